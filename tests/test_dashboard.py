"""The Grafana dashboard (deploy/grafana/mesh-dashboard.json) asks only for metrics mesh exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from brokers.main import build_broker, metrics_registry
from mesh import protocol as P
from mesh.config import BrokerSettings, build

ROOT = Path(__file__).resolve().parents[1]


def _exported() -> set[str]:
    b = build_broker(build(BrokerSettings, {"policy": "cache_aware"}))
    core = b.core
    core.start(0.0)
    core.worker_frames([b"w", *P.encode_ready(P.Ready("w0", "m", "mixed", {}, 16, 256, 400_000, 1, 1, 500))], 0.0)
    core.worker_frames([b"w", *P.encode_heartbeat()], 0.0)
    names = {m.name for m in metrics_registry(b).collect()}
    # a broker on the shared indexer exports its view of each replica too (nothing is contacted)
    bi = build_broker(build(BrokerSettings, {"policy": "cache_aware", "cache_prefix_provider": "indexer",
                                             "kv_indexer_endpoint": ("http://127.0.0.1:9",)}))
    names |= {m.name for m in metrics_registry(bi).collect()}
    from mesh.indexer.core import IndexerCore
    from mesh.indexer.server import IndexerService, _IndexerCollector

    icore = IndexerCore(max_entries=1000)
    names |= {m.name for m in _IndexerCollector(icore, IndexerService(icore)).collect()}
    # the policy-level audit's gauges: a textfile `mesh sim --audit --audit-textfile` writes
    import tempfile

    from prometheus_client.parser import text_string_to_metric_families
    from mesh.lab.sim.twin import write_textfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "audit.prom"
        write_textfile(str(path), {"pays": {"pays_ms": {"power_of_two": 1.0}, "ci95_ms": {"power_of_two": 0.5},
                                            "best": 1.0}, "fidelity": {"ratio": 1.0}}, requests=1)
        names |= {m.name for m in text_string_to_metric_families(path.read_text())}
    return names


def test_every_dashboard_metric_is_exported():
    dash = json.loads((ROOT / "deploy" / "grafana" / "mesh-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(total|bucket|count|sum)$", "", m) for e in exprs for m in re.findall(r"\bmesh_[a-z0-9_]+", e)}
    exported = _exported()
    missing = sorted(u for u in used if u not in exported)
    assert not missing, f"the dashboard asks for metrics nobody exports: {missing}"
    assert len(used) >= 10
