"""The KV event backlog: workers' KV_EVENTS handed to the index, large batches in slices (pure:
no I/O; its only clock is the work budget the shell hands :meth:`KvBacklog.run`).

A KV_EVENTS batch larger than :data:`KV_SLICE_EVENTS` events is applied in slices (a 4 MB batch
is ~0.3 s of index work); while any is queued, later batches queue behind it (order per stream).
The queue is bounded in events, in all and per worker: a dropped batch leaves a sequence gap,
which the index turns into a resync request.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any, Callable

from mesh import protocol as P
from mesh.broker_core.counters import BrokerStats
from mesh.broker_core.pool import WorkerPool, WorkerSession
from mesh.broker_core.sends import Outbox
from mesh.logs import RateLimiter

__all__ = ["KvBacklog", "KV_SLICE_EVENTS"]

KV_SLICE_EVENTS = 1024
_KV_BACKLOG_MAX_EVENTS = 200_000  # queued events at most (all workers); beyond, batches are dropped
_KV_BACKLOG_MAX_WORKER_EVENTS = 40_000  # ... and per worker (one flooding worker cannot fill it)


class KvBacklog:
    """KV_EVENTS to the index (``kv_sink``), and the bounded queue of large batches."""

    def __init__(self, kv_sink: Any, pool: WorkerPool, stats: BrokerStats, log: Any, limiter: RateLimiter,
                 outbox: Outbox) -> None:
        self.kv_sink = kv_sink
        self.pool = pool
        self.stats = stats
        self.log = log
        self._limiter = limiter
        self._out = outbox
        self.queue: deque[tuple[str, bytes, int, Any]] = deque()  # (worker_id, identity, events, slice generator)
        self._queued_events: Counter[str] = Counter()  # queued events per worker

    def on_kv_events(self, sess: WorkerSession, m: P.KvEventsMsg, now: float) -> None:
        self.stats.kv["batches"] += 1
        if self.kv_sink is None:
            return
        slices = getattr(self.kv_sink, "kv_slices", None)
        if slices is None or (not self.queue and len(m.events) <= KV_SLICE_EVENTS):
            for dp_rank, why in self.kv_sink.on_kv_events(sess.worker_id, m, now):
                self.resync(sess.identity, dp_rank, why)
            return
        # Large (or behind a large one): applied in slices by run, bounded in memory.
        # A dropped batch leaves a sequence gap, which the index turns into a resync request.
        n = len(m.events)
        queued = sum(self._queued_events.values())
        if queued + n > _KV_BACKLOG_MAX_EVENTS or self._queued_events[sess.worker_id] + n > _KV_BACKLOG_MAX_WORKER_EVENTS:
            self.stats.kv["backlog_dropped"] += 1
            if self._limiter.allow(("kv_backlog_full", sess.worker_id), now):
                self.log.warning("kv_batch_dropped", worker_id=sess.worker_id, events=n, queued=queued)
            return
        self.stats.kv["backlog_queued"] += 1
        self._queued_events[sess.worker_id] += n
        self.queue.append((sess.worker_id, sess.identity, n, slices(sess.worker_id, m, now, KV_SLICE_EVENTS)))

    def run(self, clock: Callable[[], float], budget_s: float) -> None:
        """Apply queued KV batches slice by slice until ``clock()`` has advanced ``budget_s``
        (the shell's work budget per pump: the only clock this core is handed)."""
        end = clock() + budget_s
        bl = self.queue
        while bl and clock() < end:
            wid, ident, n, gen = bl[0]
            try:
                next(gen)
                continue
            except StopIteration as done:
                resyncs = done.value or []
            except Exception as exc:  # the index must never take the loop down
                resyncs = []
                self.stats.dropped["handler_exception"] += 1
                self.log.exception("kv_apply_failed", worker_id=wid, error=repr(exc))
            bl.popleft()
            left = self._queued_events[wid] - n
            if left > 0:
                self._queued_events[wid] = left
            else:
                del self._queued_events[wid]
            if self.pool.by_identity.get(ident) is not None:
                for dp_rank, why in resyncs:
                    self.resync(ident, dp_rank, why)

    def resync(self, identity: bytes, dp_rank: int, why: str) -> None:
        """Ask a worker for its full KV state again."""
        self.stats.kv["resync_requested"] += 1
        self._out.to_worker(identity, P.encode_resync(dp_rank, why))
