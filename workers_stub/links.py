"""One worker's connection to one broker: a DEALER, its registration state and liveness.

The :class:`BrokerLink` owns its socket. Its receive loop is the only code that awaits on it;
other coroutines of the same event loop call :meth:`BrokerLink.send`, which never awaits (a
non-blocking send; a full or unconnected pipe is counted and reported to the caller).

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

from mesh import protocol as P
from mesh.logs import get_logger
from mesh.retry import RetryPolicy
from mesh.sockets import WORKER_DEALER, CurveKeys, make_socket, recv_frames, send_frames

__all__ = ["BrokerLink"]


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
        self.log = get_logger(service="worker", worker_id=worker_id, broker=endpoint)
        self.sock: zmq.asyncio.Socket | None = None
        self._sync: zmq.Socket | None = None
        self.conn_no = 0
        self.registered = False  # True once the broker answered our READY
        self.last_heard_s = 0.0
        self.send_failures = 0
        self.reconnects = 0
        self._closed = False

    # ------------------------------------------------------------------ socket lifecycle

    def _open(self) -> None:
        self.conn_no += 1
        ident = f"{self.worker_id}/{self.epoch}/{self.conn_no}".encode()
        spec = WORKER_DEALER.with_identity(ident).with_curve(self.curve)
        self.sock = make_socket(self.ctx, spec, connect=self.endpoint)
        self._sync = zmq.Socket.shadow(self.sock.underlying)
        self.registered = False
        self.last_heard_s = time.monotonic()

    def _close_socket(self, linger_ms: int = 0) -> None:
        if self.sock is not None:
            self.sock.close(linger=linger_ms)
        self.sock = None
        self._sync = None
        self.registered = False

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
        """Non-blocking send; False (and counted) if the pipe is full or not connected."""
        if self._sync is None:
            self.send_failures += 1
            return False
        try:
            send_frames(self._sync, frames)
            return True
        except zmq.Again:
            self.send_failures += 1
            return False

    async def run(self) -> None:
        """Connect, register and serve until closed; reconnects on broker silence."""
        attempt = 0
        while not self._closed:
            self._open()
            self.send(self.make_ready())
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
        assert self.sock is not None and self._sync is not None
        sock, sync = self.sock, self._sync
        expiry_s = self.hb_s * self.liveness
        while not self._closed:
            timeout_ms = max(0, int((self.last_heard_s + expiry_s - time.monotonic()) * 1000)) + 1
            try:
                # poll + non-blocking drain: one wake-up per burst, no task per message
                ready = await sock.poll(timeout_ms, zmq.POLLIN)
            except zmq.ZMQError as exc:
                return "closed" if self._closed else f"socket_error:{exc.errno}"
            if not ready:
                if time.monotonic() - self.last_heard_s >= expiry_s:
                    return "broker_silent"
                continue
            for _ in range(256):
                try:
                    frames = recv_frames(sync)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    return "closed" if self._closed else f"socket_error:{exc.errno}"
                self.last_heard_s = time.monotonic()
                self._handle(frames)
                if self._closed or self.sock is not sock:
                    return "closed"
        return "closed"

    def _handle(self, frames: list[bytes]) -> None:
        msg = P.decode_broker_to_worker(frames)
        if isinstance(msg, P.Disconnect):
            # The broker forgot us (restart, expiry, or protocol violation): start a new session.
            self.on_session_lost(self, f"disconnect:{msg.reason}")
            self.registered = False
            self.send(self.make_ready())
            return
        if not self.registered and isinstance(msg, P.Heartbeat):
            self.registered = True
            self.log.info("worker_link_registered")
        self.on_message(self, msg)
