"""What the broker core asks its shell to send, and what a failed send means (pure records).

The core never touches a socket. Every input (a decoded message, a timer tick) appends
:class:`Send` records to :attr:`BrokerCore.out`; the shell sends them in order and, when one
fails (ROUTER_MANDATORY: the peer is unreachable, or its pipe is at the send HWM), sets
:attr:`Send.failed` and hands it back through :meth:`BrokerCore.send_failed`, which may append
more sends (a re-dispatch). A send with a :attr:`Send.when` goes out only if that earlier send
did (the ACCEPTED frame of an attempt follows its REQUEST).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["Send", "Receipt", "TO_WORKER", "TO_CLIENT"]

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
