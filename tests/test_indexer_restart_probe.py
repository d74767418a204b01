"""Readiness (issue 17 part 2): a broker's indexer client notices a restarted indexer without
waiting for traffic (re-registers its workers, resyncs every stream), and keeps idle live workers
registered past the indexer's expiry. A real `mesh indexer` process, SIGKILLed and restarted."""

from __future__ import annotations

import signal

import msgpack

from mesh import kv_events as KV
from mesh.indexer.client import IndexerClient
from mesh.lab.procs import wait_for_log_event

from conftest import free_port, run, until


def _batch(seq: int) -> bytes:
    ev = KV.BlockStored((1000 + seq,), 999 + seq if seq else None, tuple(range(16)), 16, "GPU")
    return msgpack.packb([KV.encode_event_map(ev)])


def _indexer(procs, name: str, port: int, *extra: str):
    p = procs.spawn(name, ["indexer", "--listen", f"127.0.0.1:{port}", *extra])
    return p, wait_for_log_event(p.log_path, "indexer_listening", 30, p.popen, start=p.log_start)["endpoint"]


def test_a_restarted_indexer_is_resynced_without_traffic(procs):
    port = free_port()
    p, ep = _indexer(procs, "idx", port)
    asked: list[tuple[str, int, str]] = []

    async def body():
        async with IndexerClient([ep], query_timeout_ms=2000, on_resync=lambda *a: asked.append(a), probe_interval_s=0.2) as c:
            await c.register_worker("w", 16)
            for seq in range(3):
                c.forward("w", 0, 1, seq, _batch(seq))
            assert await c.flush(10)
            await until(lambda: c.stats()["counters"].get("probes", 0) >= 1, 10, "the probe saw the indexer")
            assert (await c.fetch_stats()).counters["tracked_workers"] == 1
            p.popen.send_signal(signal.SIGKILL)  # the replica dies with its state...
            p.popen.wait(10)
            _indexer(procs, "idx2", port)  # ...and comes back empty on the same address
            # no batch is forwarded from here on: the probe alone must notice and act
            await until(lambda: ("w", 0, "indexer_restarted") in asked, 15, "resync asked after the restart")
            assert c.stats()["counters"]["indexer_restarts_seen"] == 1
            await until(lambda: _workers(c), 10, "the live worker registered again on the new replica")

    run(body(), 60)


async def _workers(c: IndexerClient) -> bool:
    return (await c.fetch_stats()).counters["tracked_workers"] >= 1


def test_an_idle_live_worker_is_never_expired(procs):
    _, ep = _indexer(procs, "idx", 0, "--worker-ttl-s", "1")

    async def body():
        async with IndexerClient([ep], query_timeout_ms=2000, probe_interval_s=0.1, keepalive_s=0.3) as c:
            await c.register_worker("idle", 16)
            await until(lambda: _workers(c), 10, "registered")
            t_end = asyncio_time() + 3.0  # three expiry periods with no batch at all
            while asyncio_time() < t_end:
                assert await _workers(c), "the indexer forgot a live worker"
                await until(lambda: True, 0.2)
            assert c.stats()["counters"]["keepalives"] >= 3
            await c.forget_worker("idle")  # a worker that is gone is forgotten at once
            await until(lambda: _no_workers(c), 10, "forgotten")

    run(body(), 60)


def asyncio_time() -> float:
    import time

    return time.monotonic()


async def _no_workers(c: IndexerClient) -> bool:
    return (await c.fetch_stats()).counters["tracked_workers"] == 0


def test_queries_prefer_ready_replicas_and_flag_incomplete_coverage(procs):
    pa, pb_ = free_port(), free_port()
    a, ep_a = _indexer(procs, "a", pa)
    b, ep_b = _indexer(procs, "b", pb_)
    keys = [1000, 1001]

    async def body():
        async with IndexerClient([ep_a, ep_b], query_timeout_ms=2000, probe_interval_s=0.2, resync_holdoff_s=5.0) as c:
            await c.register_worker("w", 16)
            for seq in range(2):
                c.forward("w", 0, 1, seq, _batch(seq))
            assert await c.flush(10)
            await until(lambda: c.stats()["counters"].get("probes", 0) >= 2, 10, "both replicas probed")
            a.popen.send_signal(signal.SIGKILL)
            a.popen.wait(10)
            _indexer(procs, "a2", pa)  # replica a is back, empty
            await until(lambda: c.stats()["counters"].get("indexer_restarts_seen", 0) >= 1, 15, "restart seen")
            v = await c.match(keys, 16)
            assert v is not None and v.replica == ep_b and not v.incomplete  # the ready replica answers
            b.popen.send_signal(signal.SIGKILL)  # only the recovering one is left
            b.popen.wait(10)
            v = await c.match(keys, 16)
            assert v is not None and v.replica == ep_a and v.incomplete
            assert c.stats()["counters"]["queries_incomplete_coverage"] >= 1

    run(body(), 60)


def test_a_decision_on_incomplete_coverage_is_degraded():
    from mesh.indexer import indexer_pb2 as pb
    from mesh.indexer.client import MatchView
    from mesh.routing.router import Router, make_policy
    from mesh.routing.view import RouteRequest, WorkerState

    class Provider:  # answers what a recovering replica would: a valid, possibly partial view
        name = "indexer"

        def __init__(self, incomplete: bool) -> None:
            self.incomplete = incomplete

        def match(self, req, now_s):
            return MatchView(pb.MatchPrefixResponse(), "http://x", incomplete=self.incomplete)

        def on_routed(self, req, worker_id, now_s):
            pass

    pool = [WorkerState("w0"), WorkerState("w1")]
    for incomplete in (False, True):
        r = Router(make_policy("cache_aware"), Provider(incomplete))
        d = r.route(RouteRequest("r", 64, tokens=list(range(64))), pool, 0.0)
        assert d.worker_id is not None and d.degraded is incomplete


def test_coverage_follows_registrations_batches_gaps_and_forgets():
    """The server's own readiness (pure core): a stream a broker says it forwards is uncovered
    until a batch of it is applied in order; a hole uncovers it again; forgetting the worker (or
    a bound) ends the expectation, so nobody can hold the server out of readiness for good."""
    from mesh.indexer.core import IndexerCore, Limits

    core = IndexerCore(limits=Limits(max_streams=3))
    core.register_worker("w", 16, dp_ranks=[0, 1], now_s=0.0)
    assert core.uncovered_streams == 2 and core.uncovered() == [("w", 0), ("w", 1)]
    core.apply_batch("w", 0, 1, 0, _batch(0), now_s=1.0)
    assert core.uncovered() == [("w", 1)]
    core.apply_batch("w", 1, 1, 0, _batch(0), now_s=1.0)
    assert core.uncovered_streams == 0
    core.apply_batch("w", 1, 1, 5, _batch(5), now_s=2.0)  # seq 1-4 missing: untrusted again
    assert core.uncovered() == [("w", 1)]
    core.register_worker("x", 16, dp_ranks=[0, 1, 2], now_s=2.0)  # over max_streams in all: capped
    assert core.stats()["expected_streams"] == 3 and core.c["expected_ranks_refused"] == 1
    core.forget_worker("w", now_s=3.0)
    core.forget_worker("x", now_s=3.0)
    assert core.uncovered_streams == 0 and core.stats()["expected_streams"] == 0
    # a checkpoint of the state keeps the expectations (the Valkey backend's restart)
    core.register_worker("y", 16, dp_ranks=[0], now_s=3.0)
    other = IndexerCore()
    other.load_state(core.dump_state())
    assert other.uncovered() == [("y", 0)]


class _StubReplica:
    """A replica's gRPC stub, in process: ApplyKvBatches can be held in flight, and the instance
    the replica reports (its restarts) is set by the test."""

    def __init__(self) -> None:
        import asyncio

        from mesh.indexer import indexer_pb2 as pb

        self.pb = pb
        self.instance = 1
        self.hold = asyncio.Event()
        self.hold.set()
        self.in_flight = asyncio.Event()
        self.registered: list[str] = []
        self.applied: list[int] = []

    async def ApplyKvBatches(self, req, timeout=None, metadata=None):
        self.in_flight.set()
        await self.hold.wait()
        self.applied.extend(b.seq for b in req.batches)
        res = [self.pb.ApplyKvBatchResult(verdict=self.pb.APPLY) for _ in req.batches]
        return self.pb.ApplyKvBatchesResponse(results=res, server_instance=self.instance)

    async def RegisterWorker(self, req, timeout=None, metadata=None):
        self.registered.append(req.worker_id)
        return self.pb.RegisterWorkerResponse()

    async def Stats(self, req, timeout=None, metadata=None):
        return self.pb.StatsResponse(server_instance=self.instance)


def test_a_replica_restarted_while_a_chunk_is_in_flight_becomes_ready_again():
    """Issue 30 (b): the restart was seen (by the probe) while a chunk was still at the head of
    the queue; the re-registrations and their end marker went in front of it, and popping the sent
    chunk removed them instead: the replica stayed "re-registering" (not ready) for good."""

    async def body():
        async with IndexerClient(["http://127.0.0.1:1"], query_timeout_ms=2000, probe_interval_s=0.05, keepalive_s=0) as c:
            stub = _StubReplica()
            rep = c.replicas[0]
            rep.stub = stub
            await c.register_worker("w", 16)
            c.forward("w", 0, 1, 0, _batch(0))
            assert await c.flush(5)
            await until(lambda: rep.instance == 1, 5, "the replica's instance learned")
            stub.hold.clear()
            stub.in_flight.clear()
            for seq in (1, 2, 3):  # one chunk of three batches
                c.forward("w", 0, 1, seq, _batch(seq))
            await until(lambda: stub.in_flight.is_set(), 5, "the chunk in flight")
            stub.instance = 2  # the replica restarted meanwhile...
            await until(lambda: c.stats()["counters"].get("indexer_restarts_seen", 0) == 1, 5, "...and the probe saw it")
            stub.hold.set()
            assert await c.flush(5)
            assert stub.applied == [0, 1, 2, 3] and stub.registered == ["w", "w"]  # the chunk once, then the registration
            await until(lambda: c.stats()["replicas"][0]["ready"], 5, "the replica ready again")

    run(body(), 30)
