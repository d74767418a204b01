"""One HTTP request's replies, and the JSON and SSE answers every endpoint writes.

:class:`Call` is a submitted request seen from the ingress: the replies a broker sends a client,
read from the request's own sink and filtered to its rid (a reply for another rid is dropped and
counted, ``dropped{what=http_foreign_reply}``), until the terminal one. :class:`ReplyStream`
commits a streamed answer's 200 and SSE headers only once the first output (or, after ACCEPTED, at
most ``FIRST_OUTPUT_WAIT_S``) is there, so an error before any output keeps its HTTP status; later
errors go in-band as an SSE ``error`` event. Errors are OpenAI-style JSON bodies
(``{"error": {"message", "type", "code"}}``) with the status of the mesh error code;
``overloaded`` and ``rate_limited`` are 429 with ``Retry-After``. mesh's own metadata rides in
headers (``x-mesh-request-id``, ``x-mesh-worker``), never in the engine's body fields.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from typing import Any

import orjson
from brokers.ingress import web

from brokers.ingress.backend import IngressBackend, IngressCounters, ReplySink
from mesh import protocol as P
from mesh import tracing
from mesh.errors import ErrorCode, IngressBadRequest, IngressContextTooLong, IngressOverloaded, IngressTooLarge, RequestError

__all__ = ["Call", "ReplyStream", "dumps", "error_response", "json_response", "mesh_error_response", "refusal_response", "REFUSALS",
           "detok", "mesh_headers", "status_of", "FIRST_OUTPUT_WAIT_S", "RETRY_AFTER_S"]

FIRST_OUTPUT_WAIT_S = 5.0  # after ACCEPTED, how long a stream waits for output before committing a 200
RETRY_AFTER_S = "1"


def dumps(obj: Any) -> bytes:
    """JSON for replies (orjson: several times faster than json.dumps; anything it cannot encode
    -- never expected, the bodies are built here -- falls back to the standard library)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":"), default=str).encode()


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(obj), status=status, headers=headers, content_type="application/json")


def error_response(status: int, message: str, code: str, etype: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> web.Response:
    return json_response({"error": {"message": message, "type": etype, "code": code}}, status=status, headers=headers)


def mesh_error_response(code: str, message: str) -> web.Response:
    try:
        ec = ErrorCode(code)
    except ValueError:
        ec = ErrorCode.INTERNAL
    etype = "invalid_request_error" if ec.http_status < 500 else "server_error"
    headers = {"Retry-After": _retry_after(message)} if ec in (ErrorCode.OVERLOADED, ErrorCode.RATE_LIMITED) else None
    return error_response(ec.http_status, message, ec.value, etype, headers)


_RETRY_AFTER_RE = re.compile(r"retry after ([0-9]{1,6}) s$")


def _retry_after(message: str) -> str:
    """The seconds a refusal's message names (a tenant's limits: ``...; retry after N s``), else 1."""
    m = _RETRY_AFTER_RE.search(message)
    return m.group(1) if m else RETRY_AFTER_S


def refusal_response(stats: IngressCounters, exc: RequestError) -> web.Response:
    """The answer to a request the ingress refused before submitting it (counted by its code):
    400 (the connection closed when ``exc.close``), 413 (always closed: the rest of the body is
    not worth reading) or 429."""
    if isinstance(exc, IngressOverloaded):
        stats.requests[ErrorCode.OVERLOADED.value] += 1
        return mesh_error_response(ErrorCode.OVERLOADED.value, exc.message)
    if isinstance(exc, IngressContextTooLong):
        stats.requests[ErrorCode.CONTEXT_LENGTH_EXCEEDED.value] += 1
        return mesh_error_response(ErrorCode.CONTEXT_LENGTH_EXCEEDED.value, exc.message)
    if isinstance(exc, IngressTooLarge):
        stats.requests[ErrorCode.TOO_LARGE.value] += 1
        resp = error_response(413, exc.message, ErrorCode.TOO_LARGE.value)
        resp.force_close()
        return resp
    stats.requests[ErrorCode.BAD_REQUEST.value] += 1
    resp = error_response(400, exc.message, ErrorCode.BAD_REQUEST.value)
    if isinstance(exc, IngressBadRequest) and exc.close:
        resp.force_close()
    return resp


#: What the endpoints catch around turning a request into a SUBMIT (see :func:`refusal_response`).
REFUSALS = (IngressBadRequest, IngressTooLarge, IngressOverloaded, IngressContextTooLong)


def status_of(code: str) -> int:
    try:
        return ErrorCode(code).http_status
    except ValueError:
        return 500


def detok(data: dict, tok=None) -> str:
    if "text" in data and isinstance(data["text"], str):
        return data["text"]
    ids = data.get("token_ids") or []
    if tok is not None:
        return tok.decode(ids)  # only for workers that send no text (simulated ones)
    return "".join(f" <{t}>" for t in ids)


def mesh_headers(call: "Call", worker: str | None) -> dict[str, str]:
    """mesh's own metadata rides in headers, never in the engine's body fields."""
    h = {"x-mesh-request-id": call.rid, "x-request-id": call.rid}
    if worker:
        h["x-mesh-worker"] = header_safe(worker)
    return h


@functools.lru_cache(maxsize=4096)  # a fleet's few worker ids, once each
def header_safe(v: str) -> str:
    """A worker id as a header value: printable ASCII only (ids come from peers)."""
    v = v[:256]
    if v.isascii() and v.isprintable():
        return v
    return "".join(ch if " " <= ch <= "~" else "?" for ch in v)


# ---------------------------------------------------------------------------- one request


_EXPIRED = object()  # queued by a request's deadline timer


class Call:
    """One submitted request: its replies, filtered to its own rid, until the terminal one."""

    __slots__ = ("backend", "ident", "rid", "q", "t_end", "done", "worker", "expired", "idle", "_timer", "model", "tok")

    def __init__(self, backend: IngressBackend, ident: bytes, rid: str, q: ReplySink, timeout_s: float) -> None:
        self.backend = backend
        self.ident = ident
        self.rid = rid
        self.q = q
        self.t_end = time.monotonic() + timeout_s
        self.done = False
        self.worker = ""  # the worker of the latest ACCEPTED (streams)
        self.expired = False
        self.idle = False  # a stream ended for want of output (stream_idle_timeout_s)
        self.model = "mesh"  # the model id the answer reports
        self.tok = None  # the request's model's tokenizer (ModelTokenizer), if the ingress has one
        # One timer per request puts a marker in the queue at the deadline: waits then need no
        # timeout context each (a stream waits once per token).
        self._timer = asyncio.get_running_loop().call_later(timeout_s, q.put_nowait, _EXPIRED)

    async def next(self, until: float | None = None):
        """The next reply of this request, or None when ``until`` (default: the request's own
        deadline plus grace) passes first."""
        while True:
            if self.expired:
                return None
            try:
                frames = self.q.get_nowait()  # replies are usually waiting: no timer, no task
            except asyncio.QueueEmpty:
                if until is None:
                    frames = await self.q.get()
                else:
                    left = until - time.monotonic()
                    if left <= 0:
                        return None
                    try:
                        async with asyncio.timeout(left):
                            frames = await self.q.get()
                    except TimeoutError:
                        return None
            if frames is _EXPIRED:
                self.expired = True
                return None
            m = P.decode_client_reply(frames)
            if isinstance(m, P.ProtocolError):
                self.backend.stats.dropped["http_bad_reply"] += 1
                continue
            if getattr(m, "rid", None) != self.rid:
                self.backend.stats.dropped["http_foreign_reply"] += 1
                continue
            if isinstance(m, (P.ClientFinal, P.ClientError)):
                self.done = True
                if tracing.enabled():
                    if isinstance(m, P.ClientFinal):
                        u = m.usage if isinstance(m.usage, dict) else {}
                        tracing.annotate(worker=m.worker, attempt=m.attempt, route_reason=m.reason or None,
                                         finish_reason=m.finish_reason, prompt_tokens=u.get("prompt_tokens"),
                                         cached_tokens=u.get("cached_tokens"), completion_tokens=u.get("completion_tokens"))
                    else:
                        tracing.annotate(error_code=m.code)
            elif tracing.enabled():
                if isinstance(m, P.Accepted):
                    tracing.annotate(worker=m.worker, attempt=m.attempt)
                elif isinstance(m, P.ClientChunk) and m.seq == 0:
                    tracing.add_event("first_token")
            return m

    def close(self) -> None:
        self._timer.cancel()
        if not self.done:
            self.done = True
            self.backend.cancel(self.ident)
        self.backend.forget(self.ident)


# ---------------------------------------------------------------------------- streamed answers


class ReplyStream:
    """Waits for a request's outputs and writes SSE answers, within the ingress's stream limits."""

    def __init__(self, stats: IngressCounters, *, stream_idle_timeout_s: float, body_timeout_s: float) -> None:
        self.stats = stats
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.body_timeout_s = body_timeout_s

    async def open(self, request: web.Request, call: Call):
        """Wait for the first output before sending headers: an error (or the deadline) that
        comes first keeps its HTTP status. Returns (error response, None, None) or
        (None, the prepared stream, the first message or None)."""
        m = await self.first_output(call)
        if m is None and not call.done and (call.expired or call.idle):
            return error_response(504, self.timeout_message(call), ErrorCode.DEADLINE_EXCEEDED.value, "server_error"), None, None
        if isinstance(m, P.ClientError):
            return mesh_error_response(m.code, m.message), None, None
        return None, await self.begin(request, call), m

    async def first_output(self, call: Call):
        """For streams: the first reply worth committing HTTP headers for (a CHUNK or a terminal),
        or None when the request was accepted but produced nothing within FIRST_OUTPUT_WAIT_S
        (or nothing came at all: ``call`` then has no terminal, see ``call.done``; ``call.idle``
        when that was for ``stream_idle_timeout_s``)."""
        idle_end = time.monotonic() + self.stream_idle_timeout_s
        until = idle_end
        while True:
            m = await call.next(until)
            if m is None:
                call.idle = not call.expired and time.monotonic() >= idle_end
                return None
            if not isinstance(m, P.Accepted):
                return m
            call.worker = m.worker
            until = min(idle_end, time.monotonic() + FIRST_OUTPUT_WAIT_S)

    async def next_output(self, call: Call):
        """A stream's next reply, or None: the deadline passed (``call.expired``) or no output came
        for ``stream_idle_timeout_s`` (counted; the request is cancelled when the handler ends)."""
        m = await call.next(time.monotonic() + self.stream_idle_timeout_s)
        if m is None and not call.expired:
            call.idle = True
            self.stats.dropped["http_stream_idle_timeout"] += 1
        return m

    def timeout_message(self, call: Call) -> str:
        return (f"no output for {self.stream_idle_timeout_s:g} s" if call.idle and not call.expired
                else "no reply before the deadline")

    async def write(self, resp: web.StreamResponse, data: bytes) -> None:
        if not resp.must_wait:
            resp.write_nowait(data)
            if not resp.must_wait:  # the client's socket took it: no timer for a write that never waited
                return
            data = b""  # taken, but the socket is full now: wait for it below
        try:
            async with asyncio.timeout(self.body_timeout_s):  # no Task per write (wait_for makes one)
                await resp.write(data)
        except TimeoutError:  # a client that does not read holds a handler: drop it
            self.stats.dropped["http_write_timeout"] += 1
            raise ConnectionResetError("client stopped reading") from None

    async def sse(self, resp: web.StreamResponse, obj: dict) -> None:
        await self.write(resp, b"data: " + dumps(obj) + b"\n\n")

    async def sse_timeout(self, resp: web.StreamResponse, call: Call) -> None:
        """The in-band SSE error of a stream that got no output in time (:meth:`timeout_message`)."""
        await self.sse(resp, {"error": {"message": self.timeout_message(call), "type": "server_error",
                                        "code": ErrorCode.DEADLINE_EXCEEDED.value}})

    async def begin(self, request: web.Request, call: Call) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **mesh_headers(call, call.worker)})
        await resp.prepare(request)
        return resp
