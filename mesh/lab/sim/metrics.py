"""Metric definitions of the simulator: re-exported from :mod:`mesh.stats`.

The definitions (type 7 percentile, population cv, safe ratio, mean) live in the neutral
:mod:`mesh.stats` so the benches and the indexer share them; this module keeps the simulator's
``from mesh.lab.sim.metrics import percentile`` imports working (hand-checked in tests/test_sim.py
and tests/test_stats.py).
"""

from __future__ import annotations

from mesh.stats import cv, mean, percentile, ratio

__all__ = ["percentile", "cv", "ratio", "mean"]
