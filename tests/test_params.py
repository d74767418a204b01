"""Generation parameters reach the engine unchanged, or are refused with a 400 naming the field
(unit checks of :mod:`mesh.params`, then the official ``openai`` client through a real broker,
adapter and ``mesh stub-sglang``, reading what the engine received)."""

from __future__ import annotations


import aiohttp
import pytest

from mesh.params import ParamError, from_generate, from_openai
from tests.conftest import run


def test_openai_fields_map_onto_sglang_parameters():
    p = from_openai({"model": "mesh", "prompt": "x", "max_tokens": 7, "temperature": 0.2, "top_p": 0.9, "seed": 11,
                     "frequency_penalty": 0.5, "presence_penalty": -0.5, "stop": "END", "n": 1, "user": "u1",
                     "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
                     "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                     "logit_bias": {"42": -100}, "cache_salt": "tenant-a"}, chat=False)
    assert p == {"max_new_tokens": 7, "temperature": 0.2, "top_p": 0.9, "sampling_seed": 11, "frequency_penalty": 0.5,
                 "presence_penalty": -0.5, "stop": ["END"], "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                 "min_new_tokens": 2, "ignore_eos": True, "json_schema": '{"type": "object"}', "logit_bias": {"42": -100},
                 "cache_salt": "tenant-a"}
    assert from_openai({"messages": [], "max_completion_tokens": 3, "response_format": {"type": "json_object"}},
                       chat=True) == {"max_new_tokens": 3, "json_schema": '{"type": "object"}'}
    assert "max_new_tokens" not in from_openai({"prompt": "x"}, chat=False)  # no limit given: the engine's default


def test_openai_logprobs_map_onto_sglang_return_logprob():
    lp = {"return_logprob": True, "return_text_in_logprobs": True}
    assert from_openai({"prompt": "x", "logprobs": 3}, chat=False) == {**lp, "top_logprobs_num": 3}
    assert from_openai({"prompt": "x", "logprobs": 0}, chat=False) == {**lp, "top_logprobs_num": 0}
    assert from_openai({"messages": [], "logprobs": True}, chat=True) == lp
    assert from_openai({"messages": [], "top_logprobs": 5, "logprobs": True}, chat=True) == {**lp, "top_logprobs_num": 5}
    assert from_openai({"messages": [], "logprobs": True, "top_logprobs": 20}, chat=True) == {**lp, "top_logprobs_num": 20}
    assert from_openai({"messages": [], "logprobs": False, "top_logprobs": 0}, chat=True) == {}


@pytest.mark.parametrize("body, chat, field", [
    ({"n": 2}, False, "n"), ({"n": True}, True, "n"), ({"best_of": 3}, False, "best_of"), ({"echo": True}, False, "echo"),
    ({"suffix": "x"}, False, "suffix"), ({"tools": [{"type": "function"}]}, True, "tools"),
    ({"tool_choice": "required"}, True, "tool_choice"), ({"logprobs": 6}, False, "logprobs"), ({"logprobs": True}, False, "logprobs"),
    ({"logprobs": 1}, True, "logprobs"), ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
    ({"top_logprobs": 3}, True, "top_logprobs"), ({"logprobs": False, "top_logprobs": 2}, True, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 1.5}, True, "top_logprobs"),
    ({"temperature": 3}, True, "temperature"), ({"top_p": "0.5"}, True, "top_p"), ({"stop": ["a"] * 5}, True, "stop"),
    ({"max_tokens": -1}, False, "max_tokens"), ({"seed": 1.5}, False, "seed"), ({"frobnicate": 1}, True, "frobnicate"),
    ({"response_format": {"type": "yaml"}}, True, "response_format.type"), ({"stop_token_ids": ["x"]}, True, "stop_token_ids"),
])
def test_what_mesh_cannot_honour_is_refused_by_name(body, chat, field):
    with pytest.raises(ParamError) as e:
        from_openai(body, chat=chat)
    assert e.value.field == field and str(e.value).startswith(field)


def test_generate_passes_sampling_params_and_request_fields():
    p = from_generate({"text": "x", "rid": "r", "stream": True, "return_logprob": True, "top_logprobs_num": 3, "lora_path": "a",
                       "sampling_params": {"max_new_tokens": 5, "top_k": 3, "regex": "[0-9]+", "stop_token_ids": [2],
                                           "json_schema": None, "custom_params": {"k": 1}}})
    assert p == {"max_new_tokens": 5, "top_k": 3, "regex": "[0-9]+", "stop_token_ids": [2], "custom_params": {"k": 1},
                 "return_logprob": True, "top_logprobs_num": 3, "lora_path": "a"}
    for body, field in (({"sampling_params": {"temprature": 1}}, "sampling_params.temprature"),
                        ({"sampling_params": {"n": 2}}, "sampling_params.n"), ({"image_data": "..."}, "image_data"),
                        ({"sampling_params": []}, "sampling_params")):
        with pytest.raises(ParamError) as e:
            from_generate(body)
        assert e.value.field == field


def test_parameters_reach_the_engine_through_the_openai_client(procs):
    openai = pytest.importorskip("openai")
    from tests.adapters_support import http_adapter_path

    url, engines = http_adapter_path(procs, 1)

    async def seen(s: aiohttp.ClientSession) -> dict:
        async with s.get(engines[0] + "/debug/requests") as r:
            return [x for x in await r.json() if x["path"] == "/generate"][-1]["body"]

    async def body() -> None:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            r = await client.chat.completions.create(
                model="mesh", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.3, top_p=0.8, seed=5,
                frequency_penalty=0.1, stop=["zz"], response_format={"type": "json_object"}, extra_body={"top_k": 7})
            assert r.choices[0].finish_reason == "length"
            sp = (await seen(s))["sampling_params"]
            assert sp == {"max_new_tokens": 4, "temperature": 0.3, "top_p": 0.8, "sampling_seed": 5, "frequency_penalty": 0.1,
                          "stop": ["zz"], "json_schema": '{"type": "object"}', "top_k": 7}, sp

            await client.completions.create(model="mesh", prompt="hello there")  # no max_tokens
            assert "max_new_tokens" not in (await seen(s))["sampling_params"]  # the engine's own default applies

            for kw, field in (({"n": 2}, "n"), ({"extra_body": {"frobnicate": 1}}, "frobnicate")):
                with pytest.raises(openai.BadRequestError) as e:
                    await client.completions.create(model="mesh", prompt="x", max_tokens=2, **kw)
                assert e.value.status_code == 400 and field in str(e.value), str(e.value)

            async with s.post(url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2, "regex": "[a-z]+",
                                                                                    "ignore_eos": True}}) as resp:
                assert resp.status == 200
            assert (await seen(s))["sampling_params"] == {"max_new_tokens": 2, "regex": "[a-z]+", "ignore_eos": True}
        await client.close()

    run(body(), 60)
