"""Cache namespaces (LoRA adapter, cache_salt, extra_key): blocks stored under one namespace never
match a request of another, and do match a request of the same one -- in the local index, the
approx and speculative providers, the gRPC indexer (real gRPC, in process), the event decoders
(SGLang map / array, vLLM extra_keys) and the simulated engine.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import msgpack
import pytest

from mesh import hashing
from mesh import kv_events as KV
from mesh.adapters.kv_relay import BlockMirror, split_events
from mesh.engine_model import EngineConfig, EngineModel
from mesh.index import ops
from mesh.indexer import indexer_pb2 as pb
from mesh.indexer import indexer_pb2_grpc as pb_grpc
from mesh.indexer.client import IndexerClient
from mesh.indexer.server import serve
from mesh.namespaces import (
    ROOT_KEY,
    event_namespace,
    event_root_key,
    make_namespace,
    namespace_root_key,
    request_event_fields,
    request_namespace,
)
from mesh.protocol import pack
from mesh.routing.providers import ApproxProvider, LocalIndexProvider, request_keys
from mesh.routing.view import RouteRequest
from workers_stub.sglang_wire import encode_events

from conftest import run, until

BS = 4
TOKENS = tuple(random.Random(5).randrange(1, 30_000) for _ in range(4 * BS))
SALT = {"cache_salt": "tenant-a"}
LORA = {"lora_path": "sql-adapter"}


def _req(params: dict | None = None, tokens=TOKENS, rid: str = "r") -> RouteRequest:
    return RouteRequest(rid, len(tokens), tokens=list(tokens), namespace=request_namespace(params or {}))


def _stored(h0: int, *, lora: str | None = None, salt: str | None = None, parent: int | None = None,
            tokens=TOKENS) -> KV.BlockStored:
    n = len(tokens) // BS
    return KV.BlockStored(tuple(range(h0, h0 + n)), parent, tuple(tokens), BS, "GPU", lora, cache_salt=salt)


def _provider(**kw) -> LocalIndexProvider:
    p = LocalIndexProvider(block_size=BS, **kw)
    for w in ("plain", "salted", "lora", "both"):
        p.add_worker(w, BS)
    # the same tokens stored under four namespaces, one worker each
    p.apply_events("plain", 0, 1, 0, [_stored(100)], 0.0)
    p.apply_events("salted", 0, 1, 0, [_stored(200, salt="tenant-a")], 0.0)
    p.apply_events("lora", 0, 1, 0, [_stored(300, lora="sql-adapter")], 0.0)
    p.apply_events("both", 0, 1, 0, [_stored(400, lora="sql-adapter", salt="tenant-a")], 0.0)
    return p


def _holders(m) -> dict[str, int]:
    return {x.worker_id: x.blocks for x in m.top(10) if x.blocks}


# --------------------------------------------------------------------------- the mapping


def test_request_and_event_sides_name_the_same_namespace():
    assert request_namespace({}) is None and request_namespace({"lora_path": None, "cache_salt": ""}) is None
    assert request_namespace(SALT) == event_namespace(None, "tenant-a")
    assert request_namespace(LORA) == event_namespace("sql-adapter", None)
    assert request_namespace({**LORA, **SALT}) == event_namespace("sql-adapter", "tenant-a")
    # what a simulated engine serving the request keys its cache by / publishes
    assert request_event_fields({**LORA, **SALT, "extra_key": "k"}) == ("sql-adapter", "k", "tenant-a")
    # parts are length-prefixed: no choice of strings makes two triples collide
    assert make_namespace("a\x1fs1:b") != make_namespace("a", None, "b")
    assert len({make_namespace(*t) for t in [("x", None, None), (None, "x", None), (None, None, "x")]}) == 3


def test_root_keys_are_fixed_nonzero_and_plain_is_free():
    assert ROOT_KEY == hashing.ROOT_KEY == ops.ROOT_KEY == namespace_root_key(None) == event_root_key(None, None)
    a, b = namespace_root_key(request_namespace(SALT)), namespace_root_key(request_namespace(LORA))
    assert a != b and ROOT_KEY not in (a, b)
    assert event_root_key(None, "tenant-a") == a
    # the root key is part of the index format (brokers and indexers must agree): pin one value
    assert request_namespace(SALT) == "s8:tenant-a" and a == 0x0EF897DF56A0B3E1


def test_request_keys_chain_from_the_namespace_root():
    plain, salted = _req(), _req(SALT)
    assert request_keys(plain, BS) == hashing.content_keys(TOKENS, BS)
    ks = request_keys(salted, BS)
    assert ks == hashing.content_keys(TOKENS, BS, namespace_root_key(salted.namespace))
    assert not set(ks) & set(request_keys(plain, BS))
    packed = RouteRequest("p", len(TOKENS), packed=hashing.pack_tokens(TOKENS), namespace=salted.namespace)
    assert request_keys(packed, BS) == ks


# --------------------------------------------------------------------------- local index


def test_local_index_keeps_namespaces_apart():
    p = _provider()
    full = len(TOKENS) // BS
    assert _holders(p.match(_req(), 0.0)) == {"plain": full}
    assert _holders(p.match(_req(SALT), 0.0)) == {"salted": full}
    assert _holders(p.match(_req(LORA), 0.0)) == {"lora": full}
    assert _holders(p.match(_req({**LORA, **SALT}), 0.0)) == {"both": full}
    assert _holders(p.match(_req({"cache_salt": "tenant-b"}), 0.0)) == {}
    assert _holders(p.match(_req({"extra_key": "k"}), 0.0)) == {}  # no event names an extra_key


def test_stores_below_a_namespaced_parent_inherit_its_namespace():
    p = _provider()
    more = tuple(random.Random(6).randrange(1, 30_000) for _ in range(2 * BS))
    # vLLM / SGLang continuations: parent set, the salt is not repeated (vLLM only salts block 0)
    p.apply_events("salted", 0, 1, 1, [_stored(250, parent=203, tokens=more)], 0.0)
    p.apply_events("plain", 0, 1, 1, [_stored(150, parent=103, tokens=more)], 0.0)
    longer = TOKENS + more
    assert _holders(p.match(_req(SALT, longer), 0.0)) == {"salted": 6}
    assert _holders(p.match(_req(None, longer), 0.0)) == {"plain": 6}
    # a removal of the namespaced root drops its chain only
    p.apply_events("salted", 0, 1, 2, [KV.BlockRemoved((200,), "GPU")], 0.0)
    assert _holders(p.match(_req(SALT, longer), 0.0)) == {}
    assert _holders(p.match(_req(None, longer), 0.0)) == {"plain": 6}


def test_speculative_entries_respect_namespaces():
    p = LocalIndexProvider(block_size=BS, speculative_ttl_s=5.0)
    p.add_worker("w1", BS)
    p.on_routed(_req(SALT), "w1", 0.0)
    assert _holders(p.match(_req(), 0.1)) == {}
    assert _holders(p.match(_req(SALT), 0.1)) == {"w1": 4}
    assert _holders(p.match(_req(LORA), 0.1)) == {}


def test_approx_provider_respects_namespaces():
    p = ApproxProvider(block_size=BS, ttl_s=60.0)
    p.add_worker("w1", BS)
    p.add_worker("w2", BS)
    p.on_routed(_req(LORA), "w1", 0.0)
    p.on_routed(_req(), "w2", 0.0)
    assert _holders(p.match(_req(), 1.0)) == {"w2": 4}
    assert _holders(p.match(_req(LORA), 1.0)) == {"w1": 4}
    assert _holders(p.match(_req(SALT), 1.0)) == {}


# --------------------------------------------------------------------------- decoding


def _decode_one(ev_obj) -> KV.BlockStored:
    b = KV.decode_batch(msgpack.packb([1.0, [ev_obj], 0]))
    assert isinstance(b, KV.EventBatch) and not b.skipped, b
    (ev,) = b.events
    return ev


def test_sglang_map_cache_salt_and_lora_name():
    ev = _decode_one({"type": "BlockStored", "block_hashes": [-5, 6], "parent_block_hash": None,
                      "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
                      "cache_salt": "tenant-a", "session_id": "s1", "lora_name": "sql-adapter"})
    assert (ev.lora_name, ev.cache_salt) == ("sql-adapter", "tenant-a")
    assert KV.decode_event(KV.encode_event_map(ev)) == ev


def test_sglang_0_5_18_array_metadata_map_salt():
    ev = _decode_one(["BlockStored", [-5], None, [1, 2, 3, 4], 4, None, "GPU", {"cache_salt": "tenant-a"}])
    assert (ev.lora_name, ev.cache_salt) == (None, "tenant-a")
    ev2 = _decode_one(["BlockStored", [-5], None, [1, 2, 3, 4], 4, None, "GPU", "sql-adapter"])
    assert (ev2.lora_name, ev2.cache_salt) == ("sql-adapter", None)
    both = KV.BlockStored((7,), None, (1, 2, 3, 4), 4, "GPU", "sql-adapter", cache_salt="tenant-a")
    assert KV.decode_event(KV.encode_event_array(both)) == both


def _vllm(extra_keys, *, parent=None, lora=None, n=3):
    return {"type": "BlockStored", "block_hashes": list(range(1, n + 1)), "parent_block_hash": parent,
            "token_ids": list(range(n * 4)), "block_size": 4, "lora_id": None, "medium": "GPU",
            "lora_name": lora, "extra_keys": extra_keys, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def test_vllm_extra_keys_lora_and_first_block_salt():
    ev = _decode_one(_vllm([["sql", "tenant-a"], ["sql"], ["sql"]], lora="sql"))
    assert (ev.lora_name, ev.cache_salt, len(ev.block_hashes), ev.unmatched_blocks) == ("sql", "tenant-a", 3, 0)
    ev = _decode_one(_vllm([["tenant-a"], None, None]))
    assert (ev.lora_name, ev.cache_salt, len(ev.block_hashes)) == (None, "tenant-a", 3)
    ev = _decode_one(_vllm(None))
    assert (ev.lora_name, ev.cache_salt, len(ev.block_hashes)) == (None, None, 3)


def test_vllm_multimodal_and_unexplained_extra_keys_are_cut_or_rejected():
    # text, then an image block: only the text prefix is matchable
    ev = _decode_one(_vllm([None, [["img-3f2a", 0]], [["img-3f2a", 4]]]))
    assert (ev.block_hashes, ev.token_ids, ev.unmatched_blocks) == ((1,), (0, 1, 2, 3), 2)
    # prompt-embeds digest (bytes) on a LoRA block
    ev = _decode_one(_vllm([["sql"], ["sql", b"\x01" * 32], ["sql"]], lora="sql"))
    assert (len(ev.block_hashes), ev.unmatched_blocks, ev.lora_name) == (1, 2, "sql")
    # a salt-looking key below a parent cannot be vLLM's salt (first block only): not explained
    ev = _decode_one(_vllm([None, ["x"], None], parent=99))
    assert (len(ev.block_hashes), ev.unmatched_blocks) == (1, 2)
    # nothing matchable at all: the whole event is skipped, counted
    b = KV.decode_batch(msgpack.packb([1.0, [_vllm([[["img", 0]], None, None])], 0]))
    assert b.events == () and b.skipped == {"unmatchable_blocks": 1}


def test_stub_wire_forms_decode_to_the_same_namespace():
    ev = KV.BlockStored((1, 2), None, tuple(range(8)), 4, "GPU", "sql", cache_salt="tenant-a")
    child = KV.BlockStored((3,), 2, tuple(range(8, 12)), 4, "GPU", "sql", cache_salt="tenant-a")
    for form in ("map", "array", "vllm"):
        b = KV.decode_batch(encode_events(1.0, [ev, child], 0, form))
        root, below = b.events
        assert event_root_key(root.lora_name, root.cache_salt) == event_root_key("sql", "tenant-a"), form
        assert below.lora_name == "sql" and below.unmatched_blocks == 0, form
    vl = msgpack.unpackb(encode_events(1.0, [ev, child], 0, "vllm"))[1]
    assert vl[0]["extra_keys"] == [["sql", "tenant-a"], ["sql"]] and vl[1]["extra_keys"] == [["sql"]]


def test_provider_counts_cut_blocks_and_keeps_the_prefix():
    p = LocalIndexProvider(block_size=4)
    p.add_worker("w", 4)
    raw = [_vllm([None, [["img", 0]], [["img", 4]]])]
    p.on_kv_events("w", type("M", (), {"events": raw, "dp_rank": 0, "epoch": 1, "seq": 0})(), 0.0)
    assert p.counters["unmatched_blocks"] == 2
    assert _holders(p.match(RouteRequest("r", 12, tokens=list(range(12))), 0.0)) == {"w": 1}


def test_adapter_relay_pieces_and_mirror_keep_the_namespace():
    ev = KV.BlockStored(tuple(range(1, 5)), None, tuple(range(16)), 4, "GPU", "sql", cache_salt="tenant-a")
    pieces = [e for batch in split_events([ev], max_tokens=8) for e in batch]
    assert len(pieces) == 2 and all((e.lora_name, e.cache_salt) == ("sql", "tenant-a") for e in pieces)
    m = BlockMirror()
    m.apply([ev, KV.BlockStored((9,), None, (1, 2, 3, 4), 4, "GPU")])
    snap = {e.block_hashes[0]: (e.lora_name, e.cache_salt) for e in m.snapshot_events()}
    assert snap == {1: ("sql", "tenant-a"), 9: (None, None)}


# --------------------------------------------------------------------------- simulated engine


def _run_to_idle(eng: EngineModel, t: float = 0.0) -> tuple[list, float]:
    firsts, evs = [], []
    while eng.has_work():
        r = eng.step(t)
        t += r.duration_s
        firsts += r.first_tokens
        evs += r.kv_events
    return firsts, evs


def test_engine_model_namespaces_its_cache_and_events():
    eng = EngineModel(EngineConfig(page_size=BS, max_total_num_tokens=4096))
    prompt = list(TOKENS) + [1]
    eng.submit("plain", prompt, 1, 0.0)
    _run_to_idle(eng)
    eng.submit("salted", prompt, 1, 1.0, cache_salt="tenant-a")
    firsts, evs = _run_to_idle(eng, 1.0)
    assert firsts[0][1] == 0  # the plain pages are not reused under a salt
    stored = [e for e in evs if type(e) is KV.BlockStored]
    assert stored and all(e.cache_salt == "tenant-a" and e.lora_name is None for e in stored)
    eng.submit("salted2", prompt, 1, 2.0, cache_salt="tenant-a")
    eng.submit("lora", prompt, 1, 2.0, lora_name="sql-adapter")
    firsts, evs = _run_to_idle(eng, 2.0)
    assert dict((r, c) for r, c, _ in firsts) == {"salted2": 16, "lora": 0}
    assert {e.lora_name for e in evs if type(e) is KV.BlockStored} == {"sql-adapter"}
    # distinct engine hashes per namespace (SGLang seeds the salted chain), and every page
    # indexed by the router under the right namespace
    hashes = [h for h, _ in eng.cached_blocks()]
    assert len(hashes) == len(set(hashes))
    p = LocalIndexProvider(block_size=BS)
    p.add_worker("w", BS)
    p.apply_events("w", 0, 1, 0, eng.snapshot_events(), 0.0)
    for params in ({}, SALT, LORA):
        assert _holders(p.match(_req(params, prompt), 0.0)) == {"w": 4}, params
    assert _holders(p.match(_req({**SALT, **LORA}, prompt), 0.0)) == {}
    assert eng.peek_cached_tokens(prompt, request_namespace(SALT)) == 16 and eng.peek_cached_tokens(prompt) == 16


# --------------------------------------------------------------------------- gRPC indexer


def test_grpc_indexer_keeps_namespaces_apart():
    async def body() -> None:
        stop = asyncio.Event()
        eps: list[str] = []
        srv = asyncio.create_task(serve("127.0.0.1:0", block_size=BS, stop=stop, ready=eps.append))
        try:
            await until(lambda: eps, 10, "indexer listening")
            ep = eps[0]
            async with IndexerClient([ep], query_timeout_ms=2000) as c:
                for i, (w, ev) in enumerate([("plain", _stored(100)), ("salted", _stored(200, salt="tenant-a")),
                                             ("lora", _stored(300, lora="sql-adapter"))]):
                    await c.register_worker(w, BS)
                    c.forward(w, 0, 1, 0, pack([KV.encode_event_map(KV.AllBlocksCleared()), KV.encode_event_map(ev)]))
                assert await c.flush(10)

                async def holders(params):
                    m = await c.match(request_keys(_req(params), BS), BS)
                    assert m is not None
                    return _holders(m)

                assert await holders({}) == {"plain": 4}
                assert await holders(SALT) == {"salted": 4}
                assert await holders(LORA) == {"lora": 4}
                assert await holders({"cache_salt": "other"}) == {}
            # token-id queries carry the namespace in the request; absent = plain (old clients)
            async with grpc.aio.insecure_channel(ep.removeprefix("http://")) as ch:
                stub = pb_grpc.IndexerStub(ch)

                async def by_tokens(**kw):
                    r = await stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=list(TOKENS), block_size=BS, **kw))
                    return {w: lv.matched_blocks for lv in r.levels for w in lv.worker_ids}

                assert await by_tokens() == {"plain": 4}
                assert await by_tokens(namespace=request_namespace(SALT)) == {"salted": 4}
                assert await by_tokens(namespace=request_namespace(LORA)) == {"lora": 4}
        finally:
            stop.set()
            await asyncio.wait_for(srv, 10)

    run(body(), 30)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
