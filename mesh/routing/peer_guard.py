"""What a peer of the broker exchange may move, whatever kind of message it sends. Pure.

The exchange's messages change every router's view of the fleet, so a peer that lies, floods or
impersonates another one steers requests. These objects bound that, independently of the message
kind (figures, routed prompts, or anything added later), and :class:`~mesh.routing.peers.PeerMerge`
and :mod:`brokers.peer_exchange` apply them:

* :class:`RateBudget` -- a token bucket of messages *and* bytes per second, one per source (each
  configured ``--peer`` endpoint is read through a socket of its own, so the shell knows the
  source of every message before decoding it). A message over budget is dropped undecoded and
  counted: a flood costs the receiver one ``recv`` per message, never a decode.
* :class:`SourceBinding` -- a broker id is bound to the source (endpoint, and with
  ``--peer-curve-keys`` the key) it first arrived from: a message claiming another source's id,
  or a source claiming a second id, is dropped while the bound peer is fresh. A binding lapses
  when its peer goes stale, so a peer restarted under a new id (or behind a new address) is
  accepted after one staleness bound, never later.
* :func:`epoch_step_ok` -- epochs (the sender's boot time in wall-clock nanoseconds) only move
  forward by what the receiver's own clock says can have elapsed since the current epoch was
  accepted (plus a skew allowance): a jump to 2**63-1 is refused. A stale peer's epoch expires:
  its next message is accepted whatever its epoch, so no epoch locks a peer out for longer than
  one staleness bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RateBudget", "SourceBinding", "epoch_step_ok", "EPOCH_SKEW_NS"]

#: How far ahead of the receiver's elapsed time a new epoch may be (clocks of two hosts and the
#: sender's restart path): 10 minutes of wall-clock nanoseconds.
EPOCH_SKEW_NS = 600 * 10**9


def epoch_step_ok(old_epoch: int, new_epoch: int, elapsed_s: float, skew_ns: int = EPOCH_SKEW_NS) -> bool:
    """True if ``new_epoch`` (> ``old_epoch``) is at most ``elapsed_s`` seconds plus the skew
    allowance ahead of it."""
    return new_epoch - old_epoch <= int(max(0.0, elapsed_s) * 1e9) + skew_ns


@dataclass(slots=True)
class RateBudget:
    """Token bucket of ``msgs_per_s`` messages and ``bytes_per_s`` bytes (bursts of one second's
    worth, at least one maximum-size message). :meth:`take` says why a message is refused
    (``"rate"``, ``"bytes"``) or ``""`` when it is within budget (then it is charged)."""

    msgs_per_s: float
    bytes_per_s: float
    max_msg_bytes: int = 0
    _msgs: float = field(default=-1.0, init=False)
    _bytes: float = field(default=-1.0, init=False)
    _at_s: float = field(default=0.0, init=False)

    def take(self, nbytes: int, now_s: float) -> str:
        cap_m = max(1.0, self.msgs_per_s)
        cap_b = max(float(self.max_msg_bytes), self.bytes_per_s)
        if self._msgs < 0:
            self._msgs, self._bytes, self._at_s = cap_m, cap_b, now_s
        dt = now_s - self._at_s
        if dt > 0:
            self._msgs = min(cap_m, self._msgs + dt * self.msgs_per_s)
            self._bytes = min(cap_b, self._bytes + dt * self.bytes_per_s)
            self._at_s = now_s
        if self._msgs < 1.0:
            return "rate"
        if self._bytes < nbytes:
            return "bytes"
        self._msgs -= 1.0
        self._bytes -= nbytes
        return ""


class SourceBinding:
    """Which broker id each source speaks for (see the module docstring). The caller says whether
    a broker id is fresh; an unsourced message (``source`` "": the simulator, in-process tests)
    is not bound."""

    def __init__(self) -> None:
        self.id_of: dict[str, str] = {}  # source -> broker id
        self.source_of: dict[str, str] = {}  # broker id -> source

    def check(self, source: str, broker: str, is_fresh) -> str:
        """``""`` if ``source`` may speak for ``broker`` now, else the drop reason:
        ``id_mismatch`` (this source already speaks for another fresh broker) or ``id_spoofed``
        (another source speaks for this fresh broker)."""
        if not source:
            return ""
        bound = self.id_of.get(source)
        if bound is not None and bound != broker and is_fresh(bound):
            return "id_mismatch"
        owner = self.source_of.get(broker)
        if owner is not None and owner != source and is_fresh(broker):
            return "id_spoofed"
        return ""

    def bind(self, source: str, broker: str) -> None:
        if not source:
            return
        old = self.id_of.get(source)
        if old is not None and old != broker:
            self.source_of.pop(old, None)
        prev = self.source_of.get(broker)
        if prev is not None and prev != source:
            self.id_of.pop(prev, None)
        self.id_of[source] = broker
        self.source_of[broker] = source

    def release(self, broker: str) -> None:
        src = self.source_of.pop(broker, None)
        if src is not None and self.id_of.get(src) == broker:
            del self.id_of[src]
