"""The indexer's core: the shared index service's logic, without gRPC and without a clock.

:class:`IndexerCore` holds one :class:`mesh.index.PrefixIndex` fed through
:class:`mesh.index.ingest.KvIngest` (the event semantics the brokers' local indexes apply too).
The gRPC shell (:mod:`mesh.indexer.server`) and the Valkey log follower
(:mod:`mesh.indexer.shared`) drive it, passing the time (``now_s``, monotonic seconds) of every
mutation. Refusals are :class:`Refused` (naming the gRPC status the shell answers with) or
ValueError; verdicts are the ``indexer.proto`` enum values (:mod:`mesh.indexer.indexer_pb2`).

Per batch of a ``(worker_id, dp_rank)`` stream, :class:`IndexerCore` adds only what a shared
service needs on top:

* the verdict is reported back (APPLY, DUPLICATE, GAP, NEW_EPOCH, STALE_EPOCH, RESYNCED,
  UNTRUSTED, REJECTED) with ``resync_needed`` so the forwarding broker asks the worker for a
  snapshot. Several brokers forwarding the same batch apply it once (DUPLICATE after the first);
* a stream this server has never seen must start at ``seq`` 0 or with a snapshot
  (``AllBlocksCleared`` first); otherwise it is a GAP. That is how a restarted indexer (or one
  that forgot a worker) gets every live stream resynced instead of trusting increments on top of
  nothing;
* workers that were never registered are registered with the block size of their first
  ``BlockStored``; ``BlockStored`` events of any other size are *rejected loudly*: counted
  (``events_rejected_block_size``), logged (``indexer_block_size_mismatch``, rate-limited) and
  reported in the batch's ``events_skipped``;
* workers silent for ``worker_ttl_s`` (no batch, no RegisterWorker) are forgotten: brokers never
  forget a worker here, since another broker may still serve it.

Ownership, bounded state and ghosts: see ``Limits`` and :mod:`mesh.indexer.server`.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mesh import kv_events as KV
from mesh.stats import LatencyHistogram
from mesh.errors import CheckpointError, ConfigError, ProtocolError
from mesh.hashing import content_keys
from mesh.index import PrefixIndex, Verdict
from mesh.index.sequence import SeqState
from mesh.index.tiers import DEVICE_BIT, MAX_MEDIUMS
from mesh.index.ingest import CountingBlockSizeVote, KvIngest
from mesh.indexer import indexer_pb2 as pb
from mesh.indexer.payload import decode_payload, event_slices
from mesh.indexer.state import STATE_VERSION, WorkerRec, decode_state, encode_state
from mesh.logs import RateLimiter, get_logger
from mesh.stats import percentile

__all__ = ["IndexerCore", "ApplyOutcome", "Limits", "Refused", "REJECTED", "check_registration", "DEFAULT_MAX_ENTRIES",
           "DEFAULT_WORKER_TTL_S", "MAX_MESSAGE_BYTES", "MAX_OWNER_CHARS", "MAX_MATCH_IDS"]

#: Default entry budget: ~10 M (block, stream) entries, a few GB of Python objects at most.
DEFAULT_MAX_ENTRIES = 10_000_000
#: Workers silent this long are forgotten (0 = never).
DEFAULT_WORKER_TTL_S = 900.0
#: Default gRPC message cap (both ways). A bigger batch is refused before it is read; brokers
#: drop (and count) batches above it instead of sending them.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
#: Token ids (or block keys) one MatchPrefix may carry: the largest context a model takes (1M
#: tokens; a key per block is never more). One 8M-id query cost 14 s of handler time.
MAX_MATCH_IDS = 1 << 20
#: The longest owner id (``x-mesh-owner``) a caller may give.
MAX_OWNER_CHARS = 128
_MAX_WORKER_ID_CHARS = 256
_LATENCY_WINDOW = 8192  # recent query handler times kept for the p50/p99 in Stats

_VERDICT_PB = {
    Verdict.APPLY: pb.APPLY,
    Verdict.DUPLICATE: pb.DUPLICATE,
    Verdict.GAP: pb.GAP,
    Verdict.NEW_EPOCH: pb.NEW_EPOCH,
    Verdict.STALE_EPOCH: pb.STALE_EPOCH,
}


@dataclass(frozen=True, slots=True)
class Limits:
    """What one peer can make the server hold or do per call (``mesh indexer --help``)."""

    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_batch_events: int = 262_144
    max_workers: int = 16_384
    max_ranks_per_worker: int = 1024
    max_streams: int = 131_072
    ghost_ttl_s: float = 60.0  # 0 = ghosts are kept until the worker TTL
    owner_ttl_s: float = DEFAULT_WORKER_TTL_S  # 0 = ownership never lapses
    max_match_ids: int = MAX_MATCH_IDS  # token ids or block keys in one MatchPrefix

    def validate(self) -> None:
        for name in ("max_message_bytes", "max_batch_events", "max_workers", "max_ranks_per_worker", "max_streams",
                     "max_match_ids"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1")
        if self.max_message_bytes < 64 << 10:
            raise ConfigError("max_message_bytes: must be >= 65536")
        for name in ("ghost_ttl_s", "owner_ttl_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0 (0 = never)")


class Refused(Exception):
    """A request the server will not carry out; mapped to a gRPC status at the service boundary.

    ``status`` names that gRPC status (``RESOURCE_EXHAUSTED``, ``PERMISSION_DENIED``); ``reason``
    is also the counter name (``permission_denied``, ``refused_max_workers``, ...).
    """

    def __init__(self, status: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class _VerdictIndex(PrefixIndex):
    """A PrefixIndex that remembers the last batch verdict (apply_events does not return it)."""

    last_verdict = None

    def begin_batch(self, stream, epoch, seq):
        v = super().begin_batch(stream, epoch, seq)
        self.last_verdict = v
        return v

    def stream_entries(self, stream: tuple[str, int]) -> int:
        s = self._streams.get(stream)
        return len(s.ehmap) if s is not None else 0

    def drop_empty_stream(self, stream: tuple[str, int]) -> bool:
        """Forget one rank's sequencing state when it holds no block (ghost streams).

        PrefixIndex only forgets whole workers; a stream without entries is referenced by
        nothing but these two tables, so dropping it there is complete.
        """
        s = self._streams.get(stream)
        if s is None or s.ehmap:
            return False
        del self._streams[stream]
        s.worker.streams.pop(stream[1], None)
        return True

    def export_streams(self) -> tuple[list, list[str]]:
        """Every stream as plain lists (the state record, :mod:`mesh.indexer.state`): sequencing,
        runs parents first, tier masks; and the medium names in bit order."""
        out = []
        for (wid, rank), s in self._streams.items():
            runs = []
            todo = [r for r in s.runs if r.parent is None]
            for r in todo:  # grows while walked: breadth first, parents before their branches
                if r.ehs:
                    runs.append([None if r.parent is None else r.parent.ehs[r.poff], r.ehs, r.keys])
                todo.extend(r.branches or ())
            q = s.seq
            out.append([wid, rank, q.epoch, q.last_seq, q.max_seen, q.trusted, runs, list(s.tiers.items())])
        return out, list(self.media.mediums())

    def import_streams(self, streams: list, media: list[str]) -> None:
        """Rebuild the streams :meth:`export_streams` listed into this (empty) index; raises
        TypeError/ValueError on a malformed list (the caller discards this index then)."""
        bits = {self.media.bit(m) for m in media}
        allowed = DEVICE_BIT | sum(bits - {DEVICE_BIT})
        if len(bits - {DEVICE_BIT}) >= MAX_MEDIUMS - 1:  # full: later names share the overflow bit
            allowed |= self.media.bit("\0overflow")
        for wid, rank, epoch, last_seq, max_seen, trusted, runs, tiers in streams:
            if type(wid) is not str or type(rank) is not int:
                raise TypeError("stream: (worker id, rank) expected")
            stream = (wid, rank)
            s = self._stream(stream)
            for parent, ehs, keys in runs:
                if (parent is not None and type(parent) is not int) or not all(type(x) is int for x in (*ehs, *keys)):
                    raise TypeError(f"stream {wid}/{rank}: engine hashes and keys must be ints")
                self.store(stream, parent, ehs, keys)
            if not all(type(x) is int for x in (epoch, max_seen)) or (last_seq is not None and type(last_seq) is not int):
                raise TypeError(f"stream {wid}/{rank}: epoch and seqs must be ints")
            s.seq = SeqState(epoch, last_seq, max_seen, bool(trusted))
            for eh, mask in tiers:
                if type(eh) is not int or type(mask) is not int or mask <= 0 or mask & ~allowed:
                    raise TypeError(f"stream {wid}/{rank}: tier masks must be positive ints of known mediums")
                s.tiers[eh] = mask


@dataclass(slots=True, frozen=True)
class ApplyOutcome:
    """What happened to one batch (mirrors ``ApplyKvBatchResult``; ``refused`` = counter name
    when a bound refused it)."""

    verdict: int  # pb.Verdict value
    missed: int = 0
    resync_needed: bool = False
    events_applied: int = 0
    events_skipped: int = 0
    refused: str = ""


REJECTED = ApplyOutcome(pb.REJECTED, resync_needed=True)


def check_registration(worker_id: str, block_size: int) -> None:
    """ValueError unless a RegisterWorker's arguments are acceptable."""
    if not worker_id or len(worker_id) > _MAX_WORKER_ID_CHARS or block_size <= 0:
        raise ValueError(f"worker_id must be 1..{_MAX_WORKER_ID_CHARS} characters and block_size > 0")


def _drain(steps: Generator[None, None, ApplyOutcome]) -> ApplyOutcome:
    """Run an apply generator to completion without yielding (the synchronous path)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


class Coverage:
    """Readiness: the streams brokers told us (RegisterWorker ``dp_ranks``) they forward, and those
    of them not held trusted here (``covered``: the core's judgement, passed in). Ready (health
    SERVING) only while none is uncovered.

    Bounded like the streams themselves: per worker and over all workers (a caller naming
    streams it never sends could otherwise hold the server out of readiness without end; such a
    worker holds no block, so ghost expiry forgets it and its expectations).
    """

    def __init__(self) -> None:
        self.expected: dict[str, set[int]] = {}
        self.n_expected = 0
        self.uncovered: set[tuple[str, int]] = set()

    def is_expected(self, stream: tuple[str, int]) -> bool:
        exp = self.expected.get(stream[0])
        return exp is not None and stream[1] in exp

    def update(self, stream: tuple[str, int], covered: bool) -> None:
        if covered:
            self.uncovered.discard(stream)
        else:
            self.uncovered.add(stream)

    def expect(self, worker_id: str, dp_ranks: Sequence[int], limits: Limits,
               covered: Callable[[tuple[str, int]], bool]) -> bool:
        """Expect these streams of ``worker_id``; True when a bound refused some."""
        exp = self.expected.setdefault(worker_id, set())
        room = min(limits.max_ranks_per_worker - len(exp), limits.max_streams - self.n_expected)
        for r in dp_ranks:
            if r in exp:
                continue
            if room <= 0:
                return True
            exp.add(r)
            self.n_expected += 1
            room -= 1
            self.update((worker_id, r), covered((worker_id, r)))
        return False

    def forget(self, worker_id: str) -> None:
        """The worker is gone: none of its streams is expected any more."""
        exp = self.expected.pop(worker_id, ())
        self.n_expected -= len(exp)
        for r in exp:
            self.uncovered.discard((worker_id, r))

    def lost(self, stream: tuple[str, int]) -> None:
        """The stream's state was dropped: if expected, uncovered until a resync brings it back."""
        if self.is_expected(stream):
            self.uncovered.add(stream)

    def drop(self, stream: tuple[str, int]) -> None:
        """An empty rank nobody sends to any more: no longer expected."""
        exp = self.expected.get(stream[0])
        if exp is not None and stream[1] in exp:
            exp.discard(stream[1])
            self.n_expected -= 1
            self.uncovered.discard(stream)


class IndexerCore:
    """The service logic without gRPC: apply batches, match prompts, register/forget, stats.

    Not thread-safe: the server calls it from its one event loop. :meth:`apply_steps` is a
    generator so a big batch can be applied across several loop iterations (the caller holds the
    service's mutation lock meanwhile); :meth:`apply_batch` runs it in one go.
    """

    def __init__(self, *, max_entries: int | None = DEFAULT_MAX_ENTRIES, block_size: int = 16,
                 resync_retry_s: float = 5.0, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.limits.validate()
        self.limits_max_entries = max_entries
        self.index = _VerdictIndex(max_entries, key_fn=content_keys)
        # The routers' ingest rules; no speculation: a shared index never holds one router's guesses.
        self.ingest = KvIngest(self.index, vote=CountingBlockSizeVote(block_size))
        self.instance = int.from_bytes(os.urandom(8), "little")
        self._known: set[tuple[str, int]] = set()  # streams this server has applied a batch of
        self._w: dict[str, WorkerRec] = {}
        self._n_streams = 0
        self._ranked_streams = 0  # admitted streams with dp_rank > 0 (0 enables the fast level path)
        # Ghost candidates in first-seen order (dicts keep insertion order): expiry pops the front.
        self._ghosts: dict[str, float] = {}
        self._ghost_streams: dict[tuple[str, int], float] = {}
        # untrusted/unknown stream -> when a resync was last asked for (cleared once trusted)
        self._asked_at: dict[tuple[str, int], float] = {}
        self.resync_retry_s = resync_retry_s
        self.coverage = Coverage()
        self.c: Counter[str] = Counter()
        self.latency_ns: deque[int] = deque(maxlen=_LATENCY_WINDOW)
        self.match_hist = LatencyHistogram()  # every match's server time (Prometheus mesh_indexer_match_seconds)
        self.log = get_logger(service="indexer")
        self._rl = RateLimiter(1.0)

    @property
    def _single_rank(self) -> bool:
        return self._ranked_streams == 0

    # ------------------------------------------------------------------ admission
    def _refuse(self, reason: str, **fields: Any) -> str:
        self.c[reason] += 1
        if self._rl.allow(reason):
            self.log.warning("indexer_refused", reason=reason, **fields)
        return reason

    def _admission_refusal(self, worker_id: str, dp_rank: int | None) -> str:
        """The counter name of the bound a new worker/stream would break ("" = admissible)."""
        rec = self._w.get(worker_id)
        lim = self.limits
        if rec is None and len(self._w) >= lim.max_workers:
            return "refused_max_workers"
        if dp_rank is None or (rec is not None and dp_rank in rec.ranks):
            return ""
        if rec is not None and len(rec.ranks) >= lim.max_ranks_per_worker:
            return "refused_max_ranks"
        if self._n_streams >= lim.max_streams:
            return "refused_max_streams"
        return ""

    def _admit(self, worker_id: str, dp_rank: int | None, now: float) -> WorkerRec:
        """Create the worker/stream records (the caller checked :meth:`_admission_refusal`)."""
        rec = self._w.get(worker_id)
        if rec is None:
            rec = self._w[worker_id] = WorkerRec(first_seen=now, last_seen=now)
            self._ghosts[worker_id] = now
        if dp_rank is not None and dp_rank not in rec.ranks:
            rec.ranks.add(dp_rank)
            self._n_streams += 1
            if dp_rank:
                self._ranked_streams += 1
            if rec.active:  # a new rank of a live worker: a ghost until it holds a block
                self._ghost_streams[(worker_id, dp_rank)] = now
        return rec

    def _mark_active(self, worker_id: str, rec: WorkerRec, stream: tuple[str, int]) -> None:
        self._ghost_streams.pop(stream, None)
        if not rec.active:
            rec.active = True
            self._ghosts.pop(worker_id, None)
            for r in rec.ranks:  # the worker's other ranks are now ghosts of a live worker
                s = (worker_id, r)
                if s != stream and self.index.stream_entries(s) == 0:
                    self._ghost_streams[s] = rec.first_seen

    def _owns(self, rec: WorkerRec, owner: str, now: float) -> bool:
        """May ``owner`` change or forget this worker? (unowned or lapsed: anyone may)"""
        if not rec.owner or rec.owner == owner:
            return True
        ttl = self.limits.owner_ttl_s
        return ttl > 0 and now - rec.owner_seen > ttl

    # ------------------------------------------------------------------ apply
    def apply_batch(self, worker_id: str, dp_rank: int, epoch: int, seq: int, payload: bytes, *,
                    now_s: float, owner: str = "") -> ApplyOutcome:
        """Apply one batch. ``payload`` is msgpack: the events array, or the whole KV_EVENTS body
        (a map: its ``events`` are used).

        ``resync_needed`` is set at most once per ``resync_retry_s`` per untrusted (or unknown)
        stream, until it is trusted again (``now_s``: monotonic seconds).
        """
        return _drain(self.apply_steps(worker_id, dp_rank, epoch, seq, payload, now_s=now_s, owner=owner))

    def apply_steps(self, worker_id: str, dp_rank: int, epoch: int, seq: int, payload: bytes, *,
                    now_s: float, owner: str = "") -> Generator[None, None, ApplyOutcome]:
        """:meth:`apply_batch` as a generator: it yields (nothing) between slices of a big batch,
        where the caller may let other work run; its return value is the outcome."""
        c = self.c
        c["batches_received"] += 1
        now = now_s
        if not worker_id or len(worker_id) > _MAX_WORKER_ID_CHARS:
            c["batches_rejected"] += 1
            c["refused_worker_id"] += 1
            return ApplyOutcome(pb.REJECTED, refused="refused_worker_id")
        refusal = self._admission_refusal(worker_id, dp_rank)
        if refusal:  # cheap refusals before any decoding
            self._refuse(refusal, worker_id=worker_id[:64], dp_rank=dp_rank)
            return ApplyOutcome(pb.REJECTED, refused=refusal)
        max_events = self.limits.max_batch_events
        try:
            events, skipped = yield from decode_payload(payload, max_events)
        except ProtocolError:
            c["batches_rejected"] += 1
            return REJECTED
        if len(events) > max_events:
            reason = self._refuse("refused_batch_events", worker_id=worker_id[:64], dp_rank=dp_rank,
                                  limit=max_events)
            return ApplyOutcome(pb.REJECTED, refused=reason)
        n_skipped = 0
        for reason, n in skipped.items():
            c[f"events_skipped_{reason}"] += n
            n_skipped += n
        stream = (worker_id, dp_rank)
        rec = self._admit(worker_id, dp_rank, now)
        rec.last_seen = now
        if owner and owner == rec.owner:
            rec.owner_seen = now
        snapshot = bool(events) and type(events[0]) is KV.AllBlocksCleared
        known = stream in self._known
        if not known and seq > 0 and not snapshot:
            # Increments on top of state we never saw: ask for a snapshot, change nothing.
            c["unknown_stream_gaps"] += 1
            c["verdict_gap"] += 1
            return ApplyOutcome(pb.GAP, missed=seq, resync_needed=self._ask(stream, now), events_skipped=n_skipped)
        if rec.block_size is None:
            for ev in events:
                if type(ev) is KV.BlockStored:
                    self._set_block_size(worker_id, rec, ev.block_size)
                    c["auto_registered"] += 1
                    break
        ix = self.index
        was_trusted = ix.is_trusted(stream)
        ix.last_verdict = None
        rejected = [0]  # stores of the wrong block size taken out, filled in as slices are made

        def reject(got: int) -> None:
            rejected[0] += 1
            self._reject_block_size(worker_id, rec.block_size, got)

        slices = event_slices(events, rec.block_size, reject)
        first = next(slices, [])
        self.ingest.apply_events(worker_id, dp_rank, epoch, seq, first, now)
        v = ix.last_verdict
        if v is None:  # the resync path: a snapshot re-trusted an untrusted stream
            verdict, applied, missed = pb.RESYNCED, True, 0
        else:
            verdict, applied, missed = _VERDICT_PB[v.verdict], v.apply, v.missed
        if applied:
            bs = rec.block_size if rec.block_size is not None else self.ingest.block_size
            for piece in slices:
                yield
                # the batch's later slices (the sequencing verdict above covers the whole batch)
                self.ingest.apply(stream, piece, bs)
        rejected_bs = rejected[0]
        if applied:
            if v is not None:
                if snapshot and (not known or not was_trusted):
                    verdict = pb.RESYNCED
                elif not ix.is_trusted(stream):
                    verdict = pb.UNTRUSTED  # applied, but a hole before it is still unfilled
            if not rec.active and ix.stream_entries(stream):
                self._mark_active(worker_id, rec, stream)
            elif stream in self._ghost_streams and ix.stream_entries(stream):
                del self._ghost_streams[stream]
        if ix.is_trusted(stream):
            ask = False
            self._asked_at.pop(stream, None)
        else:
            if snapshot and not applied:
                # The snapshot we asked for came behind a hole (sequence-wise): ask again now;
                # the next one finds the stream untrusted and re-trusts it.
                self._asked_at.pop(stream, None)
            ask = self._ask(stream, now)
        n_applied = len(events) - rejected_bs if applied else 0
        out = ApplyOutcome(verdict, missed=missed, resync_needed=ask, events_applied=n_applied,
                           events_skipped=n_skipped + rejected_bs)
        if applied:
            self._known.add(stream)
            c["events_applied"] += n_applied
        if self.coverage.is_expected(stream):
            self.coverage.update(stream, self.covered(stream))
        c[f"verdict_{pb.Verdict.Name(verdict).lower()}"] += 1
        return out

    # ------------------------------------------------------------------ state (shared backends)
    #: What a checkpoint holds: everything the verdicts depend on (not counters, not latencies).
    _STATE = ("index", "ingest", "_known", "_w", "_n_streams", "_ranked_streams", "_ghosts", "_ghost_streams",
              "_asked_at", "coverage")

    #: The version of the state record (:mod:`mesh.indexer.state`); another version's is refused.
    STATE_VERSION = STATE_VERSION

    def dump_state(self) -> bytes:
        """The whole index state as an explicit msgpack record (:mod:`mesh.indexer.state`; no
        pickle), signed by :mod:`mesh.indexer.shared` before it leaves the process."""
        return encode_state({k: getattr(self, k) for k in self._STATE})

    def load_state(self, blob: bytes) -> None:
        """Replace the state with one :meth:`dump_state` made (this server's limits stay). A
        record of another version, or malformed, raises :class:`CheckpointError` and changes nothing."""
        fresh = IndexerCore(max_entries=None, block_size=self.ingest.vote.default,
                            resync_retry_s=self.resync_retry_s, limits=self.limits)
        parts = decode_state(blob, {k: getattr(fresh, k) for k in self._STATE})
        for k in self._STATE:
            setattr(self, k, parts[k])
        self.index.set_max_entries(self.limits_max_entries)

    def reset_state(self) -> None:
        """Forget everything (the shared state this server followed was replaced)."""
        fresh = IndexerCore(max_entries=self.limits_max_entries, block_size=self.ingest.vote.default,
                            resync_retry_s=self.resync_retry_s, limits=self.limits)
        for k in self._STATE:
            setattr(self, k, getattr(fresh, k))

    # ------------------------------------------------------------------ coverage
    def covered(self, stream: tuple[str, int]) -> bool:
        """Does this server hold ``stream`` trusted (a batch applied, no hole since)?"""
        return stream in self._known and self.index.is_trusted(stream)

    @property
    def ghosts(self) -> tuple[int, int]:
        """(ghost workers, ghost streams): admitted, never a block in the index yet."""
        return len(self._ghosts), len(self._ghost_streams)

    @property
    def uncovered_streams(self) -> int:
        """Expected streams (see :meth:`register_worker`) not held trusted: 0 = complete."""
        return len(self.coverage.uncovered)

    def uncovered(self, limit: int = 16) -> list[tuple[str, int]]:
        """Some uncovered streams, sorted (for logs and tests)."""
        return sorted(self.coverage.uncovered)[:limit]

    def _reject_block_size(self, worker_id: str, expected: int, got: int) -> None:
        self.c["events_rejected_block_size"] += 1
        if self._rl.allow(("block_size", worker_id)):
            self.log.warning("indexer_block_size_mismatch", worker_id=worker_id[:64], registered=expected, got=got,
                             note="events of another block size are not indexed; re-register the worker to reset it")

    def _ask(self, stream: tuple[str, int], now: float) -> bool:
        """Ask for a resync of an untrusted stream at most once per ``resync_retry_s``."""
        last = self._asked_at.get(stream)
        if last is not None and now - last < self.resync_retry_s:
            return False
        if len(self._asked_at) >= 100_000:
            self._asked_at.clear()  # bounded: garbage stream ids cannot grow it forever
        self._asked_at[stream] = now
        self.c["resyncs_asked"] += 1
        return True

    def _set_block_size(self, worker_id: str, rec: WorkerRec, block_size: int) -> None:
        rec.block_size = block_size
        self.ingest.add_worker(worker_id, block_size)

    # ------------------------------------------------------------------ register / forget
    def register_worker(self, worker_id: str, block_size: int, *, now_s: float, owner: str = "",
                        dp_ranks: Sequence[int] = ()) -> None:
        """Declare a worker's page size; the first named caller becomes its owner.

        ``dp_ranks``: the worker's streams the caller forwards. Until each is held trusted here
        the server is not ready (:attr:`uncovered_streams`): after a restart the brokers'
        re-registrations tell it what it must get back before its answers are complete.

        Raises ValueError (bad arguments) or :class:`Refused` (a bound; another owner changing
        the block size). The owner re-registering another block size resets the worker.
        """
        check_registration(worker_id, block_size)
        now = now_s
        rec = self._w.get(worker_id)
        if rec is None:
            refusal = self._admission_refusal(worker_id, None)
            if refusal:
                self._refuse(refusal, worker_id=worker_id[:64])
                raise Refused("RESOURCE_EXHAUSTED", refusal,
                              f"more than {self.limits.max_workers} workers")
            rec = self._admit(worker_id, None, now)
        elif rec.block_size is not None and rec.block_size != block_size:
            if not self._owns(rec, owner, now):
                self._deny("register", worker_id, owner, rec)
                raise Refused("PERMISSION_DENIED", "permission_denied",
                              f"worker {worker_id!r} is registered by another owner with block size {rec.block_size}")
            self._reset_worker(worker_id, rec, block_size)
        if owner and owner != rec.owner and self._owns(rec, owner, now):
            self.c["owner_taken_over" if rec.owner else "owner_bound"] += 1
            rec.owner = owner
        if owner and owner == rec.owner:
            rec.owner_seen = now
        if rec.block_size != block_size:
            self._set_block_size(worker_id, rec, block_size)
        rec.last_seen = now
        if dp_ranks:
            if self.coverage.expect(worker_id, dp_ranks, self.limits, self.covered):
                self.c["expected_ranks_refused"] += 1
        self.c["workers_registered"] += 1

    def _reset_worker(self, worker_id: str, rec: WorkerRec, block_size: int) -> None:
        """The owner changed the worker's block size: drop its blocks and streams (a resync follows)."""
        dropped = self.index.worker_entries(worker_id)
        old = rec.block_size
        self._drop_streams(worker_id, rec)
        self.index.remove_worker(worker_id)
        self.c["block_size_resets"] += 1
        self.log.warning("indexer_block_size_reset", worker_id=worker_id[:64], old=old, new=block_size,
                         entries_dropped=dropped)

    def _drop_streams(self, worker_id: str, rec: WorkerRec) -> None:
        for r in rec.ranks:
            s = (worker_id, r)
            self._known.discard(s)
            self.coverage.lost(s)
            self._asked_at.pop(s, None)
            self._ghost_streams.pop(s, None)
            if r:
                self._ranked_streams -= 1
        self._n_streams -= len(rec.ranks)
        rec.ranks = set()
        if rec.active:  # its future ranks start as ghosts again until they hold a block
            rec.active = False
            rec.first_seen = rec.last_seen
            self._ghosts[worker_id] = rec.first_seen

    def forget_worker(self, worker_id: str, *, now_s: float, owner: str | None = None) -> int:
        """Drop every block and the sequencing state of a worker; returns entries dropped.

        ``owner`` None = the server itself (expiry); otherwise only the worker's owner may (or
        anyone once it is unowned / its ownership lapsed): :class:`Refused` PERMISSION_DENIED.
        """
        rec = self._w.get(worker_id)
        if rec is not None and owner is not None:
            if not self._owns(rec, owner, now_s):
                self._deny("forget", worker_id, owner, rec)
                raise Refused("PERMISSION_DENIED", "permission_denied",
                              f"worker {worker_id!r} belongs to another owner")
        n = self.index.worker_entries(worker_id)
        self.ingest.remove_worker(worker_id)
        if rec is not None:
            self._drop_streams(worker_id, rec)
            del self._w[worker_id]
            self._ghosts.pop(worker_id, None)
        self.coverage.forget(worker_id)
        self.c["workers_forgotten"] += 1
        return n

    def _deny(self, what: str, worker_id: str, owner: str, rec: WorkerRec) -> None:
        self.c["permission_denied"] += 1
        self.c[f"permission_denied_{what}"] += 1
        if self._rl.allow(("denied", what, owner)):
            self.log.warning("indexer_permission_denied", action=what, worker_id=worker_id[:64],
                             caller=owner[:MAX_OWNER_CHARS] or "(anonymous)", owner=rec.owner)

    # ------------------------------------------------------------------ expiry
    def expire_workers(self, now_s: float, ttl_s: float, *, limit: int | None = None) -> list[str]:
        """Forget workers not heard from (no batch, no RegisterWorker) for ``ttl_s``.

        Brokers never forget a worker here (another broker may still serve it), so this bounds
        what dead workers keep. An idle live worker that is expired comes back through the
        unknown-stream GAP -> resync path on its next batch. ``limit``: at most that many.
        """
        gone = [w for w, r in self._w.items() if now_s - r.last_seen > ttl_s]
        if limit is not None:
            gone = gone[:limit]
        for w in gone:
            self.forget_worker(w, now_s=now_s)
            self.c["workers_expired"] += 1
        return gone

    def expire_ghosts(self, now_s: float, ttl_s: float | None = None, *, limit: int | None = None) -> int:
        """Drop ghosts first seen more than ``ttl_s`` (default ``limits.ghost_ttl_s``) ago: workers
        that never got a block into the index, and such ranks of live workers. O(expired)."""
        ttl = self.limits.ghost_ttl_s if ttl_s is None else ttl_s
        budget = limit if limit is not None else 1 << 62
        n = 0
        ghosts = self._ghosts
        while ghosts and n < budget:
            w, t = next(iter(ghosts.items()))
            if now_s - t <= ttl:
                break
            rec = self._w.get(w)
            if rec is None or rec.active:  # stale entry
                del ghosts[w]
                continue
            self.forget_worker(w, now_s=now_s)
            self.c["ghosts_expired"] += 1
            n += 1
        gs = self._ghost_streams
        while gs and n < budget:
            s, t = next(iter(gs.items()))
            if now_s - t <= ttl:
                break
            del gs[s]
            rec = self._w.get(s[0])
            if rec is None or s[1] not in rec.ranks or self.index.stream_entries(s):
                continue
            self.index.drop_empty_stream(s)
            rec.ranks.discard(s[1])
            self._n_streams -= 1
            if s[1]:
                self._ranked_streams -= 1
            self._known.discard(s)
            self._asked_at.pop(s, None)
            self.coverage.drop(s)
            self.c["ghost_streams_expired"] += 1
            n += 1
        return n

    # ------------------------------------------------------------------ match
    def match(self, keys: Sequence[int], max_results: int = 0) -> pb.MatchPrefixResponse:
        """Per-worker prefix match as a response message (server_time_ns left to the caller).

        ``max_results`` > 0 keeps only the deepest that many workers (``matched_workers`` still
        counts them all).
        """
        return _match_response(self.index.match(keys), len(keys), max_results, self._single_rank)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        s = self.ingest.stats()
        c = self.c
        lat = sorted(self.latency_ns)
        lim = self.limits
        return {
            **s,
            "service": dict(c),
            "server_instance": self.instance,
            "known_streams": len(self._known),
            "expected_streams": self.coverage.n_expected,
            "uncovered_streams": len(self.coverage.uncovered),
            "tracked_workers": len(self._w),
            "tracked_streams": self._n_streams,
            "ghost_workers": len(self._ghosts),
            "ghost_streams": len(self._ghost_streams),
            "limit_max_workers": lim.max_workers,
            "limit_max_streams": lim.max_streams,
            "limit_max_ranks_per_worker": lim.max_ranks_per_worker,
            "limit_max_batch_events": lim.max_batch_events,
            "limit_max_message_bytes": lim.max_message_bytes,
            "match_p50_us": percentile(lat, 50, presorted=True) / 1000.0,  # ns -> us; 0.0 with no samples
            "match_p99_us": percentile(lat, 99, presorted=True) / 1000.0,
        }


def _match_response(m: Any, n_keys: int, max_results: int, single_rank: bool) -> pb.MatchPrefixResponse:
    """A MatchResult of ``n_keys`` query blocks as a MatchPrefixResponse (see :meth:`IndexerCore.match`)."""
    resp = pb.MatchPrefixResponse(query_blocks=n_keys, blocks_read=n_keys)
    if m.empty:
        return resp
    resp.best_prefix_blocks = m.best_blocks
    matched = 0
    room = max_results if max_results > 0 else -1
    levels = resp.levels
    tiered = getattr(m, "tiered", False)
    for depth, ids, ranks in _depth_groups(m, single_rank):
        matched += len(ids)
        if room == 0:
            continue
        if 0 < room < len(ids):
            ids, ranks = ids[:room], ranks[:room]
        lvl = levels.add(matched_blocks=depth)
        lvl.worker_ids.extend(ids)
        lvl.dp_ranks.extend(ranks)
        if tiered:
            _add_tiers(lvl, m, ids)
        if room > 0:
            room -= len(ids)
    resp.matched_workers = matched
    return resp


def _add_tiers(lvl: Any, m: Any, ids: list[str]) -> None:
    """The level's ``host_blocks`` / ``store_blocks`` (left empty when all its workers' matches
    are on the device)."""
    tiers = [m.lower_tier_blocks(w) for w in ids]
    if any(h or s for h, s in tiers):
        lvl.host_blocks.extend(h for h, _ in tiers)
        lvl.store_blocks.extend(s for _, s in tiers)


def _depth_groups(m: Any, single_rank: bool):
    """``(depth, sorted worker ids, their dp ranks)`` per level of a MatchResult, deepest first.

    The public ``MatchResult.levels()`` builds a WorkerMatch per worker (~0.2 ms for a prefix with
    1,000 holders). When every stream is rank 0 (one stream per worker, so a level's new members
    are a C-level difference of two holder-key views), the levels are read directly: ~50 us.
    Any other shape takes the generic path.
    """
    ed = getattr(m, "_ed", None)
    eh = getattr(m, "_eh", None)
    if single_rank and ed is not None and eh is not None and not getattr(m, "_sd", None):
        m._check()  # same staleness guard as the public accessors
        deeper: Any = ()
        for i in range(len(ed) - 1, -1, -1):
            h = eh[i]
            streams = h.keys() if type(h) is dict else {h.stream}
            new = streams - deeper if deeper else streams
            deeper = streams
            if new:
                ids = [s.worker.worker_id for s in new]
                ids.sort()
                yield ed[i], ids, [0] * len(ids)
        return
    for depth, wms in m.levels():
        yield depth, [w.worker_id for w in wms], [w.dp_rank or 0 for w in wms]
