"""The ingress's own small HTTP surface: :class:`Request`, :class:`Response`, :class:`StreamResponse`.

What the endpoints see of HTTP, written by :mod:`.http1` (the connection: httptools parser, direct
writes) and nothing else: a request's method, path, query, headers (case-insensitive, first value
of a repeated header), peer address, ``Content-Length``, its body (read within the size limit;
:class:`BodyTooLarge` past it) and the parameters of its route; a response's status, headers and
body, written in one ``transport.write``; a stream's head, then its pieces (chunked, or
close-delimited for HTTP/1.0), each write waiting while the client's socket is full.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

__all__ = ["BodyTooLarge", "Headers", "Request", "Response", "StreamResponse", "Wire"]


class BodyTooLarge(Exception):
    """The request body exceeds the ingress's limit (raised by :meth:`Request.read`)."""


class Headers(dict):
    """A request's headers: lower-cased names, case-insensitive lookups, the first value of a repeated header."""

    __slots__ = ()

    def get(self, name: str, default=None):  # type: ignore[override]
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name) -> bool:  # type: ignore[override]
        return isinstance(name, str) and dict.__contains__(self, name.lower())


class Wire(Protocol):
    """What a request and its stream need from their connection (:class:`brokers.ingress.http1.HttpConnection`)."""

    write_paused: bool  # the client's socket is full: a write waits (drain) until it takes more

    def write_head(self, request: "Request", resp: "StreamResponse") -> None: ...

    def write_piece(self, request: "Request", data: bytes) -> None: ...

    def end_stream(self, request: "Request") -> None: ...

    async def drain(self) -> None: ...

    def read_body(self, request: "Request") -> "asyncio.Future[None]": ...

    @property
    def transport(self) -> asyncio.Transport | None: ...


class Request:
    """One parsed request head; its body arrives behind it (:meth:`read`)."""

    __slots__ = ("method", "path", "raw_path", "query", "headers", "remote", "content_length", "chunked", "http10", "keep_alive",
                 "expect_continue", "match_info", "wire", "parts", "size", "complete", "too_large", "waiter", "_body")

    def __init__(self, wire: Wire, method: str, path: str, query: str, headers: Headers, remote: str,
                 content_length: int | None, chunked: bool, http10: bool, keep_alive: bool) -> None:
        self.wire = wire
        self.method = method
        self.path = path
        self.raw_path = path  # before percent-decoding (the connection sets it)
        self.query = query
        self.headers = headers
        self.remote = remote
        self.content_length = content_length
        self.chunked = chunked
        self.http10 = http10
        self.keep_alive = keep_alive
        self.expect_continue = False
        self.match_info: dict[str, str] = {}
        self.parts: list[bytes] = []
        self.size = 0
        self.complete = False  # the whole body has arrived
        self.too_large = False  # ... or more than the limit did (the rest is dropped)
        self.waiter: asyncio.Future | None = None
        self._body: bytes | None = None

    @property
    def can_read_body(self) -> bool:
        return self.chunked or bool(self.content_length)

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.wire.transport

    def body_now(self) -> bytes | None:
        """The whole body when it has all arrived (within the limit), else None (then :meth:`read`)."""
        if self._body is None and (not self.complete or self.too_large):
            return None
        return self._body if self._body is not None else self._join()

    def _join(self) -> bytes:
        self._body = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
        self.parts = []
        return self._body

    async def read(self) -> bytes:
        """The whole body (kept: a second read returns it again); :class:`BodyTooLarge` past the limit,
        ConnectionResetError when the client goes away first."""
        if self._body is None:
            if not self.complete and not self.too_large:
                await self.wire.read_body(self)
            if self.too_large:
                raise BodyTooLarge(f"request body over the limit ({self.size} bytes so far)")
            return self._join()
        return self._body


class Response:
    """A complete answer: status, headers and body, written at once."""

    __slots__ = ("status", "headers", "body", "closing")

    prepared = False

    def __init__(self, *, body: bytes = b"", status: int = 200, headers: dict[str, str] | None = None,
                 content_type: str | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = dict(headers) if headers else {}
        if content_type is not None:
            self.headers["Content-Type"] = content_type
        self.closing = False

    def force_close(self) -> None:
        """Close the connection after this answer."""
        self.closing = True


class StreamResponse:
    """An answer written in pieces: :meth:`prepare` sends the head, :meth:`write` each piece (waiting
    while the client's socket is full), :meth:`write_eof` the end."""

    __slots__ = ("status", "headers", "prepared", "closing", "ended", "request")

    def __init__(self, *, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers = dict(headers) if headers else {}
        self.prepared = False
        self.closing = False
        self.ended = False
        self.request: Request | None = None

    def force_close(self) -> None:
        self.closing = True

    @property
    def must_wait(self) -> bool:
        """A write now would wait for the client to read (or the stream is not prepared)."""
        return self.request is None or self.request.wire.write_paused

    async def prepare(self, request: Request) -> None:
        self.request = request
        request.wire.write_head(request, self)
        self.prepared = True

    def write_nowait(self, data: bytes) -> None:
        """Hand ``data`` to the transport without waiting (see :attr:`must_wait`)."""
        req = self.request
        assert req is not None, "prepare() first"
        if data:
            req.wire.write_piece(req, data)

    async def write(self, data: bytes) -> None:
        """Write ``data`` (none: only wait), then wait while the client's socket is full."""
        self.write_nowait(data)
        await self.request.wire.drain()  # type: ignore[union-attr]

    async def write_eof(self) -> None:
        req = self.request
        if req is not None and not self.ended:
            self.ended = True
            req.wire.end_stream(req)
