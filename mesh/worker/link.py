"""One worker's connection to one broker on asyncio: a DEALER driven by a :class:`LinkSession`.

The :class:`BrokerLink` owns its socket. Reader callbacks on its file descriptors read it;
other code of the same event loop calls :meth:`BrokerLink.send`, which never awaits (a
non-blocking send; a full or unconnected pipe is counted and reported to the caller). A
request's replies go through :attr:`BrokerLink.replies` (:meth:`BrokerLink.post`): queued, and
sent together at the start of the next event-loop turn, so a turn that finished many requests
wakes libzmq's I/O thread (and writes to TCP) once, not once per reply. The protocol decisions
(when READY goes out, what "registered" means, liveness, back-off) are the session's
(:mod:`mesh.worker.session`); this module only does the I/O.

Registration: worker DEALERs are ``IMMEDIATE`` (nothing queues onto a connection that is not
up), so a READY sent right after ``connect()`` would be refused (or lost) and the worker would
only register after a heartbeat round trip (``unregistered_peer`` -> DISCONNECT -> READY). The
link therefore watches its socket's monitor and sends READY when the ZMTP handshake (CURVE
included) has succeeded, with the session's blind fallback when no handshake is reported in time.
An ``inproc://`` link (an adapter inside the broker's process) has no handshake: READY goes out
as soon as it is connected.

Wake-ups: the socket's file descriptor (and the monitor's) are watched with the event loop's
reader callbacks, which read and handle the frames in the loop turn that saw them (no task
switch, no timer per message; the receive coroutine only keeps the session's timers). ZeroMQ
FDs are edge-triggered and *any* operation on the socket, a send included, may consume the
signal of a message that just arrived; so after a send the link re-reads ``ZMQ_EVENTS``
(:func:`mesh.sockets.socket_readable`, once per event-loop turn however many sends there were)
and reads the socket if input is waiting. Without that, a reply arriving during a send would
wait for the next unrelated wake-up (typically a broker heartbeat).

In-memory links: given a :class:`~mesh.worker.memory.MemoryPeer` (a broker in this process,
``mesh broker --attach``), the link's sends go to the peer as frames lists and the peer's
messages come in through :meth:`BrokerLink._delivered`; the socket stays connected (the broker's
goodbye at shutdown comes that way) but carries nothing else.

Liveness: when the session says the broker has been silent too long, the link destroys its
socket, waits the session's back-off (:meth:`mesh.retry.RetryPolicy.forever`: no attempt cap,
capped waits) and reconnects with a fresh identity, then sends READY again.
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
from mesh.worker.memory import MemoryPeer, MemoryPipe
from mesh.worker.session import LinkSession, Send

__all__ = ["BrokerLink", "Replies"]

_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
# The link's loop waking this much later than it asked to means the process itself stalled: the
# lateness is not counted as broker silence (scheduling jitter below it is ignored).
_STALL_CREDIT_AFTER_S = 0.05


_REFUSAL_LOG_EVERY_S = 30.0
# DISCONNECTs that are the protocol's ordinary re-registration, not a refusal of this worker.
_NOT_A_REFUSAL = frozenset({"not registered; send READY", "expired", "broker_shutdown", "duplicate READY"})


def _refusal_hint(reason: str) -> str:
    if "CURVE handshake" in reason:
        return ("add this worker's public key to the broker's --curve-allow-workers file, and check --curve-server-key "
                "is the broker's public key")
    if "CURVE key" in reason:
        return ("the broker's --curve-allow-workers file binds this worker's key to other worker ids: register with the "
                "id the key is listed for, or list the key for this id")
    if "client port" in reason:
        return "--broker names the broker's client (frontend) endpoint; workers connect to its --backend endpoint"
    return "the broker refused this worker's READY; see the reason"


class Replies:
    """A link's request replies as a reply link (``send``): :meth:`BrokerLink.post`, so the
    replies of one event-loop turn leave in one burst."""

    __slots__ = ("send",)

    def __init__(self, link: "BrokerLink") -> None:
        self.send = link.post


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
        conn_no: int = 0,
        memory: MemoryPeer | None = None,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.epoch = epoch
        self.make_ready = make_ready
        self.on_message = on_message
        self.on_session_lost = on_session_lost
        self.curve = curve
        self.session = LinkSession(heartbeat_ms=heartbeat_ms, liveness=liveness, reconnect=reconnect,
                                   ready_timeout_s=ready_timeout_s)
        self.session.conn_no = conn_no  # continue a previous link's numbering (see WorkerAPI.disconnect)
        self.log = get_logger(service="worker", worker_id=worker_id, broker=endpoint)
        self.sock: zmq.asyncio.Socket | None = None
        self._sync: zmq.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None
        self._mon_sync: zmq.Socket | None = None
        self.send_failures = 0
        self._closed = False
        self._refusal: tuple[str, float] = ("", 0.0)  # the last refusal logged and when
        # receive-loop wake-up machinery (set while _serve runs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._watched: list[int] = []
        self._recheck_scheduled = False
        self._ended: str | BaseException | None = None  # set by a reader callback: the connection is over
        self._due_s = 0.0  # when the receive loop's timer wakes it next
        # request replies queued in this loop turn (post), and how many bursts sent them
        self._outbox: list[list[bytes]] = []
        self.posted_batches = 0
        self.replies = Replies(self)
        # a broker in this process: frames go through memory, the socket only carries its goodbye
        self._pipe = MemoryPipe(memory, self._delivered) if memory is not None else None

    # the session's state, under the names callers and tests use
    @property
    def registered(self) -> bool:
        return self.session.registered

    @property
    def conn_no(self) -> int:
        return self.session.conn_no

    @property
    def reconnects(self) -> int:
        return self.session.reconnects

    @property
    def handshakes(self) -> int:
        return self.session.handshakes

    @property
    def ready_sent(self) -> int:
        return self.session.ready_sent

    @property
    def ready_fallbacks(self) -> int:
        return self.session.ready_fallbacks

    # ------------------------------------------------------------------ socket lifecycle

    def _open(self) -> None:
        self.session.open(time.monotonic())
        spec = WORKER_DEALER.with_identity(self.session.identity(self.worker_id, self.epoch)).with_curve(self.curve)
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
            self.session.closed()
            raise
        self.sock = sock
        self._sync = zmq.Socket.shadow(sock.underlying)
        if self._pipe is not None:
            self._pipe.open(self.session.identity(self.worker_id, self.epoch))

    def _unwatch(self) -> None:
        """Stop the event loop watching our FDs (before they are closed: an FD number may be reused)."""
        if self._watched and self._loop is not None:
            for fd in self._watched:
                self._loop.remove_reader(fd)
        self._watched = []
        if self._wake is not None:
            self._wake.set()  # let the receive loop notice the socket is gone

    def _close_socket(self, linger_ms: int = 0) -> None:
        self._flush()  # replies queued this turn go where an immediate send would have put them
        self._unwatch()
        if self._pipe is not None:
            self._pipe.close()
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
        self.session.closed()

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
        READY has not gone out on this connection yet. Replies queued by :meth:`post` go out
        first (the link keeps one order)."""
        if self._outbox:
            self._flush()
        if self._sync is None or not self.session.may_send():
            self.send_failures += 1
            return False
        return self._send(frames)

    def post(self, frames: list[bytes]) -> bool:
        """Queue a request's reply frames (CHUNK, FINAL, ERROR: :attr:`replies`); everything
        queued in one event-loop turn goes out together at the start of the next one, in order.
        False (and counted) when the link cannot send now; a queued message the pipe then
        refuses is counted in ``send_failures`` too. Nothing queued is dropped by the queue:
        :meth:`send` and closing the socket send it first."""
        if self._sync is None or not self.session.may_send():
            self.send_failures += 1
            return False
        self._outbox.append(frames)
        if len(self._outbox) == 1:
            if self._loop is None:  # not serving (no receive loop): nothing to batch with
                self._flush()
            else:
                self._loop.call_soon(self._flush_turn)
        return True

    def _flush(self) -> None:
        """Send what :meth:`post` queued (one burst: libzmq's I/O thread is woken once for it)."""
        out = self._outbox
        if not out:
            return
        self._outbox = []
        self.posted_batches += 1
        sync = self._sync
        if sync is None or not self.session.may_send():
            self.send_failures += len(out)
            return
        if self._pipe is not None:
            if not self._pipe.send(out):
                self.send_failures += len(out)
            return
        for frames in out:
            try:
                send_frames(sync, frames)
            except zmq.Again:
                self.send_failures += 1

    def _flush_turn(self) -> None:
        """The burst :meth:`post` scheduled, then the input check every send needs (see
        :meth:`_send`), here at once rather than in another loop turn. (The other callers of
        :meth:`_flush` need none: :meth:`send` schedules it, a closing socket is not read.)"""
        self._flush()
        sync = self._sync
        if self._pipe is None and sync is not None and self._loop is not None and not sync.closed and socket_readable(sync):
            self._drain()

    def _send(self, frames: list[bytes]) -> bool:
        sync = self._sync
        if sync is None:
            self.send_failures += 1
            return False
        if self._pipe is not None:
            ok = self._pipe.send([frames])
            self.send_failures += not ok
            return ok
        try:
            send_frames(sync, frames)
            ok = True
        except zmq.Again:
            self.send_failures += 1
            ok = False
        # A send (even a refused one) processes the socket's pending commands and may consume the
        # FD signal of a message that arrived meanwhile: re-check readiness before the loop sleeps.
        if not self._recheck_scheduled and self._loop is not None:
            self._recheck_scheduled = True
            self._loop.call_soon(self._recheck)
        return ok

    def _recheck(self) -> None:
        self._recheck_scheduled = False
        sync = self._sync
        if sync is not None and self._loop is not None and not sync.closed and socket_readable(sync):
            self._drain()

    def _do(self, what: Send | None) -> None:
        if what is Send.READY:
            self.session.ready_result(self._send(self.make_ready()))
        elif what is Send.HEARTBEAT:
            self._send(P.encode_heartbeat())

    async def run(self) -> None:
        """Connect, register and serve until closed; reconnects on broker silence, forever."""
        while not self._closed:
            self._open()
            lost = await self._serve()
            if self._closed:
                break
            self.on_session_lost(self, lost)
            self._close_socket()
            delay = self.session.lost()
            self.log.warning("broker_lost", reason=lost, reconnect_in_ms=round(delay * 1000, 1))
            await asyncio.sleep(delay)
        self._close_socket()

    async def _serve(self) -> str:
        """Serve one connection until the broker goes silent or the socket fails; returns why it
        was given up. Frames are read by reader callbacks on the socket's and the monitor's FDs
        (:meth:`_drain`, :meth:`_drain_monitor`) in the loop turn that saw them: no task switch
        and no timer per message. This coroutine keeps the session's timers (the READY fallback,
        broker silence) and wakes for them, or when a callback says the connection ended."""
        assert self.sock is not None and self._sync is not None and self._mon_sync is not None
        sock, sync, mon, session = self.sock, self._sync, self._mon_sync, self.session
        loop = self._loop = asyncio.get_running_loop()
        wake = self._wake = asyncio.Event()
        self._ended = None
        self._watched = [sync.getsockopt(zmq.FD), mon.getsockopt(zmq.FD)]
        loop.add_reader(self._watched[0], self._drain)
        loop.add_reader(self._watched[1], self._drain_monitor)
        try:
            self._drain_monitor()  # what arrived before the FDs were watched
            if self.endpoint.startswith("inproc://") and session.ready_due:
                # inproc has no ZMTP handshake (its monitor reports none): the pipe exists as soon as
                # connect() returned to a bound peer, so READY goes now, not after the blind fallback
                self._do(session.on_handshake())
            self._drain()
            while True:
                ended = self._ended
                if ended is not None:
                    if isinstance(ended, BaseException):
                        raise ended
                    return ended
                if self._closed or self.sock is not sock:
                    return "closed"
                # no handshake seen in time: READY anyway (refused while there is no pipe)
                self._do(session.timer(time.monotonic()))
                wait_s = max(0.0, session.next_timer_s() - time.monotonic()) + 0.001
                due_s = self._due_s = time.monotonic() + wait_s
                wake.clear()
                try:
                    async with asyncio.timeout(wait_s):
                        await wake.wait()
                except TimeoutError:
                    pass
                now = time.monotonic()
                if now - due_s > _STALL_CREDIT_AFTER_S:
                    session.stalled(now)  # we woke late: our stall, not the broker's silence
                if session.expired(now) and not self._closed and self.sock is sock and self._ended is None:
                    self._drain()  # what it sent while we were busy: read it first
                    if session.expired(time.monotonic()) and self._ended is None and self.sock is sock:
                        return "broker_silent"
        finally:
            if self.sock is sock or self.sock is None:
                self._unwatch()
            if self._wake is wake:
                self._wake = None
                self._loop = None

    def _end(self, why: str | BaseException) -> None:
        """A callback found the connection over: the receive loop returns ``why`` (or raises it)."""
        if self._ended is None:
            self._ended = why
        if self._wake is not None:
            self._wake.set()

    def _drain(self) -> None:
        """Read and handle what the broker sent (the socket's reader callback). A long burst
        is handled in slices of 256 messages, one per loop turn, so other work goes on."""
        sync = self._sync
        if sync is None or self._ended is not None:
            return
        n = 0
        try:
            while n < 256:
                try:
                    frames = recv_frames(sync)
                except zmq.Again:
                    break
                n += 1
                self._handle(frames)
                if self._closed or self._sync is not sync:
                    self._end("closed")
                    return
            else:
                if self._loop is not None:
                    self._loop.call_soon(self._drain)
        except zmq.ZMQError as exc:
            self._end("closed" if self._closed or self._sync is not sync else f"socket_error:{exc.errno}")
            return
        except Exception as exc:  # a bug in a handler: the receive loop raises it (as it did inline)
            self._end(exc)
            return
        if n:
            self._heard()

    def _heard(self) -> None:
        self.session.heard(time.monotonic())
        if self.session.next_timer_s() < self._due_s and self._wake is not None:
            self._wake.set()  # a message moved a timer earlier (a READY to retry): re-arm

    def _delivered(self, batch: list[list[bytes]]) -> None:
        """What the in-process broker sent (:class:`~mesh.worker.memory.MemoryPipe`), handled as
        :meth:`_drain` handles what the socket read."""
        sync = self._sync
        if sync is None or self._ended is not None:
            return
        try:
            for frames in batch:
                self._handle(frames)
                if self._closed or self._sync is not sync:
                    self._end("closed")
                    return
        except Exception as exc:  # a bug in a handler: the receive loop raises it
            self._end(exc)
            return
        self._heard()

    def _drain_monitor(self) -> None:
        mon = self._mon_sync
        if mon is None or self._ended is not None:
            return
        try:
            self._read_monitor(mon)
        except zmq.ZMQError as exc:
            self._end("closed" if self._closed else f"socket_error:{exc.errno}")
        except Exception as exc:
            self._end(exc)

    def _read_monitor(self, mon: zmq.Socket) -> None:
        while True:
            try:
                frames = recv_frames(mon)
            except zmq.Again:
                return
            try:
                m = parse_monitor_message(frames)
                event = m["event"]
            except (ValueError, KeyError, IndexError):
                continue
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._do(self.session.on_handshake())
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # ZAP said no (the status code is its value)
                self._refused(f"CURVE handshake refused (ZAP status {m.get('value')}): the broker does not allow this "
                              "worker's key")

    def _refused(self, reason: str) -> None:
        """The broker answered our READY with DISCONNECT: say why here, on the refused side (the
        first time, then at most every ``_REFUSAL_LOG_EVERY_S`` while it goes on)."""
        if reason in _NOT_A_REFUSAL:
            return
        now = time.monotonic()
        if reason != self._refusal[0] or now - self._refusal[1] >= _REFUSAL_LOG_EVERY_S:
            self._refusal = (reason, now)
            self.log.warning("broker_refused_registration", reason=reason, hint=_refusal_hint(reason))

    def _handle(self, frames: list[bytes]) -> None:
        msg = P.decode_broker_to_worker(frames)
        was_registered = self.session.registered
        reply, lost = self.session.on_message(msg)
        if lost is not None:
            if not was_registered and type(msg) is P.Disconnect:
                self._refused(msg.reason)  # type: ignore[union-attr]
            # The broker forgot us (restart, expiry, or protocol violation): start a new session.
            self.on_session_lost(self, lost)
            self._do(reply)  # if the pipe just went away, READY follows the next handshake
            return
        if self.session.registered and not was_registered:
            self.log.info("worker_link_registered")
        self._do(reply)
        self.on_message(self, msg)
