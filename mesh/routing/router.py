"""The one routing entry point shared by broker, simulator and tests.

``Router.route(req, workers, now_s, exclude)`` filters the fleet to healthy, role-compatible,
non-excluded workers, asks the prefix provider for matches when the policy needs them, runs the
policy and lets the provider learn from the decision. Pure: no I/O, no clock reads.
"""

from __future__ import annotations

import random
from typing import Callable, Collection, Iterable, Protocol, Sequence

from mesh.routing.policies import MatchView, Policy, PowerOfTwo, RandomPolicy, RoundRobin
from mesh.routing.view import Decision, RouteRequest, WorkerState

__all__ = ["Router", "PrefixProvider", "POLICIES", "make_policy"]


class PrefixProvider(Protocol):
    """Source of cache matches. ``match`` returns None when it has no usable answer (degraded)."""

    name: str

    def match(self, req: RouteRequest, now_s: float) -> MatchView | None: ...

    def on_routed(self, req: RouteRequest, worker_id: str, now_s: float) -> None: ...


POLICIES: dict[str, Callable[..., Policy]] = {
    "round_robin": RoundRobin,
    "random": RandomPolicy,
    "power_of_two": PowerOfTwo,
}


def make_policy(name: str, *, rng: random.Random | None = None, freshness_s: float = 5.0, **kwargs) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    return factory(rng=rng, freshness_s=freshness_s, **kwargs)


class Router:
    """Policy + optional prefix provider. Serving roles: ``mixed`` workers serve whole requests."""

    def __init__(self, policy: Policy, provider: PrefixProvider | None = None) -> None:
        self.policy = policy
        self.provider = provider

    @staticmethod
    def pool(workers: Iterable[WorkerState], roles: Collection[str] = ("mixed",)) -> list[WorkerState]:
        """The routable pool: healthy workers of the given roles (callers cache this list)."""
        return [w for w in workers if w.healthy and w.role in roles]

    def route(self, req: RouteRequest, pool: Sequence[WorkerState], now_s: float, exclude: Collection[str] = ()) -> Decision:
        """Choose a worker from ``pool`` (see :meth:`pool`), skipping ids in ``exclude``."""
        cands = [w for w in pool if w.worker_id not in exclude] if exclude else pool
        if not cands:
            return Decision(None, "no_candidates")
        match = None
        degraded = False
        if self.policy.needs_match and self.provider is not None and req.keys is not None:
            match = self.provider.match(req, now_s)
            degraded = match is None
        d = self.policy.choose(req, cands, match, now_s)
        d.degraded = d.degraded or degraded
        if d.worker_id is not None and self.provider is not None:
            self.provider.on_routed(req, d.worker_id, now_s)
        return d
