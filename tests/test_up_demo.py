"""``mesh up`` for real: the path users run (HTTP -> broker -> ``mesh attach sglang`` -> stub
engines, driven by the official ``openai`` client), the whole two-part demo, and its cleanup."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mesh.lab.loadgen import LoadSpec, summarize
from mesh.lab.loadgen_http import prompt_text, run_http_load
from mesh.lab.up import _adapter_ok, _stop_procs, start_http_path

from conftest import run, wait_until

ENV = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}


def test_prompt_text_is_one_ascii_byte_per_token_and_keeps_shared_prefixes():
    a, b = prompt_text([1, 2, 3, 40_000]), prompt_text([1, 2, 3, 7])
    assert len(a.encode("utf-8")) == 4 and a.isascii() and a.isprintable()
    assert a[:3] == b[:3] and prompt_text([1, 2, 3, 40_000]) == a


def test_http_path_all_ok_with_cache_hits_and_ttft(procs):
    path = start_http_path(procs, 2, timeout_s=60)
    spec = LoadSpec(rate_rps=10, duration_s=3, groups=2, system_tokens=512, question_tokens=64, max_new_tokens=8, seed=3)
    out, wall = run(run_http_load(path.url, spec), 60)
    s = summarize(out, wall)
    assert s.requests >= 10 and s.ok == s.requests, s.errors
    assert all(o.ttft_s is not None and 0 < o.ttft_s <= o.e2e_s for o in out)
    assert all(o.prompt_tokens == 576 and o.completion_tokens == 8 for o in out)
    assert s.hit_rate > 0, s
    assert set(s.per_worker) <= set(path.worker_ids)  # the broker names the worker (x-mesh-worker)
    _stop_procs(path.adapters)
    ok = _adapter_ok(path.adapters, path.worker_ids)  # each adapter's own counter agrees
    assert sum(v or 0 for v in ok.values()) == s.ok, ok
    assert {w: d["requests"] for w, d in s.per_worker.items()} == {w: v for w, v in ok.items() if v}


@pytest.mark.soak  # the default run keeps its lighter relatives under the 10-minute budget
def test_up_runs_both_parts_and_writes_both_summaries(tmp_path: Path):
    out = tmp_path / "up.json"
    r = subprocess.run([sys.executable, "-m", "mesh.cli", "up", "--workers", "2", "--rate", "10", "--duration", "3",
                        "--groups", "2", "--system-tokens", "512", "--question-tokens", "64", "--max-new-tokens", "8",
                        "--json", str(out), "--log-dir", str(tmp_path / "logs")],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "part 1: the path users run" in r.stdout and "part 2: the ZeroMQ client path" in r.stdout
    d = json.loads(out.read_text())
    for part in ("http", "zmq"):
        p = d[part]
        assert p["requests"] > 0 and p["ok"] == p["requests"], (part, p)
        assert p["hit_rate"] > 0 and math.isfinite(p["ttft_p50_ms"]), (part, p)
    assert set(d["http"]["per_worker"]) == {"stub-0", "stub-1"}
    # the adapters served part 1 and the baseline pass (issue 30: power_of_two on the same first prompts)
    b = d["baseline"]
    assert b["policy"] == "power_of_two" and b["power_of_two"]["requests"] == b["requests"] > 0
    assert b["cache_aware"]["requests"] == b["requests"] and b["cache_aware"]["hit_rate"] > 0
    assert sum(w["adapter_requests_ok"] for w in d["http"]["per_worker"].values()) == d["http"]["ok"] + b["power_of_two"]["ok"]
    assert d["http"]["broker_ttft"]["count"] == d["http"]["requests"] and d["http"]["pace"]["offered_rps"] == 10
    assert "TTFT p50 / p99 (broker's histogram)" in r.stdout and "offered / achieved rate" in r.stdout
    assert "the hit rate in context" in r.stdout
    assert set(d["zmq"]["per_worker"]) <= {"worker-0", "worker-1"}


def _children(pid: int) -> list[int]:
    kids = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                stat = Path(f"/proc/{e}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(e))
    return kids


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_up_ctrl_c_during_load_stops_every_process(tmp_path: Path):
    p = subprocess.Popen([sys.executable, "-m", "mesh.cli", "up", "--workers", "2", "--rate", "5", "--duration", "120",
                          "--log-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                         start_new_session=True)
    try:
        lines = []
        for line in p.stdout:  # readiness: the part 1 banner is printed once all workers are healthy
            lines.append(line)
            if "part 1" in line:
                break
        # keep reading: a demo writing into a full pipe nobody reads would never reach its exit
        threading.Thread(target=p.stdout.read, daemon=True).start()
        kids = _children(p.pid)
        assert len(kids) == 6, (kids, lines)  # broker, the baseline broker (issue 30), 2 engines, 2 adapters
        p.send_signal(signal.SIGINT)
        assert p.wait(40) == 130
        try:  # reparented children are reaped by init asynchronously
            wait_until(lambda: all(_gone(k) for k in kids), 5, "every child reaped", step_s=0.05)
        except TimeoutError:
            raise AssertionError([k for k in kids if not _gone(k)]) from None
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def test_up_serve_is_one_consistent_fleet(tmp_path: Path):
    """Issue 30: --serve mixed SGLang stub engines and simulated workers under one model name (the
    simulated ones ignored response_format and stop): now every worker is an attached engine."""

    from mesh.client import Client

    p = subprocess.Popen([sys.executable, "-m", "mesh.cli", "up", "--serve", "--workers", "2", "--log-dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, start_new_session=True)
    try:
        frontend = None
        for line in p.stdout:
            if "ZeroMQ clients" in line:
                frontend = line.split()[2]
            if "serving" in line:
                break
        assert frontend is not None

        async def ids() -> set[str]:
            async with Client(frontend) as c:
                return {w["worker_id"] for w in (await c.status()).workers}

        assert run(ids(), 20) == {"stub-0", "stub-1"}
        p.send_signal(signal.SIGINT)
        assert p.wait(40) in (0, 130)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def test_demo_figures_broker_histogram_and_pace():
    """The figures the demo prints beside the client's TTFT (issue 30): the broker's own TTFT
    histogram between two scrapes, and whether the load generator kept its schedule."""
    from mesh.lab.loadgen import Pace
    from mesh.lab.up import histogram_figures

    def scrape(b: list[int]) -> str:
        les = ["0.05", "0.2", "1.0", "+Inf"]
        return "".join(f'mesh_ttft_seconds_bucket{{model="m",worker="w",le="{le}"}} {v}\n' for le, v in zip(les, b))

    f = histogram_figures(scrape([5, 10, 10, 10]), scrape([55, 105, 109, 110]), "mesh_ttft_seconds")
    assert f == {"count": 100, "p50_ms": 50.0, "p99_ms": 1000.0, "under_200ms": 0.95}
    assert histogram_figures(scrape([1, 1, 1, 1]), scrape([1, 1, 1, 1]), "mesh_ttft_seconds") is None
    kept = Pace(offered_rps=30, started=300, span_s=10.0, late_s=[0.001] * 300)
    behind = Pace(offered_rps=30, started=220, span_s=10.0, late_s=[0.3] * 220)
    assert not kept.lagging() and behind.lagging() and behind.achieved_rps == 22.0
