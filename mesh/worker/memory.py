"""A worker link's in-memory pipe to a broker in the same process: frames lists, no ZeroMQ.

An adapter run inside the broker (``mesh broker --attach``, :mod:`brokers.attached`) can skip
ZeroMQ altogether: its :class:`~mesh.worker.link.BrokerLink` hands what it sends (READY,
heartbeats, KV events, a turn's request replies) to the broker as lists of frames
(:meth:`MemoryPeer.frames`, handled at once on the same loop), and the broker hands what it sends
to this worker to the link's :meth:`MemoryPipe.deliver` instead of its ROUTER. Delivered frames
are handled in the next loop turn, all of one turn together (the broker may be in the middle of
its send loop: handling them at once could re-enter it). The same sessions, liveness and
messages as over a socket; what is gone is libzmq's pipe, its I/O-thread wake-ups and the event
loop's FD wake-ups, per message. (Measured: see docs/operations.md, "Engines attached in the
broker process".)
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

__all__ = ["MemoryPeer", "MemoryPipe"]


class MemoryPeer(Protocol):
    """A broker in this process that exchanges frames with links without ZeroMQ."""

    def link(self, identity: bytes, deliver: Callable[[list[bytes]], bool]) -> None:
        """Messages for ``identity`` go to ``deliver`` (which says whether it took them)."""

    def unlink(self, identity: bytes) -> None:
        """``identity``'s connection is gone: its messages go nowhere (the socket path then)."""

    def frames(self, identity: bytes, batch: list[list[bytes]]) -> None:
        """Messages from ``identity``, in order (handled before this returns)."""


class MemoryPipe:
    """One link's end of the pipe: :meth:`open` per connection, :meth:`send` out, :meth:`deliver` in
    (``handle(batch)`` runs in the next loop turn)."""

    __slots__ = ("peer", "handle", "identity", "_inbox")

    def __init__(self, peer: MemoryPeer, handle: Callable[[list[list[bytes]]], None]) -> None:
        self.peer = peer
        self.handle = handle
        self.identity = b""
        self._inbox: list[list[bytes]] = []

    def open(self, identity: bytes) -> None:
        self.close()
        self.identity = identity
        self.peer.link(identity, self.deliver)

    def close(self) -> None:
        if self.identity:
            self.peer.unlink(self.identity)
            self.identity = b""
        self._inbox = []

    def send(self, batch: list[list[bytes]]) -> bool:
        if not self.identity:
            return False
        self.peer.frames(self.identity, batch)
        return True

    def deliver(self, frames: list[bytes]) -> bool:
        self._inbox.append(frames)
        if len(self._inbox) == 1:
            asyncio.get_running_loop().call_soon(self._run)
        return True

    def _run(self) -> None:
        batch, self._inbox = self._inbox, []
        if batch:
            self.handle(batch)
