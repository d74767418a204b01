"""Prefix providers: where the cache-aware policies get their per-worker match signal.

* ``radix_tree`` (:class:`LocalIndexProvider`): a router-local :class:`~mesh.index.PrefixIndex`
  fed by the KV events workers send, plus speculative insert-on-route entries (short TTL, kept
  apart from event-fed entries and closed when the real event arrives).
* ``approx`` (:class:`ApproxProvider`): for workers that publish no events; learns only from this
  router's own decisions, entries expire after a TTL (like SGLang SMG's approximate tree).
* ``indexer``: the same event-fed index shared by every router. In the simulator that is a
  :class:`LocalIndexProvider` over one shared ``PrefixIndex`` object; in the broker it is the
  gRPC client in :mod:`mesh.indexer` (same contract).

All providers key the index by the router's own content keys (:func:`mesh.hashing.content_keys`)
recomputed from the token ids carried in ``BlockStored``; engine hashes are only ids for parent
links and removals, so SGLang signed, vLLM unsigned and salted hashes all work. Cache namespaces
(LoRA adapter, cache salt, extra key: ``mesh.namespaces``) are chains with their own root key, on
the request side (:func:`request_keys`) and on the event side (a root ``BlockStored`` naming a
``lora_name`` / ``cache_salt``); speculation and ``approx`` store request keys, so they keep
namespaces apart too. The event-side rules (sequencing, epochs, resync, block-size vote) are
:class:`mesh.index.ingest.KvIngest`'s, shared with the indexer service. Pure code: no I/O,
no clock (``now_s`` is passed in).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from mesh import kv_events as KV
from mesh.hashing import ROOT_KEY, content_keys, content_keys_from_packed, packed_bytes
from mesh.index import ApproxIndex, PrefixIndex
from mesh.index.ingest import BlockSizeVote, KvIngest
from mesh.index.peer_routes import PeerRoutes
from mesh.namespaces import namespace_root_key
from mesh.routing.view import RouteRequest

__all__ = ["LocalIndexProvider", "ApproxProvider", "PeerRouteSharing", "make_provider", "PROVIDERS", "request_keys"]


def request_keys(req: RouteRequest, block_size: int) -> Sequence[int] | None:
    """The request's content keys at ``block_size`` (computed once and cached on the request),
    chained from its cache namespace's root (``mesh.namespaces``; ROOT_KEY for plain requests)."""
    if req.keys is not None and req.block_size == block_size:
        return req.keys
    root = ROOT_KEY if req.namespace is None else namespace_root_key(req.namespace)
    if req.packed is not None:
        p = req.packed
        req.keys = content_keys_from_packed(p if isinstance(p, bytes) else packed_bytes(p), block_size, root)
    elif req.tokens is not None:
        req.keys = content_keys(req.tokens, block_size, root)
    else:
        return None
    req.block_size = block_size
    return req.keys


class MergedMatch:
    """Per-worker max of two match views (a shared event-fed index + this router's speculation)."""

    __slots__ = ("a", "b")

    def __init__(self, a, b) -> None:
        self.a, self.b = a, b

    @property
    def query_blocks(self) -> int:
        return self.a.query_blocks

    @property
    def best_blocks(self) -> int:
        return max(self.a.best_blocks, self.b.best_blocks)

    def matched_blocks(self, worker_id: str) -> int:
        return max(self.a.matched_blocks(worker_id), self.b.matched_blocks(worker_id))

    def rank_blocks(self, worker_id: str) -> dict[int, int]:
        """Per DP rank, the deeper of the two views' event-fed matches (speculation has no rank)."""
        out: dict[int, int] = {}
        for m in (self.a, self.b):
            ranks = getattr(m, "rank_blocks", None)
            for r, d in (ranks(worker_id) if ranks is not None else {}).items():
                if d > out.get(r, 0):
                    out[r] = d
        return out

    def lower_tier_blocks(self, worker_id: str) -> tuple[int, int]:
        """The event-fed view's ``(host, store)`` blocks (:mod:`mesh.index.tiers`); what only the
        other view vouches for was just routed there, on the device."""
        f = getattr(self.a, "lower_tier_blocks", None)
        return f(worker_id) if f is not None else (0, 0)

    def top(self, k: int) -> list:
        best: dict[str, Any] = {}
        for m in (*self.a.top(k), *self.b.top(k)):
            cur = best.get(m.worker_id)
            if cur is None or m.blocks > cur.blocks:
                best[m.worker_id] = m
        return sorted(best.values(), key=lambda m: (-m.blocks, m.worker_id))[:k]


class PeerRouteSharing:
    """Insert-on-route guesses shared with the other routers (:mod:`mesh.index.peer_routes`).

    A provider that speculates (``speculative_ttl_s`` > 0) tells :attr:`route_listener` (set by
    the owner of the exchange: the broker's, or the simulator's publisher) the keys of every
    prompt it routes, and answers matches from the peers' routes too (:meth:`add_peer_routes`),
    for one speculative TTL. Without an exchange both stay unset and cost nothing."""

    route_listener: Callable[[str, Sequence[int]], None] | None = None
    peer_routes: PeerRoutes | None = None

    def peer_route_ttl_s(self) -> float:
        return getattr(self, "speculative_ttl_s", 0.0)

    def add_peer_routes(self, routes: Sequence[tuple[str, int, Sequence[int]]], now_s: float, source: str = "") -> None:
        """Take the prompts peer ``source`` routed: ``(worker_id, pages, anchors)`` each (each
        source's share of the table is bounded apart: :class:`PeerRoutes`)."""
        ttl = self.peer_route_ttl_s()
        if ttl <= 0 or not routes:
            return
        pr = self.peer_routes
        if pr is None:
            pr = self.peer_routes = PeerRoutes(ttl)
        for wid, pages, anchors in routes:
            pr.add(wid, pages, anchors, now_s, source)

    def _tell_peers(self, worker_id: str, keys: Sequence[int] | None) -> None:
        if self.route_listener is not None and keys:
            self.route_listener(worker_id, keys)

    def _with_peer_routes(self, m, keys: Sequence[int] | None, now_s: float):
        pr = self.peer_routes
        if pr is None or not keys:
            return m
        pm = pr.match(keys, now_s)
        if pm is None:
            return m
        return pm if m is None else MergedMatch(m, pm)

    def _forget_peer_routes(self, worker_id: str) -> None:
        if self.peer_routes is not None:
            self.peer_routes.remove_worker(worker_id)

    def peer_route_stats(self) -> dict[str, int]:
        """``peer_routes_<what>`` counters (routes, anchors, matches, expired, evicted,
        bad_routes) and ``peer_routes_entries``; empty without an exchange."""
        pr = self.peer_routes
        if pr is None:
            return {}
        return {"peer_routes_entries": len(pr), **{f"peer_routes_{k}": v for k, v in pr.stats.items()}}


class LocalIndexProvider(PeerRouteSharing):
    """Event-fed prefix index (``radix_tree``), optionally shared by several routers (``indexer``).

    ``speculative_ttl_s`` > 0 enables insert-on-route entries; 0 disables them.
    """

    def __init__(self, index: PrefixIndex | None = None, *, name: str = "radix_tree", block_size: int = 16,
                 speculative_ttl_s: float = 5.0, max_entries: int | None = 20_000_000) -> None:
        self.name = name
        self.shared = index is not None
        self.index = index if index is not None else PrefixIndex(max_entries, key_fn=content_keys, spec_ttl_s=speculative_ttl_s or 5.0)
        if self.index.key_fn is None:
            self.index.key_fn = content_keys
        self.speculative_ttl_s = speculative_ttl_s
        # A shared index must not carry one router's guesses: speculation stays router-local.
        self._local_spec = ApproxIndex(max_entries=1_000_000, default_ttl_s=speculative_ttl_s or 5.0) if self.shared else None
        self.ingest = KvIngest(self.index, block_size=block_size)
        self.counters = self.ingest.counters

    @property
    def block_size(self) -> int:
        return self.ingest.block_size

    # ------------------------------------------------------------------ routing side
    def match(self, req: RouteRequest, now_s: float):
        keys = request_keys(req, self.block_size)
        if keys is None:
            return None
        m = self.index.match(keys, now_s)
        if self._local_spec is not None and self.speculative_ttl_s > 0:
            m = MergedMatch(m, self._local_spec.match(keys, now_s))
        return self._with_peer_routes(m, keys, now_s)

    def on_routed(self, req: RouteRequest, worker_id: str, now_s: float) -> None:
        if self.speculative_ttl_s > 0:
            keys = request_keys(req, self.block_size)
            if keys:
                if self._local_spec is not None:
                    self._local_spec.insert(worker_id, keys, now_s, self.speculative_ttl_s)
                else:
                    self.index.speculate(worker_id, keys, now_s, self.speculative_ttl_s)
                self._tell_peers(worker_id, keys)

    # ------------------------------------------------------------------ fleet side
    def add_worker(self, worker_id: str, block_size: int) -> None:
        self.ingest.add_worker(worker_id, block_size)

    def remove_worker(self, worker_id: str) -> None:
        self.ingest.remove_worker(worker_id)
        if self._local_spec is not None:
            self._local_spec.remove_worker(worker_id)
        self._forget_peer_routes(worker_id)

    def apply_events(self, worker_id: str, dp_rank: int, epoch: int, seq: int, events: Sequence[KV.KvEvent], now_s: float) -> str | None:
        """Apply one ordered batch of a (worker, rank) stream (:meth:`KvIngest.apply_events`).
        Returns a resync reason or None."""
        return self.ingest.apply_events(worker_id, dp_rank, epoch, seq, events, now_s)

    # ------------------------------------------------------------------ broker adapter
    def on_worker_ready(self, ready) -> None:
        self.add_worker(ready.worker_id, ready.block_size)

    def on_worker_removed(self, worker_id: str) -> None:
        self.remove_worker(worker_id)

    def on_kv_events(self, worker_id: str, msg, now_s: float = 0.0) -> list[tuple[int, str]]:
        """Broker entry point: decode a KV_EVENTS message (tolerantly) and apply it."""
        events = self.ingest.decode(msg.events)
        why = self.apply_events(worker_id, msg.dp_rank, msg.epoch, msg.seq, events, now_s)
        return [(msg.dp_rank, why)] if why else []

    def kv_slices(self, worker_id: str, msg, now_s: float = 0.0, step: int = 1024):
        """:meth:`on_kv_events` in slices of at most ``step`` blocks
        (:meth:`KvIngest.batch_slices`): a generator that yields each slice's blocks (so a broker
        can serve and heartbeat while a big batch is applied) and returns the resync requests."""
        why = yield from self.ingest.batch_slices(worker_id, msg.dp_rank, msg.epoch, msg.seq, msg.events, now_s, step)
        return [(msg.dp_rank, why)] if why else []

    def stats(self) -> dict[str, Any]:
        return {**self.ingest.stats(), **self.peer_route_stats()}


class ApproxProvider(PeerRouteSharing):
    """Learns from routing decisions only (no KV events): a prompt sent to a worker is assumed
    cached there for ``ttl_s`` (and, with the exchange, a prompt a peer router sent there)."""

    def __init__(self, *, block_size: int = 16, ttl_s: float = 120.0, max_entries: int = 2_000_000) -> None:
        self.name = "approx"
        self.ttl_s = ttl_s
        self.index = ApproxIndex(max_entries=max_entries, default_ttl_s=ttl_s)
        self._bs = BlockSizeVote(block_size)

    @property
    def block_size(self) -> int:
        return self._bs.value

    def match(self, req: RouteRequest, now_s: float):
        keys = request_keys(req, self.block_size)
        if keys is None:
            return None
        return self._with_peer_routes(self.index.match(keys, now_s), keys, now_s)

    def on_routed(self, req: RouteRequest, worker_id: str, now_s: float) -> None:
        keys = request_keys(req, self.block_size)
        if keys:
            self.index.insert(worker_id, keys, now_s, self.ttl_s)
            self._tell_peers(worker_id, keys)

    def peer_route_ttl_s(self) -> float:
        return self.ttl_s

    def add_worker(self, worker_id: str, block_size: int) -> None:
        self._bs.set(worker_id, block_size)

    def remove_worker(self, worker_id: str) -> None:
        self._bs.drop(worker_id)
        self.index.remove_worker(worker_id)
        self._forget_peer_routes(worker_id)

    def apply_events(self, worker_id, dp_rank, epoch, seq, events, now_s) -> str | None:
        return None  # approx ignores engine events by design

    def on_worker_ready(self, ready) -> None:
        self.add_worker(ready.worker_id, ready.block_size)

    def on_worker_removed(self, worker_id: str) -> None:
        self.remove_worker(worker_id)

    def on_kv_events(self, worker_id: str, msg, now_s: float = 0.0) -> list[tuple[int, str]]:
        return []

    def stats(self) -> dict[str, Any]:
        return {**self.index.stats(), **self.peer_route_stats()}


PROVIDERS = ("radix_tree", "approx", "indexer")


def make_provider(name: str, *, block_size: int = 16, shared_index: PrefixIndex | None = None, **kw):
    """Build a provider by name. ``indexer`` here means "an index shared by all routers": pass the
    shared ``PrefixIndex`` (the broker's networked indexer client lives in mesh.indexer)."""
    if name == "radix_tree":
        return LocalIndexProvider(name="radix_tree", block_size=block_size, **kw)
    if name == "approx":
        return ApproxProvider(block_size=block_size, **kw)
    if name == "indexer":
        if shared_index is None:
            raise ValueError("the in-process indexer provider needs shared_index")
        return LocalIndexProvider(shared_index, name="indexer", block_size=block_size, **kw)
    raise ValueError(f"unknown cache prefix provider {name!r}; choose one of {', '.join(PROVIDERS)}")
