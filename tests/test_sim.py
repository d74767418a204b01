"""The simulator: metric definitions on hand-computed cases, workloads, event plumbing, determinism."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from mesh.engine_model import EngineConfig, output_token_id
from mesh.errors import ConfigError
from mesh.lab.sim import SimConfig, Workload, load_mooncake, make_workload, oracle_cached_tokens, run_sim
from mesh.lab.sim.cli import add_sim_parser, config_from_args, dumps_report
from mesh.lab.sim.metrics import cv, percentile, ratio
from mesh.lab.sim.runner import Arm, ArmSpec, arm_specs
from mesh.lab.sim.workloads import SimRequest

SMALL_ENGINE = EngineConfig(max_total_num_tokens=20_000, page_size=16)


def _seg(key: int, n: int) -> tuple[int, int, int, int]:
    return (0, key, n, n)


def _wl(reqs: list[SimRequest], vocab: int = 32_000) -> Workload:
    return Workload("hand", reqs, {}, vocab)


# --------------------------------------------------------------------------- metrics


def test_percentile_linear_interpolation():
    assert percentile([], 50) == 0.0
    assert percentile([5.0], 99) == 5.0
    x = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(x, 0) == 1.0
    assert percentile(x, 100) == 4.0
    assert percentile(x, 50) == 2.5  # h = 1.5
    assert percentile(x, 95) == pytest.approx(3.85)  # h = 2.85 -> 3 + 0.85
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)  # h = 98.01
    with pytest.raises(ValueError):
        percentile(x, 101)


def test_cv_population():
    assert cv([]) == 0.0
    assert cv([0, 0]) == 0.0
    assert cv([3, 3, 3]) == 0.0
    assert cv([1, 3]) == pytest.approx(0.5)  # mean 2, population std 1
    assert cv([0, 2]) == pytest.approx(1.0)
    assert cv([2, 1]) == pytest.approx(1 / 3)
    assert cv([0, 0, 0, 4]) == pytest.approx(math.sqrt(3))  # mean 1, var (1+1+1+9)/4 = 3
    assert ratio(1, 0) == 0.0 and ratio(1, 4) == 0.25


def test_oracle_hand_computed():
    a, b, c = 11, 22, 33
    reqs = [
        SimRequest(0, 0.0, 12, 0, (_seg(a, 8), _seg(b, 4))),  # nothing seen: 0
        SimRequest(1, 1.0, 12, 0, (_seg(a, 8), _seg(c, 4))),  # shares A's 2 pages: 8
        SimRequest(2, 2.0, 12, 0, (_seg(a, 8), _seg(b, 4))),  # all 3 pages seen, capped at (12-1)//4 = 2: 8
        SimRequest(3, 3.0, 5, 0, (_seg(c, 5),)),               # C at position 0 is new content: 0
    ]
    assert oracle_cached_tokens(_wl(reqs), 4) == (16, 41)


def test_oracle_counts_earlier_outputs():
    p, q = 5, 6
    reqs = [
        SimRequest(0, 0.0, 8, 4, (_seg(p, 8),)),
        # history = prompt 0 + the 4 tokens the engine emits for rid 0, then a new question
        SimRequest(1, 1.0, 16, 0, (_seg(p, 8), (1, 0, 4, 4), _seg(q, 4))),
    ]
    wl = _wl(reqs)
    toks = wl.prompt(reqs[1])
    assert list(toks[8:12]) == [output_token_id(0, i, 32_000) for i in range(4)]
    # r1: 16 tokens, cap (16-1)//4 = 3 pages, all three seen (2 prompt pages + the prompt+output page)
    assert oracle_cached_tokens(wl, 4) == (12, 24)


# --------------------------------------------------------------------------- workloads


def test_mooncake_loader(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 3]},
        {"timestamp": 3000, "input_length": 100, "output_length": 1, "hash_ids": [1]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    wl = load_mooncake(trace, time_scale=0.5)
    assert [r.arrival_s for r in wl.requests] == [0.0, 0.5, 1.5]  # sorted, scaled
    assert [r.prompt_len for r in wl.requests] == [1024, 700, 100]
    p0, p1, p2 = (wl.prompt(r) for r in wl.requests)
    assert len(p0) == 1024 and len(p1) == 700 and len(p2) == 100
    assert p0[:512] == p1[:512] and p0[512:] != p1[512:700]  # same hash id, same block
    assert p2 == p0[:100]  # truncated block = prefix of the full block
    assert max(p0) < 256 and min(p0) >= 0
    assert wl.prompt(wl.requests[0]) == p0  # rebuilt identically
    assert len(load_mooncake(trace, max_requests=2).requests) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ConfigError):
        load_mooncake(bad)


def test_generators_deterministic_and_shaped():
    for name in ("shared_prefix", "multi_turn", "zipf", "low_reuse"):
        a = make_workload(name, seed=3, rate=50, duration_s=2.0)
        b = make_workload(name, seed=3, rate=50, duration_s=2.0)
        assert [(r.arrival_s, r.segments) for r in a.requests] == [(r.arrival_s, r.segments) for r in b.requests]
        assert a.requests and all(len(a.prompt(r)) == r.prompt_len for r in a.requests[:5])
        c = make_workload(name, seed=4, rate=50, duration_s=2.0)
        assert [r.segments for r in a.requests] != [r.segments for r in c.requests]
    sp = make_workload("shared_prefix", seed=0, max_requests=10, duration_s=None, groups=2, prompts_per_group=3,
                       system_tokens=64, question_tokens=32, output_tokens=8)
    assert len(sp.requests) == 10 and all(r.prompt_len == 96 and r.output_len == 8 for r in sp.requests)
    mt = make_workload("multi_turn", seed=0, max_requests=6, duration_s=None, users=2, rounds=3, system_tokens=16,
                       context_tokens=16, question_tokens=8, output_tokens=4)
    lens = [r.prompt_len for r in mt.requests]
    assert lens == [40, 40, 52, 52, 64, 64]  # +question +answer per round
    r0, r2 = mt.requests[0], mt.requests[2]  # user 0, rounds 0 and 1
    assert list(mt.prompt(r2)[:40]) == list(mt.prompt(r0))
    assert list(mt.prompt(r2)[40:44]) == mt.output_tokens(r0)
    with pytest.raises(ConfigError):
        make_workload("zipf", nonsense=1)
    with pytest.raises(ConfigError):
        make_workload("nope")


# --------------------------------------------------------------------------- the simulator


def _cfg(**kw) -> SimConfig:
    base = dict(workload="shared_prefix", engine=SMALL_ENGINE, workers=[2], routers=[1], policies=["round_robin"],
                providers=["radix_tree"], seed=1)
    base.update(kw)
    return SimConfig(**base)


def test_hit_rate_and_ttft_hand_computed():
    # One worker, the same 64-token prompt twice, far apart: the second finds 3 pages cached
    # (capped at (64-1)//16), so hit = 48 / 128.
    reqs = [SimRequest(0, 0.0, 64, 2, (_seg(9, 64),)), SimRequest(1, 10.0, 64, 2, (_seg(9, 64),))]
    cfg = _cfg(workers=[1], net_ms=0.5)
    rep = run_sim(cfg, workload=_wl(reqs))
    (arm,) = rep["arms"]
    assert arm["hit_rate"] == pytest.approx(48 / 128)
    assert arm["any_hit_rate"] == 0.5
    assert rep["oracle_hit_rate"] == pytest.approx(48 / 128)
    assert arm["worker_cv"] == 0.0 and arm["completed"] == 2
    # TTFT of request 0: net + prefill step (5 ms + 64/25000 s + attention) + net
    ttft0 = 0.5 + 5.0 + 64 / 25.0 + 64 * 64 * 4e-9 + 0.5
    ttft1 = 0.5 + 5.0 + 16 / 25.0 + 16 * 64 * 4e-9 + 0.5
    assert arm["ttft_p50_ms"] == pytest.approx((ttft0 + ttft1) / 2, abs=1e-3)
    assert arm["goodput"] == 1.0
    assert arm["decisions"] == {"round_robin": 2}


def test_worker_cv_from_dispatch_counts():
    reqs = [SimRequest(i, i * 5.0, 32, 1, (_seg(100 + i, 32),)) for i in range(3)]
    rep = run_sim(_cfg(workers=[2]), workload=_wl(reqs))
    (arm,) = rep["arms"]
    assert arm["served_per_worker"] == [2, 1]
    assert arm["worker_cv"] == pytest.approx(1 / 3, abs=1e-6)


def test_arms_cross_product_and_dedupe():
    cfg = _cfg(policies=["power_of_two", "cache_aware"], providers=["radix_tree", "approx"], routers=[1, 2], workers=[2, 3])
    specs = arm_specs(cfg)
    assert len(specs) == 2 * 2 * (1 + 2)
    assert ArmSpec("power_of_two", "none", 2, 3) in specs
    cfg.dedupe_load_only = False
    assert len(arm_specs(cfg)) == 2 * 2 * 4


def test_determinism_same_seed_same_json():
    cfg = _cfg(policies=["power_of_two", "cache_aware"], providers=["radix_tree", "indexer"], routers=[2],
               rate=40.0, duration_s=1.5, router_pick="random",
               workload_params={"groups": 4, "prompts_per_group": 2, "system_tokens": 256, "question_tokens": 64,
                                "output_tokens": 16})
    a = dumps_report(run_sim(cfg))
    b = dumps_report(run_sim(cfg))
    assert a == b
    cfg.seed = 2
    assert dumps_report(run_sim(cfg)) != a


def _small_stream(**kw):
    params = {"groups": 3, "prompts_per_group": 2, "system_tokens": 512, "question_tokens": 64, "output_tokens": 24}
    params.update(kw)
    return params


def test_kv_events_reach_providers_and_match_engines():
    # Small KV so evictions happen too; every router's radix tree must end equal to the engines.
    eng = EngineConfig(max_total_num_tokens=2_000, page_size=16)
    cfg = _cfg(engine=eng, workers=[3], routers=[2], policies=["cache_aware"], rate=30.0, duration_s=2.0,
               workload_params=_small_stream(groups=10))
    from mesh.lab.sim.runner import build_workload

    wl = build_workload(cfg)
    arm = Arm(cfg, ArmSpec("cache_aware", "radix_tree", 2, 3), wl)
    res = arm.run()
    assert res["kv_event_batches"] > 0 and res["kv_resyncs"] == 0
    for sr in arm.routers:
        idx = sr.router.provider.index
        assert idx.stats()["blocks_removed"] > 0  # evictions were mirrored too
        for w in arm.workers:
            assert idx.worker_entries(w.wid) == w.engine.num_cached_pages
            for key in list(w.engine._cache)[:50]:
                assert idx.holds(w.wid, key)
        for st in sr.states:  # heartbeats arrived and in-flight counts returned to zero
            assert st.load and st.inflight == 0 and st.outstanding_prefill_tokens == 0
    assert sum(st.inflight for sr in arm.routers for st in sr.states) == 0


def test_indexer_is_shared_and_approx_gets_no_events():
    cfg = _cfg(workers=[2], routers=[3], policies=["cache_aware"], rate=30.0, duration_s=1.0,
               workload_params=_small_stream())
    from mesh.lab.sim.runner import build_workload

    wl = build_workload(cfg)
    ix = Arm(cfg, ArmSpec("cache_aware", "indexer", 3, 2), wl)
    assert len({id(sr.router.provider.index) for sr in ix.routers}) == 1
    r_ix = ix.run()
    assert r_ix["kv_event_batches"] == sum(w.kv_seq for w in ix.workers)  # applied once per batch
    ap = Arm(cfg, ArmSpec("cache_aware", "approx", 3, 2), wl)
    assert ap.run()["kv_event_batches"] == 0


def test_cache_aware_beats_round_robin_on_shared_prefix():
    cfg = _cfg(workers=[4], routers=[1], policies=["round_robin", "cache_aware"], providers=["indexer"], rate=20.0,
               duration_s=3.0, workload_params=_small_stream(groups=6, system_tokens=1024))
    rep = run_sim(cfg)
    rr, ca = rep["arms"]
    assert ca["hit_rate"] > rr["hit_rate"]
    assert ca["hit_rate"] <= rep["oracle_hit_rate"] + 1e-9


def test_multi_turn_reuses_engine_outputs():
    # One worker, spaced rounds: every history (including earlier answers) is cached, so the hit
    # rate reaches the oracle, which counts earlier outputs.
    cfg = _cfg(workload="multi_turn", workers=[1], rate=5.0, max_requests=6, duration_s=None,
               workload_params={"users": 2, "rounds": 3, "system_tokens": 64, "context_tokens": 64,
                                "question_tokens": 32, "output_tokens": 32})
    rep = run_sim(cfg)
    (arm,) = rep["arms"]
    assert arm["hit_rate"] == pytest.approx(rep["oracle_hit_rate"])
    assert arm["hit_rate"] > 0.5


def test_oversized_prompts_dropped(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 30_000, "output_length": 2, "hash_ids": list(range(60))},
    ]) + "\n")
    rep = run_sim(SimConfig(trace=str(trace), engine=SMALL_ENGINE, workers=[1]))
    assert rep["workload"]["dropped"] == 1 and rep["arms"][0]["completed"] == 1


def test_cli_writes_json_and_plot(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="mesh")
    sub = parser.add_subparsers(dest="cmd")
    add_sim_parser(sub)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = parser.parse_args([
        "sim", "--workload", "zipf", "--rate", "20", "--duration-s", "1", "--workers", "2,3", "--routers", "1",
        "--policy", "power_of_two,cache_aware", "--provider", "approx", "--groups", "4", "--system-tokens", "128",
        "--question-tokens", "32", "--output-tokens", "8", "--max-total-num-tokens", "20000", "--json", str(out),
        "--plot", str(png), "--no-progress",
    ])
    cfg = config_from_args(args)
    assert cfg.engine.max_total_num_tokens == 20_000 and cfg.workload_params["groups"] == 4
    assert args.func(args) == 0
    rep = json.loads(out.read_text())
    assert len(rep["arms"]) == 4
    keys = {"policy", "provider", "routers", "workers", "requests", "hit_rate", "oracle_hit_rate", "worker_cv",
            "busy_cv", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "e2e_p95_ms", "throughput_rps", "goodput",
            "decisions", "degraded_decisions", "utilisation"}
    assert keys <= set(rep["arms"][0])
    assert png.stat().st_size > 1000
    assert "power_of_two" in capsys.readouterr().out
    bad = parser.parse_args(["sim", "--trace", "x.jsonl", "--users", "3"])
    with pytest.raises(ConfigError):
        config_from_args(bad)


def test_policy_options_reach_one_policy_and_bad_ones_are_named():
    """``--policy-option POLICY.KEY=VALUE`` sets a constructor option of that policy only (greedy,
    which has no such option, runs beside it), and a bad one is refused by name before any run."""
    parser = argparse.ArgumentParser(prog="mesh")
    add_sim_parser(parser.add_subparsers(dest="cmd"))
    base = ["sim", "--workload", "low_reuse", "--rate", "150", "--duration-s", "2", "--workers", "4",
            "--output-tokens", "64", "--policy", "cache_aware_greedy,cache_aware"]

    def served(extra):
        arms = {a["policy"]: a for a in run_sim(config_from_args(parser.parse_args(base + extra)))["arms"]}
        return arms["cache_aware"]["served_per_worker"], arms["cache_aware_greedy"]["served_per_worker"]

    ours, greedy = served([])
    assert ours != greedy  # every request is a miss: the queue-first miss rule places them otherwise
    as_greedy = ["--policy-option", "cache_aware.miss_queue_ms=0", "--policy-option", "cache_aware.imbalance_scope=fleet"]
    cfg = config_from_args(parser.parse_args(base + as_greedy))
    assert cfg.policy_params == {"cache_aware": {"miss_queue_ms": 0, "imbalance_scope": "fleet"}}
    # with greedy's miss rule and SGLang's fleet-wide bound, cache_aware makes greedy's choices
    ours, greedy = served(as_greedy)
    assert ours == greedy
    for opt, msg in [("cache_aware.imbalance_scope=worker", "imbalance_scope"),
                     ("cache_aware.no_such_knob=1", "no_such_knob"),
                     ("greedy_typo.cache_threshold=0.5", "unknown policy 'greedy_typo'"),
                     ("cache_aware=1", "POLICY.KEY=VALUE")]:
        with pytest.raises(ConfigError, match=msg):
            config_from_args(parser.parse_args(base + ["--policy-option", opt]))


def test_determinism_across_processes(tmp_path):
    # Different hash seeds (string hashing, set order) must not change a single byte.
    import os
    import subprocess
    import sys

    outs = []
    for hs in ("1", "2"):
        out = tmp_path / f"r{hs}.json"
        subprocess.run(
            [sys.executable, "-m", "mesh.lab.sim.cli", "--workload", "shared_prefix", "--rate", "40", "--duration-s", "1",
             "--groups", "5", "--system-tokens", "256", "--question-tokens", "32", "--output-tokens", "8",
             "--workers", "3", "--routers", "2", "--policy", "cache_aware,cache_aware_greedy",
             "--provider", "radix_tree,approx", "--router-pick", "random", "--max-total-num-tokens", "2000",
             "--json", str(out), "--no-progress"],
            check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": hs},
        )
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


def test_sim_buckets_overloaded_run_falls_back_and_rejects_nothing():
    from pathlib import Path

    from mesh.lab.sim.runner import SimConfig, run_sim

    buckets = str(Path(__file__).resolve().parents[1] / "configs" / "buckets-example.toml")
    from mesh.engine_model import EngineConfig

    # small GPUs (4 running requests, 40k KV tokens): every bucket is soon full
    cfg = SimConfig(workload="shared_prefix", workload_params={"groups": 4, "prompts_per_group": 5}, rate=40.0, duration_s=3.0,
                    policies=["cache_aware"], providers=["radix_tree"], workers=[4], buckets=buckets, seed=3,
                    engine=EngineConfig(max_total_num_tokens=40_000, max_running_requests=4))
    arm = run_sim(cfg)["arms"][0]
    assert arm["rejected"] == 0 and arm["completed"] == arm["requests"]
    assert arm["decisions"].get("capacity_fallback_power_of_two", 0) > 0


def test_sim_pd_disaggregation_completes_every_request():
    from mesh.lab.sim.runner import SimConfig, run_sim

    cfg = SimConfig(workload="shared_prefix", workload_params={"groups": 4, "prompts_per_group": 5}, rate=5.0, duration_s=3.0,
                    policies=["cache_aware"], providers=["radix_tree"], pd=(2, 2), seed=4)
    arm = run_sim(cfg)["arms"][0]
    assert arm["rejected"] == 0 and arm["completed"] == arm["requests"] > 0
    assert sum(v for k, v in arm["decisions"].items() if k.startswith("decode_")) == arm["requests"]
    assert arm["hit_rate"] > 0  # the prefill leg reuses the shared system prompts


def test_host_tier_flag_turns_on_hicache_and_raises_the_hit_rate():
    args = argparse.ArgumentParser()
    add_sim_parser(args.add_subparsers())
    ns = args.parse_args(["sim", "--workload", "shared_prefix", "--host-kv-tokens", "20000"])
    assert config_from_args(ns).engine.host_kv_tokens == 20_000
    small = EngineConfig(max_total_num_tokens=3_000, page_size=16)
    tiered = EngineConfig(max_total_num_tokens=3_000, page_size=16, host_kv_tokens=20_000)
    runs = [run_sim(_cfg(workers=[2], policies=["round_robin"], engine=eng, rate=20.0, duration_s=3.0,
                         workload_params=_small_stream(groups=8, system_tokens=1024)))["arms"][0] for eng in (small, tiered)]
    assert runs[1]["hit_rate"] > runs[0]["hit_rate"]


def test_sim_session_affinity_keeps_conversations_on_their_worker_across_routers():
    """Two routers picked at random per turn, a load-only policy: with the sessions shared over the
    exchange, every later turn of a conversation finds its worker (hits) and the hit rate rises."""
    reps = {}
    for mode in ("off", "soft"):
        cfg = SimConfig(workload="conversation", workers=[4], routers=[2], router_pick="random", policies=["power_of_two"],
                        providers=["none"], seed=1, rate=4.0, max_requests=200, duration_s=None, exchange=True,
                        session_affinity=mode)
        reps[mode] = run_sim(cfg)["arms"][0]
    off, soft = reps["off"], reps["soft"]
    assert off["sessions"] == {}
    s = soft["sessions"]
    assert s["new"] + s["hit"] == 200 and s["hit"] > 50 and s["remote_applied"] > 0
    assert not any(k.startswith("repin") for k in s)
    assert soft["hit_rate"] > 1.5 * off["hit_rate"]
    with pytest.raises(ConfigError, match="session_affinity"):
        _cfg(session_affinity="sticky").validate()
