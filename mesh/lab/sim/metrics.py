"""Metric definitions of the simulator: re-exported from :mod:`mesh.stats`, plus the batch means
the matrix's regret check reads.

The definitions (type 7 percentile, population cv, safe ratio, mean) live in the neutral
:mod:`mesh.stats` so the benches and the indexer share them; this module keeps the simulator's
``from mesh.lab.sim.metrics import percentile`` imports working (hand-checked in tests/test_sim.py
and tests/test_stats.py).

**Batch means.** Two arms of one (cell, seed) replay the same requests, so a difference of their
mean TTFTs is a paired comparison; but TTFTs in one arm are not independent (a queue delays the
requests after it), so the textbook standard error of a mean understates how well the difference
is known. :func:`batch_means` cuts the stream, by request index, into :data:`BATCHES` contiguous
batches and keeps each batch's mean; :func:`paired_ci95` takes the per-batch differences of two
arms as about independent samples (the batch-means method of simulation output analysis) and
gives the 95 % confidence half-width of the difference of means.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from mesh.stats import cv, mean, percentile, ratio

__all__ = ["percentile", "cv", "ratio", "mean", "batch_means", "paired_ci95", "paired_se", "t975", "exact_within_probability", "student_t_tail2", "tpot_mean_ms", "BATCHES"]

#: batches of :func:`batch_means` (contiguous runs of request indices)
BATCHES = 20
#: Student's t, 97.5 % quantile, by degrees of freedom (2 .. BATCHES - 1)
_T975 = {2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228, 11: 2.201,
         12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093}


def tpot_mean_ms(requests: Iterable[tuple[float, float, int]]) -> float | None:
    """Mean time per output token, ms, over ``(first_token_s, done_s, completion_tokens)`` of
    requests with at least two output tokens: ``(done - first) / (completion - 1)`` each (the
    decode side of an engine, as a recording's ``ttft_ms``/``e2e_ms`` give it); None without any."""
    xs = [(d - f) * 1e3 / (c - 1) for f, d, c in requests if c >= 2 and d >= f]
    return round(sum(xs) / len(xs), 4) if xs else None


def batch_means(values: Iterable[tuple[int, float]], n: int, batches: int = BATCHES) -> list[float | None]:
    """The mean of ``values`` ((request index, value) pairs, indices in ``[0, n)``) in each of
    ``batches`` contiguous index ranges of equal size; None for a range with no value (every
    request in it failed)."""
    sums = [0.0] * batches
    counts = [0] * batches
    if n <= 0:
        return [None] * batches
    for i, v in values:
        b = min(batches - 1, i * batches // n)
        sums[b] += v
        counts[b] += 1
    return [round(s / c, 3) if c else None for s, c in zip(sums, counts)]


def paired_se(a: Sequence[float | None], b: Sequence[float | None]) -> tuple[float, float, int] | None:
    """(mean of ``a - b`` over the batches both have, its standard error, the batches used), or
    None with fewer than 3 such batches or batch lists of different lengths."""
    if len(a) != len(b):
        return None
    d = [x - y for x, y in zip(a, b) if x is not None and y is not None]
    k = len(d)
    if k < 3:
        return None
    m = math.fsum(d) / k
    sd = math.sqrt(math.fsum((x - m) ** 2 for x in d) / (k - 1))
    return m, sd / math.sqrt(k), k


def paired_ci95(a: Sequence[float | None], b: Sequence[float | None]) -> tuple[float, float] | None:
    """(mean of ``a - b`` over the batches both have, its 95 % confidence half-width), or None
    with fewer than 3 such batches or batch lists of different lengths. The half-width uses
    Student's t for ``k - 1`` degrees of freedom (k the batches used)."""
    got = paired_se(a, b)
    if got is None:
        return None
    m, se, k = got
    return m, t975(k) * se


def t975(k: int) -> float:
    """Student's t, 97.5 % quantile, for the mean of ``k`` batches (``k - 1`` degrees of freedom)."""
    return _T975.get(k - 1, 2.09 if k <= 30 else 1.96)


def exact_within_probability(measured: float, se: float, tolerance: float) -> float:
    """How likely an estimate equal to the *expected* difference lands within ``tolerance`` x
    ``|measured|`` of a measurement with standard error ``se`` (normal approximation): the share of
    such checks a perfect estimator passes, the ceiling a run's own noise puts on the check."""
    if se <= 0.0:
        return 1.0
    return math.erf(tolerance * abs(measured) / (se * math.sqrt(2.0)))


def student_t_tail2(x: float, df: int, steps: int = 400) -> float:
    """P(|T| > x) for Student's t with ``df`` degrees of freedom (Simpson's rule on its density
    from 0 to ``|x|``; well within 1e-6 for the small ``x`` and ``df`` the matrix asks about)."""
    if df < 1:
        raise ValueError("df must be at least 1")
    x = abs(x)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def pdf(u: float) -> float:
        return c * (1.0 + u * u / df) ** (-(df + 1) / 2)

    h = x / steps
    acc = pdf(0.0) + pdf(x) + math.fsum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, steps))
    return max(0.0, 1.0 - 2.0 * acc * h / 3.0)
