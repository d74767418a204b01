"""DP-attention ranks (mesh.routing.ranks): the decision, its bookkeeping, and how the rank
travels (REQUEST ``dp_rank`` -> SGLang ``routed_dp_rank``). Pure: hand-made fleets and events."""

from __future__ import annotations

import random

from mesh import kv_events as KV
from mesh import protocol as P
from mesh.adapters.backend import EngineInfo
from mesh.adapters.sglang import generate_body
from mesh.load import LoadStat
from mesh.routing.bucket_router import BucketRouter
from mesh.routing.factory import make_router
from mesh.routing.providers import make_provider
from mesh.routing.ranks import choose_rank
from mesh.routing.router import make_policy
from mesh.routing.view import RouteRequest, WorkerState

BS = 16
PREFIX = list(range(1, 1 + 8 * BS))  # 8 pages


def _ws(wid: str, dp: int = 2, loads: dict[int, int] | None = None, at: float = 0.0) -> WorkerState:
    w = WorkerState(wid, dp_size=dp, block_size=BS)
    if loads:
        w.update_load([LoadStat(n, 0, 0, 400_000, r, 0, 0, 256, 0, 0) for r, n in loads.items()], at)
    return w


def _store(prov, wid: str, rank: int, tokens: list[int], seq: int = 0) -> None:
    hashes = tuple(1000 * (rank + 1) + i for i in range(len(tokens) // BS))
    ev = KV.BlockStored(hashes, None, tuple(tokens), BS, "GPU")
    assert prov.apply_events(wid, rank, 1, seq, [ev], 0.0) is None


def _req(rid: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(rid, prompt_tokens=len(tokens), block_size=BS, tokens=tokens)


# ------------------------------------------------------------------ the decision

def test_the_rank_holding_the_longest_prefix_wins_over_load():
    w = _ws("w", loads={0: 0, 1: 9})
    assert choose_rank(w, {1: 8}, 0.1, 5.0) == (1, "prefix")
    assert choose_rank(w, {0: 2, 1: 8}, 0.1, 5.0) == (1, "prefix")


def test_a_tie_or_a_miss_goes_to_the_least_loaded_rank():
    w = _ws("w", dp=3, loads={0: 4, 1: 1, 2: 0})
    assert choose_rank(w, {0: 8, 1: 8}, 0.1, 5.0) == (1, "prefix_tie")
    assert choose_rank(w, {}, 0.1, 5.0) == (2, "least_loaded")
    # ranks beyond dp_size and empty matches are no holders
    assert choose_rank(w, {7: 8, 0: 0}, 0.1, 5.0) == (2, "least_loaded")


def test_rank_load_is_corrected_by_this_routers_dispatches_and_falls_back_when_stale():
    w = _ws("w", loads={0: 1, 1: 1})
    w.record_rank_dispatch(0)
    w.record_rank_dispatch(0)
    assert w.rank_pressure(0, 0.1, 5.0) == 3 and w.rank_pressure(1, 0.1, 5.0) == 1
    assert choose_rank(w, {}, 0.1, 5.0) == (1, "least_loaded")
    w.update_load([LoadStat(2, 0, 0, 400_000, 0, 0, 0, 256, 0, 0)], 0.2)  # rank 0's snapshot counts them now
    assert w.rank_pressure(0, 0.3, 5.0) == 2
    w.record_release(0, 0)
    assert w.rank_inflight == [1, 0] and w.rank_pressure(0, 0.3, 5.0) == 1
    assert w.rank_pressure(0, 100.0, 5.0) == 1  # stale LoadStat: this router's own count


def test_router_routes_to_the_rank_that_holds_the_prefix_and_releases_it():
    prov = make_provider("radix_tree", block_size=BS, speculative_ttl_s=0)
    prov.add_worker("w0", BS)
    _store(prov, "w0", 1, PREFIX)
    router = make_router(make_policy("cache_aware", rng=random.Random(0)), prov)
    pool = [_ws("w0")]
    d = router.route(_req("a", PREFIX + [7] * 32), pool, 0.0)
    assert d.worker_id == "w0" and d.dp_rank == 1 and d.detail["rank_reason"] == "prefix"
    # a new prompt: the least loaded rank (rank 1 has the request above)
    d2 = router.route(_req("b", [5] * 64), pool, 0.0)
    assert d2.dp_rank == 0 and d2.detail["rank_reason"] == "least_loaded"
    assert pool[0].rank_inflight == [1, 1]
    router.release(pool[0], d)
    router.release(pool[0], d2)
    assert pool[0].rank_inflight == [0, 0] and pool[0].inflight == 0


def test_equal_holders_tie_to_the_idle_rank():
    prov = make_provider("radix_tree", block_size=BS, speculative_ttl_s=0)
    prov.add_worker("w0", BS)
    _store(prov, "w0", 0, PREFIX)
    _store(prov, "w0", 1, PREFIX)
    router = make_router(make_policy("cache_aware", rng=random.Random(0)), prov)
    pool = [_ws("w0", loads={0: 5, 1: 0})]
    d = router.route(_req("a", PREFIX), pool, 0.1)
    assert d.dp_rank == 1 and d.detail["rank_reason"] == "prefix_tie"


def test_workers_without_ranks_get_none_and_load_only_policies_get_the_least_loaded_rank():
    prov = make_provider("radix_tree", block_size=BS, speculative_ttl_s=0)
    router = make_router(make_policy("cache_aware", rng=random.Random(0)), prov)
    d = router.route(_req("a", PREFIX), [_ws("w0", dp=1)], 0.0)
    assert d.dp_rank is None and "rank_reason" not in d.detail
    p2 = make_router(make_policy("power_of_two", rng=random.Random(0)))
    d = p2.route(_req("b", PREFIX), [_ws("w1", loads={0: 3, 1: 2})], 0.1)
    assert d.dp_rank == 1 and d.detail["rank_reason"] == "least_loaded"


def test_bucket_router_gives_the_prefill_leg_its_rank():
    prov = make_provider("radix_tree", block_size=BS, speculative_ttl_s=0)
    prov.add_worker("w0", BS)
    prov.add_worker("w1", BS)
    _store(prov, "w1", 1, PREFIX)
    router = BucketRouter(None, make_policy("cache_aware", rng=random.Random(0)), prov, rng=random.Random(0))
    pool = router.pool([_ws("w0"), _ws("w1")])
    d = router.route(_req("a", PREFIX + [9] * 16), pool, 0.0)
    assert (d.worker_id, d.dp_rank, d.detail["rank_reason"]) == ("w1", 1, "prefix")
    w1 = next(w for w in pool if w.worker_id == "w1")
    router.release(w1, d)
    assert w1.rank_inflight == [0, 0]


# ------------------------------------------------------------------ the wire

def _submit(**params) -> bytes:
    return P.pack({"rid": "c1", "input_ids": [1, 2, 3], "params": params})


def test_request_carries_dp_rank_only_when_chosen():
    f = P.encode_request(7, 1, 1000, "c1", _submit(), None, dp_rank=1)
    assert P.decode_broker_to_worker(f).dp_rank == 1
    plain = P.encode_request(7, 1, 1000, "c1", _submit())
    assert "dp_rank" not in P.unpack(plain[2]) and P.decode_broker_to_worker(plain).dp_rank is None
    bad = P.encode_request(7, 1, 1000, "c1", _submit(), None, dp_rank=5000)
    assert isinstance(P.decode_broker_to_worker(bad), P.ProtocolError)


def test_sglang_generate_body_pins_the_rank():
    info = EngineInfo(model="m", block_size=BS, dp_size=2, topic="", kv_endpoints=[None, None],
                      replay_endpoints=[None, None], load_endpoints=[None, None])
    r = P.decode_broker_to_worker(P.encode_request(7, 1, 1000, "c1", _submit(), None, dp_rank=1))
    assert generate_body(r, info)["routed_dp_rank"] == 1
    r = P.decode_broker_to_worker(P.encode_request(7, 1, 1000, "c1", _submit(routed_dp_rank=0), None, dp_rank=1))
    assert generate_body(r, info)["routed_dp_rank"] == 0  # the client's own pin wins
    r = P.decode_broker_to_worker(P.encode_request(7, 1, 1000, "c1", _submit()))
    assert "routed_dp_rank" not in generate_body(r, info)
