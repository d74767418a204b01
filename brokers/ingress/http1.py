"""The ingress's HTTP/1.1 server: one :class:`asyncio.Protocol` per connection, the httptools parser,
answers written straight to the transport (no framework, no middleware chain).

Per connection: the request head is parsed into a :class:`~.web.Request` and its handler starts as
a task (one at a time: pipelined requests wait, in order, and reading pauses past
``MAX_PIPELINED`` of them); the body arrives behind the head, read by the handler within the body
limit. An answer is written in one ``transport.write`` (status line, headers, body); a stream is
chunked (HTTP/1.1) or close-delimited (HTTP/1.0), each piece waiting while the client's socket is
full (``pause_writing``; the caller bounds that wait). Keep-alive as the request asks (HTTP/1.1 by
default, HTTP/1.0 with ``Connection: keep-alive``); the connection closes after an answer sent
before its request's body was read whole (a refusal from the head), or one forced closed.
``Expect: 100-continue`` is answered when the handler reads the body, so a refusal from the head
never invites the body. Chunked request bodies are accepted within the same limit as others.

What the parser refuses is a 400 (too long a URL 414, too many or too large headers 431), counted
in ``dropped`` and followed by a close; a client that goes away cancels its running handler
(``dropped{what=http_client_disconnected}``), which cancels its request. The connection's place for
the guard (:mod:`.guard`: waiting for a head, busy, idle) is set here.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from urllib.parse import unquote

import httptools
import orjson

from brokers.ingress.backend import IngressCounters
from brokers.ingress.guard import REFUSED_RESPONSE, ConnGuard
from brokers.ingress.web import Headers, Request, Response, StreamResponse
from mesh.errors import ErrorCode

__all__ = ["HttpConnection", "Site", "MAX_HEADERS", "MAX_HEADER_BYTES", "MAX_URL_BYTES", "MAX_PIPELINED"]

MAX_URL_BYTES = 8190  # aiohttp's max_line_size
MAX_HEADERS = 128
MAX_HEADER_BYTES = 65536  # names and values of one request head
MAX_PIPELINED = 8  # requests parsed ahead of the running one before reading pauses
LINGER_S = 5.0  # after an answer sent before its request's body was read: how long the rest is read and dropped

_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n" for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


def _status_line(status: int) -> str:
    return _STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n"


def _header_lines(headers: dict[str, str]) -> str:
    out = ""
    for k, v in headers.items():
        if "\n" in v or "\r" in v:  # values from peers (an engine's Content-Type): never a second header
            v = v.replace("\r", " ").replace("\n", " ")
        out += f"{k}: {v}\r\n"
    return out


def _error_bytes(status: int, message: str, code: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}})
    return (f"{_status_line(status)}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


class Site:
    """What every connection of one server shares: the guard, the handler, the counters, the body limit."""

    __slots__ = ("guard", "dispatch", "stats", "max_body_bytes", "loop")

    def __init__(self, guard: ConnGuard, dispatch: Callable[[Request], Awaitable[Response | StreamResponse]],
                 stats: IngressCounters, max_body_bytes: int) -> None:
        self.guard = guard
        self.dispatch = dispatch
        self.stats = stats
        self.max_body_bytes = max_body_bytes
        self.loop = asyncio.get_running_loop()


class _Stop(Exception):
    """Raised from a parser callback to stop parsing a connection that was just failed."""


class HttpConnection(asyncio.Protocol):
    """One HTTP connection (see the module docstring); ``state``/``since``/``peer`` are the guard's."""

    __slots__ = ("site", "transport", "parser", "peer", "state", "since", "refused", "closing", "url", "hdrs", "n_hdrs",
                 "hdr_bytes", "clen", "chunked", "expect", "in_head", "reading", "current", "task", "pending", "read_paused",
                 "write_paused", "drainer", "stream_chunked", "stream_keep", "last", "broken", "lingering")

    def __init__(self, site: Site) -> None:
        self.site = site
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.peer = ""
        self.state = "head"
        self.since = 0.0
        self.refused = False
        self.closing = False
        self.url = b""
        self.hdrs = Headers()
        self.n_hdrs = 0
        self.hdr_bytes = 0
        self.clen: int | None = None
        self.chunked = False
        self.expect = False
        self.in_head = False  # a request head is being parsed
        self.reading: Request | None = None  # the request whose body is arriving
        self.current: Request | None = None  # the request whose handler runs
        self.task: asyncio.Task | None = None
        self.pending: deque[Request] = deque()  # pipelined requests behind the current one
        self.read_paused = False  # for pipelining
        self.write_paused = False
        self.drainer: asyncio.Future | None = None
        self.stream_chunked = False
        self.stream_keep = False
        self.last = False  # no more requests on this connection: close after the ones parsed
        self.broken: bytes | None = None  # the error answer due after the requests parsed before it
        self.lingering = False  # answered; the rest of the request body is read and dropped, then the close

    # ---------------------------------------------------------------- transport events
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        guard = self.site.guard
        if not guard.admit(self):
            self.refused = self.closing = True
            transport.write(REFUSED_RESPONSE)
            transport.close()
            return
        guard.head_started(self)

    def connection_lost(self, exc) -> None:
        self.closing = True
        self.site.guard.forget(self)
        t = self.task
        if t is not None and not t.done():  # handler_cancellation: the client went away, its request is cancelled
            self.site.stats.dropped["http_client_disconnected"] += 1
            t.cancel()
        self.task = None
        self.pending.clear()
        d = self.drainer
        if d is not None and not d.done():
            d.set_exception(ConnectionResetError("the client went away"))
        self.transport = None

    def pause_writing(self) -> None:  # a client that does not read: stop reading its next requests too
        self.write_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        d = self.drainer
        if d is not None and not d.done():
            d.set_result(None)
        if self.transport is not None and not self.read_paused and not self.closing:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.closing or (self.last and not self.lingering):
            return
        if self.state == "idle":  # first bytes of the next request on a kept-alive connection
            self.site.guard.head_started(self)
        try:
            self.parser.feed_data(data)
        except _Stop:
            pass
        except httptools.HttpParserUpgrade:  # the request is answered; what follows is not HTTP/1.1
            self.last = True
        except httptools.HttpParserError as exc:  # (a callback's _Stop comes wrapped in one: already answered)
            if self.broken is None and not self.closing:
                self.fail(400, f"malformed HTTP request: {exc}"[:200], "http_malformed")

    def close(self) -> None:
        self.closing = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _linger(self, req: Request) -> None:
        """Answered before its body arrived whole (a refusal from the head): read and drop the rest
        (at most ``LINGER_S``) before closing, so the client reads the answer, not a reset."""
        t = self.transport
        self.lingering = self.last = True
        req.too_large = True  # what still comes is dropped
        if t is not None and t.can_write_eof():
            t.write_eof()
        self.site.loop.call_later(LINGER_S, self.close)

    def fail(self, status: int, message: str, what: str) -> None:
        """Answer an error (after the requests parsed before it) and close: the rest of the bytes cannot be trusted."""
        self.site.stats.dropped[what] += 1
        self.last = True
        self.broken = _error_bytes(status, message, ErrorCode.BAD_REQUEST.value)
        if self.current is not None and self.reading is self.current:  # its own body is broken: nothing is due before the 400
            self.current = None
            if self.task is not None:
                self.task.cancel()
                self.task = None
        if self.current is None:
            self._finish()

    # ---------------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        if self.lingering:  # the body read and dropped is over: no more requests
            self.close()
            raise _Stop
        self.in_head = True
        self.url = b""
        self.hdrs = Headers()
        self.n_hdrs = 0
        self.hdr_bytes = 0
        self.clen = None
        self.chunked = False
        self.expect = False

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_URL_BYTES:
            self.fail(414, f"request target over {MAX_URL_BYTES} bytes", "http_url_too_long")
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        self.n_hdrs += 1
        self.hdr_bytes += len(name) + len(value)
        if self.n_hdrs > MAX_HEADERS or self.hdr_bytes > MAX_HEADER_BYTES:
            self.fail(431, f"request head over {MAX_HEADERS} headers or {MAX_HEADER_BYTES} bytes", "http_header_flood")
            raise _Stop
        k = name.decode("latin-1").lower()
        if k in self.hdrs:  # Headers.__contains__ lower-cases again: k already is
            return
        v = value.decode("utf-8", "surrogateescape")
        dict.__setitem__(self.hdrs, k, v)
        if k == "content-length":
            self.clen = int(value)  # llhttp checked: digits, and one value
        elif k == "transfer-encoding":
            self.chunked = "chunked" in v.lower()
        elif k == "expect":
            self.expect = v.lower() == "100-continue"

    def on_headers_complete(self) -> None:
        self.in_head = False
        p = self.parser
        raw, _, query = self.url.partition(b"?")
        path = raw.decode("utf-8", "surrogateescape")
        req = Request(self, p.get_method().decode("latin-1"), unquote(path) if "%" in path else path,
                      query.decode("utf-8", "surrogateescape"), self.hdrs, self.peer, self.clen, self.chunked,
                      p.get_http_version() == "1.0", p.should_keep_alive())
        req.raw_path = path
        req.expect_continue = self.expect
        self.reading = req
        if self.current is None:
            self._start(req)
        else:
            self.pending.append(req)
            if len(self.pending) >= MAX_PIPELINED and self.transport is not None:
                self.read_paused = True
                self.transport.pause_reading()

    def on_body(self, data: bytes) -> None:
        req = self.reading
        if req is None or req.too_large:
            return
        req.size += len(data)
        if req.size > self.site.max_body_bytes:
            req.too_large = True
            req.parts = []
            self._wake(req)
        else:
            req.parts.append(data)

    def on_message_complete(self) -> None:
        req = self.reading
        if self.lingering:
            self.close()
            raise _Stop
        if req is not None:
            self.reading = None
            req.complete = True
            self._wake(req)

    @staticmethod
    def _wake(req: Request) -> None:
        w = req.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ---------------------------------------------------------------- requests
    def _start(self, req: Request) -> None:
        self.current = req
        self.site.guard.busy(self)
        self.task = self.site.loop.create_task(self._run(req))

    async def _run(self, req: Request) -> None:
        try:
            resp = await self.site.dispatch(req)  # answers every error itself (app.py)
        except Exception:  # noqa: BLE001 - never expected: the connection cannot go on
            self.site.stats.dropped["http_handler_exception"] += 1
            self.close()
            raise
        self.task = None
        self.current = None
        t = self.transport
        if t is None or self.closing or t.is_closing():  # (a handler that closed it: its answer is never written)
            self.closing = True
            return
        keep = req.keep_alive and req.complete and not resp.closing  # (then _finish answers what was parsed before a close)
        if isinstance(resp, StreamResponse):
            if not resp.prepared:
                await resp.prepare(req)
            await resp.write_eof()
            keep = keep and self.stream_keep
        else:
            t.write(self._head(req, resp.status, resp.headers, f"Content-Length: {len(resp.body)}\r\n",
                               keep and not (self.last and not self.pending)) + (resp.body if req.method != "HEAD" else b""))
        if keep:
            self._finish()
        elif not req.complete:
            self._linger(req)
        else:
            self.close()

    def _finish(self) -> None:
        """The running request is answered: start the next pipelined one, else wait for the next head."""
        if self.pending:
            nxt = self.pending.popleft()
            if self.read_paused and len(self.pending) < MAX_PIPELINED // 2 and self.transport is not None:
                self.read_paused = False
                if not self.write_paused:
                    self.transport.resume_reading()
            self._start(nxt)
        elif self.broken is not None or self.last:
            t = self.transport
            self.closing = True
            if t is not None:
                if self.broken is not None:
                    t.write(self.broken)
                t.close()
        elif self.in_head:
            self.site.guard.head_started(self)
        else:
            self.site.guard.idle(self)

    @staticmethod
    def _head(req: Request, status: int, headers: dict[str, str], framing: str, keep: bool) -> bytes:
        conn = ("Connection: keep-alive\r\n" if req.http10 else "") if keep else "Connection: close\r\n"
        return (_status_line(status) + _header_lines(headers) + framing + conn + "\r\n").encode("utf-8", "replace")

    # ---------------------------------------------------------------- web.Wire (streams, bodies)
    def write_head(self, request: Request, resp: StreamResponse) -> None:
        t = self.transport
        if t is None or self.closing:
            raise ConnectionResetError("Cannot write to closing transport")
        self.stream_chunked = not request.http10  # HTTP/1.0: the end of the stream is the close
        self.stream_keep = self.stream_chunked and request.keep_alive and request.complete and not resp.closing
        t.write(self._head(request, resp.status, resp.headers, "Transfer-Encoding: chunked\r\n" if self.stream_chunked else "",
                           self.stream_keep and not (self.last and not self.pending)))

    def write_piece(self, request: Request, data: bytes) -> None:
        t = self.transport
        if t is None or self.closing:
            raise ConnectionResetError("Cannot write to closing transport")
        t.write(b"%x\r\n%b\r\n" % (len(data), data) if self.stream_chunked else data)

    def end_stream(self, request: Request) -> None:
        t = self.transport
        if t is not None and not self.closing and self.stream_chunked:
            t.write(_LAST_CHUNK)

    async def drain(self) -> None:
        if not self.write_paused:
            return
        if self.transport is None or self.closing:
            raise ConnectionResetError("Cannot write to closing transport")
        self.drainer = self.site.loop.create_future()
        try:
            await self.drainer
        finally:
            self.drainer = None

    def read_body(self, request: Request) -> asyncio.Future:
        t = self.transport
        if t is None or self.closing:
            raise ConnectionResetError("the client went away")
        if request.expect_continue:
            request.expect_continue = False
            t.write(_CONTINUE)
        w = request.waiter = self.site.loop.create_future()
        return w
