"""A request the gateway relays to a broker, and how it moves to another broker (issue 31 item 4).

When the broker holding a request dies (its connection drops) or answers ``unavailable``
(draining, restarting), or ``worker_lost`` before any output, the gateway resubmits the request
to another broker, by the rules :meth:`mesh.client.Client.generate` follows: idempotent requests
only, at most :data:`MAX_RESUBMITS` times, within the request's deadline. A request that already
streamed output is *continued* there, as a broker continues a stream whose worker was lost
(:mod:`mesh.broker_core.migrate`): the prompt plus the tokens streamed so far, ``max_new_tokens``
reduced; the client's stream goes on with the next ``seq`` and gets one terminal reply.
:class:`Relay` keeps what that takes; no I/O here (the gateway sends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mesh import protocol as P
from mesh.broker_core import migrate
from mesh.errors import ErrorCode, ProtocolError

__all__ = ["MAX_RESUBMITS", "Relay"]

#: resubmissions per request (``mesh.client.Client.generate``'s default ``resubmit``)
MAX_RESUBMITS = 3


@dataclass(slots=True)
class Relay:
    """One relayed request: the SUBMIT its broker has, the output relayed so far."""

    ident: bytes
    sub: P.Submit
    link: Any
    deadline_s: float
    unmigratable: str = ""  # why its stream cannot be continued elsewhere ("": it can)
    chunks: list | None = None  # CHUNK payloads since its last (re)submission, kept while it can be continued
    sent: int = 0  # chunks relayed to the client (the next client seq)
    seq_base: int = 0  # the client seq the current broker's seq 0 is
    produced: int = 0  # tokens streamed before its current submission (sent to it as prompt)
    resubmits: int = 0

    @classmethod
    def of(cls, ident: bytes, sub: P.Submit, link: Any, now_s: float, default_deadline_ms: int) -> "Relay":
        r = cls(ident, sub, link, now_s + (sub.deadline_ms or default_deadline_ms) / 1000.0)
        r.unmigratable = migrate.refusal(sub) or "" if sub.stream else "not_streamed"
        if not r.unmigratable:
            r.chunks = []
        return r

    def relayed(self, m: Any, frames: list[bytes]) -> list[bytes]:
        """The frames to hand the client for broker reply ``m``: a continued stream's chunks
        renumbered after those already sent, its FINAL's usage as the client's request saw it."""
        t = type(m)
        if t is P.ClientChunk:
            if self.chunks is not None and len(frames) == 4:
                if len(self.chunks) > self.sub.max_new_tokens:  # more chunks than tokens: not kept (as the broker)
                    self.chunks, self.unmigratable = None, "too_many_chunks"
                else:
                    self.chunks.append(frames[3])
            seq = self.sent
            self.sent += 1
            if m.seq != seq:  # (a continued stream: its new broker counts from 0)
                return P.encode_client_chunk(m.rid, seq, frames[3] if len(frames) == 4 else P.pack({}))
        elif t is P.ClientFinal and self.produced:
            return P.encode_client_final(m.rid, m.finish_reason, migrate.continued_usage(m.usage, self.produced), m.worker,
                                         m.attempt, frames[3] if len(frames) == 4 else b"", m.reason)
        return frames

    def may_move(self, code: str) -> bool:
        """Whether an ERROR ``code`` from its broker is one to resubmit on (``unavailable``; or
        ``worker_lost`` before any output, as ``mesh.client`` does)."""
        return code == ErrorCode.UNAVAILABLE.value or (code == ErrorCode.WORKER_LOST.value and not self.sent)

    def resubmission(self, now_s: float) -> tuple[P.Submit, bool] | str:
        """The SUBMIT that redoes it (nothing streamed yet) or continues it (True) on another
        broker, with the deadline left; or why it cannot move (a refusal reason)."""
        if not self.sub.idempotent:
            return "not_idempotent"
        if self.resubmits >= MAX_RESUBMITS:
            return "limit"
        left_ms = int((self.deadline_s - now_s) * 1000)
        if left_ms <= 0:
            return "deadline"
        sub, produced = self.sub, 0
        if self.sent:
            cont = self.unmigratable or migrate.continuation(self.sub, self.chunks or [])
            if isinstance(cont, str):
                return cont
            sub, produced = cont
        body = P.unpack(sub.raw)
        body["deadline_ms"] = left_ms
        new = P.submit_of_body(body, P.pack(body))
        if isinstance(new, ProtocolError):
            return "bad_request"
        self.sub = new
        self.produced += produced
        self.seq_base = self.sent
        self.resubmits += 1
        if self.chunks is not None:
            self.chunks = []
        return new, bool(self.sent)
