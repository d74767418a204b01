"""The adapter's engine HTTP client against scripted servers (real sockets on 127.0.0.1): keep-alive
reuse, chunked and close-delimited bodies, a server that closes idle connections, hostile answers
(malformed, oversized, cut off), and cancellation."""

from __future__ import annotations

import asyncio

import pytest

from mesh.adapters.engine_client import sse_events
from mesh.adapters.engine_http import EngineConnectionError, EngineHttp
from tests.conftest import run, until


class Scripted:
    """A TCP server that answers each request head it reads with ``answer(n)`` bytes (n counts
    requests over all connections); ``close_after`` closes a connection after that many answers."""

    def __init__(self, answer, close_after: int | None = None) -> None:
        self.answer = answer
        self.close_after = close_after
        self.n = 0
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                self.n += 1
                out = self.answer(self.n)
                if out is None:  # hold the request: never answer
                    await asyncio.sleep(3600)  # the fault: a server that holds the request
                for piece in out if isinstance(out, list) else [out]:
                    writer.write(piece)
                    await writer.drain()
                served += 1
                if self.close_after is not None and served >= self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def test_keep_alive_chunked_and_close_delimited_bodies():
    async def body() -> None:
        srv = Scripted(lambda n: _ok(b'{"n": %d}' % n))
        port = await srv.start()
        c = EngineHttp("127.0.0.1", port)
        for i in range(1, 6):
            assert await c.request("POST", "/generate", b"{}") == (200, b'{"n": %d}' % i)
        assert (c.connects, c.reuses, srv.connections) == (1, 4, 1)  # one connection, kept alive
        await c.close()
        await srv.stop()

        sse = [b'data: {"a":1', b'}\n\nda', b"ta: [DONE]\n\ndata:xtra\r\n\r\n"]  # events split across chunks
        wire = b"".join(b"%x\r\n%s\r\n" % (len(x), x) for x in sse) + b"0\r\n\r\n"
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunked = [head + wire[:7], wire[7:20], wire[20:]]  # and chunks split across TCP writes
        srv = Scripted(lambda n: chunked)
        port = await srv.start()
        c = EngineHttp("127.0.0.1", port)
        for _ in range(2):
            async with c.stream("POST", "/generate", b"{}") as (status, chunks):
                events = [e async for e in sse_events(chunks)]
            assert status == 200 and events == [b'{"a":1}', b"[DONE]", b"xtra"]
        assert c.connects == 1 and c.reuses == 1  # read to the end: reused
        await c.close()
        await srv.stop()

        srv = Scripted(lambda n: b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it", close_after=1)
        port = await srv.start()
        c = EngineHttp("127.0.0.1", port)
        assert await c.request("GET", "/x") == (200, b"all of it")  # ends at EOF
        assert await c.request("GET", "/x") == (200, b"all of it")
        assert c.connects == 2
        await c.close()
        await srv.stop()

    run(body(), 30)


def test_a_server_that_closes_idle_connections_costs_no_request():
    """uvicorn closes idle keep-alive connections after 5 s; a request sent on one the server has
    just closed is retried once on a fresh connection (no response byte had arrived)."""

    async def body() -> None:
        srv = Scripted(lambda n: _ok(b"ok"), close_after=1)  # closes every connection after one answer
        port = await srv.start()
        c = EngineHttp("127.0.0.1", port)
        for _ in range(5):
            assert await c.request("POST", "/generate", b"{}") == (200, b"ok")
            await until(lambda: c.open_connections == 0, 5, "the server's close arrived")  # as after an idle timeout
        assert srv.n == 5 and c.connects == 5
        for _ in range(50):  # no pause: the next request races the server's close
            assert await c.request("POST", "/generate", b"{}") == (200, b"ok")
        await c.close()
        await srv.stop()

    run(body(), 30)


@pytest.mark.parametrize("answer, what", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "closed"),  # cut off mid-body
    (b"NOT HTTP AT ALL\r\n\r\n", "malformed"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n" + b"x" * 70_000, "exceeds"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed"),
])
def test_hostile_answers_are_a_connection_error_not_a_crash(answer, what):
    async def body() -> None:
        srv = Scripted(lambda n: answer, close_after=1)
        port = await srv.start()
        c = EngineHttp("127.0.0.1", port, max_body_bytes=65_536)
        with pytest.raises(EngineConnectionError, match=what):
            await c.request("POST", "/generate", b"{}")
        assert c.idle_connections == 0  # a broken connection is never reused
        await c.close()
        await srv.stop()

    run(body(), 30)


def test_cancelled_and_timed_out_requests_close_their_connection():
    """An abandoned request closes its connection (how an engine learns to abort it) and the next
    request uses a fresh one."""

    async def body() -> None:
        srv = Scripted(lambda n: None if n == 1 else _ok(b"ok"))
        port = await srv.start()
        c = EngineHttp("127.0.0.1", port)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await c.request("POST", "/generate", b"{}")
        assert await c.request("POST", "/generate", b"{}") == (200, b"ok")
        assert c.connects == 2 and srv.connections == 2
        await c.close()
        await srv.stop()

        srv = Scripted(lambda n: [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"6\r\ndata: \r\n"] if n == 1
                       else _ok(b"ok"))
        port = await srv.start()
        c = EngineHttp("127.0.0.1", port)
        async with c.stream("POST", "/generate", b"{}") as (status, chunks):
            async for _ in chunks:
                break  # the consumer leaves mid-stream
        assert await c.request("POST", "/generate", b"{}") == (200, b"ok")
        assert c.connects == 2
        await c.close()
        await srv.stop()

    run(body(), 30)


def test_refused_connection_is_an_engine_connection_error():
    async def body() -> None:
        srv = Scripted(lambda n: _ok(b""))
        port = await srv.start()
        await srv.stop()
        srv.server and await srv.server.wait_closed()
        c = EngineHttp("127.0.0.1", port)
        with pytest.raises(EngineConnectionError, match="connect"):
            await c.request("GET", "/health")
        await c.close()

    run(body(), 30)
