"""The KV event backlog: workers' KV_EVENTS handed to the index, budgeted by blocks per worker
(pure: no I/O; its only clock is the work budget the shell hands :meth:`KvBacklog.run`).

KV work is measured in **blocks** (:func:`mesh.protocol.kv_block_count`: a batch of a few huge
events costs what its blocks cost, issue 32) and shared **per worker**, so one worker's batches
cost the others nothing beyond their share:

* a batch of at most :data:`KV_SLICE_BLOCKS` blocks from a worker with nothing queued, still
  within its :data:`KV_TURN_BLOCKS` for this loop turn, is applied at once; any other is
  queued on its worker's queue and applied by :meth:`KvBacklog.run` in slices of at most
  ``KV_SLICE_BLOCKS`` blocks, round robin across workers, each worker at most
  ``KV_TURN_BLOCKS`` blocks per turn (per stream order kept: a worker's later batches queue
  behind its queued ones);
* a worker whose queue holds :data:`KV_WORKER_QUEUE_BLOCKS` blocks is over budget: its next
  batches are dropped before they are even decoded (:meth:`KvBacklog.admit`, counted
  ``kv.over_budget_dropped``) and, once its queue has drained, it is asked to resync the streams
  it sent meanwhile (the gap the drop left would ask anyway; counted ``kv.resync_requested``).
  All queues together hold at most :data:`KV_QUEUE_BLOCKS` blocks (``kv.backlog_dropped``).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any, Callable

from mesh import protocol as P
from mesh.broker_core.counters import BrokerStats
from mesh.broker_core.pool import WorkerPool, WorkerSession
from mesh.broker_core.sends import Outbox
from mesh.logs import RateLimiter

__all__ = ["KvBacklog", "KV_SLICE_BLOCKS", "KV_TURN_BLOCKS", "KV_WORKER_QUEUE_BLOCKS", "KV_QUEUE_BLOCKS"]

KV_SLICE_BLOCKS = 1024  # blocks applied in one go (~3 ms of index work)
KV_TURN_BLOCKS = 4096  # blocks one worker may have applied per loop turn (run)
KV_WORKER_QUEUE_BLOCKS = 2 * P.MAX_KV_BATCH_BLOCKS  # a worker's queue beyond which its batches are dropped
KV_QUEUE_BLOCKS = 400_000  # all workers' queues together

_Entry = tuple[bytes, int, Any]  # (identity, blocks, slice generator)


class KvBacklog:
    """KV_EVENTS to the index (``kv_sink``), budgeted per worker by blocks (module doc)."""

    def __init__(self, kv_sink: Any, pool: WorkerPool, stats: BrokerStats, log: Any, limiter: RateLimiter,
                 outbox: Outbox) -> None:
        self.kv_sink = kv_sink
        self.pool = pool
        self.stats = stats
        self.log = log
        self._limiter = limiter
        self._out = outbox
        # worker id -> its queued batches; truthy while any batch waits (the core exposes it as
        # ``kv_backlog`` for the shell). Insertion order is the round robin's order.
        self.queue: dict[str, deque[_Entry]] = {}
        self._queued_blocks: Counter[str] = Counter()  # queued blocks per worker
        self._total_blocks = 0
        self._turn_blocks: Counter[str] = Counter()  # blocks applied per worker this turn
        self._dropped: dict[str, tuple[bytes, int]] = {}  # over budget: identity, dp_size (ranks to resync)

    # ------------------------------------------------------------------ intake

    def admit(self, sess: WorkerSession, now: float) -> bool:
        """May ``sess`` hand in another KV batch now? False (counted, logged at a limited rate):
        its queue is over budget, so the batch is dropped without being decoded, and a resync
        of its streams follows once the queue drained."""
        if self._queued_blocks[sess.worker_id] < KV_WORKER_QUEUE_BLOCKS:
            return True
        self.stats.kv["over_budget_dropped"] += 1
        self._dropped[sess.worker_id] = (sess.identity, sess.ready.dp_size)
        if self._limiter.allow(("kv_over_budget", sess.worker_id), now):
            self.log.warning("kv_batch_over_budget", worker_id=sess.worker_id, queued_blocks=self._queued_blocks[sess.worker_id])
        return False

    def on_kv_events(self, sess: WorkerSession, m: P.KvEventsMsg, now: float) -> None:
        self.stats.kv["batches"] += 1
        if self.kv_sink is None:
            return
        wid = sess.worker_id
        slices = getattr(self.kv_sink, "kv_slices", None)
        blocks = m.blocks or P.kv_block_count(m.events)
        if slices is None or (wid not in self.queue and blocks <= KV_SLICE_BLOCKS
                              and self._turn_blocks[wid] + blocks <= KV_TURN_BLOCKS):
            self._turn_blocks[wid] += blocks
            for dp_rank, why in self.kv_sink.on_kv_events(wid, m, now):
                self.resync(sess.identity, dp_rank, why)
            return
        # Queued: applied in slices by run, bounded in memory. A dropped batch leaves a sequence
        # gap, which the index turns into a resync request.
        if self._total_blocks + blocks > KV_QUEUE_BLOCKS:
            self.stats.kv["backlog_dropped"] += 1
            if self._limiter.allow(("kv_backlog_full", wid), now):
                self.log.warning("kv_batch_dropped", worker_id=wid, blocks=blocks, queued_blocks=self._total_blocks)
            return
        self.stats.kv["backlog_queued"] += 1
        self._queued_blocks[wid] += blocks
        self._total_blocks += blocks
        self.queue.setdefault(wid, deque()).append((sess.identity, blocks, slices(wid, m, now, KV_SLICE_BLOCKS)))

    # ------------------------------------------------------------------ the work

    def run(self, clock: Callable[[], float], budget_s: float) -> None:
        """One loop turn: apply queued slices round robin across workers, each worker at most
        ``KV_TURN_BLOCKS`` blocks (less what it had applied at once this turn), until
        ``clock()`` has advanced ``budget_s`` (the shell's work budget per pump: the only clock
        this core is handed). Then the turn's budgets start again."""
        end = clock() + budget_s
        for wid in list(self.queue):
            if clock() >= end:
                break
            self._run_worker(wid, clock, end)
            q = self.queue.pop(wid, None)
            if q:
                self.queue[wid] = q  # to the back of the round robin
        self._turn_blocks.clear()
        self._resync_dropped()

    def _run_worker(self, wid: str, clock: Callable[[], float], end: float) -> None:
        q = self.queue[wid]
        turn = self._turn_blocks
        while q and turn[wid] < KV_TURN_BLOCKS and clock() < end:
            ident, n, gen = q[0]
            try:
                turn[wid] += next(gen)
                continue
            except StopIteration as done:
                resyncs = done.value or []
            except Exception as exc:  # the index must never take the loop down
                resyncs = []
                self.stats.dropped["handler_exception"] += 1
                self.log.exception("kv_apply_failed", worker_id=wid, error=repr(exc))
            q.popleft()
            self._total_blocks -= n
            left = self._queued_blocks[wid] - n
            if left > 0:
                self._queued_blocks[wid] = left
            else:
                del self._queued_blocks[wid]
            if self.pool.by_identity.get(ident) is not None:
                for dp_rank, why in resyncs:
                    self.resync(ident, dp_rank, why)

    def _resync_dropped(self) -> None:
        """Workers whose batches were dropped over budget and whose queue has drained: ask them
        for their streams' full state (drop-and-resync)."""
        for wid in [w for w in self._dropped if w not in self.queue]:
            ident, dp_size = self._dropped.pop(wid)
            if self.pool.by_identity.get(ident) is not None:
                for rank in range(dp_size):
                    self.resync(ident, rank, "over_budget")

    def resync(self, identity: bytes, dp_rank: int, why: str) -> None:
        """Ask a worker for its full KV state again."""
        self.stats.kv["resync_requested"] += 1
        self._out.to_worker(identity, P.encode_resync(dp_rank, why))
