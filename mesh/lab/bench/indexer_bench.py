"""``mesh bench indexer``: the KV indexer over gRPC, with the server as a real subprocess.

* **ingest**: 1,000 workers' KV event batches (SGLang tagged-map ``BlockStored`` events with token
  ids, 16-token pages, 8-64 blocks per event, 1-4 events per batch), pre-encoded as a broker
  receives them, forwarded through :class:`~mesh.indexer.client.IndexerClient` (two clients =
  two brokers, each forwarding half of the workers, ``ApplyKvBatches`` chunks) until the server
  holds >= 1,000,000 (block, worker) entries. Blocks per second = blocks stored / wall time from
  the first forward to the last acknowledgement. The server recomputes every content key from the
  token ids.
* **match**: sequential 512-block prompts (one query in flight), client-observed latency (the
  ``await client.match`` call) and server-side handler time (``server_time_ns`` of each answer).
  Every worker holds a conversation under system prompt 0 (so that prefix has 1,000 holders) and
  one under a Zipf-popular other system prompt; queries are 60% a worker's own conversation (deep
  hit on one worker, shallow on all), 30% a system prompt then new tokens, 10% misses.
* **bytes_per_block**: growth of the server's RSS during ingest / entries held (allocator
  overhead included), plus the index's own estimate.

Target (issue 4): >= 200,000 blocks/s; match p99 <= 1 ms server-side, <= 3 ms client-observed.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mesh.hashing import content_keys, to_signed64
from mesh.protocol import pack
from mesh.stats import percentile

__all__ = ["run_indexer_bench", "TARGETS", "start_indexer_process", "start_valkey_process", "valkey_server_binary"]

BS = 16
PROMPT_BLOCKS = 512
SYSTEM_BLOCKS = 64
N_SYSTEM = 50
TARGETS = {"ingest_blocks_per_s_min": 200_000, "match_p99_ms_server_max": 1.0, "match_p99_ms_client_max": 3.0}


def start_indexer_process(log_path: Path, *extra: str, port: int = 0, timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """Start ``mesh indexer`` (via ``python -m mesh.indexer``) and wait for ``indexer_listening``."""
    from mesh.lab.procs import wait_for_log_event

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("ab") as log:
        p = subprocess.Popen([sys.executable, "-m", "mesh.indexer", "--listen", f"127.0.0.1:{port}", *extra],
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)
    try:
        rec = wait_for_log_event(log_path, "indexer_listening", timeout_s, p)
    except BaseException:
        p.kill()
        p.wait(5)
        raise
    return p, rec["endpoint"]


def valkey_server_binary() -> str | None:
    """``valkey-server`` or ``redis-server`` on PATH (None: neither; ``make test`` installs redis-server)."""
    import shutil

    return shutil.which("valkey-server") or shutil.which("redis-server")


def start_valkey_process(workdir: Path, *extra: str, timeout_s: float = 15.0,
                         password: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start a private Valkey/Redis server on a unix socket in ``workdir`` (no persistence, no TCP
    port to collide with) and wait until it answers PING; returns (process, ``unix://`` URL)."""
    import redis

    binary = valkey_server_binary()
    if binary is None:
        raise FileNotFoundError("neither valkey-server nor redis-server is installed (make test installs redis-server)")
    sock = workdir / "valkey.sock"
    p = subprocess.Popen([binary, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700", "--save", "",
                          "--appendonly", "no", "--dir", str(workdir), "--logfile", str(workdir / "valkey.log"),
                          *(["--requirepass", password] if password else []), *extra],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                         start_new_session=True)
    url = f"unix://{sock}"
    t_end = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        if p.poll() is not None:
            raise RuntimeError(f"{binary} exited with {p.returncode}: see {workdir / 'valkey.log'}")
        try:
            if sock.exists() and redis.Redis.from_url(url, socket_timeout=1.0, password=password).ping():
                return p, url
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() >= t_end:
            p.kill()
            p.wait(5)
            raise TimeoutError(f"{binary} did not answer PING within {timeout_s:g} s")
        time.sleep(delay)  # readiness poll of a process we just started
        delay = min(0.2, delay * 2)


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _Workload:
    """Token chains per worker, their KV batches (pre-encoded) and 512-block query prompts."""

    def __init__(self, workers: int, total_blocks: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.systems = [rng.integers(1, 128_000, SYSTEM_BLOCKS * BS, dtype=np.uint32) for _ in range(N_SYSTEM)]
        per_worker = -(-total_blocks // workers)
        tail_total = per_worker - 2 * SYSTEM_BLOCKS
        zipf = np.minimum(rng.zipf(1.3, workers), N_SYSTEM - 1)
        self.convs: list[tuple[str, np.ndarray]] = []  # (worker, tokens) of every conversation
        self.batches: list[tuple[str, int, bytes]] = []  # (worker, seq, events msgpack) in publish order
        self.blocks = 0
        eh = 1
        for w in range(workers):
            wid = f"worker-{w:04d}"
            seq = 0
            t1 = tail_total // 2
            for sys_id, tail in ((0, t1), (int(zipf[w]), tail_total - t1)):
                toks = np.concatenate([self.systems[sys_id], rng.integers(1, 128_000, tail * BS, dtype=np.uint32)])
                self.convs.append((wid, toks))
                nblocks = len(toks) // BS
                parent = None
                events: list[dict] = []
                start = 0
                while start < nblocks:
                    n = min(nblocks - start, int(rng.integers(8, 65)))
                    hashes = [to_signed64(h) for h in range(eh, eh + n)]
                    eh += n
                    events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                                   "token_ids": toks[start * BS:(start + n) * BS].tolist(), "block_size": BS,
                                   "lora_id": None})
                    parent = hashes[-1]
                    start += n
                    self.blocks += n
                    if len(events) >= int(rng.integers(1, 5)) or start >= nblocks:
                        self.batches.append((wid, seq, pack(events)))
                        seq += 1
                        events = []

    def queries(self, n: int) -> list[list[int]]:
        rng = self.rng
        out = []
        for _ in range(n):
            r = rng.random()
            if r < 0.6:  # a worker's own conversation, continued
                _, toks = self.convs[int(rng.integers(len(self.convs)))]
                toks = toks[:PROMPT_BLOCKS * BS]
                if len(toks) < PROMPT_BLOCKS * BS:
                    toks = np.concatenate([toks, rng.integers(1, 128_000, PROMPT_BLOCKS * BS - len(toks), dtype=np.uint32)])
            elif r < 0.9:  # a popular system prompt, then a new question
                sys_id = min(int(rng.zipf(1.3)) - 1, N_SYSTEM - 1)
                toks = np.concatenate([self.systems[sys_id],
                                       rng.integers(1, 128_000, (PROMPT_BLOCKS - SYSTEM_BLOCKS) * BS, dtype=np.uint32)])
            else:
                toks = rng.integers(1, 128_000, PROMPT_BLOCKS * BS, dtype=np.uint32)
            out.append(content_keys(toks.tolist(), BS))
        return out


async def _ingest(endpoint: str, wl: _Workload, brokers: int) -> dict[str, Any]:
    from mesh.indexer.client import IndexerClient

    resyncs: list[tuple] = []
    clients = [IndexerClient([endpoint], forward_buffer=len(wl.batches) + 1, on_resync=lambda *a: resyncs.append(a))
               for _ in range(brokers)]
    for c in clients:
        await c.start()
    try:
        for w in sorted({b[0] for b in wl.batches}):
            await clients[hash(w) % brokers].register_worker(w, BS)
        for c in clients:
            await c.flush(30)
        gc.collect()
        t0 = time.perf_counter()
        for wid, seq, raw in wl.batches:
            clients[hash(wid) % brokers].forward(wid, 0, 1, seq, raw)
        ok = all([await c.flush(120) for c in clients])
        dt = time.perf_counter() - t0
        stats = [c.stats() for c in clients]
        server = await clients[0].server_stats(timeout_s=10)
    finally:
        for c in clients:
            await c.aclose()
    return {"seconds": dt, "flushed": ok, "resyncs": len(resyncs), "client_stats": stats, "server": server}


async def _match(endpoint: str, queries: list[list[int]]) -> dict[str, Any]:
    from mesh.indexer.client import IndexerClient

    client = IndexerClient([endpoint], query_timeout_ms=1000)
    await client.start()
    lat_c: list[float] = []
    lat_s: list[float] = []
    holders: list[int] = []
    misses = 0
    try:
        for keys in queries[:50]:  # warm the channel and the server's caches
            await client.match(keys, BS)
        gc.collect()
        gc.disable()  # a collection of the bench's own garbage is not indexer latency
        clock = time.perf_counter_ns
        for keys in queries:
            t0 = clock()
            v = await client.match(keys, BS)
            dt = clock() - t0
            if v is None:
                misses += 1
                continue
            lat_c.append(dt / 1e6)
            lat_s.append(v.server_time_ns / 1e6)
            holders.append(v.matched_workers)
        gc.enable()
    finally:
        gc.enable()
        await client.aclose()
    return {"client_ms": lat_c, "server_ms": lat_s, "holders": holders, "degraded": misses}


def _run_backend(backend: str, wl: "_Workload", qs: list[list[int]], brokers: int, tmp: Path, say: Any) -> dict[str, Any]:
    """One backend's ingest and match figures (server subprocesses in ``tmp``)."""
    extra = ["--max-entries", "0", "--log-level", "warning"]
    vproc = None
    if backend == "valkey":
        vdir = tmp / "valkey"
        vdir.mkdir()
        vproc, url = start_valkey_process(vdir)
        extra += ["--backend", "valkey", "--valkey-url", url, "--insecure-store"]  # unsigned: its clients carry no token
    out: dict[str, Any] = {"backend": backend}
    try:
        proc, endpoint = start_indexer_process(tmp / f"indexer-{backend}.log", *extra)
        try:
            rss0 = _rss_bytes(proc.pid)
            say(f"[{backend}] ingesting {len(wl.batches):,} batches over gRPC into {endpoint} ...")
            ing = asyncio.run(_ingest(endpoint, wl, brokers))
            rss1 = _rss_bytes(proc.pid)
            say(f"[{backend}] timing {len(qs):,} prefix queries ...")
            m = asyncio.run(_match(endpoint, qs))
            say(f"[{backend}] timing one-batch applies ...")
            ap = asyncio.run(_apply_latency(endpoint))
            if backend == "valkey":
                # what a replica restart costs: SIGKILL, start again, listening with the whole state
                port = int(endpoint.rsplit(":", 1)[1])
                proc.kill()
                proc.wait(10)
                say(f"[{backend}] SIGKILL + restart of the replica ...")
                t0 = time.perf_counter()
                proc, endpoint = start_indexer_process(tmp / f"indexer-{backend}-2.log", *extra, port=port,
                                                       timeout_s=120)
                out["restart_seconds"] = round(time.perf_counter() - t0, 2)
                st = asyncio.run(_server_stats(endpoint))
                out["restart_entries"] = st.entries if st is not None else 0
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    finally:
        if vproc is not None:
            vproc.kill()
            vproc.wait(5)
    srv = ing["server"]
    entries = srv.entries if srv is not None else 0
    out.update({
        "indexed_blocks": entries,
        "unique_blocks": srv.unique_blocks if srv is not None else 0,
        "ingest_seconds": round(ing["seconds"], 3),
        "ingest_blocks_per_s": round(wl.blocks / ing["seconds"]),
        "ingest_batches_per_s": round(len(wl.batches) / ing["seconds"]),
        "ingest_complete": bool(ing["flushed"]) and entries >= wl.blocks,
        "ingest_resyncs": ing["resyncs"],
        "match_queries": len(m["client_ms"]),
        "match_degraded": m["degraded"],
        "match_p50_ms_client": round(percentile(m["client_ms"], 50), 3),
        "match_p99_ms_client": round(percentile(m["client_ms"], 99), 3),
        "match_p50_ms_server": round(percentile(m["server_ms"], 50), 3),
        "match_p99_ms_server": round(percentile(m["server_ms"], 99), 3),
        "match_mean_matched_workers": round(sum(m["holders"]) / max(1, len(m["holders"])), 1),
        "apply_p50_ms": round(percentile(ap, 50), 3),
        "apply_p99_ms": round(percentile(ap, 99), 3),
        "bytes_per_block": round((rss1 - rss0) / max(1, entries), 1),
        "bytes_per_block_estimate": round(srv.bytes_estimate / max(1, entries), 1) if srv is not None else None,
        "server_rss_mb": round(rss1 / 2**20, 1),
    })
    return out


async def _apply_latency(endpoint: str, n: int = 300) -> list[float]:
    """Round trips (ms) of single ApplyKvBatch calls, one in flight, 4 blocks each: what one apply
    costs a broker (the Valkey backend adds its XADD and the log tail bringing the entry back)."""
    import grpc

    from mesh import kv_events as KV
    from mesh.indexer import indexer_pb2 as pb
    from mesh.indexer import indexer_pb2_grpc as pb_grpc

    out: list[float] = []
    async with grpc.aio.insecure_channel(endpoint.split("//", 1)[1]) as ch:
        stub = pb_grpc.IndexerStub(ch)
        for seq in range(n):
            base = 10_000_000 + seq * 4
            ev = KV.BlockStored(tuple(range(base, base + 4)), base - 1 if seq else None,
                                tuple(range(seq * 4 * BS, (seq + 1) * 4 * BS)), BS, "GPU")
            req = pb.ApplyKvBatchRequest(worker_id="bench-apply", dp_rank=0, epoch=1, seq=seq,
                                         events_msgpack=pack([KV.encode_event_map(ev)]))
            t0 = time.perf_counter()
            await stub.ApplyKvBatch(req, timeout=10)
            out.append((time.perf_counter() - t0) * 1000)
    return out[20:]  # the first ones warm the channel


async def _server_stats(endpoint: str):
    from mesh.indexer.client import IndexerClient

    async with IndexerClient([endpoint]) as c:
        return await c.server_stats(timeout_s=10)


def run_indexer_bench(workers: int = 1000, total_blocks: int = 1_050_000, queries: int = 2000, brokers: int = 2,
                      quiet: bool = False, seed: int = 0, backends: tuple[str, ...] = ("memory",)) -> dict[str, Any]:
    """Run the benchmark (server subprocess, bench process as the brokers) once per backend, on the
    same workload; returns the JSON dict: the first backend's figures at the top level (as before),
    every backend's under ``backends`` and the ratios to the first under ``vs_<first>``."""
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    say(f"generating {total_blocks:,} blocks for {workers:,} workers ...")
    wl = _Workload(workers, total_blocks, seed)
    qs = wl.queries(queries)
    per: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for b in backends:
            per[b] = _run_backend(b, wl, qs, brokers, Path(tmp), say)
    first = per[backends[0]]
    res: dict[str, Any] = {
        "workers": workers,
        "block_size": BS,
        "prompt_blocks": PROMPT_BLOCKS,
        "ingest_blocks": wl.blocks,
        "ingest_batches": len(wl.batches),
        "ingest_brokers": brokers,
        **{k: v for k, v in first.items() if k != "backend"},
        "backend": backends[0],
        "backends": per,
        "targets": TARGETS,
        "bench_seconds": None,
        # context: client p99 on a shared box is dominated by CPU contention from other processes
        "host_cpus": os.cpu_count(),
        "host_loadavg_1m_at_end": round(os.getloadavg()[0], 2),
    }
    for b in backends[1:]:
        o = per[b]
        res[f"{b}_vs_{backends[0]}"] = {
            k: round(o[k] / first[k], 3) if first[k] else None
            for k in ("ingest_blocks_per_s", "apply_p50_ms", "apply_p99_ms", "match_p50_ms_client", "match_p99_ms_client",
                      "match_p50_ms_server", "match_p99_ms_server")}
    res["targets_met"] = {
        "ingest": res["ingest_blocks_per_s"] >= TARGETS["ingest_blocks_per_s_min"],
        "match_server": res["match_p99_ms_server"] <= TARGETS["match_p99_ms_server_max"],
        "match_client": res["match_p99_ms_client"] <= TARGETS["match_p99_ms_client_max"],
    }
    res["bench_seconds"] = round(time.perf_counter() - t_start, 1)
    if not quiet:
        _print(res)
    return res


def _print(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    per = res["backends"]
    names = list(per)
    t = Table(title=f"mesh bench indexer: {res['workers']:,} workers, {res['indexed_blocks']:,} indexed blocks "
                    f"({res['block_size']}-token pages), {res['prompt_blocks']}-block prompts")
    t.add_column("measure")
    for n in names:
        t.add_column(n, justify="right")
    t.add_column("target", justify="right")

    def row(label: str, fmt: Any, target: str = "") -> None:
        t.add_row(label, *[fmt(per[n]) for n in names], target)

    row("ingest over gRPC", lambda r: f"{r['ingest_blocks_per_s']:,} blocks/s", ">= 200,000")
    row("match p50 / p99, client", lambda r: f"{r['match_p50_ms_client']:.3f} / {r['match_p99_ms_client']:.3f} ms", "p99 <= 3 ms")
    row("match p50 / p99, server", lambda r: f"{r['match_p50_ms_server']:.3f} / {r['match_p99_ms_server']:.3f} ms", "p99 <= 1 ms")
    row("one-batch apply p50 / p99 (round trip)", lambda r: f"{r['apply_p50_ms']:.3f} / {r['apply_p99_ms']:.3f} ms")
    row("matched workers per query (mean)", lambda r: f"{r['match_mean_matched_workers']}")
    row("bytes per indexed block (RSS / estimate)", lambda r: f"{r['bytes_per_block']} / {r['bytes_per_block_estimate']}")
    if any("restart_seconds" in r for r in per.values()):
        row("replica SIGKILL -> listening with the state",
            lambda r: f"{r['restart_seconds']} s, {r['restart_entries']:,} entries" if "restart_seconds" in r else "n/a")
    Console(stderr=True).print(t)


if __name__ == "__main__":  # python -m mesh.lab.bench.indexer_bench [--quick]
    import json

    quick = "--quick" in sys.argv
    out = run_indexer_bench(workers=200 if quick else 1000, total_blocks=100_000 if quick else 1_050_000,
                            queries=300 if quick else 2000,
                            backends=("memory", "valkey") if valkey_server_binary() else ("memory",))
    print(json.dumps(out, indent=2))
