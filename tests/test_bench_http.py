"""``mesh bench http``: a small real run of three arms (the built-in load generator, so no wrk is
needed), the wrk report parser, one tiny real wrk run, the targets and the /proc CPU sampler."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from mesh.lab.bench.http_bench import evaluate_targets, run_http_bench
from mesh.lab.bench.http_load import parse_wrk, request_body, run_load, wrk_path
from mesh.lab.bench.proc_cpu import CpuSampler, cpu_seconds, descendants
from mesh.lab.procs import wait_for_log_event

# captured from `wrk -t 2 -c 4 -d 1s --latency` (wrk 4.1.0) against mesh instant-engine, with the
# error lines wrk adds when there are errors
WRK_SAMPLE = """Running 1s test @ http://127.0.0.1:46609/generate
  2 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   296.28us  557.91us   4.86ms   92.71%
    Req/Sec    12.02k     4.47k   23.48k    61.90%
  Latency Distribution
     50%  145.00us
     75%  211.00us
     90%  377.00us
     99%    3.15ms
  25111 requests in 1.10s, 6.32MB read
  Socket errors: connect 0, read 3, write 1, timeout 2
  Non-2xx or 3xx responses: 7
Requests/sec:  22830.94
Transfer/sec:      5.75MB
"""


@pytest.mark.bench
def test_three_arms_small_run_with_the_python_load_generator(tmp_path):
    t0 = time.monotonic()
    res = run_http_bench(arms=["direct", "broker_zmq", "broker_adapters"], concurrency=[1, 4], seconds=1.0, warmup_s=0.3,
                         loadgen="python", log_dir=tmp_path / "logs", say=lambda m: None)
    assert res["ok"], res["arms"]
    assert {a: v["status"] for a, v in res["arms"].items()} == dict.fromkeys(("direct", "broker_zmq", "broker_adapters"), "ok")
    roles = {"direct": {"loadgen", "engines"}, "broker_zmq": {"loadgen", "router", "engines"},
             "broker_adapters": {"loadgen", "router", "adapters", "engines"}}
    cells = {(c["arm"], c["c"]): c for c in res["cells"]}
    assert set(cells) == {(a, c) for a in roles for c in (1, 4)}
    for (arm, c), cell in cells.items():
        assert cell["loadgen"] == "python"
        assert cell["requests"] > 0 and cell["rps"] > 0, cell
        assert cell["errors"] == 0, cell
        assert 0 < cell["p50_ms"] <= cell["p99_ms"] <= cell["max_ms"], cell
        us = cell["cpu_us_per_req"]
        for role in ("loadgen", "router", "adapters", "engines"):
            if role in roles[arm]:
                assert isinstance(us[role], float) and us[role] >= 0, (arm, c, role, us)
            else:
                assert us[role] is None, (arm, c, role, us)
        assert us["path"] == pytest.approx(sum(us[r] or 0.0 for r in ("router", "adapters")), abs=0.2)
    assert cells[("broker_adapters", 4)]["processes"] == {"router": 1, "adapters": 4, "engines": 4}
    # the adapters' probes reached the engines; every proxied request is a /generate
    assert res["arms"]["broker_adapters"]["engine_paths"]["/server_info"] >= 4
    names = {(r["name"], r["c"]): r for r in res["targets"]}
    assert names[("full path req/s / direct req/s", 1)]["result"] in ("PASS", "MISS")
    assert names[("full path req/s / direct req/s", 4)]["result"] == "info"  # no target at c=4
    assert names[("broker_zmq router CPU per request", 4)]["value"] is not None
    assert res["machine"]["cpus"] == os.cpu_count() and res["config"]["loadgen"] == "python"
    assert time.monotonic() - t0 < 90


def test_an_arm_that_does_not_serve_the_path_is_skipped(tmp_path):
    res = run_http_bench(arms=["direct"], concurrency=[1], seconds=1.0, warmup_s=0, path="/v1/chat/completions",
                         loadgen="python", log_dir=tmp_path, say=lambda m: None)
    assert res["arms"]["direct"]["status"] == "skipped" and "/v1/chat/completions" in res["arms"]["direct"]["reason"]
    assert res["cells"] == [] and res["ok"]


def test_wrk_parser_on_a_captured_report():
    r = parse_wrk(WRK_SAMPLE)
    assert r["requests"] == 25111 and r["seconds"] == pytest.approx(1.10) and r["rps"] == pytest.approx(22830.94)
    assert r["p50_ms"] == pytest.approx(0.145) and r["p99_ms"] == pytest.approx(3.15) and r["max_ms"] == pytest.approx(4.86)
    assert r["error_detail"] == {"connect": 0, "read": 3, "write": 1, "timeout": 2, "status": 7} and r["errors"] == 13
    clean = parse_wrk(WRK_SAMPLE.replace("  Socket errors: connect 0, read 3, write 1, timeout 2\n", "")
                      .replace("  Non-2xx or 3xx responses: 7\n", "").replace("3.15ms", "1.02s"))
    assert clean["errors"] == 0 and clean["p99_ms"] == pytest.approx(1020.0)
    with pytest.raises(ValueError):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused")


@pytest.mark.skipif(wrk_path() is None, reason="wrk is not on PATH")
def test_a_tiny_real_wrk_run_against_the_instant_engine(procs):
    p = procs.spawn("engine", ["instant-engine", "--port", "0"])
    url = wait_for_log_event(p.log_path, "instant_engine_listening", 30, p.popen)["url"]
    for stream in (False, True):
        r = run_load(url + "/generate", request_body("/generate", stream=stream), 2, 1, warmup_s=0, loadgen="wrk",
                     roles={"engines": [p.pid]}, stream=stream)
        assert r["loadgen"] == "wrk" and r["requests"] > 0 and r["errors"] == 0, r["raw"]
        assert r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] and r["loadgen_cpu_s"] > 0
        assert r["cpu_s"]["engines"] >= 0


def _cell(arm, c, rps, p50, p99, mx, router=None, adapters=None):
    path = (router or 0) + (adapters or 0)
    return {"arm": arm, "c": c, "rps": rps, "p50_ms": p50, "p99_ms": p99, "max_ms": mx,
            "cpu_us_per_req": {"loadgen": 10.0, "router": router, "adapters": adapters, "engines": 5.0, "path": path}}


def test_targets_pass_miss_and_missing_arms():
    cells = [_cell("direct", 1, 10000, 0.1, 0.2, 2), _cell("direct", 64, 40000, 1.5, 3, 9),
             _cell("broker_adapters", 1, 3000, 0.8, 1.6, 20, 200, 150), _cell("broker_adapters", 64, 10000, 6, 20, 40, 150, 100),
             _cell("broker_zmq", 1, 5000, 0.3, 0.5, 3, 260), _cell("broker_zmq", 64, 15000, 4, 8, 12, 240)]
    rows = {(r["name"], r["c"]): r for r in evaluate_targets(cells, [1, 64])}
    assert rows[("full path req/s / direct req/s", 1)]["value"] == 0.3 and rows[("full path req/s / direct req/s", 1)]["result"] == "PASS"
    assert rows[("full path req/s / direct req/s", 64)]["result"] == "MISS"  # 0.25 < 0.32
    assert rows[("full path p99 / p50", 1)]["result"] == "PASS" and rows[("full path p99 / p50", 64)]["result"] == "MISS"
    assert rows[("full path max latency", 1)]["result"] == "PASS" and rows[("full path p50", 1)]["result"] == "PASS"
    assert rows[("broker_zmq router CPU per request", 1)]["result"] == "MISS"
    assert rows[("broker_zmq router CPU per request", 64)]["result"] == "PASS"
    assert rows[("full path CPU per request (router + adapters)", 64)]["value"] == 250
    assert all(r["sglang_router"] is None for r in rows.values())  # that arm did not run
    none = {(r["name"], r["c"]): r["result"] for r in evaluate_targets(cells[:2], [1])}
    assert set(none.values()) == {"n/a"}


def test_the_tokenised_gateway_arm_is_a_target_row_against_the_full_path():
    gw = _cell("gateway_tokenized", 64, 6000, 8, 20, 40, 150, 100)
    gw["cpu_us_per_req"]["gateways"] = 900.0
    cells = [_cell("broker_adapters", 64, 10000, 6, 20, 40, 150, 100), gw, _cell("gateway_tokenized", 1, 500, 2, 3, 4)]
    rows = {(r["name"], r["c"]): r for r in evaluate_targets(cells, [1, 64])}
    name = "tokenised via 2 gateways req/s / full path req/s (200s)"
    assert rows[(name, 64)]["value"] == 0.6 and rows[(name, 64)]["result"] == "PASS" and rows[(name, 64)]["target"] == 0.5
    assert rows[(name, 1)]["result"] == "n/a"  # no full path cell at c=1
    gw["ok_rps"] = 4000  # the 200s count, not the refusals
    assert {(r["name"], r["c"]): r for r in evaluate_targets(cells, [64])}[(name, 64)]["result"] == "MISS"


def test_the_attached_arm_has_its_own_target_rows_beside_the_full_path():
    cells = [_cell("sglang_router", 64, 8000, 7, 14, 30, 90), _cell("sglang_router", 1, 1000, 0.9, 1.5, 5, 90),
             _cell("broker_adapters", 64, 4000, 15, 40, 60, 150, 150), _cell("broker_attached", 64, 9000, 6, 15, 30, 120),
             _cell("broker_attached", 1, 900, 1.2, 3.5, 9, 200)]
    rows = {(r["name"], r["c"]): r for r in evaluate_targets(cells, [1, 64])}
    assert rows[("attached path req/s / sglang_router req/s", 64)]["value"] == 1.125
    assert rows[("attached path req/s / sglang_router req/s", 64)]["result"] == "PASS"
    assert rows[("attached path CPU per request / sglang_router's", 64)]["value"] == 1.333
    assert rows[("attached path p99 / p50", 1)]["result"] == "MISS" and rows[("attached path p99 / p50", 64)]["result"] == "PASS"
    assert rows[("attached path p50 - sglang_router p50", 1)]["value"] == 0.3
    assert rows[("attached path req/s / full path req/s", 64)]["value"] == 2.25
    assert rows[("attached path req/s / full path req/s", 1)]["result"] == "n/a"  # no full path cell at c=1
    assert rows[("attached path CPU per request (router)", 64)]["value"] == 120
    # the full path's own rows are unchanged: still on broker_adapters
    assert rows[("full path req/s / sglang_router req/s", 64)]["value"] == 0.5
    assert rows[("full path CPU per request / sglang_router's", 64)]["value"] == 3.333


@pytest.mark.bench
def test_the_attached_arm_small_run(tmp_path):
    res = run_http_bench(arms=["broker_attached"], concurrency=[4], seconds=1.0, warmup_s=0.3, loadgen="python",
                         log_dir=tmp_path / "logs", say=lambda m: None)
    assert res["ok"] and res["arms"]["broker_attached"]["status"] == "ok", res["arms"]
    cell = res["cells"][0]
    assert cell["errors"] == 0 and cell["requests"] > 0
    assert cell["processes"] == {"router": 1, "engines": 4}  # no adapter processes
    assert cell["cpu_us_per_req"]["adapters"] is None and cell["cpu_us_per_req"]["path"] == cell["cpu_us_per_req"]["router"]
    assert res["arms"]["broker_attached"]["engine_paths"]["/server_info"] >= 4  # the in-broker adapters' discovery


@pytest.mark.bench
def test_the_tokenised_gateway_arm_small_run(tmp_path):
    res = run_http_bench(arms=["gateway_tokenized"], concurrency=[4], seconds=1.0, warmup_s=0.3, loadgen="python",
                         path="/v1/chat/completions", tokenizer="builtin", prompt_tokens=200, log_dir=tmp_path / "logs",
                         say=lambda m: None)
    assert res["ok"] and res["arms"]["gateway_tokenized"]["status"] == "ok", res["arms"]
    cell = res["cells"][0]
    assert cell["errors"] == 0 and cell["requests"] > 0
    assert cell["processes"] == {"router": 1, "adapters": 4, "engines": 4, "gateways": 1}  # the supervisor (2 below it)
    us = cell["cpu_us_per_req"]
    assert us["gateways"] > 0 and us["path"] == pytest.approx(us["gateways"] + us["router"] + us["adapters"], abs=0.3)
    # without a tokenizer the arm is skipped, saying why
    res = run_http_bench(arms=["gateway_tokenized"], concurrency=[1], seconds=1.0, warmup_s=0, loadgen="python",
                         log_dir=tmp_path / "l2", say=lambda m: None)
    assert res["arms"]["gateway_tokenized"]["status"] == "skipped" and "--tokenizer" in res["arms"]["gateway_tokenized"]["reason"]


def test_proc_cpu_covers_threads_and_children():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert child.pid in descendants([os.getpid()])
        s = CpuSampler({"me": [os.getpid()]})
        s.start()
        import threading

        def spin():
            t_end = time.process_time() + 0.05
            while time.process_time() < t_end:
                pass

        th = threading.Thread(target=spin)
        th.start()
        th.join(10)
        t_end = time.process_time() + 0.05
        while time.process_time() < t_end:
            pass
        used = s.stop()["me"]
        assert used >= 0.05 and child.pid in s.roles["me"]
        pid_max = int(open("/proc/sys/kernel/pid_max").read())
        assert cpu_seconds(pid_max + 1) is None  # no such process
        assert math.isfinite(cpu_seconds(os.getpid()))
    finally:
        child.stdin.close()
        child.wait(10)
