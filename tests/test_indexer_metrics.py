"""`mesh indexer --metrics`: Prometheus /metrics of a real indexer process (issue 17 part 4)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from mesh.hashing import content_keys
from mesh.indexer.client import IndexerClient
from mesh.lab.procs import wait_for_log_event

from conftest import run


def _scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - the test's own indexer
        return {f.name: f.samples for f in text_string_to_metric_families(resp.read().decode())}


def test_indexer_metrics_count_matches_and_show_its_state(procs):
    p = procs.spawn("idx", ["indexer", "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
    ep = wait_for_log_event(p.log_path, "indexer_listening", 30, p.popen, start=p.log_start)["endpoint"]
    url = wait_for_log_event(p.log_path, "metrics_listening", 30, p.popen, start=p.log_start)["endpoint"]
    before = _scrape(url)
    assert sum(s.value for s in before["mesh_indexer_match_seconds"] if s.name.endswith("_count")) == 0
    keys = content_keys(list(range(64)), 16)

    async def body():
        async with IndexerClient([ep], query_timeout_ms=3000) as c:
            for _ in range(5):
                assert await c.match(keys, 16) is not None

    run(body(), 30)
    fams = _scrape(url)
    assert sum(s.value for s in fams["mesh_indexer_match_seconds"] if s.name.endswith("_count")) == 5
    events = {s.labels["what"]: s.value for s in fams["mesh_indexer_events"] if s.name.endswith("_total")}
    assert events.get("queries") == 5, events
    stats = {s.labels["stat"]: s.value for s in fams["mesh_indexer_stat"]}
    assert "tracked_workers" in stats and stats["limit_max_workers"] > 0
    assert stats["uncovered_streams"] == 0 and [s.value for s in fams["mesh_indexer_ready"]] == [1.0]
