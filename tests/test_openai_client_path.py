"""Issue 14 "done when": the official ``openai`` client's completions and chat (streamed and not,
content parts, JSON mode, logprobs) work through ``mesh broker --http`` and ``mesh gateway``, in
front of a real ``mesh attach sglang`` adapter and ``mesh stub-sglang`` engine (an enforcing engine:
with a ``json_schema`` its answer is JSON conforming to it; it returns SGLang-format logprobs).

One set of processes serves the module; every test runs against both front doors.
"""

from __future__ import annotations

import json
import math

import aiohttp
import pytest

from mesh.lab.procs import ProcGroup, wait_for_log_event
from mesh.lab.up import wait_for_workers
from tests.conftest import run, until

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "stub-sglang-8b"  # what the engine serves
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5}, "member": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    "address": {"$ref": "#/$defs/Address"}},
    "required": ["name", "age", "member", "address"], "additionalProperties": False,
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                          "required": ["city"]}}}
RF_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def fronts(tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("openai-path") / "logs")
    try:
        b = group.broker("b", "--http", "127.0.0.1:0", "--policy", "round_robin")
        broker_url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen, start=b.log_start)["url"]
        p = group.spawn("stub0", ["stub-sglang", "--port", "0", "--time-scale", "0.001"])
        engine = wait_for_log_event(p.log_path, "sglang_stub_listening", 30, p.popen, start=p.log_start)["url"]
        group.spawn("a0", ["attach", "sglang", "--url", engine, "--broker", b.backend, "--worker-id", "a0"])
        g = group.spawn("gw", ["gateway", "--http", "127.0.0.1:0", "--broker", b.frontend])
        gateway_url = wait_for_log_event(g.log_path, "gateway_listening", 30, g.popen, start=g.log_start)["url"]
        run(wait_for_workers(b.frontend, 1), 40)

        async def gateway_ready() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                async def healthy() -> bool:
                    async with s.get(gateway_url + "/health") as r:
                        return r.status == 200
                await until(healthy, 20, "the gateway sees the worker")

        run(gateway_ready(), 30)
        yield {"broker": broker_url, "gateway": gateway_url}
    finally:
        group.stop_all()


@pytest.fixture(params=["broker", "gateway"])
def url(request, fronts) -> str:
    return fronts[request.param]


def _client(url: str):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)


def test_completions_and_chat_streamed_and_not_with_content_parts(url):
    async def body() -> None:
        async with _client(url) as client:
            r = await client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=5)
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5 and len(r.choices[0].text.split()) == 5
            assert r.choices[0].logprobs is None
            stream = await client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=6, stream=True,
                                                     stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            assert len("".join(c.choices[0].text for c in chunks if c.choices).split()) == 6
            assert chunks[-1].usage.completion_tokens == 6

            parts = [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]
            r = await client.chat.completions.create(model=MODEL, messages=parts, max_tokens=4)
            msg = r.choices[0].message
            assert msg.role == "assistant" and len(msg.content.split()) == 4 and r.choices[0].finish_reason == "length"
            assert r.choices[0].logprobs is None
            stream = await client.chat.completions.create(model=MODEL, messages=parts, max_tokens=4, stream=True)
            chunks = [c async for c in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert len("".join(c.choices[0].delta.content or "" for c in chunks).split()) == 4
            assert chunks[-1].choices[0].finish_reason == "length"

    run(body())


def test_json_mode_answers_parse_and_conform(url):
    async def body() -> None:
        async with _client(url) as client:
            msgs = [{"role": "user", "content": [{"type": "text", "text": "Describe a person as JSON."}]}]
            r = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=300, response_format={"type": "json_object"})
            assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"

            for i in range(3):
                r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"person {i}"}],
                                                         max_tokens=400, response_format=RF_SCHEMA)
                jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
                assert r.choices[0].finish_reason == "stop"
            stream = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=400, response_format=RF_SCHEMA,
                                                          stream=True)
            chunks = [c async for c in stream]
            assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), SCHEMA)

            r = await client.completions.create(model=MODEL, prompt="a person:", max_tokens=400, extra_body={"response_format": RF_SCHEMA})
            jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
            cut = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, response_format=RF_SCHEMA)
            assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 5  # cut short: not valid JSON yet

    run(body())


def _check_top(token: str, logprob: float, top: list[tuple[str, float]], n: int) -> None:
    """Greedy engine: the chosen token is the most likely one, alternatives sorted, probabilities < 1."""
    assert len(top) == n
    assert top[0] == (token, logprob) and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert sum(math.exp(lp) for _, lp in top) < 1 and logprob < 0


def test_completions_logprobs_streamed_and_not(url):
    async def body() -> None:
        async with _client(url) as client:
            r = await client.completions.create(model=MODEL, prompt="the logprobs of", max_tokens=6, logprobs=3)
            ch = r.choices[0]
            lp = ch.logprobs  # parsed by the client into its Logprobs type
            assert type(lp).__name__ == "Logprobs"
            assert "".join(lp.tokens) == ch.text and len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 6
            assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(6)]
            for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
                _check_top(tok, tlp, list(top.items()), 3)

            r0 = await client.completions.create(model=MODEL, prompt="zero alternatives", max_tokens=3, logprobs=0)
            assert len(r0.choices[0].logprobs.token_logprobs) == 3 and r0.choices[0].logprobs.top_logprobs is None

            stream = await client.completions.create(model=MODEL, prompt="the logprobs of", max_tokens=6, logprobs=2, stream=True)
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].text for c in chunks)
            toks = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
            offs = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
            assert "".join(toks) == text and len(toks) == 6 and offs == [len("".join(toks[:i])) for i in range(6)]
            for c in chunks:
                if c.choices[0].logprobs:
                    assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text  # each chunk its own tokens
                    for tok, tlp, top in zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs,
                                             c.choices[0].logprobs.top_logprobs):
                        _check_top(tok, tlp, list(top.items()), 2)

    run(body())


def test_chat_logprobs_streamed_and_not_and_with_json_mode(url):
    async def body() -> None:
        async with _client(url) as client:
            msgs = [{"role": "user", "content": [{"type": "text", "text": "logprobs please"}]}]
            r = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, logprobs=True, top_logprobs=4)
            content = r.choices[0].logprobs.content  # ChatCompletionTokenLogprob objects
            assert type(content[0]).__name__ == "ChatCompletionTokenLogprob" and len(content) == r.usage.completion_tokens == 5
            assert "".join(t.token for t in content) == r.choices[0].message.content
            for t in content:
                assert t.bytes == list(t.token.encode()) and all(a.bytes == list(a.token.encode()) for a in t.top_logprobs)
                _check_top(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs], 4)

            r1 = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, logprobs=True)
            assert [t.top_logprobs for t in r1.choices[0].logprobs.content] == [[], [], []]

            stream = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, logprobs=True, top_logprobs=4,
                                                          stream=True)
            chunks = [c async for c in stream]
            streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
            assert len(streamed) == 5 and "".join(t.token for t in streamed) == "".join(c.choices[0].delta.content or "" for c in chunks)
            for c in chunks:
                if c.choices and c.choices[0].logprobs:
                    assert "".join(t.token for t in c.choices[0].logprobs.content) == c.choices[0].delta.content
                    for t in c.choices[0].logprobs.content:
                        _check_top(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs], 4)

            r = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=400, response_format=RF_SCHEMA,
                                                     logprobs=True, top_logprobs=2)
            text = r.choices[0].message.content
            jsonschema.validate(json.loads(text), SCHEMA)
            assert "".join(t.token for t in r.choices[0].logprobs.content) == text

            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, top_logprobs=3)
            assert "top_logprobs" in str(e.value)
            with pytest.raises(openai.BadRequestError) as e:
                await client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=9)
            assert "logprobs" in str(e.value)

    run(body())


def test_generate_streams_logprobs_cumulatively_like_sglang(fronts):
    async def body() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            req = {"text": "cumulative", "stream": True, "sampling_params": {"max_new_tokens": 5}, "return_logprob": True,
                   "top_logprobs_num": 2, "return_text_in_logprobs": True, "logprob_start_len": 0}
            async with s.post(fronts["broker"] + "/generate", json=req) as r:
                assert r.status == 200
                events = [json.loads(line[6:]) for line in (await r.read()).split(b"\n") if line.startswith(b"data: {")]
            assert len(events) >= 2
            for ev in events:
                m = ev["meta_info"]
                assert [e[1] for e in m["output_token_logprobs"]] == ev["output_ids"]  # cumulative, as the engine's own
                assert len(m["output_top_logprobs"]) == len(ev["output_ids"]) and len(m["input_token_logprobs"]) > 0
            async with s.post(fronts["broker"] + "/generate", json={**req, "stream": False}) as r:
                out = await r.json()
            m = out["meta_info"]
            assert [e[1] for e in m["output_token_logprobs"]] == out["output_ids"] and "".join(e[2] for e in m["output_token_logprobs"]) == out["text"]

    run(body())
