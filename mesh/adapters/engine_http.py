"""A lean keep-alive HTTP/1.1 client for the adapter's hot path: one engine, one pool.

Why not aiohttp's client: per request it builds a request object, a response object, a
payload writer, a stream reader, timers and several futures; profiled in the adapter it cost
more CPU than everything else the adapter does per request. This client does the minimum an
adapter needs from an engine on localhost or in its own pod: ``POST`` a JSON body, read the
status, then either the whole body or the body chunks as they arrive (SSE), on connections
that are kept alive and reused. Parsing is httptools' (llhttp, the parser Node.js uses), so
chunked transfer encoding, keep-alive rules and malformed responses are handled by a
well-kept parser, not by hand.

Contract:

* :meth:`EngineHttp.request` returns ``(status, body bytes)``; :meth:`EngineHttp.stream` is an
  async context manager giving ``(status, chunks)`` where ``chunks`` is an async iterator of
  body pieces. Leaving the context before the body ended closes the connection (that is how an
  engine learns a request was abandoned: SGLang and vLLM abort a request whose client
  disconnected).
* Errors: :class:`EngineConnectionError` (a subclass of ``ConnectionError``) when the connection
  fails or the response is malformed or larger than ``max_body_bytes``. Timeouts are the
  caller's (``asyncio.timeout`` around the call); a cancelled call closes its connection.
* Pool: idle connections are reused last-in first-out; one idle longer than ``idle_ttl_s`` is
  closed rather than reused (servers close idle keep-alive connections after a few seconds --
  uvicorn's default is 5 s -- and a request sent just as the server closes is lost). A request
  whose *reused* connection is found closed before any response byte arrived is retried once on
  a fresh connection; nothing else is ever retried here.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httptools

__all__ = ["EngineHttp", "EngineConnectionError"]


class EngineConnectionError(ConnectionError):
    """The engine connection failed, closed early, or sent a malformed or oversized response."""


class _Conn(asyncio.Protocol):
    """One TCP connection; parses one response at a time."""

    __slots__ = ("pool", "transport", "parser", "status", "body", "chunks", "streaming", "done", "error", "waiter",
                 "got_bytes", "body_bytes", "idle_since", "reused", "paused", "keep_alive", "framed", "content_type")

    def __init__(self, pool: "EngineHttp") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.body = bytearray()
        self.chunks: deque[bytes] = deque()
        self.streaming = False
        self.done = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.got_bytes = False
        self.body_bytes = 0
        self.idle_since = 0.0
        self.reused = False
        self.paused = False
        self.keep_alive = False
        self.framed = False  # the response has a Content-Length or is chunked (else: ends at EOF)
        self.content_type = ""  # the response's Content-Type (pass-through answers carry it on)

    # ---------------------------------------------------------------- asyncio protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # pragma: no cover - engines do not upgrade
            self._fail(EngineConnectionError("unexpected protocol upgrade from the engine"))
        except httptools.HttpParserError as exc:
            self._fail(EngineConnectionError(f"malformed HTTP response from the engine: {exc}"))

    def connection_lost(self, exc) -> None:
        self.pool._forget(self)
        if not self.done and exc is None and self.status and not self.framed:
            self.on_message_complete()  # a close-delimited body ends at EOF
            self.keep_alive = False
        elif not self.done:
            self._fail(EngineConnectionError(f"engine closed the connection{': ' + str(exc) if exc else ''}"))

    # ---------------------------------------------------------------- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 12 and name.lower() == b"content-type":
            self.content_type = value[:256].decode("latin-1")
        elif len(name) in (14, 17):
            n = name.lower()
            if n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
                self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > self.pool.max_body_bytes:
            self._fail(EngineConnectionError(f"engine response exceeds {self.pool.max_body_bytes} bytes"))
            return
        if self.streaming:
            self.chunks.append(body)
            if not self.paused and len(self.chunks) > 256 and self.transport is not None:
                self.paused = True  # the reader is behind: let TCP push back on the engine
                self.transport.pause_reading()
            self._wake()
        else:
            self.body += body

    def on_message_complete(self) -> None:
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # ---------------------------------------------------------------- internals
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.done = True
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()
        self._wake()

    async def _wait(self) -> None:
        self.waiter = self.pool._loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def begin(self, head: bytes, body: bytes, streaming: bool) -> None:
        self.status = 0
        self.body = bytearray()
        self.chunks.clear()
        self.streaming = streaming
        self.done = False
        self.error = None
        self.got_bytes = False
        self.body_bytes = 0
        self.keep_alive = False
        self.framed = False
        self.content_type = ""
        assert self.transport is not None
        self.transport.write(head + body if len(body) < 16384 else head)
        if len(body) >= 16384:
            self.transport.write(body)

    async def headers(self) -> int:
        while self.status == 0 and self.error is None:
            await self._wait()
        if self.error is not None:
            raise self.error
        return self.status

    async def whole_body(self) -> bytes:
        while not self.done:
            await self._wait()
        if self.error is not None:
            raise self.error
        return bytes(self.body)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        while True:
            while self.chunks:
                if self.paused and len(self.chunks) <= 16 and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                yield self.chunks.popleft()
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await self._wait()


class EngineHttp:
    """Keep-alive connections to one engine at ``host:port`` (see the module docstring)."""

    def __init__(self, host: str, port: int, *, tls: bool = False, path_prefix: str = "", max_idle: int = 256,
                 idle_ttl_s: float = 3.0, connect_timeout_s: float = 10.0, max_body_bytes: int = 256 * 1024 * 1024) -> None:
        self.host = host
        self.port = port
        self.path_prefix = path_prefix.rstrip("/")
        self._ssl = None
        if tls:
            import ssl

            self._ssl = ssl.create_default_context()
        self.max_idle = max_idle
        self.idle_ttl_s = idle_ttl_s
        self.connect_timeout_s = connect_timeout_s
        self.max_body_bytes = max_body_bytes
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        self._loop = asyncio.get_running_loop()
        self._host_header = f"{host}:{port}".encode() if ":" not in host else f"[{host}]:{port}".encode()
        self.connects = 0
        self.reuses = 0
        self.closed = False

    @property
    def idle_connections(self) -> int:
        """Connections kept alive for reuse right now."""
        return len(self._idle)

    @property
    def open_connections(self) -> int:
        """Connections whose transport has not been lost yet (idle or in use)."""
        return len(self._all)

    # ---------------------------------------------------------------- pool
    async def _take(self) -> _Conn:
        now = time.monotonic()
        while self._idle:
            c = self._idle.pop()
            if c.transport is None or c.transport.is_closing():
                continue
            if now - c.idle_since > self.idle_ttl_s:
                c.transport.close()
                continue
            c.reused = True
            self.reuses += 1
            return c
        if self.closed:
            raise EngineConnectionError("engine client closed")
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, c = await self._loop.create_connection(lambda: _Conn(self), self.host, self.port, ssl=self._ssl)
        except TimeoutError:
            raise EngineConnectionError(f"connect to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise EngineConnectionError(f"connect to {self.host}:{self.port} failed: {exc}") from exc
        self.connects += 1
        self._all.add(c)
        return c

    def _give_back(self, c: _Conn) -> None:
        if c.done and c.error is None and c.keep_alive and not self.closed and c.transport is not None \
                and not c.transport.is_closing() and len(self._idle) < self.max_idle:
            if c.paused:
                c.paused = False
                c.transport.resume_reading()
            c.idle_since = time.monotonic()
            self._idle.append(c)
        elif c.transport is not None:
            c.transport.close()

    def _forget(self, c: _Conn) -> None:
        self._all.discard(c)

    def _head(self, method: str, path: str, body: bytes, headers: dict[str, str] | None) -> bytes:
        h = [f"{method} {self.path_prefix}{path} HTTP/1.1\r\n".encode(), b"Host: ", self._host_header, b"\r\n"]
        if method in ("POST", "PUT", "PATCH") or body:
            h.append(b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body))
        if headers:
            for k, v in headers.items():
                if "\r" in k or "\n" in k or "\r" in v or "\n" in v:
                    raise ValueError("header names and values must not contain CR or LF")
                h.append(f"{k}: {v}\r\n".encode())
        h.append(b"\r\n")
        return b"".join(h)

    async def _start(self, method: str, path: str, body: bytes, headers: dict[str, str] | None, streaming: bool) -> tuple[_Conn, int]:
        head = self._head(method, path, body, headers)
        for _ in range(2):
            c = await self._take()
            c.begin(head, body, streaming)
            try:
                return c, await c.headers()
            except EngineConnectionError:
                if c.reused and not c.got_bytes:
                    continue  # the server closed an idle connection as we reused it: once more, fresh
                raise
            except BaseException:  # cancelled: the connection is mid-request, never reuse it
                c._fail(EngineConnectionError("request abandoned"))
                raise
        raise EngineConnectionError("engine closed two connections in a row before answering")

    # ---------------------------------------------------------------- API
    async def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """One request, the whole response body."""
        c, status = await self._start(method, path, body, headers, False)
        try:
            data = await c.whole_body()
        except BaseException:
            c._fail(EngineConnectionError("request abandoned"))
            raise
        self._give_back(c)
        return status, data

    @classmethod
    def for_url(cls, url: str, **kw) -> "EngineHttp":
        """A client for ``http[s]://host[:port][/prefix]``."""
        from urllib.parse import urlsplit

        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"expected http(s)://HOST[:PORT], got {url!r}")
        port = u.port or (443 if u.scheme == "https" else 80)
        return cls(u.hostname, port, tls=u.scheme == "https", path_prefix=u.path, **kw)

    @asynccontextmanager
    async def stream(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None):
        """``async with client.stream(...) as (status, chunks)``: body pieces as they arrive."""
        async with self.stream_with_type(method, path, body, headers) as (status, _, chunks):
            yield status, chunks

    @asynccontextmanager
    async def stream_with_type(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None):
        """As :meth:`stream`, with the response's Content-Type: ``(status, content_type, chunks)``."""
        c, status = await self._start(method, path, body, headers, True)
        ok = False
        try:
            yield status, c.content_type, c.iter_chunks()
            ok = c.done and c.error is None
        finally:
            if ok:
                self._give_back(c)
            else:
                c._fail(EngineConnectionError("stream abandoned"))

    async def close(self) -> None:
        self.closed = True
        for c in list(self._all):
            if c.transport is not None:
                c.transport.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost run
