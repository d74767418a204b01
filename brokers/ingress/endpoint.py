"""What the request endpoints (:mod:`.openai_api`, :mod:`.generate`) share: the submitter, the
reply streams, the answers to refused requests and the wait for an unstreamed request's FINAL."""

from __future__ import annotations

from typing import Any

from brokers.ingress import web

from brokers.ingress.replies import Call, ReplyStream, error_response, mesh_error_response, refusal_response
from brokers.ingress.submit import Submitter
from mesh import protocol as P
from mesh.errors import ErrorCode, RequestError

__all__ = ["Endpoint"]


class Endpoint:
    """Base of the request handlers: ``sub`` turns a request into a SUBMIT, ``streams`` answers it."""

    def __init__(self, submitter: Submitter, streams: ReplyStream) -> None:
        self.sub = submitter
        self.streams = streams

    async def head(self, request: web.Request) -> tuple[dict[str, Any] | None, int | None, dict]:
        """The request's SLO and deadline headers and its JSON body (raises the ``Ingress*`` errors)."""
        return self.sub.slo(request), self.sub.deadline_ms(request), await self.sub.read_json(request)

    def refused(self, exc: RequestError) -> web.Response:
        return refusal_response(self.sub.backend.stats, exc)

    async def final(self, call: Call) -> P.ClientFinal | web.Response:
        """An unstreamed request's FINAL, or the error answer when an error or the deadline comes first."""
        while True:
            m = await call.next()
            if m is None:
                return error_response(504, "no reply before the deadline", ErrorCode.DEADLINE_EXCEEDED.value, "server_error")
            if isinstance(m, P.ClientError):
                return mesh_error_response(m.code, m.message)
            if isinstance(m, P.ClientFinal):
                return m
