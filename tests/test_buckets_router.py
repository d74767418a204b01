"""BucketRouter: every selection branch, PD pairing, SLO ordering, global cache winner, label
membership for late joiners, bookkeeping, and a property test of the two passes. Pure, fast."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mesh.load import LoadStat
from mesh.routing.bucket_router import BucketRouter
from mesh.routing.buckets import parse_bucket_config
from mesh.routing.cache_policies import CacheAware
from mesh.routing.policies import PowerOfTwo, RoundRobin
from mesh.routing.view import RouteRequest, WorkerState
from tests.fakes import FakeMatch, FakeProvider

# ------------------------------------------------------------------ fixtures


def ws(wid, *, role="mixed", pool=None, labels=None, running=0, waiting=0, wu=0, total=0, used=0, cap=100_000,
       max_running=64, fresh=True, inflight=0):
    lab = dict(labels or {})
    if pool:
        lab["pool"] = pool
    w = WorkerState(wid, role=role, labels=lab, inflight=inflight)
    if fresh:
        w.update_load([LoadStat(running, waiting, used, cap, 0, wu, total, max_running, 0, 0)], 0.0)
    return w


FULL = {"running": 64}  # no free running slot: never admitted


class Pick:
    """Deterministic policy: the first candidate in ``order`` (else the first candidate)."""

    name = "pick"

    def __init__(self, *order, needs_match=False):
        self.order = order
        self.needs_match = needs_match
        self.calls = []

    def choose(self, req, candidates, match, now_s):
        from mesh.routing.view import Decision

        ids = [w.worker_id for w in candidates]
        self.calls.append(ids)
        for wid in self.order:
            if wid in ids:
                return Decision(wid, "picked")
        return Decision(ids[0], "first") if ids else Decision(None, "no_candidates")


def bcfg(*, long_min=4097, short_pending=None, decode=(), **top):
    short = {"id": "short", "stage": "prefill", "rank": 10, "match_labels": {"pool": "short"}, "max_extend_tokens": 4096}
    if short_pending:
        short["max_pending_prefill_tokens"] = short_pending
    long_ = {"id": "long", "stage": "prefill", "rank": 20, "match_labels": {"pool": "long"}, "max_context_tokens": 100_000}
    if long_min is not None:
        long_["min_extend_tokens"] = long_min
    return parse_bucket_config({"buckets": [short, long_, *decode], **top})


def req(L=1000, **kw):
    kw.setdefault("block_size", 16)
    return RouteRequest("r", prompt_tokens=L, **kw)


def router(cfg, policy=None, provider=None, seed=1, **kw):
    return BucketRouter(cfg, policy or PowerOfTwo(random.Random(seed)), provider, rng=random.Random(seed), **kw)


def fleet(**over):
    ws_ = {"s0": ws("s0", pool="short"), "s1": ws("s1", pool="short"), "l0": ws("l0", pool="long"), "l1": ws("l1", pool="long")}
    ws_.update(over)
    return list(ws_.values())


# ------------------------------------------------------------------ domain selection


def test_short_and_long_traffic_stay_apart():
    pool = fleet()
    r = router(bcfg())
    by = {w.worker_id: w for w in pool}
    for i in range(40):
        d = r.route(req(100 + i), pool, 0.0)
        assert d.worker_id in ("s0", "s1") and d.reason == "primary" and d.detail["bucket"] == "short"
        d2 = r.route(req(5000 + i), pool, 0.0)
        assert d2.worker_id in ("l0", "l1") and d2.detail["bucket"] == "long" and d2.detail["pass"] == 1
        r.release(by[d.worker_id], d)
        r.release(by[d2.worker_id], d2)
        for w in pool:  # the next heartbeat: the pending-token correction starts over
            w.update_load([w.load[0]], 0.0)


def test_no_config_is_one_global_domain_over_mixed_workers():
    pool = [ws("m0"), ws("m1"), ws("p0", role="prefill"), ws("d0", role="decode")]
    r = router(None)
    seen = {r.route(req(), pool, 0.0).worker_id for _ in range(50)}
    assert seen == {"m0", "m1"}
    d = r.route(req(), pool, 0.0)
    assert d.detail["bucket"] == "global" and d.decode_worker_id is None


def test_no_worker_only_without_any_compatible_worker():
    r = router(bcfg())
    d = r.route(req(200_000), fleet(), 0.0)  # above every context ceiling
    assert d.worker_id is None and d.reason == "no_worker"
    short_only = [ws("s0", pool="short")]
    assert r.route(req(5000), short_only, 0.0).reason == "no_worker"  # long bucket empty
    assert r.route(req(100), short_only, 0.0).worker_id == "s0"
    assert router(None).route(req(), [], 0.0).reason == "no_worker"


def test_exclude_skips_workers_and_all_excluded_is_no_worker():
    pool = fleet()
    r = router(bcfg())
    for _ in range(20):
        assert r.route(req(), pool, 0.0, exclude={"s0"}).worker_id == "s1"
    assert r.route(req(), pool, 0.0, exclude={"s0", "s1"}).reason == "no_worker"


def test_policy_runs_inside_the_domain_only():
    pool = fleet(s2=ws("s2", pool="short"))
    r = router(bcfg(), RoundRobin())
    assert [r.route(req(), pool, 0.0).worker_id for _ in range(4)] == ["s0", "s1", "s2", "s0"]


# ------------------------------------------------------------------ pass 1 branches


def test_primary_when_both_admitted():
    pool = fleet()
    d = router(bcfg(), Pick("s1")).route(req(), pool, 0.0)
    assert (d.worker_id, d.reason, d.detail["policy_reason"], d.detail["pass"]) == ("s1", "primary", "picked", 1)


def test_backup_pressure_guard():
    pool = fleet(s1=ws("s1", pool="short", wu=5000))
    d = router(bcfg(), Pick("s1")).route(req(), pool, 0.0)
    assert (d.worker_id, d.reason) == ("s0", "backup_pressure_guard")
    d = router(bcfg(), Pick("s1"), pressure_guard=False).route(req(), pool, 0.0)
    assert (d.worker_id, d.reason) == ("s1", "primary")
    d = router(bcfg(), Pick("s1"), pressure_rel_threshold=10.0).route(req(), pool, 0.0)
    assert d.worker_id == "s1"


def test_pressure_guard_never_throws_away_a_cache_hit():
    pool = fleet(s1=ws("s1", pool="short", wu=5000))
    prov = FakeProvider(FakeMatch({"s1": 100}))  # 1600 cached tokens on the loaded primary
    d = router(bcfg(), Pick("s1", needs_match=True), prov, global_cache_winner=False).route(req(2000), pool, 0.0)
    assert (d.worker_id, d.reason, d.matched_blocks, d.uncached_tokens) == ("s1", "primary", 100, 400)
    prov = FakeProvider(FakeMatch({"s1": 20}))  # 320 tokens: within the switch margin, guard applies
    d = router(bcfg(), Pick("s1", needs_match=True), prov, global_cache_winner=False).route(req(2000), pool, 0.0)
    assert (d.worker_id, d.reason) == ("s0", "backup_pressure_guard")


def test_backup_primary_admission():
    pool = fleet(s1=ws("s1", pool="short", **FULL))
    d = router(bcfg(), Pick("s1")).route(req(), pool, 0.0)
    assert (d.worker_id, d.reason, d.detail["pass"]) == ("s0", "backup_primary_admission", 1)


def test_range_fallback_runs_the_policy_over_admitted_workers():
    # primary s1 full; the backup sample {s0, s2} keeps s0 (less queued) but s0 is out of slots
    pool = fleet(s1=ws("s1", pool="short", **FULL), s0=ws("s0", pool="short", **FULL), s2=ws("s2", pool="short", wu=100))
    pol = Pick("s1")
    d = router(bcfg(), pol).route(req(), pool, 0.0)
    assert (d.worker_id, d.reason, d.detail["pass"]) == ("s2", "range_fallback", 1)
    assert pol.calls[-1] == ["s2"]  # the policy saw only the admitted workers


def test_queue_limit_admission_per_bucket():
    pool = fleet(s0=ws("s0", pool="short", wu=9_500), s1=ws("s1", pool="short", wu=8_000))
    d = router(bcfg(short_pending=10_000), Pick("s0")).route(req(1000), pool, 0.0)
    assert (d.worker_id, d.reason) == ("s1", "backup_primary_admission")  # 9500+1000 > 10000, 8000+1000 fits


def test_next_bucket_in_pass_1_before_any_fallback():
    # long accepts short prompts too (no min): a full short bucket spills into long, still pass 1
    pool = fleet(s0=ws("s0", pool="short", **FULL), s1=ws("s1", pool="short", **FULL))
    d = router(bcfg(long_min=None)).route(req(100), pool, 0.0)
    assert d.worker_id in ("l0", "l1") and d.reason == "primary" and d.detail["bucket"] == "long" and d.detail["pass"] == 1


def test_pass_2_when_every_compatible_bucket_is_full():
    full = {k: ws(k, pool=p, **FULL) for k, p in (("s0", "short"), ("s1", "short"), ("l0", "long"), ("l1", "long"))}
    full["s1"] = ws("s1", pool="short", running=64, wu=50)
    pool = list(full.values())
    d = router(bcfg(long_min=None)).route(req(100), pool, 0.0)
    assert (d.worker_id, d.reason, d.detail["pass"], d.detail["bucket"]) == ("s0", "capacity_fallback_power_of_two", 2, "short")


def test_fail_open_without_telemetry():
    pool = [ws("s0", pool="short", fresh=False), ws("s1", pool="short", fresh=False, inflight=5)]
    r = router(bcfg(short_pending=1))
    d = r.route(req(3000), pool, 0.0)
    assert d.reason == "primary" and d.worker_id == "s0"  # admitted although over the queue limit
    stale = [ws("s0", pool="short", **FULL), ws("s1", pool="short", **FULL)]
    assert r.route(req(), stale, 10.0).reason == "primary"  # 10 s later their LoadStat is stale


# ------------------------------------------------------------------ bookkeeping


def test_dispatch_bookkeeping_and_release_like_router():
    pool = fleet()
    prov = FakeProvider(FakeMatch({"s0": 10}))
    r = router(bcfg(), Pick("s0", needs_match=True), prov, global_cache_winner=False)
    d = r.route(req(1000), pool, 0.0)
    s0 = pool[0]
    assert d.uncached_tokens == 840 and d.matched_blocks == 10
    assert (s0.inflight, s0.outstanding_prefill_tokens, s0.pending_since_load_tokens) == (1, 840, 840)
    assert prov.routed == ["s0"]
    r.release(s0, d)
    assert (s0.inflight, s0.outstanding_prefill_tokens) == (0, 0)
    d = r.route(req(200_000), pool, 0.0)
    assert d.worker_id is None and prov.routed == ["s0"]


def test_membership_is_computed_once_per_pool_version():
    pool = fleet()
    r = router(bcfg())
    r.route(req(), pool, 0.0)
    m = r._members(pool)
    r.route(req(5000), pool, 0.0)
    assert r._members(pool) is m
    other = list(pool)  # a new list (the registry's next version, or another model's pool)
    r.route(req(), other, 0.0)
    assert r._members(other) is not m and r._members(pool) is m


# ------------------------------------------------------------------ label membership


def test_late_joiner_falls_into_its_bucket_by_labels():
    r = router(bcfg())
    pool = [ws("s0", pool="short", wu=5000)]
    assert r.route(req(), pool, 0.0).worker_id == "s0"
    pool = [*pool, ws("s9", pool="short")]  # registry builds a new list on membership change
    assert r.members(pool)["short"] == ["s0", "s9"]
    for _ in range(10):
        d = r.route(req(), pool, 0.0)
        assert d.worker_id == "s9"  # the less pressured newcomer
        r.release(pool[1], d)
    pool = [*pool, ws("x", pool="other"), ws("y")]
    assert r.members(pool)["short"] == ["s0", "s9"] and r.members(pool)["long"] == []


def test_explicit_ids_win_over_selectors_and_lower_rank_selector_wins():
    cfg = parse_bucket_config({"buckets": [
        {"id": "a", "stage": "prefill", "rank": 10, "match_labels": {"pool": "short"}},
        {"id": "b", "stage": "prefill", "rank": 20, "match_labels": {"zone": "z"}, "worker_ids": ["w-3"]},
    ]})
    pool = [ws("w-1", labels={"pool": "short", "zone": "z"}), ws("w-2", labels={"zone": "z"}), ws("w-3", pool="short")]
    m = router(cfg).members(pool)
    assert m["a"] == ["w-1"] and m["b"] == ["w-2", "w-3"]


# ------------------------------------------------------------------ SLO


def test_invalid_slo_is_bad_slo():
    pool = fleet()
    r = router(bcfg())
    for kw in ({"ttft_slo_ms": 0}, {"ttft_slo_ms": 1.5}, {"tps_slo": -1.0}, {"tps_slo": float("inf")}):
        d = r.route(req(**kw), pool, 0.0)
        assert d.worker_id is None and d.reason == "bad_slo" and "slo" in d.detail["error"]
    assert pool[0].inflight == pool[1].inflight == 0


@pytest.mark.parametrize("policy,slo,bucket", [
    ("disabled", 200, "slow"),
    ("slo_first", 200, "fast"),
    ("best_effort", 200, "slow"),
    ("slo_first", None, "slow"),
    ("best_effort", None, "slow"),
])
def test_ttft_slo_policy_orders_buckets(policy, slo, bucket):
    cfg = parse_bucket_config({"ttft_slo_policy": policy, "buckets": [
        {"id": "slow", "stage": "prefill", "rank": 10, "worker_ids": ["a"], "ttft_p95_at_capacity_ms": 1000},
        {"id": "fast", "stage": "prefill", "rank": 20, "worker_ids": ["b"], "ttft_p95_at_capacity_ms": 100},
    ]})
    d = router(cfg).route(req(ttft_slo_ms=slo), [ws("a"), ws("b")], 0.0)
    assert d.detail["bucket"] == bucket


@pytest.mark.parametrize("policy,slo,bucket", [
    ("disabled", 50.0, "d-slow"),
    ("slo_first", 50.0, "d-fast"),
    ("best_effort", 50.0, "d-slow"),
])
def test_tps_slo_policy_orders_decode_buckets(policy, slo, bucket):
    cfg = parse_bucket_config({"tps_slo_policy": policy, "buckets": [
        {"id": "p", "stage": "prefill", "rank": 1, "worker_ids": ["p0"]},
        {"id": "d-slow", "stage": "decode", "rank": 10, "worker_ids": ["d0"], "tps_p05_at_capacity": 10.0},
        {"id": "d-fast", "stage": "decode", "rank": 20, "worker_ids": ["d1"], "tps_p05_at_capacity": 100.0},
    ]})
    pool = [ws("p0", role="prefill"), ws("d0", role="decode"), ws("d1", role="decode")]
    d = router(cfg, pd=True).route(req(tps_slo=slo), pool, 0.0)
    assert d.detail["decode_bucket"] == bucket


# ------------------------------------------------------------------ prefill/decode pairing


def pd_fleet(**over):
    ws_ = {
        "p0": ws("p0", role="prefill", pool="short", labels={"stage": "prefill", "host": "h0"}),
        "p1": ws("p1", role="prefill", pool="short", labels={"stage": "prefill", "host": "h1"}),
        "p2": ws("p2", role="prefill", pool="long", labels={"stage": "prefill"}),
        "d0": ws("d0", role="decode", labels={"stage": "decode", "host": "h0"}, running=10),
        "d1": ws("d1", role="decode", labels={"stage": "decode", "host": "h1"}, running=2),
        "m0": ws("m0", pool="short"),
    }
    ws_.update(over)
    return list(ws_.values())


DEC = ({"id": "dec", "stage": "decode", "rank": 10, "match_labels": {"stage": "decode"}},)


def test_pd_picks_prefill_and_decode_independently():
    pool = pd_fleet()
    by = {w.worker_id: w for w in pool}
    r = router(bcfg(decode=DEC), pd=True)
    prefills = set()
    for _ in range(30):
        d = r.route(req(500, max_new_tokens=100), pool, 0.0)
        prefills.add(d.worker_id)
        assert d.decode_worker_id == "d1"  # least decode pressure, whichever prefill worker won
        assert d.detail["decode_reason"] == "primary" and d.detail["decode_bucket"] == "dec"
        assert isinstance(d.detail["bootstrap_room"], int)
        r.release(by[d.worker_id], d)
        r.release(by[d.decode_worker_id], d)
    assert prefills == {"p0", "p1"}  # prefill-role workers of the short bucket only, never m0


def test_pd_bookkeeping_on_both_sides_and_release():
    pool = pd_fleet()
    by = {w.worker_id: w for w in pool}
    r = router(bcfg(decode=DEC), Pick("p0"), pd=True)
    d = r.route(req(500, max_new_tokens=100), pool, 0.0)
    assert (d.worker_id, d.decode_worker_id) == ("p0", "d1")
    assert by["p0"].inflight == 1 and by["p0"].outstanding_prefill_tokens == 500
    assert by["d1"].inflight == 1 and d.detail["decode_kv_tokens"] == 600
    r.release(by["d1"], d)
    r.release(by["p0"], d)
    assert by["d1"].inflight == by["p0"].inflight == 0
    assert by["d1"].outstanding_prefill_tokens == by["p0"].outstanding_prefill_tokens == 0


def test_pd_without_decode_buckets_uses_the_global_decode_pool():
    d = router(bcfg(), pd=True).route(req(), pd_fleet(), 0.0)
    assert d.decode_worker_id == "d1" and d.detail["decode_bucket"] == "global"
    d = router(None, pd=True).route(req(), pd_fleet(), 0.0)
    assert d.worker_id in ("p0", "p1", "p2") and d.decode_worker_id == "d1"


def test_no_decode_worker_and_no_bookkeeping():
    pool = [w for w in pd_fleet() if w.role != "decode"]
    r = router(bcfg(decode=DEC), pd=True)
    d = r.route(req(), pool, 0.0)
    assert d.worker_id is None and d.reason == "no_decode_worker"
    assert all(w.inflight == 0 for w in pool)
    ranged = ({"id": "dec", "stage": "decode", "rank": 10, "match_labels": {"stage": "decode"}, "max_sequence_tokens": 1000},)
    r = router(bcfg(decode=ranged), pd=True)
    assert r.route(req(500, max_new_tokens=400), pd_fleet(), 0.0).decode_worker_id is not None
    assert r.route(req(500, max_new_tokens=600), pd_fleet(), 0.0).reason == "no_decode_worker"  # none fits
    assert r.route(req(500, max_new_tokens=None), pd_fleet(), 0.0).reason == "no_decode_worker"  # only catch-all qualifies
    assert router(bcfg(decode=DEC), pd=True).route(req(), pd_fleet(), 0.0, exclude={"d0", "d1"}).reason == "no_decode_worker"


def test_decode_range_fallback_and_capacity_fallback():
    dfull = {"running": 64}
    # d0 lacks KV room for 500 + 100 tokens; sampled pairs including it fall back to the admitted set
    reasons = set()
    for seed in range(10):
        pool = pd_fleet(d0=ws("d0", role="decode", labels={"stage": "decode"}, running=0, total=99_500),
                        d2=ws("d2", role="decode", labels={"stage": "decode"}, running=30))
        d = router(bcfg(decode=DEC), pd=True, seed=seed).route(req(500, max_new_tokens=100), pool, 0.0)
        assert d.decode_worker_id == "d1"
        reasons.add(d.detail["decode_reason"])
    assert "range_fallback" in reasons
    pool = pd_fleet(d0=ws("d0", role="decode", labels={"stage": "decode"}, **dfull),
                    d1=ws("d1", role="decode", labels={"stage": "decode"}, waiting=3, **dfull))
    d = router(bcfg(decode=DEC), pd=True).route(req(), pool, 0.0)
    assert (d.decode_worker_id, d.detail["decode_reason"], d.detail["decode_pass"]) == ("d0", "capacity_fallback_power_of_two", 2)
    assert d.worker_id is not None and d.reason == "primary"  # prefill side unaffected


def test_decode_legacy_host_affinity():
    r = router(bcfg(decode=DEC), Pick("p0"), pd=True, decode_policy="legacy_host_affinity")
    d = r.route(req(), pd_fleet(), 0.0)
    assert (d.worker_id, d.decode_worker_id, d.detail["decode_reason"]) == ("p0", "d0", "host_affinity")
    with pytest.raises(ValueError):
        router(bcfg(), decode_policy="nope")


# ------------------------------------------------------------------ global cache winner (#38814)


def cache_router(match, *, on=True, policy=None, **kw):
    return router(bcfg(), policy or CacheAware(random.Random(0)), FakeProvider(match), global_cache_winner=on, **kw)


def test_global_cache_winner_is_routed_regardless_of_bucket():
    pool = fleet()
    m = FakeMatch({"l0": 100})  # 1600 cached tokens of a short (2000-token) prompt on a long worker
    d = cache_router(m).route(req(2000), pool, 0.0)
    assert (d.worker_id, d.reason, d.detail["bucket"], d.detail["cache"]) == ("l0", "cache_candidate", "long", "winner")
    assert d.uncached_tokens == 400
    d = cache_router(m, on=False).route(req(2000), pool, 0.0)
    assert d.worker_id in ("s0", "s1") and d.detail["cache"] == "off"  # cache_aware inside the short domain only
    d = router(bcfg(), PowerOfTwo(random.Random(0)), FakeProvider(m)).route(req(2000), pool, 0.0)
    assert d.detail["cache"] == "off" and d.worker_id in ("s0", "s1")  # load-only policy: no tournament


def test_cache_winner_gate_admission_and_context():
    pool = fleet()
    d = cache_router(FakeMatch({"l0": 60})).route(req(2000), pool, 0.0)  # 960 tokens < 1024
    assert d.detail["cache"] == "none" and d.worker_id in ("s0", "s1")
    pool = fleet(l0=ws("l0", pool="long", **FULL))
    d = cache_router(FakeMatch({"l0": 100})).route(req(2000), pool, 0.0)
    assert d.detail["cache"] == "rejected" and d.worker_id in ("s0", "s1") and d.reason != "cache_candidate"
    cfg = parse_bucket_config({"buckets": [
        {"id": "short", "stage": "prefill", "rank": 10, "match_labels": {"pool": "short"}},
        {"id": "tiny", "stage": "prefill", "rank": 20, "match_labels": {"pool": "long"}, "max_context_tokens": 1000}]})
    r = router(cfg, CacheAware(random.Random(0)), FakeProvider(FakeMatch({"l0": 100})))
    assert r.route(req(2000), fleet(), 0.0).worker_id in ("s0", "s1")  # l0's context ceiling is 1000
    d = cache_router(FakeMatch({"l0": 100, "s1": 90})).route(req(2000), fleet(), 0.0, exclude={"l0"})
    assert (d.worker_id, d.reason) == ("s1", "cache_candidate")


def test_cache_tournament_near_tie_guard_and_work_gap():
    pool = fleet(l0=ws("l0", pool="long", wu=6000))
    m = FakeMatch({"l0": 100, "s1": 80})  # E = 400 vs 720: near tie
    d = cache_router(m).route(req(2000), pool, 0.0)
    assert d.worker_id == "s1" and d.reason == "cache_candidate"  # guard: l0 materially more queued
    d = cache_router(m, pressure_guard=False).route(req(2000), fleet(l0=ws("l0", pool="long", wu=6000)), 0.0)
    assert d.worker_id == "l0"  # no guard: smaller E wins
    m = FakeMatch({"l0": 200, "s1": 70})  # E = 100 vs 2180: s1 is not a near tie, pressure cannot help it
    d = cache_router(m).route(req(3300), fleet(l0=ws("l0", pool="long", wu=6000)), 0.0)
    assert d.worker_id == "l0"


def test_cache_candidates_are_bounded_to_k():
    pool = fleet(l0=ws("l0", pool="long", **FULL))
    m = FakeMatch({"l0": 100, "l1": 90})
    d = cache_router(m, cache_candidate_min_workers=1, cache_candidate_max_workers=1).route(req(2000), pool, 0.0)
    assert d.detail["cache"] == "rejected"  # only the deepest (full) candidate was considered
    d = cache_router(m).route(req(2000), fleet(l0=ws("l0", pool="long", **FULL)), 0.0)
    assert (d.worker_id, d.reason) == ("l1", "cache_candidate")


def test_degraded_when_provider_has_no_answer():
    d = cache_router(None).route(req(2000), fleet(), 0.0)
    assert d.degraded and d.worker_id in ("s0", "s1") and d.detail["cache"] == "none"


# ------------------------------------------------------------------ property: the two passes


def _admitted(w: WorkerState, L: int, limit):
    ls = w.load[0] if w.load else None
    if ls is None:
        return True  # fail open
    return (ls.num_running_reqs + 1 <= ls.max_running_requests and ls.num_total_tokens + L <= ls.max_total_num_tokens
            and (limit is None or ls.num_waiting_uncached_tokens + L <= limit))


worker_st = st.fixed_dictionaries({
    "pool": st.sampled_from(["short", "long", "other"]),
    "fresh": st.booleans(),
    "running": st.integers(0, 4),
    "max_running": st.integers(1, 4),
    "total": st.integers(0, 20_000),
    "wu": st.integers(0, 20_000),
})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workers=st.lists(worker_st, min_size=1, max_size=8),
    L=st.integers(1, 12_000),
    short_max=st.integers(1, 8_000),
    long_min=st.none() | st.integers(0, 8_000),
    pend=st.none() | st.integers(1, 25_000),
    ctx=st.none() | st.integers(1, 15_000),
    excl=st.sets(st.integers(0, 7), max_size=3),
    cache=st.none() | st.dictionaries(st.integers(0, 7), st.integers(0, 800), max_size=4),
    winner=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pass_2_only_when_no_compatible_bucket_has_an_admitted_worker(workers, L, short_max, long_min, pend, ctx, excl, cache, winner, seed):
    short = {"id": "short", "stage": "prefill", "rank": 10, "match_labels": {"pool": "short"}, "max_extend_tokens": short_max}
    if pend:
        short["max_pending_prefill_tokens"] = pend
    long_ = {"id": "long", "stage": "prefill", "rank": 20, "match_labels": {"pool": "long"}}
    if long_min is not None:
        long_["min_extend_tokens"] = long_min
    if ctx is not None:
        long_["max_context_tokens"] = ctx
    cfg = parse_bucket_config({"buckets": [short, long_]})
    pool = []
    for i, p in enumerate(workers):
        pool.append(ws(f"w-{i}", pool=p["pool"], fresh=p["fresh"], running=p["running"], max_running=p["max_running"],
                       total=p["total"], wu=p["wu"], cap=20_000))
    exclude = {f"w-{i}" for i in excl}
    if cache is None:
        r = router(cfg, PowerOfTwo(random.Random(seed)), seed=seed)
    else:
        m = FakeMatch({f"w-{i}": b for i, b in cache.items()})
        r = router(cfg, CacheAware(random.Random(seed)), FakeProvider(m), seed=seed, global_cache_winner=winner)
    d = r.route(req(L), pool, 0.0, exclude=exclude)
    event(d.reason)

    compatible = []  # (worker, bucket limit) of every compatible, live, non-excluded member
    for spec in cfg.prefill:
        if spec.fits_prefill(L):
            compatible += [(w, spec.max_pending_prefill_tokens) for w in pool
                           if spec.selects(w.labels) and w.worker_id not in exclude]
    any_admitted = any(_admitted(w, L, lim) for w, lim in compatible)
    if d.reason == "cache_candidate":  # #38814: an admitted cache winner goes regardless of bucket
        assert cache is not None and winner and d.worker_id not in exclude
        return
    if not compatible:
        assert d.worker_id is None and d.reason == "no_worker"
        return
    assert d.worker_id is not None and d.worker_id not in exclude
    chosen = {w.worker_id: lim for w, lim in compatible}
    assert d.worker_id in chosen
    if any_admitted:
        assert d.detail["pass"] == 1 and d.reason != "capacity_fallback_power_of_two"
        w = next(w for w, _ in compatible if w.worker_id == d.worker_id)
        assert _admitted(w, L, chosen[d.worker_id])
    else:
        assert d.detail["pass"] == 2 and d.reason == "capacity_fallback_power_of_two"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    decoders=st.lists(worker_st, min_size=0, max_size=6),
    L=st.integers(1, 6_000),
    max_new=st.none() | st.integers(0, 6_000),
    seq_max=st.none() | st.integers(1, 10_000),
    catch_all=st.booleans(),
    excl=st.sets(st.integers(0, 5), max_size=2),
    seed=st.integers(0, 2**16),
)
def test_decode_pass_2_only_when_no_compatible_decode_worker_is_admitted(decoders, L, max_new, seq_max, catch_all, excl, seed):
    buckets = [{"id": "p", "stage": "prefill", "rank": 1, "worker_ids": ["p0"]}]
    ranged = {"id": "ranged", "stage": "decode", "rank": 10, "match_labels": {"pool": "short"}}
    if seq_max is not None:
        ranged["max_sequence_tokens"] = seq_max
    buckets.append(ranged)
    if catch_all:
        buckets.append({"id": "all", "stage": "decode", "rank": 20, "match_labels": {"pool": "long"}})
    cfg = parse_bucket_config({"buckets": buckets})
    pool = [ws("p0", role="prefill")]
    for i, p in enumerate(decoders):
        pool.append(ws(f"d-{i}", role="decode", pool=p["pool"], fresh=p["fresh"], running=p["running"],
                       max_running=p["max_running"], total=p["total"], cap=20_000))
    exclude = {f"d-{i}" for i in excl}
    d = router(cfg, pd=True, seed=seed).route(req(L, max_new_tokens=max_new), pool, 0.0, exclude=exclude)
    T = L + (max_new or 0)
    S = None if max_new is None else L + max_new
    compatible = [w for w in pool[1:] for spec in cfg.decode
                  if spec.fits_decode(L, S) and spec.selects(w.labels) and w.worker_id not in exclude]
    event(d.detail.get("decode_reason", d.reason))
    if not compatible:
        assert d.worker_id is None and d.reason == "no_decode_worker"
        assert pool[0].inflight == 0
        return
    assert d.worker_id == "p0" and d.decode_worker_id in {w.worker_id for w in compatible}
    if any(_admitted(w, T, None) for w in compatible):
        assert d.detail["decode_pass"] == 1
        assert _admitted(next(w for w in compatible if w.worker_id == d.decode_worker_id), T, None)
    else:
        assert d.detail["decode_reason"] == "capacity_fallback_power_of_two"
