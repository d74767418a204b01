"""The simulated workers (``mesh worker-stub``) honour what they can and refuse the rest by name
(issue 30): ``max_new_tokens: 0`` prefills and generates nothing; ``stop`` and constrained output
(``response_format`` -> ``json_schema``), which made-up output cannot honour, are refused naming
the parameter (they used to be ignored: 5 of 12 JSON-mode answers were not JSON)."""

from __future__ import annotations

import pytest

from mesh.client import Client
from mesh.errors import RequestError
from mesh.lab.up import wait_for_workers
from tests.conftest import run


def test_simulated_workers_honour_max_tokens_0_and_refuse_stop_and_json_by_name(procs):
    b = procs.broker("b")
    procs.workers("w", [b.backend], "--time-scale", "0.01")

    async def body():
        await wait_for_workers(b.frontend, 1)
        async with Client(b.frontend) as c:
            for stream in (False, True):
                res = await c.generate(input_ids=list(range(1, 40)), max_new_tokens=0, stream=stream, deadline_ms=10_000)
                assert res.token_ids == [] and res.finish_reason == "length", res
                assert res.usage["completion_tokens"] == 0 and res.usage["prompt_tokens"] == 39
            for params, name in (({"stop": ["\n"]}, "stop"), ({"json_schema": '{"type": "object"}'}, "response_format"),
                                 ({"stop_token_ids": [2]}, "stop_token_ids")):
                with pytest.raises(RequestError) as ei:
                    await c.generate(input_ids=[1, 2, 3], max_new_tokens=4, params=params, deadline_ms=10_000)
                assert ei.value.code.value == "bad_request" and f"{name}: not supported" in str(ei.value), str(ei.value)

    run(body(), 60)


def test_the_sglang_stub_honours_stop_strings_and_stop_token_ids(procs):
    """Issue 30: the SGLang stub accepted ``stop`` and ignored it. It now ends the output before
    what matched (finish ``stop``, ``matched`` naming it), on /generate and the OpenAI API. Its
    words are drawn from 32; stopping on 16 of them over 32 tokens stops (but for 2**-32)."""
    import aiohttp

    from tests.adapters_support import start_stub
    from workers_stub.sglang_server import _WORDS, stop_hit

    _, rec = start_stub(procs, "stub", "--time-scale", "0.01")
    url, stops = rec["url"], list(_WORDS[:16])

    def check(text: str, n: int) -> None:
        assert n < 32 and not set(text.split()) & set(stops), (text, n)

    async def body():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            async with http.post(url + "/generate", json={"input_ids": [1, 2, 3, 4],
                                                          "sampling_params": {"max_new_tokens": 32, "stop": stops}}) as r:
                got = await r.json()
            fr = got["meta_info"]["finish_reason"]
            assert fr["type"] == "stop" and fr["matched"] in stops, fr
            check(got["text"], len(got["output_ids"]))
            async with http.post(url + "/v1/completions", json={"model": "stub-sglang-8b", "prompt": "hello world",
                                                                "max_tokens": 32, "stop": stops[:4]}) as r:
                choice = (await r.json())["choices"][0]
            assert choice["finish_reason"] in ("stop", "length")
            assert not set(choice["text"].split()) & set(stops[:4]), choice
            async with http.post(url + "/v1/chat/completions", json={"model": "stub-sglang-8b", "max_tokens": 32, "stop": stops,
                                                                     "messages": [{"role": "user", "content": "hi"}]}) as r:
                choice = (await r.json())["choices"][0]
            assert choice["finish_reason"] == "stop"
            check(choice["message"]["content"], 0)

    run(body(), 60)
    # stop token ids: the token is not output
    assert stop_hit([], [40, 41, 42], (41,)) == (1, 41) and stop_hit([], [40, 41], (99,)) is None
