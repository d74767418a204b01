"""The adapter's one error boundary (``mesh.adapters.engine_client.engine_error``) against a real HTTP
engine on 127.0.0.1 that misbehaves: connection refused, HTTP 500, a garbage body, a dropped
connection, a hang past the deadline. Each becomes the mesh error code the worker reports in its
ERROR frame (or the error discovery, health and load polls see), naming the engine's URL; engine
discovery retries through ``mesh.retry.RetryPolicy``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import aiohttp
import pytest
from aiohttp import web

from mesh import protocol as P
from mesh.adapters.base import Adapter
from mesh.adapters.engine_client import engine_error
from mesh.adapters.settings import AttachSettings
from mesh.adapters.engine_http import EngineConnectionError
from mesh.adapters.sglang import SglangBackend
from mesh.errors import ConfigError, ErrorCode, FatalRequestError, MeshError, RetryableError
from tests.adapters_support import FakeBroker
from tests.conftest import run, until

SERVER_INFO = {"page_size": 16, "served_model_name": "bad-engine", "max_running_requests": 8,
               "max_total_num_tokens": 4096}


class BadEngine:
    """An SGLang-shaped engine whose ``/generate`` misbehaves by the prompt's first token id:
    1 HTTP 500, 2 a body that is not JSON, 3 hangs (until closed), 4 drops the connection,
    5 JSON that is no answer, 6 an SSE stream of garbage; 9 answers properly. ``/server_info``
    answers 503 ``info_failures`` times first; ``/health`` hangs while ``hang_health`` is set."""

    def __init__(self, info_failures: int = 0) -> None:
        self.info_failures = info_failures
        self.hang_health = False
        self.released = asyncio.Event()  # ends every hanging handler at close
        app = web.Application()
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/health", self.health)
        app.router.add_get("/garbage", self.garbage)
        app.router.add_post("/generate", self.generate)
        self.runner = web.AppRunner(app, handle_signals=False)
        self.url = ""

    async def start(self) -> "BadEngine":
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        self.released.set()
        await self.runner.cleanup()

    async def server_info(self, request: web.Request) -> web.Response:
        if self.info_failures > 0:
            self.info_failures -= 1
            return web.Response(status=503, text="loading weights")
        return web.json_response(SERVER_INFO)

    async def health(self, request: web.Request) -> web.Response:
        if self.hang_health:
            await self.released.wait()
        return web.Response(text="ok")

    async def garbage(self, request: web.Request) -> web.Response:
        return web.Response(body=b"<html>\x00not json", content_type="application/json")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kind = body["input_ids"][0]
        if kind == 1:
            return web.Response(status=500, text="engine exploded")
        if kind == 2:
            return web.Response(body=b"<html>\x00not json", content_type="application/json")
        if kind == 3:
            await self.released.wait()
        if kind == 4:
            request.transport.close()  # the engine process died mid-request
            await self.released.wait()
        if kind == 5:
            return web.json_response([1, 2, 3])
        if kind == 6:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: {not json\n\ndata: [also not\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"output_ids": [7, 8], "text": "ok",
                                  "meta_info": {"finish_reason": {"type": "stop"}, "prompt_tokens": 2,
                                                "completion_tokens": 2, "cached_tokens": 0}})


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    return port


@contextlib.asynccontextmanager
async def attached(engine: BadEngine):
    fb = FakeBroker().start()
    s = AttachSettings(url=engine.url, brokers=(fb.endpoint,), worker_id="bad", heartbeat_ms=100,
                       health_interval_ms=100, health_timeout_ms=1000, load_poll_ms=60_000)
    ad = Adapter(s, SglangBackend(s))
    try:
        await ad.start()
        await until(lambda: fb.sessions, 10, "registration")
        yield ad, fb
    finally:
        await ad.close()
        await fb.close()


def _submit(first_id: int, stream: bool = False) -> bytes:
    return P.encode_submit(f"r{first_id}", input_ids=[first_id, 2, 3], params={"max_new_tokens": 2}, stream=stream)[2]


def test_each_engine_failure_becomes_the_error_code_the_worker_reports() -> None:
    expected = {1: ("worker_error", "HTTP 500"), 2: ("worker_error", "not valid"), 3: ("deadline_exceeded", "deadline"),
                4: ("unavailable", "engine connection failed"), 5: ("worker_error", "no finish reason"),
                6: ("worker_error", "without a finish reason")}

    async def body() -> None:
        engine = await BadEngine().start()
        try:
            async with attached(engine) as (ad, fb):
                for kind in expected:
                    fb.request(kind, _submit(kind, stream=kind == 6), deadline_ms=300 if kind == 3 else 10_000)
                fb.request(9, _submit(9))
                await until(lambda: len(fb.errors) == len(expected) and 9 in fb.finals, 10, "every reply")
                for kind, (code, text) in expected.items():
                    err = fb.errors[kind]
                    assert err.code == code and text in err.message, (kind, err)
                    assert ErrorCode(code).retryable == (code != "deadline_exceeded")
                assert engine.url in fb.errors[2].message and engine.url in fb.errors[4].message
                assert ad.counters["bad_stream_chunks"] == 2 and ad.counters["errors_unavailable"] == 1
        finally:
            await engine.close()

    run(body(), 30)


def test_discovery_retries_a_loading_engine_then_attaches() -> None:
    async def body() -> None:
        engine = await BadEngine(info_failures=3).start()
        try:
            async with attached(engine) as (ad, _):
                assert ad.counters["discovery_failures"] == 3 and ad.info.model == "bad-engine"
        finally:
            await engine.close()

    run(body(), 30)


def test_discovery_against_a_refused_port_gives_up_at_its_timeout_naming_the_url() -> None:
    async def body() -> None:
        url = f"http://127.0.0.1:{_closed_port()}"
        fb = FakeBroker().start()
        s = AttachSettings(url=url, brokers=(fb.endpoint,), worker_id="none", discovery_timeout_s=0.3)
        ad = Adapter(s, SglangBackend(s))
        try:
            with pytest.raises(ConfigError) as ei:
                await ad.start()
            assert url in str(ei.value) and "unavailable" in str(ei.value)
            assert ad.counters["discovery_failures"] >= 2
        finally:
            await ad.close()
            await fb.close()

    run(body(), 30)


def test_the_side_api_raises_only_mesh_errors_naming_the_url() -> None:
    async def body() -> None:
        engine = await BadEngine().start()
        refused = f"http://127.0.0.1:{_closed_port()}"
        try:
            async with aiohttp.ClientSession() as http:
                be = SglangBackend(AttachSettings(url=refused, brokers=("tcp://127.0.0.1:1",)))
                with pytest.raises(RetryableError) as ei:
                    await be.get_json(http, "/server_info")
                assert ei.value.code is ErrorCode.UNAVAILABLE and refused in str(ei.value)
                be = SglangBackend(AttachSettings(url=engine.url, brokers=("tcp://127.0.0.1:1",)))
                with pytest.raises(RetryableError) as ei:
                    await be.get_json(http, "/garbage")
                assert ei.value.code is ErrorCode.WORKER_ERROR and f"{engine.url}/garbage" in str(ei.value)
                engine.hang_health = True
                with pytest.raises(RetryableError) as ei:
                    await be.get_status(http, "/health", timeout_s=0.2)
                assert ei.value.code is ErrorCode.UNAVAILABLE and "in time" in str(ei.value)
                assert await be.get_json(http, "/nowhere") == (404, None)  # an answer, not an error
        finally:
            await engine.close()

    run(body(), 30)


def _response_error(status: int) -> aiohttp.ClientResponseError:
    return aiohttp.ClientResponseError(None, (), status=status, message="x")  # type: ignore[arg-type]


@pytest.mark.parametrize("exc, cls, code", [
    (_response_error(503), RetryableError, ErrorCode.UNAVAILABLE),
    (_response_error(500), RetryableError, ErrorCode.WORKER_ERROR),
    (_response_error(429), RetryableError, ErrorCode.OVERLOADED),
    (_response_error(400), FatalRequestError, ErrorCode.BAD_REQUEST),
    (asyncio.TimeoutError(), RetryableError, ErrorCode.UNAVAILABLE),
    (aiohttp.ServerTimeoutError("read"), RetryableError, ErrorCode.UNAVAILABLE),
    (aiohttp.ClientPayloadError("truncated"), RetryableError, ErrorCode.UNAVAILABLE),
    (aiohttp.ServerDisconnectedError(), RetryableError, ErrorCode.UNAVAILABLE),
    (EngineConnectionError("engine closed the connection"), RetryableError, ErrorCode.UNAVAILABLE),
    (ConnectionRefusedError(111, "refused"), RetryableError, ErrorCode.UNAVAILABLE),
    (json.JSONDecodeError("Expecting value", "<html>", 0), RetryableError, ErrorCode.WORKER_ERROR),
    (KeyError("choices"), RetryableError, ErrorCode.WORKER_ERROR),
    (AttributeError("bug"), FatalRequestError, ErrorCode.INTERNAL),
])
def test_the_boundary_maps_every_engine_failure_into_the_tree(exc, cls, code) -> None:
    err = engine_error(exc, "GET http://10.0.0.7:30000/health")
    assert type(err) is cls and err.code is code and err.__cause__ is exc
    assert "http://10.0.0.7:30000/health" in str(err) and isinstance(err, MeshError)
    assert engine_error(err, "elsewhere") is err


def test_a_prompt_beyond_the_engines_context_is_context_length_exceeded(procs) -> None:
    """Issue 30: the stub engine's (and SGLang's) 400 for a prompt that cannot fit was reported
    as bad_request with the engine's JSON escaped inside; it is context_length_exceeded, with the
    engine's own sentence."""
    from tests.adapters_support import start_stub

    _, rec = start_stub(procs, "small", "--time-scale", "0.01", "--max-total-num-tokens", "512")

    async def body() -> None:
        fb = FakeBroker().start()
        s = AttachSettings(url=rec["url"], brokers=(fb.endpoint,), worker_id="small", heartbeat_ms=100)
        ad = Adapter(s, SglangBackend(s))
        try:
            await ad.start()
            await until(lambda: fb.sessions, 10, "registration")
            for rid, stream in ((1, False), (2, True)):
                fb.request(rid, P.encode_submit(f"r{rid}", input_ids=list(range(1, 2001)), params={"max_new_tokens": 2},
                                                stream=stream)[2])
            await until(lambda: len(fb.errors) == 2, 10, "both refused")
            for rid in (1, 2):
                err = fb.errors[rid]
                assert err.code == "context_length_exceeded", err
                assert "KV capacity" in err.message and '{"' not in err.message and "HTTP 400" in err.message, err.message
        finally:
            await ad.close()
            await fb.close()

    run(body(), 30)


@pytest.mark.parametrize("body,code", [
    (b'{"object":"error","message":"The input (5000 tokens) is longer than the model\'s context length (4096 tokens).",'
     b'"type":"BadRequestError","code":400}', "context_length_exceeded"),  # SGLang
    (b'{"error":{"message":"This model\'s maximum context length is 4096 tokens. However, you requested 5000 tokens",'
     b'"type":"BadRequestError","code":400}}', "context_length_exceeded"),  # vLLM
    (b'{"error":{"message":"temperature must be >= 0","code":400}}', "bad_request"),
    (b"plain text refusal", "bad_request"),
])
def test_engine_refusals_keep_the_engines_sentence(body: bytes, code: str) -> None:
    from mesh.adapters.engine_client import engine_refusal

    got, msg = engine_refusal(400, body, "/generate")
    assert got.value == code and '{"' not in msg and msg.endswith("(HTTP 400 from /generate)"), msg
