"""The ingress's own HTTP/1.1 server (brokers/ingress/http1.py), in process over raw sockets against a
scripted backend: pipelining order, streams cut at the write timeout, malformed heads, disconnects,
``Expect: 100-continue``, chunked bodies, header floods, HTTP/1.0 and ``Connection: close``."""

from __future__ import annotations

import asyncio
import json

import msgpack

from brokers.ingress import MAX_BODY_BYTES, HttpIngress
from brokers.stats import BrokerStats
from mesh import protocol as P
from tests.conftest import run, until
from tests.ingress_support import CatalogBackend


class _Backend(CatalogBackend):
    """Answers each request with a FINAL of its prompt plus "!" (after 0.2 s for the prompt "slow"),
    streams endless 32 KiB chunks for the prompt "flood", and never answers the prompt "hold"."""

    def __init__(self) -> None:
        self.stats = BrokerStats()
        self.idents: list[bytes] = []
        self.cancelled: list[bytes] = []
        self.floods: list[asyncio.Task] = []

    def submit(self, ident, sub, q, quota_key=None) -> None:
        self.idents.append(ident)
        text = sub.text or ""
        final = P.encode_client_final(sub.rid, "length", {"completion_tokens": 2}, "w", 1, msgpack.packb({"text": text + "!"}))
        if text == "hold":
            return
        if text == "flood":
            self.floods.append(asyncio.ensure_future(self._flood(sub.rid, q)))
        elif text == "slow":
            asyncio.get_running_loop().call_later(0.2, q.put_nowait, final)
        else:
            q.put_nowait(final)

    async def _flood(self, rid: str, q) -> None:
        piece = msgpack.packb({"text": "x" * 32768})
        seq = 0
        while True:
            q.put_nowait(P.encode_client_chunk(rid, seq, piece))
            seq += 1
            await asyncio.sleep(0.001)

    def cancel(self, ident) -> None:
        self.cancelled.append(ident)


def _post(prompt: str, *, rid: str = "", extra: bytes = b"", stream: bool = False, version: bytes = b"1.1") -> bytes:
    body = json.dumps({"prompt": prompt, "max_tokens": 2, "stream": stream}).encode()
    return (b"POST /v1/completions HTTP/" + version + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
            + (b"x-request-id: " + rid.encode() + b"\r\n" if rid else b"") + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


async def _read_response(r: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "content-length" in headers:
        return status, headers, await r.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        out = b""
        while True:
            n = int((await r.readuntil(b"\r\n")).strip(), 16)
            out += (await r.readexactly(n + 2))[:n]
            if n == 0:
                return status, headers, out
    return status, headers, await r.read()


def _serve(check, timeout_s: float = 30, **kw) -> None:
    """Run ``check(backend, ingress, host, port)`` against an ingress (``kw``: its options) in front of a _Backend."""
    async def body():
        backend = _Backend()
        ing = HttpIngress(backend, **kw)
        url = await ing.start("127.0.0.1", 0)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        try:
            await check(backend, ing, host, int(port))
        finally:
            for t in backend.floods:
                t.cancel()
            await ing.stop()

    run(body(), timeout_s)


def test_pipelined_requests_are_answered_in_order():
    async def check(backend, ing, host, port):
        r, w = await asyncio.open_connection(host, port)
        w.write(_post("slow", rid="first") + _post("fast", rid="second") + b"GET /health HTTP/1.1\r\nx-request-id: third\r\n\r\n"
                + _post("fast", rid="fourth"))
        got = [await asyncio.wait_for(_read_response(r), 10) for _ in range(4)]
        assert [h.get("x-request-id") for _, h, _ in got] == ["first", "second", "third", "fourth"]
        assert [s for s, _, _ in got] == [200, 200, 200, 200]
        assert json.loads(got[0][2])["choices"][0]["text"] == "slow!"
        w.write(b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")  # honoured: answered, then the close
        status, headers, _ = await asyncio.wait_for(_read_response(r), 10)
        assert status == 200 and headers["connection"] == "close" and await asyncio.wait_for(r.read(), 10) == b""
        w.close()
        # a malformed request behind two good ones: they are answered first, then the 400 and the close
        r, w = await asyncio.open_connection(host, port)
        w.write(_post("slow", rid="a") + _post("fast", rid="b") + b"GARBAGE\r\n\r\n")
        got = [await asyncio.wait_for(_read_response(r), 10) for _ in range(3)]
        assert [(s, h.get("x-request-id")) for s, h, _ in got] == [(200, "a"), (200, "b"), (400, None)]
        assert "connection" not in got[0][1] and got[1][1]["connection"] == "close" == got[2][1]["connection"]
        assert await asyncio.wait_for(r.read(), 10) == b""
        w.close()

    _serve(check, 30)


def test_a_stream_never_read_is_cut_at_the_write_timeout_and_cancelled():
    async def check(backend, ing, host, port):
        r, w = await asyncio.open_connection(host, port, limit=1 << 16)
        w.transport.pause_reading()  # a slow reader: never reads its stream
        w.write(_post("flood", stream=True))
        await until(lambda: backend.stats.dropped["http_write_timeout"] == 1, 30, "the stream cut at the write timeout")
        await until(lambda: backend.cancelled == backend.idents, 5, "its request cancelled")
        assert backend.stats.dropped["http_stream_idle_timeout"] == 0
        w.close()

    _serve(check, 60, body_timeout_s=0.5)


def test_malformed_heads_get_400_431_414_and_the_close():
    async def check(backend, ing, host, port):
        cases = [(b"GARBAGE\r\n\r\n", 400, "http_malformed"),
                 (b"GET /health HTTP/1.1\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(500)) + b"\r\n", 431, "http_header_flood"),
                 (b"GET /health HTTP/1.1\r\nx-big: " + b"v" * 70000 + b"\r\n\r\n", 431, "http_header_flood"),
                 (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414, "http_url_too_long"),
                 (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxx", 400, "http_malformed"),
                 (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400,
                  "http_malformed")]  # smuggling: both framings
        for raw, code, what in cases:
            r, w = await asyncio.open_connection(host, port)
            w.write(raw)
            status, headers, payload = await asyncio.wait_for(_read_response(r), 10)
            assert status == code and headers["connection"] == "close", (raw[:40], status)
            assert json.loads(payload)["error"]["code"] == "bad_request"
            assert await asyncio.wait_for(r.read(), 10) == b""
            w.close()
        assert backend.stats.dropped["http_malformed"] == 3 and backend.stats.dropped["http_header_flood"] == 2
        assert backend.stats.dropped["http_url_too_long"] == 1 and backend.idents == []

    _serve(check, 30)


def test_a_client_that_disconnects_mid_request_cancels_it_counted():
    async def check(backend, ing, host, port):
        r, w = await asyncio.open_connection(host, port)
        w.write(_post("hold"))
        await until(lambda: len(backend.idents) == 1, 10, "the request submitted")
        w.close()
        await until(lambda: backend.cancelled == backend.idents, 10, "its request cancelled at once")
        assert backend.stats.dropped["http_client_disconnected"] == 1
        await until(lambda: not ing.guard.conns, 5, "the connection forgotten")

    _serve(check, 30)


def test_expect_100_continue_and_chunked_bodies():
    async def check(backend, ing, host, port):
        payload = json.dumps({"prompt": "fast", "max_tokens": 2}).encode()
        r, w = await asyncio.open_connection(host, port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(payload))
        assert await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
        w.write(payload)
        status, _, out = await asyncio.wait_for(_read_response(r), 10)
        assert status == 200 and json.loads(out)["choices"][0]["text"] == "fast!"
        # chunked request bodies are accepted (within the same limit as the others)
        w.write(b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in (payload[:7], payload[7:])) + b"0\r\n\r\n")
        status, _, out = await asyncio.wait_for(_read_response(r), 10)
        assert status == 200 and json.loads(out)["choices"][0]["text"] == "fast!"
        w.close()
        # over the limit: 413 from the head, the body never invited (no 100 Continue), then the close
        r, w = await asyncio.open_connection(host, port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
        status, headers, out = await asyncio.wait_for(_read_response(r), 10)
        assert status == 413 and json.loads(out)["error"]["code"] == "too_large" and headers["connection"] == "close"
        w.close()
        # a chunked body that grows past the limit: 413 too
        r, w = await asyncio.open_connection(host, port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%b\r\n" % (1 << 20, b"x" * (1 << 20))
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
            w.write(piece)
        status, _, out = await asyncio.wait_for(_read_response(r), 20)
        assert status == 413 and json.loads(out)["error"]["code"] == "too_large"
        w.close()
        assert len(backend.idents) == 2

    _serve(check, 60)


def test_http10_404_405_and_head():
    async def check(backend, ing, host, port):
        r, w = await asyncio.open_connection(host, port)
        w.write(b"GET /health HTTP/1.0\r\n\r\n")  # HTTP/1.0: answered, then closed
        status, headers, out = await asyncio.wait_for(_read_response(r), 10)
        assert status == 200 and json.loads(out)["status"] == "ok" and headers["connection"] == "close"
        assert await asyncio.wait_for(r.read(), 10) == b""
        r, w = await asyncio.open_connection(host, port)
        w.write(_post("fast", stream=True, version=b"1.0"))  # an HTTP/1.0 stream: close-delimited, not chunked
        status, headers, out = await asyncio.wait_for(_read_response(r), 10)
        assert status == 200 and "transfer-encoding" not in headers and out.endswith(b"data: [DONE]\n\n") and b"fast!" in out
        r, w = await asyncio.open_connection(host, port)
        w.write(b"GET /nowhere HTTP/1.1\r\n\r\nGET /v1/completions HTTP/1.1\r\n\r\nHEAD /health HTTP/1.1\r\n\r\n"
                b"GET /v1/models/m HTTP/1.1\r\n\r\nGET /v1/models/nope HTTP/1.1\r\n\r\n")
        s404, _, b404 = await asyncio.wait_for(_read_response(r), 10)
        s405, _, b405 = await asyncio.wait_for(_read_response(r), 10)
        assert (s404, json.loads(b404)["error"]["code"]) == (404, "not_found")
        assert (s405, json.loads(b405)["error"]["code"]) == (405, "method_not_allowed")
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)  # HEAD: the GET's headers, no body
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: " in head
        s, _, m = await asyncio.wait_for(_read_response(r), 10)
        assert s == 200 and json.loads(m)["id"] == "m"
        s, _, m = await asyncio.wait_for(_read_response(r), 10)
        assert s == 404 and json.loads(m)["error"]["code"] == "model_not_found"
        w.close()

    _serve(check, 30)
