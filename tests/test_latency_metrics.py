"""TTFT, inter-token, end-to-end and queue histograms by model and worker (issue 17 part 4), scraped
from a real broker's /metrics after real requests through real simulated workers."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from mesh.client import Client
from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers

from conftest import run


def _scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:  # noqa: S310 - the test's own broker
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_request_latency_histograms_by_model_and_worker(procs):
    b = procs.broker("b", "--http", "127.0.0.1:0", "--heartbeat-ms", "200", "--policy", "round_robin")
    url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen)["url"]
    procs.workers("w", [b.backend], "--time-scale", "0.05", "--stream-interval", "1", count=2)
    run(wait_for_workers(b.frontend, 2))
    n, tokens = 6, 5

    async def body():
        chunks = 0
        async with Client(b.frontend) as c:
            for i in range(n):
                stream = await c.submit(input_ids=[3, 1, 4, i], max_new_tokens=tokens, deadline_ms=20_000)
                async for _ in stream:
                    chunks += 1
                r = await stream.result()
                assert r.finish_reason == "length"
            st = await c.status()
        return chunks, {w["worker_id"]: w["model"] for w in st.workers}

    chunks, models = run(body(), timeout_s=60)
    fams = _scrape(url)
    for name in ("mesh_ttft_seconds", "mesh_e2e_seconds", "mesh_queue_seconds", "mesh_inter_token_seconds"):
        assert name in fams, sorted(fams)
    counts = {}
    for name in ("mesh_ttft_seconds", "mesh_e2e_seconds", "mesh_queue_seconds", "mesh_inter_token_seconds"):
        per = {(s.labels["model"], s.labels["worker"]): s.value for s in fams[name] if s.name == name + "_count"}
        assert set(w for _, w in per) <= set(models), per  # labelled by the workers that served
        assert all(m == models[w] for m, w in per), per  # ... and the model each serves
        counts[name] = sum(per.values())
    assert counts["mesh_ttft_seconds"] == counts["mesh_e2e_seconds"] == counts["mesh_queue_seconds"] == n
    assert counts["mesh_inter_token_seconds"] == chunks - n  # one gap per chunk after each request's first
    # the sums are plausible: TTFT below end-to-end; an idle fleet queues nothing (dispatched in
    # the same handler that accepted the SUBMIT, at the same instant)
    total = {name: sum(s.value for s in fams[name] if s.name == name + "_sum") for name in counts}
    assert 0 < total["mesh_ttft_seconds"] < total["mesh_e2e_seconds"]
    assert total["mesh_queue_seconds"] == 0.0


def test_queue_time_counts_a_parked_request_until_its_dispatch():
    """Pure core: a request submitted before any worker registered waits parked; its queue time is
    that wait, and its TTFT and end-to-end time run from the SUBMIT."""
    from mesh import protocol as P
    from mesh.broker_core import BrokerCore
    from mesh.config import BrokerSettings, build
    from mesh.routing.router import Router, make_policy

    core = BrokerCore(build(BrokerSettings, {"policy": "round_robin"}), Router(make_policy("round_robin"), None))
    core.start(10.0)
    core.client_frames([b"c", *P.encode_submit("r", input_ids=[1, 2], params={"max_new_tokens": 2}, stream=True,
                                               deadline_ms=30_000)], 10.0)
    assert core.parked
    core.worker_frames([b"w", *P.encode_ready(P.Ready("w0", "m", "mixed", {}, 16, 256, 400_000, 1, 1, 500))], 10.4)
    core.worker_frames([b"w", *P.encode_heartbeat()], 10.5)  # confirmed: the parked request goes out now
    (inf,) = core.inflight.values()
    core.worker_frames([b"w", *P.encode_worker_chunk(inf.rid, inf.attempt, 0, {})], 10.7)
    core.worker_frames([b"w", *P.encode_worker_chunk(inf.rid, inf.attempt, 1, {})], 10.75)
    core.worker_frames([b"w", *P.encode_worker_final(inf.rid, inf.attempt, "length", {"prompt_tokens": 2, "completion_tokens": 2,
                                                                                 "cached_tokens": 0})], 10.8)
    lat = {k[0]: h for k, h in core.stats.latency.items() if k[1:] == ("m", "w0")}
    assert abs(lat["queue"].sum_s - 0.5) < 1e-9
    assert abs(lat["ttft"].sum_s - 0.7) < 1e-9
    assert abs(lat["inter_token"].sum_s - 0.05) < 1e-9 and lat["inter_token"].n == 1
    assert abs(lat["e2e"].sum_s - 0.8) < 1e-9
