"""The routing quality matrix (mesh/lab/sim/matrix.py) and the conversation workload."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from mesh.errors import ConfigError
from mesh.lab.sim.cli import add_sim_parser
from mesh.lab.sim.matrix import dumps_matrix, extend, load_matrix, rejudge, run_matrix
from mesh.lab.sim.workloads import make_workload

ROOT = Path(__file__).resolve().parent.parent

TINY = """
[matrix]
seeds = [1, 3]
policies = ["power_of_two", "cache_aware_greedy", "cache_aware"]

[workloads.zipf]
workload = "zipf"
params = { groups = 64, system_tokens = 2048, question_tokens = 512, output_tokens = 32 }

[[cells]]
workload = "zipf"
load = [0.5, 1.0]
workers = 2
routers = 2
max_requests = 100
"""


def _write(tmp_path: Path, text: str, name: str = "m.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh")
    add_sim_parser(parser.add_subparsers(dest="cmd"))
    return parser


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("edit, field", [
    (("load = [0.5, 1.0]", "load = [0.5, -1.0]"), "cells[0].load[1]"),
    (("workers = 2", "workers = 0"), "cells[0].workers"),
    (("routers = 2", "routers = 'two'"), "cells[0].routers"),
    (("max_requests = 100", "max_requests = 100\nlod = 1"), "cells[0].lod"),
    (("max_requests = 100", ""), "cells[0].max_requests"),
    (('workload = "zipf"\nload', 'workload = "zapf"\nload'), "cells[0].workload"),
    (('"cache_aware"]', '"cache_awar"]'), "matrix.policies[2]"),
    (("seeds = [1, 3]", "seeds = [1, 1]"), "matrix.seeds"),
    (("seeds = [1, 3]", "seeds = [1, 3]\nsubject = 'round_robin'"), "matrix.subject"),
    (('[workloads.zipf]\nworkload = "zipf"', '[workloads.zipf]\nworkload = "zipfian"'), "workloads.zipf.workload"),
    (("groups = 64,", "grups = 64,"), "workloads.zipf.params.grups"),
    (('[workloads.zipf]\nworkload = "zipf"', '[workloads.zipf]\ntrace = "nope.jsonl"'), "workloads.zipf.trace"),
    (("[[cells]]", "[sim]\nrouter_pick = 'sideways'\n\n[[cells]]"), "sim.router_pick"),
    (("[[cells]]", "[sim]\nheartbeat_ms = 0\n\n[[cells]]"), "sim.heartbeat_ms"),
    (("[[cells]]", "[engine]\npage_size = 0\n\n[[cells]]"), "engine.page_size"),
    (("[[cells]]", "[engine]\npage_sise = 16\n\n[[cells]]"), "engine.page_sise"),
    (("[[cells]]", "[sim.policy_params.cache_awre]\nrank_ties = 'off'\n\n[[cells]]"), "sim.policy_params.cache_awre"),
    (("[[cells]]", "[sim.policy_params.cache_aware]\nrank_ties = 'never'\n\n[[cells]]"), "sim.policy_params.cache_aware"),
    (("[[cells]]", "[sim.policy_params.cache_aware]\nrank_tie = 'off'\n\n[[cells]]"), "sim.policy_params.cache_aware"),
])
def test_validation_errors_name_the_field(tmp_path, edit, field):
    old, new = edit
    assert old in TINY
    p = _write(tmp_path, TINY.replace(old, new, 1))
    with pytest.raises(ConfigError) as ei:
        load_matrix(p)
    assert str(ei.value).startswith(field + ":"), str(ei.value)


def test_one_policys_options_reach_only_that_policy(tmp_path):
    text = TINY.replace("[[cells]]", "[sim.policy_params.cache_aware]\nrank_ties = 'off'\n\n[[cells]]", 1)
    mc = load_matrix(_write(tmp_path, text))
    assert mc.sim["policy_params"] == {"cache_aware": {"rank_ties": "off"}}
    from mesh.lab.sim.matrix import _sim_config

    cfg = _sim_config(mc, mc.workloads["zipf"], 1.0, 2, 2, 1, 10, list(mc.policies))
    assert cfg.options_for("cache_aware") == {"rank_ties": "off"} and cfg.options_for("power_of_two") == {}


def test_expansion_overrides_and_duplicates(tmp_path):
    mc = load_matrix(_write(tmp_path, TINY))
    assert [c.label for c in mc.cells] == ["zipf L0.5 W2 R2", "zipf L1 W2 R2"]
    assert mc.seeds == [1, 3] and mc.subject == "cache_aware"
    assert mc.baselines == ["power_of_two", "cache_aware_greedy"] and mc.hit_reference == "cache_aware_greedy"
    mc = load_matrix(_write(tmp_path, TINY), seeds=[2], max_requests=10)
    assert mc.seeds == [2] and {c.max_requests for c in mc.cells} == {10}
    assert [c.label for c in load_matrix(_write(tmp_path, TINY), only="L1 ").cells] == ["zipf L1 W2 R2"]
    with pytest.raises(ConfigError, match="^cells: no cell label matches 'W64'"):
        load_matrix(_write(tmp_path, TINY), only="W64")
    dup = TINY + '\n[[cells]]\nworkload = "zipf"\nload = 1.0\nworkers = 2\nrouters = [1, 2]\nmax_requests = 5\n'
    with pytest.raises(ConfigError, match=r"^cells\[1\]: cell zipf L1 W2 R2 is already defined by cells\[0\]"):
        load_matrix(_write(tmp_path, dup))


def test_default_matrix_is_valid_and_covers_the_issue():
    if not (ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl").is_file():
        pytest.skip("the shared Mooncake trace is not next to this checkout")
    mc = load_matrix(ROOT / "configs" / "quality-matrix.toml")
    assert len(mc.cells) >= 24
    assert mc.seeds == [1, 3]
    kinds = {w.workload or "trace" for w in mc.workloads.values()}
    assert kinds == {"trace", "shared_prefix", "zipf", "low_reuse", "conversation"}
    assert {c.load for c in mc.cells} == {0.5, 0.8, 1.0, 1.2}
    assert {c.workers for c in mc.cells} == {4, 16, 64}
    assert {c.routers for c in mc.cells} == {1, 4, 8}
    bursty = {w for w in mc.workloads if w.startswith("bursty_")}
    assert bursty == {"bursty_conversation", "bursty_zipf"}  # issue 33: bursts at 1/4/8 routers
    for w in bursty:
        assert {c.routers for c in mc.cells if c.workload == w} == {1, 4, 8}
    for w in set(mc.workloads) - bursty:  # every workload is tried light, busy and overloaded
        assert {c.load for c in mc.cells if c.workload == w} == {0.5, 0.8, 1.0, 1.2}
    assert {"power_of_two", "cache_aware_greedy", "cache_aware"} <= set(mc.policies)


@pytest.mark.parametrize("name,rate_x", [("quality-matrix-70b.toml", 0.24), ("quality-matrix-fast.toml", 4.0)])
def test_the_held_out_engine_matrices_are_valid_and_differ_only_in_their_engine(name, rate_x):
    """The 70B-class engine (6k prefill tokens/s) and the small fast one (4x the 8B's)."""
    if not (ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl").is_file():
        pytest.skip("the shared Mooncake trace is not next to this checkout")
    base = load_matrix(ROOT / "configs" / "quality-matrix.toml")
    mc = load_matrix(ROOT / "configs" / name)
    assert mc.seeds == [2]  # held out
    assert mc.engine.prefill_tokens_per_s == rate_x * base.engine.prefill_tokens_per_s
    assert (mc.policies, mc.sim, set(mc.workloads)) == (base.policies, base.sim, set(base.workloads))
    assert {c.routers for c in mc.cells} == {1, 4}


def test_a_matrix_extends_another_and_overrides_it_key_by_key(tmp_path):
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    (base_dir / "t.jsonl").write_text('{"timestamp": 0, "input_length": 64, "output_length": 4, "hash_ids": [1]}\n')
    _write(base_dir, TINY + '\n[sim]\nheartbeat_ms = 400.0\nnet_ms = 0.7\n\n[workloads.tr]\ntrace = "t.jsonl"\n', "base.toml")
    child = _write(tmp_path, 'extends = "base/base.toml"\n[matrix]\nseeds = [2]\n[sim]\nnet_ms = 0.9\n'
                             '[engine]\nprefill_tokens_per_s = 6000.0\n')
    base, mc = load_matrix(base_dir / "base.toml"), load_matrix(child)
    assert mc.seeds == [2] and mc.policies == base.policies  # [matrix] key by key
    assert mc.sim == {**base.sim, "net_ms": 0.9}
    assert mc.engine.prefill_tokens_per_s == 6000.0 and base.engine.prefill_tokens_per_s != 6000.0
    assert mc.workloads["tr"].trace == str((base_dir / "t.jsonl").resolve())  # relative to the base
    assert mc.cells == base.cells  # not given: the base's
    mine = load_matrix(_write(tmp_path, child.read_text() + TINY[TINY.index("[[cells]]"):].replace("workers = 2", "workers = 3"), "c2.toml"))
    assert {c.workers for c in mine.cells} == {3}  # given: replaced


@pytest.mark.parametrize("text, msg", [
    ('extends = "nowhere.toml"\n', "extends: .*nowhere.toml does not exist"),
    ("extends = 3\n", "extends: must be the path"),
    ('extends = "chain.toml"\n', r"extends: .*child.toml is already in the chain of bases \(child.toml -> chain.toml\): a cycle"),
])
def test_a_bad_extends_is_a_clear_error(tmp_path, text, msg):
    _write(tmp_path, 'extends = "child.toml"\n' + TINY, "chain.toml")
    with pytest.raises(ConfigError, match=msg):
        load_matrix(_write(tmp_path, text, "child.toml"))


def test_a_base_may_extend_another_up_to_three_files(tmp_path):
    _write(tmp_path, TINY, "a.toml")
    _write(tmp_path, 'extends = "a.toml"\n[engine]\nprefill_tokens_per_s = 6000.0\n', "b.toml")
    c = _write(tmp_path, 'extends = "b.toml"\n[matrix]\ntwin = true\ntwin_engine_error = 1.2\ntwin_fit = true\n', "c.toml")
    mc = load_matrix(c)
    assert mc.engine.prefill_tokens_per_s == 6000.0 and mc.twin and mc.twin_fit and mc.twin_engine_error == 1.2
    d = _write(tmp_path, 'extends = "c.toml"\n', "d.toml")
    with pytest.raises(ConfigError, match=r"extends: more than 3 files in the chain"):
        load_matrix(d)


@pytest.mark.parametrize("text, field", [
    ("[matrix]\ntwin = true\ntwin_engine_error = 0\n", "matrix.twin_engine_error"),
    ("[matrix]\ntwin = true\ntwin_engine_error = \"fast\"\n", "matrix.twin_engine_error"),
    ("[matrix]\ntwin = true\ntwin_fit = 1\n", "matrix.twin_fit"),
    ("[matrix]\ntwin_fit = true\n", "matrix.twin_fit: needs twin = true"),
    ("[matrix]\ntwin_engine_error = 1.2\n", "matrix.twin_engine_error: needs twin = true"),
    ("[matrix]\ntwin_draws = 2\n", "matrix.twin_draws: needs twin = true"),
    ("[matrix]\ntwin = true\ntwin_draws = 17\n", "matrix.twin_draws: must be from 1 to 16"),
    ("[matrix]\nreplicas = 0\n", "matrix.replicas"),
    ("[matrix]\nreplicas = 2.5\n", "matrix.replicas"),
    ("[matrix]\nreplicas = 17\n", "matrix.replicas: must be from 1 to 16"),
])
def test_the_twins_engine_options_are_validated_naming_the_field(tmp_path, text, field):
    _write(tmp_path, TINY, "a.toml")
    with pytest.raises(ConfigError, match=field):
        load_matrix(_write(tmp_path, 'extends = "a.toml"\n' + text, "b.toml"))


def test_cli_refuses_single_run_options_with_matrix(tmp_path):
    p = _write(tmp_path, TINY)
    parser = _parser()
    args = parser.parse_args(["sim", "--matrix", str(p), "--policy", "cache_aware", "--page-size", "32"])
    with pytest.raises(ConfigError, match=r"^--policy, --page-size: not used with --matrix"):
        args.func(args)
    with pytest.raises(SystemExit):  # --matrix excludes --workload
        parser.parse_args(["sim", "--matrix", str(p), "--workload", "zipf"])
    args = parser.parse_args(["sim", "--workload", "zipf", "--seeds", "2"])
    with pytest.raises(ConfigError, match="--seeds, --cells, --rejudge, --extend and --reuse-calibration need --matrix"):
        args.func(args)


# --------------------------------------------------------------------------- end to end


@pytest.mark.soak  # the default run keeps its lighter relatives under the 10-minute budget
def test_tiny_matrix_end_to_end(tmp_path):
    p = _write(tmp_path, TINY)
    out_json, out_png = tmp_path / "m.json", tmp_path / "m.png"
    args = _parser().parse_args(["sim", "--matrix", str(p), "--jobs", "1", "--no-progress", "--json", str(out_json),
                                 "--plot", str(out_png)])
    assert args.func(args) == 0
    rep = json.loads(out_json.read_text())
    assert out_png.stat().st_size > 5000 and out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(rep["cells"]) == 2
    assert set(rep["calibrations"]) == {"zipf/W2/seed1/n100", "zipf/W2/seed3/n100"}
    for cal in rep["calibrations"].values():
        ok = [pr for pr in cal["probes"] if pr["ok"]]
        assert ok and max(pr["rate_rps"] for pr in ok) == cal["rate_p2c_rps"] and cal["first_fail_rps"] > cal["rate_p2c_rps"]
        assert all(pr["wait_within_slo"] >= 0.9 for pr in ok)
        assert all(pr["wait_within_slo"] < 0.9 for pr in cal["probes"] if not pr["ok"])
    for c in rep["cells"]:
        assert set(c["seeds"]) == {"1", "3"}
        assert c["verdict"].startswith(c["label"] + ": cache_aware p95 ")
        assert any(w in c["verdict"] for w in ("WINS", "WITHIN 5%", "LOSES"))
        assert set(c["targets"]) == {"ttft_p95", "goodput", "hit_rate"}
        for s, run in c["seeds"].items():
            arms = run["arms"]
            assert [a["policy"] for a in arms] == ["power_of_two", "cache_aware_greedy", "cache_aware"]
            # the identical stream for every policy
            assert {a["requests"] for a in arms} == {run["stream"]["requests"]} == {100}
            assert {a["oracle_hit_rate"] for a in arms} == {run["stream"]["oracle_hit_rate"]}
            assert run["rate_rps"] == pytest.approx(c["load"] * rep["calibrations"][f"zipf/W2/seed{s}/n100"]["rate_p2c_rps"],
                                                    rel=1e-5)
            an = run["analysis"]["policies"]
            for a in arms:
                others = [o for o in arms if o["policy"] != a["policy"]]
                best = min(o["ttft_p95_ms"] for o in others)
                assert an[a["policy"]]["p95_ratio"] == pytest.approx(a["ttft_p95_ms"] / best, abs=1e-4)
                assert an[a["policy"]]["goodput_diff"] == pytest.approx(a["goodput"] - max(o["goodput"] for o in others),
                                                                        abs=1e-4)
                assert an[a["policy"]]["status"] in ("win", "within", "lose")
    sm = rep["summary"]
    assert sm["cells"] == 2
    for pol, counts in sm["policies"].items():
        assert sum(counts.values()) == 2
    # the two seeds are different streams; the two cells at one seed share content (only arrivals differ)
    fp = {(c["id"], s): r["stream"]["fingerprint"] for c in rep["cells"] for s, r in c["seeds"].items()}
    assert fp[(0, "1")] != fp[(0, "3")] and fp[(0, "1")] != fp[(1, "1")]

    # same config -> same report, from reused calibrations too (and across processes: --jobs 2)
    mc = load_matrix(p)
    from mesh.lab.sim.matrix import reusable_calibrations

    reuse = reusable_calibrations(mc, out_json)
    assert set(reuse) == set(rep["calibrations"])
    again = json.loads(dumps_matrix(run_matrix(mc, jobs=1, reuse=reuse)))
    assert again["reused_calibrations"] == sorted(rep["calibrations"])
    again["reused_calibrations"] = []
    assert again == rep
    par = json.loads(dumps_matrix(run_matrix(load_matrix(p, seeds=[1]), jobs=2)))
    assert par["cells"][0]["seeds"]["1"] == rep["cells"][0]["seeds"]["1"]
    # a changed basis (another SLO) makes the old calibrations stale
    stale = load_matrix(_write(tmp_path, TINY.replace("[[cells]]", "[sim]\nttft_slo_ms = 500\n\n[[cells]]"), "s.toml"))
    assert reusable_calibrations(stale, out_json) == {}


def test_a_run_sharded_by_seed_is_judged_as_one(tmp_path):
    """``--rejudge`` with several reports: one run sharded by seed (seed 1 on one machine, seed 3
    on another) judged as one report gives the report of the run of both; files that overlap,
    miss a seed, belong to another matrix or are forged are refused by name."""
    p = _write(tmp_path, TINY.replace("load = [0.5, 1.0]", "load = 1.0"))
    mc = load_matrix(p)
    rep = json.loads(dumps_matrix(run_matrix(mc, jobs=1)))
    s1, s3 = tmp_path / "s1.json", tmp_path / "s3.json"
    s1.write_text(dumps_matrix(run_matrix(load_matrix(p, seeds=[1]), jobs=1)))
    s3.write_text(dumps_matrix(run_matrix(load_matrix(p, seeds=[3]), jobs=1)))
    assert json.loads(dumps_matrix(rejudge(mc, [s3, s1]))) == rep
    merged = tmp_path / "merged.json"
    args = _parser().parse_args(["sim", "--matrix", str(p), "--rejudge", str(s1), str(s3), "--json", str(merged)])
    assert args.func(args) == 0 and json.loads(merged.read_text()) == rep
    with pytest.raises(ConfigError, match=r"rejudge: seed 1 is in both .*s1.json and .*s1.json"):
        rejudge(mc, [s1, s1])
    with pytest.raises(ConfigError, match=r"rejudge: no file ran seed\(s\) 3 \(--seeds 1,3\)"):
        rejudge(mc, [s1])
    with pytest.raises(ConfigError, match=r"rejudge: .*s3.json ran seed 3, which is not among --seeds 1,2"):
        rejudge(load_matrix(p, seeds=[1, 2]), [s1, s3])
    stale_mc = load_matrix(_write(tmp_path, p.read_text().replace("[[cells]]", "[sim]\nttft_slo_ms = 500\n\n[[cells]]"),
                                  "s2.toml"))
    with pytest.raises(ConfigError, match=r"rejudge: .*s1.json is not a run of .* \(its sim differ\)"):
        rejudge(stale_mc, [s1, s3])
    # forged or truncated runs: a clean error naming the file, never a traceback
    broken = json.loads(s3.read_text())
    del broken["cells"][0]["seeds"]["3"]["arms"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(ConfigError, match=r"rejudge: a run in .*broken.json is broken or incomplete"):
        rejudge(mc, [s1, tmp_path / "broken.json"])
    broken["cells"][0]["seeds"] = ["3"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(ConfigError, match=r"rejudge: .*broken.json is not a mesh sim --matrix --json report"):
        rejudge(mc, [s1, tmp_path / "broken.json"])
    (tmp_path / "not.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"rejudge: .*not.json is not a mesh sim --matrix --json report"):
        rejudge(mc, [tmp_path / "not.json"])


def test_trace_windows_per_seed(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = []
    for i in range(40):  # 4 req/s, 2-block prompts sharing block i % 3
        lines.append(json.dumps({"timestamp": i * 250, "input_length": 800, "output_length": 4,
                                 "hash_ids": [i % 3, 1000 + i]}))
    trace.write_text("\n".join(lines) + "\n")
    text = TINY.replace('[workloads.zipf]\nworkload = "zipf"\nparams = { groups = 64, system_tokens = 2048, '
                        'question_tokens = 512, output_tokens = 32 }', '[workloads.zipf]\ntrace = "t.jsonl"')
    mc = load_matrix(_write(tmp_path, text.replace("max_requests = 100", "max_requests = 15")))
    from mesh.lab.sim.matrix import _sim_config, build_stream

    wdef = mc.workloads["zipf"]
    for seed, first in ((1, 0), (2, 15), (3, 4)):  # offset (seed - 1) * 15 mod 26
        cfg = _sim_config(mc, wdef, 8.0, 2, 1, seed, 15, mc.policies)
        assert cfg.time_scale == pytest.approx(0.5)  # native 4 req/s -> 8 req/s
        wl = build_stream(mc, wdef, cfg)
        assert len(wl.requests) == 15 and wl.params["offset"] == first
        assert wl.requests[0].arrival_s == 0.0 and wl.requests[-1].arrival_s == pytest.approx(14 * 0.125)


# --------------------------------------------------------------------------- conversation workload


def test_conversation_workload_statistics():
    wl = make_workload("conversation", seed=1, rate=5.0, duration_s=None, max_requests=800)
    reqs = wl.requests
    assert len(reqs) == 800
    prompts = [r.prompt_len for r in reqs]
    mean_prompt = sum(prompts) / len(prompts)
    assert 9_000 <= mean_prompt <= 16_000, mean_prompt
    assert max(prompts) > 100_000
    assert max(prompts) <= 131_072
    mean_out = sum(r.output_len for r in reqs) / len(reqs)
    assert 300 <= mean_out <= 400, mean_out
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert reqs[0].arrival_s >= 0.0 and [r.idx for r in reqs] == list(range(800))
    # each later turn extends its session's previous turn: same segments, its answer, a new message
    continued = 0
    for r in reqs:
        outs = [s for s in r.segments if s[0] == 1]
        if not outs:
            continue
        prev = reqs[outs[-1][1]]
        assert prev.idx < r.idx and prev.arrival_s <= r.arrival_s
        k = len(prev.segments)
        assert r.segments[:k] == prev.segments
        assert r.segments[k] == (1, prev.idx, prev.output_len, prev.output_len)
        assert len(r.segments) == k + 2 and r.prompt_len == prev.prompt_len + prev.output_len + r.segments[-1][3]
        continued += 1
    assert continued > 300  # sessions interleave: a good share of turns continue an earlier one in the stream
    # token level, on a few: the previous prompt, then the engine model's answer, is a prefix
    done = 0
    for r in reqs:
        outs = [s for s in r.segments if s[0] == 1]
        if outs and r.prompt_len < 20_000:
            prev = reqs[outs[-1][1]]
            toks, ptoks = wl.prompt(r), wl.prompt(prev)
            assert list(toks[: len(ptoks)]) == list(ptoks)
            assert list(toks[len(ptoks): len(ptoks) + prev.output_len]) == wl.output_tokens(prev)
            done += 1
            if done == 5:
                break
    assert done == 5
    # deterministic, and a higher rate replays the same sessions closer together
    again = make_workload("conversation", seed=1, rate=5.0, duration_s=None, max_requests=800)
    assert [(r.arrival_s, r.segments) for r in again.requests] == [(r.arrival_s, r.segments) for r in reqs]
    fast = make_workload("conversation", seed=1, rate=10.0, duration_s=None, max_requests=800)
    assert fast.requests[-1].arrival_s < reqs[-1].arrival_s
    other = make_workload("conversation", seed=2, rate=5.0, duration_s=None, max_requests=800)
    assert [r.segments for r in other.requests[:50]] != [r.segments for r in reqs[:50]]


def test_conversation_parameters_and_duration():
    wl = make_workload("conversation", seed=3, rate=4.0, duration_s=30.0, max_context_tokens=20_000, think_s=2.0)
    assert wl.requests and all(r.arrival_s < 30.0 for r in wl.requests)
    assert max(r.prompt_len for r in wl.requests) <= 20_000
    assert wl.params["max_context_tokens"] == 20_000
    with pytest.raises(ConfigError, match="think_s"):
        make_workload("conversation", seed=1, rate=4.0, duration_s=10.0, think_s=0)
    with pytest.raises(ConfigError, match="turns_mean"):
        make_workload("conversation", seed=1, rate=4.0, duration_s=10.0, turns_mean=0.5)
    with pytest.raises(ConfigError, match="no parameter 'groups'"):
        make_workload("conversation", seed=1, rate=4.0, duration_s=10.0, groups=3)


def test_noise_arm_and_router_scaling(tmp_path):
    """``noise = true`` runs the subject again with its workers named in another order: its spread is reported per
    cell and seed, a p95 miss is marked within or beyond it, and cells that differ only in
    routers get the subject's p95 over the 1-router cell's."""
    text = TINY.replace('policies = ["power_of_two", "cache_aware_greedy", "cache_aware"]',
                        'policies = ["power_of_two", "cache_aware_greedy", "cache_aware"]\nnoise = true')
    text = text.replace("load = [0.5, 1.0]", "load = 1.0").replace("routers = 2", "routers = [1, 2]").replace(
        "workers = 2", "workers = 3")
    rep = run_matrix(load_matrix(_write(tmp_path, text), seeds=[1]), jobs=1)
    for c in rep["cells"]:
        run = c["seeds"]["1"]
        assert [a["policy"] for a in run["arms"]] == ["power_of_two", "cache_aware_greedy", "cache_aware", "cache_aware@b"]
        assert set(run["analysis"]["policies"]) == {"power_of_two", "cache_aware_greedy", "cache_aware"}  # not judged
        nz = run["analysis"]["noise"]
        p95 = {a["policy"]: a["ttft_p95_ms"] for a in run["arms"]}
        assert nz["p95_ratio"] == pytest.approx(p95["cache_aware@b"] / p95["cache_aware"], abs=1e-4)
        assert nz["spread"] == pytest.approx(max(nz["p95_ratio"], 1 / nz["p95_ratio"]), abs=1e-4)
        t = run["analysis"]["targets"]["ttft_p95"]
        assert t["beyond_noise"] == (t["value"] > 1.05 * nz["spread"])
        assert "noise " in c["verdict"]
    (row,) = rep["summary"]["routers"]
    assert row["cells"] == "zipf L1 W3"
    one, two = (next(c for c in rep["cells"] if c["routers"] == r) for r in (1, 2))
    p95 = {r: {a["policy"]: a["ttft_p95_ms"] for a in c["seeds"]["1"]["arms"]} for r, c in ((1, one), (2, two))}
    assert row["ratios"]["2"]["1"] == pytest.approx(p95[2]["cache_aware"] / p95[1]["cache_aware"], abs=1e-4)
    both = (p95[2]["cache_aware"] * p95[2]["cache_aware@b"] / (p95[1]["cache_aware"] * p95[1]["cache_aware@b"])) ** 0.5
    assert row["ratios_two_orders"]["2"]["1"] == pytest.approx(both, abs=1e-4)
    assert row["within_5pct_two_orders"] == (both <= 1.05)
    assert isinstance(rep["summary"]["ttft_p95_misses_beyond_noise"], list)
    from mesh.lab.sim.matrix import render_report
    from rich.console import Console

    con = Console(record=True, width=200)
    for r in render_report(json.loads(dumps_matrix(rep))):
        con.print(r)
    text_out = con.export_text()
    assert "cache_aware@b" in text_out and "routers, zipf L1 W3: p95 over R1 R2 " in text_out


def _children(pid: int) -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(d.name))
    return out


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_matrix_killed_by_a_signal_leaves_no_worker_processes(tmp_path):
    """``mesh sim --matrix --jobs 2`` SIGTERMed (a CI timeout, an operator's kill) took its pool
    with it only in part: the spawned workers waited forever on the dead pool's queue. Each
    worker now dies with the process that started it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    text = TINY.replace("max_requests = 100", "max_requests = 3000").replace("workers = 2", "workers = 8")
    p = _write(tmp_path, text)
    proc = subprocess.Popen([sys.executable, "-m", "mesh.cli", "sim", "--matrix", str(p), "--jobs", "2", "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        workers: set[int] = set()
        deadline = time.monotonic() + 120
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            workers = {c for c in _children(proc.pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()}
            time.sleep(0.1)
        assert len(workers) == 2, "the pool's workers never started"
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        deadline = time.monotonic() + 60
        alive = set(workers)
        while alive and time.monotonic() < deadline:
            alive = {w for w in alive if Path(f"/proc/{w}").exists() and "Z" not in Path(f"/proc/{w}/stat").read_text().rsplit(")", 1)[1][:3]}
            time.sleep(0.1)
        assert not alive, f"workers outlived their matrix: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in _children(proc.pid):
            try:
                os.kill(w, signal.SIGKILL)
            except OSError:
                pass


def test_the_twin_audits_every_stream_at_the_policy_level(tmp_path):
    """``twin = true``: every (cell, seed) also runs the stream through cache_aware and both
    baselines on the twin's own draws (mesh.lab.sim.twin); the regret check judges the twin's
    difference against the same measured difference, and the summary counts it."""
    text = TINY.replace('policies = ["power_of_two", "cache_aware_greedy", "cache_aware"]',
                        'policies = ["power_of_two", "cache_aware_greedy", "cache_aware"]\ntwin = true')
    text = text.replace("load = [0.5, 1.0]", "load = 1.0").replace("workers = 2", "workers = 3")
    rep = json.loads(dumps_matrix(run_matrix(load_matrix(_write(tmp_path, text), seeds=[1]), jobs=1)))
    (c,) = rep["cells"]
    run = c["seeds"]["1"]
    twin = {a["policy"]: a for a in run["twin"]}
    assert list(twin) == ["cache_aware", "cache_aware_greedy", "power_of_two"]
    arms = {a["policy"]: a for a in run["arms"]}
    # its own draws: not a copy of the measured arms (power-of-two's picks are drawn)
    assert twin["power_of_two"]["ttft_mean_ms"] != arms["power_of_two"]["ttft_mean_ms"]
    rg = run["analysis"]["regret"]
    tw = rg["twin"]
    assert tw["predicted_ms"] == pytest.approx(twin[rg["against"]]["ttft_mean_ms"] - twin["cache_aware"]["ttft_mean_ms"], abs=1e-3)
    miss = abs(tw["predicted_ms"] - rg["measured_ms"])
    assert tw["within"] == (miss <= 0.25 * abs(rg["measured_ms"]))
    assert tw["within_ci"] == (miss <= max(0.25 * abs(rg["measured_ms"]), rg["measured_ci95_ms"]))
    assert tw["sign_right"] == ((tw["predicted_ms"] > 0) == (rg["measured_ms"] > 0))
    sm = rep["summary"]["regret"]["twin"]
    worst = sm.pop("worst_miss", None)
    assert sm.pop("verdict_right") == int(tw["verdict_right"]) and sm.pop("measured_ties") == int(tw["measured_verdict"] == "tie")
    assert sm.pop("verdict_text").startswith("its verdict (cache_aware saves, ties or costs")
    assert sm == {"runs": 1, "within_25pct": int(tw["within"]), "within_25pct_or_ci95": int(tw["within_ci"]),
                  "sign_right": int(tw["sign_right"]), "cells": 1, "cells_within_25pct": int(tw["within"])}
    assert (worst is None) == tw["within"]  # a miss of the band is named, with its share of the mean TTFT
    if worst is not None:
        assert worst["miss_ms"] == tw["miss_ms"] and worst["miss_of_ttft"] == tw["miss_of_ttft"]
    assert ", twin " in c["verdict"]
    # saves / tie / costs: the twin's and the arms', each against its own interval
    from mesh.lab.sim.twin import verdict
    assert tw["verdict"] == verdict(tw["predicted_ms"], tw["twin_ci95_ms"])
    assert tw["measured_verdict"] == verdict(rg["measured_ms"], rg.get("measured_ci95_ms"))
    assert tw["verdict_right"] == (tw["verdict"] == tw["measured_verdict"])
    # a twin described 1.5x too fast, fitted to the subject arm's mean TTFT and TPOT: it finds
    # the arms' engine again (speeds ~1/1.5 of where it started) and its figure with it
    fitted = text.replace("twin = true", "twin = true\ntwin_engine_error = 1.5\ntwin_fit = true")
    rep2 = json.loads(dumps_matrix(run_matrix(load_matrix(_write(tmp_path, fitted, "fit.toml"), seeds=[1]), jobs=1)))
    run2 = rep2["cells"][0]["seeds"]["1"]
    fit = run2["twin_fit"]
    assert fit["converged"] and fit["ttft_ratio"] == pytest.approx(1.0, abs=0.021)
    assert fit["prefill_speed"] == pytest.approx(1 / 1.5, rel=0.2) and fit["decode_speed"] == pytest.approx(1 / 1.5, rel=0.1)
    assert run2["arms"] == run["arms"]  # the arms are the fleet: untouched
    assert rep2["summary"]["regret"]["twin_fit"]["runs"] == 1 and rep2["summary"]["regret"]["twin_fit"]["engine_error"] == 1.5
    assert rep2["cells"][0]["seeds"]["1"]["analysis"]["regret"]["twin"]["predicted_ms"] == pytest.approx(
        tw["predicted_ms"], abs=max(0.25 * abs(tw["predicted_ms"]), tw["twin_ci95_ms"] or 0, 2.0))
    # replicas = 3, twin_draws = 2: the measured difference is the mean of the arms and two more
    # independent runs of cache_aware and both baselines; the twin's, the mean of two draws
    mc3 = load_matrix(_write(tmp_path, text.replace("twin = true", "twin = true\nreplicas = 3\ntwin_draws = 2"), "rep.toml"),
                      seeds=[1])
    rep3 = json.loads(dumps_matrix(run_matrix(mc3, jobs=1)))
    run3 = rep3["cells"][0]["seeds"]["1"]
    assert run3["arms"] == run["arms"] and run3["twin"] == run["twin"]  # the first run and draw are the plain ones
    assert len(run3["replicas"]) == 2 and len(run3["twin_draws"]) == 1
    for r in run3["replicas"]:  # the subject and baselines only, on their own draws and names
        assert [a["policy"] for a in r] == ["cache_aware", "power_of_two", "cache_aware_greedy"]
        assert {a["policy"]: a for a in r}["power_of_two"]["ttft_mean_ms"] != arms["power_of_two"]["ttft_mean_ms"]
    means = {p: (arms[p]["ttft_mean_ms"] + sum({a["policy"]: a for a in r}[p]["ttft_mean_ms"] for r in run3["replicas"])) / 3
             for p in ("cache_aware", "power_of_two", "cache_aware_greedy")}
    rg3 = run3["analysis"]["regret"]
    best = min(("power_of_two", "cache_aware_greedy"), key=means.__getitem__)
    assert rg3["against"] == best and rg3["replicas"] == 3
    assert rg3["measured_ms"] == pytest.approx(means[best] - means["cache_aware"], abs=2e-3)
    t2 = {a["policy"]: a["ttft_mean_ms"] for a in run3["twin_draws"][0]}
    want = (twin[best]["ttft_mean_ms"] - twin["cache_aware"]["ttft_mean_ms"] + t2[best] - t2["cache_aware"]) / 2
    assert rg3["twin"]["predicted_ms"] == pytest.approx(want, abs=2e-3) and rg3["twin"]["draws"] == 2
    sm3 = rep3["summary"]["regret"]
    assert sm3["replicas"] == 3 and sm3["twin_draws"] == 2 and "the mean of 3 independent runs" in sm3["replication"]
    tw3 = rg3["twin"]
    assert tw3["miss_ms"] == pytest.approx(abs(tw3["predicted_ms"] - rg3["measured_ms"]), abs=2e-3)
    assert tw3["miss_of_ttft"] == pytest.approx(tw3["miss_ms"] / means["cache_aware"], rel=1e-3)
    if not tw3["within"]:  # the summary names the largest miss of the band, beside the mean TTFT
        assert sm3["twin"]["worst_miss"]["miss_ms"] == tw3["miss_ms"]
    # the miss in units of both sides' own spread: Student's t on 3 + 2 - 2 degrees of freedom
    import statistics

    sets = [run3["arms"], *run3["replicas"]]
    md = [{a["policy"]: a["ttft_mean_ms"] for a in r}[best] - {a["policy"]: a["ttft_mean_ms"] for a in r}["cache_aware"] for r in sets]
    td = [twin[best]["ttft_mean_ms"] - twin["cache_aware"]["ttft_mean_ms"], t2[best] - t2["cache_aware"]]
    se = (statistics.variance(md) / 3 + statistics.variance(td) / 2) ** 0.5
    assert tw3["z"] == {"t": pytest.approx((statistics.mean(td) - statistics.mean(md)) / se, abs=1e-3), "df": 3}
    # --rejudge: the runs of that report judged again by this code, nothing simulated: the same report
    saved = _write(tmp_path, dumps_matrix(rep3), "rep3.json")
    assert json.loads(dumps_matrix(rejudge(mc3, saved))) == rep3
    other = load_matrix(_write(tmp_path, text.replace("twin = true", "twin = true\nreplicas = 2"), "rep2.toml"), seeds=[1])
    with pytest.raises(ConfigError, match=r"rejudge: .* is not a run of .* \(its replicas differ\)"):
        rejudge(other, saved)
    with pytest.raises(ConfigError, match="rejudge: cannot read"):
        rejudge(mc3, tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="matrix.twin"):
        load_matrix(_write(tmp_path, text.replace("twin = true", "twin = 1"), "bad.toml"))
    with pytest.raises(ConfigError, match="matrix.twin"):
        load_matrix(_write(tmp_path, text.replace("twin = true", "twin = true\nsubject = 'cache_aware_greedy'\n"
                                                  "baselines = ['power_of_two', 'cache_aware']"), "bad2.toml"))


def test_extend_completes_an_earlier_run_to_the_report_of_a_fresh_one(tmp_path):
    """``--extend``: a report run with 2 replicas and 2 twin draws, completed to 3 and 3, keeps
    its runs, runs only the missing draws and equals the report of a fresh run with 3 and 3 (also
    from seed shards, through the CLI); a report with more draws than the matrix, or of another
    matrix, or a forged one is refused by name."""
    base = TINY.replace("load = [0.5, 1.0]", "load = 1.0")
    small = _write(tmp_path, base.replace("[matrix]\n", "[matrix]\ntwin = true\nreplicas = 2\ntwin_draws = 2\n"), "small.toml")
    big = _write(tmp_path, base.replace("[matrix]\n", "[matrix]\ntwin = true\nreplicas = 3\ntwin_draws = 3\n"), "big.toml")
    old = tmp_path / "old.json"
    old.write_text(dumps_matrix(run_matrix(load_matrix(small), jobs=1)))
    fresh = json.loads(dumps_matrix(run_matrix(load_matrix(big), jobs=1)))
    todo: list[int] = []
    done: list[tuple[int, int]] = []
    got = extend(load_matrix(big), old, on_start=todo.append, on_cell=lambda c, r, w: done.append((c.id, r["seed"])))
    assert json.loads(dumps_matrix(got)) == fresh
    assert todo == [2] and sorted(done) == [(0, 1), (0, 3)]
    # kept, not rerun: a forged arm in the earlier report survives into the completed one
    forged = json.loads(old.read_text())
    forged["cells"][0]["seeds"]["1"]["arms"][0]["ttft_mean_ms"] = 12345.0
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    kept = extend(load_matrix(big), tmp_path / "forged.json")
    assert kept["cells"][0]["seeds"]["1"]["arms"][0]["ttft_mean_ms"] == 12345.0
    # a complete report runs nothing: it is judged as it is
    (tmp_path / "fresh.json").write_text(dumps_matrix(fresh))
    todo.clear()
    assert json.loads(dumps_matrix(extend(load_matrix(big), tmp_path / "fresh.json", on_start=todo.append))) == fresh
    assert todo == [0]
    # seed shards, through the CLI
    s1, s3, out = tmp_path / "s1.json", tmp_path / "s3.json", tmp_path / "out.json"
    s1.write_text(dumps_matrix(run_matrix(load_matrix(small, seeds=[1]), jobs=1)))
    s3.write_text(dumps_matrix(run_matrix(load_matrix(small, seeds=[3]), jobs=1)))
    args = _parser().parse_args(["sim", "--matrix", str(big), "--extend", str(s1), str(s3), "--jobs", "2",
                                 "--no-progress", "--json", str(out)])
    assert args.func(args) == 0 and json.loads(out.read_text()) == fresh
    # refused by name
    with pytest.raises(ConfigError, match=r"extend: .*fresh.json has 3 replicas, more than .*small.toml's 2"):
        extend(load_matrix(small), tmp_path / "fresh.json")
    other = _write(tmp_path, big.read_text().replace("max_requests = 100", "max_requests = 90"), "other.toml")
    with pytest.raises(ConfigError, match=r"extend: .*old.json is not a run of .*other.toml as it is now \(its cells differ\)"):
        extend(load_matrix(other), old)
    forged["cells"][0]["seeds"]["3"]["stream"]["fingerprint"] = "0" * 16  # another stream: refused, not completed
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    with pytest.raises(ConfigError, match=r"extend: cell 'zipf L1 W2 R2' seed 3: the earlier run's stream is not this matrix's"):
        extend(load_matrix(big), tmp_path / "forged.json")
    del forged["cells"][0]["seeds"]["3"]["twin"]
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    with pytest.raises(ConfigError, match=r"extend: the run of cell 0 seed 3 in .*forged.json is broken or incomplete"):
        extend(load_matrix(big), tmp_path / "forged.json")
    args = _parser().parse_args(["sim", "--matrix", str(big), "--extend", str(old), "--rejudge", str(old)])
    with pytest.raises(ConfigError, match=r"extend: --rejudge judges reports as they are, --extend completes them"):
        args.func(args)


def test_the_twins_bias_is_judged_against_students_t():
    """The twin's standardised misses over the cell-seeds, beside what noise alone gives: Student's
    t (mean 0, variance df / (df - 2), the share beyond 2 from its tails)."""
    from mesh.lab.sim.matrix import _bias, bias_phrase
    from mesh.lab.sim.metrics import student_t_tail2

    assert student_t_tail2(2.0, 1) == pytest.approx(1 - 2 / math.pi * math.atan(2.0), abs=1e-6)  # Cauchy
    assert student_t_tail2(2.0, 6) == pytest.approx(0.0924, abs=1e-4)
    assert student_t_tail2(1.96, 100_000) == pytest.approx(0.05, abs=1e-4)  # the normal's
    b = _bias([{"t": x, "df": 6} for x in (-2.5, -1.0, 0.0, 0.5, 1.0, 3.0)])
    assert b["runs"] == 6 and b["mean"] == pytest.approx(1.0 / 6, abs=1e-3) and b["beyond_2"] == 2
    assert b["variance_expected"] == 1.5 and b["beyond_2_expected"] == pytest.approx(6 * 0.0924, abs=0.05)
    assert b["mean_se"] == pytest.approx((1.5 / 6) ** 0.5, abs=1e-3)
    # 2 runs a side: 2 degrees of freedom, where t has no variance; the share beyond 2 is still judged
    b2 = _bias([{"t": x, "df": 2} for x in (-3.0, 0.5, 1.0)])
    assert b2["variance_expected"] is None and b2["mean_se"] is None and b2["beyond_2"] == 1
    assert b2["beyond_2_expected"] == pytest.approx(3 * 0.1835, abs=0.05)
    assert "variance" not in bias_phrase(b2) and json.dumps(b2, allow_nan=False)
