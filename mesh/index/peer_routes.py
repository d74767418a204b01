"""Where the other routers just sent which prompts: their insert-on-route guesses, shared. Pure.

Each router inserts the prompt of every request it routes into its own speculative index
(``speculative_ttl_s``): the engine will hold those pages in a moment, before its KV events say
so. With several routers only the router that routed a prompt knew; a follow-up that reached
another router while the first prefill was still running saw only the pages already reported
(a chunk or two of a 30k-token prompt), missed, and recomputed the whole prompt elsewhere. On
the quality matrix's conversation workload that was the whole of what 8 routers lost against
one in hit rate (seeds 4-9: 0.41-0.57 against 0.40-0.60; docs/routing.md).

So routers tell each other, through the exchange (:mod:`mesh.routing.peers`), where they routed
what, compactly: a prompt of ``n`` full pages is summarised by ``n`` and its content keys at a
few page positions, :func:`route_anchors` (every ``floor(2**(j/2))`` up to ``n``, and ``n``
itself: 2 log2(n) + 2 keys at most). Content keys are chained (a page's key depends on every page
before it), so a key at position ``p`` stands for the whole first ``p`` pages, and a request
sharing them has the same key at the same position. A receiver (:class:`PeerRoutes`) probes
only its own keys at those positions (at most 63 dict probes, whatever the prompt's length),
then the last page of the route it found.

**Only a request that contains a peer's whole routed prompt counts** (a session's next turn:
its context is being computed on that worker and nowhere else); one that merely shares a
prefix with it (a popular system prompt, a zipf document) does not. Measured on the quality
matrix: counting shared prefixes too made every router agree on the first holder of each hot
prefix, and zipf with 4 and 8 routers went from 94-125 ms TTFT p95 to 191-424 ms (the same
routers without the routes computed a hot prefix a few times over in its first milliseconds,
which spreads it over the workers it needs; a shared prefix is reported by KV events within
one prefill chunk anyway). Whole-prompt matches alone left zipf exactly as without routes and
kept the conversation's hit rate at one router's.

Entries expire after the speculative TTL, like the router's own guesses, and the table is
bounded (oldest first) **per peer**: each source keeps at most ``max_keys`` anchor entries, so a
lost, stale or lying report costs at most one TTL of misplaced affinity, and a peer that floods
routes evicts only its own, never another peer's (at most ``max_sources`` sources at once).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, deque
from typing import Sequence

from mesh.index.result import WorkerMatch

__all__ = ["route_anchors", "PeerRoutes", "PeerRouteMatch"]


def _positions_upto(limit: int) -> list[int]:
    out: list[int] = []
    j = 0
    while True:
        p = int(2 ** (j / 2))
        if p > limit:
            return out
        if not out or p != out[-1]:
            out.append(p)
        j += 1


_POSITIONS = _positions_upto(2**31)  # 1, 2, 4, 5, 8, 11, 16, 22, ...: 61 positions


def _anchor_positions(n: int) -> list[int]:
    """The page positions (1-based) of a route of ``n`` pages: the half powers of two up to
    ``n``, and ``n``."""
    out = _POSITIONS[: bisect_right(_POSITIONS, n)]
    return out + [n] if n and (not out or out[-1] != n) else out


def route_anchors(keys: Sequence[int]) -> list[int]:
    """The content keys of ``keys`` (a prompt's full pages) at :func:`_anchor_positions`
    (``len(keys)``), shallowest first: at most 62 keys below 2**31 pages, within the wire's
    ``MAX_ROUTE_ANCHORS``."""
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
    """Anchor key -> {worker id: (expiry, route pages, route tip key)} for the prompts peers
    routed (see the module docstring).

    :meth:`add` takes one peer route (a worker, the prompt's page count, its anchors and the
    peer it came from), :meth:`match` answers a request's keys. Each source holds at most
    ``max_keys`` anchor entries, its oldest going first (``stats["evicted"]``); a route from a
    source beyond ``max_sources`` live ones is dropped (``stats["sources_over"]``). ``stats``
    also counts ``routes`` taken, ``anchors`` stored, ``matches`` (requests some peer route
    matched), ``expired`` entries and ``bad_routes`` (anchors that do not fit their page count:
    dropped). Times are the receiver's ``now_s``."""

    def __init__(self, ttl_s: float, max_keys: int = 100_000, max_sources: int = 64) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys  # per source
        self.max_sources = max_sources
        self._by_key: dict[int, dict[str, tuple[float, int, int]]] = {}
        # per source, (expiry, key, worker) in arrival order: one TTL, so expiry order too
        self._order: dict[str, deque[tuple[float, int, str]]] = {}
        self.stats: Counter[str] = Counter()

    def __len__(self) -> int:
        return sum(len(q) for q in self._order.values())

    def add(self, worker_id: str, pages: int, anchors: Sequence[int], now_s: float, source: str = "") -> None:
        if not anchors or len(anchors) != len(_anchor_positions(pages)):
            self.stats["bad_routes"] += 1
            return
        self._expire(now_s)
        order = self._order.get(source)
        if order is None:
            if len(self._order) >= self.max_sources:
                self.stats["sources_over"] += 1
                return
            order = self._order[source] = deque()
        exp = now_s + self.ttl_s
        entry = (exp, pages, anchors[-1])
        by_key = self._by_key
        for k in anchors:
            ws = by_key.get(k)
            if ws is None:
                ws = by_key[k] = {}
            ws[worker_id] = entry
            order.append((exp, k, worker_id))
        self.stats["routes"] += 1
        self.stats["anchors"] += len(anchors)
        while len(order) > self.max_keys:
            self._drop(*order.popleft(), "evicted")

    def match(self, keys: Sequence[int], now_s: float) -> PeerRouteMatch | None:
        """Per worker, the longest prompt a peer routed there that ``keys`` extends (None: none)."""
        if self._order:
            self._expire(now_s)
        by_key = self._by_key
        if not by_key:
            return None
        n = len(keys)
        depth: dict[str, int] = {}
        for p in reversed(_anchor_positions(n)):
            ws = by_key.get(keys[p - 1])
            if ws is None:
                continue
            for w, (exp, pages, tip) in ws.items():
                # only a request that contains the whole routed prompt counts (see the module
                # docstring): the anchor found it, the route's last page proves it
                if exp > now_s and w not in depth and pages <= n and keys[pages - 1] == tip:
                    depth[w] = pages
        if not depth:
            return None
        self.stats["matches"] += 1
        return PeerRouteMatch(n, depth)

    def remove_worker(self, worker_id: str) -> None:
        """Forget every anchor of ``worker_id`` (it left the pool)."""
        for k in [k for k, ws in self._by_key.items() if worker_id in ws]:
            ws = self._by_key[k]
            del ws[worker_id]
            if not ws:
                del self._by_key[k]

    def _expire(self, now_s: float) -> None:
        gone = []
        for src, order in self._order.items():
            while order and order[0][0] <= now_s:
                self._drop(*order.popleft(), "expired")
            if not order:
                gone.append(src)
        for src in gone:  # a quiet source frees its slot
            del self._order[src]

    def _drop(self, exp: float, k: int, w: str, why: str) -> None:
        ws = self._by_key.get(k)
        e = ws.get(w) if ws is not None else None
        if e is None or e[0] != exp:
            return  # gone already, or refreshed by a later route (whose entry is still queued)
        del ws[w]
        if not ws:
            del self._by_key[k]
        self.stats[why] += 1
