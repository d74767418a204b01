"""``mesh instant-engine`` (workers_stub/instant_http.py): SGLang's formats, HTTP/1.1 details, and
what mesh's SGLang adapter assumes when it parses the answers."""

from __future__ import annotations

import asyncio
import json
import socket
from contextlib import asynccontextmanager

import aiohttp
import pytest

from mesh.adapters.backend import StreamState
from mesh.adapters.settings import AttachSettings
from mesh.adapters.sglang import SglangBackend, info_from_server_info, loadstat_from_v1
from workers_stub.instant_http import EngineApp, _Conn, detok, serve

from conftest import run

PROMPT = "The quick brown fox jumps over the lazy dog"
T = 10.0  # bound of every network wait


@asynccontextmanager
async def engine(model: str = "m"):
    """An instant engine in this loop; yields (url, app)."""
    stop = asyncio.Event()
    ready: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve("127.0.0.1", 0, model, ready=lambda url, app: ready.set_result((url, app)), stop=stop))
    try:
        yield await asyncio.wait_for(ready, T)
    finally:
        stop.set()
        await asyncio.wait_for(task, T)


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _read_response(r: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (Content-Length or chunked body) from a raw stream."""
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), T)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await asyncio.wait_for(r.readuntil(b"\r\n"), T)).strip(), 16)
            chunk = await asyncio.wait_for(r.readexactly(size + 2), T)
            if size == 0:
                break
            body += chunk[:-2]
        return status, headers, body
    n = int(headers.get("content-length", "0"))
    return status, headers, await asyncio.wait_for(r.readexactly(n), T)


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            ).encode() + body


def _events(body: bytes) -> list[bytes]:
    return [ev[len(b"data: "):] for ev in body.split(b"\n\n") if ev.startswith(b"data: ")]


def test_generate_non_stream_text_and_ids():
    async def body():
        async with engine() as (url, _), aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 8}, "rid": "r1"},
                              timeout=aiohttp.ClientTimeout(total=T)) as r:
                assert r.status == 200 and r.content_type == "application/json"
                d = await r.json()
            assert d["output_ids"] == list(PROMPT.encode()[:8]) and d["text"] == PROMPT[:8]
            m = d["meta_info"]
            assert m["id"] == "r1" and m["finish_reason"] == {"type": "length", "length": 8}
            assert (m["prompt_tokens"], m["completion_tokens"], m["cached_tokens"], m["e2e_latency"]) == (43, 8, 0, 0.0)
            # a prompt shorter than max_new_tokens stops; token-id prompts echo ids; no rid -> a random hex id
            async with s.post(url + "/generate", json={"input_ids": [5, 300, 7], "sampling_params": {"max_new_tokens": 8}},
                              timeout=aiohttp.ClientTimeout(total=T)) as r:
                d = await r.json()
            assert d["output_ids"] == [5, 300, 7] and d["meta_info"]["finish_reason"]["type"] == "stop"
            assert len(d["meta_info"]["id"]) == 32 and int(d["meta_info"]["id"], 16) >= 0
            assert d["text"] == "\x05\x07"  # ids >= 256 have no text
            for bad in ({"text": "a", "input_ids": [1]}, {"text": ["a", "b"]}, {"text": "a", "sampling_params": {"max_new_tokens": -1}},
                        {"text": "a", "sampling_params": []}, {"input_ids": [1, "x"]}, [1, 2]):
                async with s.post(url + "/generate", json=bad, timeout=aiohttp.ClientTimeout(total=T)) as r:
                    assert r.status == 400, bad
                    assert "message" in (await r.json())["error"]

    run(body())


def test_generate_stream_is_cumulative_and_parses_like_the_adapter():
    async def body():
        async with engine() as (url, app), aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json={"text": "héllo wörld", "sampling_params": {"max_new_tokens": 6}, "stream": True},
                              timeout=aiohttp.ClientTimeout(total=T)) as r:
                assert r.status == 200 and r.content_type == "text/event-stream"
                assert r.headers.get("Transfer-Encoding") == "chunked"
                raw = await r.read()
            events = _events(raw)
            assert events[-1] == b"[DONE]"
            objs = [json.loads(e) for e in events[:-1]]
            assert len(objs) == 6  # one event per output token
            for k, o in enumerate(objs, 1):
                assert o["output_ids"] == list("héllo wörld".encode()[:k])  # cumulative
                assert o["meta_info"]["completion_tokens"] == k
                assert (o["meta_info"]["finish_reason"] is None) == (k < 6)
            assert objs[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
            # the adapter's parser (cumulative mode, as discovered from /server_info) rebuilds the answer
            st_settings = AttachSettings(url=url, brokers=("tcp://127.0.0.1:1",))
            async with s.get(url + "/server_info", timeout=aiohttp.ClientTimeout(total=T)) as r:
                info = info_from_server_info(await r.json(), st_settings)
            backend, st = SglangBackend(st_settings), StreamState()
            ids, text = [], ""
            for o in objs:
                st.new_ids, st.new_text = [], ""
                backend.parse(o, st, info)
                assert st.error is None
                ids += st.new_ids
                text += st.new_text
            assert ids == list("héllo wörld".encode()[:6]) and text == "héllo" == detok(ids)
            assert st.finish == "length" and st.usage == {"prompt_tokens": 13, "completion_tokens": 6, "cached_tokens": 0}

    run(body())


def test_discovery_endpoints_fit_the_adapter():
    async def body():
        async with engine("my-model") as (url, _), aiohttp.ClientSession() as s:
            t = aiohttp.ClientTimeout(total=T)
            for path in ("/health", "/health_generate"):
                async with s.get(url + path, timeout=t) as r:
                    assert r.status == 200
            for path in ("/server_info", "/get_server_info"):
                async with s.get(url + path, timeout=t) as r:
                    d = await r.json()
                assert "kv_events" not in d and d["served_model_name"] == "my-model"
                assert (d["page_size"], d["max_running_requests"], d["max_total_num_tokens"]) == (16, 1024, 1 << 20)
                info = info_from_server_info(d, AttachSettings(url=url, brokers=("tcp://127.0.0.1:1",)))
                assert info.kv_endpoints == [None] and info.block_size == 16 and info.model == "my-model"
                assert not info.incremental_streaming and info.max_running_requests == 1024
            async with s.get(url + "/get_model_info", timeout=t) as r:
                assert (await r.json())["model_path"] == "my-model"
            async with s.get(url + "/v1/models", timeout=t) as r:
                assert (await r.json())["data"][0]["id"] == "my-model"
            async with s.get(url + "/v1/loads?include=core", timeout=t) as r:
                loads = (await r.json())["loads"]
            ls = loadstat_from_v1(loads[0])
            assert loads[0]["dp_rank"] == 0 and ls.num_running_reqs == 0 and ls.max_total_num_tokens == 1 << 20
            async with s.get(url + "/nope", timeout=t) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == 404
            async with s.get(url + "/generate", timeout=t) as r:
                assert r.status == 405
            async with s.post(url + "/generate", data=b"{not json", headers={"Content-Type": "application/json"}, timeout=t) as r:
                assert r.status == 400 and "invalid JSON" in (await r.json())["error"]["message"]

    run(body())


def test_completions_minimal():
    async def body():
        async with engine("m") as (url, _), aiohttp.ClientSession() as s:
            t = aiohttp.ClientTimeout(total=T)
            async with s.post(url + "/v1/completions", json={"model": "mesh", "prompt": PROMPT, "max_tokens": 4}, timeout=t) as r:
                d = await r.json()
            assert d["choices"][0]["text"] == "The " and d["choices"][0]["finish_reason"] == "length"
            assert d["usage"] == {"prompt_tokens": 43, "completion_tokens": 4, "total_tokens": 47}
            async with s.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 4, "stream": True}, timeout=t) as r:
                evs = _events(await r.read())
            deltas = [json.loads(e)["choices"][0] for e in evs[:-1]]
            assert "".join(x["text"] for x in deltas) == "ab" and deltas[-1]["finish_reason"] == "stop" and evs[-1] == b"[DONE]"

    run(body())


def test_keep_alive_pipelining_chunked_reject_and_http10():
    async def body():
        async with engine() as (url, app):
            host, port = _hostport(url)
            r, w = await asyncio.wait_for(asyncio.open_connection(host, port), T)
            req = json.dumps({"text": PROMPT, "sampling_params": {"max_new_tokens": 3}}).encode()
            for _ in range(3):  # sequential requests on one connection
                w.write(_post("/generate", req))
                status, headers, data = await _read_response(r)
                assert status == 200 and json.loads(data)["text"] == "The" and "connection" not in headers
            w.write(b"".join([_post("/generate", req), b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", _post("/nope", b"{}")]))
            assert [(await _read_response(r))[0] for _ in range(3)] == [200, 200, 404]  # pipelined, in order
            stream = json.dumps({"text": "abc", "sampling_params": {"max_new_tokens": 2}, "stream": True}).encode()
            w.write(_post("/generate", stream))
            status, headers, data = await _read_response(r)
            assert headers["transfer-encoding"] == "chunked" and _events(data)[-1] == b"[DONE]" and len(_events(data)) == 3
            w.write(_post("/generate", req))  # the connection is still usable after a stream
            assert (await _read_response(r))[0] == 200
            # a chunked request body: 411, then the connection is closed
            w.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n0\r\n\r\n")
            status, headers, data = await _read_response(r)
            assert status == 411 and headers["connection"] == "close" and json.loads(data)["error"]["code"] == 411
            assert await asyncio.wait_for(r.read(), T) == b""
            w.close()
            # malformed HTTP: 400 and close
            r, w = await asyncio.wait_for(asyncio.open_connection(host, port), T)
            w.write(b"BLAH\x00 / HTTP/9\r\n\r\n")
            assert (await _read_response(r))[0] == 400 and await asyncio.wait_for(r.read(), T) == b""
            w.close()
            # HTTP/1.0 stream: close-delimited
            r, w = await asyncio.wait_for(asyncio.open_connection(host, port), T)
            w.write(_post("/generate", stream).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
            raw = await asyncio.wait_for(r.read(), T)
            head, _, rest = raw.partition(b"\r\n\r\n")
            assert b"Transfer-Encoding" not in head and b"Connection: close" in head and _events(rest)[-1] == b"[DONE]"
            w.close()
            assert app.paths["/generate"] == 7  # the chunked one never reached a handler

    run(body())


def test_body_split_across_tcp_segments():
    async def body():
        async with engine() as (url, _):
            host, port = _hostport(url)
            r, w = await asyncio.wait_for(asyncio.open_connection(host, port), T)
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg = _post("/generate", json.dumps({"text": PROMPT, "sampling_params": {"max_new_tokens": 5}}).encode())
            for i in range(0, len(msg), 7):  # head and body in 7-byte writes, each flushed
                w.write(msg[i:i + 7])
                await asyncio.wait_for(w.drain(), T)
            status, _, data = await _read_response(r)
            assert status == 200 and json.loads(data)["text"] == "The q"
            w.close()

    run(body())


class _FakeTransport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, b: bytes) -> None:
        self.out += b

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@pytest.mark.parametrize("step", [1, 3, 64])
def test_protocol_fed_byte_by_byte(step):
    """The parser state across arbitrary segment boundaries (deterministic: no sockets)."""
    conn, tr = _Conn(EngineApp("m"), set()), _FakeTransport()
    conn.connection_made(tr)
    req = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 2}}).encode()
    data = _post("/generate", req) * 2 + b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"
    for i in range(0, len(data), step):
        conn.data_received(data[i:i + step])
    assert tr.out.count(b"HTTP/1.1 200 OK") == 2 and tr.out.count(b"HTTP/1.1 404") == 1 and not tr.closed
    assert tr.out.count(b'"text":"he"') == 2
    # Expect: 100-continue gets its interim answer before the body
    tr.out.clear()
    head, body = _post("/generate", req, "Expect: 100-continue\r\n").split(b"\r\n\r\n", 1)
    conn.data_received(head + b"\r\n\r\n")
    assert bytes(tr.out) == b"HTTP/1.1 100 Continue\r\n\r\n"
    conn.data_received(body)
    assert b"HTTP/1.1 200 OK" in tr.out


def test_engine_process_announces_url_and_counts_paths(procs):
    """``mesh instant-engine`` as a process: readiness line with the URL; on SIGTERM the requests per path."""
    import urllib.request

    from mesh.lab.procs import wait_for_log_event

    p = procs.spawn("engine", ["instant-engine", "--port", "0", "--model", "x"])
    rec = wait_for_log_event(p.log_path, "instant_engine_listening", 30, p.popen)
    with urllib.request.urlopen(rec["url"] + "/health", timeout=T) as r:
        assert r.status == 200
    assert p.stop(grace_s=10) == 0
    stopped = wait_for_log_event(p.log_path, "instant_engine_stopped", 5)
    assert stopped["paths"] == {"/health": 1} and stopped["requests"] == 1
