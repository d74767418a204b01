"""The project's one set of summary statistics (pure functions, no I/O).

Every percentile the project reports -- simulator metrics, the indexer's match latency, every
``mesh bench`` figure and the loadgen summary -- comes from :func:`percentile`, so a "p99" means
the same thing everywhere (tests/test_stats.py fails if a second percentile helper appears).

* :func:`percentile` -- linear interpolation between closest ranks (NumPy's default "linear",
  Hyndman & Fan type 7): for sorted ``x`` of length n, ``p`` in [0, 100], position
  ``h = (n - 1) * p / 100``, value ``x[floor h] + (h - floor h) * (x[floor h + 1] - x[floor h])``.
  p = 0 is the minimum, p = 100 the maximum, p = 50 the median (``statistics.median``).
* :func:`mean` -- arithmetic mean (``math.fsum``), 0 for no values.
* :func:`cv` -- coefficient of variation: population standard deviation / mean (0 when the mean
  is 0 or there are no values).
* :func:`ratio` -- a / b, 0 when b is 0.
* :class:`LatencyHistogram` -- fixed buckets for Prometheus histograms (the broker's and the
  indexer's latencies).

Callers that want "no value" (None, NaN) for an empty sample decide that themselves; these
functions return 0.0.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence

__all__ = ["percentile", "cv", "ratio", "mean", "LatencyHistogram", "DECISION_BUCKETS_S"]

# Bucket bounds (seconds) for decision latency: 10 us .. 100 ms, about x1.6 apart so that a p99
# estimated from them can tell a 1.5x change (coarser buckets made "2x idle" a single step).
DECISION_BUCKETS_S = (1e-5, 1.5e-5, 2.5e-5, 4e-5, 6e-5, 1e-4, 1.5e-4, 2.5e-4, 4e-4, 6e-4, 1e-3, 1.5e-3, 2.5e-3, 4e-3,
                      6e-3, 1e-2, 2.5e-2, 0.1)


def percentile(values: Sequence[float], p: float, *, presorted: bool = False) -> float:
    """The ``p``-th percentile, ``p`` in [0, 100] (type 7, see the module docstring).

    0.0 for no values; ``ValueError`` for ``p`` outside [0, 100]. ``presorted=True`` promises
    ``values`` is already ascending (skips the sort; not checked).
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p!r}")
    n = len(values)
    if n == 0:
        return 0.0
    x = values if presorted else sorted(values)
    h = (n - 1) * p / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    return x[lo] + (h - lo) * (x[hi] - x[lo])


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean; 0.0 when empty."""
    return math.fsum(values) / len(values) if values else 0.0


def cv(values: Sequence[float]) -> float:
    """Population std / mean; 0.0 when empty or the mean is 0."""
    n = len(values)
    if n == 0:
        return 0.0
    m = math.fsum(values) / n
    if m == 0:
        return 0.0
    var = math.fsum((v - m) ** 2 for v in values) / n
    return math.sqrt(var) / m


def ratio(a: float, b: float) -> float:
    """a / b; 0.0 when b is 0."""
    return a / b if b else 0.0


class LatencyHistogram:
    """A fixed-bucket histogram with O(log buckets) observe and no locks."""

    def __init__(self, bounds_s: Iterable[float] = DECISION_BUCKETS_S) -> None:
        self.bounds_s = tuple(bounds_s)
        self.counts = [0] * (len(self.bounds_s) + 1)
        self.sum_s = 0.0
        self.n = 0

    def observe(self, v_s: float) -> None:
        self.sum_s += v_s
        self.n += 1
        # first bucket whose upper bound is >= v (the last slot is +Inf)
        self.counts[bisect_left(self.bounds_s, v_s)] += 1

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for b, c in zip(self.bounds_s, self.counts):
            acc += c
            out.append((repr(b), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out
