"""``mesh bench tokenize-load`` end to end with tiny settings: every phase runs against real processes
(broker with --http --tokenizer, instant workers, mesh gateway, the HTTP load generator) and the JSON
holds sane figures. The benchmark's numbers are not judged here (a shared machine), only that each
phase measured something real: probe answers, decisions in the broker's histogram, 200s on the
tokenised HTTP path with prompts that reached the workers as the tokenizer's ids."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("tokenizers", reason="needs the dev extra (tokenizers) for the builtin tokenizer")
pytest.importorskip("mistral_common", reason="needs the dev extra (mistral-common) for the builtin tokenizer")

from mesh.lab.bench.tokenize_load import evaluate_targets, hist_quantile, parse_metrics  # noqa: E402

PROMPT_TOKENS = 256


def test_hist_quantile_interpolates_inside_the_bucket():
    b = [(1e-4, 0.0), (2.5e-4, 50.0), (5e-4, 100.0), (float("inf"), 100.0)]
    assert hist_quantile(b, 0.5) == pytest.approx(2.5e-4)
    assert hist_quantile(b, 0.99) == pytest.approx(2.5e-4 + 2.5e-4 * 49 / 50)
    assert hist_quantile([(1e-4, 0.0), (float("inf"), 3.0)], 0.99) == pytest.approx(1e-4)  # +Inf: the highest bound
    assert hist_quantile([(1e-4, 0.0), (float("inf"), 0.0)], 0.99) is None


def test_parse_metrics_reads_the_broker_families():
    text = "\n".join([
        # what prometheus_client writes (text format 0.0.4: the TYPE line names the _total sample)
        "# TYPE mesh_requests_total counter", 'mesh_requests_total{outcome="ok"} 7.0',
        "# TYPE mesh_routed_prompt_tokens_total counter", "mesh_routed_prompt_tokens_total 123.0",
        "# TYPE mesh_decision_latency_seconds histogram",
        'mesh_decision_latency_seconds_bucket{le="0.0001"} 3.0', 'mesh_decision_latency_seconds_bucket{le="+Inf"} 4.0',
        "mesh_decision_latency_seconds_count 4.0", "mesh_decision_latency_seconds_sum 0.001", ""])
    m = parse_metrics(text)
    assert m["requests"] == {"ok": 7.0} and m["prompt_tokens"] == 123.0
    assert m["decision"]["count"] == 4.0 and m["decision"]["buckets"][-1] == (float("inf"), 4.0)


@pytest.mark.bench
def test_tokenize_load_tiny_run(tmp_path):
    out = tmp_path / "tl.json"
    cmd = [sys.executable, "-m", "mesh.cli", "bench", "tokenize-load", "--duration-s", "1", "--warmup-s", "0.3",
           "--http-concurrency", "2", "--prompt-tokens", str(PROMPT_TOKENS), "--probe-rate", "100", "--workers", "2",
           "--no-pin", "--log-dir", str(tmp_path / "logs"), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and "error" not in res
    assert set(res["phases"]) == {"idle", "embedded", "gateway", "control"}
    # the broker's ingress tokenised the prompt: the worker saw the tokenizer's ids (BOS included)
    assert res["config"]["prompt_ids_sent"] in (PROMPT_TOKENS, PROMPT_TOKENS + 1)
    assert res["embedded_check"]["usage"]["prompt_tokens"] == res["config"]["prompt_ids_sent"]
    assert res["gateway_check"]["usage"]["prompt_tokens"] == res["config"]["prompt_ids_sent"]
    for name, ph in res["phases"].items():
        assert ph["probe"]["ok"] > 0 and not ph["probe"]["errors"], (name, ph["probe"])
        assert 0 < ph["probe"]["p50_ms"] <= ph["probe"]["p99_ms"] < 5000, (name, ph["probe"])
        d = ph["decision"]
        assert d["count"] >= ph["probe"]["ok"] and 0 < d["mean_us"] < 1e5 and d["p99_us"] > 0, (name, d)
        assert ph["cpu_s"]["broker"] is not None and ph["broker_cpu_us_per_probe"] > 0, name
        assert ph["loop_lag"]["status_samples"] > 0 and ph["loop_lag"]["pumps"] > 0, name
    assert res["phases"]["idle"]["http"]["requests"] == 0
    for name in ("embedded", "gateway", "control"):
        h = res["phases"][name]["http"]
        assert h["requests"] > 0 and h["prompt_tokens_per_s"] > 0, (name, h)
        # counted from the broker's own counters: the requests it routed carried the prompt's ids
        assert h["tokens_per_request"] == pytest.approx(res["config"]["prompt_ids_sent"], rel=0.05), (name, h)
    for name in ("embedded", "gateway"):
        lg = res["phases"][name]["loadgen"]
        assert lg["ok_2xx"] > 0 and lg["errors"] == 0, (name, lg)  # the tokenised HTTP path served 200s
    assert res["phases"]["gateway"]["cpu_s"]["gateway"] > 0
    rows = evaluate_targets(res["phases"])
    assert {r["result"] for r in rows if r["limit"] is not None} <= {"PASS", "MISS"}
    assert any(r["name"] == "decision p99 / idle" and r["phase"] == "embedded" for r in rows)
