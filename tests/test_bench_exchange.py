"""``mesh bench exchange``: a whole small run through the CLI (real brokers, workers, background
load process): every probe is seen in A's exchange messages, with a positive, finite delay, for
both intervals, and the JSON holds both. A broken exchange (no message ever showing a probe)
makes every probe time out: the command exits 1 and the counts below fail."""

from __future__ import annotations

import json
import math

import pytest

from mesh.cli import main

PROBES = 30
TIMEOUT_S = 5.0


@pytest.mark.bench  # two arms of fresh processes, ~25 s on 2 cores: make test-bench
def test_exchange_bench_sees_every_probe_for_both_intervals(tmp_path):
    out = tmp_path / "exchange.json"
    rc = main(["bench", "exchange", "--intervals-ms", "0,5", "--rounds", "1", "--workers", "2", "--probes", str(PROBES),
               "--background-rate", "40", "--timeout-s", str(TIMEOUT_S), "--log-dir", str(tmp_path / "logs"),
               "--json", str(out)])
    res = json.loads(out.read_text())
    failed = [f for a in res["arms"] for f in a["failed"]]
    assert rc == 0 and res["ok"], failed
    assert set(res["by_interval"]) == {"0", "5"}
    assert [a["interval_ms"] for a in res["arms"]] == [0.0, 5.0]
    for a in res["arms"]:
        assert a["probes"] == a["seen"] == a["ok"] == PROBES, (a["interval_ms"], a["failed"])
        delays = [r["delay_ms"] for r in a["records"]]
        assert len(delays) == PROBES
        assert all(math.isfinite(d) and 0 < d < TIMEOUT_S * 1000 for d in delays), delays
        s = a["delay_ms"]
        assert 0 < s["p50"] <= s["p99"] <= s["max"] < TIMEOUT_S * 1000
        # every probe was answered; the background ran through B and B published as it went
        assert all(r["finish_reason"] for r in a["records"])
        assert a["background"]["ok"] > 0 and not a["background"]["errors"]
        assert a["exchange_window"]["b"].get("sent_changes", 0) > 0
        assert a["exchange_window"]["a"].get("applied", 0) > 0  # A ingested B's messages
        assert a["messages_from_a_in_window"]["changes"] >= PROBES  # at least one change message per probe
    for key in ("0", "5"):
        s = res["by_interval"][key]
        assert s["ok"] == PROBES and math.isfinite(s["delay_ms"]["p50"]) and math.isfinite(s["delay_ms"]["p99"])
    assert set(res["ratios"]) == {"5/0"}
    assert all(v is not None and v > 0 for v in res["ratios"]["5/0"].values())
