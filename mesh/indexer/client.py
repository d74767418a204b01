"""What a broker uses to share the KV indexer: prefix queries and event forwarding (one asyncio loop).

Queries (:meth:`IndexerClient.match`) never raise and never queue: ``None`` means *degraded*
(route by load only) and ``last_degraded_reason`` / ``stats()`` say why:

* ``overloaded``: ``max_inflight`` queries already in flight (non-blocking try-acquire);
* ``resource_exhausted``: the indexer shed the query; ``timeout``: the deadline
  (``query_timeout_ms``, sent as the gRPC deadline and covering every replica tried) expired;
* ``unavailable``: no connection; ``error``: any other gRPC status or a bad answer;
* ``breaker_open``: every replica's circuit breaker is open (no RPC was sent: ~0 latency).

Replicas: every endpoint holds a full copy of the index. Queries go to the first replica whose
breaker admits them and fail over to the next on error. A :class:`CircuitBreaker` per replica
opens after ``breaker_failures`` consecutive failures (queries or forwards; RESOURCE_EXHAUSTED is
not one: a shedding replica is alive), lets one probe through after ``breaker_reset_s``
(half-open) and closes on its success. A dead replica therefore costs one fast failed RPC per
query until its breaker opens, then nothing.

Authentication and ownership: with ``token`` (or ``token_file``) every RPC carries
``authorization: Bearer <token>``; every RPC also carries ``x-mesh-owner: <owner>`` (the broker id;
default ``<host>:<pid>``), which makes this client the owner of the workers it registers first:
another owner can neither forget them nor change their block size. UNAUTHENTICATED and
PERMISSION_DENIED are never retried: counted (``auth_failures``, ``control_denied``) and logged.

Errors: one boundary, :func:`indexer_error`, turns whatever an RPC raises into the mesh error tree
(:mod:`mesh.errors`); its message names the endpoint and the RPC. No gRPC error leaves this
module: :meth:`~IndexerClient.match` answers ``None`` (degraded) and keeps the mapped error in
:attr:`~IndexerClient.last_error`, forwarding counts and resyncs, :meth:`~IndexerClient.fetch_stats`
raises it, and using a closed client is a :class:`~mesh.errors.ClientStateError`.

========================================================  ================================
raised by the RPC                                         becomes
========================================================  ================================
UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, ABORTED        RetryableError(unavailable)
RESOURCE_EXHAUSTED "... larger than max" (message cap)    FatalRequestError(too_large)
RESOURCE_EXHAUSTED of MatchPrefix (the indexer shed it)   RetryableError(overloaded)
RESOURCE_EXHAUSTED of other RPCs (a bound: max workers)   FatalRequestError(rate_limited)
UNAUTHENTICATED, PERMISSION_DENIED                        AuthError(unauthorized)
INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION       FatalRequestError(bad_request)
any other status (INTERNAL, UNKNOWN, UNIMPLEMENTED, ...)  FatalRequestError(internal)
asyncio.TimeoutError / TimeoutError, OSError              RetryableError(unavailable)
ValueError / TypeError (the request cannot be encoded)    FatalRequestError(bad_request)
========================================================  ================================

Lifecycle: :meth:`start` (or the first ``match``/``forward``/``register_worker`` on a running
loop) opens lazily connected channels and the forwarder tasks; :meth:`aclose` ends them.

Forwarding (:meth:`IndexerClient.forward`) is non-blocking: the batch is appended to each
replica's bounded FIFO (``forward_buffer`` batches) and a background task per replica sends it
in order, in ``ApplyKvBatches`` chunks, one chunk in flight, with tenacity retries built by
:class:`mesh.retry.RetryPolicy` (always bounded). Delivery is at least once (the indexer drops
duplicates by (worker, rank, epoch, seq)). Nothing is dropped silently:

* when a retry cycle gives up, that is counted (``forward_give_ups``), the chunk stays at the head
  of the queue and is re-sent once the replica's breaker lets a probe through;
* a batch that finds the queue full is counted (``forward_dropped``) and its stream is marked
  *dirty* for that replica; once the replica has room again (queue below half), each dirty stream
  turns into ``on_resync(worker_id, dp_rank, "overflow")``;
* verdicts asking for a resync (GAP, UNTRUSTED, REJECTED) call
  ``on_resync(worker_id, dp_rank, "gap" | "untrusted" | "rejected")``; a replica that restarted
  (its ``server_instance`` changed) gets every stream this client forwarded resynced
  (``"indexer_restarted"``).

``on_resync`` is called at most once per stream per ``resync_holdoff_s`` (several replicas, or a
burst of batches after one gap, ask once); a RESYNCED or NEW_EPOCH verdict ends the hold-off.
:meth:`register_worker` / :meth:`forget_worker` travel through the same ordered queues, so a
forget is never overtaken by the worker's earlier batches.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

import grpc

from mesh.errors import (AuthError, ClientStateError, ConfigError, ErrorCode, FatalRequestError, MeshError,
                         RequestError, RetryableError)
from mesh.index import WorkerMatch
from mesh.indexer import indexer_pb2 as pb
from mesh.indexer import indexer_pb2_grpc as pb_grpc
from mesh.logs import RateLimiter, get_logger
from mesh.retry import RetryPolicy

__all__ = ["IndexerClient", "MatchView", "CircuitBreaker", "BreakerState", "parse_endpoint", "events_from_body",
           "read_token_file", "indexer_error", "MAX_MESSAGE_BYTES"]

#: Default message cap, the server's default (``mesh indexer --max-message-bytes``).
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
_ENVELOPE_BYTES = 64 << 10  # room for the rest of an ApplyKvBatches around one batch
OWNER_METADATA = "x-mesh-owner"  # the server imports it from here


def _channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Reconnect quickly once a restarted indexer is back (gRPC's default backoff grows to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


_S = grpc.StatusCode
#: Statuses meaning "not processed, another try may succeed".
_RETRYABLE = frozenset({_S.UNAVAILABLE, _S.DEADLINE_EXCEEDED, _S.ABORTED, _S.CANCELLED})
_BAD_REQUEST = frozenset({_S.INVALID_ARGUMENT, _S.OUT_OF_RANGE, _S.FAILED_PRECONDITION})


def indexer_error(exc: BaseException, endpoint: str, rpc: str) -> MeshError:
    """The indexer client's one error boundary: what ``rpc`` against ``endpoint`` raised, as a
    :mod:`mesh.errors` exception (table in the module docstring) whose message names both.
    A :class:`~mesh.errors.MeshError` is returned as it is; the original is the ``__cause__``."""
    if isinstance(exc, MeshError):
        return exc
    where = f"indexer {endpoint} {rpc}"
    err: RequestError
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        details = (exc.details() if callable(getattr(exc, "details", None)) else "") or ""
        msg = f"{where}: {code.name if code is not None else 'RPC failed'}: {details}"[:500]
        if code in _RETRYABLE:
            err = RetryableError(ErrorCode.UNAVAILABLE, msg)
        elif code is _S.RESOURCE_EXHAUSTED:
            if "larger than max" in details:  # gRPC's message size cap, on either side
                err = FatalRequestError(ErrorCode.TOO_LARGE, msg)
            elif rpc == "MatchPrefix":  # the indexer sheds queries beyond its in-flight bound
                err = RetryableError(ErrorCode.OVERLOADED, msg)
            else:  # a bound of the indexer's state (workers, streams): retrying will not free it
                err = FatalRequestError(ErrorCode.RATE_LIMITED, msg)
        elif code in (_S.UNAUTHENTICATED, _S.PERMISSION_DENIED):
            err = AuthError(ErrorCode.UNAUTHORIZED, msg)
        elif code in _BAD_REQUEST:
            err = FatalRequestError(ErrorCode.BAD_REQUEST, msg)
        else:
            err = FatalRequestError(ErrorCode.INTERNAL, msg)
    elif isinstance(exc, TimeoutError):  # asyncio.TimeoutError is TimeoutError (an OSError): first
        err = RetryableError(ErrorCode.UNAVAILABLE, f"{where}: timed out")
    elif isinstance(exc, OSError):
        err = RetryableError(ErrorCode.UNAVAILABLE, f"{where}: {type(exc).__name__}: {exc}"[:500])
    elif isinstance(exc, (ValueError, TypeError)):
        err = FatalRequestError(ErrorCode.BAD_REQUEST, f"{where}: request cannot be encoded: {exc}"[:500])
    else:
        err = FatalRequestError(ErrorCode.INTERNAL, f"{where}: {exc!r}"[:500])
    err.__cause__ = exc
    return err


def _status(exc: BaseException) -> grpc.StatusCode | None:
    """The gRPC status behind an error (the breaker and the auth counters read it)."""
    while exc is not None and not isinstance(exc, grpc.RpcError):
        exc = exc.__cause__  # type: ignore[assignment]
    if exc is None or not callable(getattr(exc, "code", None)):
        return None
    return exc.code()


_DEGRADED_REASON = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.CANCELLED: "timeout",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.PERMISSION_DENIED: "permission_denied",
}
#: Refusals of a healthy replica (not breaker failures): ownership, a bound, a bad argument.
_ANSWERED = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.INVALID_ARGUMENT})
_RESYNC_REASON = {pb.GAP: "gap", pb.UNTRUSTED: "untrusted", pb.REJECTED: "rejected"}


def parse_endpoint(endpoint: str, field: str = "kv_indexer_endpoint") -> tuple[str, bool]:
    """``http://HOST:PORT`` / ``https://HOST:PORT`` / ``unix:PATH`` -> (gRPC target, tls)."""
    ep = endpoint.strip()
    if ep.startswith("unix:"):
        if len(ep) <= len("unix:"):
            raise ConfigError(f"{field}: {endpoint!r} has no socket path")
        return ep, False
    for scheme, tls in (("http://", False), ("https://", True)):
        if ep.startswith(scheme):
            hostport = ep[len(scheme):].rstrip("/")
            host, sep, port = hostport.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in hostport:
                raise ConfigError(f"{field}: {endpoint!r} must be {scheme}HOST:PORT")
            return hostport, tls
    raise ConfigError(f"{field}: {endpoint!r} needs an explicit http:// or https:// scheme (or unix:)")


def read_token_file(path: str, field: str = "kv_indexer_token_file") -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped). ConfigError (naming
    ``field``) when the file is missing, empty or holds more than one word."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path!r}: {exc.strerror or exc}") from None
    if not token:
        raise ConfigError(f"{field}: {path!r} is empty")
    if any(ch.isspace() for ch in token) or not token.isprintable():
        raise ConfigError(f"{field}: {path!r} must hold one token (printable, no whitespace)")
    return token


def events_from_body(body: bytes) -> bytes:
    """The raw msgpack ``events`` array of a KV_EVENTS body, sliced out without decoding it.

    (Brokers can also forward the whole body: ``forward(..., body)`` with ``is_body=True``.)
    Raises ValueError when the body is not a msgpack map with an ``events`` key.
    """
    import msgpack

    u = msgpack.Unpacker(raw=False, strict_map_key=True)
    u.feed(body)
    try:
        n = u.read_map_header()
        for _ in range(n):
            key = u.unpack()
            if key == "events":
                start = u.tell()
                u.skip()
                return body[start:u.tell()]
            u.skip()
    except Exception as exc:
        raise ValueError(f"not a KV_EVENTS body: {exc}") from exc
    raise ValueError("KV_EVENTS body without 'events'")


# ---------------------------------------------------------------------- circuit breaker


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Consecutive-failure breaker (pure: the caller passes ``now_s``, monotonic seconds).

    CLOSED: everything passes; ``failures`` consecutive failures open it. OPEN: nothing passes
    until ``reset_s`` has elapsed, then one probe passes (HALF_OPEN). The probe's success closes
    it; its failure re-opens it for another ``reset_s``.
    """

    __slots__ = ("failures", "reset_s", "state", "consecutive", "opened_at", "probe_inflight", "opens")

    def __init__(self, failures: int = 5, reset_s: float = 2.0) -> None:
        self.failures = failures
        self.reset_s = reset_s
        self.state = BreakerState.CLOSED
        self.consecutive = 0
        self.opened_at = 0.0
        self.probe_inflight = False
        self.opens = 0

    def allow(self, now_s: float) -> bool:
        """May a call go out now? (Takes the half-open probe slot when it returns True there.)"""
        st = self.state
        if st is BreakerState.CLOSED:
            return True
        if st is BreakerState.OPEN:
            if now_s - self.opened_at < self.reset_s:
                return False
            self.state = BreakerState.HALF_OPEN
            self.probe_inflight = True
            return True
        if self.probe_inflight:
            return False
        self.probe_inflight = True
        return True

    def retry_in(self, now_s: float) -> float:
        """Seconds until :meth:`allow` may say yes (0 when closed)."""
        if self.state is BreakerState.OPEN:
            return max(0.0, self.opened_at + self.reset_s - now_s)
        return 0.0

    def success(self) -> None:
        self.state = BreakerState.CLOSED
        self.consecutive = 0
        self.probe_inflight = False

    def failure(self, now_s: float) -> None:
        self.consecutive += 1
        self.probe_inflight = False
        if self.state is BreakerState.HALF_OPEN or (self.state is BreakerState.CLOSED and self.consecutive >= self.failures):
            self.state = BreakerState.OPEN
            self.opened_at = now_s
            self.opens += 1


# ---------------------------------------------------------------------- match view


class MatchView:
    """One indexer answer, shaped like :class:`mesh.index.MatchResult` (what the policies read).

    ``top(k)`` and ``levels()`` return :class:`mesh.index.WorkerMatch` objects (deepest first,
    ties by worker id); ``matched_blocks(w)`` builds a worker table on first use. Detached from
    the index: valid forever.
    """

    __slots__ = ("query_blocks", "best_blocks", "blocks_read", "matched_workers", "server_time_ns", "replica",
                 "incomplete", "_levels", "_by_worker", "_tiers")

    def __init__(self, resp: pb.MatchPrefixResponse, replica: str = "", incomplete: bool = False) -> None:
        # incomplete: the replica restarted and its resyncs are not all in yet (routers count the
        # decision degraded: it may under-report what workers hold)
        self.incomplete = incomplete
        self.query_blocks = resp.query_blocks
        self.best_blocks = resp.best_prefix_blocks
        self.blocks_read = resp.blocks_read
        self.matched_workers = resp.matched_workers
        self.server_time_ns = resp.server_time_ns
        self.replica = replica
        self._levels = resp.levels
        self._by_worker: dict[str, int] | None = None
        self._tiers: dict[str, tuple[int, int]] | None = None

    @property
    def empty(self) -> bool:
        return not self._levels

    def lower_tier_blocks(self, worker_id: str) -> tuple[int, int]:
        """``(host, store)`` matched blocks held only off the device (mesh.index.tiers)."""
        t = self._tiers
        if t is None:
            t = self._tiers = {w: (h, s) for lvl in self._levels if lvl.host_blocks
                               for w, h, s in zip(lvl.worker_ids, lvl.host_blocks, lvl.store_blocks)}
        return t.get(worker_id, (0, 0))

    def _table(self) -> dict[str, int]:
        t = self._by_worker
        if t is None:
            t = {}
            for lvl in reversed(self._levels):  # deepest last, so it wins (ids are unique anyway)
                t.update(dict.fromkeys(lvl.worker_ids, lvl.matched_blocks))
            self._by_worker = t
        return t

    def matched_blocks(self, worker_id: str) -> int:
        return self._table().get(worker_id, 0)

    def get(self, worker_id: str) -> WorkerMatch | None:
        depth = self._table().get(worker_id)
        if depth is None:
            return None
        for lvl in self._levels:
            if lvl.matched_blocks == depth:
                i = list(lvl.worker_ids).index(worker_id)
                return WorkerMatch(worker_id, depth, lvl.dp_ranks[i] if i < len(lvl.dp_ranks) else 0, False)
        return None  # pragma: no cover - the table is built from these levels

    def top(self, k: int) -> list[WorkerMatch]:
        out: list[WorkerMatch] = []
        if k <= 0:
            return out
        for lvl in self._levels:
            ids = lvl.worker_ids
            ranks = lvl.dp_ranks
            take = min(len(ids), k - len(out))
            d = lvl.matched_blocks
            out.extend(WorkerMatch(ids[i], d, ranks[i] if i < len(ranks) else 0, False) for i in range(take))
            if len(out) >= k:
                break
        return out

    def levels(self) -> Iterator[tuple[int, list[WorkerMatch]]]:
        for lvl in self._levels:
            d = lvl.matched_blocks
            ranks = lvl.dp_ranks
            yield d, [WorkerMatch(w, d, ranks[i] if i < len(ranks) else 0, False) for i, w in enumerate(lvl.worker_ids)]

    def to_dict(self) -> dict[str, WorkerMatch]:
        return {m.worker_id: m for _, ms in self.levels() for m in ms}

    def __repr__(self) -> str:
        return (f"MatchView(query_blocks={self.query_blocks}, best_blocks={self.best_blocks}, "
                f"matched_workers={self.matched_workers}, replica={self.replica!r})")


# ---------------------------------------------------------------------- replicas


# Queue items: ("b", worker_id, dp_rank, epoch, seq, payload, is_body) or ("r", worker_id, block_size,
# dp_ranks) / ("f", worker_id, 0) control items, which are never dropped, and ("m", "", 0): the end
# of the re-registrations after a restart (the replica's coverage can be judged from there on).
_Item = tuple


class _Replica:
    __slots__ = ("endpoint", "target", "tls", "channel", "stub", "breaker", "queue", "wake", "dirty", "instance",
                 "task", "probe", "last_error", "error", "sent_batches", "sending", "reregistering", "uncovered",
                 "rtt_s")

    def __init__(self, endpoint: str, breaker: CircuitBreaker) -> None:
        self.endpoint = endpoint
        self.target, self.tls = parse_endpoint(endpoint)
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.IndexerStub | None = None
        self.breaker = breaker
        self.queue: deque[_Item] = deque()
        self.wake = asyncio.Event()
        self.dirty: dict[tuple[str, int], str] = {}
        self.instance: int | None = None
        self.task: asyncio.Task | None = None
        self.probe: asyncio.Task | None = None  # the restart probe and registration keep-alive
        # Readiness: after a restart, not ready until this client's re-registrations are in and
        # the replica reports every stream it was told of covered (uncovered_streams == 0).
        self.reregistering = False
        self.uncovered = 0  # as the replica last reported it (MatchPrefix answers, Stats probes)
        self.rtt_s: float | None = None  # moving average of its query round trips (None: none yet)
        self.last_error = ""  # str(error), for stats()
        self.error: MeshError | None = None  # the latest failure, mapped by indexer_error
        self.sent_batches = 0
        self.sending = 0  # items at the head of the queue currently in an RPC


class _State(StrEnum):
    UNOPENED = "unopened"
    OPENED = "opened"
    CLOSED = "closed"


class IndexerClient:
    """Broker-side client of one or more indexer replicas (see the module docstring)."""

    def __init__(self, endpoints: Sequence[str], *, query_timeout_ms: float = 100, max_inflight: int = 32,
                 forward_buffer: int = 10_000, breaker_failures: int = 5, breaker_reset_s: float = 2.0,
                 on_resync: Callable[[str, int, str], Any] | None = None, ca_file: str | None = None,
                 max_results: int = 0, forward_chunk_batches: int = 512, forward_chunk_bytes: int = 4 << 20,
                 forward_retry: RetryPolicy | None = None, apply_timeout_s: float = 10.0,
                 resync_holdoff_s: float = 1.0, token: str | None = None, token_file: str | None = None,
                 owner: str | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 client_cert: str | None = None, client_key: str | None = None, probe_interval_s: float = 2.0,
                 keepalive_s: float = 60.0) -> None:
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        if not endpoints:
            raise ConfigError("kv_indexer_endpoint: at least one endpoint is required")
        if not query_timeout_ms > 0:
            raise ConfigError("kv_indexer_query_timeout_ms: must be > 0")
        if max_inflight < 1:
            raise ConfigError("kv_indexer_query_max_inflight: must be > 0")
        if forward_buffer < 1:
            raise ConfigError("kv_indexer_forward_buffer: must be > 0")
        if breaker_failures < 1:
            raise ConfigError("kv_indexer_breaker_failures: must be >= 1")
        if not breaker_reset_s > 0:
            raise ConfigError("kv_indexer_breaker_reset_s: must be > 0")
        if ca_file is not None and not Path(ca_file).is_file():
            raise ConfigError(f"kv_indexer_ca: no such file {ca_file!r}")
        if token is not None and token_file is not None:
            raise ConfigError("kv_indexer_token_file: give a token or a token file, not both")
        if token_file is not None:
            token = read_token_file(token_file)
        if token is not None and (not token or any(ch.isspace() for ch in token) or not token.isprintable()):
            raise ConfigError("kv_indexer_token: must be one printable word")
        owner = f"{socket.gethostname()}:{os.getpid()}" if owner is None else owner
        if not owner or len(owner) > 128 or not owner.isprintable():
            raise ConfigError("kv_indexer_owner: must be 1..128 printable characters")
        if max_message_bytes < 2 * _ENVELOPE_BYTES:
            raise ConfigError(f"kv_indexer_max_message_bytes: must be >= {2 * _ENVELOPE_BYTES}")
        if (client_cert is None) != (client_key is None):
            raise ConfigError("kv_indexer_client_cert: give the certificate and its key together")
        for name, path in (("kv_indexer_client_cert", client_cert), ("kv_indexer_client_key", client_key)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{name}: no such file {path!r}")
        self.replicas = [_Replica(ep, CircuitBreaker(breaker_failures, breaker_reset_s)) for ep in endpoints]
        if len({r.target for r in self.replicas}) != len(self.replicas):
            raise ConfigError("kv_indexer_endpoint: the same endpoint is given twice")
        self.query_timeout_s = query_timeout_ms / 1000.0
        self.max_inflight = max_inflight
        self.forward_buffer = forward_buffer
        self.on_resync = on_resync
        self.ca_file = ca_file
        self.client_cert, self.client_key = client_cert, client_key
        self.owner = owner
        md = [(OWNER_METADATA, owner)]
        if token is not None:
            md.append(("authorization", f"Bearer {token}"))
        self._md = tuple(md)  # sent with every RPC
        self.max_message_bytes = max_message_bytes
        self.max_batch_bytes = max_message_bytes - _ENVELOPE_BYTES  # one batch must fit in one ApplyKvBatches
        self.max_results = max_results
        self.chunk_batches = forward_chunk_batches
        self.chunk_bytes = min(forward_chunk_bytes, self.max_batch_bytes)
        self.retry = forward_retry or RetryPolicy(max_attempts=4, base_ms=25.0, cap_ms=250.0)
        self.apply_timeout_s = apply_timeout_s
        self.resync_holdoff_s = resync_holdoff_s
        self.inflight = 0
        self.last_degraded_reason: str | None = None
        self.c: Counter[str] = Counter()
        self.degraded: Counter[str] = Counter()
        self.resyncs: Counter[str] = Counter()
        self.verdicts: Counter[str] = Counter()
        self._streams: set[tuple[str, int]] = set()  # streams forwarded (resynced after a restart)
        # Live workers this client registered (worker id -> page size): re-registered after a replica
        # restart and every ``keepalive_s``, so an idle live worker is never expired by the indexer.
        self._workers: dict[str, int] = {}
        self.probe_interval_s = probe_interval_s  # 0: notice restarts only on the next forwarded batch
        self.keepalive_s = keepalive_s
        self._resync_at: dict[tuple[str, int], float] = {}
        self._state = _State.UNOPENED
        self._last_error: MeshError | None = None
        self.log = get_logger(service="indexer_client")
        self._rl = RateLimiter(1.0)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Open the channels (lazily connected) and start one forwarder task per replica.

        Optional: the first :meth:`match` or :meth:`forward` made on a running loop opens the
        client too. Call :meth:`aclose` on shutdown either way.
        """
        if self._state is not _State.UNOPENED:
            raise ClientStateError(f"IndexerClient cannot be started when {self._state.value}")
        self._open()

    def _open(self) -> None:
        creds = None
        if any(r.tls for r in self.replicas):
            files = {}
            for field, path in (("kv_indexer_ca", self.ca_file), ("kv_indexer_client_key", self.client_key),
                                ("kv_indexer_client_cert", self.client_cert)):
                try:
                    files[field] = Path(path).read_bytes() if path else None
                except OSError as exc:
                    raise ConfigError(f"{field}: cannot read {path!r}: {exc.strerror or exc}") from None
            ca, key, chain = files["kv_indexer_ca"], files["kv_indexer_client_key"], files["kv_indexer_client_cert"]
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)
        options = _channel_options(self.max_message_bytes)
        try:
            for r in self.replicas:
                if r.tls:
                    r.channel = grpc.aio.secure_channel(r.target, creds, options=options)
                else:
                    r.channel = grpc.aio.insecure_channel(r.target, options=options)
                r.stub = pb_grpc.IndexerStub(r.channel)
                r.task = asyncio.create_task(self._forward_loop(r), name=f"indexer-forward-{r.endpoint}")
                if self.probe_interval_s > 0:
                    r.probe = asyncio.create_task(self._probe_loop(r), name=f"indexer-probe-{r.endpoint}")
        except BaseException:
            for r in self.replicas:  # nothing was sent yet: drop what was built
                for t in (r.task, r.probe):
                    if t is not None:
                        t.cancel()
                r.task = r.probe = r.stub = r.channel = None
            raise
        self._state = _State.OPENED

    async def aclose(self) -> None:
        """Stop forwarding and close the channels (idempotent). Unsent batches are counted."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        tasks = [t for r in self.replicas for t in (r.task, r.probe) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for r in self.replicas:
            self.c["forward_unsent_at_close"] += sum(1 for it in r.queue if it[0] == "b")
            r.queue.clear()
            if r.channel is not None:
                await r.channel.close(grace=None)
                r.channel = None

    async def __aenter__(self) -> "IndexerClient":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ errors
    @property
    def last_error(self) -> MeshError | None:
        """The latest failure of any RPC (query, forward, control), as :func:`indexer_error`
        mapped it (None: none yet). A degraded :meth:`match` leaves its cause here."""
        return self._last_error

    def _failed(self, rep: _Replica, exc: BaseException, rpc: str, what: str) -> MeshError:
        """Account for a failed RPC (breaker, counters, ``last_error``) and return it mapped.

        A replica that answered with a considered refusal (PERMISSION_DENIED, RESOURCE_EXHAUSTED,
        INVALID_ARGUMENT) is alive: that is no breaker failure."""
        err = indexer_error(exc, rep.endpoint, rpc)
        code = _status(exc)
        if code in _ANSWERED:
            rep.breaker.success()
        elif code is None and isinstance(err, RequestError) and err.code is ErrorCode.BAD_REQUEST:
            rep.breaker.probe_inflight = False  # the request could not be encoded: nothing was sent
        else:
            rep.breaker.failure(time.monotonic())
        rep.error, rep.last_error = err, str(err)[:200]
        self._last_error = err
        if code is grpc.StatusCode.UNAUTHENTICATED or (code is grpc.StatusCode.PERMISSION_DENIED and what != "control"):
            self._auth_failed(rep, what, code)
        elif code is grpc.StatusCode.PERMISSION_DENIED:
            self.c["control_denied"] += 1  # ownership: another broker registered that worker
        return err

    async def fetch_stats(self, replica: int = 0, timeout_s: float = 2.0) -> pb.StatsResponse:
        """The replica's Stats(); raises the :func:`indexer_error` of a failure (RetryableError
        when the indexer is unreachable, AuthError for a missing or wrong token, ...)."""
        if self._state is not _State.OPENED:
            if self._state is _State.CLOSED:
                raise ClientStateError("IndexerClient used after aclose()")
            self._open()
        rep = self.replicas[replica]
        try:
            return await rep.stub.Stats(pb.StatsRequest(), timeout=timeout_s, metadata=self._md)
        except (grpc.RpcError, OSError, asyncio.TimeoutError) as exc:
            raise self._failed(rep, exc, "Stats", "stats") from exc

    # ------------------------------------------------------------------ queries
    @staticmethod
    def _ready(rep: _Replica) -> bool:
        """Complete as far as this client knows: re-registered after any restart, nothing uncovered."""
        return not rep.reregistering and rep.uncovered == 0

    def _ordered(self, reps: list[_Replica]) -> list[_Replica]:
        """Query order: ready replicas first; among those, the markedly slower ones (round trips
        above twice the fastest ready one plus 2 ms) after the others; otherwise list order. A
        replica not measured yet counts as fast, so every replica gets tried (and a dead one's
        breaker opens) instead of being skipped for want of a figure."""
        rtts = [r.rtt_s for r in reps if r.rtt_s is not None and self._ready(r)]
        slow_s = 2 * min(rtts) + 0.002 if rtts else float("inf")
        return sorted(reps, key=lambda r: (not self._ready(r), r.rtt_s is not None and r.rtt_s > slow_s))

    def _degrade(self, reason: str) -> None:
        self.degraded[reason] += 1
        self.last_degraded_reason = reason

    async def match(self, keys: Sequence[int], block_size: int) -> MatchView | None:
        """Per-worker prefix matches for content ``keys``; None when degraded. Never raises
        (except CancelledError when the caller is cancelled)."""
        if self._state is not _State.OPENED:
            if self._state is _State.CLOSED:
                self._degrade("closed")
                return None
            self._open()
        if self.inflight >= self.max_inflight:
            self._degrade("overloaded")
            return None
        self.inflight += 1
        try:
            return await self._match(keys, block_size)
        finally:
            self.inflight -= 1

    async def _match(self, keys: Sequence[int], block_size: int) -> MatchView | None:
        clock = time.monotonic
        t_start = clock()
        deadline = t_start + self.query_timeout_s
        req = None
        reason = "breaker_open"
        reps = self.replicas
        if len(reps) > 1:
            reps = self._ordered(reps)
        for rep in reps:
            now = clock()
            if not rep.breaker.allow(now):
                continue
            remaining = deadline - now
            if remaining <= 0:
                rep.breaker.probe_inflight = False
                reason = "timeout"
                break
            try:
                if req is None:
                    req = pb.MatchPrefixRequest(keys=keys, block_size=block_size, max_results=self.max_results)
                resp = await rep.stub.MatchPrefix(req, timeout=remaining, metadata=self._md)
            except asyncio.CancelledError:
                rep.breaker.probe_inflight = False
                raise
            except Exception as exc:  # never let the indexer fail a request: degrade, say why
                # A shedding replica (RESOURCE_EXHAUSTED) is alive and already protected: no
                # breaker failure, but the next replica is tried.
                err = self._failed(rep, exc, "MatchPrefix", "query")
                code = _status(exc)
                if code is None and isinstance(err, RequestError) and err.code is ErrorCode.BAD_REQUEST:
                    self.c["query_bad_input"] += 1  # keys not u64, block_size out of range: no RPC was sent
                    if self._rl.allow("bad_input"):
                        self.log.warning("indexer_query_bad_input", error=str(err)[:200])
                    reason = "error"
                    break
                if isinstance(err, RequestError) and err.code is ErrorCode.TOO_LARGE:
                    reason = "too_large"
                elif code is not None:
                    reason = _DEGRADED_REASON.get(code, "error")
                else:
                    reason = "timeout" if isinstance(exc, TimeoutError) else "unavailable" if isinstance(exc, OSError) else "error"
                continue
            rep.breaker.success()
            self.c["queries_ok"] += 1
            rtt = clock() - now
            rep.rtt_s = rtt if rep.rtt_s is None else rep.rtt_s + 0.2 * (rtt - rep.rtt_s)
            if resp.server_instance and rep.instance is not None and resp.server_instance != rep.instance:
                self._replica_restarted(rep, resp.server_instance, "query")
            rep.uncovered = resp.uncovered_streams
            incomplete = not self._ready(rep)
            if incomplete:
                self.c["queries_incomplete_coverage"] += 1
            return MatchView(resp, rep.endpoint, incomplete)
        self._degrade(reason)
        if self._rl.allow(("degraded", reason)):
            self.log.warning("indexer_query_degraded", reason=reason)
        return None

    # ------------------------------------------------------------------ forwarding
    def forward(self, worker_id: str, dp_rank: int, epoch: int, seq: int, events_msgpack: bytes, *,
                is_body: bool = False) -> None:
        """Queue one KV event batch for every replica (non-blocking; see the module docstring).

        ``events_msgpack`` is the msgpack ``events`` array of a KV_EVENTS body, or with
        ``is_body=True`` the whole body (``KvEventsMsg.raw``) forwarded verbatim.
        """
        if self._state is not _State.OPENED:
            if self._state is _State.CLOSED:
                self.c["forward_after_close"] += 1
                return
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass  # queued; sent once started on a loop
            else:
                self._open()
        stream = (worker_id, dp_rank)
        self._streams.add(stream)
        self.c["forward_enqueued"] += 1
        if len(events_msgpack) > self.max_batch_bytes:
            self.c["forward_too_large"] += 1
            if self._rl.allow(("too_large", worker_id)):
                self.log.warning("indexer_batch_too_large", worker_id=worker_id, dp_rank=dp_rank,
                                 bytes=len(events_msgpack), limit=self.max_batch_bytes)
            return
        item = ("b", worker_id, dp_rank, epoch, seq, events_msgpack, is_body)
        for rep in self.replicas:
            if len(rep.queue) >= self.forward_buffer:
                self.c["forward_dropped"] += 1
                rep.dirty.setdefault(stream, "overflow")
                continue
            rep.queue.append(item)
            rep.wake.set()

    def forward_kv_events(self, worker_id: str, msg: Any) -> None:
        """Forward a decoded :class:`mesh.protocol.KvEventsMsg` by its raw body (no re-encoding)."""
        self.forward(worker_id, msg.dp_rank, msg.epoch, msg.seq, msg.raw, is_body=True)

    async def register_worker(self, worker_id: str, block_size: int) -> None:
        """Declare the worker's page size on every replica (queued in order with its batches)."""
        self._workers[worker_id] = block_size
        self._control(("r", worker_id, block_size))

    async def forget_worker(self, worker_id: str) -> None:
        """Drop the worker from every replica, after the batches already queued for it."""
        self._streams = {s for s in self._streams if s[0] != worker_id}
        self._workers.pop(worker_id, None)
        for s in [s for s in self._resync_at if s[0] == worker_id]:
            del self._resync_at[s]
        self._control(("f", worker_id, 0))

    def _control(self, item: _Item) -> None:
        if self._state is _State.CLOSED:
            return
        if self._state is _State.UNOPENED:
            self._open()  # called from a coroutine: a loop is running
        for rep in self.replicas:
            if item[0] == "f":
                for s in [s for s in rep.dirty if s[0] == item[1]]:
                    del rep.dirty[s]
            rep.queue.append(item)  # control items may exceed the bound: tiny, rare, never dropped
            rep.wake.set()

    def _request_resync(self, worker_id: str, dp_rank: int, reason: str) -> bool:
        """Call on_resync unless the stream is in its hold-off; False when held off."""
        stream = (worker_id, dp_rank)
        now = time.monotonic()
        last = self._resync_at.get(stream)
        if last is not None and now - last < self.resync_holdoff_s:
            self.c["resyncs_suppressed"] += 1
            return False
        self._resync_at[stream] = now
        self.resyncs[reason] += 1
        for rep in self.replicas:  # the snapshot reaches every replica
            rep.dirty.pop(stream, None)
        if self.on_resync is None:
            return True
        try:
            r = self.on_resync(worker_id, dp_rank, reason)
            if inspect.isawaitable(r):
                asyncio.ensure_future(r)
        except Exception as exc:  # the broker's callback must not kill the forwarder
            self.c["on_resync_errors"] += 1
            self.log.warning("on_resync_failed", worker_id=worker_id, dp_rank=dp_rank, error=repr(exc)[:200])
        return True

    async def _forward_loop(self, rep: _Replica) -> None:
        q = rep.queue
        while True:
            if not q:
                rep.wake.clear()
                if rep.dirty:
                    self._flush_dirty(rep)
                    if rep.dirty:  # held off or replica not healthy yet: look again later
                        try:
                            await asyncio.wait_for(rep.wake.wait(), self.resync_holdoff_s / 2)
                        except asyncio.TimeoutError:
                            pass
                        continue
                await rep.wake.wait()
                continue
            head = q[0]
            if head[0] != "b":
                rep.sending = 1
                try:
                    done = await self._send_control(rep, head)
                except Exception as exc:
                    done = True
                    self.c["control_errors"] += 1
                    self.log.exception("indexer_control_failed", endpoint=rep.endpoint, error=repr(exc)[:200])
                finally:
                    rep.sending = 0
                if done:
                    q.popleft()
                continue
            chunk: list[_Item] = []
            size = 0
            for it in q:
                if it[0] != "b" or len(chunk) >= self.chunk_batches or (chunk and size + len(it[5]) > self.chunk_bytes):
                    break
                chunk.append(it)
                size += len(it[5])
            rep.sending = len(chunk)
            try:
                done = await self._send_chunk(rep, chunk)
            except Exception as exc:  # a bug here must not stop forwarding: drop, count, resync
                done = True
                self.c["forward_errors"] += len(chunk)
                self.log.exception("indexer_forward_failed", endpoint=rep.endpoint, error=repr(exc)[:200])
                for it in chunk:
                    rep.dirty.setdefault((it[1], it[2]), "forward_error")
            finally:
                rep.sending = 0
            if not done:
                continue  # a retry cycle gave up: the chunk stays at the head (re-sent once the breaker admits)
            for _ in range(len(chunk)):
                q.popleft()
            if rep.dirty and len(q) <= self.forward_buffer // 2:
                self._flush_dirty(rep)

    def _flush_dirty(self, rep: _Replica) -> None:
        if rep.breaker.state is not BreakerState.CLOSED:
            return  # resync into a replica that can take the snapshot
        for (w, r), reason in list(rep.dirty.items()):
            if (w, r) in rep.dirty:
                self._request_resync(w, r, reason)  # issued: removed from every dirty set

    async def _wait_for_breaker(self, rep: _Replica) -> None:
        """Sleep until the breaker lets a call through (it then holds the probe slot)."""
        while True:
            now = time.monotonic()
            if rep.breaker.allow(now):
                return
            await asyncio.sleep(min(1.0, max(0.02, rep.breaker.retry_in(now))))

    async def _rpc(self, rep: _Replica, call: Callable[[], Any], rpc: str, what: str) -> Any:
        """One retry cycle of ``call``, built by :class:`mesh.retry.RetryPolicy` (tenacity, always
        bounded), each attempt once the replica's breaker admits it. Failures leave through
        :meth:`_failed` (the :func:`indexer_error` boundary): a ``RetryableError`` is retried, and
        raised when the cycle gives up; any other mapped error is raised at once."""
        async for attempt in self.retry.async_retrying((RetryableError,), log=self.log):
            with attempt:
                if attempt.retry_state.attempt_number > 1:
                    self.c[f"{what}_retried"] += 1
                await self._wait_for_breaker(rep)
                try:
                    res = await call()
                except (grpc.RpcError, OSError, asyncio.TimeoutError) as exc:
                    raise self._failed(rep, exc, rpc, what) from exc
        rep.breaker.success()
        return res

    def _gave_up(self, rep: _Replica, what: str) -> None:
        self.c[f"{what}_give_ups"] += 1
        if self._rl.allow(("give_up", rep.endpoint)):
            self.log.warning("indexer_forward_give_up", endpoint=rep.endpoint, error=rep.last_error, queued=len(rep.queue))

    async def _send_chunk(self, rep: _Replica, chunk: list[_Item]) -> bool:
        """Send one chunk; False when the retry cycle gave up (the chunk stays queued)."""
        req = pb.ApplyKvBatchesRequest()
        add = req.batches.add
        for _, w, r, e, s, payload, is_body in chunk:
            if is_body:
                add(worker_id=w, dp_rank=r, epoch=e, seq=s, kv_events_body=payload)
            else:
                add(worker_id=w, dp_rank=r, epoch=e, seq=s, events_msgpack=payload)
        try:
            resp = await self._rpc(rep, lambda: rep.stub.ApplyKvBatches(req, timeout=self.apply_timeout_s, metadata=self._md),
                                   "ApplyKvBatches", "forward")
        except RetryableError:
            self._gave_up(rep, "forward")
            return False
        except MeshError as err:  # not retryable (e.g. INVALID_ARGUMENT, too large): resync those streams
            self.c["forward_rejected"] += len(chunk)
            if isinstance(err, AuthError):
                # A configuration error, not the streams' fault: a resync would be refused too.
                return True
            self.log.warning("indexer_forward_rejected", endpoint=rep.endpoint, error=str(err)[:200], batches=len(chunk))
            for it in chunk:
                rep.dirty.setdefault((it[1], it[2]), "rejected")
            return True
        self.c["forward_rpcs"] += 1
        self.c["forward_applied"] += len(chunk)
        rep.sent_batches += len(chunk)
        if rep.instance is not None and resp.server_instance != rep.instance:
            self._replica_restarted(rep, resp.server_instance, "forward")
            for s in {(it[1], it[2]) for it in chunk}:  # just applied from scratch: don't hold them off
                self._resync_at.pop(s, None)
        rep.instance = resp.server_instance
        verdicts = self.verdicts
        for it, res in zip(chunk, resp.results):
            v = res.verdict
            verdicts[v] += 1
            if res.events_skipped:
                self.c["events_skipped_by_indexer"] += res.events_skipped
            if v == pb.REJECTED and not res.resync_needed:  # refused by a bound of the server
                self.c["forward_refused"] += 1
                if self._rl.allow(("refused", rep.endpoint)):
                    self.log.warning("indexer_batch_refused", endpoint=rep.endpoint, worker_id=it[1], dp_rank=it[2])
            if res.resync_needed:
                self._request_resync(it[1], it[2], _RESYNC_REASON.get(v, "resync"))
            elif v == pb.RESYNCED or v == pb.NEW_EPOCH:
                self._resync_at.pop((it[1], it[2]), None)
        return True

    def _replica_restarted(self, rep: _Replica, instance: int, seen_by: str) -> None:
        """A replica came back empty (its ``server_instance`` changed): register every live worker
        again and resync every stream this client forwarded, now (``seen_by``: the forward path,
        or the probe, which notices it without waiting for traffic)."""
        self.c["indexer_restarts_seen"] += 1
        self.log.warning("indexer_restarted", endpoint=rep.endpoint, streams=len(self._streams), workers=len(self._workers),
                         seen_by=seen_by)
        rep.instance = instance
        # Its coverage is incomplete until the registrations below are in (they name every stream
        # this client forwards, so the replica knows what it must get back) and it reports every
        # such stream resynced: other replicas answer first meanwhile, and what it answers is
        # counted degraded.
        rep.reregistering = True
        ranks = self._ranks_by_worker()
        # Before any batch still queued for it, but after the items in an RPC right now: the send
        # loop pops those (by count) when the RPC returns.
        at = rep.sending
        rep.queue.insert(at, ("m", "", 0))
        for wid, bs in reversed(list(self._workers.items())):
            rep.queue.insert(at, ("r", wid, bs, ranks.get(wid, ())))
        for s in self._streams:
            rep.dirty[s] = "indexer_restarted"
            self._resync_at.pop(s, None)
        rep.wake.set()

    async def _probe_loop(self, rep: _Replica) -> None:
        """Every ``probe_interval_s``: has the replica restarted (Stats ``server_instance``)? And
        every ``keepalive_s``: register the live workers again (the indexer expires workers it has
        not heard from; an idle worker sends no batches). Failures are counted, never raised."""
        loop = asyncio.get_running_loop()
        next_keepalive = loop.time() + self.keepalive_s
        while True:
            await asyncio.sleep(self.probe_interval_s)
            if not self._workers and not self._streams:
                continue
            try:
                resp = await self.fetch_stats(self.replicas.index(rep), timeout_s=max(0.5, min(2.0, self.probe_interval_s * 4)))
            except MeshError:
                self.c["probe_failed"] += 1
                continue
            self.c["probes"] += 1

            if rep.instance is None:
                rep.instance = resp.server_instance
            elif resp.server_instance != rep.instance:
                self._replica_restarted(rep, resp.server_instance, "probe")
            rep.uncovered = int(resp.uncovered_streams)
            if self.keepalive_s > 0 and loop.time() >= next_keepalive:
                next_keepalive = loop.time() + self.keepalive_s
                ranks = self._ranks_by_worker()
                for wid, bs in self._workers.items():
                    rep.queue.append(("r", wid, bs, ranks.get(wid, ())))
                self.c["keepalives"] += len(self._workers)
                rep.wake.set()

    def _ranks_by_worker(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for w, r in self._streams:
            out.setdefault(w, []).append(r)
        return out

    async def _send_control(self, rep: _Replica, item: _Item) -> bool:
        """Send one RegisterWorker / ForgetWorker; False when the retry cycle gave up (it stays queued)."""
        kind, wid, bs = item[:3]
        if kind == "m":  # the re-registrations after a restart are all in
            rep.reregistering = False
            # until the replica says otherwise (its next answer or probe), count every stream we
            # told it of as still missing: the Stats it sent before the registrations said 0
            rep.uncovered = max(rep.uncovered, len(self._streams))
            return True
        md = self._md
        if kind == "r":
            rpc = "RegisterWorker"
            ranks = sorted(item[3]) if len(item) > 3 else []
            call = lambda: rep.stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id=wid, block_size=bs, dp_ranks=ranks),  # noqa: E731
                                                   timeout=5.0, metadata=md)
        else:
            rpc = "ForgetWorker"
            call = lambda: rep.stub.ForgetWorker(pb.ForgetWorkerRequest(worker_id=wid), timeout=5.0, metadata=md)  # noqa: E731
        try:
            await self._rpc(rep, call, rpc, "control")
            self.c["register_ok" if kind == "r" else "forget_ok"] += 1
        except RetryableError:
            self._gave_up(rep, "control")
            return False
        except MeshError as err:  # counted by _failed (control_denied, auth_failures)
            self.c["control_rejected"] += 1
            self.log.warning("indexer_control_rejected", endpoint=rep.endpoint, kind=kind, worker_id=wid,
                             owner=self.owner, error=str(err)[:300])
        return True

    def _auth_failed(self, rep: _Replica, what: str, code: grpc.StatusCode) -> None:
        if code is grpc.StatusCode.UNAUTHENTICATED:
            self.c["auth_failures"] += 1
        else:
            self.c["permission_denied"] += 1
        if self._rl.allow(("auth", rep.endpoint, what)):
            self.log.error("indexer_auth_failed", endpoint=rep.endpoint, call=what, code=code.name,
                           token="set" if len(self._md) > 1 else "none", owner=self.owner)

    # ------------------------------------------------------------------ introspection
    async def server_stats(self, replica: int = 0, timeout_s: float = 2.0) -> pb.StatsResponse | None:
        """The replica's Stats() (None when unreachable or not open; :meth:`fetch_stats` says
        why). For tests, benchmarks and `mesh status`."""
        if self.replicas[replica].stub is None:
            return None
        try:
            return await self.fetch_stats(replica, timeout_s)
        except MeshError:
            return None

    def pending(self) -> int:
        """Batches queued (or in flight) over all replicas."""
        return sum(sum(1 for it in r.queue if it[0] == "b") for r in self.replicas)

    async def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every replica's queue is empty (True) or ``timeout_s`` passes (False)."""
        t_end = time.monotonic() + timeout_s
        while any(r.queue for r in self.replicas):
            if time.monotonic() >= t_end:
                return False
            await asyncio.sleep(0.005)
        return True

    def stats(self) -> dict[str, Any]:
        c = self.c
        return {
            "queries_ok": c["queries_ok"],
            "queries_degraded": dict(self.degraded),
            "query_inflight": self.inflight,
            "forward_enqueued": c["forward_enqueued"],
            "forward_queued": self.pending(),
            "forward_applied": c["forward_applied"],
            "forward_dropped": c["forward_dropped"],
            "forward_retried": c["forward_retried"],
            "forward_give_ups": c["forward_give_ups"],
            "forward_rejected": c["forward_rejected"],
            "forward_refused": c["forward_refused"],
            "auth_failures": c["auth_failures"],
            "resyncs_requested": dict(self.resyncs),
            "resyncs_suppressed": c["resyncs_suppressed"],
            "verdicts": {pb.Verdict.Name(k).lower(): v for k, v in self.verdicts.items()},
            "counters": dict(c),
            "replicas": [
                {"endpoint": r.endpoint, "breaker": r.breaker.state.value, "consecutive_failures": r.breaker.consecutive,
                 "breaker_opens": r.breaker.opens, "queued": len(r.queue), "dirty_streams": len(r.dirty),
                 "sent_batches": r.sent_batches, "server_instance": r.instance, "last_error": r.last_error,
                 "ready": self._ready(r), "uncovered_streams": r.uncovered,
                 "rtt_ms": None if r.rtt_s is None else round(r.rtt_s * 1000, 3)}
                for r in self.replicas
            ],
        }
