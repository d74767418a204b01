"""The peer exchange's pure core (mesh.routing.peers), its wire messages and its simulator model.

The merge is fed hand-made messages with explicit times: staleness, restarts (epochs),
duplicates, reordering, loss, full snapshots, caps. The worker-state tests check that peers'
work lands in the same correction terms every policy reads (no double counting across a
LoadStat). The protocol tests throw malformed and hostile messages at the one decode boundary.
"""

from __future__ import annotations

import random

import pytest

from mesh import protocol as P
from mesh.errors import ProtocolError
from mesh.load import LoadStat
from mesh.routing.peers import PeerMerge, PeerPublisher, apply_changes
from mesh.routing.view import WorkerState
from mesh.lab.sim.runner import Arm, ArmSpec, SimConfig, run_sim
from mesh.lab.sim.workloads import make_workload
from tests.fuzz_support import fuzzed_exchange


def msg(seq, workers, *, broker="b1", epoch=1, full=False, full_ms=200):
    return P.PeerLoad(broker, epoch, seq, full, list(workers), full_ms)


def states(*ids):
    return {w: WorkerState(w) for w in ids}


def applied(merge, m, sts, now):
    outcome, changes = merge.apply(m, now)
    apply_changes(changes, sts.get)
    return outcome


def figs(st):
    return st.peer_inflight, st.peer_prefill_tokens


def load(running, waiting, uncached=0):
    return LoadStat(num_running_reqs=running, num_waiting_reqs=waiting, num_tokens=0, max_total_num_tokens=100_000,
                    num_waiting_uncached_tokens=uncached, num_total_tokens=0, max_running_requests=64)


# --------------------------------------------------------------------------- merge


def test_absolute_figures_sum_over_peers_and_replace_not_accumulate():
    m = PeerMerge("me", stale_s=1.0)
    sts = states("w0", "w1")
    assert applied(m, msg(0, [("w0", 3, 300, 300)]), sts, 0.0) == "applied"
    assert applied(m, msg(0, [("w0", 2, 200, 200), ("w1", 1, 50, 50)], broker="b2"), sts, 0.0) == "applied"
    assert figs(sts["w0"]) == (5, 500) and figs(sts["w1"]) == (1, 50)
    # a newer message of b1 replaces its figures (absolute, not added)
    applied(m, msg(1, [("w0", 1, 100, 300)]), sts, 0.1)
    assert figs(sts["w0"]) == (3, 300) and m.totals("w0") == (3, 300)


def test_duplicates_and_reordered_messages_are_dropped():
    m = PeerMerge("me", stale_s=1.0)
    sts = states("w0")
    applied(m, msg(5, [("w0", 4, 0, 0)]), sts, 0.0)
    assert applied(m, msg(5, [("w0", 9, 0, 0)]), sts, 0.01) == "duplicate"
    assert applied(m, msg(3, [("w0", 1, 0, 0)]), sts, 0.02) == "duplicate"  # arrived late: older state
    assert figs(sts["w0"]) == (4, 0)
    assert m.stats["duplicate"] == 2


def test_lost_messages_are_counted_and_the_next_message_repairs_the_state():
    m = PeerMerge("me", stale_s=1.0)
    sts = states("w0")
    applied(m, msg(0, [("w0", 1, 0, 0)]), sts, 0.0)
    # seq 1..3 lost (say the request count went 2, 3, 2); seq 4 carries the current value
    applied(m, msg(4, [("w0", 2, 0, 0)]), sts, 0.05)
    assert figs(sts["w0"]) == (2, 0) and m.stats["gap_messages"] == 3


def test_full_snapshot_zeroes_workers_it_omits():
    m = PeerMerge("me", stale_s=1.0)
    sts = states("w0", "w1")
    applied(m, msg(0, [("w0", 2, 10, 10), ("w1", 1, 5, 5)]), sts, 0.0)
    applied(m, msg(1, [("w1", 1, 5, 5)], full=True), sts, 0.5)  # w0's release message was lost
    assert figs(sts["w0"]) == (0, 0) and figs(sts["w1"]) == (1, 5)


def test_silent_peer_goes_stale_and_only_that_peer_falls_back():
    m = PeerMerge("me", stale_s=1.0)
    sts = states("w0")
    applied(m, msg(0, [("w0", 2, 0, 0)], broker="b1"), sts, 0.0)
    applied(m, msg(0, [("w0", 3, 0, 0)], broker="b2"), sts, 0.0)
    applied(m, msg(1, [("w0", 3, 0, 0)], broker="b2"), sts, 0.9)  # b2 keeps talking
    assert m.next_expiry() == pytest.approx(1.0)
    apply_changes(m.expire(0.99), sts.get)
    assert figs(sts["w0"]) == (5, 0)
    apply_changes(m.expire(1.01), sts.get)
    assert figs(sts["w0"]) == (3, 0)
    assert m.stale_peers() == ["b1"] and m.fresh_peers() == ["b2"] and m.stats["expired"] == 1
    apply_changes(m.expire(1.5), sts.get)  # counted once
    assert m.stats["expired"] == 1
    # it comes back (same epoch, later seq): accepted again from scratch
    assert applied(m, msg(7, [("w0", 1, 0, 0)], broker="b1"), sts, 2.0) == "applied"
    assert figs(sts["w0"]) == (4, 0) and m.stale_peers() == []


def test_peer_with_a_longer_snapshot_period_is_not_called_stale_between_snapshots():
    m = PeerMerge("me", stale_s=0.5)
    sts = states("w0")
    applied(m, msg(0, [("w0", 1, 0, 0)], full=True, full_ms=1000), sts, 0.0)
    apply_changes(m.expire(2.9), sts.get)
    assert figs(sts["w0"]) == (1, 0)
    apply_changes(m.expire(3.1), sts.get)
    assert figs(sts["w0"]) == (0, 0)


def test_restart_drops_the_old_epoch_and_ignores_its_stragglers():
    m = PeerMerge("me", stale_s=1.0)
    sts = states("w0")
    applied(m, msg(40, [("w0", 5, 500, 9000)], epoch=1), sts, 0.0)
    # (issue 32: at most one restart per min_restart_s, stale_s / 3 here)
    assert applied(m, msg(0, [("w0", 1, 100, 100)], epoch=2), sts, 0.4) == "applied"
    assert figs(sts["w0"]) == (1, 100) and m.stats["restarted"] == 1
    assert applied(m, msg(41, [("w0", 6, 0, 0)], epoch=1), sts, 0.5) == "old_epoch"
    assert figs(sts["w0"]) == (1, 100)


def test_own_messages_and_too_many_peers_are_refused():
    m = PeerMerge("me", stale_s=1.0, max_peers=2)
    sts = states("w0")
    assert applied(m, msg(0, [("w0", 1, 0, 0)], broker="me"), sts, 0.0) == "self"
    applied(m, msg(0, [("w0", 1, 0, 0)], broker="b1"), sts, 0.0)
    applied(m, msg(0, [("w0", 1, 0, 0)], broker="b2"), sts, 0.0)
    assert applied(m, msg(0, [("w0", 50, 0, 0)], broker="b3"), sts, 0.0) == "too_many_peers"
    assert figs(sts["w0"]) == (2, 0)


def test_worker_cap_per_peer_bounds_memory():
    m = PeerMerge("me", stale_s=1.0, max_workers_per_peer=3)
    for i in range(3):
        m.apply(msg(i, [(f"w{i}", 1, 0, 0)]), 0.0)
    _, ch = m.apply(msg(3, [("w3", 1, 0, 0)]), 0.0)
    assert ch == [] and m.stats["worker_cap"] == 1
    m.apply(msg(4, [("w0", 0, 0, 0)]), 0.0)  # w0 idle: its slot can be reused
    _, ch = m.apply(msg(5, [("w3", 1, 0, 0)]), 0.0)
    assert ch == [("w3", 1, 0, 0, True)]


def test_unknown_worker_is_seeded_from_totals_when_it_registers():
    m = PeerMerge("me", stale_s=1.0)
    m.apply(msg(0, [("late", 2, 64, 64)]), 0.0)
    assert apply_changes(m.apply(msg(1, [("late", 3, 96, 96)]), 0.0)[1], {}.get) == 0
    assert m.totals("late") == (3, 96) and m.totals("nobody") == (0, 0)


def test_random_message_streams_keep_sums_equal_to_the_latest_figures():
    """Loss, duplication and reordering in any mix: the sums always equal the figures of the
    newest message received from each fresh peer."""
    rng = random.Random(7)
    for trial in range(30):
        m = PeerMerge("me", stale_s=100.0)
        sts = states("w0", "w1", "w2")
        sent = []
        truth = {}
        for seq in range(40):
            for b in ("p1", "p2"):
                body = [(w, rng.randrange(5), rng.randrange(1000), seq * 10) for w in ("w0", "w1", "w2") if rng.random() < 0.6]
                sent.append(msg(seq, body, broker=b, full=True))
        rng.shuffle(sent)
        kept = [x for x in sent if rng.random() < 0.7]
        kept += rng.sample(kept, len(kept) // 5)  # duplicates
        for x in kept:
            applied(m, x, sts, 0.0)
            if x.seq > truth.get(x.broker, (-1, None))[0]:
                truth[x.broker] = (x.seq, {w: (n, p) for w, n, p, _ in x.workers})
        for w in ("w0", "w1", "w2"):
            want_n = sum(t[1].get(w, (0, 0))[0] for t in truth.values())
            want_p = sum(t[1].get(w, (0, 0))[1] for t in truth.values())
            assert figs(sts[w]) == (want_n, want_p) == m.totals(w), (trial, w)


# --------------------------------------------------------------------------- worker state


def test_peer_work_joins_the_correction_since_the_loadstat_without_double_counting():
    w = WorkerState("w0")
    w.update_load([load(4, 2, uncached=1000)], 0.0)
    assert w.pressure(0.1, 5.0) == 6
    w.record_dispatch(500)
    w.apply_peer_change(3, 900, 900)  # peers sent 3 requests (900 uncached tokens) since the snapshot
    assert w.pressure(0.1, 5.0) == 6 + 1 + 3
    assert w.pending_since_load_tokens == 500 + 900
    w.apply_peer_change(-1, -300, 0)  # one of them finished
    assert w.pressure(0.1, 5.0) == 9
    # the next LoadStat counts everyone's work: the correction starts again from zero
    w.update_load([load(7, 2, uncached=0)], 0.5)
    assert w.pressure(0.6, 5.0) == 9 and w.pending_since_load_tokens == 0
    assert (w.peer_inflight, w.inflight) == (2, 1)
    # without fresh telemetry: own plus peers' live figures
    assert w.pressure(10.0, 5.0) == 3
    assert w.fleet_prefill_tokens == 500 + 600


def test_dropped_peer_keeps_its_past_changes_until_the_next_loadstat():
    w = WorkerState("w0")
    w.update_load([load(0, 0)], 0.0)
    w.apply_peer_change(4, 400, 400)
    assert w.pressure(0.1, 5.0) == 4
    w.apply_peer_change(-4, -400, 0, live=False)  # its broker went silent: the work is still there
    assert w.pressure(0.1, 5.0) == 4 and w.peer_inflight == 0
    assert w.pressure(10.0, 5.0) == 0  # fallback view: own figures only


def test_record_dispatch_and_release_mark_the_exchange_dirty_set():
    dirty: set = set()
    w = WorkerState("w0", exchange_dirty=dirty)
    w.record_dispatch(10)
    assert dirty == {"w0"} and w.sent_tokens == 10
    dirty.clear()
    w.record_release(10)
    assert dirty == {"w0"} and w.sent_tokens == 10


def test_cache_aware_prefers_the_worker_peers_did_not_load():
    from mesh.routing.cache_policies import CacheAware

    pol = CacheAware(rng=random.Random(1), temperature=0, temperature_ms=0)
    a, b = WorkerState("a"), WorkerState("b")
    for s in (a, b):
        s.update_load([load(0, 0)], 0.0)
    a.apply_peer_change(8, 80_000, 80_000)  # another router just queued 80k tokens on a
    from mesh.routing.view import RouteRequest

    d = pol.choose(RouteRequest("r", 4000), [a, b], None, 0.1)
    assert d.worker_id == "b"


# --------------------------------------------------------------------------- publisher


def test_publisher_sends_changes_at_most_every_interval_and_full_snapshots():
    pub = PeerPublisher("me", 9, interval_s=0.005, full_interval_s=1.0)
    sts = states("w0", "w1")
    for s in sts.values():
        s.exchange_dirty = pub.dirty
    first = pub.build(0.0, sts.get, sts.values)
    assert first.full and first.workers == [] and first.seq == 0 and first.full_ms == 1000
    assert pub.next_due() == 1.0  # nothing dirty: only the next snapshot
    sts["w0"].record_dispatch(100)
    assert pub.next_due() == pytest.approx(0.005)
    assert pub.build(0.001, sts.get, sts.values) is None  # not yet
    m = pub.build(0.005, sts.get, sts.values)
    assert not m.full and m.workers == [("w0", 1, 100, 100)] and m.seq == 1
    sts["w1"].record_dispatch(7)
    sts["w0"].record_release(100)
    m = pub.build(0.011, sts.get, sts.values)
    assert sorted(m.workers) == [("w0", 0, 0, 100), ("w1", 1, 7, 7)]
    snap = pub.build(1.0, sts.get, sts.values)
    assert snap.full and snap.workers == [("w1", 1, 7, 7)]


def test_publisher_reports_a_vanished_worker_as_idle_and_caps_message_size():
    pub = PeerPublisher("me", 1, interval_s=0.0, full_interval_s=1.0, max_workers=2)
    sts = states("a", "b", "c")
    for s in sts.values():
        s.exchange_dirty = pub.dirty
        s.record_dispatch(1)
    pub.build(0.0, sts.get, sts.values)  # full: only 2 of 3 fit
    assert pub.stats["truncated"] == 1
    sts["a"].record_release(1)
    del sts["a"]  # the worker left the registry
    m = pub.build(0.01, sts.get, sts.values)
    assert m.workers == [("a", 0, 0, 1)]


def test_publisher_and_merge_round_trip_through_the_wire():
    pub = PeerPublisher("b1", 3, interval_s=0.0, full_interval_s=1.0)
    mine = states("w0")
    mine["w0"].exchange_dirty = pub.dirty
    theirs = states("w0")
    merge = PeerMerge("b2", stale_s=1.0)
    pub.build(0.0, mine.get, mine.values)
    for i in range(5):
        mine["w0"].record_dispatch(100)
        frames = P.encode_peer_load(pub.build(0.01 * (i + 1), mine.get, mine.values))
        decoded = P.decode_exchange(frames)
        applied(merge, decoded, theirs, 0.01 * (i + 1))
    assert figs(theirs["w0"]) == (5, 500)
    # the first sight's counter is a baseline, but the prefill outstanding then (100) is news
    assert theirs["w0"].pending_since_load_tokens == 500


def test_a_first_sight_counts_only_the_outstanding_prefill_as_sent():
    """A peer's counter at first sight of a worker is history (everything it ever sent there),
    not new work: only what it has outstanding there now counts as sent, and only when its
    figures are news (a peer that restarted starts from a baseline)."""
    merge = PeerMerge("b2", stale_s=1.0)
    outcome, changes = merge.apply(P.PeerLoad("b1", 3, 0, False, [("w0", 1, 300, 90_000)], 1000), 0.0)
    assert outcome == "applied" and changes == [("w0", 1, 300, 300, True)]
    outcome, changes = merge.apply(P.PeerLoad("b1", 3, 1, False, [("w1", 2, 5_000, 800)], 1000), 0.01)
    assert changes == [("w1", 2, 5_000, 800, True)]  # never more than the counter
    outcome, changes = merge.apply(P.PeerLoad("b1", 3, 2, False, [("w0", 2, 700, 90_400)], 1000), 0.02)
    assert changes == [("w0", 1, 400, 400, True)]  # then the counter's growth, as before


# --------------------------------------------------------------------------- protocol


def test_peer_load_round_trips():
    m = P.PeerLoad("b", 2**62, 7, True, [("w0", 1, 2, 3), ("w1", 0, 0, 2**40)], 250)
    assert P.decode_exchange(P.encode_peer_load(m)) == m


@pytest.mark.parametrize("frames,reason", [
    ([b"MESHX1", b"\x21"], "bad_frame_count"),
    ([b"MESHW1", b"\x21", P.pack({})], "bad_header"),
    ([b"MESHX1", b"\x21\x21", P.pack({})], "bad_command"),
    ([b"MESHX1", b"\x22", P.pack({})], "unknown_command"),
    ([b"MESHX1", b"\x21", b"\xc1"], "bad_msgpack"),
    ([b"MESHX1", b"\x21", P.pack([1, 2])], "bad_body"),
    ([b"MESHX1", b"\x21", b"\x00" * (P.MAX_EXCHANGE_BYTES + 1)], "too_large"),
])
def test_malformed_frames_are_rejected_with_a_reason(frames, reason):
    r = P.decode_exchange(frames)
    assert isinstance(r, ProtocolError) and r.reason == reason


def _body(**over):
    d = {"broker": "b", "epoch": 1, "seq": 0, "full": False, "workers": [["w", 1, 2, 3]]}
    d.update(over)
    return [P.EXCHANGE_HEADER, bytes([P.X_PEER_LOAD]), P.pack(d)]


@pytest.mark.parametrize("over,reason", [
    ({"broker": ""}, "bad_field"),
    ({"broker": "x" * 257}, "bad_field"),
    ({"broker": 5}, "bad_field"),
    ({"epoch": -1}, "bad_field"),
    ({"epoch": 2**64 - 1}, "bad_field"),
    ({"seq": "1"}, "bad_field"),
    ({"seq": 1.5}, "bad_field"),
    ({"full": 1}, "bad_field"),
    ({"full_ms": 0}, "bad_field"),
    ({"workers": {"w": 1}}, "bad_field"),
    ({"workers": [["w", 1, 2]]}, "bad_field"),
    ({"workers": [["", 1, 2, 3]]}, "bad_field"),
    ({"workers": [["é" * 200, 1, 2, 3]]}, "bad_field"),  # 400 bytes
    ({"workers": [["w", -1, 2, 3]]}, "bad_field"),
    ({"workers": [["w", 2**20 + 1, 2, 3]]}, "bad_field"),
    ({"workers": [["w", True, 2, 3]]}, "bad_field"),
    ({"workers": [["w", 1, 2**41, 3]]}, "bad_field"),
    ({"workers": [["w", 1, 2, float("nan")]]}, "bad_field"),
    ({"workers": [["w", 1, 2, 3], ["w", 0, 0, 3]]}, "duplicate_worker"),
    ({"workers": [["w%d" % i, 0, 0, 0] for i in range(P.MAX_EXCHANGE_WORKERS + 1)]}, "too_many_workers"),
])
def test_hostile_bodies_are_rejected_never_raised(over, reason):
    r = P.decode_exchange(_body(**over))
    assert isinstance(r, ProtocolError) and r.reason == reason, r


def test_fuzzed_bytes_never_raise():
    good = P.encode_peer_load(P.PeerLoad("b", 1, 0, True, [("w", 1, 2, 3)]))[2]
    for _ in fuzzed_exchange(good, 2000, 3, seed=3):
        pass


def test_exchange_command_stays_unknown_on_the_client_and_worker_paths():
    assert P.decode_client([P.CLIENT_HEADER, bytes([P.X_PEER_LOAD]), P.pack({})]).reason == "unknown_command"
    assert P.decode_worker([P.WORKER_HEADER, bytes([P.X_PEER_LOAD]), P.pack({})]).reason == "unknown_command"


# --------------------------------------------------------------------------- simulator


def _sim_cfg(**kw):
    return SimConfig(workload="shared_prefix", rate=20.0, duration_s=2.0, workers=[4], routers=[2], policies=["power_of_two"],
                     providers=["radix_tree"], seed=3, **kw)


def test_sim_router_sees_another_routers_dispatch_after_the_delay():
    cfg = _sim_cfg(exchange=True, exchange_delay_ms=3.0, exchange_interval_ms=5.0)
    wl = make_workload("shared_prefix", seed=3, rate=20.0, duration_s=2.0)
    arm = Arm(cfg, ArmSpec("power_of_two", "none", 2, 4), wl)
    r0, r1 = arm.routers
    from mesh.routing.view import RouteRequest

    # router 0 dispatches at t=0 (its first message, a full snapshot, goes out at once; the
    # change message is due one interval later) and router 1 merges it exchange_delay_ms after
    d = r0.route(RouteRequest("x", 1000), 0.0)
    msg0 = r0.publisher.build(0.0, r0.by_id.get, lambda: r0.states)
    assert msg0.full and msg0.workers == [(d.worker_id, 1, 1000, 1000)]
    _, changes = r1.merge.apply(msg0, 0.003)
    apply_changes(changes, r1.by_id.get)
    assert r1.by_id[d.worker_id].peer_inflight == 1 and r1.by_id[d.worker_id].inflight == 0
    assert r0.by_id[d.worker_id].peer_inflight == 0


def test_sim_exchange_runs_and_is_reproducible():
    on = run_sim(_sim_cfg(exchange=True))
    again = run_sim(_sim_cfg(exchange=True))
    off = run_sim(_sim_cfg())
    a = on["arms"][0]
    assert a["exchange"] and a["exchange_messages"] > 0 and a["exchange_applied"] > 0
    assert a == again["arms"][0]
    assert not off["arms"][0]["exchange"] and off["arms"][0]["exchange_messages"] == 0
    assert a["completed"] == off["arms"][0]["completed"]


def test_sim_exchange_with_one_router_is_a_no_op():
    cfg = _sim_cfg(exchange=True)
    cfg.routers = [1]
    base = _sim_cfg()
    base.routers = [1]
    x, y = run_sim(cfg)["arms"][0], run_sim(base)["arms"][0]
    assert x["exchange_messages"] == 0
    assert {k: v for k, v in x.items() if k != "exchange"} == {k: v for k, v in y.items() if k != "exchange"}


def test_sim_exchange_delay_decides_when_peers_see_the_work():
    """Figures that arrive only after the run change nothing (same routing as no exchange); a
    few milliseconds' delay changes where load-based routing sends requests."""
    off = run_sim(_sim_cfg())["arms"][0]
    late = run_sim(_sim_cfg(exchange=True, exchange_delay_ms=1e7))["arms"][0]
    soon = run_sim(_sim_cfg(exchange=True, exchange_delay_ms=2.0))["arms"][0]
    assert late["served_per_worker"] == off["served_per_worker"] and late["exchange_applied"] == 0
    assert soon["served_per_worker"] != off["served_per_worker"] and soon["exchange_applied"] > 0


def test_a_peers_forged_figures_do_not_outlive_the_next_loadstat_in_the_queue_estimate():
    """A hostile peer reports an enormous outstanding prefill and sent counter on a worker it
    has never used: the queue estimate takes it until the worker's next LoadStat, and after that
    at most one prefill chunk (the work a snapshot can miss) carries over, draining away."""
    from mesh.load import LoadStat
    from mesh.routing.cache_policies import CacheAware
    from mesh.routing.peers import apply_changes
    from mesh.routing.view import IN_PROGRESS_MAX_TOKENS

    w = states("w0")["w0"]
    w.update_load([LoadStat(0, 0, 0, 400_000, 0, 0, 0, 256, 0, 0)], 0.0)
    w.prefill_tokens_per_s = 25_000.0
    merge = PeerMerge("b2", stale_s=10.0)
    huge = P.MAX_PEER_PREFILL_TOKENS
    _, changes = merge.apply(P.PeerLoad("evil", 1, 0, False, [("w0", 5, huge, huge)], 1000), 0.1)
    apply_changes(changes, {"w0": w}.get, 0.1)
    pol = CacheAware()
    assert pol.queued_tokens(w, 0.1) >= huge  # believed until the worker speaks
    w.update_load([LoadStat(0, 0, 0, 400_000, 0, 0, 0, 256, 0, 0)], 0.5)
    w.prefill_tokens_per_s = 25_000.0
    assert pol.queued_tokens(w, 0.5) == IN_PROGRESS_MAX_TOKENS
    assert pol.queued_tokens(w, 0.501 + IN_PROGRESS_MAX_TOKENS / 25_000.0) == 0
