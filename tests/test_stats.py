"""mesh.stats: the one percentile definition (type 7), hand-checked, and a guard that no second
percentile helper is defined anywhere in the source tree."""

from __future__ import annotations

import ast
import math
import random
from pathlib import Path

import pytest

from mesh import stats
from mesh.stats import cv, mean, percentile, ratio

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("mesh", "brokers", "workers_stub")
CANONICAL = Path("mesh/stats.py")
# Names a private percentile helper has had (or would plausibly get); only mesh/stats.py may define them.
HELPER_NAMES = frozenset({"_pct", "pct", "_percentile", "percentile", "quantile", "_quantile"})


def test_empty_is_zero():
    assert percentile([], 0) == 0.0
    assert percentile([], 50) == 0.0
    assert percentile([], 100, presorted=True) == 0.0


def test_one_value_is_every_percentile():
    for p in (0, 1, 50, 99, 100):
        assert percentile([7.5], p) == 7.5


def test_two_values_interpolate_linearly():
    # h = (n - 1) * p / 100 = p / 100: the value moves linearly from the lower to the upper one
    assert percentile([10.0, 20.0], 0) == 10.0
    assert percentile([10.0, 20.0], 25) == pytest.approx(12.5)
    assert percentile([10.0, 20.0], 50) == pytest.approx(15.0)
    assert percentile([20.0, 10.0], 99) == pytest.approx(19.9)  # unsorted input is sorted first
    assert percentile([10.0, 20.0], 100) == 20.0


def test_known_values():
    x = [1.0, 2.0, 3.0, 4.0]
    assert percentile(x, 50) == 2.5  # h = 1.5
    assert percentile(x, 95) == pytest.approx(3.85)  # h = 2.85 -> 3 + 0.85
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)  # h = 98.01
    assert percentile(list(range(101)), 99) == 99  # h = 99 exactly: a sample, no interpolation
    assert percentile([3, 1, 2], 50) == 2  # odd n: p50 is the middle sample (the median)


def test_p0_and_p100_are_min_and_max():
    rng = random.Random(1)
    xs = [rng.uniform(-5, 5) for _ in range(37)]
    assert percentile(xs, 0) == min(xs)
    assert percentile(xs, 100) == max(xs)


def test_presorted_skips_the_sort_and_agrees():
    rng = random.Random(2)
    xs = [rng.expovariate(1.0) for _ in range(501)]
    s = sorted(xs)
    for p in (0, 10, 50, 90, 99, 99.9, 100):
        assert percentile(s, p, presorted=True) == percentile(xs, p)
    # the promise is not checked: unsorted input with presorted=True is read as given
    assert percentile([3.0, 1.0, 2.0], 0, presorted=True) == 3.0


def test_input_is_not_modified():
    xs = [3.0, 1.0, 2.0]
    percentile(xs, 50)
    assert xs == [3.0, 1.0, 2.0]


def test_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for n in (1, 2, 3, 10, 101, 1000):
        xs = [rng.lognormvariate(0, 1) for _ in range(n)]
        for p in (0, 0.5, 25, 50, 90, 95, 99, 99.9, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("p", [-0.001, 100.001, 101, -1, math.nan])
def test_p_out_of_range_raises(p):
    with pytest.raises(ValueError):
        percentile([1.0, 2.0], p)
    with pytest.raises(ValueError):
        percentile([], p)  # even with no values: a bad p is a bug in the caller


def test_mean_cv_ratio():
    assert mean([]) == 0.0 and mean([1.0, 2.0, 6.0]) == 3.0
    assert cv([]) == 0.0 and cv([0.0, 0.0]) == 0.0 and cv([5.0, 5.0]) == 0.0
    assert cv([1.0, 3.0]) == pytest.approx(0.5)  # std 1, mean 2
    assert ratio(1.0, 0.0) == 0.0 and ratio(3.0, 4.0) == 0.75


def test_sim_metrics_reexports_the_same_functions():
    from mesh.lab.sim import metrics

    assert metrics.percentile is stats.percentile
    assert metrics.mean is stats.mean and metrics.cv is stats.cv and metrics.ratio is stats.ratio


def _helper_definitions(path: Path) -> list[str]:
    """``name:line`` of every function (def, async def, or ``name = lambda``) in ``path`` named like a
    percentile helper."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in HELPER_NAMES:
            found.append(f"{node.name}:{node.lineno}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Lambda):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id in HELPER_NAMES:
                    found.append(f"{t.id}:{node.lineno}")
    return found


def test_no_second_percentile_definition_in_the_source_tree():
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 20, "the source tree was not found"
    offenders = []
    for path in files:
        rel = path.relative_to(ROOT)
        if rel == CANONICAL:
            continue
        offenders += [f"{rel}:{d}" for d in _helper_definitions(path)]
    assert not offenders, (f"percentile helpers defined outside {CANONICAL} (use mesh.stats.percentile, "
                           f"p in [0, 100]): {offenders}")
    assert _helper_definitions(ROOT / CANONICAL) == [f"percentile:{percentile.__code__.co_firstlineno}"]
