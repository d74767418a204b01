"""The engine fit of the policy-level audit (mesh.lab.sim.fit): the solver on known curves, the
observation a recording gives (forged figures left out), and the scaled engine."""

from __future__ import annotations

import math

import pytest

from mesh.engine_model import EngineConfig
from mesh.lab.sim.fit import MAX_EVALUATIONS, SPEED_BOUNDS, Observed, fit_engine, observed_from_arm, observed_from_recording, scaled_engine


def _fleet(true_prefill: float, true_decode: float):
    """A made-up fleet whose figures bend (queueing makes TTFT steeper than 1/speed) and cross
    (decode steps delay prefills; prefills stretch decode steps)."""
    def figures(p: float, d: float) -> tuple[float, float]:
        p, d = p / true_prefill, d / true_decode
        return 300.0 / p ** 1.4 + 40.0 / d ** 0.5, 20.0 / d + 3.0 / p ** 0.3
    return figures


@pytest.mark.parametrize("true_prefill, true_decode", [(1.2, 0.8), (0.5, 2.0), (3.0, 3.0), (1.0, 1.0), (0.3, 1.1)])
def test_the_fit_finds_both_speeds_of_a_bent_crossed_fleet(true_prefill, true_decode):
    f = _fleet(true_prefill, true_decode)
    calls = []

    def evaluate(p, d):
        calls.append((p, d))
        return f(p, d)

    target = Observed(*f(true_prefill, true_decode), 500)
    fit = fit_engine(evaluate, target)
    assert fit["converged"] and fit["evaluations"] == len(calls) <= MAX_EVALUATIONS
    assert fit["prefill_speed"] == pytest.approx(true_prefill, rel=0.05)
    assert fit["decode_speed"] == pytest.approx(true_decode, rel=0.05)
    assert abs(fit["ttft_ratio"] - 1) <= 0.02 and abs(fit["tpot_ratio"] - 1) <= 0.02
    assert calls[0] == (1.0, 1.0) and len(fit["steps"]) == len(calls)


def test_without_decode_figures_only_the_prefill_speed_is_fitted():
    f = _fleet(1.7, 0.6)
    fit = fit_engine(lambda p, d: (f(p, d)[0], None), Observed(f(1.7, 0.6)[0], None, 10))
    assert fit["converged"] and not fit["fitted_tpot"] and fit["decode_speed"] == 1.0 and fit["tpot_ratio"] is None
    assert fit["ttft_ratio"] == pytest.approx(1.0, abs=0.02)


def test_a_fleet_beyond_the_bounds_stops_at_the_bound_not_converged():
    f = _fleet(50.0, 1.0)  # 50x as fast as described: past the 8x bound
    fit = fit_engine(f, Observed(*f(50.0, 1.0), 10))
    assert not fit["converged"] and fit["prefill_speed"] == pytest.approx(SPEED_BOUNDS[1])
    assert fit["evaluations"] <= MAX_EVALUATIONS


def test_a_flat_or_broken_evaluation_never_loops_or_divides_by_zero():
    fit = fit_engine(lambda p, d: (100.0, 10.0), Observed(200.0, 5.0, 1))  # speeds change nothing
    assert not fit["converged"] and fit["evaluations"] <= MAX_EVALUATIONS
    with pytest.raises(ValueError, match="no usable mean TTFT"):
        fit_engine(lambda p, d: (float("nan"), None), Observed(100.0, None, 1))
    with pytest.raises(ValueError, match="target"):
        fit_engine(lambda p, d: (1.0, None), Observed(0.0, None, 1))


def test_a_recording_gives_its_mean_ttft_and_tpot_and_forged_figures_are_left_out():
    recs = [{"outcome": "ok", "ttft_ms": 100.0, "e2e_ms": 300.0, "output_length": 11},   # TPOT 20
            {"outcome": "ok", "ttft_ms": 200.0, "e2e_ms": 500.0, "output_length": 31},   # TPOT 10
            {"outcome": "ok", "ttft_ms": 300.0, "e2e_ms": 300.0, "output_length": 1},    # one token: no TPOT
            {"outcome": "ok", "ttft_ms": 400.0, "e2e_ms": None, "output_length": 5},     # old recording: no e2e
            {"outcome": "no_worker", "ttft_ms": 9999.0},
            {"outcome": "ok", "ttft_ms": float("nan")}, {"outcome": "ok", "ttft_ms": -5.0},
            {"outcome": "ok", "ttft_ms": True}, {"outcome": "ok", "ttft_ms": "100"},
            {"outcome": "ok", "ttft_ms": 500.0, "e2e_ms": 100.0, "output_length": 3},    # ends before its first token
            {"outcome": "ok", "ttft_ms": 500.0, "e2e_ms": float("inf"), "output_length": 3},
            {"outcome": "ok", "ttft_ms": 500.0, "e2e_ms": 900.0, "output_length": 2.5}]
    ob = observed_from_recording(recs)
    assert ob.requests == 7 and ob.ttft_mean_ms == pytest.approx((100 + 200 + 300 + 400 + 500 * 3) / 7)
    assert ob.tpot_mean_ms == pytest.approx(15.0)
    assert observed_from_recording([]) is None and observed_from_recording(None) is None
    assert observed_from_recording([{"outcome": "ok", "ttft_ms": 10.0}]).tpot_mean_ms is None
    assert observed_from_arm({"ttft_mean_ms": 5.0, "tpot_mean_ms": 2.0, "completed": 3}) == Observed(5.0, 2.0, 3)


def test_the_scaled_engine_is_that_many_times_as_fast_on_each_side():
    e = EngineConfig()
    s = scaled_engine(e, 2.0, 4.0)
    assert s.prefill_tokens_per_s == 2 * e.prefill_tokens_per_s and s.prefill_overhead_ms == e.prefill_overhead_ms / 2
    assert s.attention_coef_ms == e.attention_coef_ms / 2
    assert s.decode_base_ms == e.decode_base_ms / 4 and s.decode_per_req_ms == e.decode_per_req_ms / 4
    assert s.max_total_num_tokens == e.max_total_num_tokens and s.page_size == e.page_size  # memory untouched
    assert scaled_engine(e, 1.0, 1.0) == e
    assert math.isclose(scaled_engine(s, 0.5, 0.25).prefill_tokens_per_s, e.prefill_tokens_per_s)


def test_a_noisy_response_falls_back_to_the_least_squares_plane():
    """On a short stream each run's mean moves by several per cent with a 1 % change of speed
    (a real 300-request replay: 0.93x .. 1.08x within 3 % of speed): the steps chase that noise,
    and the fit takes the plane through every evaluation instead of the luckiest one."""
    f = _fleet(0.95, 0.95)

    def noisy(p, d):
        t, s = f(p, d)
        return t * (1 + 0.06 * math.sin(9000 * p + 7000 * d)), s * (1 + 0.01 * math.sin(5000 * p))

    fit = fit_engine(noisy, Observed(*f(0.95, 0.95), 300), tolerance=0.002)  # below the noise: never met by a step
    assert fit["least_squares"] and fit["evaluations"] == MAX_EVALUATIONS
    assert fit["prefill_speed"] == pytest.approx(0.95, rel=0.08) and fit["decode_speed"] == pytest.approx(0.95, rel=0.05)
    flat = fit_engine(lambda p, d: (100.0, 10.0), Observed(200.0, 5.0, 1))  # no slope at all: no plane to solve
    assert not flat["converged"] and not flat["least_squares"]
