"""Unit tests of mesh.index: sequencing verdicts, orphans, cascade, aliases, LRU budget,
speculation (TTL, closure, approx mode), result validity, rankings, stats, benchmark smoke."""

from __future__ import annotations

import pytest

from mesh import hashing
from mesh.index import (
    ROOT_KEY,
    ApproxIndex,
    Clear,
    PrefixIndex,
    Remove,
    StaleMatchError,
    Store,
    Verdict,
)
from mesh.lab.bench.index_bench import run_index_bench

from index_checks import check_index_invariants

S0 = ("w0", 0)
S1 = ("w1", 0)


def ks(*xs: int) -> list[int]:
    """Readable fake content keys (the index never inspects key values)."""
    return [1000 + x for x in xs]


def depths(ix: PrefixIndex, keys: list[int], now_s: float | None = None) -> dict[str, int]:
    return {w: m.blocks for w, m in ix.match(keys, now_s).to_dict().items()}


# --------------------------------------------------------------------------- sequencing
def test_verdicts_first_next_duplicate_stale():
    ix = PrefixIndex()
    assert ix.begin_batch(S0, 0, 7).verdict is Verdict.APPLY  # first seen, whatever seq
    assert ix.begin_batch(S0, 0, 8).verdict is Verdict.APPLY
    assert ix.begin_batch(S0, 0, 8).verdict is Verdict.DUPLICATE
    assert ix.begin_batch(S0, 0, 3).verdict is Verdict.DUPLICATE
    assert not ix.begin_batch(S0, 0, 3).apply
    ix.begin_batch(S0, 2, 0)
    v = ix.begin_batch(S0, 1, 99)
    assert v.verdict is Verdict.STALE_EPOCH and not v.apply
    st = ix.stats()
    assert (st["batches_applied"], st["duplicates"], st["stale_epochs"], st["new_epochs"]) == (3, 3, 1, 1)


def test_gap_untrusted_then_replay_restores_trust():
    ix = PrefixIndex()
    ix.begin_batch(S0, 0, 0)
    v = ix.begin_batch(S0, 0, 4)
    assert v.verdict is Verdict.GAP and v.missed == 3 and not v.apply
    assert not ix.is_trusted(S0) and ix.untrusted_streams() == [S0]
    assert ix.begin_batch(S0, 0, 5).verdict is Verdict.GAP  # live traffic while replay is pending
    for seq in (1, 2, 3, 4):  # replay from last + 1
        assert ix.begin_batch(S0, 0, seq).verdict is Verdict.APPLY
        assert not ix.is_trusted(S0)
    assert ix.begin_batch(S0, 0, 5).verdict is Verdict.APPLY
    assert ix.is_trusted(S0)
    assert ix.begin_batch(S0, 0, 5).verdict is Verdict.DUPLICATE
    st = ix.stats()
    assert (st["gaps"], st["gap_episodes"], st["missed_batches"]) == (2, 1, 3)


def test_gap_then_snapshot_reset():
    ix = PrefixIndex()
    ix.begin_batch(S0, 0, 0)
    ix.store(S0, None, [1, 2], ks(1, 2))
    assert ix.begin_batch(S0, 0, 10).verdict is Verdict.GAP
    # Replay impossible: the snapshot (Clear + stores) is trusted as of seq 10.
    assert ix.reset_stream(S0, 0, 10) == 2
    ix.store(S0, None, [3], ks(3))
    assert ix.is_trusted(S0)
    assert ix.begin_batch(S0, 0, 11).verdict is Verdict.APPLY
    assert depths(ix, ks(1, 2)) == {} and depths(ix, ks(3)) == {"w0": 1}
    assert ix.stats()["resets"] == 1


def test_new_epoch_drops_only_that_rank():
    ix = PrefixIndex()
    ix.begin_batch(("w0", 0), 0, 0)
    ix.begin_batch(("w0", 1), 0, 0)
    ix.store(("w0", 0), None, [1, 2], ks(1, 2))
    ix.store(("w0", 1), None, [1], ks(1))
    v = ix.begin_batch(("w0", 0), 1, 0)
    assert v.verdict is Verdict.NEW_EPOCH and v.apply
    res = ix.match(ks(1, 2))
    assert res.get("w0").blocks == 1 and res.get("w0").dp_rank == 1


# --------------------------------------------------------------------------- stores
def test_root_key_matches_hashing_module():
    assert ROOT_KEY == hashing.ROOT_KEY


def test_orphans_resolve_and_count():
    ix = PrefixIndex()
    assert ix.resolve_parent_key(S0, None) == ROOT_KEY
    assert ix.resolve_parent_key(S0, 42) is None
    assert ix.store(S0, 42, [5], ks(5)) == 0
    ix.store(S0, None, [1, 2, 3], ks(1, 2, 3))
    assert ix.resolve_parent_key(S0, 2) == ks(2)[0]  # mid-run parent
    assert ix.resolve_parent_key(S0, 3) == ks(3)[0]
    assert ix.resolve_parent_key(S1, 3) is None  # another stream's block is not a parent
    assert ix.store(S1, 3, [9], ks(9)) == 0
    st = ix.stats()
    assert (st["orphans"], st["orphan_blocks"], st["entries"]) == (2, 2, 3)


def test_apply_with_token_ids_uses_key_fn_and_parent_chain():
    ix = PrefixIndex(key_fn=hashing.content_keys)
    toks = list(range(64))
    ops = [
        Store([11, 12], None, token_ids=toks[:32], block_size=16),
        Store([13, 14], 12, token_ids=toks[32:], block_size=16),
        Store([99], 777, token_ids=toks[:16], block_size=16),  # orphan
    ]
    assert ix.apply(S0, ops) == 4
    keys = hashing.content_keys(toks, 16)
    assert depths(ix, keys) == {"w0": 4}
    assert ix.stats()["orphans"] == 1
    assert ix.apply(S0, [Remove([13]), Clear()]) == -4
    assert depths(ix, keys) == {}
    with pytest.raises(ValueError):
        ix.apply(S0, [Store([1], None, token_ids=[1, 2], block_size=16)])
    with pytest.raises(ValueError):
        ix.store(S0, None, [1, 2], ks(1))


def test_middle_removal_cascades_within_stream_only():
    ix = PrefixIndex()
    ix.store(S0, None, [1, 2, 3, 4], ks(1, 2, 3, 4))
    ix.store(S0, 2, [5, 6], ks(2, 5, 6)[1:])  # a branch below block 2
    ix.store(S1, None, [1, 2, 3, 4], ks(1, 2, 3, 4))
    assert ix.remove(S0, [2]) == 5  # 2, 3, 4 and the branch 5, 6
    assert depths(ix, ks(1, 2, 3, 4)) == {"w0": 1, "w1": 4}
    assert ix.resolve_parent_key(S0, 5) is None
    ix.store(S0, 1, [2, 3], ks(2, 3))  # the engine recomputes: descendants come back with stores
    assert depths(ix, ks(1, 2, 3, 4)) == {"w0": 3, "w1": 4}
    assert ix.remove(S0, [404]) == 0 and ix.stats()["unknown_removes"] == 1
    check_index_invariants(ix)


def test_restore_is_idempotent_and_continues_below_held_block():
    ix = PrefixIndex()
    ix.store(S0, None, [1, 2], ks(1, 2))
    assert ix.store(S0, None, [1, 2, 3], ks(1, 2, 3)) == 1
    assert ix.entries == 3
    ix.remove(S0, [2])
    assert depths(ix, ks(1, 2, 3)) == {"w0": 1}  # 3 hung below 2
    check_index_invariants(ix)


def test_alias_keeps_key_until_last_engine_block_goes():
    ix = PrefixIndex()
    ix.store(S0, None, [1, 2], ks(1, 2))
    ix.store(S0, None, [101, 102], ks(1, 2))  # same content, other namespace
    assert ix.entries == 4 and ix.stats()["unique_blocks"] == 2
    ix.remove(S0, [1])
    assert depths(ix, ks(1, 2)) == {"w0": 2}
    ix.remove(S0, [102])
    assert depths(ix, ks(1, 2)) == {"w0": 1}
    check_index_invariants(ix)
    ix.remove(S0, [101])
    assert depths(ix, ks(1, 2)) == {} and ix.entries == 0


def test_remove_worker_drops_all_ranks_and_speculation():
    ix = PrefixIndex()
    ix.store(("w0", 0), None, [1], ks(1))
    ix.store(("w0", 1), None, [1, 2], ks(1, 2))
    ix.store(S1, None, [1], ks(1))
    ix.speculate("w0", ks(1, 2, 3), now_s=0.0)
    assert ix.remove_worker("w0") == 3
    assert depths(ix, ks(1, 2, 3), now_s=0.0) == {"w1": 1}
    assert ix.workers() == ["w1"] and ix.spec.entries == 0
    check_index_invariants(ix)


# --------------------------------------------------------------------------- budget / LRU
def test_lru_budget_evicts_least_recently_used_leaf_first():
    ix = PrefixIndex(max_entries=64)
    ix.store(S0, None, list(range(1, 33)), ks(*range(1, 33)))  # A: 32 blocks
    ix.store(S0, None, list(range(101, 133)), ks(*range(101, 133)))  # B: 32 blocks
    ix.match(ks(*range(1, 33)))  # A used: B is now the least recently used
    ix.store(S0, None, list(range(201, 217)), ks(*range(201, 217)))  # C: over budget by 16
    assert ix.entries <= 64
    st = ix.stats()
    assert st["evictions"] == 64 + 16 - ix.entries
    assert depths(ix, ks(*range(1, 33))) == {"w0": 32}
    assert depths(ix, ks(*range(201, 217))) == {"w0": 16}
    b = depths(ix, ks(*range(101, 133)))["w0"]
    assert b == 32 - st["evictions"]  # B lost its tail only
    check_index_invariants(ix)


@pytest.mark.parametrize("used", ["X", "Y"])
def test_lru_eviction_is_per_branch(used: str):
    """P+X arrive in one store, Y branches below P: the run splits, so using one branch refreshes
    only it and P; the other branch is the one trimmed."""
    ix = PrefixIndex(max_entries=40)
    p, x, y = ks(*range(1, 11)), ks(*range(11, 26)), ks(*range(31, 46))
    ix.store(S0, None, list(range(1, 26)), p + x)
    ix.store(S0, 10, list(range(31, 46)), y)
    assert ix.entries == 40
    ix.match(p + (x if used == "X" else y))  # the deepest holder's run and its ancestors refreshed
    ix.store(S1, None, [7, 8, 9, 10, 11, 12], ks(*range(50, 56)))
    assert ix.entries == 40 and ix.stats()["evictions"] == 6
    got_x, got_y = depths(ix, p + x)["w0"], depths(ix, p + y)["w0"]
    assert (got_x, got_y) == ((25, 19) if used == "X" else (19, 25))
    check_index_invariants(ix)


def test_touch_limit_and_speculate_refresh():
    ix = PrefixIndex(max_entries=10_000)
    assert ix.touch("nobody", ks(1)) == 0
    ix.store(S0, None, [1, 2, 3], ks(1, 2, 3))
    assert ix.touch("w0", ks(1, 2, 9)) == 2


# --------------------------------------------------------------------------- speculation
def test_speculation_ttl_and_flags():
    ix = PrefixIndex(spec_ttl_s=5.0)
    ix.store(S0, None, [1, 2], ks(1, 2))
    assert ix.speculate("w1", ks(1, 2, 3, 4), now_s=10.0)
    res = ix.match(ks(1, 2, 3, 4), now_s=12.0)
    assert res.get("w1").blocks == 4 and res.get("w1").speculative and res.get("w1").dp_rank is None
    assert res.get("w0").blocks == 2 and not res.get("w0").speculative
    assert [m.worker_id for m in res.top(2)] == ["w1", "w0"]
    assert ix.match(ks(1, 2, 3, 4)).get("w1") is None  # no now_s: events only
    assert ix.match(ks(1, 2, 3, 4), now_s=15.0).get("w1") is None  # expired at 10 + 5
    assert ix.spec.stats()["expired"] == 1


def test_speculation_closed_by_real_store_of_last_block_only():
    ix = PrefixIndex()
    ix.speculate("w0", ks(1, 2, 3), now_s=0.0)
    ix.store(S0, None, [1, 2], ks(1, 2))  # prefill in progress: keep speculating on block 3
    m = ix.match(ks(1, 2, 3), now_s=0.1).get("w0")
    assert m.blocks == 3 and m.speculative
    ix.store(S0, 2, [3], ks(3))
    assert ix.spec.records == 0 and ix.spec.stats()["closed"] == 1
    m = ix.match(ks(1, 2, 3), now_s=0.2).get("w0")
    assert m.blocks == 3 and not m.speculative
    # Already held by events: nothing to speculate.
    assert not ix.speculate("w0", ks(1, 2), now_s=0.3)


def test_speculation_never_pollutes_event_entries():
    ix = PrefixIndex()
    ix.speculate("w0", ks(1, 2), now_s=0.0)
    assert ix.entries == 0 and ix.stats()["unique_blocks"] == 0
    assert ix.resolve_parent_key(S0, 1) is None


def test_approx_index_refresh_budget_and_standalone_match():
    ax = ApproxIndex(max_entries=10, default_ttl_s=100.0)
    ax.insert("a", ks(1, 2, 3), now_s=0.0)
    ax.insert("b", ks(1, 2), now_s=1.0)
    ax.insert("a", ks(1, 2, 3), now_s=2.0)  # refresh, not a new record
    assert ax.records == 2 and ax.stats()["refreshes"] == 1
    res = ax.match(ks(1, 2, 3, 4), now_s=3.0)
    assert {w: m.blocks for w, m in res.to_dict().items()} == {"a": 3, "b": 2}
    ax.insert("c", ks(7, 8, 9, 10, 11, 12), now_s=4.0)  # 11 entries > 10: oldest record goes
    assert ax.entries <= 10 and ax.stats()["evicted_entries"] == 2
    assert ax.match(ks(1, 2), now_s=4.0).get("b") is None  # b was the oldest (a was refreshed)
    assert ax.match(ks(1, 2, 3), now_s=103.0).get("a") is None  # 2 + 100 <= 103
    with pytest.raises(ValueError):
        ApproxIndex(max_entries=0)


# --------------------------------------------------------------------------- results
def test_result_goes_stale_on_mutation_and_to_dict_detaches():
    ix = PrefixIndex()
    ix.store(S0, None, [1], ks(1))
    res = ix.match(ks(1))
    snap = res.to_dict()
    ix.match(ks(1))  # reads (and LRU touches) do not invalidate
    assert res.valid
    ix.store(S1, None, [1], ks(1))
    assert not res.valid
    with pytest.raises(StaleMatchError):
        res.get("w0")
    with pytest.raises(StaleMatchError):
        res.top(1)
    assert snap["w0"].blocks == 1


@pytest.mark.parametrize("n_workers", [5, 300])
def test_top_k_and_levels_many_workers(n_workers: int):
    """Big tied levels go through the sorted-worker fast path; it must equal the definition."""
    ix = PrefixIndex()
    shared = ks(*range(20))
    ids = [f"w{(i * 7919) % 1000:04d}" for i in range(n_workers)]  # not registration order
    for i, wid in enumerate(ids):
        ix.store((wid, 0), None, list(range(20)), shared)
        if i % 3 == 0:  # a second rank deeper on some workers
            ix.store((wid, 1), None, list(range(20)), shared)
            ix.store((wid, 1), 19, [500 + i], [50_000 + i])
    ix.speculate("zz-spec-only", shared[:10], now_s=0.0)
    q = shared + [50_000]
    res = ix.match(q, now_s=0.0)
    d = res.to_dict()
    order = sorted(d.values(), key=lambda m: (-m.blocks, m.worker_id))
    assert d[ids[0]].blocks == 21 and d[ids[0]].dp_rank == 1
    assert d["zz-spec-only"].blocks == 10 and d["zz-spec-only"].speculative
    for k in (1, 2, 3, 8, n_workers + 5):
        assert res.top(k) == order[:k]
    assert [m for _, ms in res.levels() for m in ms] == order
    assert all(m.dp_rank == 0 for m in order if m.blocks == 20)
    # Walk cost is per block, not per worker: two levels whatever the fleet size.
    assert len(res._ed) == 2


def test_approx_top_k_big_level():
    ax = ApproxIndex(max_entries=None)
    for i in range(200):
        ax.insert(f"w{(i * 37) % 200:03d}", ks(1, 2, 3), now_s=0.0)
    ax.insert("w150", ks(1, 2, 3, 4), now_s=0.0)
    res = ax.match(ks(1, 2, 3, 4), now_s=1.0)
    assert [m.worker_id for m in res.top(3)] == ["w150", "w000", "w001"]
    assert [m.blocks for m in res.top(3)] == [4, 3, 3]


def test_stats_fields():
    ix = PrefixIndex(max_entries=100)
    ix.store(S0, None, [1, 2], ks(1, 2))
    st = ix.stats()
    for f in (
        "workers", "streams", "entries", "unique_blocks", "events_applied", "duplicates", "gaps",
        "orphans", "evictions", "bytes_estimate", "spec",
    ):
        assert f in st
    assert (st["workers"], st["streams"], st["entries"], st["unique_blocks"]) == (1, 1, 2, 2)
    assert ix.worker_entries("w0") == 2 and ix.holds("w0", ks(2)[0]) and not ix.holds("w1", ks(2)[0])


def test_bench_smoke():
    out = run_index_bench(
        workers=(4, 16), blocks_per_worker=600, max_total_entries=5_000, queries=50, prompt_blocks=64,
        memory_workers=4, approx_inserts=50,
    )
    assert out["apply_blocks_per_s"] > 0 and out["bytes_per_entry"] > 0
    assert set(out["fleets"]) == {"4", "16"}
    assert out["fleets"]["16"]["match"]["p50_ms"] > 0
