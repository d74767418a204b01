"""The broker benchmark's harness and the instant workers: small real runs (not timed)."""

from __future__ import annotations

import asyncio
import os

import pytest

from mesh.lab.bench.broker_bench import run_broker_bench
from mesh.client import Client
from mesh.lab.up import wait_for_workers

from conftest import run

_START_MASK = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def test_instant_worker_process_serves_requests(procs):
    """``mesh worker-stub --instant``: registers, heartbeats in slices, answers at once."""
    b = procs.broker("b", "--heartbeat-ms", "100")
    procs.workers("w", [b.backend], "--instant", "--heartbeat-ms", "100", count=12)
    run(wait_for_workers(b.frontend, 12))

    async def body():
        async with Client(b.frontend) as c:
            for i in range(30):
                r = await c.generate(input_ids=[3, 1, 4, 1, 5], max_new_tokens=2, deadline_ms=5000)
                assert r.token_ids == [3, 1]
            # several liveness windows (3 x 100 ms) pass: a worker whose heartbeat slice never
            # went out would be expired by then (deliberate: the test is that time passes)
            await asyncio.sleep(0.8)
            st = await c.status(timeout_s=5)
            assert sum(1 for w in st.workers if w.get("healthy")) == 12

    run(body())


@pytest.mark.bench  # a whole (small) mesh bench broker run, ~8 s: make test-bench
def test_broker_bench_runs_both_arms_with_zero_errors():
    res = run_broker_bench(workers=4, seconds=0.5, concurrency=16, rounds=2, quiet=True)
    assert len(res["rounds"]) == 2
    for key in ("rps", "baseline_rps", "ratio", "p50_ms", "p99_ms", "rtt_p50_ms", "baseline_p50_ms"):
        assert key in res, key
    assert res["errors"] == 0
    assert res["rps"] > 0 and res["baseline_rps"] > 0
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
        pin = res["pinning"]  # the process under test on its own CPU, the harness on the others
        assert pin and set(pin["process_under_test"]).isdisjoint(pin["harness"])
    if _START_MASK is not None:
        assert os.sched_getaffinity(0) == _START_MASK  # the harness's pinning was undone
    # nearly every request came back, in every round
    assert all(r["latency_samples"] >= 0.9 * r["latency_rate_rps"] * 0.5 for r in res["rounds"])


def test_baseline_arm_answers_every_request_like_an_instant_worker(tmp_path):
    """The forwarder arm's workers decode each SUBMIT and answer with a client FINAL (same
    work as the instant workers), and the harness counts every one of those answers."""
    from mesh.lab.bench.broker_bench import _baseline_arm

    res = _baseline_arm(tmp_path, workers=4, concurrency=16, seconds=0.5, latency_rate=400)
    assert res["errors"] == 0 and res["rps"] > 0
    assert res["latency_samples"] == 200  # 400 req/s for 0.5 s, all answered
    assert res["p50_ms"] == res["p50_ms"]  # not NaN: round trips were recorded
