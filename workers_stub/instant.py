"""Instant workers for benchmarks: N DEALERs served from one synchronous loop.

They speak the full worker protocol through the same per-broker session as every other worker
(:class:`mesh.worker.session.LinkSession`: READY, heartbeats both ways, DISCONNECT -> READY
again, broker liveness and reconnect with back-off, the shared epoch formula) but answer every
REQUEST with a FINAL at once, echoing up to ``max_new_tokens`` prompt tokens.

:class:`InstantFleet` holds the sockets and is driven from outside through a
:class:`~mesh.sockets.ReadyPoller` (cost per wake-up proportional to the sockets with input, not
to all of them). ``mesh worker-stub --instant`` runs one in its own process
(:func:`run_instant_fleet`); ``mesh bench broker`` runs one inside its load driver's loop, so
that on a small machine the process under test keeps a core to itself.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

import zmq

from mesh import protocol as P
from mesh.config import WorkerSettings
from mesh.discovery import is_dns
from mesh.errors import ConfigError, ErrorCode
from mesh.gc_tuning import freeze_startup_heap
from mesh.logs import announce
from mesh.openai_passthrough import NO_ENGINE_MESSAGE
from mesh.retry import RetryPolicy
from mesh.sockets import WORKER_DEALER, ReadyPoller, SocketSpec, make_socket, recv_frames, send_frames
from mesh.worker import Capabilities, LinkSession, Send, new_epoch, ready_frames

__all__ = ["InstantFleet", "instant_answer", "run_instant_fleet"]

_HB_SLICES = 10  # heartbeats go out in this many slices per interval


def instant_answer(sub: P.Submit) -> tuple[list[int], dict[str, int]]:
    """What an instant worker generates for ``sub``: its first ``max_new_tokens`` prompt ids
    (text prompts as bytes), and the usage to report with them (nothing cached)."""
    prompt = sub.input_ids or list((sub.text or "").encode())
    out = prompt[: sub.max_new_tokens]
    return out, {"prompt_tokens": len(prompt), "completion_tokens": len(out), "cached_tokens": 0}


@dataclass(slots=True, eq=False)
class _Conn:
    """One worker's connection to one broker: the socket (None while backing off) and its session."""

    worker_id: str
    epoch: int
    endpoint: str
    ready: list[bytes]
    session: LinkSession
    sock: zmq.Socket | None = None
    reopen_at_s: float = 0.0


class InstantFleet:
    """``count`` instant workers, each connected to every broker in ``brokers``.

    Contract: the owner registers nothing itself; call :meth:`serve` for every socket of this
    fleet that the shared poller returns, and :meth:`tick` at least every ``heartbeat_ms / 10``
    (it returns the next time it is due). A socket has no monitor, so READY goes out at the
    first tick that finds a live pipe (and again after a broker's DISCONNECT); a connection
    whose broker stays silent for ``heartbeat_ms x liveness`` is closed and, after the back-off,
    replaced by a new socket (registered with the poller) under a new identity.
    """

    def __init__(self, ctx: zmq.Context, poller: ReadyPoller, brokers: Iterable[str], *, count: int = 1,
                 worker_id: str = "", model: str = "", role: str = "mixed", labels: dict[str, str] | None = None,
                 heartbeat_ms: int = 500, liveness: int = 3, reconnect_base_ms: float = 100.0,
                 reconnect_cap_ms: float = 5000.0, spec: SocketSpec = WORKER_DEALER) -> None:
        self.ctx = ctx
        self.poller = poller
        self.spec = spec
        self.heartbeat_s = heartbeat_ms / 1000.0
        reconnect = RetryPolicy.forever(reconnect_base_ms, reconnect_cap_ms)
        caps = Capabilities(model=model, role=role, labels=dict(labels or {}))  # 16-token blocks, 256 running, 400k tokens
        base = worker_id or f"instant-{os.getpid()}"
        self._conns: list[_Conn] = []
        self._by_sock: dict[zmq.Socket, _Conn] = {}
        now = time.monotonic()
        for i in range(count):
            wid = base if count == 1 else f"{base}-{i}"
            epoch = new_epoch()
            ready = ready_frames(wid, epoch, heartbeat_ms, caps)
            for ep in brokers:
                if is_dns(ep):
                    raise ConfigError(f"brokers: {ep!r}: --instant workers connect to fixed endpoints; dns+tcp:// "
                                      "discovery is for the simulated and attached workers")
                # no monitor to report the handshake: READY is tried at once, then every interval
                session = LinkSession(heartbeat_ms=heartbeat_ms, liveness=liveness, reconnect=reconnect, ready_timeout_s=0.0)
                conn = _Conn(wid, epoch, ep, ready, session)
                self._open(conn, now)
                self._conns.append(conn)
        self._hb = P.encode_heartbeat()
        self._next_hb_s = 0.0
        self._hb_slot = 0
        self.requests = 0

    # ------------------------------------------------------------------ sockets

    def _open(self, conn: _Conn, now_s: float) -> None:
        conn.session.open(now_s)
        sk = make_socket(self.ctx, self.spec.with_identity(conn.session.identity(conn.worker_id, conn.epoch)), connect=conn.endpoint)
        self.poller.register(sk)
        conn.sock = sk
        self._by_sock[sk] = conn

    def _drop(self, conn: _Conn, linger_ms: int = 0) -> None:
        sk = conn.sock
        if sk is not None:
            self.poller.unregister(sk)
            self._by_sock.pop(sk, None)
            sk.close(linger=linger_ms)
        conn.sock = None
        conn.session.closed()

    @property
    def sockets(self) -> list[zmq.Socket]:
        return list(self._by_sock)

    def owns(self, sock: zmq.Socket) -> bool:
        return sock in self._by_sock

    @property
    def reconnects(self) -> int:
        return sum(c.session.reconnects for c in self._conns)

    @property
    def registered(self) -> int:
        """Connections a broker has registered."""
        return sum(1 for c in self._conns if c.session.registered)

    # ------------------------------------------------------------------ protocol

    def _send(self, conn: _Conn, what: Send | None) -> None:
        if conn.sock is None or what is None:
            return
        if what is Send.READY:
            conn.session.ready_result(_try_send(conn.sock, conn.ready))
        elif conn.session.may_send():
            _try_send(conn.sock, self._hb)

    def tick(self, now_s: float) -> float:
        """Send heartbeats (or READY) when due, recycle silent connections; returns the
        monotonic time of the next tick.

        Each tick serves one of ``_HB_SLICES`` slices of the connections, so every one still
        heartbeats once per interval but the fleet never sends them all at once (N real
        workers are N processes with unrelated phases)."""
        if now_s >= self._next_hb_s:
            slot = self._hb_slot
            for k in range(slot, len(self._conns), _HB_SLICES):
                conn = self._conns[k]
                session = conn.session
                if conn.sock is None:
                    if now_s >= conn.reopen_at_s:
                        self._open(conn, now_s)
                    continue
                if session.expired(now_s):
                    self._drop(conn)
                    conn.reopen_at_s = now_s + session.lost()
                    continue
                self._send(conn, Send.READY if session.ready_due else Send.HEARTBEAT)
                self.poller.recheck(conn.sock)  # type: ignore[arg-type]
            self._hb_slot = (slot + 1) % _HB_SLICES
            self._next_hb_s = now_s + self.heartbeat_s / _HB_SLICES
        return self._next_hb_s

    def serve(self, sk: zmq.Socket, max_messages: int = 256) -> None:
        """Handle what ``sk`` has queued (up to ``max_messages``), then re-check it."""
        conn = self._by_sock.get(sk)
        if conn is None:
            return  # closed by a reconnect since the poller reported it
        session = conn.session
        heard = False
        for _ in range(max_messages):
            try:
                frames = recv_frames(sk)
            except zmq.Again:
                break
            heard = True
            msg = P.decode_broker_to_worker(frames)
            if type(msg) is P.Request and msg.submit.passthrough is not None:  # no engine to pass it to
                _try_send(sk, P.encode_worker_error(msg.rid, msg.attempt, ErrorCode.BAD_REQUEST, NO_ENGINE_MESSAGE))
            elif type(msg) is P.Request:
                out, usage = instant_answer(msg.submit)
                _try_send(sk, P.encode_worker_final(msg.rid, msg.attempt, "length", usage, {"token_ids": out}))
                self.requests += 1
            else:
                self._send(conn, session.on_message(msg)[0])
        if heard:
            session.heard(time.monotonic())
        self.poller.recheck(sk)

    def close(self, *, say_goodbye: bool = True) -> None:
        for conn in self._conns:
            if say_goodbye and conn.sock is not None:
                _try_send(conn.sock, P.encode_disconnect("worker_shutdown"))
            self._drop(conn, linger_ms=100 if say_goodbye else 0)
        self._conns.clear()


def run_instant_fleet(settings: WorkerSettings) -> None:
    """Serve until SIGTERM/SIGINT. Each worker connects to every broker in ``settings.brokers``."""
    ctx = zmq.Context()
    poller = ReadyPoller()
    fleet = InstantFleet(ctx, poller, settings.brokers, count=settings.count, worker_id=settings.worker_id,
                         model=settings.model, role=settings.role, labels=dict(settings.labels),
                         heartbeat_ms=settings.heartbeat_ms, liveness=settings.liveness,
                         reconnect_base_ms=settings.reconnect_base_ms, reconnect_cap_ms=settings.reconnect_cap_ms)
    stop = False

    def _stop(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    freeze_startup_heap()
    announce("workers_started", count=settings.count, brokers=list(settings.brokers), instant=True)
    while not stop:
        next_s = fleet.tick(time.monotonic())
        for sk in poller.wait(max(0.0, next_s - time.monotonic())):
            fleet.serve(sk)
    fleet.close()
    poller.close()
    ctx.term()


def _try_send(sk: zmq.Socket, frames: list[bytes]) -> bool:
    try:
        send_frames(sk, frames)
        return True
    except zmq.Again:
        return False
