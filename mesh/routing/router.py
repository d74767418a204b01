"""The one routing entry point shared by broker, simulator and tests.

``Router.route(req, workers, now_s, exclude)`` filters the fleet to healthy, role-compatible,
non-excluded workers, asks the prefix provider for matches when the policy needs them, runs the
policy and lets the provider learn from the decision. Pure: no I/O, no clock reads.
"""

from __future__ import annotations

import random
from typing import Callable, Collection, Iterable, Protocol, Sequence

from mesh.routing.cache_policies import CacheAware, CacheAwareGreedy
from mesh.routing.policies import MatchView, Policy, PowerOfTwo, RandomPolicy, RoundRobin
from mesh.routing.ranks import assign_rank
from mesh.routing.regret import RegretAudit
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
    "cache_aware_greedy": CacheAwareGreedy,
    "cache_aware": CacheAware,
}


def make_policy(name: str, *, rng: random.Random | None = None, freshness_s: float = 5.0, **kwargs) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    return factory(rng=rng, freshness_s=freshness_s, **kwargs)


class Router:
    """Policy + optional prefix provider. ``mixed`` workers serve whole requests.

    :meth:`route` records the dispatch on the chosen :class:`WorkerState` (in-flight count and
    uncached tokens); the caller must call :meth:`release` once for every successful route when
    that request finishes, fails, or is taken back for a retry.
    """

    def __init__(self, policy: Policy, provider: PrefixProvider | None = None, audit: RegretAudit | None = None) -> None:
        self.policy = policy
        self.provider = provider
        # cache_aware's counterfactual regret audit (mesh.routing.regret; the broker's --regret-audit)
        self.audit = audit if isinstance(policy, CacheAware) else None
        # worker id -> state for each pool routed over (one per model), keyed by the pool object
        self._by_pool: dict[int, tuple[Sequence[WorkerState], dict[str, WorkerState]]] = {}

    @staticmethod
    def pool(workers: Iterable[WorkerState], roles: Collection[str] = ("mixed",)) -> list[WorkerState]:
        """The routable pool: healthy workers of the given roles (callers cache this list)."""
        return [w for w in workers if w.healthy and w.role in roles]

    def _by_id(self, pool: Sequence[WorkerState]) -> dict[str, WorkerState]:
        hit = self._by_pool.get(id(pool))
        if hit is not None and hit[0] is pool:
            return hit[1]
        if len(self._by_pool) >= 64:
            self._by_pool.clear()
        by_id = {w.worker_id: w for w in pool}
        self._by_pool[id(pool)] = (pool, by_id)
        return by_id

    def route(self, req: RouteRequest, pool: Sequence[WorkerState], now_s: float, exclude: Collection[str] = ()) -> Decision:
        """Choose a worker from ``pool`` (see :meth:`pool`), skipping ids in ``exclude``."""
        cands = [w for w in pool if w.worker_id not in exclude] if exclude else pool
        if not cands:
            return Decision(None, "no_candidates")
        match = None
        degraded = False
        if self.policy.needs_match and self.provider is not None:
            match = self.provider.match(req, now_s)
            degraded = match is None or getattr(match, "incomplete", False)
        if isinstance(self.policy, CacheAware):
            d = self.policy.choose(req, cands, match, now_s, by_id=None if exclude else self._by_id(pool))
            if self.audit is not None and d.worker_id is not None:  # the view it chose from, before the dispatch
                self.audit.record(self.policy, req, cands, match, d, now_s)
        else:
            d = self.policy.choose(req, cands, match, now_s)
        d.degraded = d.degraded or degraded
        if d.worker_id is None:
            return d
        if "uncached_tokens" in d.detail:
            d.uncached_tokens = d.detail["uncached_tokens"]
        else:
            bs = req.block_size or 16
            hit = min(d.matched_blocks * bs, max(0, req.prompt_tokens - 1)) if d.matched_blocks else 0
            d.uncached_tokens = req.prompt_tokens - hit
        w = self._by_id(pool).get(d.worker_id) or next(x for x in cands if x.worker_id == d.worker_id)
        w.record_dispatch(d.uncached_tokens, now_s)
        assign_rank(d, w, match, now_s, getattr(self.policy, "freshness_s", 5.0))  # before on_routed changes the index
        if self.provider is not None:
            self.provider.on_routed(req, d.worker_id, now_s)
        return d

    def observe(self, decision: Decision, ttft_ms: float) -> None:
        """The request routed by ``decision`` got its first reply after ``ttft_ms``: the
        policy learns from it (cache_aware's calibration; other policies ignore outcomes)."""
        obs = getattr(self.policy, "observe", None)
        if obs is not None:
            obs(decision, ttft_ms)
        if self.audit is not None:  # the regret audit's observed figure
            self.audit.observe(decision, ttft_ms)

    @staticmethod
    def release(state: WorkerState, decision: Decision) -> None:
        """Undo :meth:`route`'s bookkeeping for one request."""
        state.record_release(decision.uncached_tokens, decision.dp_rank)
