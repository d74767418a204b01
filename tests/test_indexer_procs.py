"""``mesh indexer`` as a real process: health, apply + match round trips through IndexerClient,
two brokers forwarding duplicate and reordered batches, epochs, shedding, deadlines, TLS, SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import msgpack
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh import kv_events as KV
from mesh.hashing import content_keys
from mesh.indexer import indexer_pb2 as pb
from mesh.indexer.client import IndexerClient
from mesh.lab.procs import Proc, ProcGroup, wait_for_log_event
from mesh.protocol import pack

from conftest import run, until
from test_indexer import BS, SYSTEM, FakeWorker, assert_same_matches, reference


def _cli_has_indexer() -> bool:
    from mesh.cli import build_parser

    for a in build_parser()._actions:
        if isinstance(a, argparse._SubParsersAction):
            return "indexer" in a.choices
    return False


def spawn_indexer(group: ProcGroup, name: str, *args: str, port: int = 0, timeout_s: float = 30.0) -> tuple[Proc, str]:
    """Start ``mesh indexer`` (``python -m mesh.indexer`` until mesh.cli wires the subcommand) on
    127.0.0.1:``port`` and wait for its ``indexer_listening`` line; returns (proc, endpoint)."""
    import os

    group.log_dir.mkdir(parents=True, exist_ok=True)
    log_path = group.log_dir / f"{name}.log"
    entry = ["-m", "mesh.cli", "indexer"] if _cli_has_indexer() else ["-m", "mesh.indexer"]
    with log_path.open("ab") as log:
        p = subprocess.Popen([sys.executable, *entry, "--listen", f"127.0.0.1:{port}", *args], stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc = Proc(name, p, log_path)
    group.procs.append(proc)
    rec = wait_for_log_event(log_path, "indexer_listening", timeout_s, p)
    return proc, rec["endpoint"]


@pytest.fixture(scope="module")
def shared_indexer(tmp_path_factory):
    """One indexer for the tests that use distinct worker ids."""
    group = ProcGroup(tmp_path_factory.mktemp("indexer"))
    _, endpoint = spawn_indexer(group, "indexer")
    yield endpoint
    group.stop_all()


async def _views(client: IndexerClient, workers: list[FakeWorker]) -> dict[tuple, object]:
    out = {}
    for w in workers:
        for keys in w.query_keys():
            v = await client.match(keys, BS)
            assert v is not None, client.last_degraded_reason
            out[tuple(keys)] = v
    return out


def test_health_serving_and_apply_match_round_trip(shared_indexer: str) -> None:
    async def body() -> None:
        target = shared_indexer.split("//", 1)[1]
        async with grpc.aio.insecure_channel(target) as ch:
            hs = health_pb2_grpc.HealthStub(ch)
            for service in ("", "mesh.indexer.v1.Indexer"):
                r = await hs.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
        workers = [FakeWorker(f"rt-{i}", 500 + i) for i in range(3)]
        client = IndexerClient([shared_indexer], query_timeout_ms=2000)  # no start(): opens on first use
        try:
            for w in workers:
                await client.register_worker(w.worker_id, BS)
                for _ in range(12):
                    seq, raw = w.batch()
                    if w.worker_id == "rt-1":  # what a broker has at hand: the whole KV_EVENTS body
                        raw = pack({"dp_rank": w.dp_rank, "epoch": w.epoch, "seq": seq, "ts": 1.0,
                                    "events": msgpack.unpackb(raw)})
                    client.forward(w.worker_id, w.dp_rank, w.epoch, seq, raw)
            assert await client.flush(10)
            views = await _views(client, workers)
            assert_same_matches(reference(workers), lambda keys: views[tuple(keys)], workers)
            # the same prompt given as token ids (the server computes the keys)
            stub = client.replicas[0].stub
            toks = workers[0].full_tokens[0]
            r = await stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=toks, block_size=BS), timeout=5)
            assert r.best_prefix_blocks == views[tuple(content_keys(toks, BS))].best_blocks
            st = await client.server_stats()
            assert st.workers >= 3 and st.entries > 0 and st.bytes_estimate > 0 and st.queries >= 1
            s = client.stats()
            assert s["forward_applied"] == 36 and s["forward_dropped"] == 0 and s["queries_degraded"] == {}
        finally:
            await client.aclose()

    run(body(), 40)


def test_two_brokers_duplicate_and_reordered_batches_equal_the_reference(shared_indexer: str) -> None:
    """Broker A and broker B forward the same workers' batches: every batch twice, one late and one
    lost on A's side. Duplicates are dropped, the gap asks for a resync, the worker's snapshot
    (through B) repairs the stream: the index equals applying every batch once in order."""

    async def body() -> None:
        workers = [FakeWorker(f"tb-{i}", 700 + i) for i in range(3)]
        by_id = {w.worker_id: w for w in workers}
        asked: list[tuple[str, int, str]] = []
        a = IndexerClient([shared_indexer], query_timeout_ms=2000)
        b = IndexerClient([shared_indexer], query_timeout_ms=2000, on_resync=lambda *x: asked.append(x))
        async with a, b:
            for w in workers:
                batches = [w.batch() for _ in range(6)]
                for seq, raw in batches:
                    a.forward(w.worker_id, 0, w.epoch, seq, raw)
                assert await a.flush(10)
                for seq, raw in batches:  # B forwards them again
                    b.forward(w.worker_id, 0, w.epoch, seq, raw)
                assert await b.flush(10)
                later = [w.batch() for _ in range(6)]  # seq 6..11
                b.forward(w.worker_id, 0, w.epoch, *later[2])  # 8 overtakes 6 and 7: GAP
                assert await b.flush(10)
                for seq, raw in later[:2]:  # A delivers 6, 7, then dies with 8..11
                    a.forward(w.worker_id, 0, w.epoch, seq, raw)
                assert await a.flush(10)
                for seq, raw in later[3:]:
                    b.forward(w.worker_id, 0, w.epoch, seq, raw)
                assert await b.flush(10)
            assert {(x[0], x[2]) for x in asked} == {(w.worker_id, "gap") for w in workers}
            for _round in range(3):  # the broker's RESYNC -> the worker's snapshot, through B
                todo, asked[:] = list(asked), []
                for wid, rank, _why in todo:
                    seq, raw = by_id[wid].snapshot()
                    b.forward(wid, rank, by_id[wid].epoch, seq, raw)
                assert await b.flush(10)
                if not asked:
                    break
            assert not asked
            views = await _views(a, workers)
            assert_same_matches(reference(workers), lambda keys: views[tuple(keys)], workers)
            st = await a.server_stats()
            assert st.duplicates >= 18 and st.gaps >= 3 and st.resyncs >= 3
            assert b.stats()["verdicts"].get("resynced", 0) == 3

    run(body(), 40)


def test_new_epoch_drops_the_workers_blocks(shared_indexer: str) -> None:
    async def body() -> None:
        old = [5] * (3 * BS)
        new = [6] * (2 * BS)
        async with IndexerClient([shared_indexer], query_timeout_ms=2000) as c:
            c.forward("ep-0", 0, 10, 0, pack([KV.encode_event_map(KV.BlockStored((1, 2, 3), None, tuple(old), BS))]))
            await c.flush(10)
            assert (await c.match(content_keys(old, BS), BS)).matched_blocks("ep-0") == 3
            c.forward("ep-0", 0, 11, 0, pack([KV.encode_event_map(KV.BlockStored((1, 2), None, tuple(new), BS))]))
            await c.flush(10)
            assert (await c.match(content_keys(old, BS), BS)).matched_blocks("ep-0") == 0
            assert (await c.match(content_keys(new, BS), BS)).matched_blocks("ep-0") == 2
            c.forward("ep-0", 0, 10, 1, pack([KV.encode_event_map(KV.BlockStored((9,), None, tuple(old[:BS]), BS))]))
            await c.flush(10)  # a late batch of the dead incarnation changes nothing
            assert (await c.match(content_keys(old, BS), BS)).matched_blocks("ep-0") == 0
            assert c.stats()["verdicts"]["stale_epoch"] == 1

    run(body(), 30)


def test_query_overload_is_shed_and_deadlines_hold(procs: ProcGroup) -> None:
    """Server bound 2 in flight, each query held 150 ms: a burst of 10 is shed down to 2
    (RESOURCE_EXHAUSTED, counted both sides); a 40 ms deadline returns None in ~40 ms; the
    client's own bound answers None at once."""
    _, ep = spawn_indexer(procs, "slow-indexer", "--max-inflight-queries", "2", "--fault-query-delay-ms", "150")
    keys = content_keys(SYSTEM, BS)

    async def body() -> None:
        async with IndexerClient([ep], query_timeout_ms=3000, max_inflight=64) as c:
            assert await c.match(keys, BS) is not None  # connected
            res = await asyncio.gather(*(c.match(keys, BS) for _ in range(10)))
            ok = sum(r is not None for r in res)
            shed = c.stats()["queries_degraded"].get("resource_exhausted", 0)
            assert ok >= 2 and shed >= 5 and ok + shed == 10
            st = await c.server_stats()
            assert st.queries_shed == shed
            assert c.stats()["replicas"][0]["breaker"] == "closed"  # shedding is not a failure
        async with IndexerClient([ep], query_timeout_ms=40) as c:
            await c.match(keys, BS)
            t0 = time.monotonic()
            assert await c.match(keys, BS) is None
            dt = time.monotonic() - t0
            # None for "timeout": the 40 ms bound fired, not the 150 ms answer (dt has room for a busy machine)
            assert c.last_degraded_reason == "timeout" and dt < 3.0
        async with IndexerClient([ep], query_timeout_ms=3000, max_inflight=2) as c:
            busy = [asyncio.create_task(c.match(keys, BS)) for _ in range(2)]
            await until(lambda: c.inflight == 2, 5, "two queries in flight")
            t0 = time.monotonic()
            assert await c.match(keys, BS) is None
            assert c.last_degraded_reason == "overloaded" and time.monotonic() - t0 < 1.0
            await asyncio.gather(*busy)

    run(body(), 40)


def test_sigterm_reports_not_serving_then_exits_cleanly(procs: ProcGroup) -> None:
    proc, ep = spawn_indexer(procs, "term-indexer")

    async def body() -> None:
        async with grpc.aio.insecure_channel(ep.split("//", 1)[1]) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
            seen = []
            async for r in watch:
                seen.append(r.status)
                if len(seen) == 1:
                    assert r.status == health_pb2.HealthCheckResponse.SERVING
                    proc.signal(signal.SIGTERM)
                elif r.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
            assert seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING

    run(body(), 20)
    assert proc.popen.wait(10) == 0
    wait_for_log_event(proc.log_path, "indexer_stopped", 5)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test certificate")
def test_tls_endpoint_with_a_private_ca(procs: ProcGroup, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=30)
    _, ep = spawn_indexer(procs, "tls-indexer", "--tls-cert", str(cert), "--tls-key", str(key))
    assert ep.startswith("https://")
    keys = content_keys(SYSTEM, BS)

    async def body() -> None:
        async with IndexerClient([ep], query_timeout_ms=3000, ca_file=str(cert)) as c:
            c.forward("tls-w", 0, 1, 0, pack([KV.encode_event_map(KV.BlockStored((1, 2, 3, 4), None, tuple(SYSTEM), BS))]))
            assert await c.flush(10)
            v = await c.match(keys, BS)
            assert v is not None and v.matched_blocks("tls-w") == 4
        async with IndexerClient([ep.replace("https://", "http://")], query_timeout_ms=500) as c:
            assert await c.match(keys, BS) is None  # plaintext against TLS: degraded, not raised

    run(body(), 30)
