"""Issue 31 part 1: what mesh does not render passes through to the engine's own OpenAI server.

Real processes: ``mesh broker --http`` (cache-aware routing), two ``mesh stub-sglang`` engines behind
``mesh attach sglang`` adapters, and ``mesh gateway``; the official ``openai`` client drives them:
tool calls (whole and streamed, parsed as the client's own types), reasoning, ``n`` = 2,
embeddings, Responses, rerank and score, ``GET /v1/models/{id}``, an engine's refusal, and the
agent loop (4 sessions x 6 turns of tool call + tool result, every turn after the first a cache hit
on its session's worker). Hostile inputs: oversize tools, a body that is not JSON, an unknown
path, a flood of pass-through requests.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from mesh import protocol as P
from mesh.lab.procs import ProcGroup, wait_for_log_event
from mesh.lab.up import wait_for_workers
from tests.conftest import run, until

openai = pytest.importorskip("openai")

MODEL = "stub-sglang-8b"
TOOLS = [{"type": "function", "function": {"name": "lookup_order", "description": "Find an order by its number",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                          "required": ["query"]}}},
         {"type": "function", "function": {"name": "refund", "parameters": {"type": "object", "properties": {}}}}]
SYSTEM = "You are the order desk of a garden shop. Use the tools to look orders up. " * 6


def _stubs(group: ProcGroup, n: int) -> list[str]:
    procs = [group.spawn(f"stub{i}", ["stub-sglang", "--port", "0", "--time-scale", "0.001"]) for i in range(n)]
    return [wait_for_log_event(p.log_path, "sglang_stub_listening", 30, p.popen, start=p.log_start)["url"] for p in procs]


async def _healthy(url: str, workers: int = 1) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        async def ok() -> bool:
            async with s.get(url + "/health") as r:
                return r.status == 200 and (await r.json())["workers"] >= workers
        await until(ok, 30, f"{url} sees {workers} workers")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("passthrough") / "logs")
    try:
        b = group.broker("b", "--http", "127.0.0.1:0", "--policy", "cache_aware_greedy")
        broker_url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen, start=b.log_start)["url"]
        engines = _stubs(group, 2)
        for i, e in enumerate(engines):
            group.spawn(f"a{i}", ["attach", "sglang", "--url", e, "--broker", b.backend, "--worker-id", f"a{i}"])
        g = group.spawn("gw", ["gateway", "--http", "127.0.0.1:0", "--broker", b.frontend])
        gateway_url = wait_for_log_event(g.log_path, "gateway_listening", 30, g.popen, start=g.log_start)["url"]
        run(wait_for_workers(b.frontend, 2), 40)
        run(_healthy(broker_url, 2), 40)
        run(_healthy(gateway_url, 2), 40)
        yield {"broker": broker_url, "gateway": gateway_url, "engines": engines, "frontend": b.frontend}
    finally:
        group.stop_all()


@pytest.fixture(params=["broker", "gateway"])
def url(request, fleet) -> str:
    return fleet[request.param]


def _client(url: str):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)


def test_tool_call_round_trip_parses_as_the_clients_types(url):
    from openai.types.chat import ChatCompletionMessageToolCall

    async def body():
        async with _client(url) as c:
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is order 1234?"}]
            raw = await c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, tools=TOOLS)
            r = raw.parse()
            assert raw.headers.get("x-mesh-worker") in ("a0", "a1")
            call = r.choices[0].message.tool_calls[0]
            assert isinstance(call, ChatCompletionMessageToolCall)
            assert r.choices[0].finish_reason == "tool_calls"
            assert call.function.name == "lookup_order" and json.loads(call.function.arguments) == {"query": "Where is order 1234?"}
            # the tool's result goes back; tool_choice none: the model answers in words
            msgs += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"status": "shipped"}'}]
            r2 = await c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=5)
            assert r2.choices[0].message.tool_calls is None and r2.choices[0].message.content
            # tool_choice naming the second tool
            r3 = await c.chat.completions.create(model=MODEL, messages=msgs[:2], tools=TOOLS,
                                                 tool_choice={"type": "function", "function": {"name": "refund"}})
            assert r3.choices[0].message.tool_calls[0].function.name == "refund"

    run(body(), 60)


def test_streamed_tool_calls_and_reasoning(url):
    async def body():
        async with _client(url) as c:
            msgs = [{"role": "user", "content": "Where is order 77?"}]
            stream = await c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, stream=True,
                                                     stream_options={"include_usage": True})
            chunks = [ch async for ch in stream]
            deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
            assert deltas[0].function.name == "lookup_order" and deltas[0].id
            args = "".join(d.function.arguments or "" for d in deltas)
            assert json.loads(args) == {"query": "Where is order 77?"}
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
            assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
            # reasoning separated (SGLang's separate_reasoning; the client keeps unknown fields)
            r = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, extra_body={"separate_reasoning": True})
            m = r.choices[0].message
            assert m.reasoning_content == "the user asked: Where is order 77?" and "<think>" not in m.content
            stream = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, stream=True,
                                                     extra_body={"separate_reasoning": True})
            got = [ch.choices[0].delta.model_extra.get("reasoning_content") async for ch in stream if ch.choices]
            assert "".join(x for x in got if x) == "the user asked: Where is order 77?"

    run(body(), 60)


def test_n2_embeddings_responses_rerank_score(url):
    async def body():
        async with _client(url) as c:
            r = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4)
            assert [ch.index for ch in r.choices] == [0, 1] and all(ch.message.content for ch in r.choices)
            e = await c.embeddings.create(model=MODEL, input=["a garden hose", "a rake"])
            assert len(e.data) == 2 and len(e.data[0].embedding) == 16 and e.data[0].embedding != e.data[1].embedding
            e2 = await c.embeddings.create(model=MODEL, input="a garden hose", encoding_format="float")
            assert e2.data[0].embedding == pytest.approx(e.data[0].embedding, abs=1e-6)  # deterministic (base64: float32)
            resp = await c.responses.create(model=MODEL, input="Tell me about rakes", instructions="Be brief", max_output_tokens=5)
            assert resp.output_text and resp.usage.output_tokens == 5
            events = [ev async for ev in await c.responses.create(model=MODEL, input="Tell me about rakes", stream=True,
                                                                  max_output_tokens=5)]
            assert events[0].type == "response.created" and events[-1].type == "response.completed"
            text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
            assert text == events[-1].response.output_text
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/rerank", json={"query": "rake", "documents": ["a", "b", "c"]}) as r:
                ranked = await r.json()
                assert r.status == 200 and sorted(x["index"] for x in ranked) == [0, 1, 2]
            async with s.post(url + "/v1/score", json={"query": "rake", "items": ["a", "b"], "label_token_ids": [1, 2]}) as r:
                assert r.status == 200 and len((await r.json())["scores"]) == 2

    run(body(), 60)


def test_models_by_id_and_engine_refusals_reach_the_client(url):
    async def body():
        async with _client(url) as c:
            m = await c.models.retrieve(MODEL)
            assert m.id == MODEL
            with pytest.raises(openai.NotFoundError) as ei:
                await c.models.retrieve("no-such-model")
            assert ei.value.body["code"] == "model_not_found"
            # the engine refuses: its status and its body reach the client (not a mesh 502)
            with pytest.raises(openai.BadRequestError) as ei:
                await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                                tool_choice={"type": "function", "function": {"name": "nope"}})
            assert "tool_choice names a function that is not in tools" in ei.value.body["message"]
            with pytest.raises(openai.BadRequestError) as ei:  # the engine's own limits pass through too
                await c.completions.create(model=MODEL, prompt="hi", n=2)
            assert "n=1 only" in ei.value.body["message"]

    run(body(), 60)


def test_hostile_passthrough_inputs(fleet):
    url = fleet["broker"]

    async def body():
        async with aiohttp.ClientSession() as s:
            big = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "x" * (3 << 20)}}]
            async with s.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                                 "tools": big}) as r:
                assert r.status == 413, await r.text()
            async with s.post(url + "/v1/embeddings", data=b"{not json", headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
            async with s.post(url + "/v1/embeddings", json={"model": MODEL, "input": {"a": 1}}) as r:
                assert r.status == 400 and "input" in (await r.json())["error"]["message"]
            async with s.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                                 "tools": "all of them"}) as r:
                assert r.status == 400 and "tools" in (await r.json())["error"]["message"]
            async with s.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                                 "tools": TOOLS, "chat_template_kwargs": {"messages": []}}) as r:
                assert r.status == 400 and "chat_template_kwargs" in (await r.json())["error"]["message"]
            for path, body, says in (("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 9},
                                      "n must be"),
                                     ("/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 0}, "dimensions"),
                                     ("/v1/embeddings", {"model": MODEL, "input": "x", "encoding_format": "hex"}, "encoding_format")):
                async with s.post(url + path, json=body) as r:  # the engine's own 400s, passed through
                    assert r.status == 400 and says in (await r.json())["error"]["message"], (path, body)
            async with s.post(url + "/v1/files", json={}) as r:
                assert r.status in (404, 405)
            # a flood: every request answered by the engine (or refused as overload), none lost, no 5xx
            async def one(i: int) -> int:
                async with s.post(url + "/v1/embeddings", json={"model": MODEL, "input": f"item {i}"}) as r:
                    await r.read()
                    return r.status
            statuses = await asyncio.gather(*(one(i) for i in range(200)))
            assert set(statuses) <= {200, 429}, statuses
            assert statuses.count(200) >= 100

    run(body(), 90)


async def agent_loop(urls: list[str], sessions: int = 4, turns: int = 6, *, first_urls: list[str] | None = None,
                     after_first=None) -> list[list[tuple[str, int]]]:
    """``sessions`` agents at once, each ``turns`` turns of tool call + tool result; turn t goes to
    ``urls[t % len(urls)]`` (turn 0 of session k to ``first_urls[k]`` when given, then ``after_first``
    is awaited). Returns per session the (worker, cached tokens) of each turn ("" when the answer
    named no worker: an engine asked directly)."""
    from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall

    clients = {u: _client(u) for u in {*urls, *(first_urls or ())}}
    convs = [[{"role": "system", "content": f"[{k}] {SYSTEM}"}, {"role": "user", "content": f"Where is order {k}00?"}]
             for k in range(sessions)]
    out: list[list[tuple[str, int]]] = [[] for _ in range(sessions)]

    async def turn(k: int, t: int) -> None:
        u = first_urls[k] if first_urls is not None and t == 0 else urls[t % len(urls)]
        msgs = convs[k]
        raw = await clients[u].chat.completions.with_raw_response.create(model=MODEL, messages=msgs, tools=TOOLS)
        r = raw.parse()
        assert isinstance(r, ChatCompletion)
        call = r.choices[0].message.tool_calls[0]
        assert isinstance(call, ChatCompletionMessageToolCall)
        out[k].append((raw.headers.get("x-mesh-worker", ""), r.usage.prompt_tokens_details.cached_tokens))
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"turn": t, "status": "in transit"})}]

    async def rest(k: int) -> None:
        for t in range(1, turns):
            await turn(k, t)

    try:
        await asyncio.gather(*(turn(k, 0) for k in range(sessions)))
        if after_first is not None:
            await after_first()
        await asyncio.gather(*(rest(k) for k in range(sessions)))
        return out
    finally:
        for c in clients.values():
            await c.close()


def check_agent_turns(results: list[list[tuple[str, int]]]) -> None:
    for turns in results:
        workers = {w for w, _ in turns}
        assert len(workers) == 1, turns  # every turn on its session's worker
        assert all(cached > 0 for _, cached in turns[1:]), turns  # and a cache hit there


def test_agent_loop_through_the_broker(fleet):
    results = run(agent_loop([fleet["broker"]]), 120)
    print("agent turns (worker, cached tokens):", results)
    check_agent_turns(results)


@pytest.mark.e2e
def test_agent_loop_through_the_gateway(fleet):
    results = run(agent_loop([fleet["gateway"]]), 120)
    check_agent_turns(results)


@pytest.mark.e2e
def test_agent_loop_alternating_between_two_brokers_with_the_exchange(tmp_path):
    group = ProcGroup(tmp_path / "logs")
    try:
        b1 = group.broker("b1", "--http", "127.0.0.1:0", "--policy", "cache_aware_greedy", "--exchange", "tcp://127.0.0.1:*")
        ex1 = wait_for_log_event(b1.log_path, "broker_listening", 20, b1.popen, start=b1.log_start)["exchange"]
        b2 = group.broker("b2", "--http", "127.0.0.1:0", "--policy", "cache_aware_greedy", "--exchange", "tcp://127.0.0.1:*",
                          "--peer", ex1)
        urls = [wait_for_log_event(b.log_path, "http_listening", 20, b.popen, start=b.log_start)["url"] for b in (b1, b2)]
        engines = _stubs(group, 2)
        for i, e in enumerate(engines):
            group.spawn(f"a{i}", ["attach", "sglang", "--url", e, "--broker", b1.backend, "--broker", b2.backend, "--worker-id", f"a{i}"])
        for b, u in zip((b1, b2), urls):
            run(wait_for_workers(b.frontend, 2), 40)
            run(_healthy(u, 2), 40)
        results = run(agent_loop(urls), 180)
        print("agent turns over two brokers (worker, cached tokens):", results)
        check_agent_turns(results)
    finally:
        group.stop_all()


TOOLS_TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "qwen2_5_tools.jinja"


@pytest.mark.e2e
def test_the_routing_key_is_the_models_chat_template_with_the_tools(procs, tokenizer_cache, tmp_path):
    """With the model's tokenizer and a chat template that renders tools (Qwen2.5's), the front door
    keys an agent's turn by the prompt the engine caches: turn 1 of each session goes straight to an
    engine (the broker never sees it, only that engine's KV events can say where the session is),
    and every later turn through the broker lands on that engine as a cache hit."""
    for mod in ("tokenizers", "jinja2", "mistral_common"):
        pytest.importorskip(mod)
    from mesh.lab.tokenizer_builtin import build_model_dir
    from mesh.client import Client
    from tests.tokenizer_support import kv_batches_at_least

    model_dir = build_model_dir(tmp_path / "qwen-tools", chat_template=TOOLS_TEMPLATE.read_text(),
                                extra_special_tokens=["<|im_start|>", "<|im_end|>"], tokenizer="tekken")
    b = procs.broker("b", "--http", "127.0.0.1:0", "--policy", "cache_aware_greedy", "--tokenizer", str(model_dir))
    url = wait_for_log_event(b.log_path, "http_listening", 30, b.popen, start=b.log_start)["url"]
    stubs = [procs.spawn(f"stub{i}", ["stub-sglang", "--port", "0", "--time-scale", "0.001", "--tokenizer", str(model_dir)])
             for i in range(2)]
    engines = [wait_for_log_event(p.log_path, "sglang_stub_listening", 30, p.popen, start=p.log_start)["url"] for p in stubs]
    for i, e in enumerate(engines):
        procs.spawn(f"a{i}", ["attach", "sglang", "--url", e, "--broker", b.backend, "--worker-id", f"a{i}"])
    run(wait_for_workers(b.frontend, 2), 40)

    async def published() -> int:
        async with aiohttp.ClientSession() as s:
            total = 0
            for e in engines:
                async with s.get(e + "/debug/stats") as r:
                    total += sum(rk["next_seq"] or 0 for rk in (await r.json())["ranks"])
            return total

    async def body():
        async with Client(b.frontend) as c:
            async def kv_at_broker() -> None:
                want = await published()
                await until(lambda: kv_batches_at_least(c, want), 10, "the engines' KV events at the broker", step_s=0.02)

            hits0 = (await c.status()).counters.get("decisions.cache_hit", 0)
            results = await agent_loop([url], first_urls=[engines[k % 2] for k in range(4)], after_first=kv_at_broker)
            return results, (await c.status()).counters.get("decisions.cache_hit", 0) - hits0

    results, hits = run(body(), 120)
    print("agent turns with the model's template (worker, cached tokens):", results, "cache-hit decisions", hits)
    for k, turns in enumerate(results):
        assert {w for w, _ in turns[1:]} == {f"a{k % 2}"}, (k, turns)  # where turn 1 was: found by its KV events
        assert all(cached > 0 for _, cached in turns[1:]), turns
    assert hits >= 4 * 5


def test_a_hostile_client_cannot_slip_a_passthrough_past_the_broker(fleet):
    """Over ZeroMQ, a SUBMIT whose ``passthrough`` names a path off the allow-list, a body too big or
    of the wrong type, is refused at the broker's decode boundary (counted), a flood of them too,
    and the broker keeps serving pass-through requests."""
    from tests.abuse_peers import raw_dealer, status

    bad = [{"path": "/v1/files", "body": b"{}"}, {"path": "/health", "method": "GET", "body": b""}, {"path": "/v1/embeddings", "body": "{}"},
           {"path": "/v1/embeddings", "body": b"x" * (P.MAX_PASSTHROUGH_BODY_BYTES + 1)}, "/v1/embeddings", [1, 2]]

    async def body():
        before = (await status(fleet["frontend"])).counters
        s = raw_dealer(fleet["frontend"])
        try:
            for i in range(200):  # a flood of them
                await s.send_multipart(P.encode_submit(f"r{i}", text="x", passthrough=bad[i % len(bad)]))
            codes = []
            for _ in range(200):
                m = P.decode_client_reply(await asyncio.wait_for(s.recv_multipart(), 10))
                codes.append(getattr(m, "code", type(m).__name__))
        finally:
            s.close()
        after = (await status(fleet["frontend"])).counters
        async with _client(fleet["broker"]) as c:  # and it still serves
            e = await c.embeddings.create(model=MODEL, input="still here")
        return codes, before, after, e

    codes, before, after, e = run(body(), 60)
    assert set(codes) == {"bad_request"}, Counter(codes)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    assert sum(v for k, v in grew.items() if "bad_field" in k) >= 200, grew
    assert len(e.data[0].embedding) == 16
