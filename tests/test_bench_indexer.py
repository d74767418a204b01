"""``mesh bench indexer`` as a whole, small: both backends on one workload, side by side (behind
the ``bench`` marker: ``make test-bench``). The figures are not judged here, only that every arm
ran to completion and the Valkey replica came back with the whole state after its SIGKILL."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mesh.lab.bench.indexer_bench import valkey_server_binary

pytestmark = pytest.mark.bench


def test_bench_indexer_runs_both_backends_side_by_side(tmp_path):
    if valkey_server_binary() is None:
        pytest.skip("no valkey-server/redis-server (make test-bench installs redis-server)")
    out = tmp_path / "indexer.json"
    p = subprocess.run([sys.executable, "-m", "mesh.cli", "bench", "indexer", "--workers", "50", "--blocks", "20000",
                        "--queries", "100", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    per = res["backends"]
    assert set(per) == {"memory", "valkey"}
    for name, r in per.items():
        assert r["ingest_complete"] and r["match_degraded"] == 0 and r["match_queries"] == 100, (name, r)
        assert r["apply_p50_ms"] > 0 and r["ingest_blocks_per_s"] > 0
    # everything indexed (the ingest, then the one-batch applies) is there after the restart
    assert per["valkey"]["restart_entries"] >= per["valkey"]["indexed_blocks"] > 0
    assert set(res["valkey_vs_memory"]) >= {"ingest_blocks_per_s", "apply_p50_ms", "match_p50_ms_server"}
    assert "valkey" in p.stderr and "memory" in p.stderr  # the side-by-side table
