"""`mesh bench http --profile`: py-spy's raw stacks summarised (pure), the targets against the Rust
router, the report's profile table, and one real sample of a busy process when py-spy can attach."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from mesh.lab.bench.http_bench import cpu_budget, evaluate_targets
from mesh.lab.bench.profile import Sampler, py_spy_path, summarize_raw
from mesh.lab.report import render, to_markdown

RAW = """\
<module> (mesh/cli.py:3);run (mesh/aio.py:10);_pump (brokers/broker.py:100);send_frames (mesh/sockets.py:40) 30
<module> (mesh/cli.py:3);run (mesh/aio.py:10);_pump (brokers/broker.py:100);choose (mesh/routing/cache_policies.py:9) 10
<module> (mesh/cli.py:3);run (mesh/aio.py:10);_run (brokers/ingress/http1.py:5) 60
garbage line without a count
"""


def test_summary_ranks_self_and_inclusive_and_counts_bad_lines():
    s = summarize_raw(RAW, top=3)
    assert s["samples"] == 100 and s["skipped_lines"] == 1
    assert s["self"][0] == {"frame": "_run (ingress/http1.py)", "pct": 60.0}
    assert s["self"][1] == {"frame": "send_frames (mesh/sockets.py)", "pct": 30.0}
    incl = {e["frame"]: e["pct"] for e in summarize_raw(RAW, top=10)["inclusive"]}
    assert incl["_pump (brokers/broker.py)"] == 40.0 and incl["_run (ingress/http1.py)"] == 60.0
    assert "run (mesh/aio.py)" not in incl and "<module> (mesh/cli.py)" not in incl  # the trunk: on every stack
    assert summarize_raw("", top=3) == {"samples": 0, "skipped_lines": 0, "self": [], "inclusive": []}


def test_the_trunk_stops_where_stacks_part_and_ignores_other_threads():
    raw = ("main (a.py:1);loop (b.py:2);work (c.py:3) 5\n"
           "main (a.py:1);loop (b.py:2) 3\n"  # the loop's own C code: loop is trunk, samples end there
           "main (a.py:1);loop (b.py:2);idle (d.py:4) 2\n"
           "thread_main (t.py:1);spin (t.py:2) 4\n")  # another thread, fewer samples
    incl = {e["frame"]: e["pct"] for e in summarize_raw(raw, top=10)["inclusive"]}
    assert "main (a.py)" not in incl and "loop (b.py)" not in incl
    assert incl["work (c.py)"] == pytest.approx(35.7) and incl["thread_main (t.py)"] == pytest.approx(28.6)


def _cell(arm, c, rps, p50, p99, path_us):
    return {"arm": arm, "c": c, "rps": rps, "p50_ms": p50, "p99_ms": p99, "max_ms": p99 * 2,
            "cpu_us_per_req": {"loadgen": 10.0, "router": path_us, "adapters": None, "engines": 5.0, "path": path_us}}


def test_targets_against_the_rust_router_in_the_same_run():
    cells = [_cell("sglang_router", 64, 6000, 9, 16, 100), _cell("broker_adapters", 64, 3000, 20, 70, 400),
             _cell("broker_zmq", 64, 9500, 6, 12, 200), _cell("sglang_router", 1, 800, 1.2, 2, 100),
             _cell("broker_adapters", 1, 500, 1.6, 3, 400)]
    rows = {(r["name"], r["c"]): r for r in evaluate_targets(cells, [1, 64])}
    assert rows[("full path req/s / sglang_router req/s", 64)]["value"] == 0.5
    assert rows[("full path req/s / sglang_router req/s", 64)]["result"] == "MISS"
    assert rows[("full path CPU per request / sglang_router's", 64)]["value"] == 4.0
    assert rows[("broker_zmq req/s / sglang_router req/s", 64)]["result"] == "PASS"  # 1.583 >= 1.5
    assert rows[("full path p50 - sglang_router p50", 1)]["value"] == pytest.approx(0.4)
    assert rows[("full path p50 - sglang_router p50", 1)]["result"] == "PASS"
    assert rows[("full path p99 / p50", 64)]["target"] == 3.0 and rows[("full path p99 / p50", 64)]["result"] == "MISS"
    # without the Rust arm those rows cannot be judged
    alone = {(r["name"], r["c"]): r["result"] for r in evaluate_targets(cells[1:3], [64])}
    assert alone[("full path req/s / sglang_router req/s", 64)] == "n/a"


def test_the_cpu_budget_says_what_path_cpu_would_match_the_rust_router():
    # Rust: 6000 req/s x (10 + 5 + 100) us = 0.69 cores; mesh: 3000 x (10 + 5 + 400) = 1.245 cores busy
    cells = [_cell("sglang_router", 64, 6000, 9, 16, 100), _cell("broker_adapters", 64, 3000, 20, 70, 400),
             _cell("direct", 64, 20000, 1, 2, 0), _cell("broker_zmq", 1, 500, 1, 2, 50)]
    cells[2]["cpu_us_per_req"]["engines"] = None  # an arm without every figure is left out
    cells.append(_cell("direct", 1, 5000, 0.2, 0.3, 0))  # and one without a path
    rows = {(r["arm"], r["c"]): r for r in cpu_budget(cells, [1, 64])}
    assert set(rows) == {("sglang_router", 64), ("broker_adapters", 64), ("broker_zmq", 1)}
    full = rows[("broker_adapters", 64)]
    assert full["total_us"] == 415.0 and full["cores_busy"] == pytest.approx(1.245)
    # with 1.245 cores at 6000 req/s: 207.5 us a request, of which load generator and engines take 15
    assert full["match_path_us"] == pytest.approx(192.5) and full["path_over_match"] == pytest.approx(2.078, abs=1e-3)
    # 1.5x the Rust router's req/s: 1.245 cores at 9000 req/s leave 138.3 us, 123.3 after the load generator and engines
    assert full["path_us_at_1_5x"] == pytest.approx(123.3)
    assert rows[("sglang_router", 64)]["match_path_us"] is None  # not judged against itself
    assert rows[("broker_zmq", 1)]["match_path_us"] is None  # no Rust arm at c=1
    # a starved arm: the load generator and engines alone cost more than the Rust router's rate allows
    starved = _cell("broker_zmq", 64, 100, 5, 9, 50)
    starved["cpu_us_per_req"]["loadgen"] = 5000.0
    (row,) = cpu_budget([cells[0], starved], [64])[1:]
    assert row["match_path_us"] is None and row["path_over_match"] is None


def test_the_console_summary_prints_the_cpu_budget():
    from io import StringIO

    from rich.console import Console

    from mesh.lab.bench.http_bench import print_results

    cells = [_cell("sglang_router", 64, 6000, 9, 16, 100), _cell("broker_adapters", 64, 3000, 20, 70, 400)]
    for c in cells:
        c.update(errors=0)
        c["cpu_us_per_req"].update(gateways=None)
    res = {"config": {"concurrency": [64], "seconds": 5, "path": "/generate", "stream": False, "max_new_tokens": 8,
                      "loadgen": "python", "log_dir": "logs"}, "machine": {"cpus": 2},
           "arms": {"broker_adapters": {"status": "ok"}, "sglang_router": {"status": "ok"}}, "cells": cells,
           "targets": evaluate_targets(cells, [64]), "budget": cpu_budget(cells, [64])}
    out = StringIO()
    print_results(res, Console(file=out, width=200))
    assert "CPU budget broker_adapters c=64: 1.25 cores busy; path 400 us/req, 192 us/req would match" in out.getvalue()


def test_the_report_page_shows_the_cpu_budget():
    cells = [_cell("sglang_router", 64, 6000, 9, 16, 100), _cell("broker_adapters", 64, 3000, 20, 70, 400)]
    data = {"bench": "http", "config": {"arms": ["broker_adapters", "sglang_router"], "concurrency": [64], "seconds": 5,
                                         "path": "/generate", "max_new_tokens": 8, "loadgen": "python"},
            "machine": {"cpus": 2, "cpus_usable": 2}, "cells": cells, "arms": {}, "targets": [],
            "budget": cpu_budget(cells, [64])}
    page = to_markdown(render("http", data, "bench/http.json"), src="bench/http.json", date="2026-12-05")
    assert "| broker_adapters | 64 | 3,000 | 10 µs | 5 µs | 400 µs | 415 µs | 1.25 | 192 µs | 2.08x |" in page
    assert "0.69-1.25 of the machine's 2 CPUs busy" in page and "would match (2.08x)" in page
    # broker_zmq's 1.5x target, reachable or not on this machine
    zmq = _cell("broker_zmq", 64, 5000, 9, 16, 150)
    data["cells"].append(zmq)
    data["budget"] = cpu_budget(data["cells"], [64])
    page = to_markdown(render("http", data, "bench/http.json"), src="bench/http.json", date="2026-12-05")
    assert "broker_zmq at 1.5x the Rust router's req/s would need a path of 77 µs per request (it spent 150)" in page
    zmq["cpu_us_per_req"]["loadgen"] = 300.0
    data["budget"] = cpu_budget(data["cells"], [64])
    page = to_markdown(render("http", data, "bench/http.json"), src="bench/http.json", date="2026-12-05")
    assert "broker_zmq cannot reach 1.5x the Rust router's req/s on this machine with any path" in page


def test_the_report_page_shows_profiles_and_missing_ones():
    cell = _cell("broker_zmq", 64, 9500, 6, 12, 200)
    cell["profile"] = {"router": {"pid": 1, "rate_hz": 100, **summarize_raw(RAW, top=3)},
                       "adapters": {"error": "py-spy is not installed"}}
    data = {"bench": "http", "config": {"arms": ["broker_zmq"], "concurrency": [64], "seconds": 5, "path": "/generate",
                                         "max_new_tokens": 8, "loadgen": "python", "profile": True, "log_dir": "/tmp/x"},
            "machine": {"cpus": 2}, "cells": [cell], "arms": {"broker_zmq": {"status": "ok"}}, "targets": []}
    page = to_markdown(render("http", data, "bench/http.json"), src="bench/http.json", date="2026-12-05")
    assert "`_run (ingress/http1.py)`" in page and "| 60.0 |" in page
    assert "no profile: py-spy is not installed" in page and "--profile" in page


def test_a_real_sample_of_a_busy_python_process(tmp_path):
    if py_spy_path() is None:
        pytest.skip("py-spy is not installed (the bench extra)")
    busy = subprocess.Popen([sys.executable, "-c", "def spin():\n    while True: pass\nspin()"])
    try:
        time.sleep(0.3)  # the interpreter is up (py-spy needs its symbols)
        s = Sampler({"router": busy.pid}, 1, tmp_path)
        s.start()
        out = s.finish()["router"]
    finally:
        busy.kill()
        busy.wait()
    if "error" in out:
        pytest.skip(f"py-spy cannot attach here: {out['error']}")
    assert out["samples"] > 0 and out["self"][0]["frame"].startswith("spin")


def test_without_py_spy_the_profile_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr("mesh.lab.bench.profile.py_spy_path", lambda: None)
    s = Sampler({"router": 1}, 1, tmp_path)
    s.start()
    assert s.finish() == {"router": {"error": "py-spy is not installed (pip install '.[bench]')"}}
