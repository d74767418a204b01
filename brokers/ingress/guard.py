"""Connection guards of the HTTP ingress (slowloris).

At most ``max_connections`` HTTP connections are open at once. A connection must deliver a
complete request head within ``header_timeout_s`` of connecting (or of the first byte of its next
request on a kept-alive connection), a body within ``body_timeout_s`` (checked where the body is
read), and an idle kept-alive connection is closed after ``idle_timeout_s``; one sweep a tick (a
quarter of the shorter timeout, at most 1 s) closes the expired ones, no timer per request. When
the limit is reached, a new connection evicts the connection that has waited longest for its
request head, else the longest-idle kept-alive one; when every connection is busy
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
from typing import Protocol

from brokers.ingress.backend import IngressCounters
from brokers.ingress.replies import RETRY_AFTER_S
from mesh.errors import ErrorCode

__all__ = ["ConnGuard", "Guarded", "REFUSED_RESPONSE"]


class Guarded(Protocol):
    """A connection as the guard sees it (:class:`brokers.ingress.http1.HttpConnection`): its peer
    address, where it is (``head``: waiting for a request head, ``busy``, ``idle``) and since when."""

    peer: str
    state: str
    since: float

    def close(self) -> None: ...


REFUSED_BODY = json.dumps({"error": {"message": "too many HTTP connections", "type": "server_error",
                                      "code": ErrorCode.UNAVAILABLE.value}}).encode()
REFUSED_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: "
                     + RETRY_AFTER_S.encode() + b"\r\nConnection: close\r\nContent-Length: "
                     + str(len(REFUSED_BODY)).encode() + b"\r\n\r\n" + REFUSED_BODY)


class ConnGuard:
    def __init__(self, stats: IngressCounters, max_connections: int, header_timeout_s: float, max_per_address: int = 0,
                 idle_timeout_s: float = 60.0) -> None:
        self.stats = stats
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.conns: dict[Guarded, None] = {}
        self.by_peer: dict[str, int] = {}  # open connections by peer address
        self.peak = 0
        self._sweeper: asyncio.Task | None = None

    def start(self) -> None:
        """Sweep expired connections from now on (on the running loop), until :meth:`close_all`."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop(), name="http-conn-guard")

    async def _sweep_loop(self) -> None:
        tick_s = max(0.05, min(1.0, self.header_timeout_s / 4, self.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(tick_s)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> None:
        """Close the connections that waited too long for a request head, or stayed idle too long."""
        head_before = now - self.header_timeout_s
        idle_before = now - self.idle_timeout_s
        for c in [c for c in self.conns if c.state != "busy"]:
            if c.state == "head" and c.since <= head_before:
                self.stats.dropped["http_header_timeout"] += 1
            elif c.state != "idle" or c.since > idle_before:
                continue
            self.forget(c)
            c.close()

    def admit(self, c: Guarded) -> bool:
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

    def _victim(self, peer: str | None = None) -> Guarded | None:
        """The connection to evict (of ``peer`` only, when given): waiting for a head first, then the longest idle."""
        best = None
        for c in self.conns:
            if c.state == "busy" or (peer is not None and c.peer != peer):
                continue
            key = (c.state != "head", c.since)  # waiting for a head first, then the longest idle
            if best is None or key < best[0]:
                best = (key, c)
        return best[1] if best else None

    @staticmethod
    def head_started(c: Guarded) -> None:
        c.state = "head"
        c.since = time.monotonic()

    @staticmethod
    def busy(c: Guarded) -> None:
        c.state = "busy"

    @staticmethod
    def idle(c: Guarded) -> None:
        c.state = "idle"
        c.since = time.monotonic()

    def forget(self, c: Guarded) -> None:
        if self.conns.pop(c, 0) is None:  # was open: its peer's count goes down once
            n = self.by_peer[c.peer] - 1
            if n:
                self.by_peer[c.peer] = n
            else:
                del self.by_peer[c.peer]

    def close_all(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for c in list(self.conns):
            self.forget(c)
            c.close()
