"""``mesh bench replay``: one tiny real replay (2 engines, 1 broker, one policy) with every reported field,
the CPU-bound verdict, the comparison with ``mesh sim``, the slowed engine, argument validation and the
result page; the whole command (3 policies, 2 brokers with the indexer and the exchange) under ``bench``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mesh.engine_model import EngineConfig, EngineModel
from mesh.errors import ConfigError
from mesh.lab.bench.replay_bench import build_replay_workload, run_replay_bench, sim_config
from mesh.lab.bench.replay_cli import add_bench_replay_parser, config_from_args
from mesh.lab.bench.replay_core import (ReplayConfig, RequestResult, client_figures, compare, cpu_verdict, ranking,
                                        slowed_engine)
from mesh.lab.report import detect_kind, main as report_main


def _trace(path: Path, n: int = 8) -> Path:
    """A small Mooncake-format trace: every request shares its first two 512-token blocks, half of
    them a third one; 2-block prompts plus a private block; 4 output tokens; 150 ms apart."""
    rows = []
    for i in range(n):
        ids = [0, 1] + ([2] if i % 2 else []) + [100 + i]
        rows.append({"timestamp": i * 150, "input_length": 512 * (len(ids) - 1) + 200, "output_length": 4, "hash_ids": ids})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mesh bench")
    add_bench_replay_parser(ap.add_subparsers(dest="what"))
    return ap


# ----------------------------------------------------------------------------- the real run (default suite)


@pytest.mark.e2e  # real processes, started by the bench itself
def test_a_tiny_replay_completes_and_reports_every_field(tmp_path):
    cfg = ReplayConfig(trace=str(_trace(tmp_path / "t.jsonl")), max_requests=8, workers=2, routers=1, provider="radix_tree",
                       policies=["cache_aware"])
    seen = []
    res = run_replay_bench(cfg, log_dir=str(tmp_path / "logs"), say=lambda m: None,
                           progress=lambda phase, done, total: seen.append(phase))
    assert res["bench"] == "replay" and res["ok"], res["real"]
    real, sim = res["real"]["cache_aware"], res["sim"]["cache_aware"]
    assert real["requests"] == real["completed"] == 8 and real["errors"] == {}
    assert sim["requests"] == sim["completed"] == 8
    for side in (real, sim):
        assert 0 < side["ttft_p50_ms"] <= side["ttft_p95_ms"], side
        assert 0 <= side["goodput"] <= 1
        assert side["hit_rate"] > 0.3, side  # the shared blocks are cached on both sides
    assert sum(real["served_per_worker"].values()) == 8 and set(real["served_per_worker"]) == {"w00", "w01"}
    assert real["lag_p95_ms"] is not None and real["wall_s"] > 0
    assert set(real["cpu_s"]) == set(real["cpu_wait_share"]) == {"brokers", "engines", "adapters", "indexer", "client"}
    assert real["cpu_wait_share"]["indexer"] is None  # no indexer with radix_tree
    assert 0 <= real["cpu_wait_worst"][2] <= 1 and real["cpu_wait_worst"][0] in real["cpu_s"]
    assert real["cpu_s"]["engines"] > 0 and real["cpu_s"]["indexer"] == 0
    assert isinstance(real["cpu_bound"], bool) and isinstance(real["cpu_bound_reasons"], list)
    assert res["cpu_bound"] == bool(res["cpu_bound_reasons"])
    cmp = res["comparison"]
    assert cmp["ranking_real"] == cmp["ranking_sim"] == ["cache_aware"] and cmp["ranking_agrees"]
    assert cmp["p95_real_over_sim"]["cache_aware"] > 0
    assert "sim 1/1" in seen and "cache_aware" in seen  # the progress bar saw both phases
    # the simulator once more on an engine fitted to the real run's mean TTFT and TPOT
    fit, fitted = res["engine_fit"], res["sim_fitted"]["cache_aware"]
    assert fit["evaluations"] >= 1 and fit["prefill_speed"] > 0 and fit["decode_speed"] > 0 and "engine" not in fit
    assert fitted["completed"] == 8
    if fit["converged"]:
        assert fitted["ttft_mean_ms"] == pytest.approx(real["ttft_mean_ms"], rel=0.021)
    json.dumps(res)  # JSON-ready


@pytest.mark.e2e
def test_an_exchange_port_taken_before_its_broker_binds_it_restarts_the_fleet(tmp_path, monkeypatch):
    """Two brokers that are each other's --peer need their exchange ports before either starts;
    another process may bind one in between (seen: a replay died with 'exchange: tcp://...:38843
    is already in use' and a traceback). The fleet starts again on fresh ports; a fleet that
    cannot start is a clean error, not a traceback."""
    import socket

    import mesh.lab.bench.replay_bench as rb

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real_free = rb.free_port
    handed = []

    def free_port():
        handed.append(taken if not handed else real_free())  # the first broker's port: taken
        return handed[-1]

    monkeypatch.setattr(rb, "free_port", free_port)
    cfg = ReplayConfig(trace=str(_trace(tmp_path / "t.jsonl")), max_requests=4, workers=1, routers=2, provider="radix_tree",
                       policies=["cache_aware"])
    try:
        res = run_replay_bench(cfg, log_dir=str(tmp_path / "logs"), say=lambda m: None)
    finally:
        squatter.close()
    assert res["ok"] and res["real"]["cache_aware"]["completed"] == 4
    assert (tmp_path / "logs" / "cache_aware").is_dir() and (tmp_path / "logs" / "cache_aware-start2").is_dir()
    # always taken: three starts, then a clean error naming the port
    monkeypatch.setattr(rb, "free_port", lambda: taken)
    with socket.socket() as sq:
        sq.bind(("127.0.0.1", taken))
        sq.listen()
        with pytest.raises(rb.FleetStartError, match=f"{taken} is already in use"):
            run_replay_bench(cfg, log_dir=str(tmp_path / "logs2"), say=lambda m: None)
    assert (tmp_path / "logs2" / "cache_aware-start3").is_dir()


# ----------------------------------------------------------------------------- the CPU-bound verdict


def test_cpu_bound_when_the_client_sent_late():
    bound, why = cpu_verdict(lag_p95_ms=120.0, cpu_busy=0.5, max_lag_ms=50, max_cpu_busy=0.9)
    assert bound and len(why) == 1 and "send lag p95 120 ms > 50 ms" in why[0]


def test_cpu_bound_when_a_replay_process_waited_for_a_cpu():
    bound, why = cpu_verdict(lag_p95_ms=3.0, cpu_busy=0.5, wait_share=0.12, wait_who="engine-2", max_lag_ms=50,
                             max_cpu_busy=0.9, max_wait_share=0.05)
    assert bound and why == ["engine-2 waited for a CPU 12.0% of the run > 5.0%: its steps and hops ran late"]


def test_a_busy_machine_decides_only_when_the_waits_are_unmeasured():
    # other work keeps the machine busy but the replay's processes got a CPU when they needed one
    assert cpu_verdict(lag_p95_ms=3.0, cpu_busy=0.97, wait_share=0.01, wait_who="engine-0", max_lag_ms=50,
                       max_cpu_busy=0.9, max_wait_share=0.05) == (False, [])
    bound, why = cpu_verdict(lag_p95_ms=3.0, cpu_busy=0.97, wait_share=None, max_lag_ms=50, max_cpu_busy=0.9)
    assert bound and "machine CPU 97% busy > 90%" in why[0]


def test_cpu_bound_when_the_replays_own_processes_fill_the_cpus():
    bound, why = cpu_verdict(lag_p95_ms=3.0, cpu_busy=0.5, own_cpu_share=0.95, max_lag_ms=50, max_cpu_busy=0.9)
    assert bound and "own processes used 95%" in why[0]


def test_not_cpu_bound_within_both_bounds_and_unmeasured_figures_decide_nothing():
    assert cpu_verdict(lag_p95_ms=50.0, cpu_busy=0.9, own_cpu_share=0.9, max_lag_ms=50, max_cpu_busy=0.9) == (False, [])
    assert cpu_verdict(lag_p95_ms=None, cpu_busy=None, max_lag_ms=50, max_cpu_busy=0.9) == (False, [])
    bound, why = cpu_verdict(lag_p95_ms=80.0, cpu_busy=0.99, own_cpu_share=None, max_lag_ms=50, max_cpu_busy=0.9)
    assert bound and len(why) == 2  # every reason is listed


# ----------------------------------------------------------------------------- figures and the comparison


def test_client_figures_count_failures_against_goodput_and_every_worker():
    rs = [RequestResult(0, True, lag_ms=1, ttft_ms=100, e2e_ms=300, worker="w00", prompt_tokens=1000, cached_tokens=500),
          RequestResult(1, True, lag_ms=2, ttft_ms=3000, e2e_ms=3100, worker="w00", prompt_tokens=1000, cached_tokens=0),
          RequestResult(2, False, lag_ms=3, error="http_503")]
    f = client_figures(rs, slo_ms=2000, workers=["w00", "w01"])
    assert f["requests"] == 3 and f["completed"] == 2 and f["errors"] == {"http_503": 1}
    assert f["goodput"] == pytest.approx(1 / 3, abs=1e-4)  # the failed request misses the SLO
    assert f["hit_rate"] == 0.25 and f["served_per_worker"] == {"w00": 2, "w01": 0} and f["worker_cv"] == 1.0
    assert f["lag_max_ms"] == 3 and f["ttft_mean_ms"] == 1550.0  # the completed requests' mean
    assert f["tpot_mean_ms"] is None  # no request had two or more output tokens
    rs[0].completion_tokens, rs[1].completion_tokens = 11, 1
    assert client_figures(rs, slo_ms=2000)["tpot_mean_ms"] == 20.0  # (300 - 100) / (11 - 1); one token: no TPOT


def test_compare_ranks_by_p95_and_checks_the_tolerance():
    real = {"power_of_two": {"ttft_p95_ms": 900.0}, "cache_aware": {"ttft_p95_ms": 500.0}}
    sim = {"power_of_two": {"ttft_p95_ms": 1000.0}, "cache_aware": {"ttft_p95_ms": 450.0}}
    c = compare(real, sim)
    assert c["ranking_real"] == c["ranking_sim"] == ["cache_aware", "power_of_two"] and c["ranking_agrees"]
    assert c["p95_real_over_sim"] == {"power_of_two": 0.9, "cache_aware": 1.1111} and c["p95_within_tolerance"]
    sim["cache_aware"]["ttft_p95_ms"] = 1200.0
    c = compare(real, sim)
    assert not c["ranking_agrees"] and not c["p95_within_tolerance"]
    assert ranking({"a": None, "b": 2.0, "c": 1.0}) == ["c", "b", "a"]
    assert "pays" not in c  # no mean TTFTs: nothing to say what cache_aware pays


def test_compare_sets_what_cache_aware_pays_real_beside_the_twin():
    """The real-process replay's difference of mean TTFTs against each baseline, beside the
    simulator's on the same slice (the policy-level audit's twin, mesh sim --audit)."""
    real = {"power_of_two": {"ttft_mean_ms": 900.0}, "cache_aware_greedy": {"ttft_mean_ms": 560.0},
            "cache_aware": {"ttft_mean_ms": 500.0}}
    sim = {"power_of_two": {"ttft_mean_ms": 1000.0}, "cache_aware_greedy": {"ttft_mean_ms": None},
           "cache_aware": {"ttft_mean_ms": 450.0}}
    assert compare(real, sim)["pays"] == {"power_of_two": {"real_ms": 400.0, "sim_ms": 550.0},
                                          "cache_aware_greedy": {"real_ms": 60.0, "sim_ms": None}}
    fitted = {"power_of_two": {"ttft_mean_ms": 930.0}, "cache_aware": {"ttft_mean_ms": 510.0}}
    assert compare(real, sim, fitted=fitted)["pays"] == {"power_of_two": {"real_ms": 400.0, "sim_ms": 550.0, "fitted_ms": 420.0},
                                                         "cache_aware_greedy": {"real_ms": 60.0, "sim_ms": None, "fitted_ms": None}}
    # the ranking and p95 against the fitted engine's figures too, beside the stubs' own
    real = {"power_of_two": {"ttft_p95_ms": 5400.0}, "cache_aware": {"ttft_p95_ms": 2100.0}}
    sim = {"power_of_two": {"ttft_p95_ms": 4300.0}, "cache_aware": {"ttft_p95_ms": 2000.0}}
    fit = {"power_of_two": {"ttft_p95_ms": 4800.0}, "cache_aware": {"ttft_p95_ms": 2150.0}}
    c = compare(real, sim, fitted=fit)
    assert not c["p95_within_tolerance"] and c["fitted"]["p95_within_tolerance"] and c["fitted"]["ranking_agrees"]
    assert c["fitted"]["p95_real_over_sim"] == {"power_of_two": 1.125, "cache_aware": 0.9767}
    assert "fitted" not in compare(real, sim) and "fitted" not in compare(real, sim, fitted={"cache_aware": {}})


def test_the_slowed_engine_takes_exactly_slowdown_times_as_long():
    base, slow = EngineConfig(), slowed_engine(EngineConfig(), 3.0)
    durs = []
    for cfg in (base, slow):
        e = EngineModel(cfg)
        e.submit("a", list(range(5000)), 6, 0.0)
        e.submit("b", list(range(100, 9000)), 2, 0.0)
        d, t = [], 0.0
        while e.has_work():
            r = e.step(t)
            d.append(r.duration_s)
            t += r.duration_s
        durs.append(d)
    assert len(durs[0]) == len(durs[1]) > 5
    for a, b in zip(*durs):
        assert b == pytest.approx(3 * a, rel=1e-9)
    assert slowed_engine(base, 1) is base


def test_both_sides_replay_one_stream_with_the_same_fleet(tmp_path):
    cfg = ReplayConfig(workload="conversation", max_requests=30, rate=2.0, time_scale=0.5, slowdown=2.0, workers=3, routers=2)
    wl = build_replay_workload(cfg)
    plain = build_replay_workload(ReplayConfig(workload="conversation", max_requests=30, rate=2.0, workers=3, routers=2))
    assert [r.arrival_s for r in wl.requests] == pytest.approx([r.arrival_s for r in plain.requests])  # x 0.5 x 2
    sc = sim_config(cfg)
    assert sc.workers == [3] and sc.routers == [2] and sc.exchange and sc.providers == ["indexer"]
    assert sc.engine == slowed_engine(EngineConfig(), 2.0) and sc.ttft_slo_ms == 4000.0
    trace = ReplayConfig(trace=str(_trace(tmp_path / "t.jsonl")), max_requests=4, time_scale=2.0, slowdown=1.5)
    assert [r.arrival_s for r in build_replay_workload(trace).requests] == pytest.approx([0, 0.45, 0.9, 1.35])


# ----------------------------------------------------------------------------- arguments


def test_help_names_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["replay", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--trace", "--workload", "--max-requests", "--time-scale", "--slowdown", "--workers", "--routers",
                 "--provider", "--no-exchange", "--policies", "--max-lag-ms", "--max-wait-share", "--max-cpu-busy", "--json"):
        assert flag in out, flag


@pytest.mark.parametrize(("argv", "field"), [
    (["--workers", "abc"], "--workers"), (["--workers", "0"], "--workers"), (["--time-scale", "-1"], "--time-scale"),
    (["--slowdown", "nan"], "--slowdown"), (["--max-wait-share", "0"], "--max-wait-share"), (["--provider", "approx"], "--provider"),
])
def test_a_bad_flag_is_refused_naming_it(argv, field, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["replay", "--workload", "zipf", *argv])
    assert exc.value.code == 2
    assert f"argument {field}" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "field"), [
    (["--policies", "cache_aware,fastest"], "policies: unknown policy 'fastest'"), (["--policies", ","], "policies: give"),
    (["--max-cpu-busy", "1.5"], "max_cpu_busy must be in"), (["--max-wait-share", "2"], "max_wait_share must be in"),
    (["--workers", "17"], "workers must be"), (["--slowdown", "50"], "slowdown must be in"),
])
def test_a_bad_value_is_a_configuration_error_naming_its_field(argv, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        config_from_args(_parser().parse_args(["replay", "--workload", "zipf", *argv]))


def test_exactly_one_source_is_required():
    with pytest.raises(SystemExit):
        _parser().parse_args(["replay", "--trace", "a", "--workload", "zipf"])
    with pytest.raises(ConfigError, match="trace/workload"):
        ReplayConfig().validate()


@pytest.mark.parametrize(("kw", "field"), [
    ({"workers": 10**6}, "workers"), ({"routers": 99}, "routers"), ({"max_requests": 10**9}, "max_requests"),
    ({"workers": "4"}, "workers"), ({"slowdown": 100.0}, "slowdown"), ({"time_scale": float("inf")}, "time_scale"),
    ({"net_ms": -1.0}, "net_ms"), ({"policies": []}, "policies"), ({"policies": ["cache_aware", "cache_aware"]}, "policies"),
    ({"provider": "approx"}, "provider"), ({"max_wait_share": 2.0}, "max_wait_share"),
])
def test_an_out_of_range_setting_names_its_field(kw, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        ReplayConfig(workload="zipf", **kw).validate()


def test_a_missing_or_broken_trace_is_a_configuration_error(tmp_path):
    args = _parser().parse_args(["replay", "--trace", str(tmp_path / "none.jsonl")])
    with pytest.raises(ConfigError, match="^trace: no file"):
        config_from_args(args)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1: bad trace record"):
        build_replay_workload(config_from_args(_parser().parse_args(["replay", "--trace", str(bad)])))


# ----------------------------------------------------------------------------- the result page


def _result(cpu_bound: bool) -> dict:
    fig = {"ttft_p50_ms": 400.0, "ttft_p95_ms": 2778.0, "goodput": 0.9, "hit_rate": 0.41, "lag_p95_ms": 4.0,
           "cpu_bound": cpu_bound}
    cfg = ReplayConfig(trace="trace.jsonl", max_requests=800, policies=["power_of_two", "cache_aware"]).to_dict()
    return {"bench": "replay", "config": cfg, "workload": {"name": "mooncake", "requests": 800, "span_s": 200.0},
            "real": {"power_of_two": {**fig, "ttft_p95_ms": 3500.0}, "cache_aware": fig},
            "sim": {"power_of_two": {**fig, "ttft_p95_ms": 3600.0}, "cache_aware": {**fig, "ttft_p95_ms": 3068.0}},
            "comparison": compare({"power_of_two": {"ttft_p95_ms": 3500.0, "ttft_mean_ms": 1500.0},
                                   "cache_aware": {"ttft_p95_ms": 2778.0, "ttft_mean_ms": 1100.0}},
                                  {"power_of_two": {"ttft_p95_ms": 3600.0, "ttft_mean_ms": 1550.0},
                                   "cache_aware": {"ttft_p95_ms": 3068.0, "ttft_mean_ms": 1180.0}},
                                  fitted={"power_of_two": {"ttft_p95_ms": 3300.0, "ttft_mean_ms": 1480.0},
                                          "cache_aware": {"ttft_p95_ms": 2900.0, "ttft_mean_ms": 1090.0}}),
            "engine_fit": {"prefill_speed": 0.87, "decode_speed": 0.95, "evaluations": 4, "converged": True},
            "cpu_bound": cpu_bound, "cpu_bound_reasons": ["cache_aware: machine CPU 97% busy > 90%"] if cpu_bound else [],
            "machine": {"cpus": 2, "loadavg_at_start": [0.5]}}


@pytest.mark.parametrize("cpu_bound", [False, True])
def test_the_replay_page_shows_both_sides_and_says_when_cpu_bound(tmp_path, cpu_bound):
    src = tmp_path / "replay.json"
    src.write_text(json.dumps(_result(cpu_bound)))
    assert detect_kind(_result(cpu_bound)) == "replay"
    assert report_main([str(src), "--out", str(tmp_path / "results"), "--date", "2026-12-05"]) == 0
    text = (tmp_path / "results" / "replay-mooncake.md").read_text()
    assert "- Command: `mesh bench replay --trace trace.jsonl --max-requests 800" in text
    assert "| cache_aware | 400 / 400 | 2,778 / 3,068 | 0.91x |" in text
    assert "real cache_aware < p2c; sim cache_aware < p2c: agree" in text
    assert "What cache_aware pays per request" in text and "p2c +400 / +370 ms" in text
    assert "On the engine fitted to the real cache_aware run" in text and "prefill x0.87, decode x0.95" in text
    assert "p2c +400 / +390 ms (real / fitted sim)" in text
    assert "On the engine fitted to the real cache_aware run: ranking cache_aware < p2c: agree; p95 real/sim p2c 1.06x" in text
    assert ("**CPU-bound**" in text) == cpu_bound and ("| CPU-bound |" in text) == cpu_bound


# ----------------------------------------------------------------------------- the whole command


@pytest.mark.bench
@pytest.mark.e2e
def test_the_command_replays_every_policy_through_two_brokers_with_the_indexer(tmp_path):
    from mesh.cli import main

    out = tmp_path / "replay.json"
    rc = main(["bench", "replay", "--trace", str(_trace(tmp_path / "t.jsonl", 12)), "--max-requests", "12",
               "--workers", "3", "--routers", "2", "--log-dir", str(tmp_path / "logs"), "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert list(res["real"]) == list(res["sim"]) == ["power_of_two", "cache_aware_greedy", "cache_aware"]
    for pol, fig in res["real"].items():
        assert fig["completed"] == 12 and fig["cpu_s"]["indexer"] >= 0 and len(fig["served_per_worker"]) == 3, pol
    assert res["sim_config"]["exchange"] and res["sim_config"]["providers"] == ["indexer"]
    assert report_main([str(out), "--out", str(tmp_path / "results")]) == 0
