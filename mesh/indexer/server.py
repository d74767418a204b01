"""The KV indexer service (``mesh indexer --listen HOST:PORT``): one prefix index shared by brokers.

A thin gRPC shell (``grpc.aio``, one event loop, so no locks) around the same index code the
brokers and the simulator use: :class:`mesh.index.PrefixIndex` fed through
:meth:`mesh.routing.providers.LocalIndexProvider.apply_events` (one implementation of the event
semantics: sequencing, resync snapshots, epochs, block-size checks, content keys from token ids).

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
  ``BlockStored`` (events of any other size are then not applied, as in the local provider);
* workers silent for ``worker_ttl_s`` (no batch, no RegisterWorker) are forgotten: brokers never
  forget a worker here, since another broker may still serve it.

Overload: only ``MatchPrefix`` is shed (``RESOURCE_EXHAUSTED`` once ``max_inflight_queries`` are
admitted and unanswered; each admitted query yields to the loop once before running, so a burst
that arrives together is counted together). Apply RPCs are never shed; a long ``ApplyKvBatches``
yields to the loop every ``_APPLY_SLICE_NS`` so queries are not stuck behind a big ingest chunk.
Memory: the index holds at most ``max_entries`` (block, stream) entries (LRU eviction).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mesh import kv_events as KV
from mesh.errors import ConfigError, ProtocolError
from mesh.hashing import content_keys
from mesh.index import PrefixIndex, Verdict
from mesh.indexer import indexer_pb2 as pb
from mesh.indexer import indexer_pb2_grpc as pb_grpc
from mesh.logs import announce, configure, get_logger
from mesh.protocol import unpack
from mesh.routing.providers import LocalIndexProvider

__all__ = ["IndexerCore", "IndexerService", "ApplyOutcome", "serve", "run_server", "parse_listen",
           "DEFAULT_MAX_ENTRIES", "DEFAULT_WORKER_TTL_S", "SERVICE_NAME", "MAX_MESSAGE_BYTES"]

SERVICE_NAME = "mesh.indexer.v1.Indexer"
#: Default entry budget: ~10 M (block, stream) entries, a few GB of Python objects at most.
DEFAULT_MAX_ENTRIES = 10_000_000
#: Workers silent this long are forgotten (0 = never).
DEFAULT_WORKER_TTL_S = 900.0
#: gRPC message cap both ways: a resync snapshot of a big worker is one batch.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_APPLY_SLICE_NS = 2_000_000  # yield to queries after this much apply work in one RPC
_LATENCY_WINDOW = 8192  # recent query handler times kept for the p50/p99 in Stats

_VERDICT_PB = {
    Verdict.APPLY: pb.APPLY,
    Verdict.DUPLICATE: pb.DUPLICATE,
    Verdict.GAP: pb.GAP,
    Verdict.NEW_EPOCH: pb.NEW_EPOCH,
    Verdict.STALE_EPOCH: pb.STALE_EPOCH,
}


class _VerdictIndex(PrefixIndex):
    """A PrefixIndex that remembers the last batch verdict (apply_events does not return it)."""

    last_verdict = None

    def begin_batch(self, stream, epoch, seq):
        v = super().begin_batch(stream, epoch, seq)
        self.last_verdict = v
        return v


@dataclass(slots=True, frozen=True)
class ApplyOutcome:
    """What happened to one batch (mirrors ``ApplyKvBatchResult``)."""

    verdict: int  # pb.Verdict value
    missed: int = 0
    resync_needed: bool = False
    events_applied: int = 0
    events_skipped: int = 0


_REJECTED = ApplyOutcome(pb.REJECTED, resync_needed=True)


class IndexerCore:
    """The service logic without gRPC: apply batches, match prompts, register/forget, stats.

    Not thread-safe: the server calls it from its one event loop.
    """

    def __init__(self, *, max_entries: int | None = DEFAULT_MAX_ENTRIES, block_size: int = 16,
                 resync_retry_s: float = 5.0) -> None:
        self.index = _VerdictIndex(max_entries, key_fn=content_keys)
        # speculative_ttl_s=0: a shared index never holds one router's guesses.
        self.provider = LocalIndexProvider(self.index, name="indexer", block_size=block_size, speculative_ttl_s=0)
        self.instance = int.from_bytes(os.urandom(8), "little")
        self._known: set[tuple[str, int]] = set()  # streams this server has applied a batch of
        self._registered: set[str] = set()
        self._last_seen: dict[str, float] = {}  # worker -> monotonic time of its last batch/register
        # untrusted/unknown stream -> when a resync was last asked for (cleared once trusted)
        self._asked_at: dict[tuple[str, int], float] = {}
        self.resync_retry_s = resync_retry_s
        self._single_rank = True  # no stream with dp_rank > 0 seen yet (enables the fast level path)
        self.c: Counter[str] = Counter()
        self.latency_ns: deque[int] = deque(maxlen=_LATENCY_WINDOW)

    # ------------------------------------------------------------------ apply
    def apply_batch(self, worker_id: str, dp_rank: int, epoch: int, seq: int, payload: bytes, *,
                    now_s: float | None = None) -> ApplyOutcome:
        """Apply one batch. ``payload`` is msgpack: the events array, or the whole KV_EVENTS body
        (a map: its ``events`` are used).

        ``resync_needed`` is set at most once per ``resync_retry_s`` per untrusted (or unknown)
        stream, until it is trusted again (``now_s``: monotonic seconds, default now).
        """
        c = self.c
        c["batches_received"] += 1
        now = time.monotonic() if now_s is None else now_s
        try:
            obj = unpack(payload)
        except ProtocolError:
            c["batches_rejected"] += 1
            return _REJECTED
        if type(obj) is dict:  # a whole KV_EVENTS body
            obj = obj.get("events")
        events, skipped = KV.decode_events(obj)
        n_skipped = 0
        for reason, n in skipped.items():
            c[f"events_skipped_{reason}"] += n
            n_skipped += n
        if not worker_id:
            c["batches_rejected"] += 1
            return ApplyOutcome(pb.REJECTED, resync_needed=False, events_skipped=n_skipped)
        stream = (worker_id, dp_rank)
        self._last_seen[worker_id] = now
        if dp_rank:
            self._single_rank = False
        snapshot = bool(events) and type(events[0]) is KV.AllBlocksCleared
        known = stream in self._known
        if not known and seq > 0 and not snapshot:
            # Increments on top of state we never saw: ask for a snapshot, change nothing.
            c["unknown_stream_gaps"] += 1
            c["verdict_gap"] += 1
            return ApplyOutcome(pb.GAP, missed=seq, resync_needed=self._ask(stream, now), events_skipped=n_skipped)
        if worker_id not in self._registered:
            for ev in events:
                if type(ev) is KV.BlockStored:
                    self._register(worker_id, ev.block_size)
                    c["auto_registered"] += 1
                    break
        ix = self.index
        was_trusted = ix.is_trusted(stream)
        ix.last_verdict = None
        self.provider.apply_events(worker_id, dp_rank, epoch, seq, events, now)
        v = ix.last_verdict
        if v is None:  # the resync path: a snapshot re-trusted an untrusted stream
            verdict, applied, missed = pb.RESYNCED, True, 0
        else:
            verdict, applied, missed = _VERDICT_PB[v.verdict], v.apply, v.missed
            if applied:
                if snapshot and (not known or not was_trusted):
                    verdict = pb.RESYNCED
                elif not ix.is_trusted(stream):
                    verdict = pb.UNTRUSTED  # applied, but a hole before it is still unfilled
        if ix.is_trusted(stream):
            ask = False
            self._asked_at.pop(stream, None)
        else:
            if snapshot and not applied:
                # The snapshot we asked for came behind a hole (sequence-wise): ask again now;
                # the next one finds the stream untrusted and re-trusts it.
                self._asked_at.pop(stream, None)
            ask = self._ask(stream, now)
        out = ApplyOutcome(verdict, missed=missed, resync_needed=ask,
                           events_applied=len(events) if applied else 0, events_skipped=n_skipped)
        if applied:
            self._known.add(stream)
            c["events_applied"] += out.events_applied
        c[f"verdict_{pb.Verdict.Name(verdict).lower()}"] += 1
        return out

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

    def _register(self, worker_id: str, block_size: int) -> None:
        self.provider.add_worker(worker_id, block_size)
        self._registered.add(worker_id)

    def register_worker(self, worker_id: str, block_size: int) -> None:
        if not worker_id or block_size <= 0:
            raise ValueError("worker_id must be non-empty and block_size > 0")
        self._register(worker_id, block_size)
        self._last_seen[worker_id] = time.monotonic()
        self.c["workers_registered"] += 1

    def forget_worker(self, worker_id: str) -> int:
        n = self.index.worker_entries(worker_id)
        self.provider.remove_worker(worker_id)
        self._registered.discard(worker_id)
        self._last_seen.pop(worker_id, None)
        self._known = {s for s in self._known if s[0] != worker_id}
        for s in [s for s in self._asked_at if s[0] == worker_id]:
            del self._asked_at[s]
        self.c["workers_forgotten"] += 1
        return n

    def expire_workers(self, now_s: float, ttl_s: float) -> list[str]:
        """Forget workers not heard from (no batch, no RegisterWorker) for ``ttl_s``.

        Brokers never forget a worker here (another broker may still serve it), so this bounds
        what dead workers keep. An idle live worker that is expired comes back through the
        unknown-stream GAP -> resync path on its next batch.
        """
        gone = [w for w, t in self._last_seen.items() if now_s - t > ttl_s]
        for w in gone:
            self.forget_worker(w)
            self.c["workers_expired"] += 1
        return gone

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
        s = self.provider.stats()
        c = self.c
        lat = sorted(self.latency_ns)

        def pct(p: float) -> float:
            return lat[min(len(lat) - 1, int(p / 100 * (len(lat) - 1)))] / 1000.0 if lat else 0.0

        return {
            **s,
            "service": dict(c),
            "server_instance": self.instance,
            "known_streams": len(self._known),
            "match_p50_us": pct(50),
            "match_p99_us": pct(99),
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


class IndexerService(pb_grpc.IndexerServicer):
    """gRPC shell around :class:`IndexerCore` (see module docstring for shedding)."""

    def __init__(self, core: IndexerCore, *, max_inflight_queries: int = 32, query_delay_ms: float = 0.0) -> None:
        if max_inflight_queries < 1:
            raise ConfigError("max_inflight_queries: must be >= 1")
        self.core = core
        self.max_inflight_queries = max_inflight_queries
        self.query_delay_s = query_delay_ms / 1000.0  # fault-injection seam for tests
        self.inflight_queries = 0
        self.log = get_logger(service="indexer")

    def _apply(self, b: pb.ApplyKvBatchRequest) -> pb.ApplyKvBatchResult:
        which = b.WhichOneof("payload")
        if which is None:
            self.core.c["batches_rejected"] += 1
            return pb.ApplyKvBatchResult(verdict=pb.REJECTED, resync_needed=True)
        o = self.core.apply_batch(b.worker_id, b.dp_rank, b.epoch, b.seq,
                                  b.kv_events_body if which == "kv_events_body" else b.events_msgpack)
        return pb.ApplyKvBatchResult(verdict=o.verdict, missed=o.missed, resync_needed=o.resync_needed,
                                     events_applied=o.events_applied, events_skipped=o.events_skipped)

    async def ApplyKvBatch(self, request, context):
        return self._apply(request)

    async def ApplyKvBatches(self, request, context):
        resp = pb.ApplyKvBatchesResponse(server_instance=self.core.instance)
        out = resp.results
        clock = time.perf_counter_ns
        t0 = clock()
        for b in request.batches:
            out.append(self._apply(b))
            if clock() - t0 > _APPLY_SLICE_NS:
                await asyncio.sleep(0)  # let queries in; batches of one stream stay in order
                t0 = clock()
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
                    keys = content_keys(list(request.token_ids), request.block_size)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids/block_size: {exc}")
            resp = self.core.match(keys, request.max_results)
            dt = time.perf_counter_ns() - t0
            resp.server_time_ns = dt
            self.core.latency_ns.append(dt)
            c["queries"] += 1
            return resp
        finally:
            self.inflight_queries -= 1

    async def RegisterWorker(self, request, context):
        try:
            self.core.register_worker(request.worker_id, request.block_size)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.RegisterWorkerResponse()

    async def ForgetWorker(self, request, context):
        return pb.ForgetWorkerResponse(entries_dropped=self.core.forget_worker(request.worker_id))

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
        )


# ---------------------------------------------------------------------- server lifecycle


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port). Port 0 = any free port."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"listen: expected HOST:PORT, got {listen!r}")
    return host, int(port)


_SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
    # brokers may keep idle channels open with keepalive pings
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
]


async def serve(listen: str, *, max_entries: int | None = DEFAULT_MAX_ENTRIES, max_inflight_queries: int = 32,
                block_size: int = 16, tls_cert: str | None = None, tls_key: str | None = None,
                query_delay_ms: float = 0.0, worker_ttl_s: float = DEFAULT_WORKER_TTL_S,
                stop: asyncio.Event | None = None, ready: Any = None) -> None:
    """Run the indexer until ``stop`` is set, then shut down gracefully (health NOT_SERVING first).

    Announces ``indexer_listening`` with the bound ``endpoint`` (``http://`` or ``https://``
    HOST:PORT) once the health service reports SERVING; ``ready(endpoint)`` is called then too.
    """
    host, _ = parse_listen(listen)
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("tls_cert/tls_key: give both or neither")
    core = IndexerCore(max_entries=max_entries, block_size=block_size)
    svc = IndexerService(core, max_inflight_queries=max_inflight_queries, query_delay_ms=query_delay_ms)
    server = grpc.aio.server(options=_SERVER_OPTIONS)
    pb_grpc.add_IndexerServicer_to_server(svc, server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    try:
        if tls_cert is not None:
            creds = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
            port = server.add_secure_port(listen, creds)
            scheme = "https"
        else:
            port = server.add_insecure_port(listen)
            scheme = "http"
    except RuntimeError as exc:
        raise ConfigError(f"listen: cannot bind {listen}: {exc}") from None
    if not port:
        raise ConfigError(f"listen: cannot bind {listen}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    endpoint = f"{scheme}://{host}:{port}"
    log = svc.log
    announce("indexer_listening", endpoint=endpoint, max_entries=max_entries,
             max_inflight_queries=max_inflight_queries, server_instance=core.instance, pid=os.getpid())
    if ready is not None:
        ready(endpoint)
    stop = stop or asyncio.Event()
    expiry = asyncio.create_task(_expire_loop(core, worker_ttl_s, log)) if worker_ttl_s > 0 else None
    try:
        await stop.wait()
    finally:
        if expiry is not None:
            expiry.cancel()
        await hs.enter_graceful_shutdown()  # NOT_SERVING before the port goes away
        await server.stop(grace=1.0)
        log.info("indexer_stopped", **{k: v for k, v in core.c.items() if not k.startswith("verdict_")})
        announce("indexer_stopped")


async def _expire_loop(core: IndexerCore, ttl_s: float, log: Any) -> None:
    while True:
        await asyncio.sleep(min(30.0, max(0.05, ttl_s / 4)))
        gone = core.expire_workers(time.monotonic(), ttl_s)
        if gone:
            log.info("workers_expired", count=len(gone), first=gone[0], ttl_s=ttl_s)


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
