"""One worker's connection to one broker: a DEALER, its registration state and liveness.

The :class:`BrokerLink` owns its socket. Its receive loop is the only code that waits on it;
other coroutines of the same event loop call :meth:`BrokerLink.send`, which never awaits (a
non-blocking send; a full or unconnected pipe is counted and reported to the caller).

Registration: worker DEALERs are ``IMMEDIATE`` (nothing queues onto a connection that is not
up), so a READY sent right after ``connect()`` would be refused (or lost) and the worker would
only register after a heartbeat round trip (``unregistered_peer`` -> DISCONNECT -> READY). The
link therefore watches its socket's monitor and sends READY when the ZMTP handshake (CURVE
included) has succeeded. If no handshake is reported within ``ready_timeout_s`` (at most half
the liveness window) it falls back to sending READY blindly, retried every heartbeat interval until one is accepted by a live pipe
(and still at the next handshake). Until READY went out, other sends are refused (a heartbeat
ahead of READY would only earn a DISCONNECT). When the same socket reconnects (say the broker
restarted), the link sends one HEARTBEAT at once: a broker that knows the session takes it as a
heartbeat, one that does not answers DISCONNECT and gets READY straight back, instead of after
the next scheduled heartbeat.

Wake-ups: the receive loop waits on the socket's file descriptor (and the monitor's) with the
event loop's reader callbacks. ZeroMQ FDs are edge-triggered and *any* operation on the socket,
a send included, may consume the signal of a message that just arrived; so after a send the link
re-reads ``ZMQ_EVENTS`` (:func:`mesh.sockets.socket_readable`, once per event-loop turn however
many sends there were) and wakes the receive loop if input is waiting. Without that, a reply
arriving during a send would wait for the next unrelated wake-up (typically a broker heartbeat).

Liveness (Paranoid Pirate): the broker heartbeats every HB; if nothing arrives for
HB x liveness, the link destroys its socket, waits a jittered exponential back-off and
reconnects with a fresh identity, then sends READY again. A DISCONNECT from the broker means
"forget the session": the link drops its requests and sends READY again on the same socket.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mesh import protocol as P
from mesh.logs import get_logger
from mesh.retry import RetryPolicy
from mesh.sockets import WORKER_DEALER, CurveKeys, make_socket, recv_frames, send_frames, socket_readable

__all__ = ["BrokerLink"]

_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class BrokerLink:
    """Connection state for one (worker, broker) pair."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        worker_id: str,
        epoch: int,
        make_ready: Callable[[], list[bytes]],
        on_message: Callable[["BrokerLink", object], None],
        on_session_lost: Callable[["BrokerLink", str], None],
        *,
        heartbeat_ms: int,
        liveness: int,
        reconnect: RetryPolicy,
        curve: CurveKeys | None = None,
        ready_timeout_s: float = 1.0,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.epoch = epoch
        self.make_ready = make_ready
        self.on_message = on_message
        self.on_session_lost = on_session_lost
        self.hb_s = heartbeat_ms / 1000.0
        self.liveness = liveness
        self.reconnect = reconnect
        self.curve = curve
        self.ready_timeout_s = ready_timeout_s
        self.log = get_logger(service="worker", worker_id=worker_id, broker=endpoint)
        self.sock: zmq.asyncio.Socket | None = None
        self._sync: zmq.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None
        self._mon_sync: zmq.Socket | None = None
        self.conn_no = 0
        self.registered = False  # True once the broker answered our READY
        self.last_heard_s = 0.0
        self.send_failures = 0
        self.reconnects = 0
        self.handshakes = 0  # handshakes seen on the current socket
        self.ready_sent = 0  # READY frames accepted by a live pipe
        self.ready_fallbacks = 0  # READY sent blindly because no handshake was seen in time
        self._closed = False
        self._ready_due = False  # READY has not gone out on the current connection yet
        self._ready_at_s = 0.0  # when to stop waiting for the handshake and send READY anyway
        # receive-loop wake-up machinery (set while _serve runs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._watched: list[int] = []
        self._recheck_scheduled = False

    # ------------------------------------------------------------------ socket lifecycle

    def _open(self) -> None:
        self.conn_no += 1
        ident = f"{self.worker_id}/{self.epoch}/{self.conn_no}".encode()
        spec = WORKER_DEALER.with_identity(ident).with_curve(self.curve)
        sock = make_socket(self.ctx, spec)
        try:
            # the monitor is attached before connect() so the first handshake cannot be missed
            self._mon = sock.get_monitor_socket(_MONITOR_EVENTS)
            self._mon_sync = zmq.Socket.shadow(self._mon.underlying)
            sock.connect(self.endpoint)
        except BaseException:
            if self._mon is not None:
                sock.disable_monitor()
                self._mon.close(linger=0)
                self._mon = self._mon_sync = None
            sock.close(linger=0)
            raise
        self.sock = sock
        self._sync = zmq.Socket.shadow(sock.underlying)
        self.registered = False
        self.handshakes = 0
        self._ready_due = True
        # the fallback must fire well before the silence expiry would recycle the socket
        self._ready_at_s = time.monotonic() + min(self.ready_timeout_s, self.hb_s * self.liveness / 2)
        self.last_heard_s = time.monotonic()

    def _unwatch(self) -> None:
        """Stop the event loop watching our FDs (before they are closed: an FD number may be reused)."""
        if self._watched and self._loop is not None:
            for fd in self._watched:
                self._loop.remove_reader(fd)
        self._watched = []
        if self._wake is not None:
            self._wake.set()  # let the receive loop notice the socket is gone

    def _close_socket(self, linger_ms: int = 0) -> None:
        self._unwatch()
        if self.sock is not None:
            if self._mon is not None:
                try:
                    self.sock.disable_monitor()
                except zmq.ZMQError:
                    pass
                self._mon.close(linger=0)
            self.sock.close(linger=linger_ms)
        self.sock = None
        self._sync = None
        self._mon = None
        self._mon_sync = None
        self.registered = False
        self._ready_due = False

    def close(self, *, say_goodbye: bool = True) -> None:
        """Send DISCONNECT (best effort) and close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if say_goodbye and self._sync is not None:
            self.send(P.encode_disconnect("worker_shutdown"))
            self._close_socket(linger_ms=500)  # linger so the goodbye is actually delivered
        else:
            self._close_socket()

    # ------------------------------------------------------------------ I/O

    def send(self, frames: list[bytes]) -> bool:
        """Non-blocking send; False (and counted) if the pipe is full or not connected, or if
        READY has not gone out on this connection yet."""
        if self._sync is None or self._ready_due:
            self.send_failures += 1
            return False
        return self._send(frames)

    def _send(self, frames: list[bytes]) -> bool:
        sync = self._sync
        if sync is None:
            self.send_failures += 1
            return False
        try:
            send_frames(sync, frames)
            ok = True
        except zmq.Again:
            self.send_failures += 1
            ok = False
        # A send (even a refused one) processes the socket's pending commands and may consume the
        # FD signal of a message that arrived meanwhile: re-check readiness before the loop sleeps.
        if not self._recheck_scheduled and self._loop is not None and self._wake is not None:
            self._recheck_scheduled = True
            self._loop.call_soon(self._recheck)
        return ok

    def _recheck(self) -> None:
        self._recheck_scheduled = False
        sync, wake = self._sync, self._wake
        if sync is not None and wake is not None and not sync.closed and socket_readable(sync):
            wake.set()

    def _send_ready(self) -> bool:
        if self._send(self.make_ready()):
            self._ready_due = False
            self.ready_sent += 1
            return True
        self._ready_due = True
        return False

    async def run(self) -> None:
        """Connect, register and serve until closed; reconnects on broker silence."""
        attempt = 0
        while not self._closed:
            self._open()
            lost = await self._serve()
            if self._closed:
                break
            self.on_session_lost(self, lost)
            self._close_socket()
            attempt += 1
            self.reconnects += 1
            delay = self.reconnect.delay_s(min(attempt, 16))
            self.log.warning("broker_lost", reason=lost, reconnect_in_ms=round(delay * 1000, 1))
            await asyncio.sleep(delay)
        self._close_socket()

    async def _serve(self) -> str:
        """Receive until the broker goes silent; returns why the connection was given up."""
        assert self.sock is not None and self._sync is not None and self._mon_sync is not None
        sock, sync, mon = self.sock, self._sync, self._mon_sync
        loop = self._loop = asyncio.get_running_loop()
        wake = self._wake = asyncio.Event()
        self._watched = [sync.getsockopt(zmq.FD), mon.getsockopt(zmq.FD)]
        for fd in self._watched:
            loop.add_reader(fd, wake.set)
        expiry_s = self.hb_s * self.liveness
        try:
            while not self._closed and self.sock is sock:
                wake.clear()
                try:
                    self._read_monitor(mon)
                    if self._ready_due and time.monotonic() >= self._ready_at_s:
                        # no handshake seen in time: send READY anyway (refused while there is
                        # no pipe), then retry once per heartbeat interval
                        self.ready_fallbacks += 1
                        self._ready_at_s = time.monotonic() + self.hb_s
                        self._send_ready()
                    for _ in range(256):
                        try:
                            frames = recv_frames(sync)
                        except zmq.Again:
                            break
                        self.last_heard_s = time.monotonic()
                        self._handle(frames)
                        if self._closed or self.sock is not sock:
                            return "closed"
                    else:
                        await asyncio.sleep(0)  # a long burst: let the other tasks run, then drain on
                        continue
                    if socket_readable(sync) or socket_readable(mon):
                        continue
                except zmq.ZMQError as exc:
                    return "closed" if self._closed or self.sock is not sock else f"socket_error:{exc.errno}"
                now = time.monotonic()
                timeout_s = self.last_heard_s + expiry_s - now
                if self._ready_due:
                    timeout_s = min(timeout_s, self._ready_at_s - now)
                try:
                    async with asyncio.timeout(max(0.0, timeout_s) + 0.001):
                        await wake.wait()
                except TimeoutError:
                    pass
                if time.monotonic() - self.last_heard_s >= expiry_s and not self._closed and self.sock is sock:
                    return "broker_silent"
            return "closed"
        finally:
            if self.sock is sock or self.sock is None:
                self._unwatch()
            if self._wake is wake:
                self._wake = None

    def _read_monitor(self, mon: zmq.Socket) -> None:
        while True:
            try:
                frames = recv_frames(mon)
            except zmq.Again:
                return
            try:
                event = parse_monitor_message(frames)["event"]
            except (ValueError, KeyError, IndexError):
                continue
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshakes += 1
                if self._ready_due:
                    self._send_ready()
                elif self.handshakes > 1:
                    # The same socket reconnected (broker restart or network blip). A broker that
                    # still knows this session takes this as a heartbeat; one that does not answers
                    # DISCONNECT at once, and READY follows (see _handle).
                    self._send(P.encode_heartbeat())

    def _handle(self, frames: list[bytes]) -> None:
        msg = P.decode_broker_to_worker(frames)
        if isinstance(msg, P.Disconnect):
            # The broker forgot us (restart, expiry, or protocol violation): start a new session.
            self.on_session_lost(self, f"disconnect:{msg.reason}")
            self.registered = False
            self._send_ready()  # if the pipe just went away, READY follows the next handshake
            return
        if not self.registered and isinstance(msg, P.Heartbeat):
            self.registered = True
            self.log.info("worker_link_registered")
            # Confirm at once: a broker routes to a new session only after it has heard from it
            # since READY (silent registrations never get traffic), so do not wait a full interval.
            self._send(P.encode_heartbeat())
        self.on_message(self, msg)
