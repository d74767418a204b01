"""Peers' insert-on-route guesses (mesh.index.peer_routes): anchors, matching, bounds, the wire,
the publisher and the simulator, all with explicit times.

The failure they fix: with several routers, a follow-up prompt reaching another router while the
first prefill still ran saw only the pages already reported, missed, and recomputed the whole
prompt elsewhere. ``test_sim_a_follow_up_at_another_router_finds_the_worker_computing_its_prefix``
is that case through the simulator's routers; ``tests/test_peer_exchange_e2e.py`` has it through
two real brokers.
"""

from __future__ import annotations

import random

import pytest

from mesh import protocol as P
from mesh.errors import ProtocolError
from mesh.hashing import content_keys
from mesh.index.peer_routes import PeerRoutes, _anchor_positions, route_anchors
from mesh.routing.peers import PeerMerge, PeerPublisher, apply_changes
from mesh.routing.providers import LocalIndexProvider
from mesh.routing.view import RouteRequest, WorkerState
from tests.fuzz_support import fuzzed_exchange

BS = 16


def keys_of(tokens):
    return content_keys(tokens, BS)


def prompt(n_pages, seed=0, prefix=None):
    rng = random.Random(seed)
    toks = list(prefix or [])
    while len(toks) < n_pages * BS:
        toks.append(rng.randrange(32_000))
    return toks


# --------------------------------------------------------------------------- anchors


def test_anchor_positions_are_half_powers_of_two_and_the_tip():
    assert _anchor_positions(0) == []
    assert _anchor_positions(1) == [1]
    assert _anchor_positions(20) == [1, 2, 4, 5, 8, 11, 16, 20]
    for n in (3, 100, 2141, 8000, 2**31):
        pos = _anchor_positions(n)
        assert pos == sorted(set(pos)) and pos[-1] == n and len(pos) <= P.MAX_ROUTE_ANCHORS
        assert all(b <= 1.42 * a + 2 for a, b in zip(pos, pos[1:]))  # a partial share keeps > 70 % of its depth
    ks = keys_of(prompt(20))
    assert route_anchors(ks) == [ks[p - 1] for p in [1, 2, 4, 5, 8, 11, 16, 20]]


# --------------------------------------------------------------------------- matching


def test_an_extension_of_a_peer_route_matches_its_full_length_and_a_shared_prefix_alone_does_not():
    base = prompt(100, seed=1)
    pr = PeerRoutes(ttl_s=5.0)
    pr.add("w1", 100, route_anchors(keys_of(base)), now_s=0.0)
    follow_up = keys_of(base + prompt(30, seed=2))  # the next turn: the whole prompt plus more
    m = pr.match(follow_up, 1.0)
    assert m.matched_blocks("w1") == 100 and m.best_blocks == 100 and m.query_blocks == 130
    assert [(x.worker_id, x.blocks, x.speculative) for x in m.top(3)] == [("w1", 100, True)]
    # sharing a prefix is not enough (the anchor at 64 is found, the route's last page is not):
    # a popular prefix is spread by the routers' own choices and reported by KV events
    partial = keys_of(base[: 70 * BS] + prompt(40, seed=3))
    assert pr.match(partial, 1.0) is None
    assert pr.match(keys_of(base[: 60 * BS]), 1.0) is None  # a prefix of the route
    assert pr.match(keys_of(base), 1.0).matched_blocks("w1") == 100  # the same prompt again
    assert pr.match(keys_of(prompt(50, seed=9)), 1.0) is None  # unrelated
    assert pr.match(follow_up, 5.0) is None  # expired after the TTL
    assert len(pr) == 0 and pr.stats["expired"] == len(route_anchors(keys_of(base)))


def test_several_workers_and_a_refreshed_route():
    a = prompt(40, seed=4)
    pr = PeerRoutes(ttl_s=2.0)
    pr.add("w1", 40, route_anchors(keys_of(a)), 0.0)
    pr.add("w2", 20, route_anchors(keys_of(a[: 20 * BS])), 0.5)
    m = pr.match(keys_of(a), 1.0)
    assert m.depth == {"w1": 40, "w2": 20}
    assert [x.worker_id for x in m.top(2)] == ["w1", "w2"]
    pr.add("w1", 40, route_anchors(keys_of(a)), 1.9)  # routed there again: lives to 3.9
    assert pr.match(keys_of(a), 3.0).depth == {"w1": 40}  # w2's expired at 2.5, w1's first copy at 2.0
    pr.remove_worker("w1")
    assert pr.match(keys_of(a), 3.0) is None


def test_the_table_is_bounded_oldest_first_whatever_a_peer_sends():
    pr = PeerRoutes(ttl_s=60.0, max_keys=1000)
    rng = random.Random(5)
    n_anchors = len(_anchor_positions(2**31 - 1))  # the longest route: 61 anchors
    for i in range(P.MAX_EXCHANGE_ROUTES):  # one full hostile message: 1024 routes x 61 random anchors
        pr.add(f"w{i % 7}", 2**31 - 1, [rng.randrange(2**64) for _ in range(n_anchors)], 0.0)
    assert len(pr) == 1000 and len(pr._by_key) <= 1000 and pr.stats["evicted"] == 1024 * 61 - 1000
    pr.add("w0", 5, [1, 2], 0.0)  # anchors that do not fit the page count: dropped, counted
    assert pr.stats["bad_routes"] == 1
    newest = prompt(10, seed=6)
    pr.add("w0", 10, route_anchors(keys_of(newest)), 1.0)
    assert pr.match(keys_of(newest), 1.0).matched_blocks("w0") == 10
    claimed = prompt(30, seed=13)  # a route claiming more pages than its anchors show is no match
    pr.add("w1", 31, route_anchors(keys_of(claimed)), 1.0)  # 30 pages' 9 anchors, as 31 pages would have
    assert pr.match(keys_of(claimed), 1.0) is None


def test_a_flooding_peer_evicts_only_its_own_routes_and_sources_are_bounded():
    pr = PeerRoutes(ttl_s=60.0, max_keys=500, max_sources=3)
    honest = prompt(40, seed=21)
    pr.add("w1", 40, route_anchors(keys_of(honest)), 0.0, source="tcp://honest:1")
    rng = random.Random(8)
    n_anchors = len(_anchor_positions(2**31 - 1))
    for i in range(200):  # a hostile peer: 200 routes x 61 random anchors, 24x its share
        pr.add("w0", 2**31 - 1, [rng.randrange(2**64) for _ in range(n_anchors)], 0.1, source="tcp://flood:1")
    assert pr.stats["evicted"] == 200 * n_anchors - 500  # all of them its own
    assert pr.match(keys_of(honest), 0.2).matched_blocks("w1") == 40  # the honest peer's route stands
    assert len(pr) == 500 + len(route_anchors(keys_of(honest)))
    pr.add("w2", 40, route_anchors(keys_of(prompt(40, seed=22))), 0.3, source="tcp://third:1")
    pr.add("w2", 40, route_anchors(keys_of(prompt(40, seed=23))), 0.3, source="tcp://fourth:1")  # a fourth source
    assert pr.stats["sources_over"] == 1
    assert pr.match(keys_of(honest), 61.0) is None and len(pr) == 0  # expired, every source's slot freed
    pr.add("w2", 40, route_anchors(keys_of(prompt(40, seed=23))), 61.0, source="tcp://fourth:1")
    assert pr.stats["sources_over"] == 1 and len(pr) > 0


# --------------------------------------------------------------------------- wire and publisher


def test_routes_round_trip_and_an_old_message_without_them_still_decodes():
    m = P.PeerLoad("b", 1, 2, False, [("w0", 1, 2, 3)], 1000, [("w0", 2, [1, 2**64 - 1]), ("w1", 1, [7])])
    assert P.decode_exchange(P.encode_peer_load(m)) == m
    plain = P.decode_exchange(P.encode_peer_load(P.PeerLoad("b", 1, 2, False, [])))
    assert plain.routes == []


def _body(routes):
    d = {"broker": "b", "epoch": 1, "seq": 0, "full": False, "workers": [], "routes": routes}
    return [P.EXCHANGE_HEADER, bytes([P.X_PEER_LOAD]), P.pack(d)]


@pytest.mark.parametrize("routes,reason", [
    ({"w": [1]}, "bad_field"),
    ([["w", 1]], "bad_field"),
    ([["w", [1]]], "bad_field"),
    ([["w", 1, [1], 3]], "bad_field"),
    ([["", 1, [1]]], "bad_field"),
    ([["é" * 200, 1, [1]]], "bad_field"),
    ([[5, 1, [1]]], "bad_field"),
    ([["w", 0, [1]]], "bad_field"),
    ([["w", 2**31, [1]]], "bad_field"),
    ([["w", -3, [1]]], "bad_field"),
    ([["w", 1.0, [1]]], "bad_field"),
    ([["w", 1, []]], "bad_field"),
    ([["w", 1, [1] * (P.MAX_ROUTE_ANCHORS + 1)]], "bad_field"),
    ([["w", 1, [-1]]], "bad_field"),
    ([["w", 1, [1.5]]], "bad_field"),
    ([["w", 1, [True]]], "bad_field"),
    ([["w", 1, "123"]], "bad_field"),
    ([["w", 1, [1]]] * (P.MAX_EXCHANGE_ROUTES + 1), "too_many_routes"),
])
def test_hostile_routes_are_rejected_never_raised(routes, reason):
    r = P.decode_exchange(_body(routes))
    assert isinstance(r, ProtocolError) and r.reason == reason, r


def test_the_publisher_sends_routed_prompts_with_the_next_message_and_bounds_its_queue():
    pub = PeerPublisher("me", 1, interval_s=0.005, full_interval_s=1.0, max_routes=3)
    sts = {"w0": WorkerState("w0")}
    pub.build(0.0, sts.get, sts.values)  # the first snapshot
    assert pub.next_due() == 1.0
    ks = keys_of(prompt(20, seed=7))
    pub.note_route("w0", ks)
    assert pub.next_due() == pytest.approx(0.005)  # a route alone makes a change message due
    m = pub.build(0.005, sts.get, sts.values)
    assert m.routes == [("w0", 20, route_anchors(ks))] and m.workers == []
    assert pub.build(0.02, sts.get, sts.values) is None  # sent once
    for i in range(5):
        pub.note_route("w0", keys_of(prompt(3, seed=10 + i)))
    assert len(pub.build(0.03, sts.get, sts.values).routes) == 3 and pub.stats["routes_dropped"] == 2


def test_a_provider_counts_peer_routes_as_speculative_matches_and_tells_its_own():
    told = []
    a, b = LocalIndexProvider(block_size=BS), LocalIndexProvider(block_size=BS)
    a.route_listener = lambda wid, ks: told.append((wid, len(ks), route_anchors(ks)))
    for p in (a, b):
        p.add_worker("w1", BS)
        p.add_worker("w2", BS)
    toks = prompt(60, seed=8)
    a.on_routed(RouteRequest("r1", len(toks), tokens=toks), "w1", 0.0)
    assert told and told[0][0] == "w1"
    follow = toks + prompt(10, seed=9)
    assert b.match(RouteRequest("r2", len(follow), tokens=follow), 0.1).best_blocks == 0  # not told yet
    b.add_peer_routes(told, 0.1)
    m = b.match(RouteRequest("r3", len(follow), tokens=follow), 0.2)
    assert m.matched_blocks("w1") == 60 and m.matched_blocks("w2") == 0
    b.remove_worker("w1")
    assert b.match(RouteRequest("r4", len(follow), tokens=follow), 0.3).matched_blocks("w1") == 0
    off = LocalIndexProvider(block_size=BS, speculative_ttl_s=0.0)  # no speculation: nothing shared either way
    off.route_listener = lambda wid, ks: told.append("unexpected")
    off.on_routed(RouteRequest("r5", len(toks), tokens=toks), "w1", 0.0)
    off.add_peer_routes(told[:1], 0.0)
    assert told[-1] != "unexpected" and off.peer_routes is None


def test_a_merge_outcome_other_than_applied_brings_no_routes():
    merge = PeerMerge("me", stale_s=1.0)
    m = P.PeerLoad("b1", 1, 5, False, [], 1000, [("w", 1, [1])])
    assert merge.apply(m, 0.0)[0] == "applied"
    assert merge.apply(m, 0.1)[0] == "duplicate"  # the broker and the simulator take routes only when applied


# --------------------------------------------------------------------------- simulator


def test_sim_a_follow_up_at_another_router_finds_the_worker_computing_its_prefix():
    """Router 0 routes a long prompt; before any KV event, router 1 gets its follow-up. With the
    routes exchanged router 1 sends it to the same worker (a speculative hit of the whole first
    prompt); with the load figures alone (the exchange before routes) it is a miss that goes to
    another worker, away from the queued prefill, and recomputes the prompt."""
    from mesh.lab.sim.runner import Arm, ArmSpec, SimConfig
    from mesh.lab.sim.workloads import make_workload

    first = prompt(2000, seed=11)
    follow = first + prompt(100, seed=12)
    out = {}
    for routes in (True, False):
        cfg = SimConfig(workload="shared_prefix", rate=20.0, duration_s=1.0, workers=[4], routers=[2],
                        policies=["cache_aware"], providers=["radix_tree"], seed=3, exchange=True, exchange_routes=True)
        arm = Arm(cfg, ArmSpec("cache_aware", "radix_tree", 2, 4), make_workload("shared_prefix", seed=3, rate=20.0, duration_s=1.0))
        r0, r1 = arm.routers
        d0 = r0.route(RouteRequest("first", len(first), tokens=first), 0.0)
        msg = r0.publisher.build(0.0, r0.by_id.get, lambda: r0.states)
        assert msg.routes and msg.routes[0][0] == d0.worker_id
        outcome, changes = r1.merge.apply(msg, 0.002)
        assert outcome == "applied"
        apply_changes(changes, r1.by_id.get)
        if routes:
            r1.router.provider.add_peer_routes(msg.routes, 0.002)
        d1 = r1.route(RouteRequest("follow", len(follow), tokens=follow), 0.01)
        out[routes] = (d0.worker_id, d1.worker_id, d1.reason)
    w0, w1, why = out[True]
    assert w1 == w0 and why == "cache_hit"
    w0, w1, why = out[False]
    assert w1 != w0 and why == "cache_miss_min_load"


def test_sim_sends_routes_by_default_and_without_them_figures_only():
    from mesh.lab.sim.runner import Arm, ArmSpec, SimConfig, run_sim
    from mesh.lab.sim.workloads import make_workload

    kw = dict(workload="shared_prefix", rate=20.0, duration_s=1.0, workers=[4], routers=[2], policies=["cache_aware"],
              providers=["radix_tree"], seed=3, exchange=True)
    assert SimConfig(**kw).exchange_routes  # the broker's default: routes on
    cfg = SimConfig(**kw, exchange_routes=False)
    arm = Arm(cfg, ArmSpec("cache_aware", "radix_tree", 2, 4), make_workload("shared_prefix", seed=3, rate=20.0, duration_s=1.0))
    r0 = arm.routers[0]
    toks = prompt(50, seed=14)
    d = r0.route(RouteRequest("x", len(toks), tokens=toks), 0.0)
    msg = r0.publisher.build(0.0, r0.by_id.get, lambda: r0.states)
    assert msg.workers and msg.workers[0][0] == d.worker_id and msg.routes == []
    on, off = run_sim(SimConfig(**kw, exchange_routes=True))["arms"][0], run_sim(cfg)["arms"][0]
    assert on["completed"] == off["completed"] and on["exchange_messages"] > 0 and off["exchange_messages"] > 0


def test_fuzzed_messages_with_routes_never_raise_and_what_decodes_is_safe_to_apply():
    """Byte-flipped PEER_LOAD bodies carrying routes: the decoder answers a PeerLoad or a
    ProtocolError, never raises, and any routes it lets through go into a PeerRoutes table
    (and are matched against) without an exception."""
    ks = keys_of(prompt(40, seed=15))
    good = P.encode_peer_load(P.PeerLoad("b", 1, 0, False, [("w", 1, 2, 3)], 1000,
                                         [("w", 40, route_anchors(ks)), ("v", 3, route_anchors(ks[:3]))]))[2]
    pr = PeerRoutes(ttl_s=5.0)
    decoded = 0
    for i, r in enumerate(fuzzed_exchange(good, 3000, 4, seed=17)):  # each r: a PeerLoad or a ProtocolError
        if isinstance(r, P.PeerLoad):
            decoded += 1
            for wid, pages, anchors in r.routes:
                pr.add(wid, pages, anchors, i * 1e-3)
            pr.match(ks, i * 1e-3)
    assert decoded > 100  # the fuzz reached the routes, not only the envelope
