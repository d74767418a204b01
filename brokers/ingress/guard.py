"""Connection guards of the HTTP ingress (slowloris).

At most ``max_connections`` HTTP connections are open at once. A connection must deliver a
complete request head within ``header_timeout_s`` of connecting (or of the first byte of its next
request on a kept-alive connection), a body within ``body_timeout_s`` (checked where the body is
read), and an idle kept-alive connection is closed after ``idle_timeout_s`` (aiohttp's keep-alive
timeout). When the limit is reached, a new connection evicts the connection that has waited
longest for its request head, else the longest-idle kept-alive one; when every connection is busy
with a request, the new one gets a 503 and is closed. The listen backlog is bounded too, so the
ingress holds at most ``max_connections + backlog`` descriptors however many connections arrive.

One peer address holds at most ``max_per_address`` of those connections (0: no bound): past it, its
own head-waiting or idle connection is evicted, else its new one gets the 503. A client holding
hundreds of streams it never reads can then take no more than its share of the slots (and the
streamed-write drain timeout of the replies ends those streams). Behind a reverse proxy every client
shares the proxy's address: bound connections at the proxy and set the per-address bound to 0.
"""

from __future__ import annotations

import asyncio
import json
import time

from brokers.ingress.backend import IngressCounters
from brokers.ingress.replies import RETRY_AFTER_S
from mesh.errors import ErrorCode

__all__ = ["ConnGuard", "GuardedConnection"]


class GuardedConnection(asyncio.Protocol):
    """Wraps aiohttp's RequestHandler for one connection (public protocol API only) and tracks
    where the connection is: waiting for a request head, busy with a request, or idle."""

    __slots__ = ("guard", "inner", "transport", "state", "since", "timer", "refused", "peer")

    def __init__(self, guard: "ConnGuard", inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.state = "head"
        self.since = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.refused = False
        self.peer = ""

    # asyncio protocol interface
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self.guard.admit(self):
            self.refused = True
            transport.write(_REFUSED_RESPONSE)
            transport.close()
            return
        self.inner.connection_made(transport)
        self.guard.head_started(self)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.state == "idle":  # first bytes of the next request on a kept-alive connection
            self.guard.head_started(self)
        self.inner.data_received(data)

    def eof_received(self):
        if self.refused:
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self.guard.forget(self)
        if not self.refused:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self.refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.refused:
            self.inner.resume_writing()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


_REFUSED_BODY = json.dumps({"error": {"message": "too many HTTP connections", "type": "server_error",
                                      "code": ErrorCode.UNAVAILABLE.value}}).encode()
_REFUSED_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: "
                     + RETRY_AFTER_S.encode() + b"\r\nConnection: close\r\nContent-Length: "
                     + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n" + _REFUSED_BODY)


class ConnGuard:
    def __init__(self, stats: IngressCounters, max_connections: int, header_timeout_s: float, max_per_address: int = 0) -> None:
        self.stats = stats
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.header_timeout_s = header_timeout_s
        self.conns: dict[GuardedConnection, None] = {}
        self.by_peer: dict[str, int] = {}  # open connections by peer address
        self.peak = 0

    def admit(self, c: GuardedConnection) -> bool:
        if self.max_per_address and self.by_peer.get(c.peer, 0) >= self.max_per_address:
            victim = self._victim(c.peer)
            if victim is None:
                self.stats.dropped["http_conn_refused_per_address"] += 1
                return False
            self.stats.dropped["http_conn_evicted_per_address"] += 1
            self.forget(victim)
            victim.close()
        if len(self.conns) >= self.max_connections:
            victim = self._victim()
            if victim is None:
                self.stats.dropped["http_conn_refused"] += 1
                return False
            self.stats.dropped["http_conn_evicted"] += 1
            self.forget(victim)
            victim.close()
        self.conns[c] = None
        self.by_peer[c.peer] = self.by_peer.get(c.peer, 0) + 1
        self.peak = max(self.peak, len(self.conns))
        return True

    def _victim(self, peer: str | None = None) -> GuardedConnection | None:
        """The connection to evict (of ``peer`` only, when given): waiting for a head first, then the longest idle."""
        best = None
        for c in self.conns:
            if c.state == "busy" or (peer is not None and c.peer != peer):
                continue
            key = (c.state != "head", c.since)  # waiting for a head first, then the longest idle
            if best is None or key < best[0]:
                best = (key, c)
        return best[1] if best else None

    def head_started(self, c: GuardedConnection) -> None:
        c.state = "head"
        c.since = time.monotonic()
        if c.timer is not None:
            c.timer.cancel()
        c.timer = asyncio.get_running_loop().call_later(self.header_timeout_s, self._head_expired, c)

    def _head_expired(self, c: GuardedConnection) -> None:
        c.timer = None
        if c.state == "head" and c in self.conns:
            self.stats.dropped["http_header_timeout"] += 1
            self.forget(c)
            c.close()

    def busy(self, c: GuardedConnection) -> None:
        c.state = "busy"
        if c.timer is not None:
            c.timer.cancel()
            c.timer = None

    def idle(self, c: GuardedConnection) -> None:
        if c.state == "busy":
            c.state = "idle"
            c.since = time.monotonic()  # aiohttp's keep-alive timeout (idle_timeout_s) closes it

    def forget(self, c: GuardedConnection) -> None:
        if c.timer is not None:
            c.timer.cancel()
            c.timer = None
        if self.conns.pop(c, 0) is None:  # was open: its peer's count goes down once
            n = self.by_peer[c.peer] - 1
            if n:
                self.by_peer[c.peer] = n
            else:
                del self.by_peer[c.peer]

    def close_all(self) -> None:
        for c in list(self.conns):
            self.forget(c)
            c.close()

