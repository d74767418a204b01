"""The path users run, with real processes: HTTP client -> ``mesh broker --http`` -> ``mesh attach
sglang`` -> ``mesh stub-sglang`` (SGLang's own answer formats).

* no stall: concurrent requests through real adapters complete without waiting for a heartbeat
  (a lost wake-up on a socket owner used to park requests until its poll timed out);
* fidelity: the body of a /generate answer has the engine's fields (``meta_info`` as the engine
  wrote it, ``finish_reason.length`` included, the request's own ``rid`` as ``id``), a stream has
  exactly the engine's events (no extra final event) with token counts in every event, and mesh's
  own metadata is in ``x-mesh-*`` headers;
* errors: when every engine answers 500, a stream that failed before its first byte gets an HTTP
  error status and a JSON error body, not a 200 with an SSE error.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.adapters_support import http_adapter_path
from tests.conftest import run, until

async def _sse(resp: aiohttp.ClientResponse) -> list[bytes]:
    raw = await resp.read()
    return [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]


# A stall lasts about one heartbeat (the link's poll timeout): with a long heartbeat the stall is
# seconds, far above what a busy machine (2 cores, 3x oversubscribed) adds to a healthy p99.
STALL_HB_MS = 5000


def test_concurrent_requests_through_real_adapters_do_not_stall(procs):
    url, _ = http_adapter_path(procs, heartbeat_ms=STALL_HB_MS)

    async def body() -> list[float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            async def one(k: int, i: int, stream: bool) -> float:
                t0 = time.monotonic()
                async with s.post(url + "/generate", json={"text": f"loop {k} request {i} of the stall test",
                                                            "sampling_params": {"max_new_tokens": 4}, "stream": stream}) as r:
                    await r.read()
                    assert r.status == 200, r.status
                return time.monotonic() - t0

            await one(0, 0, False)  # warm up: first connections, first decisions

            async def loop(k: int) -> list[float]:
                return [await one(k, i, i % 2 == 1) for i in range(12)]

            return sorted(x for lats in await asyncio.gather(*(loop(k) for k in range(32))) for x in lats)

    lat = run(body(), 90)
    p50, p99 = lat[len(lat) // 2], lat[int(len(lat) * 0.99) - 1]
    print(f"32 loops x 12 requests through 2 adapters: p50 {p50 * 1000:.1f} ms p99 {p99 * 1000:.1f} ms max {lat[-1] * 1000:.1f} ms")
    assert p99 < 0.3 * STALL_HB_MS / 1000, (p50, p99, lat[-5:])


def test_generate_answers_keep_the_engines_fields_and_events(procs):
    url, engines = http_adapter_path(procs, 1)
    req = {"input_ids": list(range(100, 140)), "sampling_params": {"max_new_tokens": 6}}

    async def body() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            async def post(base: str, **extra):
                async with s.post(base + "/generate", json={**req, **extra}) as r:
                    assert r.status == 200, (base, r.status, await r.text())
                    return r.headers, (await _sse(r) if extra.get("stream") else await r.json())

            _, direct = await post(engines[0], rid="direct-1")
            headers, via = await post(url, rid="my-request-1")
            assert set(via) == set(direct) == {"text", "output_ids", "meta_info"}
            assert set(via["meta_info"]) == set(direct["meta_info"]), set(via["meta_info"]) ^ set(direct["meta_info"])
            assert via["meta_info"]["finish_reason"] == direct["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
            assert via["meta_info"]["id"] == "my-request-1"
            assert len(via["output_ids"]) == len(direct["output_ids"]) == 6 and via["text"]
            assert headers["x-mesh-worker"] == "a0" and headers["x-mesh-request-id"]

            _, no_rid = await post(url)  # no rid given: the id is the one the broker logs the request by
            assert isinstance(no_rid["meta_info"]["id"], str) and len(no_rid["meta_info"]["id"]) >= 16

            _, d_events = await post(engines[0], stream=True, rid="direct-2")
            headers, v_events = await post(url, stream=True, rid="my-request-2")
            assert headers["x-mesh-worker"] == "a0" and headers["Content-Type"].startswith("text/event-stream")
            assert d_events[-1] == v_events[-1] == b"[DONE]"
            assert len(v_events) == len(d_events), (len(v_events), len(d_events))  # no extra final event
            d, v = [orjson.loads(x) for x in d_events[:-1]], [orjson.loads(x) for x in v_events[:-1]]
            assert [len(e["output_ids"]) for e in v] == [len(e["output_ids"]) for e in d] == list(range(1, 7))  # cumulative
            assert [e["meta_info"]["completion_tokens"] for e in v] == [e["meta_info"]["completion_tokens"] for e in d]
            assert all(e["meta_info"]["finish_reason"] is None for e in v[:-1])
            assert v[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
            assert all(e["meta_info"]["id"] == "my-request-2" for e in v)
            assert set(v[-1]["meta_info"]) == set(d[-1]["meta_info"])

    run(body(), 60)


def _serve_engines(n: int, generate):
    """Start ``n`` SGLang-shaped fake engines (discovery, health, loads, and ``generate`` as the
    /generate handler) on a thread of their own; yields their URLs."""
    import threading

    urls: list[str] = []
    ready = threading.Event()
    stop: asyncio.Event | None = None
    loop: asyncio.AbstractEventLoop | None = None

    async def main() -> None:
        nonlocal stop, loop
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        async def info(_):
            return web.json_response({"served_model_name": "broken", "page_size": 16, "max_running_requests": 64,
                                      "max_total_num_tokens": 65536})

        async def ok(_):
            return web.json_response({})

        runners = []
        for _ in range(n):
            app = web.Application()
            app.add_routes([web.get("/server_info", info), web.get("/health", ok), web.get("/v1/loads", ok),
                            web.post("/generate", generate)])
            r = web.AppRunner(app, access_log=None, handler_cancellation=True)  # as SGLang aborts on disconnect
            await r.setup()
            site = web.TCPSite(r, "127.0.0.1", 0)
            await site.start()
            port = r.addresses[0][1]
            urls.append(f"http://127.0.0.1:{port}")
            runners.append(r)
        ready.set()
        await stop.wait()
        for r in runners:
            await r.cleanup()

    t = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    t.start()
    assert ready.wait(10)
    yield urls
    loop.call_soon_threadsafe(stop.set)
    t.join(10)


@pytest.fixture
def failing_engines():
    """Two SGLang-shaped engines that are healthy but answer every /generate with HTTP 500."""
    hits = {"generate": 0}

    async def generate(request):
        await request.read()
        hits["generate"] += 1
        return web.json_response({"object": "error", "message": "CUDA error: an illegal memory access", "code": 500},
                                 status=500)

    for urls in _serve_engines(2, generate):
        yield urls, hits


@pytest.fixture
def stalling_engine():
    """One engine whose streams send one event and then nothing (a wedged GPU)."""
    seen = {"aborted": 0}

    async def generate(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"text": "a", "output_ids": [97], "meta_info": {"id": "x", "finish_reason": null, '
                         b'"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}}\n\n')
        try:
            await asyncio.sleep(60)  # the fault: a wedged GPU sends nothing more
        except asyncio.CancelledError:
            seen["aborted"] += 1  # the adapter closed the connection: the engine would abort the request
            raise
        return resp

    for urls in _serve_engines(1, generate):
        yield urls, seen


def test_when_every_engine_answers_500_the_client_gets_an_http_error(procs, failing_engines):
    engines, hits = failing_engines
    url, _ = http_adapter_path(procs, 2, engine_urls=engines)

    async def body() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            for path, req in (("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}}),
                              ("/v1/completions", {"model": "mesh", "prompt": "hello", "max_tokens": 4})):
                for stream in (False, True):
                    async with s.post(url + path, json={**req, "stream": stream}) as r:
                        body = await r.read()
                        assert r.status == 502, (path, stream, r.status, body[:300])
                        assert r.headers["Content-Type"].startswith("application/json"), (path, stream, r.headers)
                        err = orjson.loads(body)["error"]
                        assert err["code"] == "worker_error" and "HTTP 500" in err["message"], err

    run(body(), 90)
    assert hits["generate"] >= 8  # every request was tried on more than one engine before giving up


def test_a_request_past_its_deadline_is_a_504_and_the_engine_is_freed(procs):
    """x-mesh-deadline-ms bounds the whole request: the broker answers 504 at the deadline and the
    adapter abandons the engine request (its connection closes, the engine aborts)."""
    url, engines = http_adapter_path(procs, 1, time_scale="1.0")  # modelled speed: 2,000 tokens take seconds

    async def body() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            t0 = time.monotonic()
            async with s.post(url + "/generate", headers={"x-mesh-deadline-ms": "400"},
                              json={"text": "a long answer please", "sampling_params": {"max_new_tokens": 2000}}) as r:
                err = orjson.loads(await r.read())["error"]
            took = time.monotonic() - t0
            assert r.status == 504 and err["code"] == "deadline_exceeded", (r.status, err)
            assert 0.35 < took < 10.0, took  # unbounded, 2,000 modelled tokens take far longer

            async def idle() -> bool:
                async with s.get(engines[0] + "/v1/loads?include=core") as resp:
                    loads = (await resp.json())["loads"]
                return sum(x["num_running_reqs"] + x["num_waiting_reqs"] for x in loads) == 0

            await until(idle, 10, "the engine idle (nobody waits for the request)", step_s=0.05)

    run(body(), 60)


async def _engine_idle(s: aiohttp.ClientSession, engine: str, within_s: float = 10.0) -> None:
    async def idle() -> bool:
        async with s.get(engine + "/v1/loads?include=core") as resp:
            loads = (await resp.json())["loads"]
        return sum(x["num_running_reqs"] + x["num_waiting_reqs"] for x in loads) == 0

    await until(idle, within_s, "the engine idle (nobody waits for the request)", step_s=0.05)


def test_lifetimes_streams_are_bounded_by_idle_time_unstreamed_by_the_request_timeout(procs):
    """--http-request-timeout-s bounds an unstreamed request; a stream that keeps producing runs
    past it (only --http-stream-idle-timeout-s between outputs bounds it); a client that goes
    away cancels its request on the engine, streamed or not."""
    url, engines = http_adapter_path(procs, 1, time_scale="1.0",
                         broker_args=("--http-request-timeout-s", "1.5", "--http-stream-idle-timeout-s", "1"))

    async def body() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            req = {"text": "tell me a long story", "sampling_params": {"max_new_tokens": 2000}}
            t0 = time.monotonic()
            async with s.post(url + "/generate", json=req) as r:
                err = orjson.loads(await r.read())["error"]
            assert r.status == 504 and err["code"] == "deadline_exceeded" and 1.3 < time.monotonic() - t0 < 5
            await _engine_idle(s, engines[0])

            # a stream of over two seconds (300 tokens at the modelled 7 ms a step, a floor): past the request
            # timeout, never idle
            t0 = time.monotonic()
            async with s.post(url + "/generate", json={**req, "stream": True, "sampling_params": {"max_new_tokens": 300}}) as r:
                events = await _sse(r)
            took = time.monotonic() - t0
            last = orjson.loads(events[-2])
            assert r.status == 200 and events[-1] == b"[DONE]" and last["meta_info"]["finish_reason"]["type"] == "length", events[-2:]
            assert took > 1.5, took  # it outlived --http-request-timeout-s

            for stream in (False, True):  # the client goes away mid-generation
                with pytest.raises(asyncio.TimeoutError):
                    async with asyncio.timeout(0.5):
                        async with s.post(url + "/generate", json={**req, "stream": stream}) as r:
                            await r.read()
                await _engine_idle(s, engines[0])

    run(body(), 90)


def test_a_stream_without_output_for_the_idle_timeout_ends_with_an_error_and_frees_the_engine(procs, stalling_engine):
    engines, seen = stalling_engine
    url, _ = http_adapter_path(procs, 1, engine_urls=engines, broker_args=("--http-stream-idle-timeout-s", "1"))

    async def body() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            t0 = time.monotonic()
            async with s.post(url + "/generate", json={"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 9}}) as r:
                events = await _sse(r)
            took = time.monotonic() - t0
            assert r.status == 200 and len(events) == 3 and events[-1] == b"[DONE]", events
            assert orjson.loads(events[0])["output_ids"] == [97]
            err = orjson.loads(events[1])["error"]
            assert err["code"] == "deadline_exceeded" and "no output for 1 s" in err["message"], err
            assert 0.9 < took < 15, took  # the engine stalls for ever: only the idle timeout ends it
            await until(lambda: seen["aborted"], 10, "the engine request abandoned", step_s=0.05)

    run(body(), 60)
