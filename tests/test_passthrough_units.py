"""Pass-through in process: the SUBMIT ``passthrough`` field at the decode boundary (old peers,
hostile values), the routing key core (:mod:`mesh.openai_passthrough`), and the adapters' relay
(:mod:`mesh.adapters.passthrough`) against a fake engine, for the SGLang and the vLLM backend."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from contextlib import asynccontextmanager

import orjson
import pytest

from mesh import openai_passthrough as OP
from mesh import protocol as P
from mesh.adapters.backend import EngineInfo
from mesh.adapters.proxy import RequestProxy
from mesh.adapters.settings import AttachSettings
from mesh.adapters.sglang import SglangBackend
from mesh.adapters.vllm import VllmBackend
from mesh.errors import ProtocolError
from mesh.logs import get_logger
from tests.conftest import run

PT = {"path": "/v1/chat/completions", "method": "POST", "body": b'{"model": "m", "messages": [], "tools": []}'}


def _submit_frames(**kw) -> list[bytes]:
    return P.encode_submit("r1", text="user: hi\nassistant:", **kw)


# ---------------------------------------------------------------------------- protocol


def test_passthrough_rides_the_submit_and_the_request_and_old_peers_keep_working():
    sub = P.decode_client(_submit_frames(passthrough=PT))
    assert isinstance(sub, P.Submit) and sub.passthrough == PT
    req = P.decode_broker_to_worker(P.encode_request(7, 1, 1000, "r1", sub.raw))
    assert isinstance(req, P.Request) and req.submit.passthrough == PT
    old = P.decode_client(_submit_frames())
    assert isinstance(old, P.Submit) and old.passthrough is None


@pytest.mark.parametrize("bad", [
    "a string", 5, [], {"path": "/v1/files", "body": b"{}"}, {"path": "/generate", "body": b"{}"},
    {"path": "/v1/embeddings", "method": "GET", "body": b"{}"}, {"path": "/v1/embeddings", "body": "{}"},
    {"path": "/v1/embeddings"}, {"path": 5, "body": b""}, {"path": "/v1/embeddings", "body": b"x" * (P.MAX_PASSTHROUGH_BODY_BYTES + 1)},
])
def test_hostile_passthrough_fields_are_refused_by_name_and_never_raise(bad):
    for m in (P.decode_client(_submit_frames(passthrough=bad)), P.submit_of_body(P.submit_body("r", text="x", passthrough=bad), b"")):
        assert isinstance(m, ProtocolError) and m.reason == "bad_field" and "passthrough" in str(m), m


def test_passthrough_reply_reads_only_well_formed_pieces():
    ok = P.passthrough_reply({"token_ids": [], "raw": b"{}", "status": 400, "content_type": "application/json"})
    assert ok == P.PassthroughReply(400, "application/json", b"{}")
    assert P.passthrough_reply({"raw": b"data: x\n\n"}) == P.PassthroughReply(None, None, b"data: x\n\n")
    for bad in (None, [], {}, {"token_ids": [1]}, {"raw": "text"}, {"raw": b"", "status": 99}, {"raw": b"", "status": True},
                {"raw": b"", "status": "200"}, {"raw": b"", "content_type": "a\r\nb: c"}, {"raw": b"", "content_type": "x" * 300},
                {"raw": b"", "content_type": 5}):
        assert P.passthrough_reply(bad) is None, bad


# ---------------------------------------------------------------------------- routing key core


def test_what_passes_through():
    assert OP.passthrough_reason({"tools": [{}]}, chat=True) == "tools"
    assert OP.passthrough_reason({"reasoning_effort": "low"}, chat=True) == "reasoning_effort"
    assert OP.passthrough_reason({"n": 2}, chat=False) == "n"
    assert OP.passthrough_reason({"n": 1, "logprobs": True}, chat=True) is None
    assert OP.passthrough_reason({"n": True}, chat=True) is None  # a bool is no count: mesh's own 400
    assert OP.passthrough_reason({"messages": [{"role": "tool", "content": "x"}]}, chat=True) == "messages"
    assert OP.passthrough_reason({"messages": [{"role": "user", "content": "x"}]}, chat=True) is None


def test_an_agents_next_turn_extends_the_routing_key_of_the_last():
    tools = OP.template_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})
    assert tools == [{"name": "f", "parameters": {}}]
    assert OP.template_tools({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}) is None
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "where is 1?"}]
    keys = []
    for t in range(4):
        keys.append(OP.render_chat_text(OP.template_messages(msgs), tools))
        msgs = msgs + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{t}", "type": "function", "function": {"name": "f", "arguments": json.dumps({"q": t})}}]},
            {"role": "tool", "tool_call_id": f"c{t}", "content": "ok"}]
    assert all(b.startswith(a) for a, b in zip(keys, keys[1:])), keys
    assert '"arguments": {"q": 0}' in keys[1]  # parsed, as the engines give it to the template


@pytest.mark.parametrize("body,field", [
    ({"messages": "hi"}, "messages"), ({"messages": [5]}, "messages[0]"), ({"messages": [{"role": 5}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}] * 10_001}, "messages"),
])
def test_malformed_chats_are_refused_by_name(body, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        OP.render_chat_text(body["messages"], None)


def test_routing_text_of_each_endpoint():
    assert OP.routing_text("/v1/embeddings", {"input": ["a", "b"]}) == "a\nb"
    assert OP.routing_text("/v1/responses", {"instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}) == "be brief\nhi"
    assert OP.routing_text("/v1/rerank", {"query": "q", "documents": ["d1", "d2"]}) == "q\nd1\nd2"
    assert OP.routing_text("/v1/score", {"text_1": "a", "text_2": ["b"]}) == "a\nb"
    assert OP.routing_text("/v1/embeddings", {"input": [[1, 2, 3]]}) == "[1, 2, 3]"
    for bad in ({"input": {"a": 1}}, {"input": 5}, {}, {"input": ""}, {"input": [1.5]}):
        with pytest.raises(ValueError, match="input"):
            OP.routing_text("/v1/embeddings", bad)
    for kw in ({"messages": []}, {"tools": 1}, {"add_generation_prompt": False}, {str(i): i for i in range(40)}):
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            OP.template_kwargs({"chat_template_kwargs": kw})


# ---------------------------------------------------------------------------- adapter relay


class FakeEngine:
    """Answers every POST with ``status``, ``ctype`` and ``pieces``; records what it was sent."""

    def __init__(self, status: int, ctype: str, pieces: list[bytes]) -> None:
        self.status, self.ctype, self.pieces = status, ctype, pieces
        self.sent: list[tuple[str, bytes, dict | None]] = []

    @asynccontextmanager
    async def stream_with_type(self, method, path, body=b"", headers=None):
        self.sent.append((path, body, headers))

        async def chunks():
            for p in self.pieces:
                await asyncio.sleep(0)
                yield p
        yield self.status, self.ctype, chunks()


class Link:
    def __init__(self) -> None:
        self.frames: list[list[bytes]] = []

    def send(self, frames: list[bytes]) -> bool:
        self.frames.append(frames)
        return True

    def replies(self):
        return [P.decode_worker(f) for f in self.frames]


def _request(body: bytes, *, model: str | None = "stub", path: str = "/v1/chat/completions", stream: bool = True) -> P.Request:
    raw = P.pack(P.submit_body("r", text="user: hi\nassistant:", model=model, stream=stream,
                               passthrough={"path": path, "method": "POST", "body": body}))
    req = P.decode_broker_to_worker(P.encode_request(3, 1, 5000, "r", raw, dp_rank=1))
    assert isinstance(req, P.Request)
    return req


def _proxy(backend_cls, engine: FakeEngine) -> tuple[RequestProxy, Counter]:
    s = AttachSettings(url="http://127.0.0.1:1", brokers=("tcp://127.0.0.1:2",), kv_endpoint="tcp://127.0.0.1:3",
                       block_size=16)
    info = EngineInfo(model="stub", block_size=16, dp_size=2, loras=["ad1"])
    counters: Counter = Counter()
    return RequestProxy(backend_cls(s), engine, info, url=s.url, base_url=s.url, worker_id="w", counters=counters,  # type: ignore[arg-type]
                        log=get_logger(service="test"), on_unavailable=lambda: None), counters


SSE = [b'data: {"choices": [{"delta": {"content": "a"}}], "usage": null}\n\n', b'data: {"choices": [], "us',
       b'age": {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}}\n\ndata: [DONE]\n\n']


@pytest.mark.parametrize("backend_cls", [SglangBackend, VllmBackend])
def test_adapters_relay_an_sse_answer_byte_for_byte_with_its_usage(backend_cls):
    engine = FakeEngine(200, "text/event-stream; charset=utf-8", SSE)
    proxy, counters = _proxy(backend_cls, engine)
    link = Link()
    body = b'{"model": "stub", "tools": [{"type": "function"}],  "stream": true}'
    run(proxy.serve(link, _request(body)), 10)
    path, sent, headers = engine.sent[0]
    assert (path, sent) == ("/v1/chat/completions", body)  # unchanged, spaces and all
    assert headers == {"X-Data-Parallel-Rank": "1"}
    got = link.replies()
    assert [type(m) for m in got] == [P.WorkerChunk] * 3 + [P.WorkerFinal]
    pieces = [P.passthrough_reply(P.unpack(m.data)) for m in got]
    assert pieces[0].status == 200 and pieces[0].content_type == "text/event-stream; charset=utf-8"
    assert all(p.status is None for p in pieces[1:])
    assert b"".join(p.raw for p in pieces) == b"".join(SSE)
    assert got[-1].usage == {"prompt_tokens": 9, "completion_tokens": 2, "cached_tokens": 4}
    assert counters["passthrough_requests"] == 1


def test_an_engine_refusal_is_one_final_with_its_status_and_body_and_a_foreign_model_is_renamed():
    refusal = b'{"error": {"message": "tool_choice names a function that is not in tools", "code": 400}}'
    engine = FakeEngine(400, "application/json", [refusal[:10], refusal[10:]])
    proxy, counters = _proxy(SglangBackend, engine)
    link = Link()
    run(proxy.serve(link, _request(b'{"model": "mesh", "input": "x"}', model="mesh", path="/v1/embeddings")), 10)
    assert orjson.loads(engine.sent[0][1]) == {"model": "stub", "input": "x"}  # the fleet's name -> the engine's model
    (fin,) = link.replies()
    assert isinstance(fin, P.WorkerFinal) and fin.finish_reason == "http_400"
    assert P.passthrough_reply(P.unpack(fin.data)) == P.PassthroughReply(400, "application/json", refusal)
    assert counters["passthrough_engine_refused"] == 1
    for model in ("stub", "ad1", "stub:ad1", None):  # the engine's own names: the body is not touched
        engine.sent.clear()
        run(proxy.serve(Link(), _request(b'{"model":  "x"}', model=model)), 10)
        assert engine.sent[0][1] == b'{"model":  "x"}'


def test_a_large_answer_goes_in_bounded_pieces():
    big = b"[" + b"1," * (P.MAX_PASSTHROUGH_PIECE_BYTES) + b"1]"
    engine = FakeEngine(200, "application/json", [big[i:i + 65536] for i in range(0, len(big), 65536)])
    proxy, _ = _proxy(SglangBackend, engine)
    link = Link()
    run(proxy.serve(link, _request(b"{}", stream=False)), 10)
    got = link.replies()
    assert all(len(P.unpack(m.data)["raw"]) <= P.MAX_PASSTHROUGH_PIECE_BYTES for m in got)
    assert b"".join(P.unpack(m.data)["raw"] for m in got) == big and isinstance(got[-1], P.WorkerFinal)


def test_a_prefill_leg_refuses_a_passthrough_request_by_name():
    engine = FakeEngine(200, "application/json", [b"{}"])
    proxy, _ = _proxy(SglangBackend, engine)
    req = _request(b"{}")
    req.bootstrap = {"mode": "prefill", "room": 1}
    link = Link()
    run(proxy.serve(link, req), 10)
    (err,) = link.replies()
    assert isinstance(err, P.WorkerError) and err.code == "bad_request" and "prefill/decode" in err.message
    assert not engine.sent
