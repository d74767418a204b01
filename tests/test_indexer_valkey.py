"""The Valkey backend (issue 17 part 1): indexer replicas that share one state in a real
``redis-server`` (or ``valkey-server``) this test starts, and survive a SIGKILL.

* two replicas on one Valkey: what is applied through one is matched through the other, the same
  batch through the other is a DUPLICATE, and both have the same ``server_instance``;
* the Done-when check: two brokers, simulated workers, two replicas; replica 1 is SIGKILLed under
  load and restarted: no request fails, no decision is degraded, and the restarted replica
  answers complete (same state, same instance: no resync asked) at once;
* checkpoints bound the log and a replica started later loads checkpoint + log;
* Valkey lost: mutations fail UNAVAILABLE, queries go on; Valkey back empty: the replicas follow
  the new state (a new ``server_instance``, so brokers resync into it);
* a checkpoint signed with another token is refused at startup, naming the field.

``make test`` installs redis-server when it can (root with apt-get) and then requires these tests
to run (``MESH_REQUIRE_VALKEY=1``); elsewhere they are skipped when no server binary exists.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

import grpc
import msgpack
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh import kv_events as KV
from mesh.client import Client
from mesh.hashing import content_keys
from mesh.index import ROOT_KEY
from mesh.indexer import indexer_pb2 as pb
from mesh.indexer import indexer_pb2_grpc as pb_grpc
from mesh.lab.bench.indexer_bench import start_valkey_process, valkey_server_binary
from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers

from conftest import free_port, run, until

BS = 16


@pytest.fixture
def valkey(tmp_path):
    """A private redis-server/valkey-server on a unix socket: (process, url, workdir)."""
    if valkey_server_binary() is None:
        if os.environ.get("MESH_REQUIRE_VALKEY") == "1":
            pytest.fail("redis-server is not installed but MESH_REQUIRE_VALKEY=1 (make test installs it)")
        pytest.skip("no valkey-server/redis-server on PATH (make test installs redis-server)")
    d = tmp_path / "valkey"
    d.mkdir()
    p, url = start_valkey_process(d)
    yield p, url, d
    p.kill()
    p.wait(5)


def _replica(procs, name: str, url: str, port: int = 0, *extra: str):
    # without a token the backend runs only with --insecure-store (issue 32; the signed store is
    # tested in test_indexer_valkey_signed.py)
    unsigned = () if "--token-file" in extra else ("--insecure-store",)
    p = procs.spawn(name, ["indexer", "--listen", f"127.0.0.1:{port}", "--backend", "valkey", "--valkey-url", url,
                           "--log-level", "info", *unsigned, *extra])
    rec = wait_for_log_event(p.log_path, "indexer_listening", 30, p.popen, start=p.log_start)
    return p, rec["endpoint"]


def _batch(seq: int, parent: int | None = None) -> bytes:
    ev = KV.BlockStored((5000 + seq,), parent if parent is not None else (4999 + seq if seq else None),
                        tuple(range(seq * BS, (seq + 1) * BS)), BS, "GPU")
    return msgpack.packb([KV.encode_event_map(ev)])


def _keys(n: int) -> list[int]:
    return content_keys(list(range(n * BS)), BS, ROOT_KEY)


async def _apply(stub, seq: int, worker: str = "w") -> pb.ApplyKvBatchResult:
    return await stub.ApplyKvBatch(pb.ApplyKvBatchRequest(worker_id=worker, dp_rank=0, epoch=1, seq=seq,
                                                          events_msgpack=_batch(seq)), timeout=5)


def test_two_replicas_share_one_state(procs, valkey):
    _, url, _ = valkey
    _, ep1 = _replica(procs, "r1", url)
    _, ep2 = _replica(procs, "r2", url)

    async def body():
        async with grpc.aio.insecure_channel(ep1.split("//")[1]) as ch1, \
                grpc.aio.insecure_channel(ep2.split("//")[1]) as ch2:
            s1, s2 = pb_grpc.IndexerStub(ch1), pb_grpc.IndexerStub(ch2)
            await s1.RegisterWorker(pb.RegisterWorkerRequest(worker_id="w", block_size=BS), timeout=5)
            for seq in range(4):
                assert (await _apply(s1, seq)).verdict in (pb.APPLY, pb.RESYNCED, pb.NEW_EPOCH)
            # the same batches through the other replica (a second broker forwarding them)
            assert [(await _apply(s2, seq)).verdict for seq in range(4)] == [pb.DUPLICATE] * 4

            async def deep():
                r = await s2.MatchPrefix(pb.MatchPrefixRequest(keys=_keys(4), block_size=BS), timeout=5)
                return r if r.best_prefix_blocks == 4 else None

            r = await until(deep, 10, "replica 2 sees what replica 1 applied")
            assert r.levels[0].worker_ids == ["w"] and r.uncovered_streams == 0
            st1 = await s1.Stats(pb.StatsRequest(), timeout=5)
            st2 = await s2.Stats(pb.StatsRequest(), timeout=5)
            assert st1.server_instance == st2.server_instance == r.server_instance != 0
            assert st1.backend == st2.backend == "valkey" and st1.ready and st2.ready
            # forgetting through replica 2 drops it on replica 1
            await s2.ForgetWorker(pb.ForgetWorkerRequest(worker_id="w"), timeout=5)

            async def gone():
                r = await s1.MatchPrefix(pb.MatchPrefixRequest(keys=_keys(4), block_size=BS), timeout=5)
                return r.best_prefix_blocks == 0

            await until(gone, 10, "the worker forgotten on replica 1 too")

    run(body(), 60)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


@pytest.mark.soak  # chaos/flood run: make soak
def test_replica_sigkill_under_load_costs_no_degraded_decision(procs, valkey):
    """Issue 17's Done-when: two replicas on one Valkey survive a replica SIGKILL with zero
    degraded decisions after the restart (and none during it: the other replica answers)."""
    _, url, _ = valkey
    port1 = free_port()
    r1, ep1 = _replica(procs, "r1", url, port1)
    _, ep2 = _replica(procs, "r2", url)
    extra = ["--cache-prefix-provider", "indexer", "--kv-indexer-endpoint", ep1, "--kv-indexer-endpoint", ep2,
             "--kv-indexer-query-timeout-ms", "500", "--heartbeat-ms", "200"]
    a, b = procs.broker("bA", *extra, "--metrics", "127.0.0.1:0"), procs.broker("bB", *extra)
    metrics_url = wait_for_log_event(a.log_path, "metrics_listening", 10, a.popen, start=a.log_start)["endpoint"]
    procs.workers("w", [a.backend, b.backend], "--kv-events-to", "one", "--time-scale", "0.2", count=4)
    run(wait_for_workers(a.frontend, 4))
    run(wait_for_workers(b.frontend, 4))
    system = _prompt(3, 1536)
    sent = [0]

    async def load(c: Client, n: int, seed: int) -> list:
        rng = random.Random(seed)
        tasks = []
        for _ in range(n):
            sent[0] += 1
            tasks.append(asyncio.create_task(c.generate(input_ids=system + [rng.randrange(1, 30_000) for _ in range(64)],
                                                        max_new_tokens=4, deadline_ms=30_000)))
            await asyncio.sleep(0.03)  # pacing: an arrival every 30 ms
        return await asyncio.gather(*tasks, return_exceptions=True)

    async def degraded(c: Client) -> int:
        total = 0
        for fe in (a.frontend, b.frontend):
            async with Client(fe) as one:
                total += (await one.status()).counters.get("degraded_decisions", 0)
        return total

    async def body():
        async with Client([a.frontend, b.frontend]) as c:
            warm = await load(c, 20, 1)
            assert not [x for x in warm if isinstance(x, Exception)]
            before = await degraded(c)
            task = asyncio.create_task(load(c, 60, 2))
            mark = sent[0]
            await until(lambda: sent[0] >= mark + 10, 10, "load under way")
            r1.signal(signal.SIGKILL)
            r1.popen.wait(10)
            r1b, _ = _replica(procs, "r1b", url, port1)  # same address, state from Valkey
            during = await task
            assert [x for x in during if isinstance(x, Exception)] == []
            after = await load(c, 40, 3)
            ok = [r for r in after if not isinstance(r, Exception)]
            assert len(ok) == 40
            hit = sum(r.usage["cached_tokens"] for r in ok) / sum(r.usage["prompt_tokens"] for r in ok)
            assert hit > 0.5, hit  # still cache-aware
            assert await degraded(c) == before, "a decision was degraded across the replica's SIGKILL"
            return r1b

    r1b = run(body(), 120)
    # the restarted replica loaded its state from Valkey and answered queries (it is first in list)
    replayed = wait_for_log_event(r1b.log_path, "indexer_log_replayed", 5, r1b.popen, start=r1b.log_start)
    assert replayed["entries"] > 0

    async def answered():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port1}") as ch:
            st = await pb_grpc.IndexerStub(ch).Stats(pb.StatsRequest(), timeout=5)
            return st.queries > 0 and st.entries > 0 and st.ready

    assert run(answered(), 10)
    for br in (a, b):  # no broker saw a restart, so none resynced anything
        assert "indexer_restarted" not in br.log_path.read_text()
    # the broker's /metrics shows its view of each replica: both ready, breakers closed again
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    fam = {f.name: f for f in text_string_to_metric_families(text)}["mesh_indexer_replica"]
    view = {(s.labels["endpoint"], s.labels["what"]): s.value for s in fam.samples}
    for ep in (ep1, ep2):
        assert view[(ep, "ready")] == 1.0 and view[(ep, "uncovered_streams")] == 0.0, view


def test_checkpoints_bound_the_log_and_a_late_replica_loads_one(procs, valkey):
    import redis

    _, url, _ = valkey
    r1, ep1 = _replica(procs, "r1", url, 0, "--checkpoint-every", "25")

    async def body():
        async with grpc.aio.insecure_channel(ep1.split("//")[1]) as ch:
            s = pb_grpc.IndexerStub(ch)
            for seq in range(120):
                await _apply(s, seq)
            return await s.MatchPrefix(pb.MatchPrefixRequest(keys=_keys(120), block_size=BS), timeout=5)

    want = run(body(), 60)
    assert want.best_prefix_blocks == 120
    wait_for_log_event(r1.log_path, "indexer_checkpoint_written", 10, r1.popen, start=r1.log_start)
    assert redis.Redis.from_url(url).xlen("mesh:indexer:log") < 120  # trimmed below the previous checkpoint
    late, ep3 = _replica(procs, "late", url)
    loaded = wait_for_log_event(late.log_path, "indexer_checkpoint_loaded", 5, late.popen, start=late.log_start)
    assert loaded["bytes"] > 0

    async def check():
        async with grpc.aio.insecure_channel(ep3.split("//")[1]) as ch:
            r = await pb_grpc.IndexerStub(ch).MatchPrefix(pb.MatchPrefixRequest(keys=_keys(120), block_size=BS), timeout=5)
            assert r.best_prefix_blocks == 120 and list(r.levels[0].worker_ids) == ["w"]

    run(check(), 30)


def test_a_checkpoint_of_another_version_starts_an_empty_index_that_serves(procs, valkey):
    """A rolling upgrade meets the previous version's checkpoint (another shape, classes under other
    module names): the replica must not crash-loop; it starts empty at that checkpoint, says so,
    and serves what the log brings from there."""
    import pickle

    import redis

    _, url, _ = valkey
    rc = redis.Redis.from_url(url)
    rc.xadd("mesh:indexer:log", {b"o": b"\xc1"})
    rc.hset("mesh:indexer:checkpoint", mapping={b"id": b"1-0", b"trimmed": b"0-0",
                                                b"data": pickle.dumps({"index": None, "provider": None})})
    r1, ep1 = _replica(procs, "r1", url)
    bad = wait_for_log_event(r1.log_path, "indexer_checkpoint_incompatible", 10, r1.popen, start=r1.log_start)
    assert bad["upto"] == "1-0"

    async def body():
        async with grpc.aio.insecure_channel(ep1.split("//")[1]) as ch:
            s = pb_grpc.IndexerStub(ch)
            for seq in range(3):
                await _apply(s, seq)
            return await s.MatchPrefix(pb.MatchPrefixRequest(keys=_keys(3), block_size=BS), timeout=5)

    assert run(body(), 30).best_prefix_blocks == 3
    assert r1.popen.poll() is None


def test_valkey_lost_then_back_empty(procs, valkey):
    vp, url, d = valkey
    r1, ep1 = _replica(procs, "r1", url)

    async def body():
        async with grpc.aio.insecure_channel(ep1.split("//")[1]) as ch:
            s, h = pb_grpc.IndexerStub(ch), health_pb2_grpc.HealthStub(ch)
            for seq in range(3):
                await _apply(s, seq)
            first = (await s.Stats(pb.StatsRequest(), timeout=5)).server_instance
            vp.kill()
            vp.wait(5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _apply(s, 3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "valkey" in err.value.details()
            # queries go on from the local copy
            r = await s.MatchPrefix(pb.MatchPrefixRequest(keys=_keys(3), block_size=BS), timeout=5)
            assert r.best_prefix_blocks == 3
            await until(lambda: _not_serving(h), 10, "NOT_SERVING while Valkey is gone")
            # Valkey comes back empty (no persistence): a new state; the replica follows it
            again.append(start_valkey_process(d)[0])
            await until(lambda: _instance_changed(s, first), 20, "the replica follows the new state")
            r = await s.MatchPrefix(pb.MatchPrefixRequest(keys=_keys(3), block_size=BS), timeout=5)
            assert r.best_prefix_blocks == 0  # the old copy is not served as if it were the new state
            assert (await _apply(s, 0)).verdict in (pb.APPLY, pb.RESYNCED, pb.NEW_EPOCH)
            await until(lambda: _serving(h), 10, "SERVING again")

    again: list = []
    try:
        run(body(), 60)
    finally:
        for p in again:  # the fixture stops only the first server
            p.kill()
            p.wait(5)
    assert "indexer_state_replaced" in r1.log_path.read_text()


async def _not_serving(h) -> bool:
    r = await h.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return r.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def _serving(h) -> bool:
    r = await h.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return r.status == health_pb2.HealthCheckResponse.SERVING


async def _instance_changed(s, first: int) -> bool:
    try:
        return (await s.Stats(pb.StatsRequest(), timeout=5)).server_instance != first
    except grpc.aio.AioRpcError:
        return False


def test_a_checkpoint_signed_with_another_token_is_rejected_and_the_replica_starts_without_it(procs, valkey, tmp_path):
    """Issue 32 changed this: a checkpoint that does not verify (another token, or forged) no
    longer stops a start (a forger could stop every new replica so); it is rejected, counted and
    logged naming the token, and so is every entry the other token signed."""
    _, url, _ = valkey
    t1, t2 = tmp_path / "t1", tmp_path / "t2"
    t1.write_text("token-one\n")
    t2.write_text("token-two\n")
    r1, ep1 = _replica(procs, "r1", url, 0, "--checkpoint-every", "2", "--token-file", str(t1))

    async def body():
        md = (("authorization", "Bearer token-one"),)
        async with grpc.aio.insecure_channel(ep1.split("//")[1]) as ch:
            s = pb_grpc.IndexerStub(ch)
            for seq in range(4):
                await s.ApplyKvBatch(pb.ApplyKvBatchRequest(worker_id="w", dp_rank=0, epoch=1, seq=seq,
                                                            events_msgpack=_batch(seq)), timeout=5, metadata=md)

    run(body(), 30)
    wait_for_log_event(r1.log_path, "indexer_checkpoint_written", 10, r1.popen, start=r1.log_start)
    other, ep2 = _replica(procs, "r2", url, 0, "--token-file", str(t2))
    rec = wait_for_log_event(other.log_path, "indexer_checkpoint_rejected", 10, other.popen, start=other.log_start)
    assert rec["reason"] == "bad_signature" and "token-file" in rec["note"]

    async def check():
        async with grpc.aio.insecure_channel(ep2.split("//")[1]) as ch:
            st = await pb_grpc.IndexerStub(ch).Stats(pb.StatsRequest(), timeout=5,
                                                     metadata=(("authorization", "Bearer token-two"),))
            assert st.entries == 0 and st.counters["service_checkpoints_rejected"] == 1
            assert st.store_rejected.startswith(("checkpoint", "log entry"))
            assert st.counters["service_log_bad_entries_bad_signature"] >= 1

    run(check(), 30)
    assert "Traceback" not in other.log_path.read_text()


def test_backend_flags_are_validated(procs):
    p = procs.spawn("bad", ["indexer", "--backend", "valkey"])
    assert p.popen.wait(30) != 0
    assert "valkey_url" in p.log_path.read_text()
    p = procs.spawn("bad2", ["indexer", "--backend", "valkey", "--valkey-url", "http://x"])
    assert p.popen.wait(30) != 0
    assert "valkey_url" in p.log_path.read_text()


def test_a_replica_paused_past_a_trim_reloads_the_checkpoint(procs, valkey):
    """A replica SIGSTOPped while the log was checkpointed and trimmed twice must not go on from
    its old place (XREAD would skip the trimmed entries silently): it reloads the checkpoint."""
    _, url, _ = valkey
    r1, ep1 = _replica(procs, "r1", url, 0, "--checkpoint-every", "10")
    r2, ep2 = _replica(procs, "r2", url)

    async def body():
        async with grpc.aio.insecure_channel(ep1.split("//")[1]) as ch1, \
                grpc.aio.insecure_channel(ep2.split("//")[1]) as ch2:
            s1, s2 = pb_grpc.IndexerStub(ch1), pb_grpc.IndexerStub(ch2)
            await _apply(s1, 0)

            async def seen(stub, n):
                r = await stub.MatchPrefix(pb.MatchPrefixRequest(keys=_keys(n), block_size=BS), timeout=5)
                return r.best_prefix_blocks == n

            await until(lambda: seen(s2, 1), 10, "replica 2 following")
            r2.signal(signal.SIGSTOP)
            try:
                for seq in range(1, 60):
                    await _apply(s1, seq)
                import redis

                rc = redis.Redis.from_url(url)
                await until(lambda: rc.hget("mesh:indexer:checkpoint", "trimmed") not in (None, b"0-0"), 10,
                            "a trim past replica 2's place")
            finally:
                r2.signal(signal.SIGCONT)
            await until(lambda: seen(s2, 60), 15, "replica 2 holds all 60 blocks again")
            st = await s2.Stats(pb.StatsRequest(), timeout=5)
            assert st.counters["service_checkpoint_reloads"] >= 1 and st.untrusted_streams == 0

    run(body(), 60)
    assert "indexer_tail_behind_trim" in r2.log_path.read_text()


def test_a_password_comes_from_the_environment_and_never_reaches_a_log(procs, tmp_path):
    if valkey_server_binary() is None:
        pytest.skip("no valkey-server/redis-server on PATH")
    d = tmp_path / "vk"
    d.mkdir()
    vp, url = start_valkey_process(d, password="hunter2-secret")
    try:
        bad = procs.spawn("nopass", ["indexer", "--listen", "127.0.0.1:0", "--backend", "valkey", "--valkey-url", url,
                                     "--insecure-store"])
        assert bad.popen.wait(30) == 2
        out = bad.log_path.read_text()
        assert "valkey_url" in out and "Traceback" not in out
        wrong = procs.spawn("wrong", ["indexer", "--listen", "127.0.0.1:0", "--backend", "valkey", "--valkey-url",
                                      url.replace("unix://", "unix://:hunter2-secret-not@"), "--insecure-store"])
        assert wrong.popen.wait(30) == 2 and "hunter2" not in wrong.log_path.read_text()
        procs.env["MESH_VALKEY_PASSWORD"] = "hunter2-secret"
        ok, ep = _replica(procs, "ok", url)

        async def body():
            async with grpc.aio.insecure_channel(ep.split("//")[1]) as ch:
                assert (await _apply(pb_grpc.IndexerStub(ch), 0)).verdict in (pb.APPLY, pb.RESYNCED, pb.NEW_EPOCH)

        run(body(), 30)
        assert "hunter2" not in ok.log_path.read_text()
        # issue 32: or from --valkey-password-file (the environment's is gone)
        procs.env.pop("MESH_VALKEY_PASSWORD", None)
        (tmp_path / "pw").write_text("hunter2-secret\n")
        ok, ep2 = _replica(procs, "ok-file", url, 0, "--valkey-password-file", str(tmp_path / "pw"))

        async def via_file():
            async with grpc.aio.insecure_channel(ep2.split("//")[1]) as ch:
                assert (await _apply(pb_grpc.IndexerStub(ch), 0, "w2")).verdict in (pb.APPLY, pb.RESYNCED, pb.NEW_EPOCH)

        run(via_file(), 30)
        assert "hunter2" not in ok.log_path.read_text()
    finally:
        procs.env.pop("MESH_VALKEY_PASSWORD", None)
        vp.kill()
        vp.wait(5)


def test_garbage_in_the_log_is_counted_and_skipped(procs, valkey):
    """Whoever can write to Valkey can append anything to the log: an entry that is not msgpack,
    an unknown kind or wrong arity is counted and skipped, and the replicas go on serving (and
    keep agreeing: every replica skips the same entries)."""
    import redis

    _, url, _ = valkey
    _, ep1 = _replica(procs, "r1", url)
    rc = redis.Redis.from_url(url)
    for junk in (b"\xc1not msgpack", msgpack.packb([1, "launch", "x"]), msgpack.packb([1, "apply"]), b""):
        rc.xadd("mesh:indexer:log", {b"o": junk})
    rc.xadd("mesh:indexer:log", {b"x": b"no o field"})

    async def body():
        async with grpc.aio.insecure_channel(ep1.split("//")[1]) as ch:
            s = pb_grpc.IndexerStub(ch)
            assert (await _apply(s, 0)).verdict in (pb.APPLY, pb.RESYNCED, pb.NEW_EPOCH)
            st = await s.Stats(pb.StatsRequest(), timeout=5)
            assert st.counters["service_log_bad_entries"] == 5 and st.entries == 1 and st.ready
            # a RegisterWorker naming more streams than a worker may have is refused by name
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await s.RegisterWorker(pb.RegisterWorkerRequest(worker_id="w", block_size=BS,
                                                                dp_ranks=list(range(5000))), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dp_ranks" in err.value.details()

    run(body(), 30)
    _, ep2 = _replica(procs, "late", url)  # a replica replaying the same log skips the same entries

    async def late():
        async with grpc.aio.insecure_channel(ep2.split("//")[1]) as ch:
            st = await pb_grpc.IndexerStub(ch).Stats(pb.StatsRequest(), timeout=5)
            assert st.counters["service_log_bad_entries"] == 5 and st.entries == 1

    run(late(), 30)
