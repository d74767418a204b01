"""Admission formulas, pressure orderings and the pressure guard (sglang-router-design.md §3)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.load import LoadStat
from mesh.routing.admission import (
    LoadView,
    PressureGuard,
    Snapshot,
    admit_cache_candidate,
    admit_decode,
    admit_prefill,
    admitted_workers,
    kv_ok,
    least_decode_pressure,
    least_prefill_pressure,
)
from mesh.routing.view import WorkerState


def ws(wid="w", *, running=0, waiting=0, wu=0, total=0, used=0, cap=10_000, max_running=8, rate=None, at=0.0, inflight=0):
    w = WorkerState(wid, inflight=inflight)
    w.update_load([LoadStat(running, waiting, used, cap, 0, wu, total, max_running, 0, 0)], at)
    w.prefill_tokens_per_s = rate
    return w


def v(w, now=0.0):
    return LoadView.of(w, now, 5.0)


def test_kv_ok_running_slots_and_tokens():
    assert kv_ok(v(ws(running=7, max_running=8)), 0)
    assert not kv_ok(v(ws(running=8, max_running=8)), 0)
    assert kv_ok(v(ws(total=9_000, cap=10_000)), 1_000)
    assert not kv_ok(v(ws(total=9_000, cap=10_000)), 1_001)


def test_fail_open_without_fresh_complete_telemetry():
    full = ws(running=8, max_running=8, total=10_000)
    assert not admit_prefill(v(full), 1, None)
    assert admit_prefill(v(full, now=6.0), 1, None)  # stale: admitted
    short = WorkerState("s")
    short.update_load([LoadStat(8, 0, 0, 10, 0, extended=False)], 0.0)
    assert admit_prefill(v(short), 10**9, 1) and admit_decode(v(short), 10**9)  # no extension: admitted
    assert admit_prefill(v(WorkerState("never")), 10**9, 1)
    assert not v(short).fresh


def test_prefill_domain_queue_limit_uses_L():
    w = ws(wu=3_000)
    assert admit_prefill(v(w), 1_000, 4_000)
    assert not admit_prefill(v(w), 1_001, 4_000)
    assert admit_prefill(v(w), 1_001, None)


def test_cache_candidate_queue_limit_uses_its_uncached_work():
    w = ws(wu=3_000)
    assert admit_cache_candidate(v(w), 5_000, 1_000, 4_000)  # E = 1000 fits although L does not
    assert not admit_cache_candidate(v(w), 5_000, 1_001, 4_000)
    assert not admit_cache_candidate(v(ws(total=9_000)), 1_001, 1, None)  # KV check still on L


def test_decode_admission_uses_peak_size():
    w = ws(total=8_000, cap=10_000)
    assert admit_decode(v(w), 2_000)
    assert not admit_decode(v(w), 2_001)


def test_live_correction_since_snapshot():
    w = ws(running=6, max_running=8, wu=100, total=1_000)
    w.record_dispatch(500)
    lv = v(w)
    assert lv.waiting_uncached == 600 and lv.total_tokens == 1_500 and lv.sent_since == 1
    assert kv_ok(lv, 0)
    w.record_dispatch(0)
    assert not kv_ok(v(w), 0)  # 6 running + 2 sent since + 1 > 8


def test_snapshot_memoises_one_view_per_worker():
    w = ws()
    s = Snapshot(0.0, 5.0)
    assert s.view(w) is s.view(w)


def test_prefill_ordering_queue_ms_when_everyone_has_it():
    a = ws("a", wu=1_000, rate=1_000.0)  # 1000 ms
    b = ws("b", wu=3_000, rate=10_000.0)  # 300 ms
    assert least_prefill_pressure([v(a), v(b)]).worker_id == "b"
    c = ws("c", wu=10)  # no rate: falls back to the token tuple for everyone
    assert least_prefill_pressure([v(a), v(b), v(c)]).worker_id == "c"


def test_prefill_ordering_tuple_then_local_then_id():
    a = ws("a", wu=100, waiting=5)
    b = ws("b", wu=100, waiting=3, running=9)
    assert least_prefill_pressure([v(a), v(b)]).worker_id == "b"
    c = ws("c", wu=100, waiting=3, running=1)
    assert least_prefill_pressure([v(b), v(c)]).worker_id == "c"
    d, e = ws("d", inflight=2), ws("e", inflight=1)
    d.inflight_at_load = e.inflight_at_load = 0
    assert least_prefill_pressure([v(d), v(e)]).worker_id == "e"
    assert least_prefill_pressure([v(ws("y")), v(ws("x"))]).worker_id == "x"


def test_mixed_freshness_compares_router_local_load():
    fresh_busy = ws("a", wu=50_000)
    stale = WorkerState("b", inflight=3)
    assert least_prefill_pressure([v(fresh_busy), v(stale)]).worker_id == "a"  # 0 in flight vs 3
    assert least_decode_pressure([v(fresh_busy), v(stale)]).worker_id == "a"


def test_decode_ordering():
    a = ws("a", waiting=1)
    b = ws("b", running=5)
    assert least_decode_pressure([v(a), v(b)]).worker_id == "b"
    c = ws("c", running=5, used=5_000, cap=10_000)
    d = ws("d", running=5, used=5_000, cap=20_000)
    assert least_decode_pressure([v(c), v(d)]).worker_id == "d"  # lower KV usage fraction
    e = ws("e", running=5, used=2_000, cap=4_000)
    f = ws("f", running=5, used=4_000, cap=8_000)
    assert least_decode_pressure([v(f), v(e)]).worker_id == "e"  # same fraction: fewer used tokens


def test_pressure_guard_needs_both_gaps():
    g = PressureGuard()
    assert g.prefers(v(ws(wu=3_000)), v(ws(wu=1_000)))  # gap 2000 > 1024 and 3000 > 1500
    assert not g.prefers(v(ws(wu=2_000)), v(ws(wu=1_000)))  # relative ok, absolute 1000 not > 1024
    assert not g.prefers(v(ws(wu=4_000)), v(ws(wu=2_900)))  # absolute 1100 ok, 4000 < 4350
    assert not PressureGuard(enabled=False).prefers(v(ws(wu=9_000)), v(ws()))
    assert not g.prefers(v(ws(wu=9_000), now=9.0), v(ws()))  # needs fresh data on both


def test_pressure_guard_ms_variant():
    g = PressureGuard(abs_ms=100.0)
    p = ws(wu=2_000, rate=10_000.0)  # 200 ms
    b = ws(wu=500, rate=10_000.0)  # 50 ms
    assert g.prefers(v(p), v(b))  # 150 ms > 100 and 200 > 75
    assert not PressureGuard(abs_ms=200.0).prefers(v(p), v(b))
    # without queue times on both sides the token variant applies
    assert g.prefers(v(ws(wu=2_000)), v(ws(wu=500)))  # 1500 tokens > 1024 and 2000 > 750
    assert not g.prefers(v(ws(wu=1_000)), v(ws(wu=100)))  # 900 tokens: no, whatever the ms threshold


@settings(max_examples=300, deadline=None)
@given(
    ranks=st.lists(st.tuples(st.integers(0, 10), st.integers(1, 10), st.integers(0, 5_000), st.integers(0, 5_000),
                             st.booleans(), st.booleans()), min_size=0, max_size=3),
    inflight=st.integers(0, 6), at_load=st.integers(0, 6), pend=st.integers(0, 3_000),
    now=st.sampled_from([0.0, 4.9, 5.1]), L=st.integers(0, 6_000), limit=st.none() | st.integers(1, 8_000),
)
def test_fast_admission_scan_matches_the_formulas(ranks, inflight, at_load, pend, now, L, limit):
    w = WorkerState("w", dp_size=max(1, len(ranks)))
    if ranks:
        w.update_load([LoadStat(r, 0, 0, 5_000 if cap else 0, i, wu, tot, mr, 0, 0, extended=ext)
                       for i, (r, mr, wu, tot, ext, cap) in enumerate(ranks)], 0.0)
    w.inflight, w.inflight_at_load, w.pending_since_load_tokens = inflight, at_load, pend
    lv = LoadView.of(w, now, 5.0)
    assert bool(admitted_workers([w], now, 5.0, L, L, limit)) == admit_prefill(lv, L, limit)
    assert bool(admitted_workers([w], now, 5.0, L)) == admit_decode(lv, L)
