"""Bursty arrivals, the fleet-wide shared first block and session re-arrivals (issue 33, part 1)."""

from __future__ import annotations

import statistics

import pytest

from mesh.errors import ConfigError
from mesh.lab.sim.matrix import load_matrix, stream_fingerprint
from mesh.lab.sim.workloads import WORKLOADS, burst_warp, make_workload

# Fingerprints of the streams before the common parameters existed (seed 7, 40 req/s, 300
# requests): the defaults must keep every stream byte-identical.
_BEFORE = {
    "conversation": "8eef043be2a7f423",
    "low_reuse": "6ba3c42dc827e348",
    "multi_turn": "ae6f7a896399cfc8",
    "shared_prefix": "661f1cb9a3c65967",
    "zipf": "1a50a8cf8ac8a2ff",
}


def _cv(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.pstdev(gaps) / statistics.fmean(gaps)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_defaults_keep_streams_identical(name):
    wl = make_workload(name, seed=7, rate=40.0, duration_s=None, max_requests=300)
    assert stream_fingerprint(wl) == _BEFORE[name]
    # arrival_cv=1 is Poisson: the same stream, not a warped one
    wl1 = make_workload(name, seed=7, rate=40.0, duration_s=None, max_requests=300, arrival_cv=1.0)
    assert stream_fingerprint(wl1) == _BEFORE[name]


@pytest.mark.parametrize("cv", [2.0, 2.9])
def test_arrival_cv_measured_within_tolerance(cv):
    wl = make_workload("low_reuse", seed=1, rate=50.0, duration_s=None, max_requests=20_000, arrival_cv=cv)
    times = [r.arrival_s for r in wl.requests]
    assert times == sorted(times)
    assert abs(_cv(times) - cv) / cv < 0.08
    # the mean rate is kept
    assert abs((len(times) - 1) / (times[-1] - times[0]) - 50.0) / 50.0 < 0.1


def test_bursty_stream_is_deterministic_and_rescales_with_rate():
    a = make_workload("zipf", seed=3, rate=20.0, duration_s=None, max_requests=500, arrival_cv=2.9)
    b = make_workload("zipf", seed=3, rate=20.0, duration_s=None, max_requests=500, arrival_cv=2.9)
    assert stream_fingerprint(a) == stream_fingerprint(b)
    c = make_workload("zipf", seed=3, rate=40.0, duration_s=None, max_requests=500, arrival_cv=2.9)
    # the same bursts, twice as close together (the matrix's calibration depends on it)
    assert [r.arrival_s / 2 for r in a.requests] == pytest.approx([r.arrival_s for r in c.requests])
    assert [r.segments for r in a.requests] == [r.segments for r in c.requests]


def test_burst_warp_is_monotone_and_keeps_order():
    times = [i * 0.01 for i in range(1000)]
    out = burst_warp(times, seed=1, rate=100.0, cv=3.0, peak=8.0)
    assert out == sorted(out) and len(out) == len(times)
    gaps = [b - a for a, b in zip(out, out[1:])]
    assert min(gaps) == pytest.approx(0.01 / 8)  # inside an on-period: 8x the rate


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_shared_first_block_on_every_prompt(name):
    wl = make_workload(name, seed=2, rate=40.0, duration_s=None, max_requests=200, shared_first_tokens=512)
    base = make_workload(name, seed=2, rate=40.0, duration_s=None, max_requests=200)
    first = {tuple(wl.prompt(r)[:512]) for r in wl.requests}
    assert len(first) == 1
    for r, b in zip(wl.requests, base.requests):
        assert r.prompt_len == b.prompt_len + 512
        assert list(wl.prompt(r)[512:]) == list(base.prompt(b))


def test_shared_first_block_keeps_multi_turn_histories():
    wl = make_workload("conversation", seed=1, rate=10.0, duration_s=None, max_requests=400, shared_first_tokens=256)
    by_session: dict[int, list] = {}
    for r in wl.requests:
        by_session.setdefault(r.session, []).append(r)
    follow = [(a, b) for turns in by_session.values() for a, b in zip(turns, turns[1:])]
    assert follow
    for a, b in follow:  # a later turn starts with the whole earlier prompt (shared block once)
        assert list(wl.prompt(b)[: a.prompt_len]) == list(wl.prompt(a))


def test_rearrivals_land_inside_bursts():
    kw = dict(seed=1, rate=10.0, duration_s=None, max_requests=2000, think_s=10.0)
    plain = make_workload("conversation", **kw)
    quick = make_workload("conversation", rearrival_share=0.5, **kw)

    def quick_follow_ups(wl):
        last: dict[int, float] = {}
        n = 0
        for r in wl.requests:
            if r.session in last and r.arrival_s - last[r.session] < 1.0:
                n += 1
            last[r.session] = r.arrival_s
        return n

    assert quick_follow_ups(quick) > 5 * max(1, quick_follow_ups(plain))


def test_matrix_bursty_workloads_look_like_the_trace():
    mc = load_matrix("configs/quality-matrix.toml", only="bursty")
    labels = {c.label for c in mc.cells}
    for r in (1, 4, 8):
        assert f"bursty_conversation L1 W16 R{r}" in labels and f"bursty_zipf L1 W16 R{r}" in labels
    p = mc.workloads["bursty_conversation"].params
    wl = make_workload("conversation", seed=1, rate=3.2, duration_s=None, max_requests=2000, **p)
    assert 2.5 < _cv([r.arrival_s for r in wl.requests]) < 3.3
    lens = sorted(r.prompt_len for r in wl.requests)
    assert 6000 < lens[len(lens) // 2] < 9000
    assert lens[-1] <= 123_392


@pytest.mark.parametrize("field,value", [
    ("arrival_cv", 0.5), ("arrival_cv", "2"), ("arrival_cv", float("nan")), ("arrival_cv", 1e9),
    ("burst_peak", 1.0), ("burst_peak", -3), ("shared_first_tokens", -1), ("shared_first_tokens", 1.5),
    ("shared_first_tokens", 10**9), ("rearrival_share", 1.5), ("rearrival_share", "x"),
])
def test_bad_common_params_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        make_workload("zipf", seed=1, max_requests=10, duration_s=None, **{field: value})


def test_matrix_rejects_unknown_params_but_takes_common_ones(tmp_path):
    base = ('[matrix]\nseeds=[1]\npolicies=["power_of_two", "cache_aware"]\nbaselines=["power_of_two"]\nsubject="cache_aware"\n'
            'hit_reference="power_of_two"\n[workloads.z]\nworkload="zipf"\nparams={%s}\n'
            '[[cells]]\nworkload="z"\nload=1.0\nworkers=2\nrouters=1\nmax_requests=10\n')
    ok = tmp_path / "ok.toml"
    ok.write_text(base % "arrival_cv = 2.0, shared_first_tokens = 64")
    assert load_matrix(ok).workloads["z"].params["arrival_cv"] == 2.0
    bad = tmp_path / "bad.toml"
    bad.write_text(base % "arrival_cvv = 2.0")
    with pytest.raises(ConfigError, match="arrival_cvv"):
        load_matrix(bad)
