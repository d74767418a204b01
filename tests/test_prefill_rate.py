"""The router's prefill-rate estimate (mesh.load.PrefillRateEstimate) and how WorkerState uses it.

The failure it fixes, reproduced on the engine model: one heartbeat interval that holds a single
one-page prefill beside a decode batch gives SGLang's two-sample rate a figure 20-40x below what the
worker prefills, and the router read every queue on that worker as that much longer.
"""

from __future__ import annotations

import math
import random

import pytest

from mesh.engine_model import EngineModel
from mesh.load import LoadStat, PrefillRateEstimate, prefill_rate_tokens_per_s
from mesh.routing.view import WorkerState


def _ls(tokens: int, busy_us: int, rank: int = 0) -> LoadStat:
    return LoadStat(0, 0, 0, 400_000, rank, 0, 0, 256, tokens, busy_us)


def _prompt(n: int, base: int) -> list[int]:
    return [(base + i) % 31_000 + 1 for i in range(n)]


def _step_until_first_token(e: EngineModel, rid: str, t: float) -> float:
    while True:
        r = e.step(t)
        t += r.duration_s
        if any(x[0] == rid for x in r.first_tokens):
            return t


def test_a_one_page_prefill_beside_a_decode_batch_does_not_drag_the_pooled_rate_down():
    e = EngineModel()
    t = 0.0
    for i in range(24):  # a decode batch that keeps running
        e.submit(f"d{i}", _prompt(2_000, 7_000 * i), 10_000, t)
    t = _step_until_first_token(e, "d23", t)
    shared = _prompt(6_000, 900_000)
    pooled = PrefillRateEstimate()
    prev = first = e.load_stat()
    two_sample = []
    for k in range(12):
        # a 1,200-token question after a cached 6,000-token system prompt, then one page more
        rid = f"q{k}"
        e.submit(rid, shared + _prompt(1_200, 50_000 * (k + 1)), 4, t)
        t = _step_until_first_token(e, rid, t)
        cur = e.load_stat()
        two_sample.append(prefill_rate_tokens_per_s(prev, cur))
        pooled.update(prev, cur)
        prev = cur
        e.submit(rid + "r", shared + _prompt(1_200, 50_000 * (k + 1)) + _prompt(16, 3), 4, t)
        t = _step_until_first_token(e, rid + "r", t)
        cur = e.load_stat()
        two_sample.append(prefill_rate_tokens_per_s(prev, cur))
        pooled.update(prev, cur)
        prev = cur
    overall = prefill_rate_tokens_per_s(first, prev)  # the questions' tokens over their busy time
    assert overall is not None and overall > 10_000
    assert min(two_sample) < overall / 10  # the one-page intervals: what SGLang's formula reports
    assert pooled.rate_tokens_per_s == pytest.approx(overall, rel=0.1)


def test_the_estimate_follows_a_change_within_a_few_windows():
    est = PrefillRateEstimate(window_s=2.0)
    tok = busy = 0
    prev = _ls(tok, busy)
    for _ in range(40):  # 20,000 tokens/s, 0.1 s of busy time per sample
        tok, busy = tok + 2_000, busy + 100_000
        cur = _ls(tok, busy)
        est.update(prev, cur)
        prev = cur
    assert est.rate_tokens_per_s == pytest.approx(20_000)
    for _ in range(60):  # then 5,000 tokens/s for 6 s of busy time: 3 windows
        tok, busy = tok + 500, busy + 100_000
        cur = _ls(tok, busy)
        est.update(prev, cur)
        prev = cur
    assert est.rate_tokens_per_s == pytest.approx(5_000, rel=0.25)


def test_idle_samples_keep_the_estimate_and_a_restart_starts_it_over():
    est = PrefillRateEstimate()
    assert est.update(None, _ls(0, 0)) is None  # nothing prefilled yet: no rate
    assert est.update(_ls(0, 0), _ls(10_000, 500_000)) == pytest.approx(20_000)
    assert est.update(_ls(10_000, 500_000), _ls(10_000, 500_000)) == pytest.approx(20_000)  # idle
    # the publisher restarted: its counters went backwards; the estimate starts over from the
    # new counters (they count from the restart)
    assert est.update(_ls(10_000, 500_000), _ls(50, 1_000)) == pytest.approx(50_000)
    assert est.update(_ls(50, 1_000), _ls(1_050, 101_000)) == pytest.approx(1_050 / 0.101, rel=0.01)


def test_the_first_sample_seeds_the_rate_with_at_most_one_window_of_weight():
    """A router's first LoadStat from a worker already gives a rate: the counters run from the
    engine's start. A worker that ran for an hour at 20,000 tokens/s weighs one window (2 s of
    busy time), so one window at 5,000 tokens/s brings the estimate below 10,000."""
    est = PrefillRateEstimate(window_s=2.0)
    first = _ls(72_000_000, 3_600_000_000)
    assert est.update(None, first) == pytest.approx(20_000)
    assert est.busy_s == pytest.approx(2.0)
    assert est.update(first, _ls(72_010_000, 3_602_000_000)) < 10_000
    w = WorkerState("w")
    w.update_load([_ls(100_000, 1_000_000)], 0.5)  # one LoadStat: 100,000 tokens in 1 s of busy time
    assert w.prefill_tokens_per_s == pytest.approx(100_000)


def test_busy_time_without_tokens_lowers_the_rate_and_never_divides_by_zero():
    est = PrefillRateEstimate()
    assert est.update(_ls(0, 0), _ls(0, 1_000)) is None  # busy, nothing prefilled (transfers)
    r = est.update(_ls(0, 1_000), _ls(1_000, 101_000))
    assert r is not None and math.isfinite(r) and r < 10_000


def test_worker_state_sums_the_pooled_rate_of_every_rank():
    w = WorkerState("w", dp_size=2)
    w.update_load([_ls(0, 0, 0), _ls(0, 0, 1)], 0.0)
    assert w.prefill_tokens_per_s is None
    w.update_load([_ls(20_000, 1_000_000, 0), _ls(10_000, 1_000_000, 1)], 0.5)
    assert w.prefill_tokens_per_s == pytest.approx(30_000)
    # rank 1 reports a one-page interval: the rate barely moves (the two-sample rate would fall
    # to 20,000 + 640)
    w.update_load([_ls(20_000, 1_000_000, 0), _ls(10_016, 1_025_000, 1)], 1.0)
    assert w.prefill_tokens_per_s > 29_000


def test_hostile_counters_leave_a_finite_positive_rate_or_none():
    """A broken or lying worker's counters (jumps to 2^63, going backwards, busy time without
    tokens, tokens without busy time) never make the rate NaN, infinite, zero or negative, and
    never raise: the router either has a positive finite rate for it or falls back to the default."""
    rng = random.Random(5)
    w = WorkerState("liar")
    for i in range(2_000):
        tok = rng.choice([0, 1, rng.randrange(1 << 20), rng.randrange(1 << 63), (1 << 63) - 1])
        busy = rng.choice([0, 1, rng.randrange(1 << 20), rng.randrange(1 << 63), (1 << 63) - 1])
        w.update_load([_ls(tok, busy)], i * 0.1)
        r = w.prefill_tokens_per_s
        assert r is None or (math.isfinite(r) and r > 0), (i, tok, busy, r)


def test_hostile_first_samples_never_raise_and_seed_nothing_they_cannot_mean():
    """A broken or hostile worker's first LoadStat: counters at zero, negative, or not integers
    seed no rate (the cost model's reference rate stays in use); absurd but well-formed counters
    give a finite rate that later samples decay as any other (a lying worker could already claim
    any rate with its second sample)."""
    for tok, busy in ((0, 0), (-5, 1_000), (1_000, -1), (0, 1_000), (1_000, 0), (1.5, 2_000), (10, 2.5)):
        est = PrefillRateEstimate()
        assert est.update(None, _ls(tok, busy)) is None, (tok, busy)
        assert est.busy_s == 0.0
    est = PrefillRateEstimate(window_s=2.0)
    first = _ls(2**62, 1)
    r = est.update(None, first)
    assert r is not None and math.isfinite(r) and est.busy_s == pytest.approx(1e-6)
    keep = math.exp(-1.0 / 2.0)  # the next second of busy time decays the seed like any sample
    nxt = est.update(first, _ls(2**62 + 20_000, 1_000_001))
    assert nxt == pytest.approx((2**62 * keep + 20_000) / (1e-6 * keep + 1.0), rel=1e-6) and nxt < r
    w = WorkerState("w")
    w.update_load([_ls(-1, -1)], 0.5)
    assert w.prefill_tokens_per_s is None
