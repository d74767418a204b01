"""The broker: one asyncio process, two ROUTER sockets, one loop that owns both.

Data flow of one request (see :mod:`mesh.protocol` for every frame)::

    client SUBMIT -> decode -> Router.route -> REQUEST to worker -> ACCEPTED to client
    worker CHUNK* -> attempt fence -> CHUNK to client ... worker FINAL -> FINAL to client

Design rules this module keeps:

* **One owner per socket.** :meth:`Broker._pump` is the only code that touches the frontend and
  backend sockets. It runs as an event-loop callback: when a socket's file descriptor becomes
  readable, when a timer is due (heartbeats, expiry, deadlines, delayed retries), or when another
  task posts work to the mailbox. Each run drains both sockets with non-blocking receives on
  plain (synchronous) sockets, runs what is due, and re-arms one timer. No future or coroutine
  is created per message: at half load each request costs a couple of loop wake-ups, not a poll
  set-up and tear-down each time.
* **No silent drops.** Both ROUTERs run with ROUTER_MANDATORY; every send is non-blocking and a
  failed send is counted and acted on (worker: treated as lost; client: its requests cancelled).
* **Exactly one terminal frame** (FINAL or ERROR) per accepted client request. A request is
  re-dispatched (new attempt, different worker) only while nothing was streamed to the client,
  it is idempotent, attempts remain, the retry budget allows it and the deadline has not passed.
  Replies of a superseded attempt are dropped (``dropped{what=stale_reply}``).
* **Liveness for idle and busy workers.** Any inbound message refreshes a session; a session
  silent for heartbeat x liveness is expired and its requests retried or failed ``worker_lost``.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections import Counter, deque
import itertools
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from brokers.registry import Registry, WorkerSession
from brokers.stats import BrokerStats
from mesh import protocol as P
from mesh.config import BrokerSettings
from mesh.errors import ErrorCode, ProtocolError
from mesh.logs import RateLimiter, announce, get_logger
from mesh.retry import RetryBudget, RetryPolicy
from mesh.hashing import text_to_tokens
from mesh.namespaces import request_namespace
from mesh.routing.peers import apply_changes
from mesh.routing.router import Router
from mesh.routing.view import Decision, RouteRequest, WorkerState
from mesh.security import key_may_claim
from mesh.sockets import BROKER_BACKEND, BROKER_FRONTEND, CurveKeys, make_socket, recv_frames, recv_frames_user, send_frames, socket_readable

__all__ = ["Broker", "Inflight"]

_DRAIN_BATCH = 512  # max messages taken from one socket before looking at the other
_DRAIN_TICK_S = 0.05  # while draining for shutdown, re-check at least this often
# Heartbeats to workers go out in this many slices per interval (each session in its own
# slice, assigned round-robin at registration): 1,000 workers never cost one long send burst.
_HB_SLICES = 10
# One pump reads for at most this long before it runs the timers (heartbeats, expiry) and yields
# the loop: a flood on one socket or a few expensive messages never starve liveness or HTTP.
_PUMP_BUDGET_S = 0.02
# A loop stall longer than this (a slow pump, another task hogging the loop) is credited to every
# worker's liveness: the broker's own lateness is not the workers' silence.
_STALL_CREDIT_S = 0.05
_LAG_WINDOW_S = 1.0  # time constant of the loop-lag average that drives load shedding
# An in-process (HTTP) client whose reply queue holds this many frames is not reading: it is
# treated like a ZeroMQ client at its send HWM.
_LOCAL_QUEUE_MAX = 4096
# Error-rate outlier ejection: a worker with at least _OUTLIER_MIN_OUTCOMES recent outcomes whose
# error rate is >= _OUTLIER_MIN_RATE and exceeds its peers' by _OUTLIER_MARGIN is ejected.
_OUTLIER_MIN_OUTCOMES = 16
_OUTLIER_MIN_RATE = 0.5
_OUTLIER_MARGIN = 0.3
_MAX_KEY_TOKENS = 1 << 20  # prompt tokens hashed for routing while no worker has registered
# KV_EVENTS larger than this many events are applied in slices across pumps (a 4 MB batch is
# ~0.3 s of index work); while any is queued, later batches queue behind it (order per stream).
_KV_SLICE_EVENTS = 1024
_KV_BACKLOG_BUDGET_S = 0.01  # index work per pump while a backlog exists
_KV_BACKLOG_MAX_EVENTS = 200_000  # queued events at most (all workers); beyond, batches are dropped
_KV_BACKLOG_MAX_WORKER_EVENTS = 40_000  # ... and per worker (one flooding worker cannot fill it)
_SLOW_PREFILL_TOKENS_PER_S = 5000.0  # a pessimistic prefill rate for the progress window
_STATUS_CACHE_S = 0.1  # STATUS worker lists of large fleets are rebuilt at most this often
_STATUS_CACHE_MIN_WORKERS = 256  # smaller fleets always get a fresh list


@dataclass(slots=True)
class Inflight:
    """One accepted client request, owned by the broker until its terminal frame is sent."""

    rid: int
    client: bytes
    client_rid: str
    submit: P.Submit
    deadline_s: float
    attempt: int = 0
    session: WorkerSession | None = None
    decision: Decision | None = None
    route_req: RouteRequest | None = None
    chunks_sent: int = 0
    tried: set[str] = field(default_factory=set)
    retry_pending: bool = False
    parked_until_s: float | None = None
    phase: str = "mixed"  # mixed | prefill | decode (prefill/decode disaggregation)
    room: int = 0  # PD bootstrap room linking the two legs
    prefill_worker: str = ""
    prefill_usage: dict | None = None
    prefill_bootstrap: dict = field(default_factory=dict)
    holds_retry_budget: bool = False
    reason: str = ""  # routing decision reason of the current attempt
    fail_cause: str = ""  # error code of the last failed attempt
    fail_message: str = ""  # and its message (what the engine said), for the client's error
    replied: bool = False  # the current attempt's worker sent something for it (progress)
    sent_s: float = 0.0  # when the current attempt was sent (first-reply latency per worker)
    quota: bytes = b""  # whose in-flight quota it counts against (the client; an HTTP request's peer)
    model: str | None = None  # the served model it is routed to (None: any worker; see Broker._model_for)

    @property
    def committed(self) -> bool:
        """True once anything was streamed to the client: no re-dispatch after that."""
        return self.chunks_sent > 0


class Broker:
    """A mesh broker. Create, then ``await run()``; ``request_stop()`` starts a graceful drain."""

    def __init__(
        self,
        settings: BrokerSettings,
        router: Router,
        *,
        kv_sink: Any = None,
        curve: CurveKeys | None = None,
        ctx: zmq.asyncio.Context | None = None,
        worker_keys: dict[bytes, str] | None = None,
    ) -> None:
        self.s = settings
        self.router = router
        self.kv_sink = kv_sink  # optional: receives KV_EVENTS (mesh.routing providers)
        self.curve = curve
        # CURVE: z85 public key -> key name of every allow-listed worker key. A registration is
        # bound to the key its connection authenticated with (mesh.security.key_may_claim).
        self.worker_keys = worker_keys
        self._peer_key: bytes | None = None  # User-Id of the worker message being handled
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self.broker_id = settings.broker_id or f"broker-{os.getpid()}"
        self.log = get_logger(service="broker", broker_id=self.broker_id)
        self.stats = BrokerStats()
        self.registry = Registry()
        self.retry = RetryPolicy(settings.max_attempts, settings.retry_base_ms, settings.retry_cap_ms)
        self.budget = RetryBudget(settings.retry_budget_ratio, settings.retry_budget_min)
        self.rng = random.Random(settings.seed)
        self._limiter = RateLimiter(1.0)
        self._inflight: dict[int, Inflight] = {}
        self._by_client: dict[tuple[bytes, str], int] = {}
        self._rid_seq = itertools.count(1)
        self._deadlines: list[tuple[float, int]] = []
        self._parked: dict[int, None] = {}  # requests waiting for a routable worker (insertion order)
        self._park_timers: list[tuple[float, int]] = []
        self._retries: list[tuple[float, int]] = []
        self._state = "init"  # init -> serving -> draining -> closed
        self._started_s = time.monotonic()
        self.frontend_endpoint = ""
        self.backend_endpoint = ""
        self._front: zmq.Socket | None = None
        self._back: zmq.Socket | None = None
        # Mailbox: other tasks of this event loop (HTTP ingress, indexer queries, resync
        # callbacks) hand work to the socket owner through this deque and schedule a pump.
        self._mail: deque[tuple[str, Any]] = deque()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Future | None = None  # resolved when the pump has finished serving
        self._pump_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._readers: list[int] = []
        self._watch: list[zmq.Socket] = []  # sockets whose FDs the loop watches
        self._dirty: set[zmq.Socket] = set()  # sent on since their last readiness check
        self._next_hb = self._next_sweep = self._next_tel = 0.0
        self._hb_slot = 0
        self._hb_slots = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        # Local clients (the HTTP ingress): identity -> reply queue. Their identities start with
        # b"\x00" and are longer than 5 bytes, which ZeroMQ reserves, so no peer can collide.
        self._local: dict[bytes, asyncio.Queue] = {}
        self.async_provider = bool(getattr(router.provider, "is_async", False))
        self.telemetry = None
        self.telemetry_endpoint = ""
        self.exchange = None  # brokers.peer_exchange.PeerExchange with --exchange
        self.exchange_endpoint = ""
        self._xs: zmq.Socket | None = None  # its SUB (read by the pump)
        self._monitors: list[tuple[str, Any]] = []
        self._worker_tokens: dict[str, list[int]] = {}  # worker_id -> [requests, prompt tokens, cached tokens]
        self.ready = asyncio.Event()
        self._client_inflight: Counter[bytes] = Counter()  # quota key (client identity) -> its requests in flight
        self._local_quota: dict[bytes, bytes] = {}  # local (HTTP) identity -> its quota key
        self._progress: list[tuple[float, int, int]] = []  # (due_s, rid, attempt): no-progress checks
        self._due_s = float("inf")  # earliest time a pump was wanted (kick, timer): starting later is loop lag
        self._lag_s = 0.0  # time-weighted average of recent loop stalls (load shedding)
        self._lag_at_s = 0.0
        self._send_why = ""  # why the last failed send failed (send_hwm | unreachable)
        self._fleet_errors = 0  # sums of every session's outcome window (peer error rate)
        self._fleet_outcomes = 0
        self._cap_version = -1  # registry version the fleet capacity was computed at
        self._cap_tokens: dict[str | None, int] = {}  # model (None: all) -> largest KV capacity
        self._aliases = settings.aliases()  # --model-alias: name -> served model
        self._status_cache: tuple[float, list[dict]] | None = None
        self._front_first = False  # which socket the next pump reads first (alternates)
        self._kv_backlog: deque[tuple[str, bytes, int, Any]] = deque()  # (worker_id, identity, events, slice generator)
        self._kv_backlog_events: Counter[str] = Counter()  # queued events per worker

    # ------------------------------------------------------------------ lifecycle

    def bind(self) -> None:
        """Bind both ROUTERs (ports may be ``*``); the bound endpoints land in ``*_endpoint``."""
        front_spec = BROKER_FRONTEND.with_curve(self.curve, b"clients")
        back_spec = BROKER_BACKEND.with_curve(self.curve, b"workers")
        # Plain synchronous sockets on the same underlying context (same inproc namespace, same
        # ZAP handler): the pump does non-blocking I/O itself and watches their FDs, so the
        # zmq.asyncio machinery (a reader and futures per socket) would be pure overhead.
        sctx = zmq.Context.shadow(self.ctx.underlying)
        self._front = make_socket(sctx, front_spec, bind=self.s.frontend)
        try:
            self._back = make_socket(sctx, back_spec, bind=self.s.backend)
        except BaseException:
            self._front.close(linger=0)
            raise
        self._fs, self._bs = self._front, self._back
        self.frontend_endpoint = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend_endpoint = self._back.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.curve is not None:
            # Handshake failures (unlisted keys) are counted: they never reach the decode boundary.
            ev = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            self._monitors = [(path, sock.get_monitor_socket(ev)) for path, sock in (("client", self._front), ("worker", self._back))]
        if self.s.telemetry:
            from brokers.telemetry import TelemetryPublisher

            self.telemetry = TelemetryPublisher(self.ctx, self.s.telemetry, self.broker_id)
            self.telemetry_endpoint = self.telemetry.endpoint
        if self.s.exchange:
            from brokers.peer_exchange import PeerExchange

            self.exchange = PeerExchange(sctx, self.broker_id, self.s.exchange, self.s.peer, interval_ms=self.s.exchange_interval_ms,
                                         stale_ms=self.s.exchange_stale_ms, stats=self.stats.exchange, log=self.log,
                                         on_reject=lambda err: self._reject("exchange", err, b""))
            self.exchange_endpoint = self.exchange.endpoint
            self._xs = self.exchange.sub
            if self.curve is not None:
                self.log.warning("exchange_plaintext", endpoint=self.exchange_endpoint,
                                 note="the peer exchange has no CURVE: keep it on the brokers' private network")

    async def run(self) -> None:
        """Serve until :meth:`request_stop`; then drain in-flight work and close the sockets."""
        if self._front is None:
            self.bind()
        self._state = "serving"
        announce("broker_listening", broker_id=self.broker_id, frontend=self.frontend_endpoint, backend=self.backend_endpoint,
                 telemetry=self.telemetry_endpoint, exchange=self.exchange_endpoint, policy=self.router.policy.name,
                 provider=getattr(self.router.provider, "name", "none"))
        self.ready.set()
        try:
            await self._loop()
        finally:
            self.close()

    def request_stop(self) -> None:
        """Stop accepting new requests and drain (idempotent; safe from a signal handler)."""
        if self._state == "serving":
            self._state = "draining"
            self._drain_deadline_s = time.monotonic() + self.s.drain_timeout_s
            self.log.info("broker_draining", inflight=len(self._inflight))
        self._kick()

    def close(self) -> None:
        """Close sockets (idempotent)."""
        if self._state == "closed":
            return
        self._stop_io()
        if self._back is not None:
            for sess in list(self.registry.by_identity.values()):
                self._send_worker(sess.identity, P.encode_disconnect("broker_shutdown"))
        for t in list(self._tasks):
            t.cancel()
        for path, mon in self._monitors:
            mon.close(linger=0)
        if self.telemetry is not None:
            self.telemetry.close()
        if self.exchange is not None:
            self.exchange.close()
        for sock in (self._front, self._back):
            if sock is not None:
                if self._monitors:
                    sock.disable_monitor()
                sock.close(linger=500)
        self._state = "closed"
        self.log.info("broker_closed")

    def terminate(self) -> None:
        """Terminate the broker's own context after :meth:`close` and after any other user of the
        context (the ZAP authenticator) stopped. term() blocks until queued replies are flushed,
        bounded by the sockets' linger: exiting without it would drop the last FINALs of a drain."""
        if self._own_ctx and not self.ctx.closed:
            self.ctx.term()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    # ------------------------------------------------------------------ main loop

    async def _loop(self) -> None:
        """Watch the sockets' FDs and wait until the pump says serving is over."""
        assert self._front is not None and self._back is not None
        loop = asyncio.get_running_loop()
        self._aloop = loop
        self._done = loop.create_future()
        self._watch = [self._bs, self._fs, *(mon for _, mon in self._monitors)]
        if self._xs is not None:
            self._watch.append(self._xs)
        now = time.monotonic()
        hb_s = self.s.heartbeat_ms / 1000.0
        self._next_hb = now + hb_s / _HB_SLICES
        self._next_sweep = now + hb_s / 5
        self._next_tel = now + (self.telemetry.interval_s if self.telemetry else 1e9)
        for sock in self._watch:
            fd = sock.getsockopt(zmq.FD)
            loop.add_reader(fd, self._pump)
            self._readers.append(fd)
        # ZeroMQ FDs are edge-triggered: messages queued before we watched would never be
        # reported, so the first pump runs unconditionally.
        self._kick()
        try:
            await self._done
        finally:
            self._stop_io()

    def _stop_io(self) -> None:
        """Stop watching the sockets and cancel the timer (idempotent)."""
        if self._aloop is not None:
            for fd in self._readers:
                self._aloop.remove_reader(fd)
        self._readers = []
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = float("inf")
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def _kick(self) -> None:
        """Schedule one pump soon (coalesced)."""
        if self._aloop is not None and not self._pump_scheduled and self._readers:
            self._pump_scheduled = True
            now = time.monotonic()
            if now < self._due_s:
                self._due_s = now
            self._aloop.call_soon(self._pump)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        self._pump()

    def _pump(self) -> None:
        """Drain both sockets and the mailbox, run due timers, re-arm the timer.

        Runs from the event loop (FD readable, timer, or :meth:`_kick`). A ZeroMQ FD only
        signals *changes*, and any send may consume a pending signal, so the pump ends by
        reading EVENTS on every socket sent on since its last readiness check: if one still
        has input it schedules itself again (after letting other tasks run) instead of waiting
        on the FD.
        An unexpected exception ends serving and is raised from :meth:`run`.
        """
        self._pump_scheduled = False
        if not self._readers:
            return  # stopped
        try:
            self._pump_once()
        except BaseException as exc:  # noqa: BLE001 - handed to run(), which re-raises it
            if self._done is not None and not self._done.done():
                self._done.set_exception(exc)
            self._stop_io()

    def _pump_once(self) -> None:
        front, back = self._fs, self._bs
        t0 = time.monotonic()
        # A pump was wanted by _due_s (a kick, or the timer); starting later means the loop was
        # busy elsewhere. Pumps woken by a socket's FD have no known due time and count no lag.
        lag_s = t0 - self._due_s if self._due_s < t0 else 0.0
        self._due_s = float("inf")
        budget_end = t0 + _PUMP_BUDGET_S
        busy = True
        # Which side reads first alternates between pumps: when one side floods (and uses up the
        # budget), the other still gets whole pumps every other time, not one message per pump.
        self._front_first = first_front = not self._front_first
        with_user = self.worker_keys is not None
        while busy:
            if first_front:
                busy = (self._drain(front, self._on_client_socket_frames, budget_end)
                        | self._drain(back, self._on_worker_frames, budget_end, with_user=with_user))
            else:
                busy = (self._drain(back, self._on_worker_frames, budget_end, with_user=with_user)
                        | self._drain(front, self._on_client_socket_frames, budget_end))
            if self._xs is not None:
                busy |= self._drain(self._xs, self._on_exchange_frames, budget_end)
            if busy and time.monotonic() >= budget_end:
                break  # more is queued: run the timers, let other tasks in, come straight back
        if self._mail:
            self._drain_mail()
        if self._kv_backlog:
            self._run_kv_backlog()
        for path, mon in self._monitors:
            try:
                self._drain_monitor(path, mon)
            except Exception as exc:  # monitoring must never take the loop down
                self.stats.dropped["handler_exception"] += 1
                self.log.exception("monitor_failed", error=repr(exc))
        now = time.monotonic()
        self._note_stall(max(0.0, lag_s) + (now - t0), now)
        self._run_timers(now, drained=not busy)
        if self._state == "draining" and (not self._inflight or now >= self._drain_deadline_s):
            self._fail_all(ErrorCode.UNAVAILABLE, "broker shut down before the request finished")
            self._stop_io()  # also resolves _done: run() returns and closes the sockets
            return
        if self._mail or busy or self._kv_backlog:
            self._kick()
        else:
            # Only sockets sent on after their last readiness check can hide queued input.
            for sk in self._dirty:
                if socket_readable(sk):
                    self._kick()
                    break
        self._dirty.clear()
        self._arm_timer(now)
        # A timer already due (say a sweep deferred while input is still queued) wants the next
        # pump now, not at its original time: lag counts from the end of this pump at most.
        due = max(self._timer_at, now)
        if due < self._due_s:
            self._due_s = due

    def _note_stall(self, stall_s: float, now: float) -> None:
        """Account one pump's lateness plus its own duration: loop lag, measured.

        A stall above ``_STALL_CREDIT_S`` moves every session's expiry by its length (what was
        queued meanwhile is read before anyone is expired, see :meth:`_run_timers`), and their
        time-weighted average drives load shedding in :meth:`_refusal`."""
        self.stats.loop_lag.observe(stall_s)
        # Time-weighted average of the stalls over about a second: one slow pump (a 4 MB KV
        # batch, a GC pass) does not shed, a loop that keeps lagging does.
        keep = math.exp(-(now - self._lag_at_s) / _LAG_WINDOW_S) if self._lag_at_s else 0.0
        self._lag_s = self._lag_s * keep + (stall_s if stall_s > _STALL_CREDIT_S else 0.0) * (1.0 - keep)
        self._lag_at_s = now
        if stall_s > _STALL_CREDIT_S:
            self.stats.loop["stalls"] += 1
            self.stats.loop["stalled_ms"] += int(stall_s * 1000)
            for sess in self.registry.by_identity.values():
                sess.expiry_s += stall_s

    def _run_timers(self, now: float, drained: bool = True) -> None:
        hb_s = self.s.heartbeat_ms / 1000.0
        if now >= self._next_hb:
            # After a stall, every overdue slice goes out now (each session once per interval).
            slice_s = hb_s / _HB_SLICES
            for _ in range(_HB_SLICES):
                self._send_heartbeats(now)
                self._next_hb += slice_s
                if self._next_hb > now:
                    break
            if self._next_hb <= now:
                self._next_hb = now + slice_s
        # Expire only after reading what is queued (a heartbeat may be waiting behind a flood);
        # a broker that never catches up still sweeps, one interval late.
        if now >= self._next_sweep and (drained or now >= self._next_sweep + hb_s):
            self._purge_expired(now)
            self._next_sweep = now + hb_s / 5
        if now >= self._next_tel and self.telemetry is not None:
            self._publish_snapshot(now)
            self._next_tel = now + self.telemetry.interval_s
        x = self.exchange
        if x is not None and now >= x.next_due():
            changes = x.tick(now, self._worker_state, self._worker_states)
            if changes:
                apply_changes(changes, self._worker_state)
        if self._deadlines and self._deadlines[0][0] <= now:
            self._expire_deadlines(now)
        if self._retries and self._retries[0][0] <= now:
            self._run_due_retries(now)
        if self._park_timers and self._park_timers[0][0] <= now:
            self._unpark(now, expired_only=True)
        if self._progress and self._progress[0][0] <= now:
            self._check_progress(now)

    def _arm_timer(self, now: float) -> None:
        """Make sure the timer fires by the earliest due time (the loop clock is monotonic)."""
        wake = min(self._next_hb, self._next_sweep, self._next_tel)
        if self.exchange is not None:
            wake = min(wake, self.exchange.next_due())
        # Finished requests leave their deadline in the heap (lazy deletion); drop those from
        # the top first, or under sustained load the timer would fire once per finished request.
        dl, inflight = self._deadlines, self._inflight
        while dl and dl[0][1] not in inflight:
            heapq.heappop(dl)
        if dl:
            wake = min(wake, dl[0][0])
        if self._retries:
            wake = min(wake, self._retries[0][0])
        if self._park_timers:
            wake = min(wake, self._park_timers[0][0])
        pg = self._progress
        while pg and pg[0][1] not in inflight:
            heapq.heappop(pg)
        if pg:
            wake = min(wake, pg[0][0])
        if self._state == "draining":
            wake = min(wake, now + _DRAIN_TICK_S)
        if wake < self._timer_at - 1e-4:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = wake
            self._timer = self._aloop.call_at(wake, self._on_timer)  # type: ignore[union-attr]

    def _drain_monitor(self, path: str, mon) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                ev = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            self.stats.frames_rejected[(path, "auth_failed")] += 1
            if self._limiter.allow(("auth_failed", path)):
                self.log.warning("handshake_rejected", path=path, endpoint=str(ev.get("endpoint")), zmq_event=int(ev.get("event", 0)))

    def post(self, kind: str, item: Any) -> None:
        """Hand work to the socket owner from another task of the same event loop (never
        blocks; not thread-safe: every caller runs on the broker's loop)."""
        self._mail.append((kind, item))
        self._kick()

    def _drain_mail(self) -> None:
        now = time.monotonic()
        while self._mail:
            kind, item = self._mail.popleft()
            try:
                if kind == "matched":
                    inf = self._inflight.get(item)
                    if inf is not None and inf.session is None and not inf.retry_pending:
                        self._dispatch(inf, now)
                elif kind == "local_submit":
                    self._on_submit(*item)
                elif kind == "client_frames":
                    self._on_client_frames(item)
                elif kind == "cancel_local":
                    for inf in [i for i in self._inflight.values() if i.client == item]:
                        self._finish_error(inf, ErrorCode.CANCELLED, "HTTP client went away", cancel_worker=True)
                elif kind == "resync":
                    worker_id, dp_rank, why = item
                    sess = self.registry.by_id.get(worker_id)
                    if sess is not None:
                        self.stats.kv["resync_requested"] += 1
                        self._send_worker(sess.identity, P.encode_resync(dp_rank, why))
            except Exception as exc:
                self.stats.dropped["handler_exception"] += 1
                self.log.exception("mail_handler_failed", kind=kind, error=repr(exc))

    # -- local clients (HTTP ingress) -------------------------------------------------
    def submit_local(self, identity: bytes, frames: list[bytes], replies: asyncio.Queue, *, quota_key: bytes | None = None,
                     decoded: P.Submit | None = None) -> None:
        """Submit client frames on behalf of an in-process client; replies land in ``replies``.
        ``quota_key`` names who the request counts against for ``max_inflight_per_client``
        (the HTTP peer; each HTTP request has a fresh identity); ``decoded`` is ``frames``
        already through :func:`mesh.protocol.decode_client` (the ingress checks it), so the
        loop does not decode it again."""
        self._local[identity] = replies
        if quota_key is not None:
            self._local_quota[identity] = quota_key
        if isinstance(decoded, P.Submit):
            self.post("local_submit", (identity, decoded))
        else:
            self.post("client_frames", [identity, *frames])

    def cancel_local(self, identity: bytes) -> None:
        self.post("cancel_local", identity)

    def forget_local(self, identity: bytes) -> None:
        self._local.pop(identity, None)
        self._local_quota.pop(identity, None)

    def spawn(self, coro) -> asyncio.Task:
        """Run a helper coroutine on the broker's loop; it is cancelled when the broker closes."""
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _prefetch(self, inf: Inflight) -> None:
        """Async prefix providers (the shared indexer) answer before the routing decision."""
        try:
            await self.router.provider.prefetch(inf.route_req)  # type: ignore[union-attr]
        except Exception as exc:  # the provider must not fail requests: route by load instead
            self.stats.dropped["prefetch_failed"] += 1
            if self._limiter.allow(("prefetch_failed",)):
                self.log.warning("prefetch_failed", error=repr(exc))
        self.post("matched", inf.rid)

    def _drain(self, sock: zmq.Socket, handler, budget_end: float = float("inf"), with_user: bool = False) -> bool:
        """Receive up to _DRAIN_BATCH messages without blocking, and not past ``budget_end``
        (monotonic; checked before each message after the first); True if more may be queued.

        Readiness is read from ZMQ_EVENTS before each receive: about a third of what a failed
        receive costs (pyzmq builds a zmq.Again exception), and most pumps find one socket idle.
        """
        mono = time.monotonic
        for i in range(_DRAIN_BATCH):
            if i and mono() >= budget_end:  # one message can be expensive (a 4 MB batch)
                return True
            if not socket_readable(sock):
                self._dirty.discard(sock)  # just read EVENTS: its FD is armed again
                return False
            try:
                if with_user:
                    frames, self._peer_key = recv_frames_user(sock)
                else:
                    frames = recv_frames(sock)
            except zmq.Again:  # EVENTS promised a message; never expected, harmless
                return False
            try:
                handler(frames)
            except Exception as exc:  # a handler bug must not kill the loop; it is logged and counted
                self.stats.dropped["handler_exception"] += 1
                self.log.exception("handler_failed", error=repr(exc))
        return True

    # ------------------------------------------------------------------ sends

    def _send(self, sock: zmq.Socket, path: str, identity: bytes, frames: list[bytes]) -> bool:
        """Non-blocking send through a ROUTER_MANDATORY socket; a failure is counted, logged
        (rate-limited) and reported to the caller, which decides what it means."""
        self._dirty.add(sock)  # a send may consume the socket's FD signal: re-check it (see _pump)
        try:
            send_frames(sock, [identity, *frames])
            return True
        except zmq.Again:
            why = "send_hwm"
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            why = "unreachable"
        self._send_why = why
        self.stats.dropped[f"{path}_{why}"] += 1
        if self._limiter.allow((path, "send_failed", identity)):
            self.log.warning("send_failed", path=path, peer=identity.hex()[:32], why=why)
        return False

    def _send_worker(self, identity: bytes, frames: list[bytes]) -> bool:
        return self._send(self._bs, "worker", identity, frames)

    def _send_client(self, identity: bytes, frames: list[bytes]) -> bool:
        if identity[:1] == b"\x00" and len(identity) > 5:
            q = self._local.get(identity)
            if q is None:
                self._send_why = "unreachable"
                self.stats.dropped["client_unreachable"] += 1
                return False
            if q.qsize() >= _LOCAL_QUEUE_MAX:  # an HTTP client that stopped reading
                self._send_why = "send_hwm"
                self.stats.dropped["client_send_hwm"] += 1
                return False
            q.put_nowait(frames)
            return True
        return self._send(self._fs, "client", identity, frames)

    def _reject(self, path: str, err: ProtocolError, peer: bytes) -> None:
        self.stats.frames_rejected[(path, err.reason)] += 1
        if self._limiter.allow((path, err.reason, peer)):
            self.log.warning("frame_rejected", path=path, reason=err.reason, detail=err.detail[:200], peer=peer.hex()[:32])

    # ------------------------------------------------------------------ client path

    def _on_client_socket_frames(self, frames: list[bytes]) -> None:
        """Frames read from the frontend socket. Identities that start with a zero byte and are
        longer than 5 bytes are the in-process (HTTP) clients' namespace; a remote peer may set
        such a ROUTING_ID (libzmq does not forbid it), and replies to it would be delivered to a
        local client's queue: such frames are refused, counted, and never answered."""
        ident = frames[0]
        if ident[0] == 0 and len(ident) > 5:
            self.stats.frames_rejected[("client", "reserved_identity")] += 1
            if self._limiter.allow(("client", "reserved_identity")):
                self.log.warning("frame_rejected", path="client", reason="reserved_identity", peer=ident.hex()[:32])
            return
        self._on_client_frames(frames)

    def _on_client_frames(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self.stats.frames_rejected[("client", "bad_frame_count")] += 1
            return
        ident = frames[0]
        msg = P.decode_client(frames[1:])
        if isinstance(msg, P.Submit):
            self._on_submit(ident, msg)
        elif isinstance(msg, P.Cancel):
            self._on_client_cancel(ident, msg.rid)
        elif isinstance(msg, P.StatusQuery):
            self._send_client(ident, self._status_reply())
        else:
            self._reject("client", msg, ident)
            # Answer when the sender can be identified: a client path header means a client.
            rid = _salvage_rid(frames[1:])
            if frames[1] == P.CLIENT_HEADER:
                self.stats.requests[ErrorCode.BAD_REQUEST.value] += 1
                self._send_client(ident, P.encode_client_error(rid, ErrorCode.BAD_REQUEST, str(msg)))

    def _on_submit(self, ident: bytes, sub: P.Submit) -> None:
        key = (ident, sub.rid)
        if key in self._by_client:
            self.stats.requests[ErrorCode.DUPLICATE.value] += 1
            self._send_client(ident, P.encode_client_error(sub.rid, ErrorCode.DUPLICATE, "a request with this rid is in flight"))
            return
        if self._state != "serving":
            self.stats.requests[ErrorCode.UNAVAILABLE.value] += 1
            self._send_client(ident, P.encode_client_error(sub.rid, ErrorCode.UNAVAILABLE, "broker is draining"))
            return
        if len(self._inflight) >= self.s.max_inflight:
            self.stats.requests[ErrorCode.OVERLOADED.value] += 1
            self._send_client(ident, P.encode_client_error(sub.rid, ErrorCode.OVERLOADED, "broker in-flight limit reached"))
            return
        now = time.monotonic()
        refusal = self._refusal(ident, sub, now)
        if refusal is not None:
            code, message = refusal
            self.stats.requests[code.value] += 1
            self._send_client(ident, P.encode_client_error(sub.rid, code, message))
            return
        budget_ms = sub.deadline_ms or self.s.default_deadline_ms
        rid = next(self._rid_seq)
        inf = Inflight(rid, ident, sub.rid, sub, now + budget_ms / 1000.0)
        self._inflight[rid] = inf
        self._by_client[key] = rid
        inf.quota = self._local_quota.get(ident, ident)
        self._client_inflight[inf.quota] += 1
        heapq.heappush(self._deadlines, (inf.deadline_s, rid))
        if self.async_provider:
            if self._prepare_route(inf):
                self.spawn(self._prefetch(inf))
            return
        self._dispatch(inf, now)

    def _prepare_route(self, inf: Inflight) -> bool:
        """Build the request's routing view once, after checking it can run at all (workers
        may have registered since the submit); False: it was refused and is finished."""
        refusal = self._context_refusal(inf.submit, inf.model)
        if refusal is not None:
            self._finish_error(inf, *refusal)
            return False
        inf.route_req = self._route_request(inf)
        return True

    def _refusal(self, ident: bytes, sub: P.Submit, now: float) -> tuple[ErrorCode, str] | None:
        """Why a new SUBMIT is refused before any work is done on it (None: accept it).
        Checked in order of cost; nothing here looks at the prompt."""
        if len(sub.raw) > P.MAX_FRAME_BYTES:  # an in-process client: workers could not take the frame
            return ErrorCode.TOO_LARGE, f"request body of {len(sub.raw)} bytes exceeds the {P.MAX_FRAME_BYTES}-byte frame limit"
        if self._client_inflight[self._local_quota.get(ident, ident)] >= self.s.max_inflight_per_client:
            return ErrorCode.RATE_LIMITED, f"this client already has {self.s.max_inflight_per_client} requests in flight"
        if self._lag_s * 1000.0 > self.s.overload_lag_ms:
            self.stats.loop["shed"] += 1
            return ErrorCode.OVERLOADED, f"broker overloaded (event loop lag {self._lag_s * 1000:.0f} ms)"
        return None  # the prompt's length is checked where it is routed (_prepare_route)

    def _fleet_capacity(self, model: str | None = None) -> int:
        """The most KV tokens any registered worker (of ``model``) can hold (0 while none is registered)."""
        if self._cap_version != self.registry.version:
            self._cap_version = self.registry.version
            self._cap_tokens.clear()
        cap = self._cap_tokens.get(model)
        if cap is None:
            cap = self._cap_tokens[model] = max((s.ready.max_total_num_tokens for s in self.registry.by_id.values()
                                                 if model is None or s.ready.model == model), default=0)
        return cap

    def _model_for(self, sub: P.Submit) -> tuple[str | None, tuple[ErrorCode, str] | None]:
        """The model a request is routed to (None: any worker) and why it is refused, if it is.

        A name is a model some registered worker serves (READY ``model``; adapters read it from
        the engine) or an alias of one (``--model-alias``). No name, or ``--model-name`` (the id
        the HTTP ingress reports, default ``mesh``), means the fleet's only model: with several
        it is a 400. An unknown name is a 404 ``model_not_found``, except while no worker is
        registered at all (startup): then it waits, parked, for workers to say what they serve."""
        name = sub.model
        known = self.registry.models()
        if name is not None:
            name = self._aliases.get(name, name)
            if name in known:
                return name, None
        if name is None or name == self.s.model_name:
            # The models with routable workers decide: a registered peer that serves nothing (or
            # a model whose workers are all down) does not make unnamed requests ambiguous.
            served = [m for m in known if self.registry.pool(m)]
            if len(served) > 1:
                return None, (ErrorCode.BAD_REQUEST, f"model is required: this fleet serves {', '.join(sorted(served))}")
            return (served[0] if served else None), None
        if not known:
            return name, None
        listed = sorted(set(known) | set(self._aliases))
        return None, (ErrorCode.MODEL_NOT_FOUND, f"model {name!r} is not served here; models: {', '.join(listed)}")

    def _context_refusal(self, sub: P.Submit, model: str | None = None) -> tuple[ErrorCode, str] | None:
        """A prompt longer than every worker's KV capacity can never run: refuse it before it is
        hashed. Text is counted conservatively (no real tokenizer packs 32 characters per
        token on average), so a text prompt that could fit is never refused."""
        cap = self._fleet_capacity(model)
        if not cap:
            return None  # no worker yet: checked again at dispatch
        n = len(sub.input_ids) if sub.input_ids is not None else len(sub.text or "") // 32
        if n > cap:
            return (ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                    f"prompt of {n}{'+' if sub.input_ids is None else ''} tokens exceeds the largest worker's capacity of {cap} tokens")
        return None

    def _on_client_cancel(self, ident: bytes, client_rid: str) -> None:
        rid = self._by_client.get((ident, client_rid))
        if rid is None:
            self.stats.dropped["cancel_unknown"] += 1
            return
        inf = self._inflight[rid]
        self._finish_error(inf, ErrorCode.CANCELLED, "cancelled by client", cancel_worker=True)

    # ------------------------------------------------------------------ dispatch

    def _route_request(self, inf: Inflight) -> RouteRequest:
        sub = inf.submit
        tokens = sub.input_ids
        packed = sub.packed
        # Only a prefix that some worker could hold can match: keys beyond the fleet's capacity
        # are never hashed (a 4M-token prompt once blocked the loop for 0.9 s hashing in full).
        cap = self._fleet_capacity(inf.model) or _MAX_KEY_TOKENS
        if tokens is None and self.router.policy.needs_match:
            tokens = text_to_tokens((sub.text or "")[:cap])[:cap]  # text prompts route by a byte-level key
            n_prompt = sub.prompt_len
        else:
            n_prompt = len(tokens) if tokens is not None else sub.prompt_len
            if tokens is not None and len(tokens) > cap:
                tokens = tokens[:cap]
                packed = packed[:cap] if packed is not None else None
        return RouteRequest(
            request_id=inf.client_rid,
            prompt_tokens=n_prompt,
            max_new_tokens=sub.max_new_tokens,
            tokens=tokens,
            packed=packed,
            ttft_slo_ms=sub.ttft_slo_ms,
            tps_slo=sub.tps_slo,
            namespace=request_namespace(sub.params),
        )

    def _dispatch(self, inf: Inflight, now: float) -> None:
        """Route and send one attempt. On failure to find or reach a worker, fail or retry.

        Prefill/decode mode: the first leg goes to the prefill worker (bootstrap mode
        ``prefill``); its FINAL ``prefill_done`` hands the request to the decode worker chosen
        with it (:meth:`_send_decode`). A decode leg that fails before any chunk is re-sent to
        another decode worker; the prefill leg is retried whole.
        """
        if inf.phase == "decode":
            self._send_decode(inf, now)
            return
        model, refusal = self._model_for(inf.submit)
        if refusal is not None:
            self._finish_error(inf, *refusal)
            return
        inf.model = model
        pool = self.registry.pool(model)
        cap = self.s.max_inflight_per_worker
        # Workers at their in-flight cap are not candidates (the policy would happily pick a
        # cache holder that is full); when every worker is, wait in the bounded queue.
        full = {w.worker_id for w in pool if w.inflight >= cap} if cap else set()
        if full and len(full) == len(pool):
            self._park_or_overload(inf, now)
            return
        if inf.route_req is None and not self._prepare_route(inf):
            return
        req = inf.route_req
        while True:
            t0 = time.perf_counter()
            decision = self.router.route(req, pool, now, exclude=inf.tried | full if full else inf.tried)
            self.stats.decision_latency.observe(time.perf_counter() - t0)
            if decision.worker_id is None:
                if decision.reason == "bad_slo":
                    self._finish_error(inf, ErrorCode.BAD_REQUEST, "invalid SLO")
                    return
                if full - inf.tried:
                    self._park_or_overload(inf, now)  # an untried worker is only full: wait for its slot
                    return
                if not pool and self._park(inf, now):
                    return  # no worker yet (startup, restart, fleet loss): wait briefly for one
                if inf.tried:
                    code = ErrorCode(inf.fail_cause) if inf.fail_cause else ErrorCode.UNAVAILABLE
                    self._finish_error(inf, code, f"no other worker after {inf.attempt} attempt(s); last: {inf.fail_cause or 'failed'}"
                                       + (f": {inf.fail_message}" if inf.fail_message else ""))
                else:
                    self._finish_error(inf, ErrorCode.NO_WORKER, "no routable worker" if not pool else decision.reason)
                return
            self.stats.decisions[decision.reason] += 1
            if self.exchange is not None and self.exchange.degraded:
                self.stats.exchange["decisions_peer_stale"] += 1  # routed on this broker's own view
            dr = decision.detail.get("decode_reason")
            if dr:
                self.stats.decisions[f"decode_{dr}"] += 1
            if decision.degraded:
                self.stats.degraded_decisions += 1
            sess = self.registry.by_id[decision.worker_id]
            inf.attempt += 1
            inf.tried.add(sess.worker_id)
            bootstrap = None
            if decision.decode_worker_id is not None:
                inf.phase = "prefill"
                inf.room = int(decision.detail.get("bootstrap_room") or inf.rid)
                bootstrap = {"mode": "prefill", "room": inf.room, "decode_worker": decision.decode_worker_id}
            remaining_ms = max(1, int((inf.deadline_s - now) * 1000))
            frames = P.encode_request(inf.rid, inf.attempt, remaining_ms, inf.client_rid, inf.submit.raw, bootstrap)
            inf.decision = decision
            if self._send_worker(sess.identity, frames):
                inf.session = sess
                inf.reason = decision.reason
                sess.inflight.add(inf.rid)
                self._watch_progress(inf, now)
                if inf.submit.stream:
                    self._send_client(inf.client, P.encode_accepted(inf.client_rid, sess.worker_id, decision.reason, inf.attempt))
                return
            # Unreachable or full worker: it is failing; try another one right away.
            self._release(inf, sess)
            self.stats.retries["send_failed"] += 1
            if inf.attempt >= self.s.max_attempts:
                self._finish_error(inf, ErrorCode.UNAVAILABLE, "could not deliver the request to any worker")
                return

    def _progress_window_s(self, inf: Inflight) -> float:
        """How long an attempt may go without a word: ``progress_timeout_ms`` plus its prompt at
        a slow prefill rate (a 400k-token prompt may legitimately take a minute to first token)."""
        req = inf.route_req
        n = req.prompt_tokens if req is not None else 0
        return self.s.progress_timeout_ms / 1000.0 + n / _SLOW_PREFILL_TOKENS_PER_S

    def _watch_progress(self, inf: Inflight, now: float) -> None:
        """A dispatched attempt must hear from its worker within its progress window."""
        inf.replied = False
        inf.sent_s = now
        if self.s.progress_timeout_ms:
            heapq.heappush(self._progress, (now + self._progress_window_s(inf), inf.rid, inf.attempt))

    def _check_progress(self, now: float) -> None:
        """Attempts that heard nothing in their window, from a worker that answered *nothing at
        all* meanwhile: it holds requests it does not serve (heartbeats prove its loop, not its
        engine). A busy worker that keeps answering other requests is only slow: the check is
        re-armed. A failed check counts against the worker, and the attempt is retried elsewhere
        while nothing was streamed."""
        while self._progress and self._progress[0][0] <= now:
            _, rid, attempt = heapq.heappop(self._progress)
            inf = self._inflight.get(rid)
            if inf is None or inf.attempt != attempt or inf.session is None or inf.replied:
                continue
            sess = inf.session
            window_s = self._progress_window_s(inf)
            if now - sess.last_reply_s < window_s:
                heapq.heappush(self._progress, (sess.last_reply_s + window_s, rid, attempt))
                continue
            self.stats.workers["no_progress"] += 1
            if self._limiter.allow(("no_progress", sess.worker_id)):
                self.log.warning("worker_no_progress", worker_id=sess.worker_id, request_id=inf.client_rid,
                                 attempt=attempt, timeout_ms=self.s.progress_timeout_ms)
            self._send_worker(sess.identity, P.encode_worker_cancel(inf.rid, inf.attempt))
            self._note_outcome(sess, True, now)
            self._note_failure(sess, now)
            self._retry_or_fail(inf, ErrorCode.WORKER_ERROR,
                                f"worker {sess.worker_id} sent nothing for {self.s.progress_timeout_ms} ms", now)

    def _release(self, inf: Inflight, sess: WorkerSession | None) -> None:
        """Undo the routing bookkeeping of the current leg (both sides while the prefill leg runs)."""
        d = inf.decision
        if d is None:
            return
        inf.decision = None
        if inf.phase == "decode":
            ds = self.registry.by_id.get(d.decode_worker_id or "")
            if ds is not None:
                self.router.release(ds.state, d)
            return
        if sess is not None:
            self.router.release(sess.state, d)
        if inf.phase == "prefill" and d.decode_worker_id:
            ds = self.registry.by_id.get(d.decode_worker_id)
            if ds is not None:
                self.router.release(ds.state, d)

    def _release_decision(self, d: Decision) -> None:
        """Undo a decision that will not be used (both sides)."""
        for wid in (d.worker_id, d.decode_worker_id):
            s = self.registry.by_id.get(wid or "")
            if s is not None:
                self.router.release(s.state, d)

    def _handoff(self, inf: Inflight, sess: WorkerSession, m: P.WorkerFinal, now: float) -> None:
        """The prefill leg is done: release it and send the decode leg."""
        d = inf.decision
        sess.inflight.discard(inf.rid)
        inf.session = None
        if d is not None:
            self.router.release(sess.state, d)  # prefill side only; the decode side stays booked
        inf.prefill_worker = sess.worker_id
        inf.prefill_usage = m.usage
        try:  # a real SGLang prefill server names its bootstrap endpoint for the decode server
            data = P.unpack(m.data) if m.data else {}
        except ProtocolError:
            data = {}
        inf.prefill_bootstrap = {k: data[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")
                                 if isinstance(data, dict) and k in data}
        inf.phase = "decode"
        self.stats.decisions["pd_handoff"] += 1
        self._send_decode(inf, now)

    def _send_decode(self, inf: Inflight, now: float) -> None:
        d = inf.decision
        dsess = self.registry.by_id.get(d.decode_worker_id or "") if d is not None else None
        if dsess is None or dsess.draining or dsess.worker_id in inf.tried:
            # The decode worker chosen with the prefill is gone or failed: pick another one.
            if d is not None and dsess is not None:
                self.router.release(dsess.state, d)
            inf.decision = None
            pool = self.registry.pool(inf.model)
            # prefer a decode worker not tried yet; a transient failure may retry the same one
            tried_decode = {w for w in inf.tried if (s := self.registry.by_id.get(w)) is not None and s.ready.role == "decode"}
            nd = self.router.route(inf.route_req, pool, now, exclude=tried_decode)
            if (nd.worker_id is None or nd.decode_worker_id is None) and tried_decode:
                if nd.worker_id is not None:
                    self._release_decision(nd)
                nd = self.router.route(inf.route_req, pool, now)
            if nd.worker_id is None or nd.decode_worker_id is None:
                if nd.worker_id is not None:
                    self._release_decision(nd)
                self._finish_error(inf, ErrorCode.NO_WORKER, "no decode worker for the handoff")
                return
            ps = self.registry.by_id.get(nd.worker_id)
            if ps is not None:
                self.router.release(ps.state, nd)  # only the decode side of this decision is used
            inf.decision = d = nd
            dsess = self.registry.by_id[nd.decode_worker_id]  # type: ignore[index]
            self.stats.decisions["decode_reselected"] += 1
        inf.attempt += 1
        inf.tried.add(dsess.worker_id)
        remaining_ms = max(1, int((inf.deadline_s - now) * 1000))
        bootstrap = {"mode": "decode", "room": inf.room, "prefill_worker": inf.prefill_worker,
                     "prompt_tokens": int((inf.prefill_usage or {}).get("prompt_tokens", 0)),
                     "cached_tokens": int((inf.prefill_usage or {}).get("cached_tokens", 0)),
                     **inf.prefill_bootstrap}
        if self._send_worker(dsess.identity, P.encode_request(inf.rid, inf.attempt, remaining_ms, inf.client_rid,
                                                              inf.submit.raw, bootstrap)):
            inf.session = dsess
            dsess.inflight.add(inf.rid)
            self._watch_progress(inf, now)
            return
        self._retry_or_fail(inf, ErrorCode.UNAVAILABLE, f"could not reach decode worker {dsess.worker_id}", now)

    def _park_or_overload(self, inf: Inflight, now: float) -> None:
        """Every worker this request may use is at its in-flight cap: queue it, or refuse 429."""
        if not self._park(inf, now, saturated=True):
            self._finish_error(inf, ErrorCode.OVERLOADED, "every worker is at capacity and the wait queue is full or timed out")

    def _park(self, inf: Inflight, now: float, *, saturated: bool = False) -> bool:
        """Hold a request while no worker is routable (``park_timeout_s``) or every worker is at
        its in-flight cap (``queue_timeout_s``), in one bounded FIFO queue.

        Returns False when it cannot wait (queue full, or its wait is over)."""
        if inf.parked_until_s is None:
            if len(self._parked) >= self.s.max_parked:
                self.stats.dropped["park_queue_full"] += 1
                return False
            wait_s = self.s.queue_timeout_s if saturated else self.s.park_timeout_s
            inf.parked_until_s = min(inf.deadline_s, now + wait_s)
        elif now >= inf.parked_until_s:
            return False
        self._parked[inf.rid] = None
        heapq.heappush(self._park_timers, (inf.parked_until_s, inf.rid))
        self.stats.requests_parked += 1
        return True

    def _unpark_one(self, now: float) -> None:
        """A worker slot freed: give it to the oldest waiting request (FIFO)."""
        while self._parked:
            rid = next(iter(self._parked))
            del self._parked[rid]
            inf = self._inflight.get(rid)
            if inf is not None:
                self._dispatch(inf, now)
                return

    def _unpark(self, now: float, *, expired_only: bool = False) -> None:
        """Re-dispatch parked requests (a worker became routable) or fail the expired ones."""
        if expired_only:
            while self._park_timers and self._park_timers[0][0] <= now:
                _, rid = heapq.heappop(self._park_timers)
                if self._parked.pop(rid, 0) is None:  # still parked
                    inf = self._inflight.get(rid)
                    if inf is not None:
                        self._dispatch(inf, now)
            return
        parked, self._parked = self._parked, {}
        for rid in parked:
            inf = self._inflight.get(rid)
            if inf is not None:
                self._dispatch(inf, now)

    def _detach(self, inf: Inflight) -> None:
        sess = inf.session
        if sess is not None:
            sess.inflight.discard(inf.rid)
            self._release(inf, sess)
            inf.session = None
        elif inf.decision is not None:
            self._release(inf, None)

    def _retry_or_fail(self, inf: Inflight, code: ErrorCode, message: str, now: float, *, budgeted: bool = True) -> None:
        """A dispatched attempt failed without output. Re-dispatch after a back-off, or fail.

        A failed prefill leg is retried whole; a failed decode leg only re-sends the decode.
        ``budgeted=False`` for requests displaced by a worker that announced it was leaving
        (graceful drain): that is a planned move, not a failure, so it does not draw on the
        retry budget that protects against retry storms (attempts and the deadline still bound
        it)."""
        self._detach(inf)
        if inf.phase == "prefill":
            inf.phase = "mixed"
        inf.fail_cause = code.value
        inf.fail_message = message[:400]
        remaining = inf.deadline_s - now
        if inf.committed or not inf.submit.idempotent or not self.retry.should_retry(inf.attempt, remaining):
            self._finish_error(inf, code, message)
            return
        if budgeted and not inf.holds_retry_budget:
            if not self.budget.try_acquire(len(self._inflight)):
                self.stats.dropped["retry_budget_exhausted"] += 1
                self._finish_error(inf, code if code is ErrorCode.WORKER_LOST else ErrorCode.UNAVAILABLE, f"{message} (retry budget exhausted)")
                return
            inf.holds_retry_budget = True
        self.stats.retries[code.value] += 1
        delay = self.retry.delay_s(inf.attempt)
        inf.retry_pending = True
        heapq.heappush(self._retries, (now + delay, inf.rid))
        self.log.info("retry_scheduled", request_id=inf.client_rid, attempt=inf.attempt, cause=code.value, delay_ms=round(delay * 1000, 2))

    def _run_due_retries(self, now: float) -> None:
        while self._retries and self._retries[0][0] <= now:
            _, rid = heapq.heappop(self._retries)
            inf = self._inflight.get(rid)
            if inf is None or not inf.retry_pending:
                continue
            inf.retry_pending = False
            self._dispatch(inf, now)

    # ------------------------------------------------------------------ terminal frames

    def _forget(self, inf: Inflight) -> None:
        self._parked.pop(inf.rid, None)
        freed = inf.session is not None
        self._detach(inf)
        if freed and self._parked and self.s.max_inflight_per_worker:
            self._unpark_one(time.monotonic())
        self._inflight.pop(inf.rid, None)
        if self._by_client.pop((inf.client, inf.client_rid), None) is not None:
            qk = inf.quota
            n = self._client_inflight[qk] - 1
            if n > 0:
                self._client_inflight[qk] = n
            else:
                self._client_inflight.pop(qk, None)
        if inf.holds_retry_budget:
            self.budget.release()
            inf.holds_retry_budget = False

    def _finish_error(self, inf: Inflight, code: ErrorCode, message: str, *, cancel_worker: bool = False) -> None:
        if cancel_worker and inf.session is not None:
            self._send_worker(inf.session.identity, P.encode_worker_cancel(inf.rid, inf.attempt))
        self._forget(inf)
        self.stats.requests[code.value] += 1
        self._send_client(inf.client, P.encode_client_error(inf.client_rid, code, message))
        self.log.info("request_failed", request_id=inf.client_rid, code=code.value, attempts=inf.attempt, message=message[:200])

    def _fail_all(self, code: ErrorCode, message: str) -> None:
        for inf in list(self._inflight.values()):
            self._finish_error(inf, code, message, cancel_worker=True)

    def _expire_deadlines(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            inf = self._inflight.get(rid)
            if inf is not None:
                if rid in self._parked:  # it never reached a worker: say why
                    if self.registry.pool(inf.model):
                        self._finish_error(inf, ErrorCode.OVERLOADED, "every worker stayed at capacity until the deadline")
                    else:
                        self._finish_error(inf, ErrorCode.NO_WORKER, "no routable worker before the deadline")
                else:
                    sess = inf.session
                    if sess is not None and not inf.replied:  # it held the request and said nothing
                        self._note_outcome(sess, True, now)
                        self._note_failure(sess, now)
                    self._finish_error(inf, ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded", cancel_worker=True)

    # ------------------------------------------------------------------ worker path

    def _on_worker_frames(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self.stats.frames_rejected[("worker", "bad_frame_count")] += 1
            return
        ident = frames[0]
        msg = P.decode_worker(frames[1:])
        sess = self.registry.by_identity.get(ident)
        if isinstance(msg, ProtocolError):
            self._reject("worker", msg, ident)
            return
        if sess is None:
            if isinstance(msg, P.Ready):
                self._on_ready(ident, msg)
            elif not isinstance(msg, P.Disconnect):
                # Unknown peer (e.g. we restarted and its TCP connection came back): ask it to re-register.
                self.stats.frames_rejected[("worker", "unregistered_peer")] += 1
                if self._limiter.allow(("unregistered_reply", ident)):  # at most once a second per peer
                    self._send_worker(ident, P.encode_disconnect("not registered; send READY"))
            return
        now = time.monotonic()
        sess.expiry_s = now + self._expiry_s(sess)
        sess.last_seen_s = now
        if not sess.confirmed:
            self._confirm(sess, now)
        t = type(msg)
        if t is P.WorkerFinal:
            self._on_worker_final(sess, msg)
        elif t is P.WorkerChunk:
            self._on_worker_chunk(sess, msg)
        elif t is P.Heartbeat:
            if msg.load:
                sess.state.update_load(msg.load, now)
        elif t is P.KvEventsMsg:
            self._on_kv_events(sess, msg)
        elif t is P.WorkerError:
            self._on_worker_error(sess, msg, now)
        elif t is P.Disconnect:
            self._on_worker_disconnect(sess, msg.reason, now)
        elif t is P.Ready:
            if msg.worker_id == sess.worker_id and msg.epoch == sess.ready.epoch:
                # The same registration again (a worker that missed our first heartbeat, or one
                # that re-sent READY after a stall): acknowledge it, keep its requests and index.
                self.stats.workers["ready_repeated"] += 1
                self._send_worker(ident, P.encode_heartbeat())
                return
            # A different identity on a live session is a protocol violation: make it start over.
            self.stats.frames_rejected[("worker", "duplicate_ready")] += 1
            self._send_worker(ident, P.encode_disconnect("duplicate READY"))
            self._remove_session(sess, now, "duplicate_ready")

    def _expiry_s(self, sess: WorkerSession) -> float:
        # The slower of our interval and the worker's own decides liveness (mismatch-proof), but
        # never beyond the broker's cap: a worker cannot switch its own liveness off.
        hb_ms = min(max(self.s.heartbeat_ms, sess.ready.heartbeat_ms), self.s.max_worker_heartbeat_ms)
        return hb_ms * self.s.liveness / 1000.0

    def _confirm(self, sess: WorkerSession, now: float) -> None:
        """The session's first message after READY: it is routable from now on."""
        self.registry.set_confirmed(sess)
        self.stats.workers["confirmed"] += 1
        if self._parked:
            self._unpark(now)

    def _refuse_ready(self, ident: bytes, r: P.Ready, why: str, message: str) -> None:
        """Refuse a registration: counted, warned (rate-limited) and answered with DISCONNECT at
        most once a second per peer, so a peer that retries at once cannot make us ping-pong."""
        self.stats.workers[f"refused_{why}"] += 1
        if self._limiter.allow(("ready_refused", why, r.worker_id)):
            self.log.warning("worker_refused", worker_id=r.worker_id, why=why, peer=ident.hex()[:32])
        if self._limiter.allow(("ready_refused_reply", ident)):
            self._send_worker(ident, P.encode_disconnect(message))

    def _on_ready(self, ident: bytes, r: P.Ready) -> None:
        now = time.monotonic()
        old = self.registry.by_id.get(r.worker_id)
        if old is None and len(self.registry) >= self.s.max_workers:
            self._refuse_ready(ident, r, "max_workers", f"broker already has {self.s.max_workers} workers")
            return
        key_name = None
        if self.worker_keys is not None:
            key_name = self.worker_keys.get(self._peer_key or b"")
            if key_name is None or not key_may_claim(key_name, r.worker_id):
                self._refuse_ready(ident, r, "key_mismatch", f"this CURVE key may not register as {r.worker_id!r}")
                return
        if old is not None and old.identity != ident and not (key_name and old.key_name == key_name):
            # A live worker id is not given away: a second claimant (an impostor, or a restart
            # whose old connection is still up) waits until the old session expires (its expiry
            # carries the credit of our own stalls: a slow broker loop must not open a window).
            # A restarted worker's old connection is gone, so our next heartbeat to it fails and
            # frees the id within one heartbeat interval (see _send_heartbeats).
            if old.expiry_s > now:
                self._refuse_ready(ident, r, "duplicate_id", f"worker_id {r.worker_id!r} is registered on another live connection")
                return
        if r.heartbeat_ms > self.s.max_worker_heartbeat_ms and self._limiter.allow(("hb_capped", r.worker_id)):
            self.log.warning("worker_heartbeat_capped", worker_id=r.worker_id, announced_ms=r.heartbeat_ms,
                             cap_ms=self.s.max_worker_heartbeat_ms)
        state = WorkerState(
            worker_id=r.worker_id, role=r.role, labels=dict(r.labels), block_size=r.block_size,
            max_running_requests=r.max_running_requests, max_total_num_tokens=r.max_total_num_tokens, dp_size=r.dp_size,
        )
        if self.exchange is not None:
            state.exchange_dirty = self.exchange.publisher.dirty
            state.peer_inflight, state.peer_prefill_tokens = self.exchange.merge.totals(r.worker_id)
        sess = WorkerSession(ident, r, state, expiry_s=0.0, hb_slot=next(self._hb_slots) % _HB_SLICES, last_seen_s=now,
                             key_name=key_name or "")
        sess.expiry_s = now + self._expiry_s(sess)
        old = self.registry.add(sess)
        if old is not None:
            self._forget_outcomes(old)
            self.stats.workers["replaced"] += 1
            self._orphan_requests(old, now, "worker_replaced")
            if self.kv_sink is not None and old.ready.epoch != r.epoch:
                self.kv_sink.on_worker_removed(r.worker_id)
        self.stats.workers["registered"] += 1
        if self.kv_sink is not None:
            self.kv_sink.on_worker_ready(r)
        self.log.info("worker_registered", worker_id=r.worker_id, role=r.role, epoch=r.epoch, block_size=r.block_size,
                      replaced=old is not None, workers=len(self.registry))
        self._event("worker_registered", worker_id=r.worker_id, role=r.role, epoch=r.epoch)
        self._send_worker(ident, P.encode_heartbeat())  # first message tells the worker it is routable
        if self._parked:
            self._unpark(now)

    def _first_reply(self, inf: Inflight, sess: WorkerSession, now: float) -> None:
        """The current attempt's first reply: the worker's outcome figure, and the routing
        policy learns from its prediction (cache_aware's calibration; prefill/mixed legs only,
        the decode leg of a P/D request was not predicted)."""
        inf.replied = True
        ms = (now - inf.sent_s) * 1000.0
        sess.state.record_first_reply(ms)
        if inf.phase != "decode" and inf.decision is not None:
            self.router.observe(inf.decision, ms)

    def _on_worker_chunk(self, sess: WorkerSession, m: P.WorkerChunk) -> None:
        inf = self._inflight.get(m.rid)
        if inf is None or inf.session is not sess or inf.attempt != m.attempt:
            self.stats.dropped["stale_reply"] += 1
            return
        sess.last_reply_s = now = time.monotonic()
        if not inf.replied:
            self._first_reply(inf, sess, now)
        if m.seq != inf.chunks_sent:
            self.stats.dropped["chunk_out_of_order"] += 1
            if self._limiter.allow(("chunk_seq", sess.worker_id)):
                self.log.warning("chunk_out_of_order", request_id=inf.client_rid, worker_id=sess.worker_id, expected=inf.chunks_sent, got=m.seq)
            return
        if not inf.submit.stream:
            return  # non-streaming: the worker's FINAL carries everything
        if self._send_client(inf.client, P.encode_client_chunk(inf.client_rid, m.seq, m.data)):
            inf.chunks_sent += 1
        else:
            self._client_gone(inf, self._send_why)

    def _on_worker_final(self, sess: WorkerSession, m: P.WorkerFinal) -> None:
        inf = self._inflight.get(m.rid)
        if inf is None or inf.session is not sess or inf.attempt != m.attempt:
            self.stats.dropped["stale_reply"] += 1
            return
        sess.last_reply_s = now = time.monotonic()
        if not inf.replied:
            self._first_reply(inf, sess, now)
        if inf.phase == "prefill":
            if m.finish_reason == "prefill_done":
                self._handoff(inf, sess, m, time.monotonic())
                return
        elif inf.phase == "decode" and inf.prefill_usage:
            # the client sees the prompt accounting of the prefill leg (where the cache hit was)
            m.usage = {**m.usage, "prompt_tokens": inf.prefill_usage.get("prompt_tokens", m.usage.get("prompt_tokens")),
                       "cached_tokens": inf.prefill_usage.get("cached_tokens", 0)}
        self._forget(inf)
        sess.failures = 0
        self._note_outcome(sess, False, time.monotonic())
        u = m.usage
        pt, ct = u.get("prompt_tokens"), u.get("cached_tokens")
        if type(pt) is int and type(ct) is int:
            self.stats.prompt_tokens += pt
            self.stats.cached_tokens += ct
            wt = self._worker_tokens.get(sess.worker_id)
            if wt is None:
                wt = self._worker_tokens[sess.worker_id] = [0, 0, 0]
            wt[0] += 1
            wt[1] += pt
            wt[2] += ct
        if self._send_client(inf.client, P.encode_client_final(inf.client_rid, m.finish_reason, u, sess.worker_id, m.attempt, m.data, inf.reason)):
            self.stats.requests["ok"] += 1
        else:  # finished, but the client is gone or not reading: never counted ok
            slow = self._send_why == "send_hwm"
            self.stats.requests["client_slow" if slow else "client_gone"] += 1
            if self._limiter.allow(("final_undelivered", inf.client)):
                self.log.warning("client_slow" if slow else "client_gone", client=inf.client.hex()[:32], request_id=inf.client_rid)

    def _on_worker_error(self, sess: WorkerSession, m: P.WorkerError, now: float) -> None:
        inf = self._inflight.get(m.rid)
        if inf is None or inf.session is not sess or inf.attempt != m.attempt:
            self.stats.dropped["stale_reply"] += 1
            return
        inf.replied = True
        sess.last_reply_s = now
        if m.malformed:
            self.stats.frames_rejected[("worker", "bad_payload")] += 1
            if self._limiter.allow(("bad_payload", sess.worker_id)):
                self.log.warning("frame_rejected", path="worker", reason="bad_payload", worker_id=sess.worker_id, detail=m.message[:200])
        try:
            code = ErrorCode(m.code)
        except ValueError:
            code = ErrorCode.WORKER_ERROR
        if code is not ErrorCode.CANCELLED and not (sess.draining and code is ErrorCode.UNAVAILABLE):
            self._note_outcome(sess, True, now)
        if code in (ErrorCode.WORKER_ERROR, ErrorCode.INTERNAL) or (code is ErrorCode.UNAVAILABLE and not sess.draining):
            self._note_failure(sess, now)
        if code.retryable:
            # a draining worker refusing work the broker sent before it saw DRAINING: a planned move
            self._retry_or_fail(inf, code, f"worker {sess.worker_id}: {m.message}", now,
                                budgeted=not (sess.draining and code is ErrorCode.UNAVAILABLE))
        else:
            self._finish_error(inf, code, m.message)

    # -- outlier ejection ---------------------------------------------------------------
    def _note_failure(self, sess: WorkerSession, now: float) -> None:
        """Count a worker-side failure; eject the worker after ``eject_after_failures`` in a row
        for ``eject_base_s x n`` (capped), unless that would leave no routable worker (panic
        mode: a failing worker is better than none)."""
        sess.failures += 1
        if sess.failures < self.s.eject_after_failures or sess.ejected_until_s:
            return
        self._eject(sess, now, f"{sess.failures} failures in a row")

    def _eject(self, sess: WorkerSession, now: float, why: str) -> None:
        """Eject ``sess`` for ``eject_base_s x n`` (capped), unless that would leave no routable
        worker or eject more than ``max_ejected_ratio`` of them (panic mode)."""
        healthy = sum(1 for s2 in self.registry.by_id.values() if s2.state.healthy and not s2.draining)
        ejected = sum(1 for s2 in self.registry.by_id.values() if s2.ejected_until_s)
        if healthy <= 1 or (ejected + 1) > max(1, int(self.s.max_ejected_ratio * len(self.registry))):
            self.stats.workers["ejection_skipped"] += 1
            return
        sess.ejections += 1
        dur = min(self.s.eject_base_s * sess.ejections, self.s.eject_max_s)
        self.registry.set_ejected(sess, now + dur)
        self.stats.workers["ejected"] += 1
        self.log.warning("worker_ejected", worker_id=sess.worker_id, failures=sess.failures, why=why, for_s=dur)
        self._event("worker_ejected", worker_id=sess.worker_id, for_s=dur)

    def _note_success(self, sess: WorkerSession) -> None:
        sess.failures = 0

    def _note_outcome(self, sess: WorkerSession, failed: bool, now: float) -> None:
        """Record one attempt outcome; eject a worker whose recent error rate stands out from
        its peers' (Envoy-style success-rate outlier detection). Any error counts, ``bad_request``
        too: a worker that refuses everything its peers serve is broken, whatever code it uses;
        one bad client makes every worker answer alike, so no worker stands out."""
        w = sess.outcomes
        if len(w) == w.maxlen:
            old = w[0]
            sess.outcome_errors -= old
            self._fleet_errors -= old
            self._fleet_outcomes -= 1
        v = 1 if failed else 0
        w.append(v)
        sess.outcome_errors += v
        self._fleet_errors += v
        self._fleet_outcomes += 1
        if not failed or len(w) < _OUTLIER_MIN_OUTCOMES or sess.ejected_until_s:
            return
        rate = sess.outcome_errors / len(w)
        peers_n = self._fleet_outcomes - len(w)
        peer_rate = (self._fleet_errors - sess.outcome_errors) / peers_n if peers_n > 0 else 0.0
        if rate >= _OUTLIER_MIN_RATE and rate >= peer_rate + _OUTLIER_MARGIN:
            self._eject(sess, now, f"error rate {rate:.2f} vs peers {peer_rate:.2f}")

    def _forget_outcomes(self, sess: WorkerSession) -> None:
        """Take a session that is going away out of the fleet's outcome sums."""
        self._fleet_errors -= sess.outcome_errors
        self._fleet_outcomes -= len(sess.outcomes)
        sess.outcomes.clear()
        sess.outcome_errors = 0

    def _reinstate_due(self, now: float) -> None:
        for sess in list(self.registry.by_id.values()):
            if sess.ejected_until_s and sess.ejected_until_s <= now:
                sess.failures = 0
                self._forget_outcomes(sess)  # a fresh window after ejection
                self.registry.set_ejected(sess, 0.0)
                self.stats.workers["reinstated"] += 1
                self.log.info("worker_reinstated", worker_id=sess.worker_id)
                self._event("worker_reinstated", worker_id=sess.worker_id)

    def _on_worker_disconnect(self, sess: WorkerSession, reason: str, now: float) -> None:
        if reason == P.DRAINING:
            # Graceful drain: no new work, but its in-flight requests finish where they are.
            if not sess.draining:
                self.registry.set_draining(sess)
                self.stats.workers["draining"] += 1
                self.log.info("worker_draining", worker_id=sess.worker_id, inflight=len(sess.inflight))
                self._event("worker_draining", worker_id=sess.worker_id)
            return
        self.stats.workers["disconnected"] += 1
        self.log.info("worker_disconnected", worker_id=sess.worker_id, reason=reason)
        self._event("worker_disconnected", worker_id=sess.worker_id, reason=reason)
        self._remove_session(sess, now, "disconnected")

    def _on_kv_events(self, sess: WorkerSession, m: P.KvEventsMsg) -> None:
        self.stats.kv["batches"] += 1
        if self.kv_sink is None:
            return
        slices = getattr(self.kv_sink, "kv_slices", None)
        if slices is None or (not self._kv_backlog and len(m.events) <= _KV_SLICE_EVENTS):
            for dp_rank, why in self.kv_sink.on_kv_events(sess.worker_id, m, time.monotonic()):
                self.stats.kv["resync_requested"] += 1
                self._send_worker(sess.identity, P.encode_resync(dp_rank, why))
            return
        # Large (or behind a large one): applied in slices by _run_kv_backlog, bounded in memory.
        # A dropped batch leaves a sequence gap, which the index turns into a resync request.
        n = len(m.events)
        queued = sum(self._kv_backlog_events.values())
        if queued + n > _KV_BACKLOG_MAX_EVENTS or self._kv_backlog_events[sess.worker_id] + n > _KV_BACKLOG_MAX_WORKER_EVENTS:
            self.stats.kv["backlog_dropped"] += 1
            if self._limiter.allow(("kv_backlog_full", sess.worker_id)):
                self.log.warning("kv_batch_dropped", worker_id=sess.worker_id, events=n, queued=queued)
            return
        self.stats.kv["backlog_queued"] += 1
        self._kv_backlog_events[sess.worker_id] += n
        self._kv_backlog.append((sess.worker_id, sess.identity, n, slices(sess.worker_id, m, time.monotonic(), _KV_SLICE_EVENTS)))

    def _run_kv_backlog(self) -> None:
        """Apply queued KV batches slice by slice for at most ``_KV_BACKLOG_BUDGET_S``."""
        end = time.monotonic() + _KV_BACKLOG_BUDGET_S
        bl = self._kv_backlog
        while bl and time.monotonic() < end:
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
            left = self._kv_backlog_events[wid] - n
            if left > 0:
                self._kv_backlog_events[wid] = left
            else:
                del self._kv_backlog_events[wid]
            sess = self.registry.by_identity.get(ident)
            for dp_rank, why in resyncs:
                if sess is not None:
                    self.stats.kv["resync_requested"] += 1
                    self._send_worker(ident, P.encode_resync(dp_rank, why))

    def _remove_session(self, sess: WorkerSession, now: float, why: str) -> None:
        self.registry.remove(sess)
        self._forget_outcomes(sess)
        self._orphan_requests(sess, now, why)
        if self.kv_sink is not None and sess.worker_id not in self.registry.by_id:
            self.kv_sink.on_worker_removed(sess.worker_id)

    def _orphan_requests(self, sess: WorkerSession, now: float, why: str) -> None:
        """Requests on a lost session: retry those with nothing streamed, fail the others."""
        for rid in list(sess.inflight):
            inf = self._inflight.get(rid)
            if inf is None:
                continue
            if inf.committed:
                self._detach(inf)
                self._finish_error(inf, ErrorCode.WORKER_LOST, f"worker {sess.worker_id} lost mid-stream ({why})")
            else:
                # Not budgeted: a lost worker's requests are each retried at most max_attempts
                # times anyway, and the budget (sized for retry storms) would fail the requests a
                # third of the fleet held when one of three workers stalls (issue 12, item 9).
                self._retry_or_fail(inf, ErrorCode.WORKER_LOST, f"worker {sess.worker_id} lost ({why})", now, budgeted=False)
        sess.inflight.clear()

    def _purge_expired(self, now: float) -> None:
        self._reinstate_due(now)
        for sess in self.registry.expired(now):
            self.stats.workers["expired"] += 1
            self.log.warning("worker_expired", worker_id=sess.worker_id, inflight=len(sess.inflight))
            self._event("worker_expired", worker_id=sess.worker_id, inflight=len(sess.inflight))
            self._send_worker(sess.identity, P.encode_disconnect("expired"))
            self._remove_session(sess, now, "expired")

    def _send_heartbeats(self, now: float) -> None:
        """Heartbeat the sessions of the current slice (each session once per interval). A
        session whose connection is gone (ROUTER_MANDATORY: unreachable) is removed at once:
        its requests are retried now and its worker id is free for its reconnection."""
        slot = self._hb_slot
        self._hb_slot = (slot + 1) % _HB_SLICES
        hb = P.encode_heartbeat()
        gone = []
        for sess in [s for s in self.registry.by_identity.values() if s.hb_slot == slot]:
            if not self._send_worker(sess.identity, hb) and self._send_why == "unreachable":
                gone.append(sess)
        for sess in gone:
            self.stats.workers["connection_lost"] += 1
            self.log.warning("worker_connection_lost", worker_id=sess.worker_id, inflight=len(sess.inflight))
            self._event("worker_connection_lost", worker_id=sess.worker_id)
            self._remove_session(sess, now, "connection_lost")

    def _client_gone(self, inf: Inflight, why: str = "unreachable") -> None:
        """The client's connection is gone, or it stopped reading (its pipe is at the send HWM):
        cancel all of its requests (nobody reads them) and count them ``client_gone`` or
        ``client_slow``, never ``ok``."""
        client = inf.client
        outcome = "client_slow" if why == "send_hwm" else "client_gone"
        self.log.warning(outcome, client=client.hex()[:32], request_id=inf.client_rid)
        for other in [i for i in self._inflight.values() if i.client == client]:
            if other.session is not None:
                self._send_worker(other.session.identity, P.encode_worker_cancel(other.rid, other.attempt))
            self._forget(other)
            self.stats.requests[outcome] += 1

    # ------------------------------------------------------------------ peer exchange

    def _on_exchange_frames(self, frames: list[bytes]) -> None:
        """A peer broker's figures (see brokers/peer_exchange.py): merged into the worker states."""
        changes = self.exchange.receive(frames, time.monotonic())  # type: ignore[union-attr]
        if changes:
            apply_changes(changes, self._worker_state)

    def _worker_state(self, worker_id: str) -> WorkerState | None:
        sess = self.registry.by_id.get(worker_id)
        return sess.state if sess is not None else None

    def _worker_states(self):
        return (sess.state for sess in self.registry.by_id.values())

    # ------------------------------------------------------------------ telemetry

    def _event(self, event: str, **fields: Any) -> None:
        if self.telemetry is not None:
            self.telemetry.event(event, **fields)

    def _publish_snapshot(self, now: float) -> None:
        workers = self._status_workers()[:P.MAX_STATUS_WORKERS]
        for w in workers:
            req, pt, ct = self._worker_tokens.get(w["worker_id"], (0, 0, 0))
            w["requests"] = req
            w["hit_rate"] = round(ct / pt, 4) if pt else 0.0
        self.telemetry.snapshot({"state": self._state, "inflight": len(self._inflight), "workers": workers,  # type: ignore[union-attr]
                                 "requests": dict(self.stats.requests), "decisions": dict(self.stats.decisions),
                                 "degraded_decisions": self.stats.degraded_decisions})

    # ------------------------------------------------------------------ status

    def _status_reply(self) -> list[bytes]:
        """The STATUS reply, bounded to ``MAX_STATUS_WORKERS`` workers. For large fleets the
        worker list (O(workers) to build) is reused for ``_STATUS_CACHE_S``, so a flood of
        queries costs one build per interval; broker state and counters are always current."""
        now = time.monotonic()
        c = self._status_cache
        if c is None or now - c[0] >= _STATUS_CACHE_S or len(self.registry) <= _STATUS_CACHE_MIN_WORKERS:
            workers = self._status_workers()[:P.MAX_STATUS_WORKERS]
            c = self._status_cache = (now, workers)
        broker = self._status_broker()
        if len(self.registry) > len(c[1]):
            broker["workers_truncated"] = True
        return P.encode_status_reply(broker, c[1], self.stats.flat())

    def _status_broker(self) -> dict:
        return {"id": self.broker_id, "state": self._state, "inflight": len(self._inflight),
                "uptime_s": round(time.monotonic() - self._started_s, 3), "policy": self.router.policy.name,
                "loop_lag_ms": round(self._lag_s * 1000, 2), "workers_total": len(self.registry),
                "provider": getattr(self.router.provider, "name", "none"), "models": self.served_models(),
                "model_name": self.s.model_name, "aliases": self._aliases,
                **({"exchange": self.exchange.status(time.monotonic())} if self.exchange is not None else {})}

    def model_catalog(self) -> tuple[dict[str, int], dict[str, str], str]:
        """What the HTTP ingress lists and resolves: served models (routable workers each), the
        aliases and the fleet's name (``--model-name``)."""
        return self.served_models(), self._aliases, self.s.model_name

    def served_models(self) -> dict[str, int]:
        """Model name -> routable workers serving it (models whose workers are all down are absent)."""
        return {m: n for m in self.registry.models() if (n := len(self.registry.pool(m)))}

    def _status_workers(self) -> list[dict]:
        now = time.monotonic()
        out = []
        for sess in self.registry.by_id.values():
            st = sess.state
            agg = st.fresh_load(now, self.s.load_freshness_s)
            out.append({
                "worker_id": st.worker_id, "model": sess.ready.model, "role": st.role, "labels": st.labels, "healthy": st.healthy and not sess.draining and sess.confirmed,
                "inflight": st.inflight, "peer_inflight": st.peer_inflight, "peer_prefill_tokens": st.peer_prefill_tokens,
                "epoch": sess.ready.epoch, "load_distrusted": st.load_distrusted,
                "load": None if agg is None else {"running": agg.running, "waiting": agg.waiting, "kv_usage": round(agg.kv_usage, 4)},
            })
        return out


def _salvage_rid(frames: list[bytes]) -> str | None:
    """Best effort: the rid of a rejected SUBMIT, so the error can name it."""
    if len(frames) < 3:
        return None
    try:
        d = P.unpack(frames[2])
    except ProtocolError:
        return None
    rid = d.get("rid") if isinstance(d, dict) else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= P.MAX_RID_BYTES else None
