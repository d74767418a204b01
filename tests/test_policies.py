"""Unit tests for every routing policy branch (pure: hand-made fleet views and matches)."""

from __future__ import annotations

import random

import pytest

from mesh.load import LoadStat
from mesh.routing.cache_policies import CacheAware, CacheAwareGreedy
from mesh.routing.policies import PowerOfTwo, RandomPolicy, RoundRobin
from mesh.routing.router import Router, make_policy
from mesh.routing.view import RouteRequest, WorkerState
from tests.fakes import FakeMatch, FakeProvider
from tests.policy_support import req, ws


# ------------------------------------------------------------------ classic policies

def test_round_robin_cycles_and_empty():
    p = RoundRobin()
    pool = [ws("a"), ws("b"), ws("c")]
    assert [p.choose(req(), pool, None, 0).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert p.choose(req(), [], None, 0).worker_id is None


def test_random_is_seeded():
    pool = [ws(str(i)) for i in range(10)]
    a = [RandomPolicy(random.Random(3)).choose(req(), pool, None, 0).worker_id for _ in range(5)]
    b = [RandomPolicy(random.Random(3)).choose(req(), pool, None, 0).worker_id for _ in range(5)]
    assert a == b


def test_power_of_two_prefers_less_pressured():
    pool = [ws("busy", running=50), ws("idle")]
    p = PowerOfTwo(random.Random(0))
    assert all(p.choose(req(), pool, None, 0.1).worker_id == "idle" for _ in range(20))
    # stale telemetry falls back to the router's own in-flight counts
    stale = [ws("x", running=50, inflight=0, at=-100.0), ws("y", running=0, inflight=3, at=-100.0)]
    assert p.choose(req(), stale, None, 0.0).worker_id == "x"
    assert p.choose(req(), [ws("only")], None, 0).worker_id == "only"


def test_pressure_corrects_stale_snapshot_with_local_dispatches():
    w = ws("a", running=2, waiting=1, inflight=0)
    assert w.pressure(0.1, 5.0) == 3
    w.record_dispatch(100)
    w.record_dispatch(100)
    assert w.pressure(0.1, 5.0) == 5
    w.record_release(100)
    assert w.pressure(0.1, 5.0) == 4 and w.outstanding_prefill_tokens == 100


# ------------------------------------------------------------------ greedy (SGLang threshold policy)

def test_greedy_imbalance_fast_path():
    pool = [ws("hot", running=100), ws("cold", running=1)]
    m = FakeMatch({"hot": 128}, 128)
    d = CacheAwareGreedy().choose(req(), pool, m, 0.1)
    assert (d.worker_id, d.reason) == ("cold", "imbalance_min_load")


def test_greedy_cache_hit_above_threshold_picks_least_loaded_matched():
    pool = [ws("a", running=5), ws("b", running=3), ws("c", running=0)]
    m = FakeMatch({"a": 100, "b": 90}, 128)
    d = CacheAwareGreedy().choose(req(), pool, m, 0.1)
    assert (d.worker_id, d.reason) == ("b", "cache_hit")


def test_greedy_below_threshold_goes_min_load():
    pool = [ws("a", running=5), ws("b", running=3)]
    m = FakeMatch({"a": 10}, 128)
    d = CacheAwareGreedy().choose(req(), pool, m, 0.1)
    assert (d.worker_id, d.reason) == ("b", "cache_miss_min_load")


# ------------------------------------------------------------------ cache_aware cost policy

def test_cost_prefers_cache_holder_when_loads_equal():
    pool = [ws("a"), ws("b"), ws("c")]
    m = FakeMatch({"b": 120}, 128)
    d = CacheAware(temperature=0.0, temperature_ms=0.0, cost_ties="always").choose(req(), pool, m, 0.1)
    assert (d.worker_id, d.reason) == ("b", "cache_hit")
    assert d.matched_blocks == 120 and d.detail["uncached_tokens"] == 2048 - 1920


def test_cost_overrides_cache_when_holder_queue_is_long():
    # b holds the prefix but has 200k uncached tokens queued: 8 s of prefill; a is idle.
    pool = [ws("a"), ws("b", wu=200_000, waiting=40)]
    m = FakeMatch({"b": 120}, 128)
    d = CacheAware(temperature=0.0, temperature_ms=0.0, cost_ties="always").choose(req(), pool, m, 0.1)
    assert (d.worker_id, d.reason) == ("a", "load_override")


def test_cost_miss_goes_to_least_queued():
    pool = [ws("a", wu=5000), ws("b", wu=100), ws("c", wu=3000)]
    d = CacheAware(temperature=0.0, temperature_ms=0.0, cost_ties="always").choose(req(), pool, FakeMatch({}, 128), 0.1)
    assert (d.worker_id, d.reason) == ("b", "cache_miss_min_load")


def test_cost_decode_pressure_term():
    pool = [ws("a", running=200, used=300_000), ws("b", running=2)]
    d = CacheAware(temperature=0.0, temperature_ms=0.0, cost_ties="always").choose(req(), pool, FakeMatch({}, 128), 0.1)
    assert d.worker_id == "b"
    cm = CacheAware(temperature=0.0, temperature_ms=0.0, cost_ties="always")
    assert cm.predicted_ttft_ms(pool[0], 2048, 2048, 0.1) > cm.predicted_ttft_ms(pool[1], 2048, 2048, 0.1)


def test_cost_kv_full_penalty():
    full = ws("full", used=399_000)
    free = ws("free", wu=20_000)
    d = CacheAware(temperature=0.0, temperature_ms=0.0, cost_ties="always").choose(req(), [full, free], FakeMatch({"full": 120}, 128), 0.1)
    assert d.worker_id == "free"


def test_cost_fail_open_uses_local_outstanding_tokens():
    a, b = WorkerState("a"), WorkerState("b")  # no telemetry at all
    a.record_dispatch(50_000)
    d = CacheAware(temperature=0.0, temperature_ms=0.0, cost_ties="always").choose(req(), [a, b], FakeMatch({}, 128), 0.0)
    assert d.worker_id == "b"


def test_cost_ties_spread_deterministically_and_temperature_samples():
    pool = [ws(f"w{i}") for i in range(8)]
    p = CacheAware(temperature=0.0, temperature_ms=0.0, cost_ties="always")
    picks = [p.choose(RouteRequest(f"r{i}", 2048, block_size=16), pool, FakeMatch({}, 128), 0.1).worker_id for i in range(40)]
    assert len(set(picks)) >= 4  # idle ties are spread over the fleet, not all on the lowest id
    assert picks == [p.choose(RouteRequest(f"r{i}", 2048, block_size=16), pool, FakeMatch({}, 128), 0.1).worker_id for i in range(40)]
    # the pure cost policy's softmax: the clearly cheaper worker wins most of the time, the other sometimes
    two = [ws("cheap"), ws("dear", wu=5_000)]  # ~100 ms more queued prefill once drained to now
    hot = CacheAware(random.Random(1), affinity_threshold=0.0)
    picks2 = [hot.choose(req(), two, FakeMatch({}, 128), 0.1).worker_id for _ in range(200)]
    assert picks2.count("cheap") > 150 and picks2.count("dear") > 3, picks2.count("cheap")


def test_a_miss_goes_to_the_shortest_prefill_queue_then_the_least_loaded():
    """A miss waits for the prefill queued ahead of it, not for the requests decoding beside it."""
    now = 0.01  # 10 ms after the snapshots: 250 tokens of each queue drained at 25k tokens/s
    a = ws("a", running=2, wu=5_000, at=0.0)  # equal request counts; a has ~190 ms of prefill queued
    b = ws("b", running=3, at=0.0)  # one request more, nothing queued
    miss = FakeMatch({}, 128)
    assert CacheAware().choose(req(), [a, b], miss, now).worker_id == "b"
    assert CacheAwareGreedy().choose(req(), [a, b], miss, now).worker_id == "a"  # by requests
    assert CacheAware(miss_queue_ms=0).choose(req(), [a, b], miss, now).worker_id == "a"  # greedy's rule
    # queues within the same 5 ms count as equal: then the least loaded, then the lowest id
    c = ws("c", running=2, wu=300, at=0.0)  # ~2 ms queued once drained
    assert CacheAware().choose(req(), [b, c], miss, now).worker_id == "c"
    assert CacheAware().choose(req(), [ws("d", running=1), ws("e", running=1)], miss, now).worker_id == "d"
    # a holder of the prompt is not a miss: its queue does not send the request away
    assert CacheAware().choose(req(), [a, b], FakeMatch({"a": 128}, 128), now).worker_id == "a"
    # what this router sent since the snapshot counts as queued too (the exchange adds its peers')
    f, g = ws("f", at=0.0), ws("g", at=0.0)
    f.record_dispatch(4_000)
    assert CacheAware().choose(req(), [f, g], miss, now).worker_id == "g"
    # only among the workers within one request of the least loaded: near saturation the request
    # balance decides (an idle queue two requests above the least loaded does not win)
    h, k = ws("h", running=1, wu=5_000, at=0.0), ws("k", running=3, at=0.0)
    assert CacheAware().choose(req(), [h, k], miss, now).worker_id == "h"
    assert CacheAware(miss_load_band=2).choose(req(), [h, k], miss, now).worker_id == "k"
    # an imbalance is corrected by request count, as greedy does, whatever the queues
    big = [ws("m", running=40, at=0.0), ws("n", running=2, wu=5_000, at=0.0), ws("o", running=3, at=0.0)]
    assert CacheAware().choose(req(), big, FakeMatch({"m": 128}, 128), now).worker_id == "n"
    with pytest.raises(ValueError, match="miss_queue_ms"):
        CacheAware(miss_queue_ms=-1)
    with pytest.raises(ValueError, match="miss_load_band"):
        CacheAware(miss_load_band=-1)


def test_a_miss_among_equal_workers_goes_where_the_fleet_has_sent_the_least():
    """The miss rule's last tie-break: among workers with the same prefill queue and load, the
    one the routers (this one and, through the exchange, its peers) have sent the least prefill
    work so far, not the lowest id: on an idle fleet new prefixes spread over the engines
    instead of stacking on the first ids."""
    now = 0.01
    miss = FakeMatch({}, 128)
    a, b = ws("a"), ws("b")
    a.record_dispatch(2_048)
    a.record_release(2_048)  # finished: a is idle again (its LoadStat says so), but it holds a prefix
    a.update_load([LoadStat(0, 0, 0, 400_000, 0, 0, 0, 256, 0, 0)], 0.005)
    assert CacheAware().queued_prefill_ms(a, now) == CacheAware().queued_prefill_ms(b, now) == 0
    assert CacheAware().choose(req(), [a, b], miss, now).worker_id == "b"
    assert CacheAware(miss_order="id").choose(req(), [a, b], miss, now).worker_id == "a"
    assert CacheAwareGreedy().choose(req(), [a, b], miss, now).worker_id == "a"
    # what peers report sending counts as the fleet's too
    b.apply_peer_change(0, 0, 4_096)
    b.apply_peer_change(0, 0, 0)
    assert b.fleet_sent_tokens == 4_096 and a.fleet_sent_tokens == 2_048
    assert CacheAware().choose(req(), [a, b], miss, now).worker_id == "a"
    # only a tie-break: a shorter queue or a lower load still wins, and a holder is no miss
    assert CacheAware().choose(req(), [ws("d", running=2, wu=5_000, at=0.0), a], miss, now).worker_id == "a"
    assert CacheAware().choose(req(), [ws("e", running=1), a], miss, now).worker_id == "a"
    assert CacheAware().choose(req(), [b, ws("f")], FakeMatch({"b": 128}, 128), now).worker_id == "b"
    # a peer's dropped figures (live=False) are not work it sent
    g = ws("g")
    g.apply_peer_change(1, 100, 100, live=False)
    assert g.fleet_sent_tokens == 0
    with pytest.raises(ValueError, match="miss_order"):
        CacheAware(miss_order="random")


def test_the_imbalance_bound_moves_only_the_requests_whose_holder_is_overloaded():
    """SGLang's bound sends every request to the least loaded worker while any worker is 32
    requests (and 1.1x) above it, so requests whose own holder is fine are recomputed there, a
    herd of full prefills on one worker (zipf: six within 40 ms, TTFT 386-734 ms). cache_aware
    overrides affinity only where the holder is itself overloaded."""
    now = 0.01
    hot, mid, cold = ws("hot", running=45), ws("mid", running=12), ws("cold", running=4)
    fleet = [hot, mid, cold]
    held_by_mid, held_by_hot = FakeMatch({"mid": 128}, 128), FakeMatch({"hot": 128}, 128)
    assert CacheAware().choose(req(), fleet, held_by_mid, now).worker_id == "mid"
    assert CacheAware().choose(req(), fleet, held_by_hot, now).worker_id == "cold"
    # several holders: the overloaded one is left out, the least loaded of the rest wins
    both = FakeMatch({"hot": 128, "mid": 128}, 128)
    assert CacheAware().choose(req(), fleet, both, now).worker_id == "mid"
    # a miss during an imbalance goes to the least loaded, whatever the queues
    assert CacheAware().choose(req(), fleet, FakeMatch({}, 128), now).worker_id == "cold"
    # SGLang's scope (and greedy) move the request held by the fine worker too
    assert CacheAware(imbalance_scope="fleet").choose(req(), fleet, held_by_mid, now).worker_id == "cold"
    assert CacheAwareGreedy().choose(req(), fleet, held_by_mid, now).worker_id == "cold"
    # no imbalance (45 - 14 <= 32): affinity to the busier holder stands in both scopes
    calm = [hot, ws("mid", running=14), ws("cold", running=14)]
    for scope in ("holder", "fleet"):
        assert CacheAware(imbalance_scope=scope).choose(req(), calm, held_by_hot, now).worker_id == "hot"
    with pytest.raises(ValueError, match="imbalance_scope"):
        CacheAware(imbalance_scope="worker")


def test_cost_bounded_candidates_in_large_fleet():
    pool = [ws(f"w{i:04d}") for i in range(2000)]
    p = CacheAware(random.Random(0), top_k=4, sample_others=4, temperature=0.0, temperature_ms=0.0)
    m = FakeMatch({"w1234": 100, "w0007": 50}, 128)
    cands, known, complete = p._candidates(pool, m, {w.worker_id: w for w in pool})
    assert known["w1234"] == 100 and not complete
    assert len(cands) <= 8 and "w1234" in {w.worker_id for w in cands}
    assert p.choose(req(), pool, m, 0.1, by_id={w.worker_id: w for w in pool}).worker_id == "w1234"


def test_router_records_dispatch_and_release_and_speculates():
    pool = [ws("a"), ws("b")]
    prov = FakeProvider(FakeMatch({"a": 100}, 128))
    r = Router(make_policy("cache_aware", temperature=0.0, temperature_ms=0.0), prov)
    d = r.route(req(), pool, 0.1)
    assert d.worker_id == "a" and prov.routed == ["a"]
    assert pool[0].inflight == 1 and pool[0].outstanding_prefill_tokens == d.uncached_tokens == 2048 - 1600
    Router.release(pool[0], d)
    assert pool[0].inflight == 0 and pool[0].outstanding_prefill_tokens == 0
    assert r.route(req(), pool, 0.1, exclude={"a", "b"}).worker_id is None


def test_router_degraded_when_provider_has_no_answer():
    pool = [ws("a"), ws("b")]
    r = Router(make_policy("cache_aware"), FakeProvider(None))
    d = r.route(req(), pool, 0.1)
    assert d.degraded and d.worker_id is not None


def test_make_policy_unknown():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")


def test_power_of_two_draws_exactly_like_random_sample():
    """The fast two-index draw consumes the seeded stream exactly as rng.sample(range(n), 2),
    for the small-population (pool) and large-population (rejection) paths alike."""
    import random

    from mesh.routing.policies import _two_distinct

    for n in (2, 3, 21, 22, 64, 4096):
        a, b = random.Random(n), random.Random(n)
        for _ in range(500):
            i, j = _two_distinct(b, n)
            assert (i, j) == tuple(a.sample(range(n), 2))
            assert i != j and 0 <= i < n and 0 <= j < n


def test_cost_keeps_affinity_to_a_holder_until_it_is_clearly_overloaded():
    # b holds 94 % of the prompt and has 10 requests waiting (12k uncached tokens, ~480 ms): by
    # predicted TTFT alone a is better, but recomputing the prefix there costs the fleet; within
    # the imbalance bounds (32 requests and 1.1x) the holder keeps it, as SGLang's greedy rule does
    pool = [ws("a"), ws("b", wu=12_000, waiting=10)]
    m = FakeMatch({"b": 120}, 128)
    argmin = dict(temperature=0.0, temperature_ms=0.0)
    assert CacheAware(**argmin).choose(req(), pool, m, 0.1).worker_id == "b"
    # 60k tokens (~2.4 s) queued is a stall: the stall escape leaves the holder, unless it is off
    deep = [ws("a"), ws("b", wu=60_000, waiting=10)]
    assert CacheAware(**argmin).choose(req(), deep, m, 0.1).worker_id == "a"
    assert CacheAware(stall_escape_ms=0, **argmin).choose(req(), deep, m, 0.1).worker_id == "b"
    assert CacheAware(affinity_threshold=0.0, **argmin).choose(req(), pool, m, 0.1).worker_id == "a"  # pure cost
    # below the affinity threshold (a 25 % match) the cost model decides
    assert CacheAware(**argmin).choose(req(), pool, FakeMatch({"b": 32}, 128), 0.1).worker_id == "a"
    # a holder whose KV cannot take the prompt is not a holder for this request
    full = [ws("a"), ws("b", used=399_000)]
    assert CacheAware(**argmin).choose(req(), full, m, 0.1).worker_id == "a"


def test_a_worker_claiming_an_instant_prefill_queue_gains_at_most_the_load_band():
    """Hostile telemetry: a worker whose counters claim an absurd prefill rate (so every queue
    estimate drains at once) and an empty queue would take every miss under a queue-only rule;
    the band keeps it within one request of the least loaded."""
    honest = [ws(f"h{i}", running=2, wu=3_000, at=0.0) for i in range(3)]
    liar = ws("liar", running=2, at=0.0)
    liar.prefill_tokens_per_s = 1e12
    pool = [*honest, liar]
    pol = CacheAware()
    picks = []
    for i in range(40):
        d = pol.choose(RouteRequest(f"m{i}", 2048, block_size=16), pool, FakeMatch({}, 128), 0.01)
        next(w for w in pool if w.worker_id == d.worker_id).record_dispatch(2048)
        picks.append(d.worker_id)
    n = {w.worker_id: picks.count(w.worker_id) for w in pool}
    assert n["liar"] <= min(n[h.worker_id] for h in honest) + 2, n
    unbounded = CacheAware(miss_load_band=1_000)
    fresh = [*(ws(f"h{i}", running=2, wu=3_000, at=0.0) for i in range(3)), ws("liar", running=2, at=0.0)]
    fresh[-1].prefill_tokens_per_s = 1e12
    for i in range(40):
        d = unbounded.choose(RouteRequest(f"m{i}", 2048, block_size=16), fresh, FakeMatch({}, 128), 0.01)
        next(w for w in fresh if w.worker_id == d.worker_id).record_dispatch(2048)
    assert fresh[-1].inflight >= 30  # what the band prevents (only the 32-request imbalance bound stops it)


def test_stall_escape_leaves_a_holder_stuck_behind_a_huge_prefill_and_only_then():
    """On by default (``stall_escape_ms`` 200, ``stall_queue_ms`` 1000; chosen on the quality
    matrix, docs/routing.md). A follow-up whose holder has 100k tokens of prefill queued (4 s) goes to an
    idle worker instead; a queue under the floor, an equally busy fleet or ``stall_escape_ms=0``
    keep it on the holder."""
    now = 0.01
    held = FakeMatch({"h": 128}, 160)  # h holds 2,048 of the 2,560-token prompt
    stuck, idle = ws("h", running=1, wu=100_000), ws("o", running=1)
    assert CacheAware(stall_escape_ms=0).choose(req(2560), [stuck, idle], held, now).worker_id == "h"
    d = CacheAware().choose(req(2560), [stuck, idle], held, now)
    assert (d.worker_id, d.reason) == ("o", "stall_escape")
    # 600 ms queued: the margin (600 against 102 ms) is over 200 ms, but the queue is under the
    # 1 s floor (zipf's holders at 150-300 ms lost their hits to a bare margin)
    short = ws("h", running=1, wu=15_000)
    assert CacheAware().choose(req(2560), [short, idle], held, now).worker_id == "h"
    assert CacheAware(stall_queue_ms=500).choose(req(2560), [short, idle], held, now).worker_id == "o"
    busy = ws("o", running=1, wu=95_000)  # everyone is as busy: recomputing buys nothing
    assert CacheAware().choose(req(2560), [stuck, busy], held, now).worker_id == "h"
    for bad in ({"stall_escape_ms": -1}, {"stall_queue_ms": float("nan")}, {"stall_queue_ms": -5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CacheAware(**bad)


def test_stall_escape_leaves_only_a_queue_the_holder_reported():
    """Without a fresh LoadStat from the holder (before its first heartbeat, or telemetry gone
    silent beyond ``freshness_s``) the queue is estimated from the routers' own unfinished
    requests, decoding ones included: an upper bound, not a reason to recompute the prompt."""
    held = FakeMatch({"h": 128}, 160)
    silent, idle = WorkerState("h", inflight=2), ws("o", running=1)
    silent.outstanding_prefill_tokens = 100_000  # what this router sent there and has not seen finish
    d = CacheAware().choose(req(2560), [silent, idle], held, 0.01)
    assert (d.worker_id, d.reason) == ("h", "cache_hit")
    # the same queue reported by the holder itself is left; once its report is stale it is not
    stuck = ws("h", running=1, wu=100_000, at=0.0)
    assert CacheAware().choose(req(2560), [stuck, idle], held, 0.01).reason == "stall_escape"
    late = CacheAware(freshness_s=5.0).choose(req(2560), [stuck, ws("o", running=1, at=5.5)], held, 5.5)
    assert (late.worker_id, late.reason) == ("h", "cache_hit")


def test_a_candidate_holding_the_prefix_is_seen_when_workers_outside_the_candidates_match_deeper():
    """The ranking read for a small fleet is the match's top len(candidates): workers that are not
    candidates (tried, drained, another bucket, without the LoRA adapter) but match deeper crowd it,
    and a candidate that holds the prefix read as holding none."""
    pool = [ws("b"), ws("c")]
    m = FakeMatch({"x1": 128, "x2": 128, "b": 120}, 128)  # x1, x2: not candidates
    d = CacheAware(temperature=0.0, temperature_ms=0.0, cost_ties="always").choose(req(), pool, m, 0.1)
    assert (d.worker_id, d.reason, d.matched_blocks) == ("b", "cache_hit", 120)


def test_the_prefill_queue_is_a_fluid_of_timed_sends():
    """cache_aware's queue estimate adds every send at its own time and drains it at the
    worker's rate from then on: capacity the worker had while idle is not spent on work that
    arrived later (a send 300 ms after an idle snapshot used to read as nothing queued), and a
    peer's send heard through the exchange counts from when it was heard."""
    pol = CacheAware()
    w = ws("a", at=0.0)
    w.prefill_tokens_per_s = 10_000.0
    w.record_dispatch(2_000, 0.3)
    assert pol.queued_tokens(w, 0.3) == pytest.approx(2_000)
    assert pol.queued_tokens(w, 0.35) == pytest.approx(1_500)
    assert pol.queued_tokens(w, 0.6) == 0
    w.apply_peer_change(1, 1_000, 1_000, now_s=0.7)
    assert pol.queued_tokens(w, 0.75) == pytest.approx(500)
    # sends close together queue behind each other
    w.record_dispatch(1_000, 0.75)
    assert pol.queued_tokens(w, 0.8) == pytest.approx(1_000)


def test_a_loadstat_keeps_the_prefill_in_progress_but_not_its_own_old_queue():
    """A LoadStat counts waiting work only: the prefill a worker is computing right now is in
    its running batch. What is left of the work sent since the previous snapshot stays in the
    estimate when it is more than the snapshot's queue (a worker halfway through a long prefill
    does not look idle the moment its LoadStat arrives); a snapshot's queue never carries over
    into the next one, so a lying LoadStat costs one heartbeat interval, as before."""
    pol = CacheAware()
    w = ws("a", at=0.0)
    w.prefill_tokens_per_s = 6_000.0
    w.record_dispatch(3_000, 0.1)  # 500 ms of prefill
    w.update_load([LoadStat(1, 0, 0, 400_000, 0, 0, 0, 256, 0, 0)], 0.2)  # admitted: waiting 0
    w.prefill_tokens_per_s = 6_000.0
    assert pol.queued_tokens(w, 0.2) == pytest.approx(2_400)
    assert pol.queued_tokens(w, 0.7) == 0  # done by then
    # a snapshot's own waiting queue wins when larger
    w.update_load([LoadStat(1, 1, 0, 400_000, 0, 9_000, 0, 256, 0, 0)], 0.8)
    w.prefill_tokens_per_s = 6_000.0
    assert pol.queued_tokens(w, 0.8) == pytest.approx(9_000)
    # ... and does not outlive the next snapshot (nothing was sent in between)
    w.update_load([LoadStat(1, 0, 0, 400_000, 0, 0, 0, 256, 0, 0)], 1.0)
    assert pol.queued_tokens(w, 1.0) == 0
