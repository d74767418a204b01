"""The one socket factory. Every ZeroMQ option that matters is set here, explicitly.

libzmq defaults are wrong for a broker (infinite LINGER hangs exit, ROUTER drops silently at HWM
and for unknown identities, no MAXMSGSIZE, no connection heartbeats), so no socket in mesh is
created anywhere else. Each role gets a :class:`SocketSpec` with every option spelled out.

ZMTP heartbeats (``HEARTBEAT_IVL``/``TIMEOUT``/``TTL``) detect dead *connections* on the DEALERs
(the broker's ROUTERs run without them: see BROKER_FRONTEND); application heartbeats (protocol
HEARTBEAT) detect dead *event loops*; per-request deadlines catch stuck work; TCP keepalive
catches vanished hosts.
"""

from __future__ import annotations

import selectors
from dataclasses import dataclass, replace

import zmq
import zmq.asyncio

from mesh.protocol import MAX_EXCHANGE_BYTES, MAX_FRAME_BYTES

__all__ = ["send_frames", "send_routed", "recv_frames", "recv_frames_user", "socket_readable", "ReadyPoller", "SocketSpec", "CurveKeys", "make_socket", "BROKER_FRONTEND", "BROKER_BACKEND", "WORKER_DEALER", "CLIENT_DEALER", "TELEMETRY_PUB", "EXCHANGE_PUB", "EXCHANGE_SUB"]


# Hot-path helpers. pyzmq's sugar layer (enum flag arithmetic, per-part type checks) costs more
# than the send itself at broker rates, so these call the Cython backend with int flags.
# Only the first part of a multipart message can fail with EAGAIN/EHOSTUNREACH; once it is
# queued the rest is guaranteed to follow, so a failed send never leaves a partial message.
_raw_send = zmq.backend.Socket.send
_raw_recv = zmq.backend.Socket.recv
_raw_get = zmq.backend.Socket.get
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK) | int(zmq.SNDMORE)


def send_frames(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Non-blocking multipart send of byte frames. Raises zmq.Again / zmq.ZMQError on failure."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        _raw_send(sock, f, _NOBLOCK if i == last else _NOBLOCK_MORE)


def send_routed(sock: zmq.Socket, identity: bytes, frames: list[bytes]) -> None:
    """:func:`send_frames` of ``[identity, *frames]`` through a ROUTER, without building that
    list. The identity part is the one that can fail (EHOSTUNREACH, EAGAIN): nothing is sent then."""
    last = len(frames) - 1
    _raw_send(sock, identity, _NOBLOCK_MORE if frames else _NOBLOCK)
    for i, f in enumerate(frames):
        _raw_send(sock, f, _NOBLOCK if i == last else _NOBLOCK_MORE)


def recv_frames(sock: zmq.Socket) -> list[bytes]:
    """Non-blocking multipart receive. Raises zmq.Again when nothing is queued.

    Receives zero-copy Frames and reads their ``more`` flag: cheaper than a RCVMORE getsockopt
    per part (which builds an enum each call).
    """
    parts = []
    while True:
        f = _raw_recv(sock, _NOBLOCK, False)
        parts.append(f.bytes)
        if not f.more:
            return parts


def recv_frames_user(sock: zmq.Socket) -> tuple[list[bytes], bytes | None]:
    """:func:`recv_frames` plus the message's ZAP ``User-Id`` (the z85 CURVE public key the
    peer authenticated with; None without ZAP)."""
    parts = []
    user = None
    while True:
        f = _raw_recv(sock, _NOBLOCK, False)
        if user is None:
            try:
                u = f.get("User-Id")
            except zmq.ZMQError:
                u = None
            user = u.encode() if isinstance(u, str) and u else b""
        parts.append(f.bytes)
        if not f.more:
            return parts, (user or None)


def socket_readable(sock: zmq.Socket) -> bool:
    """True when a message is waiting (reads ZMQ_EVENTS, which also re-arms the socket's
    edge-triggered FD: call it after the last send before waiting on that FD again)."""
    return bool(_raw_get(sock, _EVENTS) & _POLLIN)


class ReadyPoller:
    """Wait for input on many synchronous sockets at a cost proportional to the *ready* ones.

    ``zmq.Poller`` checks every registered socket on every call (64 sockets: tens of
    microseconds per wake-up); this watches the sockets' file descriptors with the OS selector
    instead. ZeroMQ FDs only signal changes, and a send on a socket may consume a pending
    signal, so the contract is: after handling a socket returned by :meth:`wait` (receive until
    ``zmq.Again``, send replies), call :meth:`recheck` on it; after sending on sockets that were
    not returned (a heartbeat round), call :meth:`recheck` on those too. A socket that still has
    input is then returned by the next :meth:`wait` without waiting.
    """

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._pending: dict[zmq.Socket, None] = {}

    def register(self, sock: zmq.Socket) -> None:
        self._sel.register(sock.getsockopt(zmq.FD), selectors.EVENT_READ, sock)
        self._pending[sock] = None  # input may have arrived before the FD was watched

    def unregister(self, sock: zmq.Socket) -> None:
        self._sel.unregister(sock.getsockopt(zmq.FD))
        self._pending.pop(sock, None)

    def recheck(self, sock: zmq.Socket) -> None:
        if socket_readable(sock):
            self._pending[sock] = None

    def wait(self, timeout_s: float | None) -> list[zmq.Socket]:
        """Sockets that may have input (possibly none when the timeout expires)."""
        ready = self._pending
        self._pending = {}
        for key, _ in self._sel.select(0 if ready else timeout_s):
            ready[key.data] = None
        return list(ready)

    def close(self) -> None:
        self._sel.close()


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """CURVE key material. A server sets ``secret_key`` + ``public_key`` and ``server=True``;
    a client sets its own pair plus ``server_key`` (the server's public key)."""

    public_key: bytes
    secret_key: bytes
    server: bool = False
    server_key: bytes | None = None


@dataclass(frozen=True, slots=True)
class SocketSpec:
    """Every option a mesh socket carries. Times are in milliseconds (libzmq units)."""

    kind: int
    sndhwm: int
    rcvhwm: int
    linger_ms: int
    maxmsgsize: int = MAX_FRAME_BYTES + 64 * 1024  # a frame is capped below; headers are tiny
    router_mandatory: bool = False
    router_handover: bool = False
    immediate: bool = False
    heartbeat_ivl_ms: int = 1000
    heartbeat_timeout_ms: int = 3000
    heartbeat_ttl_ms: int = 3000
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 2000
    handshake_ivl_ms: int = 5000
    tcp_keepalive: int = 1
    # A vanished host (no FIN, no RST) is found by TCP keepalive in idle + intvl x cnt = 60 s;
    # the kernel default idle time is 2 hours.
    tcp_keepalive_idle_s: int = 30
    tcp_keepalive_intvl_s: int = 10
    tcp_keepalive_cnt: int = 3
    identity: bytes | None = None
    curve: CurveKeys | None = None
    zap_domain: bytes | None = None  # ZAP domain for server-side authentication (allow-lists)

    def with_identity(self, identity: bytes) -> "SocketSpec":
        return replace(self, identity=identity)

    def with_curve(self, curve: CurveKeys | None, zap_domain: bytes | None = None) -> "SocketSpec":
        if curve is None:
            return self
        # libzmq 4.3.5 can abort (stream_engine_base.cpp: !_io_error) when a ZMTP heartbeat
        # timer fires on a CURVE connection whose ZAP handshake failed; with CURVE we rely on
        # the application heartbeats (and TCP keepalive) instead of ZMTP PINGs.
        return replace(self, curve=curve, zap_domain=zap_domain, heartbeat_ivl_ms=0, heartbeat_timeout_ms=0, heartbeat_ttl_ms=0)


# ROUTERs: ROUTER_MANDATORY so an unroutable or full peer raises instead of dropping silently;
# bounded HWMs so a slow peer cannot exhaust broker memory; short linger so shutdown is bounded.
#
# No ZMTP heartbeats on the ROUTERs: libzmq 4.3.5 aborts the whole process (Assertion failed:
# !_io_error, stream_engine_base.cpp:310) when an engine whose input stopped at RCVHWM sees its
# peer's connection die and its heartbeat timer then writes on it (upstream #4364/#3937/#4767;
# guarded on libzmq master). Any peer can provoke that by filling its pipe and closing, so the
# broker relies on application heartbeats (workers) and TCP keepalive instead.
# RCVHWM 1,000: what one connection can make the broker buffer is RCVHWM x MAXMSGSIZE (libzmq
# counts messages, not bytes); 10,000 let one unauthenticated client queue 40 GB of 4 MB frames.
BROKER_FRONTEND = SocketSpec(zmq.ROUTER, sndhwm=10_000, rcvhwm=1_000, linger_ms=500, router_mandatory=True,
                             heartbeat_ivl_ms=0, heartbeat_timeout_ms=0, heartbeat_ttl_ms=0)
BROKER_BACKEND = SocketSpec(zmq.ROUTER, sndhwm=10_000, rcvhwm=1_000, linger_ms=500, router_mandatory=True,
                            heartbeat_ivl_ms=0, heartbeat_timeout_ms=0, heartbeat_ttl_ms=0)
# Worker DEALERs: IMMEDIATE so nothing queues onto a connection that is not up (the broker
# re-dispatches what a lost link never delivered).
WORKER_DEALER = SocketSpec(zmq.DEALER, sndhwm=10_000, rcvhwm=10_000, linger_ms=0, immediate=True)
# Client DEALERs: NOT immediate. With IMMEDIATE=1 libzmq drops the unread inbound messages of a
# connection the moment it closes, so a broker that sends its last FINALs and exits (graceful
# drain) would lose them. Without it, requests sent while a broker restarts wait for it (each
# is still bounded by its deadline).
CLIENT_DEALER = SocketSpec(zmq.DEALER, sndhwm=10_000, rcvhwm=10_000, linger_ms=0, immediate=False)
# Telemetry: a slow subscriber must never slow the broker; PUB drops for it at this HWM.
TELEMETRY_PUB = SocketSpec(zmq.PUB, sndhwm=1000, rcvhwm=1000, linger_ms=0)
# Peer exchange (brokers/peer_exchange.py). Its messages are state, not events: a newer one
# replaces an older, so queues are short (a backlog is only stale figures) and a slow peer loses
# messages at the PUB's HWM (the receiver counts them from sequence gaps). No ZMTP heartbeats,
# for the libzmq 4.3.5 abort described at BROKER_FRONTEND (a SUB whose input stops at RCVHWM is
# exactly that engine); a silent peer is found by the exchange's own staleness bound. The PUB
# only ever reads subscriptions. libzmq keeps every subscriber's filters in a byte trie (tens of
# bytes per filter byte, MAXMSGSIZE does not apply to them, and XPUB_MANUAL keeps a second copy):
# a stranger's 2,800 long unique subscriptions grew a broker from 55 MB to 2.41 GB (issue 32).
# Only the handshake can refuse them: ZAP domain ``peers`` (listed keys under CURVE, the --peer
# hosts' addresses in plaintext; brokers/peer_exchange.py, docs/security.md).
EXCHANGE_PUB = SocketSpec(zmq.PUB, sndhwm=100, rcvhwm=100, linger_ms=0, maxmsgsize=64 * 1024,
                          heartbeat_ivl_ms=0, heartbeat_timeout_ms=0, heartbeat_ttl_ms=0)
EXCHANGE_SUB = SocketSpec(zmq.SUB, sndhwm=100, rcvhwm=100, linger_ms=0, maxmsgsize=MAX_EXCHANGE_BYTES + 64 * 1024,
                          heartbeat_ivl_ms=0, heartbeat_timeout_ms=0, heartbeat_ttl_ms=0)


def make_socket(
    ctx: zmq.Context | zmq.asyncio.Context,
    spec: SocketSpec,
    *,
    bind: str | None = None,
    connect: str | list[str] | None = None,
) -> zmq.Socket:
    """Create a socket from ``spec`` and bind or connect it. Returns the socket.

    The caller owns the socket (one owner, one task) and must close it. ``bind`` may use a
    ``*`` port (``tcp://127.0.0.1:*``); read the bound address with
    ``sock.getsockopt_string(zmq.LAST_ENDPOINT)``.
    """
    sock = ctx.socket(spec.kind)
    try:
        sock.setsockopt(zmq.LINGER, spec.linger_ms)
        sock.setsockopt(zmq.SNDHWM, spec.sndhwm)
        sock.setsockopt(zmq.RCVHWM, spec.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, spec.maxmsgsize)
        sock.setsockopt(zmq.HEARTBEAT_IVL, spec.heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, spec.heartbeat_timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, spec.heartbeat_ttl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL, spec.reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, spec.reconnect_ivl_max_ms)
        sock.setsockopt(zmq.HANDSHAKE_IVL, spec.handshake_ivl_ms)
        sock.setsockopt(zmq.TCP_KEEPALIVE, spec.tcp_keepalive)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, spec.tcp_keepalive_idle_s)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, spec.tcp_keepalive_intvl_s)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, spec.tcp_keepalive_cnt)
        if spec.kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, int(spec.router_mandatory))
            sock.setsockopt(zmq.ROUTER_HANDOVER, int(spec.router_handover))
        if spec.kind in (zmq.DEALER, zmq.REQ, zmq.PUSH):
            sock.setsockopt(zmq.IMMEDIATE, int(spec.immediate))
        if spec.identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, spec.identity)
        if spec.zap_domain is not None:
            sock.setsockopt(zmq.ZAP_DOMAIN, spec.zap_domain)
        if spec.curve is not None:
            c = spec.curve
            sock.setsockopt(zmq.CURVE_PUBLICKEY, c.public_key)
            sock.setsockopt(zmq.CURVE_SECRETKEY, c.secret_key)
            if c.server:
                sock.setsockopt(zmq.CURVE_SERVER, 1)
            else:
                if c.server_key is None:
                    raise ValueError("a CURVE client needs server_key")
                sock.setsockopt(zmq.CURVE_SERVERKEY, c.server_key)
        if bind:
            sock.bind(bind)
        if connect:
            for ep in [connect] if isinstance(connect, str) else connect:
                sock.connect(ep)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock
