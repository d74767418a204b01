"""Tier-aware index (mesh.index.tiers): ownership per medium, demotions, tier-weighted routing.

The engine frames are the engines' own classes encoded by their own encoder
(tests/data/tier_frames.json, made by tests/data/record_tier_frames.py from the sglang 0.5.23
(maps) / 0.5.18 (arrays) and vllm 0.34 wheels).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesh import kv_events as KV
from mesh.hashing import content_keys
from mesh.index import PrefixIndex, Remove, Store
from mesh.index.ingest import KvIngest
from mesh.index.tiers import DEVICE, HOST, MAX_MEDIUMS, STORE, MediumBook, tier_level
from mesh.load import LoadStat
from mesh.routing.cache_policies import CacheAware
from mesh.routing.calibration import TierCostLearner
from mesh.routing.providers import LocalIndexProvider
from mesh.routing.view import RouteRequest, WorkerState

DATA = json.loads((Path(__file__).parent / "data" / "tier_frames.json").read_text())
TOKENS = DATA["tokens"]
BS = DATA["block_size"]
KEYS = content_keys(TOKENS, BS, 0)
# (matched blocks, (device, host, store)) after each recorded step
EXPECTED = {
    "gpu_store": (2, (2, 0, 0)),
    "host_store": (2, (2, 0, 0)),
    "gpu_remove": (2, (0, 2, 0)),  # demoted, not gone
    "store_store": (2, (0, 2, 0)),
    "host_remove": (2, (0, 0, 2)),
    "store_remove": (0, (0, 0, 0)),  # removed from its last tier: gone
}


@pytest.mark.parametrize("engine", sorted(DATA["engines"]))
def test_engine_frames_demote_then_remove(engine):
    e = DATA["engines"][engine]
    ingest = KvIngest(PrefixIndex(key_fn=content_keys), block_size=BS)
    ingest.add_worker("w", BS)
    for seq, (step, payload) in enumerate(zip(DATA["steps"], e["payloads"])):
        batch = KV.decode_batch(bytes.fromhex(payload))
        assert not isinstance(batch, Exception) and not batch.skipped
        ingest.apply_events("w", batch.dp_rank or 0, 1, seq, batch.events, 0.0)
        m = ingest.index.match(KEYS)
        blocks, tiers = EXPECTED[step]
        assert (m.matched_blocks("w"), m.tier_blocks("w")) == (blocks, tiers), step
    assert ingest.index.entries == 0 and ingest.index.stats()["tiered_entries"] == 0
    assert ingest.index.c.demotions == 4  # two blocks off the GPU, two off the host


def test_engine_mediums_map_to_levels():
    levels = {m: tier_level(m) for e in DATA["engines"].values() for m in e["mediums"]}
    assert levels == {"GPU": DEVICE, "CPU_PINNED": HOST, "CPU": HOST, "DISK": STORE, "EXTERNAL": STORE,
                      "STORAGE": STORE}
    assert tier_level(None) == DEVICE and tier_level("cpu") == HOST and tier_level("ssd-pool") == STORE


def idx_with(chain_mediums):
    """Index where worker w holds the 2-block chain, block i stored on chain_mediums[i] (a tuple each)."""
    ix = PrefixIndex(key_fn=content_keys)
    for medium in {m for ms in chain_mediums for m in ms}:
        for i, ms in enumerate(chain_mediums):
            if medium in ms:
                ix.apply(("w", 0), [Store([100 + i], None if i == 0 else 100 + i - 1, token_ids=TOKENS[i * BS:(i + 1) * BS],
                                          block_size=BS, medium=medium)])
    return ix


def test_device_prefix_and_host_tail_are_counted_per_block():
    ix = PrefixIndex(key_fn=content_keys)
    ix.apply(("w", 0), [Store([1, 2], None, token_ids=TOKENS, block_size=BS)])
    ix.apply(("w", 0), [Store([2], 1, token_ids=TOKENS[BS:], block_size=BS, medium="CPU_PINNED")])
    ix.apply(("w", 0), [Remove([2], "GPU")])
    m = ix.match(KEYS)
    assert m.tier_blocks("w") == (1, 1, 0) and m.lower_tier_blocks("w") == (1, 0)


def test_removal_from_a_medium_the_block_is_not_on_is_ignored():
    ix = PrefixIndex(key_fn=content_keys)
    ix.apply(("w", 0), [Store([1, 2], None, token_ids=TOKENS, block_size=BS, medium="CPU_PINNED")])
    ix.apply(("w", 0), [Remove([1, 2], "GPU")])  # a late GPU eviction of blocks now only on the host
    assert ix.match(KEYS).tier_blocks("w") == (0, 2, 0)
    assert ix.c.tier_misses == 2 and ix.entries == 2


def test_removal_without_medium_removes_every_tier_and_cascades():
    ix = PrefixIndex(key_fn=content_keys)
    ix.apply(("w", 0), [Store([1, 2], None, token_ids=TOKENS, block_size=BS),
                        Store([1, 2], None, token_ids=TOKENS, block_size=BS, medium="CPU")])
    ix.apply(("w", 0), [Remove([1])])
    assert ix.entries == 0 and ix.stats()["tiered_entries"] == 0


def test_full_removal_of_a_parent_drops_the_tiers_of_its_subtree():
    ix = PrefixIndex(key_fn=content_keys)
    ix.apply(("w", 0), [Store([1, 2], None, token_ids=TOKENS, block_size=BS, medium="CPU")])
    ix.apply(("w", 0), [Remove([1], "CPU")])  # parent gone from its only tier: the child is unreachable
    assert ix.entries == 0 and ix.stats()["tiered_entries"] == 0


def test_gpu_only_fleet_keeps_no_tier_state():
    ix = PrefixIndex(key_fn=content_keys)
    ix.apply(("w", 0), [Store([1, 2], None, token_ids=TOKENS, block_size=BS, medium="GPU")])
    ix.apply(("w", 0), [Remove([2], "GPU")])
    assert ix.entries == 1 and not ix.media.tiered and ix.stats()["tiered_entries"] == 0
    assert ix.match(KEYS).tier_blocks("w") == (1, 0, 0)


def test_restore_on_gpu_promotes_back():
    ix = PrefixIndex(key_fn=content_keys)
    ix.apply(("w", 0), [Store([1, 2], None, token_ids=TOKENS, block_size=BS, medium="CPU"),
                        Store([1, 2], None, token_ids=TOKENS, block_size=BS)])  # loaded back onto the GPU
    assert ix.match(KEYS).tier_blocks("w") == (2, 0, 0) and ix.c.tier_stores == 2


def test_medium_book_is_bounded():
    book = MediumBook()
    bits = {book.bit(f"tier{i}") for i in range(3 * MAX_MEDIUMS)}
    assert len(bits) == MAX_MEDIUMS  # MAX_MEDIUMS - 1 named bits + one shared overflow bit
    assert book.bit("GPU") == book.bit(None) == book.bit("cuda")


# ------------------------------------------------------------------ routing


def ws(wid: str, running: int = 0) -> WorkerState:
    w = WorkerState(wid)
    w.update_load([LoadStat(running, 0, 0, 400_000, 0, 0, 0, 256, 0, 0)], 0.0)
    return w


def provider_with(holdings):
    """A radix_tree provider; holdings: worker -> (blocks held, medium of the held copy, demoted?)."""
    p = LocalIndexProvider(block_size=4, speculative_ttl_s=0)
    tokens = list(range(1, 65))
    hs = list(range(1, 17))
    for wid, (n, medium) in holdings.items():
        p.add_worker(wid, 4)
        evs = [KV.BlockStored(tuple(hs[:n]), None, tuple(tokens[:n * 4]), 4, "GPU")]
        if medium != "GPU":
            evs += [KV.BlockStored(tuple(hs[:n]), None, tuple(tokens[:n * 4]), 4, medium),
                    KV.BlockRemoved(tuple(hs[:n][::-1]), "GPU")]
        p.apply_events(wid, 0, 1, 0, evs, 0.0)
    return p, RouteRequest("r1", prompt_tokens=64, block_size=4, tokens=tokens)


def test_demoted_holder_keeps_its_requests():
    p, rq = provider_with({"a": (0, "GPU"), "b": (16, "CPU_PINNED")})
    d = CacheAware().choose(rq, [ws("a"), ws("b")], p.match(rq, 0.0), 0.0)
    assert d.worker_id == "b" and d.reason == "cache_hit" and d.matched_blocks == 15
    assert d.detail["tier_tokens"] == (63, 0)


def test_a_host_hit_counts_three_quarters_against_the_affinity_threshold():
    # 10 of 16 blocks: 40 tokens; on the device a holder (>= 32), on the host 30 weighted tokens: not
    p, rq = provider_with({"a": (0, "GPU"), "b": (10, "GPU")})
    assert CacheAware().choose(rq, [ws("a"), ws("b")], p.match(rq, 0.0), 0.0).worker_id == "b"
    p, rq = provider_with({"a": (0, "GPU"), "b": (10, "CPU")})
    assert CacheAware().choose(rq, [ws("a"), ws("b")], p.match(rq, 0.0), 0.0).worker_id == "a"
    p, rq = provider_with({"a": (0, "GPU"), "b": (10, "CPU")})
    pol = CacheAware(tier_weights=(1.0, 1.0, 1.0))  # configured: tiers count as the device
    assert pol.choose(rq, [ws("a"), ws("b")], p.match(rq, 0.0), 0.0).worker_id == "b"


def test_cost_policy_prefers_the_device_copy():
    p, rq = provider_with({"a": (16, "CPU"), "b": (16, "GPU")})
    pol = CacheAware(affinity_threshold=0, temperature=0, temperature_ms=0)
    d = pol.choose(rq, [ws("a"), ws("b")], p.match(rq, 0.0), 0.0)
    assert d.worker_id == "b"
    p, rq = provider_with({"a": (16, "DISK"), "b": (16, "CPU")})
    assert pol.choose(rq, [ws("a"), ws("b")], p.match(rq, 0.0), 0.0).worker_id == "b"


def test_tier_learner_learns_a_cheap_host_tier_from_outcomes():
    lr = TierCostLearner((1.0, 0.75, 0.25))
    assert lr.weights() == (1.0, 0.75, 0.25)
    for _ in range(200):  # host transfers cost 10 % of recompute, the prediction assumed 25 %
        lr.observe((400.0, 0.0), (0.25, 0.75), actual_ms=100.0 + 40.0, predicted_ms=100.0 + 100.0)
    w = lr.weights()
    assert w[1] == pytest.approx(0.9, abs=0.02) and w[2] == pytest.approx(0.25, abs=0.01)
    with pytest.raises(ValueError):
        TierCostLearner((1.0, 1.5, 0.25))


def test_policy_feeds_the_tier_learner():
    pol = CacheAware()
    for i in range(40):
        p, rq = provider_with({"b": (16, "CPU")})
        d = pol.choose(rq, [ws("b")], p.match(rq, 0.0), 0.0)
        assert d.detail["tier_ms"][0] > 0
        pol.observe(d, d.detail["predicted_ttft_ms"] - 0.2 * d.detail["tier_ms"][0])  # host 5 % of recompute
    assert pol.tier_learner.observations == 40
    assert pol.route_tier_weights()[1] > 0.85
    assert CacheAware(learn_tiers=False).route_tier_weights() == (1.0, 0.75, 0.25)


# ------------------------------------------------------------------ shared indexer


def test_indexer_reply_carries_the_tiers_and_the_policy_reads_them():
    from mesh.indexer import indexer_pb2 as pb
    from mesh.indexer.client import MatchView
    from mesh.indexer.core import IndexerCore
    from mesh.protocol import pack

    core = IndexerCore(max_entries=None, block_size=BS)
    for wid in ("a", "b"):
        core.register_worker(wid, BS, now_s=0.0)
    events = [KV.BlockStored((1, 2), None, tuple(TOKENS), BS, "GPU")]
    core.apply_batch("a", 0, 1, 0, pack([KV.encode_event_map(e) for e in events]), now_s=0.0)
    events += [KV.BlockStored((1, 2), None, tuple(TOKENS), BS, "CPU_PINNED"), KV.BlockRemoved((2,), "GPU")]
    core.apply_batch("b", 0, 1, 0, pack([KV.encode_event_map(e) for e in events]), now_s=0.0)
    resp = pb.MatchPrefixResponse.FromString(core.match(KEYS).SerializeToString())
    assert [(list(lv.worker_ids), list(lv.host_blocks), list(lv.store_blocks)) for lv in resp.levels] == [
        (["a", "b"], [0, 1], [0, 0])]
    view = MatchView(resp)
    assert view.lower_tier_blocks("b") == (1, 0) and view.lower_tier_blocks("a") == (0, 0)
    rq = RouteRequest("r", prompt_tokens=9, block_size=BS, tokens=TOKENS + [9])
    d = CacheAware().choose(rq, [ws("b"), ws("a", running=3)], view, 0.0)
    # 8 tokens matched, 4 of them on the host: 1 + 4 x (1 - 0.75) tokens' worth to compute
    assert d.matched_blocks == 2 and d.detail["tier_tokens"] == (4, 0) and d.detail["uncached_tokens"] == 2


def test_indexer_reply_of_a_device_only_fleet_has_no_tier_arrays():
    from mesh.indexer.core import IndexerCore
    from mesh.protocol import pack

    core = IndexerCore(max_entries=None, block_size=BS)
    core.register_worker("a", BS, now_s=0.0)
    core.apply_batch("a", 0, 1, 0, pack([KV.encode_event_map(KV.BlockStored((1, 2), None, tuple(TOKENS), BS, "GPU"))]),
                     now_s=0.0)
    (lv,) = core.match(KEYS).levels
    assert list(lv.worker_ids) == ["a"] and not lv.host_blocks and not lv.store_blocks


# ------------------------------------------------------------------ broker settings


@pytest.mark.parametrize("field", ["tier_weight_host", "tier_weight_store"])
def test_tier_weight_settings_are_validated_naming_the_field(field):
    from mesh.config import BrokerSettings, build
    from mesh.errors import ConfigError

    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match=field):
            build(BrokerSettings, {field: bad})


def test_tier_weights_reach_the_broker_policy():
    from brokers.main import build_broker
    from mesh.config import BrokerSettings, build

    b = build_broker(build(BrokerSettings, {"tier_weight_host": 0.9}))
    try:
        assert b.router.policy.tier_weights == (1.0, 0.9, 0.25)
    finally:
        b.close()


# ------------------------------------------------------------------ brute force


@pytest.mark.parametrize("seed", range(40))
def test_random_tiered_ops_match_a_brute_force_model(seed):
    """Random stores / removals on random mediums against a per-block medium-set model: removal
    cascades below a block only when its last medium goes (or without a medium)."""
    import random

    rng = random.Random(seed)
    n = 24
    parent = {i: (None if i < 3 or rng.random() < 0.1 else rng.randrange(1, i)) for i in range(1, n + 1)}

    def path(i):
        out = []
        while i is not None:
            out.append(i)
            i = parent[i]
        return out[::-1]

    mediums = [None, "GPU", "CPU_PINNED", "CPU", "DISK", "STORAGE"]
    ix = PrefixIndex(key_fn=content_keys)
    held: dict[int, set] = {}  # the model: block -> mediums holding it

    def drop(b):
        held.pop(b, None)
        for c in [c for c in held if parent[c] == b]:
            drop(c)

    for _ in range(80):
        i = rng.randrange(1, n + 1)
        med = rng.choice(mediums)
        if rng.random() < 0.6:
            chain = path(i)[rng.randrange(len(path(i))):]  # a segment ending at i
            p = parent[chain[0]]
            ix.apply(("w", 0), [Store(chain, p, token_ids=chain, block_size=1, medium=med)])
            if p is None or p in held:
                for b in chain:
                    held.setdefault(b, set()).add(med or "GPU")
        else:
            ix.apply(("w", 0), [Remove([i], med)])
            if i in held:
                if med is None:
                    drop(i)
                elif med in held[i]:
                    held[i].discard(med)
                    if not held[i]:
                        drop(i)
        for q in range(1, n + 1):
            pq = path(q)
            m = ix.match(content_keys(pq, 1, 0), touch=False)
            depth = 0
            while depth < len(pq) and pq[depth] in held:
                depth += 1
            split = [0, 0, 0]
            for b in pq[:depth]:
                split[min(tier_level(x) for x in held[b])] += 1
            assert (m.matched_blocks("w"), m.tier_blocks("w")) == (depth, tuple(split)), (seed, q)
    assert ix.entries == len(held)


def test_indexer_checkpoint_keeps_the_tiers():
    from mesh.indexer.core import IndexerCore
    from mesh.protocol import pack

    core = IndexerCore(max_entries=None, block_size=BS)
    core.register_worker("b", BS, now_s=0.0)
    evs = [KV.BlockStored((1, 2), None, tuple(TOKENS), BS, "GPU"), KV.BlockStored((1, 2), None, tuple(TOKENS), BS, "CPU"),
           KV.BlockRemoved((2,), "GPU")]
    core.apply_batch("b", 0, 1, 0, pack([KV.encode_event_map(e) for e in evs]), now_s=0.0)
    other = IndexerCore(max_entries=None, block_size=BS)
    other.load_state(core.dump_state())
    (lv,) = other.match(KEYS).levels
    assert list(lv.host_blocks) == [1]
    other.apply_batch("b", 0, 1, 1, pack([KV.encode_event_map(KV.BlockRemoved((2,), "CPU"))]), now_s=0.0)
    (lv,) = other.match(KEYS).levels
    assert lv.matched_blocks == 1 and not lv.host_blocks


def test_endless_made_up_medium_names_cost_no_memory_past_the_cap():
    """A worker may send any ``medium`` string: past the cap every new one shares the overflow
    bit and is not remembered (the table stayed at 100,000 entries before)."""
    from mesh.index.tiers import MAX_MEDIUMS, MediumBook

    book = MediumBook()
    bits = {book.bit(f"made-up-{i}") for i in range(10_000)}
    assert len(book._bits) <= MAX_MEDIUMS + 2 and len(bits) <= MAX_MEDIUMS + 1
