"""The indexer client when the indexer dies: fast degraded answers, circuit breaker, recovery
after a restart on the same port (with resyncs), replica failover, forward overflow -> resync."""

from __future__ import annotations

import signal
import time

from mesh.indexer.client import IndexerClient
from mesh.lab.procs import ProcGroup

from conftest import run, until
from test_indexer import BS, FakeWorker, reference
from test_indexer_procs import spawn_indexer


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


async def _until(pred, timeout_s: float, step_s: float = 0.05):
    """conftest's ``until``, None on timeout (the caller's assert then shows the client's stats)."""
    try:
        return await until(pred, timeout_s, step_s=step_s)
    except TimeoutError:
        return None


def test_killed_indexer_costs_no_latency_and_is_used_again_after_restart(procs: ProcGroup) -> None:
    proc, ep = spawn_indexer(procs, "indexer-1")
    w = FakeWorker("kill-w", 11)
    asked: list[tuple] = []

    async def body() -> None:
        nonlocal proc
        c = IndexerClient([ep], query_timeout_ms=100, breaker_failures=3, breaker_reset_s=0.5,
                          on_resync=lambda *a: asked.append(a))
        async with c:
            for _ in range(6):
                seq, raw = w.batch()
                c.forward(w.worker_id, 0, w.epoch, seq, raw)
            assert await c.flush(10)
            keys = max(w.query_keys(), key=len)
            depth = (await c.match(keys, BS)).matched_blocks(w.worker_id)
            assert depth > 0

            proc.signal(signal.SIGKILL)
            proc.popen.wait(5)
            times, reasons = [], []
            for _ in range(8):
                t0 = time.monotonic()
                assert await c.match(keys, BS) is None
                times.append(time.monotonic() - t0)
                reasons.append(c.last_degraded_reason)
            assert max(times) < 0.06, times  # connection refused: far below the 100 ms deadline
            assert reasons[:3] == ["unavailable"] * 3 and set(reasons[3:]) == {"breaker_open"}
            assert max(times[3:]) < 0.002  # breaker open: no RPC at all
            assert c.stats()["replicas"][0]["breaker"] == "open"

            proc, _ = spawn_indexer(procs, "indexer-2", port=_port(ep))  # same port, empty index

            async def answered():
                return await c.match(keys, BS)

            assert await _until(answered, 10), c.stats()
            # The restarted indexer knows nothing: the worker's next batch (seq > 0 on an unknown
            # stream) asks for a resync; the snapshot makes it cache-aware again.
            seq, raw = w.batch()
            c.forward(w.worker_id, 0, w.epoch, seq, raw)
            assert await c.flush(10)
            assert (w.worker_id, 0) in {(a[0], a[1]) for a in asked}
            seq, raw = w.snapshot()
            c.forward(w.worker_id, 0, w.epoch, seq, raw)
            assert await c.flush(10)

            async def cache_aware_again():
                v = await c.match(keys, BS)
                return v is not None and v.matched_blocks(w.worker_id) == depth

            assert await _until(cache_aware_again, 5)
            assert c.stats()["replicas"][0]["breaker"] == "closed"

    run(body(), 50)


def test_queries_fail_over_to_the_next_replica(procs: ProcGroup) -> None:
    p1, ep1 = spawn_indexer(procs, "replica-1")
    _, ep2 = spawn_indexer(procs, "replica-2")
    w = FakeWorker("rep-w", 12)

    async def body() -> None:
        async with IndexerClient([ep1, ep2], query_timeout_ms=200, breaker_failures=2) as c:
            for _ in range(5):
                seq, raw = w.batch()
                c.forward(w.worker_id, 0, w.epoch, seq, raw)  # every replica gets a full copy
            assert await c.flush(10)
            keys = max(w.query_keys(), key=len)
            v = await c.match(keys, BS)
            assert v.replica == ep1 and v.matched_blocks(w.worker_id) > 0
            p1.signal(signal.SIGKILL)
            p1.popen.wait(5)
            for _ in range(5):
                v = await c.match(keys, BS)
                assert v is not None and v.replica == ep2 and v.matched_blocks(w.worker_id) > 0
            # Queries may never try the dead replica again (once ep2's round trip is measured, a
            # slow first query to ep1 on a busy machine orders it last): forwards go to every
            # replica, so their failures open its breaker whichever way the queries went.
            seq, raw = w.batch()
            c.forward(w.worker_id, 0, w.epoch, seq, raw)
            await until(lambda: c.stats()["replicas"][0]["breaker"] == "open", 10, "the dead replica's breaker opens")
            assert c.stats()["queries_degraded"] == {}

    run(body(), 30)


def test_forward_overflow_is_counted_and_turns_into_a_resync(procs: ProcGroup) -> None:
    proc, ep = spawn_indexer(procs, "ovf-1")
    proc.signal(signal.SIGKILL)
    proc.popen.wait(5)
    w = FakeWorker("ovf-w", 13)
    asked: list[tuple] = []

    async def body() -> None:
        c = IndexerClient([ep], forward_buffer=4, breaker_failures=2, breaker_reset_s=0.3,
                          on_resync=lambda *a: asked.append(a))
        async with c:
            for _ in range(10):
                seq, raw = w.batch()
                c.forward(w.worker_id, 0, w.epoch, seq, raw)  # indexer down: 4 queued, 6 dropped
            s = c.stats()
            assert s["forward_dropped"] == 6 and s["forward_queued"] == 4 and not asked
            # the forwarder retries, gives up, waits on the breaker; nothing queued is lost meanwhile
            await until(lambda: c.stats()["forward_give_ups"] >= 1, 10, "a forward give-up")
            assert c.stats()["forward_queued"] == 4
            spawn_indexer(procs, "ovf-2", port=_port(ep))

            async def resynced():
                return bool(asked)

            assert await _until(resynced, 10), c.stats()
            assert asked[0] == (w.worker_id, 0, "overflow")
            assert c.stats()["forward_applied"] == 4  # the buffered batches were kept, not dropped
            seq, raw = w.snapshot()
            c.forward(w.worker_id, 0, w.epoch, seq, raw)
            assert await c.flush(10)
            keys = max(w.query_keys(), key=len)
            want = reference([w]).match(keys, touch=False).matched_blocks(w.worker_id)
            assert (await c.match(keys, BS)).matched_blocks(w.worker_id) == want
            assert len(asked) == 1  # one resync, not one per dropped batch

    run(body(), 40)
