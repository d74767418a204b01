"""What the broker core asks its shell to send, and what a failed send means (pure records).

The core never touches a socket. Every input (a decoded message, a timer tick) appends
:class:`Send` records to :attr:`BrokerCore.out`; the shell sends them in order and, when one
fails (ROUTER_MANDATORY: the peer is unreachable, or its pipe is at the send HWM), sets
:attr:`Send.failed` and hands it back through :meth:`BrokerCore.send_failed`, which may append
more sends (a re-dispatch). A send with a :attr:`Send.when` goes out only if that earlier send
did (the ACCEPTED frame of an attempt follows its REQUEST). :func:`deliver` is that loop, the
one the broker shell, the simulator and the tests all run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Protocol

__all__ = ["Send", "Receipt", "TO_WORKER", "TO_CLIENT", "Outbox", "deliver"]

TO_WORKER = 0
TO_CLIENT = 1


class Receipt(enum.IntEnum):
    """What the core must do when a send fails (NONE: the shell's drop counter is all)."""

    NONE = 0
    DISPATCH = 1  # a REQUEST to a worker: release it, try another worker
    DECODE = 2  # the decode leg of a P/D request: retry or fail it
    CHUNK = 3  # a streamed chunk: the client is gone or not reading, cancel its requests
    FINAL = 4  # a FINAL: counted client_slow / client_gone instead of ok
    HEARTBEAT = 5  # a heartbeat: an unreachable worker's connection is gone, remove it now


@dataclass(slots=True)
class Send:
    to: int  # TO_WORKER | TO_CLIENT
    identity: bytes
    frames: list[bytes]
    receipt: Receipt = Receipt.NONE
    ref: Any = None  # the Inflight (DISPATCH, DECODE, CHUNK, FINAL) or WorkerSession (HEARTBEAT)
    attempt: int = 0  # the attempt a DISPATCH / DECODE carried
    when: "Send | None" = None  # only sent if this earlier send went out
    failed: str = ""  # set by the shell: why it failed ("send_hwm" | "unreachable")


class Outbox:
    """The sends the core's collaborators append, in order (one list, never replaced)."""

    __slots__ = ("sends",)

    def __init__(self) -> None:
        self.sends: list[Send] = []

    def to_worker(self, identity: bytes, frames: list[bytes], receipt: Receipt = Receipt.NONE, ref: Any = None,
                  attempt: int = 0) -> Send:
        s = Send(TO_WORKER, identity, frames, receipt, ref, attempt)
        self.sends.append(s)
        return s

    def to_client(self, identity: bytes, frames: list[bytes], receipt: Receipt = Receipt.NONE, ref: Any = None,
                  when: Send | None = None) -> Send:
        s = Send(TO_CLIENT, identity, frames, receipt, ref, 0, when)
        self.sends.append(s)
        return s


class _Core(Protocol):
    out: list[Send]

    def send_failed(self, send: Send, now: float) -> None: ...


def deliver(core: _Core, transport: Callable[[Send], str | None], clock: Callable[[], float],
            on_error: Callable[[Exception], None] | None = None) -> None:
    """Make ``core``'s pending sends in order through ``transport`` (returns why a send failed,
    falsy when it went out). A failed send is marked (:attr:`Send.failed`) and, when it carries
    a receipt, handed back through ``core.send_failed`` at ``clock()``; what that appends is
    delivered in the same loop. Sends conditional on a failed one are skipped. ``on_error``:
    a ``send_failed`` that raises is reported there instead of propagating (the broker's loop
    must survive a core bug). The list is drained in place, also when ``transport`` raises."""
    out = core.out
    i = 0
    try:
        while i < len(out):
            s = out[i]
            i += 1
            if s.when is not None and s.when.failed:
                continue
            why = transport(s)
            if why:
                s.failed = why
                if s.receipt:
                    try:
                        core.send_failed(s, clock())
                    except Exception as exc:  # a core bug must not kill the broker's loop
                        if on_error is None:
                            raise
                        on_error(exc)
    finally:
        del out[:i]
