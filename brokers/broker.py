"""The broker process's shell: two ROUTER sockets, timers, the mailbox and local (HTTP) clients.

Every decision about requests and workers is made by :class:`mesh.broker_core.BrokerCore`, a
sans-I/O state machine that the simulator and the property-based tests run too. This module
only moves bytes and time: it reads frames from the sockets and hands them to the core with the
time they were read, sends what the core asks for (:attr:`BrokerCore.out`) and reports failed
sends back (:meth:`BrokerCore.send_failed`), runs the core's timers (:meth:`BrokerCore.tick`,
:meth:`BrokerCore.wakeup_s`), measures its own loop lag, and runs the peer exchange, telemetry
and the shared indexer's async matches.

Data flow of one request (see :mod:`mesh.protocol` for every frame)::

    client SUBMIT -> decode -> core: route -> REQUEST to worker -> ACCEPTED to client
    worker CHUNK* -> core: attempt fence -> CHUNK to client ... worker FINAL -> FINAL to client

Design rules this module keeps:

* **One owner per socket.** :meth:`Broker._pump` is the only code that touches the frontend and
  backend sockets. It runs as an event-loop callback: when a socket's file descriptor becomes
  readable, when a timer is due, or when another task posts work to the mailbox. Each run
  drains both sockets with non-blocking receives on plain (synchronous) sockets, runs what is
  due, and re-arms one timer. No future or coroutine is created per message.
* **No silent drops.** Both ROUTERs run with ROUTER_MANDATORY; every send is non-blocking and a
  failed send is counted and handed back to the core, which acts on it (worker: try another or
  remove it; client: its requests cancelled, never counted ``ok``).
* **The loop never starves liveness.** One pump reads for at most ``_PUMP_BUDGET_S``; a stall is
  credited to every worker's expiry and its average drives load shedding.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import signal
import time
from collections import deque
from typing import Any, Callable

import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.broker_core import BrokerCore, Inflight
from mesh.broker_core.counters import BrokerStats
from mesh.broker_core.pool import WorkerPool
from mesh.broker_core.sends import TO_WORKER, Send, deliver
from mesh.broker_core.status import may_read_full_status
from mesh.config import BrokerSettings
from mesh.errors import ProtocolError
from mesh.logs import RateLimiter, announce, get_logger
from mesh.routing.peers import apply_changes, set_router_rank
from mesh.routing.router import Router
from mesh.routing.view import WorkerState
from mesh.sockets import BROKER_BACKEND, BROKER_FRONTEND, CurveKeys, make_socket, recv_frames, recv_frames_user, send_routed, socket_readable

__all__ = ["Broker", "Inflight"]

_DRAIN_BATCH = 512  # max messages taken from one socket before looking at the other
_DRAIN_TICK_S = 0.05  # while draining for shutdown, re-check at least this often
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
# The mailbox (HTTP submits and cancels) is handled after the sockets, within the pump's budget,
# and for at least this long when the sockets used all of it.
_MAIL_MIN_S = 0.005
# What a socket batch asks to send is sent together (see Broker._drain), but held at most this long:
# batching saves a deliver and a ZeroMQ I/O-thread wake-up per message, holding adds latency.
_SEND_HOLD_S = 0.001
_KV_BACKLOG_BUDGET_S = 0.01  # index work per pump while a KV backlog exists
_REMOTE: Any = object()  # _send_client: the identity is no local client's


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
        self.curve = curve
        self.worker_keys = worker_keys
        # z85 CURVE public key -> tenant (the keys file's curve_keys; None: every ZeroMQ client is zmq_tenant)
        self.client_tenants: dict[bytes, str] | None = None
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self.broker_id = settings.broker_id or f"broker-{os.getpid()}"
        self.log = get_logger(service="broker", broker_id=self.broker_id)
        self.stats = BrokerStats()
        self.record_log, recorder = self._decision_log(settings, router)  # --record-decisions (None: off)
        self.core = BrokerCore(settings, router, broker_id=self.broker_id, stats=self.stats, log=self.log, kv_sink=kv_sink,
                               worker_keys=worker_keys, on_event=self._event, on_new_worker=self._on_new_worker, perf=time.perf_counter,
                               # (no exchange configured: no per-decision call to ask whether peers are stale)
                               view_degraded=self._view_degraded if settings.exchange else None,
                               status_extra=self._status_extra, status_full=self._status_full, recorder=recorder)
        if recorder is not None:  # the file's header, written now: an unwritable file is a startup error
            recorder.start(time.monotonic())
            self.record_log.start(recorder.out)
        self._limiter = RateLimiter(1.0)
        self._closed = False
        self.frontend_endpoint = ""
        self.backend_endpoint = ""
        self.inproc_backend = ""  # the backend's inproc:// endpoint, with --attach
        # links of workers in this process (brokers.attached.MemoryLinks): identity -> their deliver
        self.memory_links: dict[bytes, Callable[[list[bytes]], bool]] = {}
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
        self._next_tel = 0.0
        self._tasks: set[asyncio.Task] = set()
        # Local clients (the HTTP ingress, see brokers.ingress.backend): identity -> reply queue;
        # a client's replies are found here, the others go to the frontend socket. None: the client
        # went away (its cancel is in the mailbox); such entries, listed in _gone, are dropped once
        # the mailbox is drained. (The core refuses such identities from the socket: a zero byte
        # then more than 4 bytes.)
        self._local: dict[bytes, asyncio.Queue | None] = {}
        self._gone: list[bytes] = []
        self.telemetry = None
        self.telemetry_endpoint = ""
        self.exchange = None  # brokers.peer_exchange.PeerExchange with --exchange
        self.exchange_endpoint = ""
        self._xs: list = []  # its sockets and their handlers (read by the pump)
        self._monitors: list[tuple[str, Any]] = []
        self.ready = asyncio.Event()
        self._due_s = float("inf")  # earliest time a pump was wanted (kick, timer): starting later is loop lag
        self._lag_s = 0.0  # time-weighted average of recent loop stalls (load shedding)
        self._lag_at_s = 0.0
        self._send_why = ""  # why the last failed send failed (send_hwm | unreachable)
        self._front_first = False  # which socket the next pump reads first (alternates)

    def _decision_log(self, settings: BrokerSettings, router: Router):
        """--record-decisions: the recorder (pure) and its writer (started once the core exists:
        ConfigError naming record_decisions when the file cannot be written)."""
        if not settings.record_decisions:
            return None, None
        from brokers.decision_log import DecisionLog
        from mesh.broker_core.recorder import DecisionRecorder

        rec = DecisionRecorder(
            broker_id=self.broker_id, policy=router.policy.name, max_bytes=settings.record_max_bytes,
            max_ids=settings.record_max_ids,
            fleet=lambda: [(s.worker_id, s.ready.role) for s in self.core.pool.by_id.values()],
            block_size=lambda: getattr(router.provider, "block_size", None), wall_s=time.time,
            sessions=settings.session_affinity != "off")
        writer = DecisionLog(settings.record_decisions, files=settings.record_files, dropped=self.stats.record_dropped,
                             written=self.stats.record, log=self.log)
        return writer, rec

    # -- read-only views for the HTTP ingress (brokers.ingress.backend), metrics and tests --
    @property
    def registry(self) -> WorkerPool:
        """The worker pool (sessions by identity and id, the routable pool)."""
        return self.core.pool

    @property
    def state(self) -> str:
        """init -> serving -> draining -> closed."""
        return "closed" if self._closed else self.core.state

    @property
    def budget(self):
        return self.core.budget

    @property
    def inflight_count(self) -> int:
        return len(self.core.inflight)

    @property
    def parked_count(self) -> int:
        return len(self.core.parked)

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
        self.frontend_endpoint = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend_endpoint = self._back.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.s.attach:
            # engines attached in this process (brokers.attached) link over inproc: the same ROUTER,
            # no TCP, no CURVE handshake (inproc has none: only this process can connect)
            self.inproc_backend = f"inproc://mesh-backend-{os.getpid()}-{id(self):x}"
            self._back.bind(self.inproc_backend)
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
            from mesh.security import exchange_keys

            x_curve, x_keys = exchange_keys(self.curve, self.s.exchange_curve_secret, self.s.peer_curve_keys)
            self.exchange = PeerExchange(sctx, self.broker_id, self.s.exchange, self.s.peer, interval_ms=self.s.exchange_interval_ms,
                                         stale_ms=self.s.exchange_stale_ms, stats=self.stats.exchange, log=self.log,
                                         on_reject=lambda err: self._reject("exchange", err, b""), curve=x_curve,
                                         on_routes=getattr(self.router.provider, "add_peer_routes", None), peer_keys=x_keys,
                                         max_msgs_per_s=self.s.exchange_peer_msgs_per_sec,
                                         max_bytes_per_s=self.s.exchange_peer_bytes_per_sec)
            self.exchange_endpoint = self.exchange.endpoint
            sessions = getattr(self.router, "session_table", None)
            if sessions is not None:  # session pins travel both ways (mesh.routing.sessions)
                sessions.listener = self.exchange.publisher.note_session
                self.exchange.on_sessions = sessions.apply_remote
            self.exchange.on_rank = functools.partial(set_router_rank, self.router)  # parts near-ties (cache_aware)
            if self.s.exchange_routes and hasattr(self.router.provider, "add_peer_routes"):
                # the provider's insert-on-route guesses go to the peers with the next message
                self.router.provider.route_listener = self.exchange.publisher.note_route
            self._xs = [(sock, functools.partial(self._on_exchange_frames, fn)) for sock, fn in self.exchange.inputs()]
            # a stranger subscribing to our PUB (refused by key, or in plaintext by address), or
            # a --peer that does not hold the brokers' key: counted as auth_failed
            ev = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            xsocks = self.exchange.sockets() if self.curve is not None else [self.exchange.pub]
            self._monitors += [("exchange", sock.get_monitor_socket(ev)) for sock in xsocks]

    async def run(self) -> None:
        """Serve until :meth:`request_stop`; then drain in-flight work and close the sockets."""
        if self._front is None:
            self.bind()
        self.core.start(time.monotonic())
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
        self.core.begin_drain(time.monotonic())
        self._kick()

    def close(self) -> None:
        """Close sockets (idempotent)."""
        if self._closed:
            return
        self._stop_io()
        if self._back is not None:
            for sess in list(self.core.pool.by_identity.values()):
                self._send(self._back, "worker", sess.identity, P.encode_disconnect("broker_shutdown"))
        for t in list(self._tasks):
            t.cancel()
        for path, mon in self._monitors:
            mon.close(linger=0)
        if self.telemetry is not None:
            self.telemetry.close()
        if self.exchange is not None:
            if self._monitors:
                for sock in self.exchange.sockets():
                    sock.disable_monitor()
            self.exchange.close()
        for sock in (self._front, self._back):
            if sock is not None:
                if self._monitors:
                    sock.disable_monitor()
                sock.close(linger=500)
        if self.record_log is not None:
            self.record_log.put(self.core.recorder.out)
            self.record_log.close()
        self._closed = True
        self.core.state = "closed"
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
        self._watch = [self._back, self._front, *(mon for _, mon in self._monitors)]
        self._watch.extend(sock for sock, _ in self._xs)
        self._next_tel = time.monotonic() + (self.telemetry.interval_s if self.telemetry else 1e9)
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
        front, back = self._front, self._back
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
        on_client, on_worker = self.core.client_frames, self.core.worker_frames
        tenants = self.client_tenants
        if tenants is not None:  # the tenant of the client's CURVE key
            def on_client(frames, now, key, _cf=self.core.client_frames):
                _cf(frames, now, tenant=tenants.get(key or b""))
        client_user = tenants is not None
        while busy:
            if first_front:
                busy = (self._drain(front, on_client, budget_end, with_user=client_user)
                        | self._drain(back, on_worker, budget_end, with_user=with_user))
            else:
                busy = (self._drain(back, on_worker, budget_end, with_user=with_user)
                        | self._drain(front, on_client, budget_end, with_user=client_user))
            for xsock, xhandler in self._xs:
                busy |= self._drain(xsock, xhandler, budget_end)
            if busy and time.monotonic() >= budget_end:
                break  # more is queued: run the timers, let other tasks in, come straight back
        if self._mail:
            # its own share of the pump when the sockets used up theirs (HTTP submits still move)
            self._drain_mail(max(budget_end, time.monotonic() + _MAIL_MIN_S))
        if self._gone and not self._mail:  # after the mailbox: the cancels of these clients are done
            for ident in self._gone:
                if self._local.get(ident, b"") is None:
                    del self._local[ident]
            self._gone.clear()
        core = self.core
        if core.kv_backlog:
            core.run_kv_backlog(time.monotonic, _KV_BACKLOG_BUDGET_S)
            self._flush()
        for path, mon in self._monitors:
            try:
                self._drain_monitor(path, mon)
            except Exception as exc:  # monitoring must never take the loop down
                self.stats.dropped["handler_exception"] += 1
                self.log.exception("monitor_failed", error=repr(exc))
        now = time.monotonic()
        self._note_stall(max(0.0, lag_s) + (now - t0), now)
        self._run_timers(now, drained=not busy)
        if core.drain_over(now):
            self._flush()
            self._stop_io()  # also resolves _done: run() returns and closes the sockets
            return
        if self._mail or busy or core.kv_backlog:
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
        queued meanwhile is read before anyone is expired, see :meth:`BrokerCore.tick`), and
        their time-weighted average drives load shedding (the core's ``loop_lag_s``)."""
        self.stats.loop_lag.observe(stall_s)
        # Time-weighted average of the stalls over about a second: one slow pump (a 4 MB KV
        # batch, a GC pass) does not shed, a loop that keeps lagging does.
        keep = math.exp(-(now - self._lag_at_s) / _LAG_WINDOW_S) if self._lag_at_s else 0.0
        self._lag_s = self._lag_s * keep + (stall_s if stall_s > _STALL_CREDIT_S else 0.0) * (1.0 - keep)
        self._lag_at_s = now
        self.core.loop_lag_s = self._lag_s
        if stall_s > _STALL_CREDIT_S:
            self.stats.loop["stalls"] += 1
            self.stats.loop["stalled_ms"] += int(stall_s * 1000)
            self.core.credit_stall(stall_s)

    def _run_timers(self, now: float, drained: bool = True) -> None:
        self.core.tick(now, drained)
        self._flush()
        if now >= self._next_tel and self.telemetry is not None:
            self._publish_snapshot(now)
            self._next_tel = now + self.telemetry.interval_s
        x = self.exchange
        if x is not None and now >= x.next_due():
            changes = x.tick(now, self._worker_state, self._worker_states)
            if changes:
                apply_changes(changes, self._worker_state, now)

    def _arm_timer(self, now: float) -> None:
        """Make sure the timer fires by the earliest due time (the loop clock is monotonic)."""
        wake = min(self.core.wakeup_s(), self._next_tel)
        if self.exchange is not None:
            wake = min(wake, self.exchange.next_due())
        if self.core.state == "draining":
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

    def _drain_mail(self, budget_end: float = float("inf")) -> None:
        """Handle the mailbox in order, until it is empty or ``budget_end`` (monotonic; checked
        after each item): a burst of HTTP submits cannot hold the worker replies queued behind
        it for longer than a pump's budget (what is left waits for the next pump, which reads
        the sockets first). What the items asked to send goes out once, at the end."""
        mono = time.monotonic
        now = mono()
        core = self.core
        mail = self._mail
        while mail:
            kind, item = mail.popleft()
            try:
                if kind == "local_submit":
                    ident, sub, quota_key = item
                    core.submit(ident, sub, now, quota_key)
                elif kind == "cancel_local":
                    core.cancel_client(item, now)
                elif kind == "matched":
                    core.matched(item, now)
                elif kind == "resync":
                    worker_id, dp_rank, why = item
                    core.resync(worker_id, dp_rank, why, now)
                elif kind == "worker_frames":  # injected through feed_worker_frames
                    frames, peer_key = item
                    core.worker_frames(frames, now, peer_key)
                elif kind == "admin":
                    action, worker_id, for_s, fut = item
                    if not fut.done():
                        try:
                            fut.set_result(core.admin(action, worker_id, now, for_s=for_s) if action != "list"
                                           else core.status.workers(now))
                        except (KeyError, ValueError) as exc:
                            fut.set_exception(exc)
            except Exception as exc:
                self.stats.dropped["handler_exception"] += 1
                self.log.exception("mail_handler_failed", kind=kind, error=repr(exc))
            now = mono()
            if now >= budget_end:
                break
        if core.out:
            self._flush()
        if core.prefetch:
            self._start_prefetches()

    # -- local clients (HTTP ingress): brokers.ingress.backend.IngressBackend ---------------
    def submit(self, identity: bytes, sub: P.Submit, replies: asyncio.Queue, *, quota_key: bytes | None = None) -> None:
        """Submit a decoded SUBMIT on behalf of an in-process client; replies land in ``replies``.
        ``quota_key`` names who the request counts against for ``max_inflight_per_client`` (the
        HTTP peer; each HTTP request has a fresh identity)."""
        self._local[identity] = replies
        self.post("local_submit", (identity, sub, quota_key))

    def cancel(self, identity: bytes) -> None:
        self.post("cancel_local", identity)

    def forget(self, identity: bytes) -> None:
        if identity in self._local:
            self._local[identity] = None  # replies until its cancel is done: counted unreachable
            self._gone.append(identity)

    def routable_workers(self) -> int:
        return len(self.core.pool.pool())

    def prompt_token_cap(self) -> int:
        return self.core.intake.fleet_capacity()

    def admin(self, action: str, worker_id: str = "", for_s: float | None = None) -> asyncio.Future:
        """An operator's action, run by the pump (it owns the core): ``list`` (every worker's
        status), or ``drain`` / ``eject`` / ``reinstate`` one worker (see BrokerCore.admin). The
        future raises KeyError for an unknown worker, ValueError for an action its state refuses."""
        fut = asyncio.get_running_loop().create_future()
        self.post("admin", (action, worker_id, for_s, fut))
        return fut

    def worker_batch(self, identity: bytes, batch: list[list[bytes]]) -> None:
        """Messages of a worker in this process (:mod:`mesh.worker.memory`), handled now, as if
        read from the worker socket in one batch; what they ask to send goes out at the end."""
        if self._closed:
            return
        now = time.monotonic()
        core = self.core
        for frames in batch:
            try:
                core.worker_frames([identity, *frames], now)
            except Exception as exc:  # a handler bug must not kill the loop; it is logged and counted
                self.stats.dropped["handler_exception"] += 1
                self.log.exception("handler_failed", error=repr(exc))
        self._send_asked()
        if core.kv_backlog:
            self._kick()  # the pump works the backlog off within its budget
        elif self._aloop is not None:
            self._arm_timer(now)  # a retry's back-off, say, may be due before the armed timer

    def feed_worker_frames(self, frames: list[bytes], peer_key: bytes | None = None) -> None:
        """Handle ``[identity, *frames]`` as if read from the worker socket (on the broker's
        loop; for tests that stand in for a peer the socket cannot produce, e.g. a registration
        whose connection is already gone)."""
        self.post("worker_frames", (frames, peer_key))

    def spawn(self, coro) -> asyncio.Task:
        """Run a helper coroutine on the broker's loop; it is cancelled when the broker closes."""
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _start_prefetches(self) -> None:
        """Run the async prefix matches the core asked for (the shared indexer)."""
        core = self.core
        if core.prefetch:
            todo, core.prefetch = core.prefetch, []
            for inf in todo:
                self.spawn(self._prefetch(inf))

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
        What the messages asked to send goes out together, when the batch ends or once the oldest
        send held has waited ``_SEND_HOLD_S``: the REQUESTs of a burst of SUBMITs leave back to
        back (one deliver, one wake-up of ZeroMQ's I/O thread, not one each), and no send waits
        behind a long batch for more than that.
        """
        try:
            return self._receive(sock, handler, budget_end, with_user)
        finally:
            self._send_asked()

    def _send_asked(self) -> None:
        """After a batch of handled messages: send what they asked for, start the prefix matches."""
        if self.core.out:
            self._flush()
        if self.core.prefetch:
            self._start_prefetches()

    def _receive(self, sock: zmq.Socket, handler, budget_end: float, with_user: bool) -> bool:
        mono = time.monotonic
        core = self.core
        held_s = 0.0  # when the oldest unsent send was asked for (0: none held)
        for i in range(_DRAIN_BATCH):
            now = mono()  # the message's time for the core, and the budget check
            if held_s and now - held_s >= _SEND_HOLD_S:
                self._send_asked()
                held_s = 0.0
            if i and now >= budget_end:  # one message can be expensive (a 4 MB batch)
                return True
            if not socket_readable(sock):
                self._dirty.discard(sock)  # just read EVENTS: its FD is armed again
                return False
            peer_key = None
            try:
                if with_user:
                    frames, peer_key = recv_frames_user(sock)
                else:
                    frames = recv_frames(sock)
            except zmq.Again:  # EVENTS promised a message; never expected, harmless
                return False
            try:
                if with_user:
                    handler(frames, now, peer_key)
                else:
                    handler(frames, now)
            except Exception as exc:  # a handler bug must not kill the loop; it is logged and counted
                self.stats.dropped["handler_exception"] += 1
                self.log.exception("handler_failed", error=repr(exc))
            if not held_s and core.out:
                held_s = now
        return True

    # ------------------------------------------------------------------ sends

    def _flush(self) -> None:
        """Send what the core asked for, in order; a failed send goes back to the core (which
        may ask for more sends: a re-dispatch), and sends conditional on it are skipped."""
        deliver(self.core, self._transport, time.monotonic, self._send_failed_bug)
        if self.record_log is not None and self.core.recorder.out:
            self.record_log.put(self.core.recorder.out)  # to the writer thread; never waits for the disk

    def _transport(self, s: Send) -> str:
        """One send for :func:`deliver`: why it failed, "" when it went out."""
        if s.to == TO_WORKER:
            deliver = self.memory_links.get(s.identity) if self.memory_links else None
            ok = deliver(s.frames) if deliver is not None else self._send(self._back, "worker", s.identity, s.frames)
        else:
            ok = self._send_client(s.identity, s.frames)
        return "" if ok else (self._send_why or "unreachable")

    def _send_failed_bug(self, exc: Exception) -> None:
        self.stats.dropped["handler_exception"] += 1
        self.log.exception("send_failed_handler", error=repr(exc))

    def _send(self, sock: zmq.Socket | None, path: str, identity: bytes, frames: list[bytes]) -> bool:
        """Non-blocking send through a ROUTER_MANDATORY socket; a failure is counted, logged
        (rate-limited) and reported to the caller, which decides what it means."""
        self._dirty.add(sock)  # a send may consume the socket's FD signal: re-check it (see _pump)
        try:
            send_routed(sock, identity, frames)
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

    def _send_client(self, identity: bytes, frames: list[bytes]) -> bool:
        q = self._local.get(identity, _REMOTE)
        if q is _REMOTE:
            return self._send(self._front, "client", identity, frames)
        if q is None:  # an in-process client that went away
            self._send_why = "unreachable"
            self.stats.dropped["client_unreachable"] += 1
            return False
        if q.qsize() >= _LOCAL_QUEUE_MAX:  # an HTTP client that stopped reading
            self._send_why = "send_hwm"
            self.stats.dropped["client_send_hwm"] += 1
            return False
        q.put_nowait(frames)
        return True

    def _reject(self, path: str, err: ProtocolError, peer: bytes) -> None:
        self.stats.frames_rejected[(path, err.reason)] += 1
        if self._limiter.allow((path, err.reason, peer)):
            self.log.warning("frame_rejected", path=path, reason=err.reason, detail=err.detail[:200], peer=peer.hex()[:32])

    # ------------------------------------------------------------------ socket input

    # ------------------------------------------------------------------ peer exchange

    def _on_exchange_frames(self, receive, frames: list[bytes], now: float) -> None:
        """A peer broker's figures (see brokers/peer_exchange.py): merged into the worker states."""
        changes = receive(frames, now)
        if changes:
            apply_changes(changes, self._worker_state, now)

    def _worker_state(self, worker_id: str) -> WorkerState | None:
        sess = self.core.pool.by_id.get(worker_id)
        return sess.state if sess is not None else None

    def _worker_states(self):
        return (sess.state for sess in self.core.pool.by_id.values())

    def _on_new_worker(self, state: WorkerState) -> None:
        """A new session's routing state joins the exchange: what peers have there counts from the start."""
        if self.exchange is not None:
            state.exchange_dirty = self.exchange.publisher.dirty
            state.peer_inflight, state.peer_prefill_tokens = self.exchange.merge.totals(state.worker_id)

    def _view_degraded(self) -> bool:
        return self.exchange is not None and self.exchange.degraded

    def _status_full(self, ident: bytes) -> bool:
        """Whether the client ``ident`` may read whole STATUS rows: CURVE with a client allow-list."""
        return may_read_full_status(self.curve is not None and bool(self.s.curve_allow_clients))

    def _status_extra(self, now: float) -> dict:
        out: dict = {}
        if self.exchange is not None:  # with peers' routed prompts: taken, matched, expired, evicted, bad (mesh.index.peer_routes)
            prs = getattr(self.router.provider, "peer_route_stats", None)
            out["exchange"] = {**self.exchange.status(now), "peer_routes": prs() if prs is not None else {}}
        sessions = getattr(self.router, "session_table", None)
        if sessions is not None:  # session affinity: the mode and how many sessions are pinned now
            out["sessions"] = {"mode": self.router.mode, "pinned": len(sessions), "max": sessions.max_size}
        audit = getattr(self.router, "audit", None)
        if audit is not None:  # cache_aware's regret audit (mesh.routing.regret): what it pays per request
            out["regret"] = audit.snapshot()
        return out

    # ------------------------------------------------------------------ telemetry

    def _event(self, event: str, **fields: Any) -> None:
        if self.telemetry is not None:
            self.telemetry.event(event, **fields)

    def _publish_snapshot(self, now: float) -> None:
        core = self.core
        workers = core.status.workers(now)[:P.MAX_STATUS_WORKERS]
        for w in workers:
            req, pt, ct = core.status.worker_tokens(w["worker_id"])
            w["requests"] = req
            w["hit_rate"] = round(ct / pt, 4) if pt else 0.0
        body = {"state": self.state, "inflight": len(core.inflight), "workers": workers,
                "requests": dict(self.stats.requests), "decisions": dict(self.stats.decisions),
                "degraded_decisions": self.stats.degraded_decisions, "text_unmatched": dict(self.stats.text_unmatched)}
        audit = getattr(self.router, "audit", None)
        if audit is not None:  # cache_aware's regret audit: mesh top shows what it pays per request
            body["regret"] = audit.snapshot()
        self.telemetry.snapshot(body)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ status

    def model_catalog(self) -> tuple[dict[str, int], dict[str, str], str]:
        """What the HTTP ingress lists and resolves: served models (routable workers each), the
        aliases and the fleet's name (``--model-name``)."""
        return self.core.status.model_catalog()

    def lora_catalog(self) -> dict[str, dict]:
        """LoRA adapters of the routable workers: name -> ``{"parent", "workers"}``."""
        return self.core.status.lora_catalog()

    def served_models(self) -> dict[str, int]:
        return self.core.status.served_models()

    def announced_tokenizers(self) -> dict[str, str]:
        return self.core.status.announced_tokenizers()
