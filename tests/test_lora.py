"""LoRA placement (issue 30, build step 5).

Unit: the ``base:adapter`` syntax and the adapter a request names (:mod:`mesh.routing.lora`); the
engines' ``/v1/models`` answers with adapters (recorded from their code, ``tests/data``); the
``loras`` wire fields (READY, HEARTBEAT; old peers without them); what the adapters send each
engine; placement in the broker core (holders preferred, a forced miss counted, a runtime change
followed, an adapter nobody holds is a 404 by its own name and routed by ``base:adapter``).

End to end: real broker (with HTTP), ``mesh attach sglang`` / ``attach vllm`` processes and
stub engines holding different adapters: requests land on the engines that hold their adapter, in
each engine's own form; ``/v1/models`` lists the adapters; an adapter loaded at run time is
followed; a request sent to an engine without its adapter is counted.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import aiohttp
import pytest

from mesh import protocol as P
from mesh.adapters.backend import EngineInfo, engine_lora, models_and_loras
from mesh.adapters.sglang import generate_body
from mesh.adapters.vllm import completions_body
from mesh.broker_core import BrokerCore
from mesh.broker_core.sends import TO_WORKER
from mesh.client import Client
from mesh.config import BrokerSettings, build
from mesh.errors import ErrorCode, ProtocolError, RequestError
from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers
from mesh.routing.lora import holders_only, request_lora, split_model
from mesh.routing.router import Router, make_policy
from mesh.routing.view import WorkerState
from tests.adapters_support import start_adapters, start_stubs
from tests.conftest import run, until
from tests.core_support import outcomes

DATA = Path(__file__).parent / "data"


# ----------------------------------------------------------------------------- names


def test_split_model_follows_sglangs_base_adapter_syntax():
    served = ["base", "s3://bucket/model", "llama3:8b"]
    assert split_model("base:sql", served) == ("base", "sql")
    assert split_model("base", served) == ("base", None)
    assert split_model("base:", served) == ("base", None)
    assert split_model("s3://bucket/model:sql", served) == ("s3://bucket/model", "sql")  # the served name first
    assert split_model("llama3:8b", served) == ("llama3:8b", None)  # a served name is never split
    assert split_model("llama3:8b:sql", served) == ("llama3:8b", "sql")  # the longest served base
    assert split_model("other:sql", served) == ("other", "sql")  # else the first ':' (as SGLang)
    assert split_model("sql", served) == ("sql", None)


def test_the_models_adapter_wins_over_lora_path():
    assert request_lora({"lora_path": "a"}, "b") == "b"
    assert request_lora({"lora_path": "a"}, None) == "a"
    assert request_lora({"lora_path": ""}, None) is None and request_lora(None, None) is None
    assert request_lora({"lora_path": 3}, None) is None


def test_holders_only_prefers_holders_while_one_can_take_the_request():
    pool = [WorkerState("a", loras=frozenset({"sql"})), WorkerState("b"), WorkerState("c", loras=frozenset({"sql", "x"}))]
    assert holders_only(pool, "sql", set()) == {"b"}
    assert holders_only(pool, "sql", {"a"}) == {"a", "b"}
    assert holders_only(pool, "sql", {"a", "c"}) is None  # every holder tried or full: the whole pool
    assert holders_only(pool, "nobody", set()) is None
    pd = [WorkerState("p1", role="prefill", loras=frozenset({"sql"})), WorkerState("p2", role="prefill"),
          WorkerState("d1", role="decode")]
    assert holders_only(pd, "sql", set()) == {"p2"}  # the decode workers stay: none of them holds it


# ----------------------------------------------------------------------------- engines


def test_models_and_loras_reads_both_engines_lists():
    doc = json.loads((DATA / "lora_v1_models.json").read_text())
    assert models_and_loras(doc["sglang"]) == ("meta-llama/Llama-3.1-8B-Instruct", ["chat-lora", "sql-lora"])
    assert models_and_loras(doc["vllm"]) == ("Qwen/Qwen3-8B", ["sql-lora"])
    assert models_and_loras(doc["vllm_lora_first"]) == ("Qwen/Qwen3-8B", ["sql-lora"])  # not data[0]
    assert models_and_loras({"data": [{"id": "m"}]}) == ("m", [])  # no --enable-lora
    assert models_and_loras({"data": [None, {"id": 3}, {"id": "x", "parent": ""}]}) == ("x", [])
    assert models_and_loras("garbage") == (None, [])


def _request(model: str | None = None, **params) -> P.Request:
    sub = P.decode_client(P.encode_submit("c", input_ids=[1, 2, 3], model=model, params=params or None))
    return P.Request(1, 1, 1000, "c", None, sub)


def test_each_engine_gets_the_adapter_in_its_own_form():
    info = EngineInfo(model="base", block_size=16, dp_size=1, loras=["sql"])
    cases = {("base:sql", None): "sql", ("sql", None): "sql", ("base", None): None, (None, "sql"): "sql",
             ("base:new", None): "new",  # this engine's model: an adapter it may load on demand
             ("alias:sql", None): "sql",  # an alias of the base (the broker resolved it), a held adapter
             ("llama3:8b", None): None,  # a broker alias with a colon, no adapter of ours: the base
             ("base:sql", "other"): "sql"}
    for (model, lp), want in cases.items():
        r = _request(model, **({"lora_path": lp} if lp else {}))
        assert engine_lora(r, info) == want, (model, lp)
        sg = generate_body(r, info)
        assert sg.get("lora_path") == want, (model, lp, sg)  # SGLang: lora_path = the adapter's name
        assert completions_body(r, info)["model"] == (want or "base"), (model, lp)  # vLLM: model = the adapter
    # the broker's resolution (REQUEST lora) wins: an adapter name this engine does not hold yet
    r = P.decode_broker_to_worker(P.encode_request(1, 1, 1000, "c", _request("sql2").submit.raw, lora="sql2"))
    assert r.lora == "sql2" and engine_lora(r, info) == "sql2" and generate_body(r, info)["lora_path"] == "sql2"
    assert P.decode_broker_to_worker(P.encode_request(1, 1, 1000, "c", r.submit.raw)).lora is None


# ----------------------------------------------------------------------------- wire


def _ready(wid: str, loras: list[str] | None, model: str = "base") -> P.Ready:
    return P.Ready(wid, model, "mixed", {}, 16, 256, 400_000, 1, 1, 500, loras)


def test_loras_travel_in_ready_and_heartbeat_and_old_peers_still_work():
    r = P.decode_worker(P.encode_ready(_ready("w", ["sql", "chat"])))
    assert isinstance(r, P.Ready) and r.loras == ["sql", "chat"]
    old = P.decode_worker(P.encode_ready(_ready("w", None)))
    assert isinstance(old, P.Ready) and old.loras is None  # an old worker: no field, nothing known
    assert P.decode_worker(P.encode_heartbeat(None, ["x"])).loras == ["x"]
    assert P.decode_worker(P.encode_heartbeat([], [])).loras == []
    assert P.decode_worker(P.encode_heartbeat()).loras is None
    for bad in ("sql", [1], [""], ["x" * 300], ["a"] * (P.MAX_LORAS + 1)):
        frames = [P.WORKER_HEADER, bytes([P.Cmd.HEARTBEAT]), P.pack({"loras": bad})]
        err = P.decode_worker(frames)
        assert isinstance(err, ProtocolError) and err.reason == "bad_field", bad
    # an old broker's decoder reads only the fields it knows (msgpack map: extra keys are ignored)
    body = P.unpack(P.encode_ready(_ready("w", ["sql"]))[2])
    assert body["loras"] == ["sql"] and body["worker_id"] == "w"


# ----------------------------------------------------------------------------- broker core


def _core(fleet: dict[str, tuple[str, list[str] | None]], **settings) -> BrokerCore:
    core = BrokerCore(build(BrokerSettings, {"policy": "round_robin", **settings}), Router(make_policy("round_robin"), None))
    core.start(0.0)
    for wid, (model, loras) in fleet.items():
        core.worker_frames([wid.encode(), *P.encode_ready(_ready(wid, loras, model))], 0.0)
        core.worker_frames([wid.encode(), *P.encode_heartbeat()], 0.0)
    core.take()
    return core


_RIDS = itertools.count()


def _send(core: BrokerCore, n: int, model: str | None, now: float = 1.0, **params) -> list[str]:
    """Submit ``n`` requests; the worker each was sent to (or the error code it got)."""
    out = []
    for i in range(n):
        core.client_frames([b"client", *P.encode_submit(f"r{next(_RIDS)}", input_ids=[i + 1] * 8, model=model,
                                                       params=params or None)], now)
        out += outcomes(core.take())
    return out


def test_requests_for_an_adapter_go_to_its_holders():
    core = _core({"a": ("base", ["sql"]), "b": ("base", ["sql", "chat"]), "c": ("base", []), "o": ("other", None)})
    assert set(_send(core, 6, "base:sql")) == {"a", "b"}
    assert set(_send(core, 4, "chat")) == {"b"}  # the adapter's own name: its base model, its holder
    assert set(_send(core, 4, "base", lora_path="chat")) == {"b"}
    assert set(_send(core, 6, "base")) == {"a", "b", "c"}  # the base model: every engine serving it
    assert core.stats.lora == {"sent_to_holder": 14}
    assert _send(core, 1, "nosuch") == [ErrorCode.MODEL_NOT_FOUND.value]  # an adapter nobody holds, by its name
    # base:adapter that no engine holds: the base model's engines (one may load it), counted
    assert set(_send(core, 3, "base:fresh")) <= {"a", "b", "c"}
    assert core.stats.lora["sent_without_adapter"] == 3
    st = {w["worker_id"]: w for w in core.status.workers(1.0)}
    assert st["b"]["loras"] == ["chat", "sql"] and st["o"]["loras"] == []
    assert core.status.lora_catalog() == {"sql": {"parent": "base", "workers": 2}, "chat": {"parent": "base", "workers": 1}}
    assert core.stats.flat()["lora.sent_without_adapter"] == 3
    # the REQUEST tells the worker the adapter the broker resolved (its engine may not hold it yet)
    core.client_frames([b"client", *P.encode_submit("last", input_ids=[1] * 8, model="chat")], 2.0)
    reqs = [P.decode_broker_to_worker(x.frames) for x in core.take() if x.to == TO_WORKER]
    assert [(q.lora, q.submit.model) for q in reqs] == [("chat", "chat")]


def test_a_runtime_change_is_followed_and_a_full_holder_is_a_counted_miss():
    core = _core({"a": ("base", ["sql"]), "b": ("base", [])}, max_inflight_per_worker=1)
    core.worker_frames([b"b", *P.encode_heartbeat([], ["chat"])], 1.0)  # b loaded chat at run time
    assert _send(core, 1, "chat", now=1.0) == ["b"]
    assert core.stats.workers["loras_changed"] == 1
    core.worker_frames([b"b", *P.encode_heartbeat([], ["chat"])], 1.0)  # the same list again: no change
    assert core.stats.workers["loras_changed"] == 1
    assert _send(core, 1, "base:sql", now=1.0) == ["a"]
    # a is at its in-flight cap, b is busy with chat: the next sql request waits for a slot ...
    assert _send(core, 1, "base:sql", now=1.0) == []
    core.worker_frames([b"b", *P.encode_worker_final(1, 1, "stop", {"completion_tokens": 1})], 1.1)  # b's slot frees
    sent = [s.identity.decode() for s in core.take() if s.to == TO_WORKER and
            isinstance(P.decode_broker_to_worker(s.frames), P.Request)]
    assert sent == ["b"]  # ... and goes to b, without the adapter: counted
    assert core.stats.lora == {"sent_to_holder": 2, "sent_without_adapter": 1}


def test_an_old_worker_without_the_field_serves_the_base_model():
    core = _core({"old": ("base", None)})
    assert _send(core, 2, "base") == ["old", "old"]
    assert _send(core, 1, "base:sql") == ["old"]  # routed as before, counted as a miss
    assert core.stats.lora == {"sent_without_adapter": 1}


def test_the_gateway_lists_the_adapters_its_brokers_report():
    from brokers.gateway import BrokerPool

    gw = BrokerPool(["tcp://127.0.0.1:1"])
    gw.pool = lambda: [{"worker_id": "a", "model": "base", "loras": ["sql"]}, {"worker_id": "b", "model": "base", "loras": ["sql", "x"]},
                       {"worker_id": "c", "model": "base"}, {"worker_id": "d", "model": "base", "loras": "bad"}]
    assert gw.lora_catalog() == {"sql": {"parent": "base", "workers": 2}, "x": {"parent": "base", "workers": 1}}


def test_an_adapter_is_tokenised_as_its_base_model_at_the_http_ingress():
    from brokers.ingress.tokenizers import Tokenizers

    class Fleet:
        def model_catalog(self):
            return {"base": 2, "other": 1}, {"fast": "base"}, "mesh"

        def lora_catalog(self):
            return {"sql": {"parent": "base", "workers": 1}}

        def announced_tokenizers(self):
            return {}

    reg = Tokenizers(Fleet())
    reg._texts = {"base": "T-base", "other": "T-other"}  # what --tokenizer base=DIR other=DIR loads
    got = [run(reg.for_model(m)) for m in ("base:sql", "sql", "fast:sql", "other", "nosuch")]
    assert got == ["T-base", "T-base", "T-base", "T-other", None]


# ----------------------------------------------------------------------------- end to end

FAST_ADAPTER = ("--heartbeat-ms", "200", "--health-interval-ms", "100", "--unhealthy-after", "1", "--load-poll-ms", "200",
                "--lora-refresh-ms", "200")
STUB = ("--time-scale", "0.05")


def test_lora_requests_land_on_the_engines_that_hold_the_adapter(procs):
    b = procs.broker("b", "--heartbeat-ms", "200", "--policy", "round_robin", "--http", "127.0.0.1:0")
    http_url = wait_for_log_event(b.log_path, "http_listening", 30, b.popen, start=b.log_start)["url"]
    stubs = start_stubs(procs, {"stub-a": (*STUB, "--lora-paths", "sql=/adapters/sql"),
                                "stub-b": (*STUB, "--enable-lora", "--lora-dynamic"),
                                "stub-v": (*STUB, "--event-format", "vllm", "--model", "stub-vllm-8b", "--lora-paths", "chat")})
    sa, sb, sv = (stubs[f"stub-{k}"] for k in "abv")
    start_adapters(procs, [("a", "sglang", sa["url"], [b.backend], FAST_ADAPTER),
                           ("b", "sglang", sb["url"], [b.backend], FAST_ADAPTER),
                           ("v", "vllm", sv["url"], [b.backend], (*FAST_ADAPTER, "--kv-endpoint", sv["kv_endpoint"],
                                                                  "--block-size", "16"))])
    run(wait_for_workers(b.frontend, 3))
    base = "stub-sglang-8b"

    async def go():
        async with Client(b.frontend) as c, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async def loras() -> dict[str, list[str]]:
                return {w["worker_id"]: w.get("loras") for w in (await c.status()).workers}

            async def stub_stats(stub: dict) -> dict:
                async with http.get(stub["url"] + "/debug/stats") as r:
                    return (await r.json())["lora_requests"]

            assert await loras() == {"a": ["sql"], "b": [], "v": ["chat"]}
            async with http.get(http_url + "/v1/models") as r:
                listed = {m["id"]: m.get("parent") for m in (await r.json())["data"]}
            assert listed["sql"] == base and listed["chat"] == "stub-vllm-8b" and listed[base] is None, listed

            # SGLang: base:adapter, the adapter's name, lora_path -> the holder, sent as lora_path
            for kw in [{"model": f"{base}:sql"}] * 4 + [{"model": "sql"}] * 2 + [{"model": base, "params": {"lora_path": "sql"}}] * 2:
                r = await c.generate(input_ids=[5] * 40, max_new_tokens=2, **kw)
                assert r.worker == "a", (kw, r.worker)
            assert await stub_stats(sa) == {"sql": 8}
            # vLLM: the adapter's name or base:adapter -> the holder, sent as model = the adapter
            for model in ("chat", "chat", "stub-vllm-8b:chat"):
                assert (await c.generate(input_ids=[6] * 40, max_new_tokens=2, model=model)).worker == "v"
            assert await stub_stats(sv) == {"chat": 3}
            async with http.get(sv["url"] + "/debug/requests") as r:
                assert [q["body"]["model"] for q in await r.json() if q["path"] == "/v1/completions"][-3:] == ["chat"] * 3
            assert (await c.status()).counters.get("lora.sent_to_holder") == 11

            # an adapter loaded at run time (vLLM's /v1/load_lora_adapter) is followed
            async with http.post(sv["url"] + "/v1/load_lora_adapter", json={"lora_name": "summ", "lora_path": "/a/summ"}) as r:
                assert r.status == 200
            await until(lambda: _has(loras, "v", "summ"), 15, "v announces summ", step_s=0.05)
            assert (await c.generate(input_ids=[7] * 40, max_new_tokens=2, model="summ")).worker == "v"

            # the only holder leaves: the request goes to an engine without the adapter (counted),
            # which loads it on demand and then announces it
            async with http.post(sa["url"] + "/debug/health", json={"ok": False}) as r:
                assert r.status == 200
            await until(lambda: _gone(c, "a"), 15, "a leaves", step_s=0.05)
            assert (await c.generate(input_ids=[8] * 40, max_new_tokens=2, model=f"{base}:sql")).worker == "b"
            assert (await c.status()).counters.get("lora.sent_without_adapter") == 1
            assert await stub_stats(sb) == {"sql": 1}
            await until(lambda: _has(loras, "b", "sql"), 15, "b announces sql", step_s=0.05)

            with pytest.raises(RequestError) as ei:
                await c.generate(input_ids=[9] * 16, max_new_tokens=1, model="nosuch-adapter")
            assert ei.value.code is ErrorCode.MODEL_NOT_FOUND

    run(go(), timeout_s=120)


async def _has(loras, wid: str, adapter: str) -> bool:
    return adapter in ((await loras()).get(wid) or [])


async def _gone(c: Client, wid: str) -> bool:
    return wid not in {w["worker_id"] for w in (await c.status()).workers}
