"""Several routers through a burst (issue 33, part 2): near-ties parted by router rank while
decisions can collide, and the miss rule's and stall escape's thresholds relative to the worker's
measured prefill rate."""

from __future__ import annotations

import math

import pytest

from mesh.routing.cache_policies import CacheAware, CostModel, part_ties
from mesh import protocol as P
from mesh.routing.peers import PeerMerge, peer_dispatched, router_rank, set_router_rank
from mesh.routing.router import Router
from mesh.routing.sessions import with_sessions
from mesh.routing.view import RouteRequest
from tests.fakes import FakeMatch
from tests.policy_support import req, ws


def test_part_ties_rank_zero_is_the_minimum_and_ranks_differ():
    keyed = [((0, 1), 30, "c", "C"), ((0, 1), 10, "a", "A"), ((0, 1), 20, "b", "B"), ((1, 0), 0, "d", "D")]
    assert part_ties(keyed, 0) == "A"  # the plain minimum of (class, order, id)
    assert [part_ties(keyed, r) for r in range(4)] == ["A", "B", "C", "A"]  # only the best class, modulo
    assert part_ties([((5,), 0, "x", "X")], 3) == "X"


def in_burst(pol: CacheAware, now_s: float = 0.0) -> CacheAware:
    """``pol`` just heard (at ``now_s``) a peer's dispatch through the exchange: a burst."""
    pol.note_peer_dispatch(now_s)
    return pol


def test_a_burst_on_four_routers_with_one_view_spreads():
    """Four routers with the same view (the exchange's) and a miss each within the same
    millisecond: without ranks all four take the same worker, with ranks four different ones."""
    fleet = [ws(w, running=1) for w in "abcdef"]
    for i, w in enumerate(fleet):
        w.sent_tokens = 1000 * i  # the fleet's sent order: a, b, c, ...
    miss = FakeMatch({}, 128)
    plain = {CacheAware().choose(req(), fleet, miss, 0.01).worker_id for _ in range(4)}
    assert plain == {"a"}  # herding
    for mode in ("misses", "all"):
        parted = {in_burst(CacheAware(router_rank=r, rank_ties=mode)).choose(req(), fleet, miss, 0.001).worker_id
                  for r in range(4)}
        assert parted == {"a", "b", "c", "d"}, mode
    # the default (misses) parts them too; off or holders only, on a miss: every router takes rank 0's choice
    assert {in_burst(CacheAware(router_rank=r)).choose(req(), fleet, miss, 0.001).worker_id
            for r in range(4)} == {"a", "b", "c", "d"}
    for mode in ("off", "holders"):
        assert {in_burst(CacheAware(router_rank=r, rank_ties=mode)).choose(req(), fleet, miss, 0.001).worker_id
                for r in range(4)} == {"a"}, mode
    with pytest.raises(ValueError, match="rank_ties"):
        CacheAware(rank_ties=True)


def test_ranks_part_only_near_ties():
    """A worker with a longer prefill queue or more requests is not in the tie class: no rank
    sends a request there, and holders of the prompt win over idle non-holders at any rank."""
    idle, queued = ws("a", running=1), ws("b", running=1, wu=50_000)
    assert {in_burst(CacheAware(router_rank=r, rank_ties="all")).choose(req(), [idle, queued], FakeMatch({}, 128), 0.001)
            .worker_id for r in range(4)} == {"a"}
    holders = [ws("h1", running=2), ws("h2", running=2), ws("o", running=0)]
    m = FakeMatch({"h1": 128, "h2": 128}, 128)
    for mode in ("all", "holders"):  # equally loaded holders are parted; the idle non-holder never taken
        assert {in_burst(CacheAware(router_rank=r, rank_ties=mode)).choose(req(), holders, m, 0.001).worker_id
                for r in range(4)} == {"h1", "h2"}, mode
    # misses only (the default) and off: a hit stays on the lowest-id holder, as one router's would
    for mode in ("misses", "off"):
        assert {in_burst(CacheAware(router_rank=r, rank_ties=mode)).choose(req(), holders, m, 0.001).worker_id
                for r in range(4)} == {"h1"}, mode


def test_router_rank_from_the_exchange_and_the_setter():
    assert router_rank("b", ["a", "c"]) == 1
    assert router_rank("a", []) == 0
    assert router_rank("b", ["b", "a"]) == 1  # its own id among the peers counts once
    merge = PeerMerge("r1", 3.0)
    assert router_rank(merge.self_id, merge.fresh_peers()) == 0
    pol = CacheAware()
    assert set_router_rank(Router(pol), 2) and pol.router_rank == 2
    pol2 = CacheAware()
    assert set_router_rank(with_sessions(Router(pol2), "soft", 60.0, 100), 3) and pol2.router_rank == 3
    from mesh.routing.policies import PowerOfTwo

    assert not set_router_rank(Router(PowerOfTwo()), 1)  # a policy without ranks ignores it
    for bad in (-1, 1.5, "2", None):
        with pytest.raises(ValueError, match="router_rank"):
            CacheAware(router_rank=bad)


def test_miss_queue_classes_scale_with_the_measured_prefill_rate():
    """``miss_queue_ms`` is ms of prefill on the reference engine (25k tokens/s): 125 tokens. On
    a worker measured at 6k tokens/s those 125 tokens are 21 ms of its own: two workers 15 ms
    apart in their own ms (90 tokens) are in the same class there, as they are on the 8B."""
    def pair(rate):
        b, c = ws("b", running=1, wu=0, at=0.0), ws("c", running=1, wu=90, at=0.0)
        for w in (b, c):
            w.prefill_tokens_per_s = rate
        return b, c

    miss = FakeMatch({}, 128)
    for rate in (6_000.0, 25_000.0, 100_000.0):
        b, c = pair(rate)
        c.sent_tokens = 0
        b.sent_tokens = 10_000  # c wins the tie-break when the queues are one class
        assert CacheAware().choose(req(), [b, c], miss, 0.0).worker_id == "c", rate
    # a queue longer than one class (200 tokens) loses whatever the rate
    for rate in (6_000.0, 100_000.0):
        b, c = ws("b", running=1, at=0.0), ws("c", running=1, wu=200, at=0.0)
        for w in (b, c):
            w.prefill_tokens_per_s = rate
        b.sent_tokens = 10_000
        assert CacheAware().choose(req(), [b, c], miss, 0.0).worker_id == "b", rate


def test_stall_escape_thresholds_are_prefill_work_not_milliseconds():
    """The stall escape's floor (1,000 ms) and margin (200 ms) are ms on the reference engine:
    25,000 and 5,000 tokens of prefill. A 70B-class worker (6k tokens/s) with 15k tokens queued
    has 2.5 s of its own ms queued but less than the floor's work: it keeps its holder (with
    absolute ms it was left); 100k tokens queued are left on any engine."""
    held = FakeMatch({"h": 128}, 160)

    def fleet(rate, wu):
        stuck, idle = ws("h", running=1, wu=wu), ws("o", running=1)
        for w in (stuck, idle):
            w.prefill_tokens_per_s = rate
        return [stuck, idle]

    assert CacheAware().choose(req(2560), fleet(6_000.0, 15_000), held, 0.0).worker_id == "h"
    for rate in (6_000.0, 25_000.0, 100_000.0):
        d = CacheAware().choose(req(2560), fleet(rate, 100_000), held, 0.0)
        assert (d.worker_id, d.reason) == ("o", "stall_escape"), rate
    # the reference is the cost model's default rate: a policy told the engine is slower scales
    slow_ref = CacheAware(cost=CostModel(prefill_tokens_per_s=6_000.0))
    assert slow_ref.choose(req(2560), fleet(6_000.0, 15_000), held, 0.0).worker_id == "o"


def test_route_request_unchanged_by_rank_for_a_lone_router():
    fleet = [ws(w, running=1) for w in "abc"]
    miss = FakeMatch({}, 128)
    r = RouteRequest("x", prompt_tokens=2048, block_size=16)
    assert CacheAware().choose(r, fleet, miss, 0.01).worker_id == CacheAware(router_rank=0).choose(r, fleet, miss, 0.01).worker_id


def test_the_broker_exchange_tells_the_policy_its_rank_among_fresh_brokers():
    """The broker's exchange shell reports its rank among itself and its fresh peers on every
    update (``on_rank``; the broker hands it to the policy): distinct per broker, 0 when alone."""
    import zmq

    from brokers.peer_exchange import PeerExchange
    from mesh import protocol as P

    ctx = zmq.Context()
    peer_ep = "tcp://127.0.0.1:1"
    x = PeerExchange(ctx, "m", "tcp://127.0.0.1:*", [peer_ep], interval_ms=0, stale_ms=3000, epoch=1)
    pol = CacheAware(rank_ties="misses")
    x.on_rank = lambda *a: set_router_rank(Router(pol), *a)
    try:
        x.receive(P.encode_peer_load(P.PeerLoad("a", 1, 0, True, [], 1000)), 0.0, source=peer_ep)
        assert pol.router_rank == 1  # "a" < "m"
        assert pol._peer_s == -math.inf  # a message without dispatches says nobody is deciding
        x.receive(P.encode_peer_load(P.PeerLoad("a", 1, 1, False, [("w1", 1, 2048, 2048)], 1000)), 0.5, source=peer_ep)
        assert pol._peer_s == 0.5  # a peer's dispatch, heard at 0.5 s: parting for a moment
        x.receive(P.encode_peer_load(P.PeerLoad("a", 1, 2, False, [("w1", 0, 0, 2048)], 1000)), 0.7, source=peer_ep)
        assert pol._peer_s == 0.5  # a release is no decision
        x.tick(10.0, lambda w: None, lambda: [])  # the peer went stale: alone again
        assert pol.router_rank == 0
    finally:
        x.close()
        ctx.term()


def _misses_fleet():
    fleet = [ws(w, running=1) for w in "abcd"]
    for i, w in enumerate(fleet):
        w.sent_tokens = 1000 * i  # the best miss choice is "a", rank 2's parted one "c"
    return fleet, FakeMatch({}, 128)


def test_ranks_part_only_while_decisions_can_collide():
    """Router rank 2 takes its own member of a miss tie only while another decision was made
    within the window before: its own previous one, or a peer's dispatch heard through the
    exchange. Alone in a quiet moment it takes the best choice, as one router would."""
    fleet, miss = _misses_fleet()
    pol = CacheAware(router_rank=2, rank_window_prefills=0.25)  # 0.25 prefills of 2,047 tokens at 25k/s: 20 ms
    pick = lambda t: pol.choose(req(), fleet, miss, t).worker_id  # noqa: E731
    assert pick(0.0) == "a"  # the first decision: nothing to collide with
    assert pick(0.004) == "c"  # its own previous decision 4 ms ago: a burst, parted
    assert pick(0.5) == "a"  # quiet for 496 ms: the best
    assert pick(0.5) == "a"  # the same instant again (a two-pass router) is the same decision
    pol.note_peer_dispatch(1.0)  # a peer just dispatched (exchange message arrival)
    assert pick(1.008) == "c"
    assert pick(2.0) == "a"
    # the window is the knob: 0 prefills never part, rank_window_ms=inf always parts (the old rule)
    never = CacheAware(router_rank=2, rank_ties="misses", rank_window_prefills=0)
    never.note_peer_dispatch(0.0)
    assert [never.choose(req(), fleet, miss, t).worker_id for t in (0.001, 0.002)] == ["a", "a"]
    always = CacheAware(router_rank=2, rank_ties="misses", rank_window_ms=math.inf)
    assert [always.choose(req(), fleet, miss, t).worker_id for t in (0.0, 100.0)] == ["c", "c"]
    # the default (100 prefills, at most 1 s): parted while any decision was made within the last second
    dflt = CacheAware(router_rank=2)
    assert [dflt.choose(req(), fleet, miss, t).worker_id for t in (0.0, 0.5, 1.4, 3.0)] == ["a", "c", "c", "a"]
    # rank 0 (a lone router, or the first) never parts, whatever it heard
    lone = in_burst(CacheAware(router_rank=0, rank_ties="misses"))
    assert [lone.choose(req(), fleet, miss, t).worker_id for t in (0.001, 0.002)] == ["a", "a"]


def test_rank_window_is_validated_naming_the_field():
    for bad in (-1, -0.5, math.nan, "10", True):
        with pytest.raises(ValueError, match="rank_window_ms"):
            CacheAware(rank_window_ms=bad)
    for bad in (-1, -1e-9, math.nan, math.inf, -math.inf, 101, 1e300, "0.25", None, True):
        with pytest.raises(ValueError, match="rank_window_prefills"):
            CacheAware(rank_window_prefills=bad)
    from mesh.errors import ConfigError
    from mesh.lab.sim.runner import SimConfig

    for field, bad in (("rank_window_ms", -1), ("rank_window_prefills", math.nan), ("rank_window_prefills", 1e9)):
        with pytest.raises(ConfigError, match=field):
            SimConfig(workload="zipf", policies=["cache_aware"], policy_params={"cache_aware": {field: bad}}).validate()


def _typical(pol: CacheAware, fleet, n: int = 8, L: int = 4096) -> CacheAware:
    """``pol`` after ``n`` quiet misses of ``L`` tokens on ``fleet`` (one a second: never parted)."""
    for i in range(n):
        pol.choose(req(L), fleet, FakeMatch({}, 256), 10.0 + i)
    return pol


def test_the_derived_window_scales_with_the_measured_prefill_rate():
    """``rank_window_prefills`` (here 0.25) of a typical request's prefill at the workers' measured
    rate: 4,096 uncached tokens are 164 ms on the 8B engine (25k tokens/s): a 41 ms window; 683
    ms on a 70B-class one (6k/s): 171 ms; 41 ms on a small fast one (100k/s): 10 ms. Two
    decisions 30 ms apart collide on the 8B and the 70B, not on the fast engine, whose fleet
    decides 4x as often."""
    got = {}
    for rate in (6_000.0, 25_000.0, 100_000.0):
        fleet, _ = _misses_fleet()
        for w in fleet:
            w.prefill_tokens_per_s = rate
        pol = _typical(CacheAware(router_rank=2, calibrate=False, rank_window_prefills=0.25), fleet)
        got[rate] = pol.rank_window_s
        assert got[rate] == pytest.approx(0.25 * 4096 / rate)
        picks = [pol.choose(req(), fleet, FakeMatch({}, 128), t).worker_id for t in (30.0, 30.03)]
        assert picks == (["a", "a"] if rate == 100_000.0 else ["a", "c"]), rate
    assert got[6_000.0] > got[25_000.0] > got[100_000.0]
    # twice the prefills, twice the window; a fixed rank_window_ms overrides the derived one
    fleet, _ = _misses_fleet()
    assert _typical(CacheAware(rank_window_prefills=0.5, calibrate=False), fleet).rank_window_s == pytest.approx(0.5 * 4096 / 25_000)
    assert _typical(CacheAware(rank_window_ms=10), fleet).rank_window_s == 0.01


def test_the_window_before_calibration_and_with_the_calibrated_model():
    """Before its first decision a router assumes a 1,024-token request at the reference rate
    (the cost model's, 25k tokens/s: a 10 ms window, the old fixed one); an engine configured
    slower stretches it. Once the calibrated TTFT model's fit is used, its weight on predicted
    prefill ms scales the window (the fleet's prefills take that much longer than measured)."""
    assert CacheAware(rank_window_prefills=0.25).rank_window_s == pytest.approx(0.25 * 1024 / 25_000)
    assert CacheAware(cost=CostModel(prefill_tokens_per_s=6_000.0),
                      rank_window_prefills=0.25).rank_window_s == pytest.approx(0.25 * 1024 / 6_000)
    assert CacheAware().rank_window_s == 1.0  # the default: 100 prefills, capped at 1 s
    fleet, _ = _misses_fleet()
    pol = _typical(CacheAware(rank_window_prefills=0.25), fleet)
    base = pol.rank_window_s
    assert base == pytest.approx(0.25 * 4096 / 25_000)
    cal = pol.calibrator
    cal.theta[1] = 2.0
    cal.observations, cal.fit_rel_err, cal.raw_rel_err = 10**6, 0.1, 0.2  # the fit predicts better: used
    assert cal.use_fit and pol.rank_window_s == pytest.approx(2 * base)
    cal.theta[1] = -5.0  # a nonsense fit cannot make the window negative
    assert pol.rank_window_s == 0.0


def test_huge_prompts_cannot_stretch_the_window_past_its_cap():
    """A client's stream of huge prompts on a slow worker makes the typical prefill minutes
    long; the window stays at most 1 s, so a peer's flood of dispatches still parts a router
    only within 1 s of its last message."""
    fleet, miss = _misses_fleet()
    for w in fleet:
        w.prefill_tokens_per_s = 1.0
    pol = _typical(CacheAware(router_rank=2, calibrate=False), fleet, L=10**5)
    assert pol.rank_window_s == 1.0
    for i in range(100):
        pol.note_peer_dispatch(100.0 + i / 1000)
    assert pol.choose(req(), fleet, miss, 100.5).worker_id == "c"  # within the window: parted
    assert pol.choose(req(), fleet, miss, 102.0).worker_id == "a"  # bounded: quiet again, the best


def test_a_hostile_peer_parts_a_router_only_within_the_window():
    """A peer claiming dispatches (a flood of them, any counter) makes a router part near-ties
    only within ``rank_window_ms`` of the last such message's arrival on the router's own clock:
    it names no time of its own, and a nonsense time is ignored; once it stops, the router in a
    quiet moment takes the best choice again."""
    fleet, miss = _misses_fleet()
    pol = CacheAware(router_rank=2, rank_ties="misses", rank_window_prefills=0.25)
    router = Router(pol)
    merge = PeerMerge("m", 3.0)
    for seq in range(50):  # a flood of dispatch claims, the last at 0.049 s
        msg = P.PeerLoad("evil", 1, seq, False, [("a", seq + 1, 10**9, 10**9 * (seq + 1))], 1000)
        outcome, changes = merge.apply(msg, seq / 1000.0)
        assert outcome == "applied" and peer_dispatched(changes)
        set_router_rank(router, 2, seq / 1000.0)
    assert pol.choose(req(), fleet, miss, 0.050).worker_id == "c"  # within the window: parted
    assert pol.choose(req(), fleet, miss, 0.5).worker_id == "a"  # bounded: quiet again, the best
    for t in (math.inf, math.nan, -math.inf):  # no time beyond the window's reach
        pol.note_peer_dispatch(t)
    assert pol.choose(req(), fleet, miss, 5.0).worker_id == "a"
    assert pol.choose(req(), fleet, miss, 1e9).worker_id == "a"
    # releases and a dropped peer are not decisions
    assert not peer_dispatched([("a", -1, -2048, 0, True), ("b", 2, 10, 0, False)])


def test_the_simulator_feeds_peer_dispatches_as_the_broker_does(monkeypatch):
    """Each simulated router's policy hears its peers' dispatches from the merged exchange
    messages (the arrival time, as the broker's exchange shell reports it), never its own."""
    from mesh.lab.sim import SimConfig, run_sim

    heard: list[tuple[int, float]] = []
    monkeypatch.setattr(CacheAware, "note_peer_dispatch", lambda self, t: heard.append((id(self), t)))
    cfg = SimConfig(workload="zipf", workers=[4], routers=[2], policies=["cache_aware"], providers=["radix_tree"],
                    seed=1, rate=50.0, max_requests=60, duration_s=None, exchange=True)
    arm = run_sim(cfg)["arms"][0]
    assert arm["completed"] == 60
    assert len({pid for pid, _ in heard}) == 2  # both routers heard the other's dispatches
    assert 20 <= len(heard) <= 60  # one per message showing a dispatch, at most one per request
    assert [t for _, t in heard] == sorted(t for _, t in heard)  # arrival times, in event order


def test_a_parted_miss_reaches_past_the_load_band_by_its_rank():
    """A burst of misses on a fleet whose prefill queues are all empty but whose decode counts
    differ (one worker 1 request, the next 2, the rest 3-4): the load band (least loaded + 1)
    holds two workers, so ranks 0-3 wrapped around onto them and two of four misses queued a
    whole prefill behind another. Parted, router k reaches past the band as far as its rank
    needs distinct workers, at most k requests -- as if the k routers ranked before it had each
    placed one request of the burst, as one router deciding them one by one would have seen --
    so the four land on four workers. Rank 0 and
    a quiet moment keep the plain best. The widening is about load, not queues: with
    ``rank_reach=0`` (the shortest queue only) the four idle workers are the same four."""
    def fleet():
        return [ws("a", running=1), ws("b", running=2), ws("c", running=3), ws("d", running=3), ws("e", running=4)]

    miss = FakeMatch({}, 128)
    picks = [in_burst(CacheAware(router_rank=r)).choose(req(), fleet(), miss, 0.001).worker_id for r in range(4)]
    assert picks == ["a", "b", "c", "d"]
    # a worker the band and the rank do not reach is never taken (rank 1: load <= 1 + 1 + 1)
    assert in_burst(CacheAware(router_rank=1)).choose(req(), [ws("a", running=1), ws("e", running=4)],
                                                      miss, 0.001).worker_id == "a"
    exact = [in_burst(CacheAware(router_rank=r, rank_reach=0)).choose(req(), fleet(), miss, 0.001).worker_id
             for r in range(4)]
    assert exact == ["a", "b", "c", "d"]
    assert CacheAware(router_rank=3).choose(req(), fleet(), miss, 0.001).worker_id == "a"  # quiet: the best
    # only as far as the rank needs: with two workers in the band rank 1 stays in it and does
    # not take c (idle, two requests past the least loaded) over a (one queue class, 125 tokens,
    # behind: within the reach of an 8,192-token prompt);
    # rank 2 needs a third and reaches c, after the band's two: three ranks, three workers
    band_enough = [ws("a", running=1, wu=150), ws("b", running=2), ws("c", running=3)]
    assert [in_burst(CacheAware(router_rank=r)).choose(req(L=8192), band_enough, miss, 0.001).worker_id
            for r in range(3)] == ["b", "a", "c"]


def test_a_parted_miss_reaches_a_share_of_its_own_prompt_behind_the_shortest():
    """On a busy fleet the shortest queue often has one member: with exact ties only, every rank
    took that worker in a burst and all but one waited a whole prefill behind the others.
    Parted (another decision within the window), rank k takes the k-th worker whose queue is at
    most ``rank_reach`` (0.03) of the request's own prompt longer than the shortest, in the
    rule's order, whatever its load; a worker further behind is never taken, and rank 0 keeps
    the plain best. The reach is relative to the prompt: the same 125 queued tokens (150 at the
    snapshot, drained for a millisecond since) are within it for an 8,192-token prompt (246
    tokens) and past it for a 2,048-token one (61), so on any engine a parted router pays at
    most 3 % of the prefill a collision would cost."""
    def fleet():
        a = ws("a", running=2)  # idle queue, one request more than b
        b = ws("b", running=1, wu=150)  # one queue class (125 tokens) behind
        c = ws("c", running=1, wu=2_000)  # far behind
        return [a, b, c]

    miss = FakeMatch({}, 128)
    picks = {r: in_burst(CacheAware(router_rank=r)).choose(req(L=8192), fleet(), miss, 0.001).worker_id
             for r in range(4)}
    assert picks == {0: "a", 1: "b", 2: "a", 3: "b"}
    short = {in_burst(CacheAware(router_rank=r)).choose(req(), fleet(), miss, 0.001).worker_id for r in range(4)}
    assert short == {"a"}  # b is past 3 % of this prompt: a collision risk is cheaper than its queue
    wide = {in_burst(CacheAware(router_rank=r, rank_reach=0.5)).choose(req(), fleet(), miss, 0.001).worker_id
            for r in range(4)}
    assert wide == {"a", "b"}  # c (~2,000 tokens behind) is past even half the prompt
    exact = {in_burst(CacheAware(router_rank=r, rank_reach=0)).choose(req(L=8192), fleet(), miss, 0.001).worker_id
             for r in range(4)}
    assert exact == {"a"}  # the shortest alone: every rank collides on it
    # a quiet moment (no decision within the window): the best, at any rank
    assert CacheAware(router_rank=3).choose(req(), fleet(), miss, 0.001).worker_id == "a"
    for bad in (-1, 10.5, math.nan, math.inf, "1", None, True):
        with pytest.raises(ValueError, match="rank_reach"):
            CacheAware(rank_reach=bad)
    from mesh.config import BrokerSettings
    from mesh.errors import ConfigError

    for bad in (-0.5, 11.0, math.nan):
        with pytest.raises(ConfigError, match="rank_reach"):
            BrokerSettings(rank_reach=bad).validate()
