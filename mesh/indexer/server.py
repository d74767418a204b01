"""The KV indexer service (``mesh indexer --listen HOST:PORT``): one prefix index shared by brokers.

A thin gRPC shell (``grpc.aio``, one event loop, so no locks) around the same index code the
brokers and the simulator use: :class:`mesh.index.PrefixIndex` fed through
:meth:`mesh.index.ingest.KvIngest.apply_events` (one implementation of the event semantics:
sequencing, resync snapshots, epochs, block-size checks, content keys from token ids).

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

Hostile or broken peers (see ``Limits``):

* **authentication**: with a token configured, every Indexer RPC must carry
  ``authorization: Bearer <token>`` (compared with ``hmac.compare_digest``); otherwise
  UNAUTHENTICATED, counted as ``auth_failures``. ``grpc.health.v1`` stays open. Optional TLS
  client certificates (``tls_client_ca``) on top. Without a token the server logs
  ``indexer_unauthenticated`` at startup and accepts everyone, as before;
* **ownership**: a worker's registration belongs to the caller that first registered it (the
  ``x-mesh-owner`` metadata value, e.g. the broker id). Another owner may re-register the same
  block size (a second broker serving the worker) but may not change it nor ForgetWorker it:
  PERMISSION_DENIED, counted as ``permission_denied``. The owner changing the block size is an
  explicit reset (the worker's blocks and streams are dropped; ``block_size_resets``). Ownership
  lapses after ``owner_ttl_s`` without the owner registering or forwarding for that worker (a
  broker that went away for good). Owner ids are asserted by token holders: they separate
  well-behaved brokers, they do not authenticate them individually;
* **bounded work per call**: gRPC refuses messages above ``max_message_bytes``
  (RESOURCE_EXHAUSTED before any handler runs); a batch of more than ``max_batch_events`` events
  is refused; an allowed big batch is decoded and applied in slices, yielding to the event loop
  every ``_APPLY_SLICE_NS`` so concurrent MatchPrefix calls keep their deadlines. Mutations
  (apply, register, forget, expiry) hold one asyncio lock, so a batch stays atomic for the other
  mutators while queries interleave with it;
* **bounded state**: at most ``max_workers`` workers, ``max_ranks_per_worker`` streams per worker
  and ``max_streams`` streams in all (more: RESOURCE_EXHAUSTED for RegisterWorker/ApplyKvBatch, a
  REJECTED verdict inside ApplyKvBatches; ``refused_*`` counters). *Ghosts* -- workers and streams
  that never got a block into the index -- are dropped ``ghost_ttl_s`` after they first appeared
  (``ghosts_expired``, ``ghost_streams_expired``), and no per-batch cost grows with their number.

Overload: only ``MatchPrefix`` is shed (``RESOURCE_EXHAUSTED`` once ``max_inflight_queries`` are
admitted and unanswered; each admitted query yields to the loop once before running, so a burst
that arrives together is counted together). Apply RPCs are never shed.
Memory: the index holds at most ``max_entries`` (block, stream) entries (LRU eviction).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import os
import pickle
import signal
import time
from collections import Counter, deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import grpc
import msgpack
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mesh import kv_events as KV
from mesh.broker_core.counters import LatencyHistogram
from mesh.errors import ConfigError, ProtocolError
from mesh.hashing import content_keys
from mesh.index import PrefixIndex, Verdict
from mesh.index.ingest import CountingBlockSizeVote, KvIngest
from mesh.indexer import indexer_pb2 as pb
from mesh.indexer import indexer_pb2_grpc as pb_grpc
from mesh.indexer.client import OWNER_METADATA, read_token_file
from mesh.logs import RateLimiter, announce, configure, get_logger
from mesh.namespaces import namespace_root_key
from mesh.protocol import unpack
from mesh.stats import percentile

__all__ = ["IndexerCore", "IndexerService", "ApplyOutcome", "Limits", "Refused", "serve", "run_server",
           "parse_listen", "read_token_file", "DEFAULT_MAX_ENTRIES", "DEFAULT_WORKER_TTL_S", "SERVICE_NAME",
           "MAX_MESSAGE_BYTES", "OWNER_METADATA", "TOKEN_ENV"]

SERVICE_NAME = "mesh.indexer.v1.Indexer"
#: Default entry budget: ~10 M (block, stream) entries, a few GB of Python objects at most.
DEFAULT_MAX_ENTRIES = 10_000_000
#: Workers silent this long are forgotten (0 = never).
DEFAULT_WORKER_TTL_S = 900.0
#: Default gRPC message cap (both ways). A bigger batch is refused before it is read; brokers
#: drop (and count) batches above it instead of sending them.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
# OWNER_METADATA, the metadata key naming the caller (a broker id) for worker ownership, is
# defined once, in mesh.indexer.client (which must not import the server).
#: Environment variable holding the bearer token when no --token-file is given.
TOKEN_ENV = "MESH_INDEXER_TOKEN"
_MAX_OWNER_CHARS = 128
_MAX_WORKER_ID_CHARS = 256
_APPLY_SLICE_NS = 4_000_000  # yield to queries after this much apply work in one RPC
# The yield is a real (short) sleep, not sleep(0): the loop then blocks in its poll and releases
# the GIL, so gRPC's completion-queue thread can hand over the queries that arrived meanwhile.
# With sleep(0) each query hop waited for the interpreter's 5 ms switch interval: a match during
# a big apply took ~25 ms (p99 ~80 ms) instead of ~5 ms. Cost: ~1/9 of apply throughput.
_YIELD_S = 0.0005
_SLICED_DECODE_BYTES = 128 << 10  # payloads above this are unpacked event by event, with yields
_DECODE_SLICE_EVENTS = 256  # events unpacked + decoded between two chances to yield
_APPLY_SLICE_BLOCKS = 256  # blocks applied between two chances to yield
_SPLIT_STORE_BLOCKS = 1024  # a BlockStored longer than this is applied as parent-linked pieces
_EXPIRE_SLICE = 256  # workers/streams expired between two yields
_LATENCY_WINDOW = 8192  # recent query handler times kept for the p50/p99 in Stats
_HEALTH_PREFIX = "/grpc.health.v1.Health/"

_VERDICT_PB = {
    Verdict.APPLY: pb.APPLY,
    Verdict.DUPLICATE: pb.DUPLICATE,
    Verdict.GAP: pb.GAP,
    Verdict.NEW_EPOCH: pb.NEW_EPOCH,
    Verdict.STALE_EPOCH: pb.STALE_EPOCH,
}
_ARRAY_HEADERS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_MAP_HEADERS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


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

    def validate(self) -> None:
        for name in ("max_message_bytes", "max_batch_events", "max_workers", "max_ranks_per_worker", "max_streams"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1")
        if self.max_message_bytes < 64 << 10:
            raise ConfigError("max_message_bytes: must be >= 65536")
        for name in ("ghost_ttl_s", "owner_ttl_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0 (0 = never)")


class Refused(Exception):
    """A request the server will not carry out; mapped to a gRPC status at the service boundary.

    ``reason`` is also the counter name (``permission_denied``, ``refused_max_workers``, ...).
    """

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
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


@dataclass(slots=True, eq=False)
class _WorkerRec:
    """What the service knows about one worker besides its index entries."""

    first_seen: float
    last_seen: float
    block_size: int | None = None  # None: neither registered nor seen storing a block
    owner: str = ""  # "" = unowned (auto-registered from events, or registered anonymously)
    owner_seen: float = 0.0  # last registration/forward of this worker by its owner
    ranks: set[int] = field(default_factory=set)  # streams admitted (counted against the bounds)
    active: bool = False  # some batch got a block into the index: not a ghost


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


_REJECTED = ApplyOutcome(pb.REJECTED, resync_needed=True)


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


def _events_value_offset(payload: bytes) -> int | None:
    """Offset of the (last) ``events`` value of a msgpack map, None without one. Raises on bad msgpack."""
    u = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(payload))
    u.feed(payload)
    pos = None
    for _ in range(u.read_map_header()):
        if u.unpack() == "events":
            pos = u.tell()
        u.skip()
    if u.tell() != len(payload):
        raise ValueError("extra data after the body")
    return pos


def _raw_event_chunks(payload: bytes, n: int) -> Iterator[list[Any] | None]:
    """Unpack a big payload (events array, or a KV_EVENTS map with ``events``) lazily: lists of at
    most ``n`` undecoded events; one ``None`` when there is no events array (a bad_batch).
    Raises ProtocolError(bad_msgpack) like :func:`mesh.protocol.unpack`."""
    try:
        first = payload[0]
        if first in _MAP_HEADERS:
            start = _events_value_offset(payload)
            whole = False
        elif first in _ARRAY_HEADERS:
            start, whole = 0, True
        else:
            unpack(payload)  # a scalar: must still be valid msgpack to count as a bad_batch
            start = None
        if start is None or payload[start] not in _ARRAY_HEADERS:
            yield None  # no events array: decode_events would call it a bad_batch
            return
        u = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(payload))
        u.feed(memoryview(payload)[start:])
        buf: list[Any] = []
        for _ in range(u.read_array_header()):
            buf.append(u.unpack())
            if len(buf) >= n:
                yield buf
                buf = []
        if buf:
            yield buf
        if whole and u.tell() != len(payload):
            raise ValueError("extra data after the events array")
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several non-UnpackException types
        raise ProtocolError("bad_msgpack", f"{type(exc).__name__}: {exc}") from exc


def _split_store(ev: KV.BlockStored, n: int) -> list[KV.BlockStored]:
    """One long BlockStored as parent-linked pieces of ``n`` blocks (the same chain, stored in steps)."""
    hs, toks, bs = ev.block_hashes, ev.token_ids, ev.block_size
    out = []
    parent = ev.parent_block_hash
    for i in range(0, len(hs), n):
        piece = hs[i:i + n]
        last = i + n >= len(hs)
        out.append(dataclasses.replace(ev, block_hashes=piece, parent_block_hash=parent,
                                       token_ids=toks[i * bs:(i + len(piece)) * bs],
                                       lookahead_token_id=ev.lookahead_token_id if last else None,
                                       unmatched_blocks=ev.unmatched_blocks if last else 0))
        parent = piece[-1]
    return out


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
        self._w: dict[str, _WorkerRec] = {}
        self._n_streams = 0
        self._ranked_streams = 0  # admitted streams with dp_rank > 0 (0 enables the fast level path)
        # Ghost candidates in first-seen order (dicts keep insertion order): expiry pops the front.
        self._ghosts: dict[str, float] = {}
        self._ghost_streams: dict[tuple[str, int], float] = {}
        # untrusted/unknown stream -> when a resync was last asked for (cleared once trusted)
        self._asked_at: dict[tuple[str, int], float] = {}
        self.resync_retry_s = resync_retry_s
        # Coverage: the streams brokers told us (RegisterWorker dp_ranks) they forward, and those of
        # them not held trusted here. Ready (health SERVING) only while the second set is empty.
        self._expected: dict[str, set[int]] = {}
        self._n_expected = 0
        self._uncovered: set[tuple[str, int]] = set()
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

    def _admit(self, worker_id: str, dp_rank: int | None, now: float) -> _WorkerRec:
        """Create the worker/stream records (the caller checked :meth:`_admission_refusal`)."""
        rec = self._w.get(worker_id)
        if rec is None:
            rec = self._w[worker_id] = _WorkerRec(first_seen=now, last_seen=now)
            self._ghosts[worker_id] = now
        if dp_rank is not None and dp_rank not in rec.ranks:
            rec.ranks.add(dp_rank)
            self._n_streams += 1
            if dp_rank:
                self._ranked_streams += 1
            if rec.active:  # a new rank of a live worker: a ghost until it holds a block
                self._ghost_streams[(worker_id, dp_rank)] = now
        return rec

    def _mark_active(self, worker_id: str, rec: _WorkerRec, stream: tuple[str, int]) -> None:
        self._ghost_streams.pop(stream, None)
        if not rec.active:
            rec.active = True
            self._ghosts.pop(worker_id, None)
            for r in rec.ranks:  # the worker's other ranks are now ghosts of a live worker
                s = (worker_id, r)
                if s != stream and self.index.stream_entries(s) == 0:
                    self._ghost_streams[s] = rec.first_seen

    def _owns(self, rec: _WorkerRec, owner: str, now: float) -> bool:
        """May ``owner`` change or forget this worker? (unowned or lapsed: anyone may)"""
        if not rec.owner or rec.owner == owner:
            return True
        ttl = self.limits.owner_ttl_s
        return ttl > 0 and now - rec.owner_seen > ttl

    # ------------------------------------------------------------------ apply
    def apply_batch(self, worker_id: str, dp_rank: int, epoch: int, seq: int, payload: bytes, *,
                    now_s: float | None = None, owner: str = "") -> ApplyOutcome:
        """Apply one batch. ``payload`` is msgpack: the events array, or the whole KV_EVENTS body
        (a map: its ``events`` are used).

        ``resync_needed`` is set at most once per ``resync_retry_s`` per untrusted (or unknown)
        stream, until it is trusted again (``now_s``: monotonic seconds, default now).
        """
        return _drain(self.apply_steps(worker_id, dp_rank, epoch, seq, payload, now_s=now_s, owner=owner))

    def apply_steps(self, worker_id: str, dp_rank: int, epoch: int, seq: int, payload: bytes, *,
                    now_s: float | None = None, owner: str = "") -> Generator[None, None, ApplyOutcome]:
        """:meth:`apply_batch` as a generator: it yields (nothing) between slices of a big batch,
        where the caller may let other work run; its return value is the outcome."""
        c = self.c
        c["batches_received"] += 1
        now = time.monotonic() if now_s is None else now_s
        if not worker_id or len(worker_id) > _MAX_WORKER_ID_CHARS:
            c["batches_rejected"] += 1
            c["refused_worker_id"] += 1
            return ApplyOutcome(pb.REJECTED, refused="refused_worker_id")
        refusal = self._admission_refusal(worker_id, dp_rank)
        if refusal:  # cheap refusals before any decoding
            self._refuse(refusal, worker_id=worker_id[:64], dp_rank=dp_rank)
            return ApplyOutcome(pb.REJECTED, refused=refusal)
        max_events = self.limits.max_batch_events
        skipped: Counter[str] = Counter()
        if len(payload) <= _SLICED_DECODE_BYTES:
            try:
                obj = unpack(payload)
            except ProtocolError:
                c["batches_rejected"] += 1
                return _REJECTED
            if type(obj) is dict:  # a whole KV_EVENTS body
                obj = obj.get("events")
            events, sk = KV.decode_events(obj)
            skipped.update(sk)
        else:
            events = []
            try:
                for chunk in _raw_event_chunks(payload, _DECODE_SLICE_EVENTS):
                    if chunk is None:
                        skipped["bad_batch"] += 1
                        break
                    evs, sk = KV.decode_events(chunk)
                    events.extend(evs)
                    skipped.update(sk)
                    if len(events) > max_events:
                        break
                    yield
            except ProtocolError:
                c["batches_rejected"] += 1
                return _REJECTED
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
        slices = self._slices(worker_id, rec, events, rejected)
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
        exp = self._expected.get(worker_id)
        if exp is not None and dp_rank in exp:
            self._cover(stream)
        c[f"verdict_{pb.Verdict.Name(verdict).lower()}"] += 1
        return out

    # ------------------------------------------------------------------ state (shared backends)
    #: What a checkpoint holds: everything the verdicts depend on (not counters, not latencies).
    _STATE = ("index", "ingest", "_known", "_w", "_n_streams", "_ranked_streams", "_ghosts", "_ghost_streams",
              "_asked_at", "_expected", "_n_expected", "_uncovered")

    def dump_state(self) -> bytes:
        """The whole index state as bytes (pickle: only ever loaded from a store this service
        trusts, and signed by :mod:`mesh.indexer.shared` before it leaves the process)."""
        return pickle.dumps({k: getattr(self, k) for k in self._STATE}, protocol=5)

    def load_state(self, blob: bytes) -> None:
        """Replace the state with one :meth:`dump_state` made (this server's limits stay)."""
        st = pickle.loads(blob)  # noqa: S301 -- signed checkpoint of our own state (see dump_state)
        for k in self._STATE:
            setattr(self, k, st[k])
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

    def _cover(self, stream: tuple[str, int]) -> None:
        if self.covered(stream):
            self._uncovered.discard(stream)
        else:
            self._uncovered.add(stream)

    @property
    def uncovered_streams(self) -> int:
        """Expected streams (see :meth:`register_worker`) not held trusted: 0 = complete."""
        return len(self._uncovered)

    def uncovered(self, limit: int = 16) -> list[tuple[str, int]]:
        """Some uncovered streams, sorted (for logs and tests)."""
        return sorted(self._uncovered)[:limit]

    def _expect(self, worker_id: str, dp_ranks: Sequence[int]) -> None:
        """Bounded like the streams themselves: per worker and over all workers (a caller naming
        streams it never sends could otherwise hold the server out of readiness without end;
        such a worker holds no block, so ghost expiry forgets it and its expectations)."""
        exp = self._expected.setdefault(worker_id, set())
        room = min(self.limits.max_ranks_per_worker - len(exp), self.limits.max_streams - self._n_expected)
        for r in dp_ranks:
            if r in exp:
                continue
            if room <= 0:
                self.c["expected_ranks_refused"] += 1
                break
            exp.add(r)
            self._n_expected += 1
            room -= 1
            self._cover((worker_id, r))

    def _unexpect(self, worker_id: str) -> None:
        exp = self._expected.pop(worker_id, ())
        self._n_expected -= len(exp)
        for r in exp:
            self._uncovered.discard((worker_id, r))

    def _slices(self, worker_id: str, rec: _WorkerRec, events: list[KV.KvEvent],
                rejected: list[int]) -> Iterator[list[KV.KvEvent]]:
        """The batch's events in slices of about ``_APPLY_SLICE_BLOCKS`` blocks, with stores of the
        wrong block size taken out (counted in ``rejected[0]`` and the service counters, logged)
        and very long stores split into parent-linked pieces.
        """
        bs = rec.block_size
        out: list[KV.KvEvent] = []
        blocks = 0
        for ev in events:
            if type(ev) is KV.BlockStored:
                if bs is not None and ev.block_size != bs:
                    rejected[0] += 1
                    self._reject_block_size(worker_id, bs, ev.block_size)
                    continue
                n = len(ev.block_hashes)
                if n > _SPLIT_STORE_BLOCKS:
                    if out:
                        yield out
                    for piece in _split_store(ev, _APPLY_SLICE_BLOCKS):
                        yield [piece]
                    out, blocks = [], 0
                    continue
                blocks += n
            else:
                blocks += 1
            out.append(ev)
            if blocks >= _APPLY_SLICE_BLOCKS:
                yield out
                out, blocks = [], 0
        if out:
            yield out

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

    def _set_block_size(self, worker_id: str, rec: _WorkerRec, block_size: int) -> None:
        rec.block_size = block_size
        self.ingest.add_worker(worker_id, block_size)

    # ------------------------------------------------------------------ register / forget
    def register_worker(self, worker_id: str, block_size: int, *, owner: str = "", now_s: float | None = None,
                        dp_ranks: Sequence[int] = ()) -> None:
        """Declare a worker's page size; the first named caller becomes its owner.

        ``dp_ranks``: the worker's streams the caller forwards. Until each is held trusted here
        the server is not ready (:attr:`uncovered_streams`): after a restart the brokers'
        re-registrations tell it what it must get back before its answers are complete.

        Raises ValueError (bad arguments) or :class:`Refused` (a bound; another owner changing
        the block size). The owner re-registering another block size resets the worker.
        """
        check_registration(worker_id, block_size)
        now = time.monotonic() if now_s is None else now_s
        rec = self._w.get(worker_id)
        if rec is None:
            refusal = self._admission_refusal(worker_id, None)
            if refusal:
                self._refuse(refusal, worker_id=worker_id[:64])
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal,
                              f"more than {self.limits.max_workers} workers")
            rec = self._admit(worker_id, None, now)
        elif rec.block_size is not None and rec.block_size != block_size:
            if not self._owns(rec, owner, now):
                self._deny("register", worker_id, owner, rec)
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, "permission_denied",
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
            self._expect(worker_id, dp_ranks)
        self.c["workers_registered"] += 1

    def _reset_worker(self, worker_id: str, rec: _WorkerRec, block_size: int) -> None:
        """The owner changed the worker's block size: drop its blocks and streams (a resync follows)."""
        dropped = self.index.worker_entries(worker_id)
        old = rec.block_size
        self._drop_streams(worker_id, rec)
        self.index.remove_worker(worker_id)
        self.c["block_size_resets"] += 1
        self.log.warning("indexer_block_size_reset", worker_id=worker_id[:64], old=old, new=block_size,
                         entries_dropped=dropped)

    def _drop_streams(self, worker_id: str, rec: _WorkerRec) -> None:
        exp = self._expected.get(worker_id, ())
        for r in rec.ranks:
            s = (worker_id, r)
            self._known.discard(s)
            if r in exp:
                self._uncovered.add(s)  # expected and now gone: a resync must bring it back
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

    def forget_worker(self, worker_id: str, *, owner: str | None = None, now_s: float | None = None) -> int:
        """Drop every block and the sequencing state of a worker; returns entries dropped.

        ``owner`` None = the server itself (expiry); otherwise only the worker's owner may (or
        anyone once it is unowned / its ownership lapsed): :class:`Refused` PERMISSION_DENIED.
        """
        rec = self._w.get(worker_id)
        if rec is not None and owner is not None:
            if not self._owns(rec, owner, time.monotonic() if now_s is None else now_s):
                self._deny("forget", worker_id, owner, rec)
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, "permission_denied",
                              f"worker {worker_id!r} belongs to another owner")
        n = self.index.worker_entries(worker_id)
        self.ingest.remove_worker(worker_id)
        if rec is not None:
            self._drop_streams(worker_id, rec)
            del self._w[worker_id]
            self._ghosts.pop(worker_id, None)
        self._unexpect(worker_id)
        self.c["workers_forgotten"] += 1
        return n

    def _deny(self, what: str, worker_id: str, owner: str, rec: _WorkerRec) -> None:
        self.c["permission_denied"] += 1
        self.c[f"permission_denied_{what}"] += 1
        if self._rl.allow(("denied", what, owner)):
            self.log.warning("indexer_permission_denied", action=what, worker_id=worker_id[:64],
                             caller=owner[:_MAX_OWNER_CHARS] or "(anonymous)", owner=rec.owner)

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
            self.forget_worker(w)
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
            self.forget_worker(w)
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
            exp = self._expected.get(s[0])
            if exp is not None and s[1] in exp:  # an empty rank nobody sends to any more: no longer expected
                exp.discard(s[1])
                self._n_expected -= 1
                self._uncovered.discard(s)
            self.c["ghost_streams_expired"] += 1
            n += 1
        return n

    # ------------------------------------------------------------------ match
    def match(self, keys: Sequence[int], max_results: int = 0) -> pb.MatchPrefixResponse:
        """Per-worker prefix match as a response message (server_time_ns left to the caller).

        ``max_results`` > 0 keeps only the deepest that many workers (``matched_workers`` still
        counts them all).
        """
        m = self.index.match(keys)
        resp = pb.MatchPrefixResponse(query_blocks=len(keys), blocks_read=len(keys))
        if m.empty:
            return resp
        resp.best_prefix_blocks = m.best_blocks
        matched = 0
        room = max_results if max_results > 0 else -1
        levels = resp.levels
        for depth, ids, ranks in _depth_groups(m, self._single_rank):
            matched += len(ids)
            if room == 0:
                continue
            if 0 < room < len(ids):
                ids, ranks = ids[:room], ranks[:room]
            lvl = levels.add(matched_blocks=depth)
            lvl.worker_ids.extend(ids)
            lvl.dp_ranks.extend(ranks)
            if room > 0:
                room -= len(ids)
        resp.matched_workers = matched
        return resp

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
            "expected_streams": self._n_expected,
            "uncovered_streams": len(self._uncovered),
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


# ---------------------------------------------------------------------- gRPC service


def _owner_of(context: Any) -> str:
    for md in context.invocation_metadata() or ():
        if md.key == OWNER_METADATA:
            return md.value if isinstance(md.value, str) else ""
    return ""


class IndexerService(pb_grpc.IndexerServicer):
    """gRPC shell around :class:`IndexerCore` (see the module docstring for shedding, bounds,
    ownership). Every mutation runs under ``self.mutex``; queries never wait for it."""

    def __init__(self, core: IndexerCore, *, max_inflight_queries: int = 32, query_delay_ms: float = 0.0) -> None:
        if max_inflight_queries < 1:
            raise ConfigError("max_inflight_queries: must be >= 1")
        self.core = core
        self.max_inflight_queries = max_inflight_queries
        self.query_delay_s = query_delay_ms / 1000.0  # fault-injection seam for tests
        self.inflight_queries = 0
        self.mutex = asyncio.Lock()
        self._slice_t0 = 0
        self.log = get_logger(service="indexer")
        # The Valkey backend (mesh.indexer.shared.SharedState): mutations go through its log and
        # are applied by its tail; None = the in-memory backend, mutations applied here directly.
        self.shared: Any = None
        self.backend = "memory"
        self.ready = True  # what the health service says (coverage, and the shared log's tail)
        self.on_health: Any = None  # called with the new readiness when it changes

    def update_health(self) -> None:
        """Recompute readiness: every expected stream covered (and, shared, the tail caught up)."""
        ready = self.core.uncovered_streams == 0 and (self.shared is None or self.shared.ready)
        if ready != self.ready:
            self.ready = ready
            self.core.c["became_ready" if ready else "became_not_ready"] += 1
            self.log.info("indexer_readiness", ready=ready, uncovered_streams=self.core.uncovered_streams,
                          uncovered=[f"{w}/{r}" for w, r in self.core.uncovered(4)],
                          tail="n/a" if self.shared is None else ("caught_up" if self.shared.ready else "lost"))
            if self.on_health is not None:
                self.on_health(ready)

    async def _shared_submit(self, ops: list[tuple], context: Any) -> list[Any]:
        from mesh.indexer.shared import StoreUnavailable

        try:
            return await self.shared.submit(ops)
        except StoreUnavailable as exc:
            self.core.c["store_unavailable"] += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc)[:500])

    async def _owner(self, context: Any) -> str:
        owner = _owner_of(context)
        if len(owner) > _MAX_OWNER_CHARS:
            self.core.c["refused_owner"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{OWNER_METADATA}: at most {_MAX_OWNER_CHARS} characters")
        return owner

    async def _run(self, steps: Generator[None, None, ApplyOutcome]) -> ApplyOutcome:
        """Drive an apply generator, yielding to the loop every ``_APPLY_SLICE_NS`` of work."""
        clock = time.perf_counter_ns
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value
            if clock() - self._slice_t0 > _APPLY_SLICE_NS:
                await asyncio.sleep(_YIELD_S)  # let queries in; the mutex keeps other mutators out
                self._slice_t0 = clock()

    async def _apply(self, b: pb.ApplyKvBatchRequest, owner: str) -> ApplyOutcome:
        which = b.WhichOneof("payload")
        if which is None:
            self.core.c["batches_rejected"] += 1
            return _REJECTED
        async with self.mutex:
            o = await self._run(self.core.apply_steps(
                b.worker_id, b.dp_rank, b.epoch, b.seq,
                b.kv_events_body if which == "kv_events_body" else b.events_msgpack, owner=owner))
        self.update_health()
        return o

    async def _apply_shared(self, batches: Sequence[pb.ApplyKvBatchRequest], owner: str, context: Any) -> list[ApplyOutcome]:
        """The Valkey backend: append the batches to the log, return their verdicts as applied."""
        ops: list[tuple] = []
        slots: list[int] = []
        out: list[ApplyOutcome] = []
        for b in batches:
            which = b.WhichOneof("payload")
            if which is None:
                self.core.c["batches_rejected"] += 1
                out.append(_REJECTED)
                continue
            slots.append(len(out))
            out.append(_REJECTED)
            ops.append(("apply", b.worker_id, b.dp_rank, b.epoch, b.seq,
                        b.kv_events_body if which == "kv_events_body" else b.events_msgpack, owner))
        if ops:
            for i, res in zip(slots, await self._shared_submit(ops, context)):
                if isinstance(res, BaseException):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(res)[:500])
                out[i] = res
        self.update_health()
        return out

    @staticmethod
    def _result(o: ApplyOutcome) -> pb.ApplyKvBatchResult:
        return pb.ApplyKvBatchResult(verdict=o.verdict, missed=o.missed, resync_needed=o.resync_needed,
                                     events_applied=o.events_applied, events_skipped=o.events_skipped)

    async def ApplyKvBatch(self, request, context):
        owner = await self._owner(context)
        self._slice_t0 = time.perf_counter_ns()
        if self.shared is not None:
            o = (await self._apply_shared([request], owner, context))[0]
        else:
            o = await self._apply(request, owner)
        if o.refused and o.refused != "refused_worker_id":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"batch refused: {o.refused}")
        return self._result(o)

    async def ApplyKvBatches(self, request, context):
        # A refused batch inside a multi-batch call is a REJECTED verdict (resync_needed false),
        # not a failed call: one stream over a bound must not fail a broker's whole chunk.
        owner = await self._owner(context)
        resp = pb.ApplyKvBatchesResponse(server_instance=self.core.instance)
        out = resp.results
        self._slice_t0 = time.perf_counter_ns()
        if self.shared is not None:
            out.extend(self._result(o) for o in await self._apply_shared(request.batches, owner, context))
            self.core.c["apply_rpcs"] += 1
            return resp
        for b in request.batches:
            out.append(self._result(await self._apply(b, owner)))
            if time.perf_counter_ns() - self._slice_t0 > _APPLY_SLICE_NS:
                await asyncio.sleep(_YIELD_S)  # batches of one stream stay in order
                self._slice_t0 = time.perf_counter_ns()
        self.core.c["apply_rpcs"] += 1
        return resp

    async def MatchPrefix(self, request, context):
        c = self.core.c
        if self.inflight_queries >= self.max_inflight_queries:
            c["queries_shed"] += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"more than {self.max_inflight_queries} prefix queries in flight")
        self.inflight_queries += 1
        try:
            # Yield once so RPCs that arrived together are all admitted (or shed) before any runs.
            await asyncio.sleep(self.query_delay_s)
            t0 = time.perf_counter_ns()
            keys = list(request.keys)
            if not keys and len(request.token_ids):
                try:
                    keys = content_keys(list(request.token_ids), request.block_size,
                                        namespace_root_key(request.namespace or None))
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids/block_size: {exc}")
            resp = self.core.match(keys, request.max_results)
            dt = time.perf_counter_ns() - t0
            resp.server_time_ns = dt
            resp.server_instance = self.core.instance
            resp.uncovered_streams = self.core.uncovered_streams
            self.core.latency_ns.append(dt)
            self.core.match_hist.observe(dt / 1e9)
            c["queries"] += 1
            return resp
        finally:
            self.inflight_queries -= 1

    async def RegisterWorker(self, request, context):
        owner = await self._owner(context)
        wid, bs, ranks = request.worker_id, request.block_size, list(request.dp_ranks)
        if len(ranks) > self.core.limits.max_ranks_per_worker:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_ranks: at most {self.core.limits.max_ranks_per_worker} (max_ranks_per_worker)")
        try:
            if self.shared is not None:
                check_registration(wid, bs)  # refused before it is logged
                res = (await self._shared_submit([("register", wid, bs, owner, ranks)], context))[0]
                if isinstance(res, BaseException):
                    raise res
            else:
                async with self.mutex:
                    self.core.register_worker(wid, bs, owner=owner, dp_ranks=ranks)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Refused as exc:
            await context.abort(exc.code, str(exc))
        self.update_health()
        return pb.RegisterWorkerResponse()

    async def ForgetWorker(self, request, context):
        owner = await self._owner(context)
        try:
            if self.shared is not None:
                n = (await self._shared_submit([("forget", request.worker_id, owner)], context))[0]
                if isinstance(n, BaseException):
                    raise n
            else:
                async with self.mutex:
                    n = self.core.forget_worker(request.worker_id, owner=owner)
        except Refused as exc:
            await context.abort(exc.code, str(exc))
        self.update_health()
        return pb.ForgetWorkerResponse(entries_dropped=n)

    async def Stats(self, request, context):
        s = self.core.stats()
        svc = s["service"]
        ints = {k: int(v) for k, v in s.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "server_instance"}
        ints.update({f"service_{k}": int(v) for k, v in svc.items()})
        ints["inflight_queries"] = self.inflight_queries
        ints["max_inflight_queries"] = self.max_inflight_queries
        return pb.StatsResponse(
            workers=s["workers"], streams=s["streams"], untrusted_streams=s["untrusted_streams"],
            entries=s["entries"], unique_blocks=s["unique_blocks"], max_entries=s["max_entries"] or 0,
            bytes_estimate=s["bytes_estimate"], batches_received=svc.get("batches_received", 0),
            batches_applied=s["batches_applied"], events_applied=svc.get("events_applied", 0),
            duplicates=s["duplicates"], gaps=s["gaps"] + svc.get("unknown_stream_gaps", 0),
            resyncs=svc.get("verdict_resynced", 0), new_epochs=s["new_epochs"], stale_epochs=s["stale_epochs"],
            evictions=s["evictions"], queries=svc.get("queries", 0), queries_shed=svc.get("queries_shed", 0),
            server_instance=self.core.instance, counters=ints,
            match_p50_us=s["match_p50_us"], match_p99_us=s["match_p99_us"],
            uncovered_streams=self.core.uncovered_streams, backend=self.backend, ready=self.ready,
        )


class _TokenAuth(grpc.aio.ServerInterceptor):
    """Bearer-token check on every RPC but the health service (constant-time compare)."""

    def __init__(self, token: str, core: IndexerCore) -> None:
        self._expected = f"Bearer {token}".encode()
        self._core = core
        self._rl = RateLimiter(1.0)
        self._log = get_logger(service="indexer")

        async def deny(request: Any, context: Any) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(_HEALTH_PREFIX):
            return await continuation(handler_call_details)
        got = b""
        for k, v in handler_call_details.invocation_metadata or ():
            if k == "authorization":
                got = v.encode() if isinstance(v, str) else bytes(v)
                break
        if hmac.compare_digest(got, self._expected):
            return await continuation(handler_call_details)
        c = self._core.c
        c["auth_failures"] += 1
        c["auth_failures_missing" if not got else "auth_failures_wrong"] += 1
        if self._rl.allow(method):
            self._log.warning("indexer_auth_failed", method=method, token="missing" if not got else "wrong")
        return self._deny


# ---------------------------------------------------------------------- server lifecycle


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port). Port 0 = any free port."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"listen: expected HOST:PORT, got {listen!r}")
    return host, int(port)


def _server_options(limits: Limits) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
        # brokers may keep idle channels open with keepalive pings
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


async def serve(listen: str, *, max_entries: int | None = DEFAULT_MAX_ENTRIES, max_inflight_queries: int = 32,
                block_size: int = 16, tls_cert: str | None = None, tls_key: str | None = None,
                tls_client_ca: str | None = None, token: str | None = None, limits: Limits | None = None,
                query_delay_ms: float = 0.0, worker_ttl_s: float = DEFAULT_WORKER_TTL_S,
                stop: asyncio.Event | None = None, ready: Any = None, metrics: str | None = None,
                backend: str = "memory", valkey_url: str | None = None, valkey_prefix: str | None = None,
                checkpoint_every: int = 20_000) -> None:
    """Run the indexer until ``stop`` is set, then shut down gracefully (health NOT_SERVING first).

    ``token``: the bearer token every Indexer RPC must carry (None = unauthenticated, logged as
    ``indexer_unauthenticated``). ``tls_client_ca``: require client certificates signed by it.
    ``metrics``: HOST:PORT of a Prometheus ``/metrics`` endpoint served on this event loop (no
    authentication; an empty host binds 127.0.0.1), announced as ``metrics_listening``. Announces ``indexer_listening`` with the bound ``endpoint`` (``http://`` or ``https://``
    HOST:PORT) once the health service reports SERVING; ``ready(endpoint)`` is called then too.

    ``backend="valkey"``: the state lives in Valkey at ``valkey_url`` under ``valkey_prefix``
    (:mod:`mesh.indexer.shared`); the port opens once the checkpoint and the log are loaded.
    Health is SERVING only while every stream brokers registered is covered (and, with Valkey,
    the log tail is caught up).
    """
    host, _ = parse_listen(listen)
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("tls_cert/tls_key: give both or neither")
    if tls_client_ca is not None and tls_cert is None:
        raise ConfigError("tls_client_ca: needs tls_cert and tls_key")
    if token is not None and not token:
        raise ConfigError("token: must not be empty")
    if backend not in ("memory", "valkey"):
        raise ConfigError(f"backend: {backend!r} must be memory or valkey")
    if backend == "valkey" and not valkey_url:
        raise ConfigError("valkey_url: --backend valkey needs --valkey-url redis://HOST:PORT[/DB]")
    if checkpoint_every < 1:
        raise ConfigError("checkpoint_every: must be >= 1")
    limits = limits or Limits()
    core = IndexerCore(max_entries=max_entries, block_size=block_size, limits=limits)
    svc = IndexerService(core, max_inflight_queries=max_inflight_queries, query_delay_ms=query_delay_ms)
    shared = None
    if backend == "valkey":
        from mesh.indexer.shared import DEFAULT_PREFIX, SharedState, StoreUnavailable, ValkeyLog, mac_key_from_token

        vlog = ValkeyLog(valkey_url, valkey_prefix or DEFAULT_PREFIX, mac_key=mac_key_from_token(token))
        shared = SharedState(svc, vlog, checkpoint_every=checkpoint_every, worker_ttl_s=worker_ttl_s,
                             ghost_ttl_s=limits.ghost_ttl_s)
        svc.shared, svc.backend, svc.ready = shared, "valkey", False
        if token is None:
            svc.log.warning("indexer_checkpoint_unsigned",
                            note="no token: checkpoints in Valkey are unsigned pickles; whoever can write to that "
                                 "Valkey can run code in this indexer (keep it private, or set --token-file)")
        try:
            await shared.start()
        except StoreUnavailable as exc:
            await vlog.aclose()
            raise ConfigError(f"valkey_url: {exc}") from None
    interceptors = [_TokenAuth(token, core)] if token else []
    server = grpc.aio.server(options=_server_options(limits), interceptors=interceptors)
    pb_grpc.add_IndexerServicer_to_server(svc, server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    log = svc.log
    try:
        if tls_cert is not None:
            ca = Path(tls_client_ca).read_bytes() if tls_client_ca else None
            creds = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())],
                                                root_certificates=ca, require_client_auth=ca is not None)
            port = server.add_secure_port(listen, creds)
            scheme = "https"
        else:
            port = server.add_insecure_port(listen)
            scheme = "http"
    except RuntimeError as exc:
        raise ConfigError(f"listen: cannot bind {listen}: {exc}") from None
    if not port:
        raise ConfigError(f"listen: cannot bind {listen}")
    if not token:
        log.warning("indexer_unauthenticated",
                    note="no --token-file (or MESH_INDEXER_TOKEN): anyone reaching the port may apply, register "
                         "and forget workers")
    elif scheme == "http":
        log.warning("indexer_token_in_cleartext", note="the bearer token travels unencrypted; serve TLS (--tls-cert)")
    await server.start()

    async def set_health(ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await hs.set(name, status)

    health_tasks: set[asyncio.Task] = set()

    def on_health(ready: bool) -> None:
        t = asyncio.get_running_loop().create_task(set_health(ready))
        health_tasks.add(t)
        t.add_done_callback(health_tasks.discard)

    svc.update_health()
    await set_health(svc.ready)
    svc.on_health = on_health
    endpoint = f"{scheme}://{host}:{port}"
    announce("indexer_listening", endpoint=endpoint, max_entries=max_entries, backend=backend, ready=svc.ready,
             max_inflight_queries=max_inflight_queries, server_instance=core.instance, pid=os.getpid(),
             auth="token" if token else "none", client_certs=tls_client_ca is not None,
             **{f"limit_{k}": v for k, v in dataclasses.asdict(limits).items()})
    metrics_runner = await _start_metrics(metrics, core, svc, log) if metrics else None
    if ready is not None:
        ready(endpoint)
    stop = stop or asyncio.Event()
    if shared is None:
        expiry = asyncio.create_task(_expire_loop(svc, worker_ttl_s, limits.ghost_ttl_s, log))
    else:  # replicas expire on log time, as they apply entries (mesh.indexer.shared)
        expiry = asyncio.create_task(shared.run(), name="valkey-tail")
    try:
        await stop.wait()
    finally:
        expiry.cancel()
        if shared is not None:
            await asyncio.gather(expiry, return_exceptions=True)
            await shared.vlog.aclose()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        await hs.enter_graceful_shutdown()  # NOT_SERVING before the port goes away
        await server.stop(grace=1.0)
        log.info("indexer_stopped", **{k: v for k, v in core.c.items() if not k.startswith("verdict_")})
        announce("indexer_stopped")


class _IndexerCollector:
    """The indexer's figures for Prometheus, read on the event loop that mutates them (the
    /metrics handler runs there too): call counters by what, state gauges, match latency."""

    def __init__(self, core: "IndexerCore", svc: "IndexerService") -> None:
        self.core = core
        self.svc = svc

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        st = self.core.stats()
        fam = CounterMetricFamily("mesh_indexer_events", "Indexer calls and outcomes, by what", labels=["what"])
        for k, v in sorted(self.core.c.items()):
            fam.add_metric([k], v)
        yield fam
        g = GaugeMetricFamily("mesh_indexer_stat", "Indexer state (workers, streams, entries, limits)", labels=["stat"])
        for k, v in sorted(st.items()):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                g.add_metric([k], float(v))
        yield g
        yield GaugeMetricFamily("mesh_indexer_queries_in_flight", "Prefix queries being answered", value=self.svc.inflight_queries)
        yield GaugeMetricFamily("mesh_indexer_ready", "1 while health says SERVING: every expected stream covered "
                                "(and, on Valkey, the log tail caught up)", value=1.0 if self.svc.ready else 0.0)
        h = self.core.match_hist
        yield HistogramMetricFamily("mesh_indexer_match_seconds", "Server time of one prefix match", buckets=h.buckets(), sum_value=h.sum_s)


async def _start_metrics(spec: str, core: "IndexerCore", svc: "IndexerService", log: Any):
    """Serve /metrics on HOST:PORT from this event loop (aiohttp); returns the runner to clean up."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"metrics: expected HOST:PORT, got {spec!r}")
    host = host.strip("[]") or "127.0.0.1"
    reg = CollectorRegistry()
    reg.register(_IndexerCollector(core, svc))

    async def handle(_request):
        return web.Response(body=generate_latest(reg), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, int(port))
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"metrics: cannot bind {spec}: {exc.strerror}") from None
    bound = site._server.sockets[0].getsockname()[:2]  # aiohttp has no public accessor for the bound port
    if host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("metrics_public", host=host, note="the --metrics port has no authentication")
    announce("metrics_listening", endpoint=f"http://{bound[0]}:{bound[1]}/metrics")
    return runner


async def _expire_loop(svc: IndexerService, ttl_s: float, ghost_ttl_s: float, log: Any) -> None:
    """Expire silent workers (``ttl_s``) and ghosts (``ghost_ttl_s``), a slice at a time under the
    mutation lock, so a mass expiry never stalls queries."""
    ttls = [t for t in (ttl_s, ghost_ttl_s) if t > 0]
    if not ttls:
        return
    period = min(30.0, max(0.05, min(ttls) / 4))
    while True:
        await asyncio.sleep(period)
        try:
            await _expire_once(svc, ttl_s, ghost_ttl_s, log)
        except Exception as exc:  # one bad pass must not end expiry for good (nothing would say so)
            log.exception("expire_failed", error=repr(exc))


async def _expire_once(svc: IndexerService, ttl_s: float, ghost_ttl_s: float, log: Any) -> None:
    """One expiry pass, a slice at a time under the mutation lock."""
    core = svc.core
    now = time.monotonic()
    gone: list[str] = []
    ghosts = 0
    while True:
        async with svc.mutex:
            g = core.expire_workers(now, ttl_s, limit=_EXPIRE_SLICE) if ttl_s > 0 else []
            n = core.expire_ghosts(now, ghost_ttl_s, limit=_EXPIRE_SLICE) if ghost_ttl_s > 0 else 0
        gone += g
        ghosts += n
        if len(g) < _EXPIRE_SLICE and n < _EXPIRE_SLICE:
            break
        await asyncio.sleep(0)
    svc.update_health()
    if gone:
        log.info("workers_expired", count=len(gone), first=gone[0], ttl_s=ttl_s)
    if ghosts:
        log.info("ghosts_expired", count=ghosts, ttl_s=ghost_ttl_s, ghost_workers=len(core._ghosts),
                 ghost_streams=len(core._ghost_streams))


def run_server(listen: str, *, log_level: str = "info", **kw: Any) -> int:
    """Blocking entry point of ``mesh indexer``: SIGTERM/SIGINT stop it gracefully."""
    configure(log_level)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(listen, stop=stop, **kw)

    asyncio.run(main())
    return 0
