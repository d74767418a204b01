"""Load-based routing policies and the Policy interface. Pure: no I/O, no clock reads.

A policy picks one worker among ``candidates`` (already filtered for health, role and exclusions
by :class:`mesh.routing.router.Router`). It never returns a worker outside ``candidates`` and
returns ``Decision(None, ...)`` only when ``candidates`` is empty. Randomness comes from the
``random.Random`` the policy was built with, so a seeded router is deterministic.
"""

from __future__ import annotations

import random
from typing import Protocol, Sequence

from mesh.routing.view import Decision, RouteRequest, WorkerState

__all__ = ["Policy", "MatchView", "RoundRobin", "RandomPolicy", "PowerOfTwo", "least_pressure"]


class MatchView(Protocol):
    """Per-worker cache matches for one request, from a prefix provider.

    ``top(k)`` returns the k deepest matches as objects with ``worker_id`` and ``blocks``.
    """

    query_blocks: int

    def matched_blocks(self, worker_id: str) -> int: ...

    def top(self, k: int) -> list: ...


class Policy(Protocol):
    name: str
    needs_match: bool

    def choose(self, req: RouteRequest, candidates: Sequence[WorkerState], match: MatchView | None, now_s: float) -> Decision: ...


def least_pressure(cands: Sequence[WorkerState], now_s: float, freshness_s: float) -> WorkerState:
    """Least pressured candidate; ties broken by worker id (deterministic)."""
    return min(cands, key=lambda w: (w.pressure(now_s, freshness_s), w.worker_id))


class RoundRobin:
    name = "round_robin"
    needs_match = False

    def __init__(self, rng: random.Random | None = None, freshness_s: float = 5.0) -> None:
        self._next = 0

    def choose(self, req, candidates, match, now_s):
        if not candidates:
            return Decision(None, "no_candidates")
        w = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(w.worker_id, "round_robin")


class RandomPolicy:
    name = "random"
    needs_match = False

    def __init__(self, rng: random.Random | None = None, freshness_s: float = 5.0) -> None:
        self.rng = rng or random.Random()

    def choose(self, req, candidates, match, now_s):
        if not candidates:
            return Decision(None, "no_candidates")
        return Decision(self.rng.choice(candidates).worker_id, "random")


def _two_distinct(rng: random.Random, n: int) -> tuple[int, int]:
    """Two distinct indexes in ``range(n)`` (n >= 2), drawn exactly as ``rng.sample(range(n), 2)``
    draws them (same random stream, so seeded runs keep their results) at a third of its cost."""
    if n <= 21:  # sample() draws from a shrinking pool for small populations
        i = rng.randrange(n)
        j = rng.randrange(n - 1)
        return i, (n - 1 if j == i else j)
    i = rng.randrange(n)  # and rejects repeats for larger ones
    j = rng.randrange(n)
    while j == i:
        j = rng.randrange(n)
    return i, j


class PowerOfTwo:
    """Sample two distinct candidates, keep the less pressured (ties: lower worker id)."""

    name = "power_of_two"
    needs_match = False

    def __init__(self, rng: random.Random | None = None, freshness_s: float = 5.0) -> None:
        self.rng = rng or random.Random()
        self.freshness_s = freshness_s

    def choose(self, req, candidates, match, now_s):
        n = len(candidates)
        if n == 0:
            return Decision(None, "no_candidates")
        if n == 1:
            return Decision(candidates[0].worker_id, "power_of_two")
        i, j = _two_distinct(self.rng, n)
        a, b = candidates[i], candidates[j]
        pa, pb = a.pressure(now_s, self.freshness_s), b.pressure(now_s, self.freshness_s)
        w = a if (pa, a.worker_id) <= (pb, b.worker_id) else b
        return Decision(w.worker_id, "power_of_two")
