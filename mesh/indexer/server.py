"""The KV indexer service (``mesh indexer --listen HOST:PORT``): one prefix index shared by brokers.

A thin gRPC shell (``grpc.aio``, one event loop, so no locks) around the pure
:class:`mesh.indexer.core.IndexerCore` (no gRPC, no clock: what a shared service adds per batch),
itself the same index code the brokers and the simulator use: :class:`mesh.index.PrefixIndex` fed
through :meth:`mesh.index.ingest.KvIngest.apply_events` (one implementation of the event semantics:
sequencing, resync snapshots, epochs, block-size checks, content keys from token ids). The shell
owns the clock (it passes ``now_s`` to every mutation), the status codes, the locks and yields.

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
  broker that went away for good). With a token, owner ids are asserted by token holders: they
  separate well-behaved brokers, they do not authenticate them individually. Without a token
  anyone may claim any id, so the owner is the claim *and* the caller's address (``peer_host``:
  IP without port): a caller elsewhere claiming the owner's id is refused (a broker that moves to
  another address regains its workers once the old ownership lapses);
* **bounded queries**: a MatchPrefix of more than ``max_match_ids`` token ids or keys is refused
  (INVALID_ARGUMENT, ``refused_match_ids``) before any work; token ids are hashed in slices that
  yield to the loop;
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
import signal
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mesh.errors import ConfigError
from mesh.hashing import content_keys
from mesh.indexer import indexer_pb2 as pb
from mesh.indexer import indexer_pb2_grpc as pb_grpc
from mesh.indexer.client import OWNER_METADATA, read_token_file
from mesh.indexer.core import (DEFAULT_MAX_ENTRIES, DEFAULT_WORKER_TTL_S, MAX_OWNER_CHARS, REJECTED, ApplyOutcome,
                               IndexerCore, Limits, Refused, check_registration)
from mesh.logs import RateLimiter, announce, configure, get_logger
from mesh.namespaces import namespace_root_key

__all__ = ["IndexerService", "serve", "run_server", "parse_listen", "read_token_file", "SERVICE_NAME", "OWNER_METADATA",
           "TOKEN_ENV"]

SERVICE_NAME = "mesh.indexer.v1.Indexer"
# OWNER_METADATA, the metadata key naming the caller (a broker id) for worker ownership, is
# defined once, in mesh.indexer.client (which must not import the server).
#: Environment variable holding the bearer token when no --token-file is given.
TOKEN_ENV = "MESH_INDEXER_TOKEN"
_APPLY_SLICE_NS = 4_000_000  # yield to queries after this much apply work in one RPC
# The yield is a real (short) sleep, not sleep(0): the loop then blocks in its poll and releases
# the GIL, so gRPC's completion-queue thread can hand over the queries that arrived meanwhile.
# With sleep(0) each query hop waited for the interpreter's 5 ms switch interval: a match during
# a big apply took ~25 ms (p99 ~80 ms) instead of ~5 ms. Cost: ~1/9 of apply throughput.
_YIELD_S = 0.0005
_EXPIRE_SLICE = 256  # workers/streams expired between two yields
_HASH_SLICE_TOKENS = 65_536  # prompt tokens hashed between two yields (MatchPrefix by token ids)
_HEALTH_PREFIX = "/grpc.health.v1.Health/"


# ---------------------------------------------------------------------- gRPC service


def _owner_of(context: Any) -> str:
    for md in context.invocation_metadata() or ():
        if md.key == OWNER_METADATA:
            return md.value if isinstance(md.value, str) else ""
    return ""


def peer_host(peer: str) -> str:
    """The caller's address without its port (``ipv4:10.0.0.5:41234`` -> ``ipv4:10.0.0.5``;
    ``unix:`` peers as they are): what a caller cannot choose, unlike its ``x-mesh-owner``."""
    if peer.startswith(("ipv4:", "ipv6:")):
        host, sep, port = peer.rpartition(":")
        return host if sep and port.isdigit() else peer
    return peer


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
        # Without a token anyone may claim any x-mesh-owner: ownership is then bound to the
        # claim *and* the caller's address (set by serve() when no token is configured).
        self.owners_by_address = False

    def update_health(self) -> None:
        """Recompute readiness: every expected stream covered (and, shared, the tail caught up)."""
        ready = self.core.uncovered_streams == 0 and (self.shared is None or self.shared.ready)
        if ready != self.ready:
            self.ready = ready
            self.core.c["became_ready" if ready else "became_not_ready"] += 1
            self.log.info("indexer_readiness", ready=ready, uncovered_streams=self.core.uncovered_streams,
                          uncovered=[f"{w}/{r}" for w, r in self.core.uncovered(4)],
                          tail="n/a" if self.shared is None else ("caught_up" if self.shared.ready else "lost"),
                          store_rejected=self.shared.last_rejection if self.shared is not None else "")
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
        if len(owner) > MAX_OWNER_CHARS:
            self.core.c["refused_owner"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{OWNER_METADATA}: at most {MAX_OWNER_CHARS} characters")
        if owner and self.owners_by_address:
            owner = f"{owner}@{peer_host(context.peer() or '')[:80]}"
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
            return REJECTED
        async with self.mutex:
            o = await self._run(self.core.apply_steps(
                b.worker_id, b.dp_rank, b.epoch, b.seq,
                b.kv_events_body if which == "kv_events_body" else b.events_msgpack, now_s=time.monotonic(), owner=owner))
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
                out.append(REJECTED)
                continue
            slots.append(len(out))
            out.append(REJECTED)
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
            n_ids = max(len(request.keys), len(request.token_ids))
            if n_ids > self.core.limits.max_match_ids:  # refused before any work on them
                c["refused_match_ids"] += 1
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"keys/token_ids: {n_ids} ids, at most "
                                    f"{self.core.limits.max_match_ids} (max_match_ids)")
            # Yield once so RPCs that arrived together are all admitted (or shed) before any runs.
            await asyncio.sleep(self.query_delay_s)
            t0 = time.perf_counter_ns()
            keys = list(request.keys)
            if not keys and len(request.token_ids):
                try:
                    keys = await content_keys_sliced(list(request.token_ids), request.block_size,
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
                    self.core.register_worker(wid, bs, now_s=time.monotonic(), owner=owner, dp_ranks=ranks)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Refused as exc:
            await context.abort(grpc.StatusCode[exc.status], str(exc))
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
                    n = self.core.forget_worker(request.worker_id, now_s=time.monotonic(), owner=owner)
        except Refused as exc:
            await context.abort(grpc.StatusCode[exc.status], str(exc))
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
            store_rejected=self.shared.last_rejection if self.shared is not None else "",
        )


async def content_keys_sliced(tokens: list[int], block_size: int, root: int) -> list[int]:
    """content_keys of a long prompt in slices, yielding to the loop between them (queries and
    applies of other callers go on while one caller's long prompt is hashed)."""
    if block_size < 1 or len(tokens) <= _HASH_SLICE_TOKENS:
        return content_keys(tokens, block_size, root)
    step = max(1, _HASH_SLICE_TOKENS // block_size) * block_size
    keys: list[int] = []
    for i in range(0, len(tokens), step):
        if i:
            await asyncio.sleep(0)
        keys += content_keys(tokens[i:i + step], block_size, keys[-1] if keys else root)
    return keys


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
                checkpoint_every: int = 20_000, insecure_store: bool = False,
                valkey_password: str | None = None) -> None:
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
    if backend == "valkey" and not token and not insecure_store:
        raise ConfigError("token_file: --backend valkey signs every log entry and checkpoint with a key derived from "
                          "the token; without --token-file (or MESH_INDEXER_TOKEN) anyone who can write to the store "
                          "could forge them: give a token, or --insecure-store to run unsigned on a private store")
    limits = limits or Limits()
    core = IndexerCore(max_entries=max_entries, block_size=block_size, limits=limits)
    svc = IndexerService(core, max_inflight_queries=max_inflight_queries, query_delay_ms=query_delay_ms)
    svc.owners_by_address = not token
    shared = None
    if backend == "valkey":
        from mesh.indexer.shared import DEFAULT_PREFIX, SharedState, StoreUnavailable, ValkeyLog
        from mesh.indexer.signing import mac_key_from_token

        vlog = ValkeyLog(valkey_url, valkey_prefix or DEFAULT_PREFIX, mac_key=mac_key_from_token(token),
                         password=valkey_password)
        shared = SharedState(svc, vlog, checkpoint_every=checkpoint_every, worker_ttl_s=worker_ttl_s,
                             ghost_ttl_s=limits.ghost_ttl_s)
        svc.shared, svc.backend, svc.ready = shared, "valkey", False
        if token is None:
            svc.log.warning("indexer_store_unsigned", insecure_store=True,
                            note="--insecure-store: log entries and checkpoints in Valkey are NOT signed; whoever can "
                                 "write to that Valkey can forget workers, forge KV holdings (misroute prompts) and "
                                 "rewrite the state (keep it private, or set --token-file)")
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
                         "and forget workers (a worker's owner is its x-mesh-owner claim AND the caller's address)")
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
        ghost_workers, ghost_streams = core.ghosts
        log.info("ghosts_expired", count=ghosts, ttl_s=ghost_ttl_s, ghost_workers=ghost_workers, ghost_streams=ghost_streams)


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
