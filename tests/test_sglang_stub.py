"""``mesh stub-sglang`` as a real process: SGLang's HTTP API and ZMQ wire formats (§1-§4, §9-§11)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math

import aiohttp
import pytest
import zmq
import zmq.asyncio

from mesh import kv_events as KV
from mesh import protocol as P
from mesh.load import LoadStat
from mesh.sockets import SocketSpec, make_socket
from tests.conftest import run
from tests.adapters_support import start_stub

SUB = SocketSpec(zmq.SUB, sndhwm=1000, rcvhwm=10_000, linger_ms=0)
DEALER = SocketSpec(zmq.DEALER, sndhwm=100, rcvhwm=10_000, linger_ms=0)


async def _sse(resp: aiohttp.ClientResponse) -> list[str]:
    body = (await resp.read()).decode()
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    return [ev[len("data: "):] for ev in body.split("\n\n") if ev][:-1]  # without the [DONE]


async def _recv(sock, timeout_s: float = 5.0) -> list[bytes]:
    return await asyncio.wait_for(sock.recv_multipart(), timeout_s)


async def _replay(ctx, endpoint: str, start: int) -> list[list[bytes]]:
    d = make_socket(ctx, DEALER, connect=endpoint)
    try:
        await d.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            f = await _recv(d)
            out.append(f)
            if b"\xff" * 8 in f:
                return out
    finally:
        d.close(linger=0)


def test_http_api_and_default_zmq_wire(procs):
    _, rec = start_stub(procs, "stub", "--dp-size", "2", "--time-scale", "0.05", "--topic", "kv@t")

    async def go():
        url = rec["url"]
        ctx = zmq.asyncio.Context.instance()
        subs = [make_socket(ctx, SUB, connect=f"tcp://127.0.0.1:{rec['kv_port_base'] + r}") for r in range(2)]
        load_sub = make_socket(ctx, SUB, connect=rec["load_endpoint"])
        for s in subs:
            s.setsockopt(zmq.SUBSCRIBE, b"kv@")
        load_sub.setsockopt(zmq.SUBSCRIBE, b"load")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(url + "/server_info") as r:
                info = await r.json()
            kv = info["kv_events"]
            assert kv == {"publisher": "zmq", "endpoint_host": "127.0.0.1", "endpoint_port_base": rec["kv_port_base"], "topic": "kv@t",
                          "block_size": 16, "dp_size": 2, "load_endpoint_port_base": rec["load_port_base"], "load_topic": "load",
                          "replay_endpoint_port_base": rec["replay_port_base"]}
            assert info["page_size"] == 16 and info["dp_size"] == 2 and info["max_total_num_tokens"] == 400_000
            for path in ("/health", "/ready", "/health_generate"):
                async with http.get(url + path) as r:
                    assert r.status == 200
            async with http.get(url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "stub-sglang-8b"

            prompt = list(range(1, 70))
            async with http.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 5},
                                                          "rid": "r1", "routed_dp_rank": 1}) as r:
                out = await r.json()
            assert out["meta_info"]["id"] == "r1" and out["meta_info"]["dp_rank"] == 1 and len(out["output_ids"]) == 5
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
            assert (out["meta_info"]["prompt_tokens"], out["meta_info"]["completion_tokens"]) == (69, 5)

            # streaming: cumulative chunks, finish on the last, then [DONE]; the prefix is now cached
            async with http.post(url + "/generate", json={"input_ids": prompt + [7], "sampling_params": {"max_new_tokens": 6},
                                                          "stream": True, "routed_dp_rank": 1}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                chunks = [json.loads(x) for x in await _sse(r)]
            ids = [c["output_ids"] for c in chunks]
            assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:])) and len(ids[-1]) == 6
            assert [c["meta_info"]["finish_reason"] for c in chunks][-1]["type"] == "length"
            assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
            assert chunks[-1]["text"].startswith(chunks[0]["text"]) and chunks[-1]["meta_info"]["cached_tokens"] == 64

            async with http.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_token": 1}}) as r:
                assert r.status == 400 and "max_new_token" in (await r.json())["error"]["message"]

            async with http.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "stream": True,
                                                                "return_token_ids": True, "stream_options": {"include_usage": True}}) as r:
                cs = [json.loads(x) for x in await _sse(r)]
            assert sum(len(c["choices"][0]["token_ids"]) for c in cs if c["choices"]) == 4
            assert cs[-1]["choices"] == [] and cs[-1]["usage"]["completion_tokens"] == 4
            async with http.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                     "max_tokens": 3, "stream": True}) as r:
                cc = [json.loads(x) for x in await _sse(r)]
            assert cc[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and cc[-1]["choices"][0]["finish_reason"] == "length"
            async with http.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}) as r:
                assert (await r.json())["object"] == "chat.completion"

            async with http.get(url + "/v1/loads") as r:
                loads = (await r.json())["loads"]
            assert [x["dp_rank"] for x in loads] == [0, 1] and loads[1]["num_used_tokens"] > 0
            async with http.get(url + "/get_load") as r:
                assert r.status == 404  # removed in 0.5.21, as the stub's default emulates 0.5.23
            async with http.get(url + "/metrics") as r:
                metrics = await r.text()
            assert 'sglang:num_running_reqs{model_name="stub-sglang-8b"' in metrics and 'dp_rank="1"' in metrics

            # live KV stream of rank 1: [topic, seq8, msgpack [ts, events, 1]] with map events
            f = await _recv(subs[1])
            assert len(f) == 3 and f[0] == b"kv@t" and len(f[1]) == 8
            batch = P.unpack(f[2])
            assert batch[2] == 1 and isinstance(batch[1][0], dict) and batch[1][0]["type"] == "BlockStored"
            async with http.post(url + "/flush_cache") as r:
                assert r.status == 200
            seen_clear = False
            for _ in range(20):
                f = await _recv(subs[0])
                if P.unpack(f[2])[1] == [{"type": "AllBlocksCleared"}]:
                    seen_clear = True
                    break
            assert seen_clear

            # replay (>= 0.5.22 shape): [b"", topic, seq8, payload] ..., then [b"", b"", ff*8, b""]
            rep = await _replay(ctx, f"tcp://127.0.0.1:{rec['replay_port_base'] + 1}", 0)
            assert rep[-1] == [b"", b"", b"\xff" * 8, b""]
            assert all(len(m) == 4 and m[1] == b"kv@t" for m in rep[:-1])
            seqs = [int.from_bytes(m[2], "big") for m in rep[:-1]]
            assert seqs == list(range(len(seqs))) and len(seqs) >= 3
            assert KV.decode_batch(rep[0][3]).events == (KV.AllBlocksCleared(),)  # the startup reset

            lf = await _recv(load_sub)
            assert lf[0] == b"load" and len(lf[1]) == 8
            ls = LoadStat.from_wire(P.unpack(lf[2]))
            assert ls.extended and ls.max_total_num_tokens == 400_000 and len(P.unpack(lf[2])) == 11
        for s in [*subs, load_sub]:
            s.close(linger=0)

    run(go(), 40)


def test_legacy_array_format_three_frame_replay_and_get_load(procs):
    _, rec = start_stub(procs, "stub-old", "--event-format", "array", "--replay-frames", "3", "--http-load-api", "get_load",
                        "--time-scale", "0.05", "--fail-health", "--load-port", "-1")

    async def go():
        url = rec["url"]
        assert rec["load_endpoint"] is None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            for path in ("/health", "/ready"):
                async with http.get(url + path) as r:
                    assert r.status == 503  # --fail-health
            async with http.post(url + "/generate", json={"text": "x" * 40, "sampling_params": {"max_new_tokens": 2}}) as r:
                assert r.status == 200
            async with http.get(url + "/get_load") as r:
                gl = await r.json()
            assert gl[0]["dp_rank"] == 0 and "num_pending_tokens" in gl[0]
            async with http.get(url + "/server_info") as r:
                assert "load_endpoint_port_base" not in (await r.json())["kv_events"]
            async with http.post(url + "/debug/health", json={"ok": True}) as r:
                assert (await r.json())["healthy"] is True
            async with http.get(url + "/health") as r:
                assert r.status == 200
        rep = await _replay(zmq.asyncio.Context.instance(), rec["replay_endpoint"], 0)
        assert rep[-1] == [b"", b"\xff" * 8, b""] and all(len(m) == 3 for m in rep)
        events = [e for m in rep[:-1] for e in P.unpack(m[2])[1]]
        assert events[0] == ["AllBlocksCleared"] and events[1][0] == "BlockStored" and len(events[1]) == 8

    run(go(), 40)


_BARE_ROUTES = pytest.mark.filterwarnings("ignore:Bare functions are deprecated")  # the stub's lambda routes, in-process


def _stub_in_process(**kw):
    from workers_stub.sglang_server import SglangStub, StubSettings

    return SglangStub(StubSettings(port=0, kv_port=None, load_port=None, time_scale=0.001, **kw))


@contextlib.asynccontextmanager
async def _stub_http(**kw):
    """An in-process stub and an HTTP session to it: yields (url, session); stops the stub."""
    stub = _stub_in_process(**kw)
    url = (await stub.start())["url"]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            yield url, http
    finally:
        await stub.stop()


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 3}, "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1},
    "pet": {"$ref": "#/$defs/Pet"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    "required": ["name", "age", "pet"], "$defs": {"Pet": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}}}


def _check_logprobs(out: dict, top_n: int) -> None:
    """SGLang's shapes, consistent with the answer: one [logprob, id, text] per output id, the
    texts spell the answer, the chosen token leads its (sorted) top list."""
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [e[1] for e in lps] == out["output_ids"] and "".join(e[2] for e in lps) == out["text"]
    assert all(type(e[0]) is float and e[0] < 0 for e in lps)
    if not top_n:
        assert "output_top_logprobs" not in meta
        return
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(lps)
    for chosen, top in zip(lps, tops):
        assert len(top) == top_n and top[0] == chosen and [e[0] for e in top] == sorted((e[0] for e in top), reverse=True)
        assert len({e[2] for e in top}) == top_n and sum(math.exp(e[0]) for e in top) < 1


@_BARE_ROUTES
def test_json_schema_output_conforms_and_logprobs_match_the_tokens():
    jsonschema = pytest.importorskip("jsonschema")

    async def go():
        async with _stub_http() as (url, http):
            async def gen(body: dict) -> tuple[int, dict]:
                async with http.post(url + "/generate", json=body) as r:
                    return r.status, await r.json()

            for i in range(3):  # different prompts, different (conforming) answers
                st, out = await gen({"text": f"person {i}", "sampling_params": {"max_new_tokens": 400, "json_schema": json.dumps(SCHEMA)},
                                     "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True})
                assert st == 200, out
                jsonschema.validate(json.loads(out["text"]), SCHEMA)
                assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}  # complete: EOS, not length
                assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])
                _check_logprobs(out, 3)
            st, out = await gen({"text": "x", "sampling_params": {"max_new_tokens": 3, "json_schema": '{"type": "object"}'}})
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3} and len(out["output_ids"]) == 3
            for bad in ("{nope", "[1]", json.dumps({"type": "frobnicate"}), json.dumps({"$ref": "#/$defs/Missing"})):
                st, out = await gen({"text": "x", "sampling_params": {"json_schema": bad}})
                assert st == 400 and out["error"]["message"].startswith("json_schema"), out
            # plain logprobs: no text unless asked; input logprobs from logprob_start_len, the first without a value
            st, out = await gen({"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True,
                                 "logprob_start_len": 1, "top_logprobs_num": 2})
            meta = out["meta_info"]
            assert [e[2] for e in meta["output_token_logprobs"]] == [None] * 4
            assert [e[1] for e in meta["input_token_logprobs"]] == [6, 7, 8] and len(meta["input_top_logprobs"]) == 3
            st, out = await gen({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                                 "logprob_start_len": 0, "return_text_in_logprobs": True})
            assert out["meta_info"]["input_token_logprobs"][0][0] is None and "input_top_logprobs" not in out["meta_info"]
            _check_logprobs(out, 0)
            st, out = await gen({"text": "x", "return_logprob": True, "top_logprobs_num": -1})
            assert st == 400 and "top_logprobs_num" in out["error"]["message"]

    run(go())


@_BARE_ROUTES
def test_streamed_logprobs_are_cumulative_unless_incremental():
    async def go():
        for incremental in (False, True):
            stub = _stub_in_process(incremental_streaming_output=incremental)
            url = (await stub.start())["url"]
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                    async with http.post(url + "/generate", json={
                            "input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 6}, "return_logprob": True,
                            "top_logprobs_num": 2, "return_text_in_logprobs": True, "logprob_start_len": 0}) as r:
                        events = [json.loads(e) for e in await _sse(r)]
                ids, lps, tops, inputs = [], [], [], []
                for ev in events:
                    m = ev["meta_info"]
                    if incremental:
                        ids += ev["output_ids"]
                        lps += m["output_token_logprobs"]
                        tops += m["output_top_logprobs"]
                        inputs += m.get("input_token_logprobs", [])
                    else:
                        ids, lps, tops, inputs = ev["output_ids"], m["output_token_logprobs"], m["output_top_logprobs"], m["input_token_logprobs"]
                        assert len(lps) == len(ids)
                assert len(ids) == 6 and [e[1] for e in lps] == ids and [t[0] for t in tops] == lps
                assert [e[1] for e in inputs] == [1, 2, 3]  # incremental: in the first event only
            finally:
                await stub.stop()

    run(go())


@_BARE_ROUTES
def test_the_stubs_openai_endpoints_honour_response_format_and_logprobs():
    jsonschema = pytest.importorskip("jsonschema")

    async def go():
        async with _stub_http() as (url, http):
            rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
            async with http.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "who?"}]}], "max_tokens": 400,
                    "response_format": rf, "logprobs": True, "top_logprobs": 2}) as r:
                out = await r.json()
            ch = out["choices"][0]
            jsonschema.validate(json.loads(ch["message"]["content"]), SCHEMA)
            assert ch["finish_reason"] == "stop"
            assert "".join(t["token"] for t in ch["logprobs"]["content"]) == ch["message"]["content"]
            assert all(t["top_logprobs"][0]["token"] == t["token"] for t in ch["logprobs"]["content"])
            async with http.post(url + "/v1/completions", json={"prompt": "p", "max_tokens": 50, "stream": True, "logprobs": 1,
                                                                "response_format": {"type": "json_object"}}) as r:
                chunks = [json.loads(e) for e in await _sse(r)]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            assert isinstance(json.loads(text), dict)
            toks = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
            offs = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
            assert "".join(toks) == text and offs == [len("".join(toks[:i])) for i in range(len(toks))]

    run(go())
