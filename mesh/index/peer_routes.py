"""Where the other routers just sent which prompts: their insert-on-route guesses, shared. Pure.

Each router inserts the prompt of every request it routes into its own speculative index
(``speculative_ttl_s``): the engine will hold those pages in a moment, before its KV events say
so. With several routers only the router that routed a prompt knew; a follow-up that reached
another router while the first prefill was still running saw only the pages already reported
(a chunk or two of a 30k-token prompt), missed, and recomputed the whole prompt elsewhere. On
the quality matrix's conversation workload that was the whole of what 8 routers lost against
one in hit rate (seeds 4-9: 0.41-0.57 against 0.40-0.60; see the README).

So routers tell each other, through the exchange (:mod:`mesh.routing.peers`), where they routed
what, compactly: a prompt of ``n`` full pages is summarised by its content keys at a few page
positions, :func:`route_anchors` (every ``floor(2**(j/2))`` up to ``n``, and ``n`` itself).
Content keys are chained (a page's key depends on every page before it), so a key at position
``p`` stands for the whole first ``p`` pages. A receiver looks its own request's keys up in the
anchors it holds (:class:`PeerRoutes`): the deepest one found is a speculative match of that
many pages on that worker. Exact when a follow-up extends a prompt a peer routed (the last
anchor is its full length); rounded down by at most ~29 % otherwise; never more than what the
peer routed. Entries expire after the speculative TTL, like the router's own guesses, and the
table is bounded (oldest first), so a lost, stale or lying report costs at most one TTL of
misplaced affinity.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Sequence

from mesh.index.result import WorkerMatch

__all__ = ["route_anchors", "PeerRoutes", "PeerRouteMatch"]


def _anchor_positions(n: int) -> list[int]:
    out: list[int] = []
    j = 0
    while True:
        p = int(2 ** (j / 2))
        if p > n:
            break
        if not out or p != out[-1]:
            out.append(p)
        j += 1
    if n and (not out or out[-1] != n):
        out.append(n)
    return out


def route_anchors(keys: Sequence[int]) -> list[int]:
    """The content keys of ``keys`` (a prompt's full pages) at positions 1, 2, 4, 5, 8, 11, ...
    (``floor(2**(j/2))``) and at ``len(keys)``: 2 log2(n) + 2 keys at most (63 below 2**31 pages,
    within the wire's ``MAX_ROUTE_ANCHORS``), shallowest first."""
    return [keys[p - 1] for p in _anchor_positions(len(keys))]


class PeerRouteMatch:
    """Per-worker speculative depths from peers' anchors (the match interface of
    :class:`mesh.index.result.MatchResult`: ``best_blocks``, ``matched_blocks``, ``top``)."""

    __slots__ = ("query_blocks", "depth")

    def __init__(self, query_blocks: int, depth: dict[str, int]) -> None:
        self.query_blocks = query_blocks
        self.depth = depth

    @property
    def best_blocks(self) -> int:
        return max(self.depth.values(), default=0)

    def matched_blocks(self, worker_id: str) -> int:
        return self.depth.get(worker_id, 0)

    def top(self, k: int) -> list[WorkerMatch]:
        ranked = sorted(self.depth.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        return [WorkerMatch(w, d, None, True) for w, d in ranked]


class PeerRoutes:
    """Anchor key -> {worker id: expiry} for the prompts peers routed (see the module docstring).

    :meth:`add` takes one peer route (a worker and the anchors of its prompt), :meth:`match`
    answers a request's keys. At most ``max_keys`` anchor entries: the oldest go first
    (``stats["evicted"]``). ``stats`` also counts ``routes`` taken, ``anchors`` stored,
    ``matches`` (requests some peer route matched) and ``expired`` entries. Times are the
    receiver's ``now_s``."""

    def __init__(self, ttl_s: float, max_keys: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._by_key: dict[int, dict[str, float]] = {}
        self._order: deque[tuple[float, int, str]] = deque()  # (expiry, key, worker) in arrival order
        self.stats: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._order)

    def add(self, worker_id: str, anchors: Sequence[int], now_s: float) -> None:
        self._expire(now_s)
        exp = now_s + self.ttl_s
        by_key, order = self._by_key, self._order
        for k in anchors:
            ws = by_key.get(k)
            if ws is None:
                ws = by_key[k] = {}
            ws[worker_id] = exp
            order.append((exp, k, worker_id))
        self.stats["routes"] += 1
        self.stats["anchors"] += len(anchors)
        while len(order) > self.max_keys:
            self._drop(*order.popleft(), "evicted")

    def match(self, keys: Sequence[int], now_s: float) -> PeerRouteMatch | None:
        """The deepest anchor of each worker among ``keys`` (None: no peer route matches)."""
        by_key = self._by_key
        if not by_key or by_key.keys().isdisjoint(keys):
            return None
        self._expire(now_s)
        depth: dict[str, int] = {}
        for i in range(len(keys) - 1, -1, -1):
            ws = by_key.get(keys[i])
            if ws is not None:
                for w, exp in ws.items():
                    if exp > now_s and w not in depth:
                        depth[w] = i + 1
        if not depth:
            return None
        self.stats["matches"] += 1
        return PeerRouteMatch(len(keys), depth)

    def remove_worker(self, worker_id: str) -> None:
        """Forget every anchor of ``worker_id`` (it left the pool)."""
        for k in [k for k, ws in self._by_key.items() if worker_id in ws]:
            ws = self._by_key[k]
            del ws[worker_id]
            if not ws:
                del self._by_key[k]

    def _expire(self, now_s: float) -> None:
        order = self._order
        while order and order[0][0] <= now_s:
            self._drop(*order.popleft(), "expired")

    def _drop(self, exp: float, k: int, w: str, why: str) -> None:
        ws = self._by_key.get(k)
        if ws is None or ws.get(w) != exp:
            return  # gone already, or refreshed by a later route (whose entry is still queued)
        del ws[w]
        if not ws:
            del self._by_key[k]
        self.stats[why] += 1
