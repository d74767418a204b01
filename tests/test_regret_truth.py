"""The regret audit's one-step truth in the simulator (mesh.lab.sim.regret_truth, ``mesh sim
--regret-truth K``): a sampled decision replayed on copies of both workers' engines."""

from __future__ import annotations

import math

import pytest

from mesh.engine_model import EngineModel
from mesh.errors import ConfigError
from mesh.lab.sim.regret_truth import OneStepTruth, _first_token_ms


def _prompt(n: int, base: int) -> list[int]:
    return [(base + i) % 31_000 + 1 for i in range(n)]


def _queued(tokens: int) -> EngineModel:
    """An engine with ``tokens`` of uncached prefill waiting, its first step in flight."""
    e = EngineModel()
    for j in range(tokens // 4_000):
        e.submit(f"q{j}", _prompt(4_000, 1_000 * (j + 1)), 8, 0.0)
    return e


def test_the_one_step_truth_is_the_replayed_difference_and_leaves_the_engines_alone():
    idle, busy = EngineModel(), _queued(20_000)
    before = (busy.load_stat(now_s=0.0), idle.load_stat(now_s=0.0))
    prompt = _prompt(1_000, 77)
    idle_ms = _first_token_ms(idle, 0.0, 1, prompt, 8, 0.0)
    busy_ms = _first_token_ms(busy, 0.0, 1, prompt, 8, 0.0)
    rate = idle.config.prefill_tokens_per_s
    assert idle_ms == pytest.approx(idle.config.prefill_overhead_ms + 1e3 * 1_000 / rate, rel=0.05)
    assert busy_ms > 1e3 * 20_000 / rate  # behind the whole queue
    # the decision: cache_aware picked the idle worker (predicted 50 ms), greedy would have picked
    # the busy one (predicted 700 ms); power-of-two agreed with cache_aware
    truth = OneStepTruth(1)
    detail = {"predicted_ttft_ms": 50.0, "regret_audit": (1, 700.0, None, "busy", "idle")}
    engines = {"idle": (idle, 0.0), "busy": (busy, 0.0)}
    truth.sample(detail, idle, 0.0, engines, 1, prompt, 8, 0.0)
    truth.sample({"predicted_ttft_ms": 50.0, "regret_audit": (1, None, None, "idle", "idle")}, idle, 0.0, engines,
                 2, prompt, 8, 0.0)  # an agreeing decision: nothing replayed, half the share
    snap = truth.snapshot()
    g = snap["cache_aware_greedy"]
    assert snap["audited"] == 2 and g["sampled"] == 1 and g["differ_share"] == 0.5
    assert g["predicted_ms"] == pytest.approx(0.5 * 650.0)
    assert g["one_step_ms"] == pytest.approx(0.5 * (busy_ms - idle_ms), rel=1e-6)
    assert g["error_ci95_ms"] is None  # one sample knows nothing of the spread
    assert snap["power_of_two"]["sampled"] == 0 and snap["power_of_two"]["one_step_ms"] is None
    # the copies were replayed, not the engines
    assert (busy.load_stat(now_s=0.0), idle.load_stat(now_s=0.0)) == before


def test_every_kth_disagreement_is_sampled_and_bad_settings_are_refused():
    idle = EngineModel()
    truth = OneStepTruth(3)
    for i in range(9):
        truth.sample({"predicted_ttft_ms": 10.0, "regret_audit": (1, 20.0, None, "b", "a")}, idle, 0.0,
                     {"a": (idle, 0.0), "b": (EngineModel(), 0.0)}, i, _prompt(64, i), 4, 0.0)
    assert truth.sampled["cache_aware_greedy"] == 3
    g = truth.snapshot()["cache_aware_greedy"]
    # the same decision three times: the error's spread is 0, so is its interval
    assert g["error_ci95_ms"] == pytest.approx(0.0, abs=1e-6)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every"):
            OneStepTruth(bad)


def test_sim_regret_truth_option_reports_the_one_step_figure_and_is_validated():
    from mesh.lab.sim.runner import SimConfig, run_sim

    cfg = SimConfig(workload="zipf", rate=200.0, duration_s=None, max_requests=150, seed=1,
                    policies=["cache_aware", "power_of_two"], workers=[4], routers=[1], regret_truth_every=1)
    arms = {a["policy"]: a for a in run_sim(cfg)["arms"]}
    tr = arms["cache_aware"]["regret_truth"]
    assert tr["audited"] > 0 and tr["cache_aware_greedy"]["sampled"] + tr["power_of_two"]["sampled"] > 0
    assert all(math.isfinite(v["one_step_ms"]) for k, v in tr.items() if isinstance(v, dict) and v["sampled"])
    assert arms["power_of_two"]["regret_truth"] is None  # no audit, nothing to replay
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="regret_truth_every"):
            SimConfig(workload="zipf", regret_truth_every=bad).validate()
    # the command line and the matrix TOML: tests/test_regret.py::test_the_lab_regret_options_are_refused_naming_the_field


def test_the_matrix_splits_the_audits_error_at_the_one_step_truth():
    """The regret check judges the TTFT model against the one-step truth (within 25 % or the
    sample's interval) and the one-step truth against the arms' measured difference."""
    from mesh.lab.sim.matrix import regret_check

    subj = {"policy": "cache_aware", "ttft_mean_ms": 100.0,
            "regret": {"pays_ms": {"power_of_two": 50.0, "cache_aware_greedy": 30.0, "best": 30.0},
                       "baselines": {"power_of_two": {"decisions": 9}, "cache_aware_greedy": {"decisions": 9}}},
            "regret_truth": {"cache_aware_greedy": {"sampled": 40, "predicted_ms": 31.0, "one_step_ms": 14.0,
                                                    "error_ci95_ms": 3.0}}}
    base = [{"policy": "power_of_two", "ttft_mean_ms": 170.0}, {"policy": "cache_aware_greedy", "ttft_mean_ms": 102.0}]
    one = regret_check(subj, base)["one_step"]
    # the model over-predicts the one-step truth (31 vs 14), which is itself far from the measured 2
    assert one["sampled"] == 40 and not one["model_within"] and not one["one_step_within"]
    subj["regret_truth"]["cache_aware_greedy"]["error_ci95_ms"] = 20.0  # a sample that knows less
    assert regret_check(subj, base)["one_step"]["model_within"]
    subj["regret_truth"]["cache_aware_greedy"]["one_step_ms"] = 2.4  # 0.4 ms off the measured 2: within 25 %
    assert regret_check(subj, base)["one_step"]["one_step_within"]
    subj["regret_truth"] = {"power_of_two": {"sampled": 3, "predicted_ms": 1.0, "one_step_ms": 1.0}}
    assert "one_step" not in regret_check(subj, base)  # judged against the best baseline only
