"""cache_aware's counterfactual regret audit (mesh.routing.regret, issue 33 part 3): known views give
known regrets, the audit never moves a decision, its figures reach /metrics, STATUS, telemetry and
``mesh top``, the flag is validated, and the simulator's arms carry it."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from mesh.config import BrokerSettings, build
from mesh.errors import ConfigError
from mesh.routing.cache_policies import CacheAware, CacheAwareGreedy
from mesh.routing.factory import make_router
from mesh.routing.regret import REGRET_BUCKETS_MS, RegretAudit, audit_enabled, merged_pays
from mesh.routing.router import Router
from mesh.routing.view import RouteRequest, WorkerState

BS = 16


@dataclass
class _M:
    worker_id: str
    blocks: int


class _Match:
    """A MatchView over fixed per-worker block counts."""

    def __init__(self, blocks: dict[str, int], query_blocks: int) -> None:
        self.blocks = blocks
        self.query_blocks = query_blocks

    def matched_blocks(self, wid: str) -> int:
        return self.blocks.get(wid, 0)

    def top(self, k: int) -> list[_M]:
        got = sorted(((b, w) for w, b in self.blocks.items() if b), reverse=True)[:k]
        return [_M(w, b) for b, w in got]


class _Prov:
    name = "fixed"

    def __init__(self, match: _Match) -> None:
        self.m = match

    def match(self, req, now_s):
        return self.m

    def on_routed(self, req, wid, now_s):
        pass


def _fleet(inflight: list[int]) -> list[WorkerState]:
    out = []
    for i, n in enumerate(inflight):
        w = WorkerState(f"w{i}", block_size=BS)
        w.inflight = n  # no telemetry: pressure is the router's own in-flight count, no queue
        out.append(w)
    return out


def _route(pool, blocks: dict[str, int], L: int = 1024, audit: RegretAudit | None = None):
    audit = audit or RegretAudit(random.Random(1))
    r = Router(CacheAware(rng=random.Random(0)), _Prov(_Match(blocks, L // BS)), audit)
    d = r.route(RouteRequest("r1", L, 8, BS), pool, 1.0)
    return d, audit


# the fixed (prior) model, no telemetry, one 8k chunk: ttft = 5 ms + 1000 x uncached / 25k tok/s + (7 + 0.02 x running) if running
def _prior_ms(uncached: int, running: int) -> float:
    return 5.0 + 1000.0 * uncached / 25_000 + ((7.0 + 0.02 * running) if running else 0.0)


def test_known_view_gives_known_regret_against_both_baselines():
    # w0 holds exactly half of the prompt (cache_aware's affinity threshold, not greedy's: greedy
    # wants more than half) and has one request; w1 is idle and holds nothing. cache_aware sticks to
    # w0; greedy takes the least loaded (w1); p2c compares the only pair and takes w1 too.
    pool = _fleet([1, 0])
    d, audit = _route(pool, {"w0": 32})
    assert d.worker_id == "w0"
    expect = _prior_ms(1024, 0) - _prior_ms(512, 1)  # 45.96 - 32.5
    snap = audit.snapshot()
    for b in ("power_of_two", "cache_aware_greedy"):
        assert snap["baselines"][b]["decisions"] == 1
        assert snap["baselines"][b]["mean_ms"] == pytest.approx(expect, abs=1e-3)
    assert audit.pays_ms()["best"] == pytest.approx(expect, abs=1e-3)


def test_same_pick_is_zero_regret_and_a_one_worker_pool_is_skipped():
    pool = _fleet([0, 0])
    d, audit = _route(pool, {"w0": 64})  # w0 holds the whole prompt and is idle: everyone picks it
    assert d.worker_id == "w0"
    for b in audit.baselines.values():
        assert (b.n, b.same, b.sum_ms) == (1, 1, 0.0)
    d, audit = _route(_fleet([0]), {"w0": 64})
    assert audit.skipped == 1 and all(b.n == 0 for b in audit.baselines.values())
    assert audit.pays_ms() == {}


def test_negative_regret_when_a_baseline_would_have_been_faster():
    # w0 holds 60 % of the prompt but has a prefill queue of this router's own requests (fail-open
    # estimate: 20k outstanding tokens, 0.8 s: under the stall escape's 1 s floor, so it stays)
    pool = _fleet([3, 0])
    pool[0].outstanding_prefill_tokens = 20_000
    d, audit = _route(pool, {"w0": 40}, audit=RegretAudit(random.Random(1)))
    assert d.worker_id == "w0"
    got = audit.snapshot()["baselines"]["power_of_two"]["mean_ms"]
    assert got < 0  # recomputing everything on the idle w1 is predicted faster than queueing at w0
    assert got == pytest.approx(_prior_ms(1024, 0) - (5.0 + 1000.0 * (20_000 + 384) / 25_000 + 3 * 7.06), abs=1e-3)


def test_greedy_counterfactual_is_greedys_own_choice_on_random_views():
    """On pools the policy scans in full, the audit's greedy pick is what CacheAwareGreedy picks."""
    rng = random.Random(5)
    for trial in range(300):
        n = rng.randrange(2, 9)
        pool = _fleet([rng.choice([0, 0, 1, 2, 5, 40, 80]) for _ in range(n)])
        L = BS * rng.randrange(4, 80)
        blocks = {w.worker_id: rng.choice([0, L // BS // 2, L // BS // 2 + 1, L // BS, 1]) for w in pool}
        match = _Match(blocks, L // BS)
        pol = CacheAware(rng=random.Random(trial))
        req = RouteRequest(str(trial), L, 8, BS)
        pol.choose(req, pool, match, 1.0)
        scored, load = pol.last_view()
        if load is None:
            load = {t[2]: t[4].pressure(1.0, 5.0) for t in scored}
        want = CacheAwareGreedy().choose(req, pool, match, 1.0).worker_id
        got = RegretAudit()._greedy(pol, scored, load, req, match)[2]
        assert got == want, (trial, blocks, [w.inflight for w in pool])


def test_the_audit_never_changes_a_decision():
    class _RandomProv(_Prov):
        def __init__(self, rng):
            self.rng = rng

        def match(self, req, now_s):
            q = req.prompt_tokens // BS
            return _Match({f"w{i}": self.rng.choice([0, q // 3, q // 2 + 1, q]) for i in range(6)}, q)

    def decisions(audit):
        rng = random.Random(3)
        pool = _fleet([0] * 6)
        r = make_router(CacheAware(rng=random.Random(9)), _RandomProv(random.Random(8)), regret_audit=audit)
        out, live = [], []
        for i in range(300):
            d = r.route(RouteRequest(str(i), rng.randrange(100, 5000), 8, BS), pool, 1.0 + i * 0.01)
            out.append((d.worker_id, d.reason))
            live.append(d)
            while live and rng.random() < 0.5:
                done = live.pop(rng.randrange(len(live)))
                Router.release(next(w for w in pool if w.worker_id == done.worker_id), done)
        return out

    audit = RegretAudit(random.Random(4))
    assert decisions(None) == decisions(audit)
    assert audit.baselines["power_of_two"].n == 300
    assert 0 < audit.baselines["cache_aware_greedy"].same < 300  # greedy agreed sometimes, not always


def test_state_is_bounded_and_the_gauge_is_a_windowed_mean():
    a = RegretAudit(window=10)
    b = a.baselines["power_of_two"]
    for _ in range(10):
        b.add(100.0)
    assert b.mean_ms == pytest.approx(100.0)  # exact mean while n <= window
    for _ in range(200):
        b.add(-50.0)
    assert b.mean_ms == pytest.approx(-50.0, abs=0.1)  # the window forgot the old figures
    assert b.sum_ms == pytest.approx(10 * 100.0 - 200 * 50.0)  # the cumulative sum did not
    assert len(b.hist.counts) == len(REGRET_BUCKETS_MS) + 1 and sum(b.hist.counts) == 210
    assert a.pays_ms()["best"] == min(a.pays_ms()["power_of_two"], a.pays_ms()["cache_aware_greedy"])


def test_merged_pays_sums_routers_and_is_none_without_decisions():
    a1, a2 = RegretAudit(), RegretAudit()
    a1.baselines["power_of_two"].add(10.0)
    a2.baselines["power_of_two"].add(30.0)
    a1.baselines["cache_aware_greedy"].add(0.0)
    a2.baselines["cache_aware_greedy"].add(-4.0)
    m = merged_pays([a1, None, a2])
    assert m["pays_ms"] == {"power_of_two": 20.0, "cache_aware_greedy": -2.0, "best": -2.0}
    assert m["baselines"]["cache_aware_greedy"]["same_pick"] == 1
    assert merged_pays([RegretAudit(), None]) is None and merged_pays([]) is None


def test_regret_audit_flag_is_validated_naming_the_field():
    assert build(BrokerSettings, {}).regret_audit == "on"  # on by default
    assert audit_enabled("off") is False
    for bad in ("maybe", 1, "", "on" * 1000, ["on"]):  # wrong value, wrong type, oversize
        with pytest.raises(ConfigError, match="regret_audit"):
            build(BrokerSettings, {"regret_audit": bad})
        with pytest.raises(ValueError, match="regret_audit"):
            audit_enabled(bad)
    with pytest.raises(ValueError, match="window"):
        RegretAudit(window=0)


def test_broker_exports_the_histogram_and_gauge_and_status_and_top_show_it():
    from brokers.main import build_broker, metrics_registry
    from mesh import protocol as P
    from mesh.top import regret_line, render

    b = build_broker(build(BrokerSettings, {"policy": "cache_aware", "seed": 1}))
    audit = b.router.audit
    assert isinstance(audit, RegretAudit)
    audit.baselines["power_of_two"].add(12.0)
    audit.baselines["cache_aware_greedy"].add(-3.0)
    fams = {m.name: m for m in metrics_registry(b).collect()}
    h = {(s.labels["baseline"], s.labels.get("le")): s.value for s in fams["mesh_regret_ms"].samples
         if s.name == "mesh_regret_ms_bucket"}
    assert h[("power_of_two", "10.0")] == 0 and h[("power_of_two", "30.0")] == 1
    assert h[("cache_aware_greedy", "-3.0")] == 1 and h[("cache_aware_greedy", "+Inf")] == 1
    g = {s.labels["baseline"]: s.value for s in fams["mesh_cache_aware_pays_ms"].samples}
    assert g == {"power_of_two": 12.0, "cache_aware_greedy": -3.0, "best": -3.0}
    assert not fams["mesh_cache_aware_pays_observed_ms"].samples  # no outcome yet
    audit.observed_n, audit.observed_sum = 2, {"power_of_two": 30.0, "cache_aware_greedy": 8.0}
    fams = {m.name: m for m in metrics_registry(b).collect()}
    o = {s.labels["baseline"]: s.value for s in fams["mesh_cache_aware_pays_observed_ms"].samples}
    assert o == {"power_of_two": 15.0, "cache_aware_greedy": 4.0, "best": 4.0}
    core = b.core
    core.start(0.0)
    extra = b._status_extra(0.0)
    assert extra["regret"]["pays_ms"]["best"] == -3.0
    P.pack(extra)  # STATUS carries it as it is
    line = regret_line("b1", extra["regret"])
    assert line is not None and "-3 ms" in line.plain and "saves 12 ms vs power-of-two" in line.plain
    assert "+4 ms with its own TTFT measured" in line.plain  # the observed figure set above
    # a hostile or foreign telemetry snapshot never breaks mesh top
    for junk in (None, "x", [], {"pays_ms": "x"}, {"pays_ms": {"best": "x"}, "baselines": {}},
                 {"pays_ms": {"power_of_two": "x", "best": 1.0}, "baselines": {"a": "junk"}},
                 {"pays_ms": {"best": 1.0}, "baselines": []}):
        assert regret_line("b1", junk) is None, junk
    odd = regret_line("b1", {"pays_ms": {"power_of_two": 1e12, "best": -1e12},
                             "baselines": {"a": "junk", "b": {"decisions": 3}, "c": {"decisions": "x"}}})
    assert odd is not None and "3 decisions" in odd.plain
    junk_obs = regret_line("b1", {"pays_ms": {"best": 1.0, "power_of_two": 1.0}, "baselines": {"b": {"decisions": 3}},
                                  "observed": {"pays_ms": {"best": "x"}}})
    assert junk_obs is not None and "measured" not in junk_obs.plain
    from rich.console import Console

    con = Console(width=200, record=True)
    con.print(render({"b1": {"workers": [], "regret": extra["regret"]}}, {}, []))  # the telemetry snapshot's field
    assert "cache-aware pays -3 ms per request" in con.export_text()
    # off: no audit, no families
    off = build_broker(build(BrokerSettings, {"policy": "cache_aware", "regret_audit": "off"}))
    assert getattr(off.router, "audit", None) is None
    assert "mesh_regret_ms" not in {m.name for m in metrics_registry(off).collect()}
    # a load-only policy has nothing to audit
    assert getattr(build_broker(build(BrokerSettings, {"policy": "power_of_two"})).router, "audit", None) is None


def test_sim_arm_carries_the_regret_field():
    from mesh.lab.sim.runner import SimConfig, run_sim

    cfg = SimConfig(workload="zipf", rate=200.0, duration_s=None, max_requests=150, seed=1,
                    policies=["power_of_two", "cache_aware"], workers=[4], routers=[2], exchange=True)
    rep = run_sim(cfg)
    arms = {a["policy"]: a for a in rep["arms"]}
    assert arms["power_of_two"]["regret"] is None
    rg = arms["cache_aware"]["regret"]
    assert rg["baselines"]["power_of_two"]["decisions"] == 150
    assert set(rg["pays_ms"]) == {"power_of_two", "cache_aware_greedy", "best"}
    assert all(math.isfinite(v) for v in rg["pays_ms"].values())


def test_sim_regret_shadow_option_adds_the_shadow_figure_and_is_validated():
    """``mesh sim --regret-shadow RATE`` (SimConfig.regret_shadow_rate, the matrix's
    sim.regret_shadow_rate): cache_aware arms carry regret.shadow; a rate outside (0, 1] is
    refused naming the field (and below, on the command line and in the matrix TOML)."""
    from mesh.lab.sim.runner import SimConfig, run_sim

    cfg = SimConfig(workload="zipf", rate=200.0, duration_s=None, max_requests=150, seed=1,
                    policies=["cache_aware"], workers=[4], routers=[1], regret_shadow_rate=1.0)
    rg = run_sim(cfg)["arms"][0]["regret"]
    assert rg["shadow"]["requests"] == 150
    assert all(math.isfinite(v) for v in rg["shadow"]["pays_ms"].values())
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="regret_shadow_rate"):
            SimConfig(workload="zipf", regret_shadow_rate=bad).validate()


@pytest.mark.parametrize("flag, field, bad", [("--regret-shadow", "regret_shadow_rate", "2"),
                                              ("--regret-truth", "regret_truth_every", "-1")])
def test_the_lab_regret_options_are_refused_naming_the_field(tmp_path, flag, field, bad):
    """``mesh sim --regret-shadow`` / ``--regret-truth`` and the matrix's ``sim.`` keys: a bad
    value exits 2 on the command line and is a ConfigError naming ``sim.<field>`` in the TOML."""
    from mesh.cli import main
    from mesh.lab.sim.matrix import load_matrix

    assert main(["sim", "--workload", "zipf", "--max-requests", "20", f"{flag}={bad}", "--no-progress"]) == 2
    m = tmp_path / "m.toml"
    m.write_text(f'[matrix]\nseeds = [1]\n[sim]\n{field} = 1.5\n'
                 '[workloads.z]\nworkload = "zipf"\n[[cells]]\nworkload = "z"\nload = 1.0\nworkers = 4\nrouters = 1\n')
    with pytest.raises(ConfigError, match=f"sim.{field}"):
        load_matrix(str(m))


def test_matrix_compares_the_audit_with_the_measured_mean_difference():
    from mesh.lab.sim.matrix import regret_check

    subj = {"policy": "cache_aware", "ttft_mean_ms": 100.0,
            "regret": {"pays_ms": {"power_of_two": 50.0, "cache_aware_greedy": 18.0, "best": 18.0},
                       "baselines": {"power_of_two": {"decisions": 9}, "cache_aware_greedy": {"decisions": 9}}}}
    base = [{"policy": "power_of_two", "ttft_mean_ms": 170.0}, {"policy": "cache_aware_greedy", "ttft_mean_ms": 120.0}]
    rc = regret_check(subj, base)
    assert rc["against"] == "cache_aware_greedy" and rc["measured_ms"] == 20.0 and rc["predicted_ms"] == 18.0
    assert rc["within"] and rc["error_ratio"] == 0.1
    subj["regret"]["pays_ms"]["cache_aware_greedy"] = 26.0
    assert not regret_check(subj, base)["within"]
    subj["regret"]["pays_ms"].update(power_of_two=5.0, best=5.0)  # judged against the baseline measured best
    assert regret_check(subj, base)["predicted_ms"] == 26.0
    assert regret_check(subj, base, noise_ms=7.0)["within_noise"]  # 6 ms off, the cell's own noise is 7
    assert not regret_check(subj, base, noise_ms=1.0)["within_noise"]
    assert regret_check({**subj, "regret": None}, base) is None
    assert regret_check(subj, base)["sign_right"] and "shadow" not in regret_check(subj, base)
    subj["regret"]["shadow"] = {"requests": 9, "pays_ms": {"power_of_two": 60.0, "cache_aware_greedy": -21.0, "best": -21.0}}
    sh = regret_check(subj, base)["shadow"]  # the shadow figure judged against the same measured difference
    assert sh["predicted_ms"] == -21.0 and not sh["within"] and not sh["sign_right"]
    assert sh["by_baseline"] == {"power_of_two": 60.0, "cache_aware_greedy": -21.0}


def test_batch_means_give_a_paired_confidence_interval_of_the_measured_difference():
    from mesh.lab.sim.metrics import BATCHES, batch_means, paired_ci95

    # 40 requests: request i lands in batch i * 20 // 40; a failed request (missing) is left out
    bm = batch_means(((i, float(i)) for i in range(40) if i != 3), 40)
    assert len(bm) == BATCHES and bm[0] == 0.5 and bm[1] == 2.0 and bm[19] == 38.5
    assert batch_means([], 4) == [None] * BATCHES
    # an arm 10 ms slower in every batch: the difference is known exactly
    a = [100.0 + b for b in range(20)]
    m, half = paired_ci95([x + 10.0 for x in a], a)
    assert m == 10.0 and half == 0.0
    # differences alternating 0 / 20 ms: mean 10, sd 10.26, t(19) 2.093 -> half-width 4.80
    m, half = paired_ci95([x + (20.0 if i % 2 else 0.0) for i, x in enumerate(a)], a)
    assert m == 10.0 and abs(half - 2.093 * math.sqrt(400 * 20 / 4 / 19) / math.sqrt(20)) < 1e-9
    assert paired_ci95(a, a[:5]) is None and paired_ci95([1.0, None, 2.0], [1.0, 1.0, None]) is None


def test_the_regret_check_says_when_the_prediction_is_within_the_measured_differences_interval():
    from mesh.lab.sim.matrix import regret_check

    subj = {"policy": "cache_aware", "ttft_mean_ms": 100.0, "ttft_batch_means_ms": [100.0] * 20,
            "regret": {"pays_ms": {"power_of_two": 50.0, "cache_aware_greedy": 9.0, "best": 9.0},
                       "baselines": {"power_of_two": {"decisions": 9}, "cache_aware_greedy": {"decisions": 9}}}}
    # greedy measured 4 ms slower on average, batch by batch 0 or 8 ms: a half-width of 1.92 ms
    greedy = {"policy": "cache_aware_greedy", "ttft_mean_ms": 104.0,
              "ttft_batch_means_ms": [100.0 + (8.0 if i % 2 else 0.0) for i in range(20)]}
    base = [{"policy": "power_of_two", "ttft_mean_ms": 170.0}, greedy]
    rc = regret_check(subj, base)
    assert rc["measured_ms"] == 4.0 and not rc["within"]  # 9 against 4: 125 % off
    assert 1.9 < rc["measured_ci95_ms"] < 1.95 and not rc["within_ci"]  # and 5 ms beyond what the arms know
    greedy["ttft_batch_means_ms"] = [100.0 + (24.0 if i % 2 else -16.0) for i in range(20)]  # same mean, noisier
    rc = regret_check(subj, base)
    assert rc["measured_ci95_ms"] > 9.0 and rc["within_ci"] and not rc["within"]
    assert "measured_ci95_ms" not in regret_check({**subj, "ttft_batch_means_ms": None}, base)


def test_the_checks_ceiling_is_how_often_an_exact_estimator_lands_within_25_pct_of_one_noisy_measurement():
    from mesh.lab.sim.matrix import regret_check
    from mesh.lab.sim.metrics import exact_within_probability

    # within 25 % of 40 ms is 10 ms: one standard error of 10 ms -> P(|Z| <= 1) = 0.6827
    assert abs(exact_within_probability(40.0, 10.0, 0.25) - 0.682689) < 1e-6
    assert abs(exact_within_probability(-40.0, 10.0, 0.25) - 0.682689) < 1e-6  # the sign does not matter
    assert exact_within_probability(40.0, 0.0, 0.25) == 1.0  # known exactly
    assert exact_within_probability(4.0, 10.0, 0.25) < 0.08  # a 4 ms difference known to +-20 ms: hardly judgeable
    subj = {"policy": "cache_aware", "ttft_mean_ms": 100.0, "ttft_batch_means_ms": [100.0] * 20,
            "regret": {"pays_ms": {"power_of_two": 50.0, "cache_aware_greedy": 9.0, "best": 9.0},
                       "baselines": {"power_of_two": {"decisions": 9}, "cache_aware_greedy": {"decisions": 9}}}}
    quiet = {"policy": "cache_aware_greedy", "ttft_mean_ms": 140.0, "ttft_batch_means_ms": [140.0 + (1.0 if i % 2 else -1.0) for i in range(20)]}
    noisy = {**quiet, "ttft_batch_means_ms": [140.0 + (60.0 if i % 2 else -60.0) for i in range(20)]}
    p2c = {"policy": "power_of_two", "ttft_mean_ms": 170.0}
    assert regret_check(subj, [p2c, quiet])["exact_within_p"] == 1.0  # 40 ms known to +-0.5: any miss is the audit's
    assert regret_check(subj, [p2c, noisy])["exact_within_p"] < 0.6  # known to +-28: a miss may be the measurement's


def test_broker_metrics_show_the_regret_gauge_after_requests(procs):
    """One small real-process run: a cache_aware broker (audit on by default), two simulated
    workers, a few requests: /metrics has the histogram with one count per audited decision and
    the gauge per baseline."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from mesh.client import Client
    from mesh.lab.procs import wait_for_log_event
    from mesh.lab.up import wait_for_workers
    from tests.conftest import run

    b = procs.broker("b", "--metrics", "127.0.0.1:0", "--heartbeat-ms", "200", "--policy", "cache_aware")
    url = wait_for_log_event(b.log_path, "metrics_listening", 20, b.popen)["endpoint"]
    procs.workers("w", [b.backend], "--time-scale", "0.05", count=2)
    run(wait_for_workers(b.frontend, 2))
    rng = random.Random(2)
    prefix = [rng.randrange(1, 30_000) for _ in range(256)]
    n = 6

    async def body():
        async with Client(b.frontend) as c:
            for i in range(n):
                r = await c.generate(input_ids=prefix + [rng.randrange(1, 30_000) for _ in range(32)],
                                     max_new_tokens=2, deadline_ms=20_000)
                assert r.finish_reason == "length"
            return await c.status()

    st = run(body(), timeout_s=60)
    assert st.broker["regret"]["baselines"]["power_of_two"]["decisions"] == n
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - the test's own broker
        fams = {f.name: f.samples for f in text_string_to_metric_families(resp.read().decode())}
    # (signed buckets: Prometheus histograms with negative buckets carry no _sum/_count; +Inf is the count)
    counts = {s.labels["baseline"]: s.value for s in fams["mesh_regret_ms"] if s.labels.get("le") == "+Inf"}
    assert counts == {"power_of_two": n, "cache_aware_greedy": n}
    pays = {s.labels["baseline"] for s in fams["mesh_cache_aware_pays_ms"]}
    assert pays == {"power_of_two", "cache_aware_greedy", "best"}


def test_routing_bench_times_the_audit_on_the_same_decisions():
    from mesh.lab.bench.routing_bench import _decision_times, _Fleet, _TimedAudit

    fleet = _Fleet(4, 64, seed=4)
    au = _TimedAudit()
    times = _decision_times(fleet, 12, au)
    assert len(times) == 12 and len(au.times) == 12 + 50  # every decision audited (warm-up included)
    assert au.baselines["power_of_two"].n == 62


class _FixedPolicy:
    """An AuditedPolicy whose predictions are a table (the sampling tests need exact regrets)."""

    freshness_s = 5.0
    balance_abs_threshold = 1e9
    balance_rel_threshold = 1e9

    class cost:
        prefill_tokens_per_s = 25_000.0
        decode_base_ms = 7.0
        prefill_overhead_ms = 5.0

    def __init__(self, pool, pred_ms: dict[str, float]) -> None:
        self.pred = pred_ms
        # w0 busy (load 1), every other worker idle and holding nothing: both baselines leave w0
        self.view = ([(0.0, 0.0, w.worker_id, 0, w, None) for w in pool],
                     {w.worker_id: (1.0 if w.worker_id == "w0" else 0.0) for w in pool})

    def last_view(self):
        return self.view

    def predicted_ttft_ms(self, w, uncached, prompt_tokens, now_s):
        return self.pred.get(w.worker_id, 0.0)


def _audit_stream(audit: RegretAudit, rounds: int) -> None:
    """Alternate a small pool (every baseline pick 10 ms slower) and a large one (30 ms slower)."""
    from mesh.routing.view import Decision

    small, large = _fleet([1, 0]), _fleet([1] + [0] * 39)
    pols = (_FixedPolicy(small, {"w1": 10.0}), _FixedPolicy(large, {w.worker_id: 30.0 for w in large[1:]}))
    for i in range(rounds):
        for pool, pol in ((small, pols[0]), (large, pols[1])):
            d = Decision("w0", "cache_hit", detail={"predicted_ttft_ms": 0.0})
            audit.record(pol, RouteRequest(str(i), 256, 8, BS), pool, None, d, 1.0)


def test_the_sample_stands_for_every_decision_and_keeps_the_gauge_unbiased():
    """Large pools are audited one decision in every_large (the 10 us budget); each audited one
    counts for that many, so the mean over a mixed stream is the mean over all of it (20 ms), not
    the small pools' over-weighted 16.7 ms, and the counts are the decisions made."""
    audit = RegretAudit(random.Random(3), window=100_000, every_large=2, shadow_rate=None)  # exact mean
    _audit_stream(audit, 1000)
    for b in audit.baselines.values():
        assert b.n == 2000 and b.audited == 1500 and b.hist.counts[-1] == 0
        assert sum(b.hist.counts) == 2000 and b.sum_ms == pytest.approx(1000 * 10.0 + 1000 * 30.0)
        assert b.mean_ms == pytest.approx(20.0)
    assert audit.unsampled == 500 and audit.pays_ms()["best"] == pytest.approx(20.0)
    assert merged_pays([audit])["pays_ms"]["power_of_two"] == pytest.approx(20.0)
    # the windowed gauge moves as the decisions it stands for would: still about 20
    ew = RegretAudit(random.Random(3), window=50, shadow_rate=None)  # the default: one in three above 32
    _audit_stream(ew, 1000)
    assert ew.pays_ms()["cache_aware_greedy"] == pytest.approx(20.0, abs=3.0) and ew.unsampled == 667
    every = RegretAudit(random.Random(3), window=100_000, every_large=1, shadow_rate=None)
    _audit_stream(every, 10)
    assert every.unsampled == 0 and every.baselines["power_of_two"].audited == 20


def test_sampling_settings_are_validated():
    for bad in (0, -1, 1.5, "2", None):
        with pytest.raises(ValueError, match="every_large"):
            RegretAudit(every_large=bad)
    with pytest.raises(ValueError, match="shadow rate"):
        RegretAudit(shadow_rate=0.0)


def _shadow_req(rid: str, first_key: int, L: int = 1024):
    return RouteRequest(rid, L, 100_000, BS, keys=list(range(first_key, first_key + L // BS)))


def test_shadow_sees_the_queue_the_baselines_own_history_builds():
    """Two workers prefilling 1,000 tokens/s, three 1,024-token requests at once (long outputs:
    they stay in flight). cache_aware sends S twice to w0 (the second hits) and T to w1.
    power_of_two's own shadow: S to w0, S again to the idle w1 (a miss), then T -- both busy, the
    lower id -- to w0, where it waits behind S's whole prefill. The per-decision audit, judged on
    cache_aware's fleet, never sees that wait; the shadow charges it: (0 - 1 + 1024) / 3 ms."""
    from mesh.routing.regret_shadow import ShadowAudit

    pool = _fleet([0, 0])
    for w in pool:
        w.prefill_tokens_per_s = 1000.0
    sh = ShadowAudit(("power_of_two",), random.Random(1))
    for req, chosen in ((_shadow_req("r1", 1), "w0"), (_shadow_req("r2", 1), "w0"), (_shadow_req("r3", 500), "w1")):
        sh.observe(req, pool, chosen, 0.0, 25_000.0)
    assert sh.n == 3
    assert sh.pays_ms()["power_of_two"] == pytest.approx((0.0 - 1.0 + 1024.0) / 3)
    f = sh.fleets["power_of_two"]
    assert f.q_tok == [2048.0, 1024.0]  # S then T queued on w0, S's miss on w1
    assert sh.fleets["cache_aware"].q_tok == [1025.0, 1024.0]  # S, S's last token; T


def test_shadow_samples_sessions_and_bounds_its_state():
    from mesh.routing.regret_shadow import ShadowAudit

    pool = _fleet([0, 0, 0])
    sh = ShadowAudit(("power_of_two", "cache_aware_greedy"), rate=0.25, cache_tokens=1000)
    seen = 0
    for i in range(400):
        sh.observe(_shadow_req(str(i), 10_000 * i), pool, "w0", i * 0.01, 25_000.0)
        seen = sh.n
    assert 50 < seen < 150  # about a quarter of the sessions
    # a session is in or out as a whole: its turns share the session key
    before = sh.n
    for t in range(5):
        sh.observe(_shadow_req(f"s{t}", 10_000 * 7), pool, "w0", 5.0 + t, 25_000.0)
    assert sh.n - before in (0, 5)
    assert 0 < len(sh.holders) <= sh.cap_keys


def test_hostile_inputs_never_raise():
    """NaN and zero rates, zero capacity, NaN clocks, junk uncached counts: the audit and its
    shadow skip or fall back, never raise, and the gauges stay finite."""
    from mesh.load import LoadStat
    from mesh.routing.regret_shadow import ShadowAudit

    pool = _fleet([1, 0, 2])
    pool[0].prefill_tokens_per_s = float("nan")
    pool[1].prefill_tokens_per_s = 0.0
    pool[2].max_total_num_tokens = 0
    pool[2].update_load([LoadStat(1, 0, 0, 0, 0, 0, 0, 0, 0, 0)], 0.5)  # zero capacity
    audit = RegretAudit(random.Random(1), shadow_rate=1.0)
    r = Router(CacheAware(rng=random.Random(0)), _Prov(_Match({"w0": 32, "w2": 64}, 64)), audit)
    for i in range(20):
        d = r.route(RouteRequest(str(i), 1024, 8, BS, keys=list(range(64))), pool, 1.0 + i * 0.01)
        assert d.worker_id is not None
    snap = audit.snapshot()
    assert all(math.isfinite(v) for v in snap["pays_ms"].values())
    assert all(math.isfinite(v) for v in snap["shadow"]["pays_ms"].values())
    sh = ShadowAudit(("power_of_two",), cache_tokens=0)
    for default in (float("nan"), 0.0, -1.0, float("inf")):
        sh.observe(_shadow_req("x", 1), pool, "w0", 1.0, default)
    sh.observe(_shadow_req("x", 1), pool, "w0", float("nan"), 25_000.0)
    sh.observe(_shadow_req("x", 1), pool, "nobody", 1.0, 25_000.0)
    sh.observe(RouteRequest("k", 1024, 8, BS), pool, "w0", 1.0, 25_000.0)  # no keys
    sh.observe(_shadow_req("u", 1), pool, "w0", 2.0, 25_000.0, uncached=float("nan"), step_ms=float("nan"))
    assert sh.n == 1 and all(math.isfinite(v) for v in sh.pays_ms().values())
    for b in (float("nan"), float("inf")):  # a NaN prediction is skipped, not averaged
        bad = _FixedPolicy(pool, {"w1": b, "w2": b})
        from mesh.routing.view import Decision

        a = RegretAudit(shadow_rate=None)
        a.record(bad, RouteRequest("n", 256, 8, BS), pool, None, Decision("w0", "x", detail={"predicted_ttft_ms": 0.0}), 1.0)
        a.record(bad, RouteRequest("n", 256, 8, BS), pool, None, Decision("w0", "x", detail={"predicted_ttft_ms": b}), 1.0)
        assert a.skipped == 2 and a.pays_ms() == {}


def test_observed_figure_charges_the_baselines_prediction_against_the_measured_ttft():
    """cache_aware's own prediction of its pick is its lowest estimate (it chose by it), so it
    runs low; the observed figure replaces it with the TTFT the request measured."""
    pool = _fleet([1, 0])
    audit = RegretAudit(random.Random(1))
    r = Router(CacheAware(rng=random.Random(0)), _Prov(_Match({"w0": 32}, 64)), audit)
    d = r.route(RouteRequest("r1", 1024, 8, BS), pool, 1.0)
    assert d.worker_id == "w0" and audit.observed_pays_ms() == {}
    r.observe(d, 40.0)  # both baselines would have sent it to the idle w1: predicted 45.96 ms
    assert audit.observed_pays_ms()["power_of_two"] == pytest.approx(_prior_ms(1024, 0) - 40.0, abs=1e-3)
    same = r.route(RouteRequest("r2", 1024, 8, BS), _fleet([0, 0]), 1.0)  # a pick everyone makes: 0
    assert same.worker_id == "w0"
    r2 = Router(CacheAware(rng=random.Random(0)), _Prov(_Match({"w0": 64}, 64)), audit)
    same = r2.route(RouteRequest("r3", 1024, 8, BS), _fleet([0, 0]), 1.0)
    r2.observe(same, 500.0)
    for junk in (float("nan"), float("inf")):  # a junk outcome is ignored
        r.observe(d, junk)
    r.observe(_decision_without_audit(), 10.0)
    assert audit.observed_n == 2
    assert audit.observed_pays_ms()["cache_aware_greedy"] == pytest.approx((_prior_ms(1024, 0) - 40.0) / 2, abs=1e-3)
    m = merged_pays([audit, None])
    assert m["observed"] == {"decisions": 2, "pays_ms": audit.observed_pays_ms()}
    assert audit.snapshot()["observed"]["decisions"] == 2


def test_pooled_draws_average_their_differences_and_narrow_the_interval():
    """``pooled_pays``: independent draws of the same stream average to one figure per baseline;
    their batch-mean standard errors combine as independent (sqrt(sum se^2) / n); the best
    baseline is the one with the lowest pooled mean, even when one draw alone ranks them otherwise."""
    from mesh.lab.sim.twin import pooled_pays, twin_pays

    def draw(ca, gr, p2c, wobble):
        return [{"policy": "cache_aware", "ttft_mean_ms": ca, "ttft_batch_means_ms": [ca] * 20},
                {"policy": "cache_aware_greedy", "ttft_mean_ms": gr, "ttft_batch_means_ms": [gr] * 20},
                {"policy": "power_of_two", "ttft_mean_ms": p2c,
                 "ttft_batch_means_ms": [p2c + (wobble if i % 2 else -wobble) for i in range(20)]}]

    d0, d1, d2 = draw(100.0, 130.0, 125.0, 10.0), draw(100.0, 110.0, 135.0, 10.0), draw(106.0, 121.0, 136.0, 10.0)
    one = twin_pays(d0)
    assert one["against"] == "power_of_two" and one["draws"] == 1 and one["per_draw_ms"] == [one["pays_ms"]]
    got = pooled_pays([d0, d1, d2])
    assert got["draws"] == 3 and got["against"] == "cache_aware_greedy"  # 120.33 pooled against 132
    assert got["pays_ms"] == {"cache_aware_greedy": pytest.approx(18.333, abs=1e-3), "power_of_two": pytest.approx(30.0)}
    assert got["best"] == got["pays_ms"]["cache_aware_greedy"]
    assert got["per_draw_ms"][1] == {"cache_aware_greedy": 10.0, "power_of_two": 35.0}
    assert got["se_ms"]["power_of_two"] == pytest.approx(one["se_ms"]["power_of_two"] / 3 ** 0.5, rel=1e-3)
    assert got["ci95_ms"]["power_of_two"] < one["ci95_ms"]["power_of_two"] / 3 ** 0.5  # and more batches: a smaller t
    assert got["ci95_ms"]["cache_aware_greedy"] == 0.0
    no_batches = [{**a, "ttft_batch_means_ms": None} for a in d1]
    assert pooled_pays([d0, no_batches])["ci95_ms"]["power_of_two"] is None  # a draw without batch means: no interval
    assert pooled_pays([d0, d1[1:]]) is None and pooled_pays([]) is None  # the subject missing from a draw
    # the verdict: beyond the interval cache_aware saves or costs; inside it the two tie
    assert got["verdict"] == "saves" and got["best_of_ttft"] == pytest.approx(18.333 / (306 / 3), abs=1e-4)
    close = pooled_pays([draw(100.0, 125.0, 101.0, 10.0)])  # 1 ms against power_of_two, +-4.7
    assert close["against"] == "power_of_two" and close["verdict"] == "tie"
    assert pooled_pays([draw(100.0, 125.0, 90.0, 10.0)])["verdict"] == "costs"


def test_a_verdict_needs_the_difference_beyond_its_interval():
    from mesh.lab.sim.twin import verdict

    assert verdict(5.0, 2.0) == "saves" and verdict(-5.0, 2.0) == "costs"
    assert verdict(1.9, 2.0) == verdict(-2.0, 2.0) == verdict(0.0, 0.0) == "tie"
    assert verdict(0.1, None) == "saves" and verdict(-0.1, None) == "costs" and verdict(0.0, None) == "tie"


def _decision_without_audit():
    from mesh.routing.view import Decision

    return Decision("w0", "cache_hit", detail={"predicted_ttft_ms": 1.0})


def test_the_twins_figure_is_the_paired_difference_of_its_arms():
    from mesh.lab.sim.twin import fidelity, twin_pays

    ca = {"policy": "cache_aware", "ttft_mean_ms": 100.0, "ttft_batch_means_ms": [100.0] * 20}
    gr = {"policy": "cache_aware_greedy", "ttft_mean_ms": 110.0, "ttft_batch_means_ms": [110.0] * 20}
    p2c = {"policy": "power_of_two", "ttft_mean_ms": 160.0,
           "ttft_batch_means_ms": [160.0 + (10.0 if i % 2 else -10.0) for i in range(20)]}
    tp = twin_pays([ca, gr, p2c, {**p2c, "policy": "cache_aware@b"}])
    assert tp["against"] == "cache_aware_greedy" and tp["best"] == 10.0
    assert tp["pays_ms"] == {"cache_aware_greedy": 10.0, "power_of_two": 60.0}  # a noise arm is no baseline
    assert tp["ci95_ms"]["cache_aware_greedy"] == 0.0 and 4.7 < tp["ci95_ms"]["power_of_two"] < 4.9
    assert twin_pays([gr, p2c]) is None and twin_pays([ca]) is None
    rec = [{"outcome": "ok", "ttft_ms": 90.0}, {"outcome": "ok", "ttft_ms": 110.0}, {"outcome": "timeout", "ttft_ms": None}]
    f = fidelity(ca, rec)
    assert f == {"observed_ttft_mean_ms": 100.0, "twin_ttft_mean_ms": 100.0, "requests": 2, "ratio": 1.0, "matches": True}
    assert not fidelity({**ca, "ttft_mean_ms": 200.0}, rec)["matches"]  # 2x the observed: the engine model is off
    assert not fidelity({**ca, "ttft_mean_ms": 85.0}, rec)["matches"]  # 15 % and 15 ms low: off too
    assert fidelity({**ca, "ttft_mean_ms": 108.0}, rec)["matches"]  # within 10 %
    fast = [{"outcome": "ok", "ttft_ms": 26.0}]  # a few ms of hops the twin does not model, at a short TTFT
    assert fidelity({**ca, "ttft_mean_ms": 22.0}, fast)["matches"] and not fidelity({**ca, "ttft_mean_ms": 20.0}, fast)["matches"]
    assert fidelity(ca, []) is None and fidelity(ca, None) is None
    forged = rec + [{"outcome": "ok", "ttft_ms": v} for v in (float("nan"), float("inf"), -5.0, True, "9", None, 1e400)]
    assert fidelity(ca, forged) == f  # a recording's broken or forged TTFTs are left out, not averaged
