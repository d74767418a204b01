"""cache_aware's online TTFT calibration (mesh.routing.calibration) and its use by the policy."""

from __future__ import annotations

import random

from mesh.load import LoadStat
from mesh.routing.cache_policies import CacheAware
from mesh.routing.calibration import CalibrationSettings, TtftCalibrator
from mesh.routing.router import Router
from mesh.routing.view import RouteRequest, WorkerState
from tests.fakes import FakeMatch

PRIOR = (5.0, 1.0, 1.0, 2000.0)


def _stream(theta, n, seed=1, noise=0.05):
    rng = random.Random(seed)
    for _ in range(n):
        x = (1.0, rng.uniform(10, 400), rng.uniform(0, 60), 1.0 if rng.random() < 0.05 else 0.0)
        y = sum(t * v for t, v in zip(theta, x)) * (1 + rng.uniform(-noise, noise))
        yield x, y


def test_learns_a_fleet_slower_than_the_prior_and_trusts_it():
    truth = (30.0, 2.5, 1.8, 1500.0)  # a GPU 2.5x slower at prefill than the default model
    c = TtftCalibrator(PRIOR)
    assert not c.trusted and not c.use_fit  # nothing observed: the prior, not trusted
    for x, y in _stream(truth, 600):
        c.observe(x, y, c.best(x))
    assert c.use_fit and c.trusted
    assert abs(c.theta[1] - 2.5) < 0.15, c.snapshot()
    assert c.fit_rel_err < 0.1 < c.raw_rel_err  # the fit predicts far better than the prior
    x = (1.0, 200.0, 20.0, 0.0)
    want = sum(t * v for t, v in zip(truth, x))
    assert abs(c.best(x) - want) / want < 0.1


def test_keeps_the_prior_when_fitting_does_not_pay_and_distrusts_noise():
    c = TtftCalibrator(PRIOR)
    rng = random.Random(3)
    for x, _ in _stream(PRIOR, 400):
        c.observe(x, rng.uniform(1, 3000), c.best(x))  # outcomes unrelated to the features
    assert not c.trusted
    snap = c.snapshot()
    assert snap["observations"] == 400 and snap["trusted"] is False


def test_bad_outcomes_are_ignored_and_runaway_fits_restart_from_the_prior():
    c = TtftCalibrator(PRIOR, CalibrationSettings(min_observations=1))
    for bad in (float("nan"), -1.0, float("inf")):
        c.observe((1.0, 10.0, 0.0, 0.0), bad)
    c.observe((1.0, 10.0), 5.0)  # wrong arity
    assert c.observations == 0 and c.theta == list(PRIOR)
    # outcomes that would need an absurd fit (a 1,000 s first token on a 10 ms prediction)
    for _ in range(50):
        c.observe((1.0, 10.0, 0.0, 0.0), 1e6)
    assert all(lo - 1.0 <= v <= hi for v, (lo, hi) in zip(c.theta, ((-1e3, 5e3), (0, 20), (0, 20), (0, 6e4))))


def _worker(wid, *, waiting_uncached=0, running=0, at=0.0):
    w = WorkerState(wid)
    w.update_load([LoadStat(num_running_reqs=running, num_waiting_reqs=0, num_tokens=0,
                            max_total_num_tokens=400_000, num_waiting_uncached_tokens=waiting_uncached,
                            num_total_tokens=0, max_running_requests=256)], at)
    return w


def test_queued_prefill_drains_at_the_worker_rate_since_the_snapshot():
    # 50k uncached tokens waiting at the snapshot; at 25k tokens/s they are gone 2 s later
    pol = CacheAware(calibrate=False)
    w = _worker("a", waiting_uncached=50_000)
    at0 = pol.predicted_ttft_ms(w, 1000, 1000, 0.0)
    at1 = pol.predicted_ttft_ms(w, 1000, 1000, 1.0)
    at3 = pol.predicted_ttft_ms(w, 1000, 1000, 3.0)
    assert at0 > at1 > at3
    assert abs(at1 - at0 + 1000.0) < 1.0  # one second of drain = 1,000 ms less queue
    assert at3 < 50.0  # only its own 1,000 tokens (40 ms) and the overhead are left


def test_router_outcomes_reach_the_policy_and_change_its_predictions():
    pol = CacheAware(calibration=CalibrationSettings(min_observations=8))
    router = Router(pol)
    pool = [_worker("a"), _worker("b")]
    before = pol.predicted_ttft_ms(pool[0], 2048, 2048, 0.0)
    for i in range(200):
        d = router.route(RouteRequest(f"r{i}", 2048, 16, 16), pool, 0.0)
        assert "cost_x" in d.detail and d.detail["predicted_ttft_ms"] > 0
        # this fleet is 3x slower than the model assumes
        router.observe(d, 3.0 * d.detail["cost_x"][1] + 5.0)
        Router.release(next(w for w in pool if w.worker_id == d.worker_id), d)
    after = pol.predicted_ttft_ms(_worker("fresh"), 2048, 2048, 0.0)
    assert pol.calibrator.use_fit and pol.calibrator.trusted
    assert 2.5 * before < after < 3.5 * before, (before, after, pol.calibrator.snapshot())


def test_default_ignores_the_cost_model_for_ties():
    # the default (cost_ties="never", chosen on the quality matrix) orders equally loaded
    # holders by worker id even when the calibration trusts the cost model (a miss goes by
    # prefill queue: test_policies.py; a's 800 ms queue is under the stall escape's 1 s floor)
    pol = CacheAware(calibration=CalibrationSettings(min_observations=1))
    for _ in range(5):
        x = (1.0, 100.0, 0.0, 0.0)
        pol.calibrator.observe(x, pol.calibrator.best(x), pol.calibrator.best(x))
    assert pol.calibrator.trusted
    pool = [_worker("a", waiting_uncached=20_000), _worker("b", waiting_uncached=100)]
    assert pol.choose(RouteRequest("q", 2048, 16, 16), pool, FakeMatch({"a": 128, "b": 128}, 128), 0.0).worker_id == "a"


def test_untrusted_cost_model_falls_back_to_request_counts_trusted_one_reads_queues():
    # equal request counts, both hold the prompt; "a" has a long prefill queue. Until the
    # calibration trusts its predictions the choice is greedy's (lowest id at equal load); once
    # trusted, the queue decides (a's 800 ms queue is under the stall escape's 1 s floor).
    def pool():
        return [_worker("a", waiting_uncached=20_000), _worker("b", waiting_uncached=100)]
    pol = CacheAware(calibration=CalibrationSettings(min_observations=4), cost_ties="auto")
    both = FakeMatch({"a": 128, "b": 128}, 128)
    assert pol.choose(RouteRequest("q", 2048, 16, 16), pool(), both, 0.0).worker_id == "a"
    for _ in range(10):
        x = (1.0, 100.0, 0.0, 0.0)
        pol.calibrator.observe(x, pol.calibrator.best(x) * 1.01, pol.calibrator.best(x))
    assert pol.calibrator.trusted
    assert pol.choose(RouteRequest("q", 2048, 16, 16), pool(), both, 0.0).worker_id == "b"
