"""A caller's x-request-id travels HTTP -> broker -> adapter -> engine and comes back (issue 17 part 4),
with real processes: ``mesh broker --http``, ``mesh attach sglang``, ``mesh stub-sglang``."""

from __future__ import annotations

import aiohttp

from tests.adapters_support import http_adapter_path
from tests.conftest import run


def test_x_request_id_reaches_the_engine_and_comes_back(procs):
    url, _ = http_adapter_path(procs, 1)

    async def body():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            h = {"x-request-id": "trace-7f3a.checkout:42"}
            async with s.post(url + "/generate", json={"input_ids": list(range(10, 40)), "sampling_params": {"max_new_tokens": 3}},
                              headers=h) as r:
                assert r.status == 200, await r.text()
                got = await r.json()
                assert r.headers["x-request-id"] == "trace-7f3a.checkout:42"
                assert r.headers["x-mesh-request-id"] == "trace-7f3a.checkout:42"
            assert got["meta_info"]["id"] == "trace-7f3a.checkout:42"
            async with s.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, headers=h) as r:
                assert r.status == 200 and r.headers["x-request-id"] == "trace-7f3a.checkout:42"
            # errors carry it too, and a malformed id is refused by name
            async with s.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": -1}, headers=h) as r:
                assert r.status == 400 and r.headers["x-request-id"] == "trace-7f3a.checkout:42"
            async with s.post(url + "/v1/completions", json={"prompt": "hello"}, headers={"x-request-id": "bad id"}) as r:
                assert r.status == 400 and "x-request-id" in (await r.json())["error"]["message"]
            # without one, the broker's own id is returned under both names
            async with s.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}) as r:
                assert r.status == 200 and r.headers["x-request-id"] == r.headers["x-mesh-request-id"]

    run(body(), 60)


def test_the_engine_is_given_the_request_id():
    """The adapter's request to SGLang names the request by the SUBMIT's rid (the HTTP x-request-id),
    then the broker's request number and attempt: the engine's logs show the caller's id."""
    from mesh import protocol as P
    from mesh.adapters.settings import AttachSettings
    from mesh.adapters.sglang import generate_body, info_from_server_info

    sub = P.decode_client(P.encode_submit("trace-7f3a.checkout:42", input_ids=[1, 2, 3], params={"max_new_tokens": 2}))
    body = generate_body(P.Request(7, 2, 1000, sub.rid, None, sub), info_from_server_info({"page_size": 16}, AttachSettings(url="http://x", brokers=("tcp://127.0.0.1:1",))))
    assert body["rid"].startswith("trace-7f3a.checkout:42/7.2."), body["rid"]


def test_vllm_is_given_the_request_id():
    """vLLM's ``/v1/completions`` body carries ``request_id`` (its own request id field), built
    like SGLang's rid: the caller's id first."""
    from mesh import protocol as P
    from mesh.adapters.backend import EngineInfo
    from mesh.adapters.vllm import completions_body

    sub = P.decode_client(P.encode_submit("trace-9", input_ids=[1, 2, 3], params={"max_new_tokens": 2}))
    body = completions_body(P.Request(11, 3, 1000, sub.rid, None, sub), EngineInfo(model="m", block_size=16, dp_size=1))
    assert body["request_id"].startswith("trace-9/11.3."), body["request_id"]
    other = completions_body(P.Request(11, 3, 1000, sub.rid, None, sub), EngineInfo(model="m", block_size=16, dp_size=1))
    assert other["request_id"] != body["request_id"]  # unique per attempt sent
