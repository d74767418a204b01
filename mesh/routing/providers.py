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
namespaces apart too. Pure code: no I/O,
no clock (``now_s`` is passed in).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Sequence

from mesh import kv_events as KV
from mesh.hashing import ROOT_KEY, content_keys, content_keys_from_packed, packed_bytes
from mesh.index import ApproxIndex, Clear, PrefixIndex, Remove, Store, Verdict
from mesh.index.peer_routes import PeerRoutes
from mesh.namespaces import event_root_key, namespace_root_key
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

    def add_peer_routes(self, routes: Sequence[tuple[str, int, Sequence[int]]], now_s: float) -> None:
        """Take the prompts a peer routed: ``(worker_id, pages, anchors)`` each."""
        ttl = self.peer_route_ttl_s()
        if ttl <= 0 or not routes:
            return
        pr = self.peer_routes
        if pr is None:
            pr = self.peer_routes = PeerRoutes(ttl)
        for wid, pages, anchors in routes:
            pr.add(wid, pages, anchors, now_s)

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


class _BlockSizeVote:
    """The fleet's block size: the most common one among registered workers."""

    def __init__(self, default: int) -> None:
        self.default = default
        self.by_worker: dict[str, int] = {}
        self._value: int | None = None  # cached: read on every request, changed on membership

    def set(self, worker_id: str, bs: int) -> None:
        if self.by_worker.get(worker_id) != bs:
            self.by_worker[worker_id] = bs
            self._value = None

    def drop(self, worker_id: str) -> None:
        if self.by_worker.pop(worker_id, None) is not None:
            self._value = None

    @property
    def value(self) -> int:
        if self._value is None:
            self._value = Counter(self.by_worker.values()).most_common(1)[0][0] if self.by_worker else self.default
        return self._value


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
        self._bs = _BlockSizeVote(block_size)
        self.counters: Counter[str] = Counter()
        self.resync_retry_s = 5.0
        self._resync_pending: dict[tuple[str, int], float] = {}

    @property
    def block_size(self) -> int:
        return self._bs.value

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
        self._bs.set(worker_id, block_size)

    def remove_worker(self, worker_id: str) -> None:
        self._bs.drop(worker_id)
        self.index.remove_worker(worker_id)
        if self._local_spec is not None:
            self._local_spec.remove_worker(worker_id)
        self._forget_peer_routes(worker_id)

    def apply_events(self, worker_id: str, dp_rank: int, epoch: int, seq: int, events: Sequence[KV.KvEvent], now_s: float) -> str | None:
        """Apply one ordered batch of a (worker, rank) stream. Returns a resync reason or None.

        Duplicates and stale epochs are ignored; a gap marks the stream untrusted and asks for a
        resync (once per ``resync_retry_s`` while one is pending; live batches keep applying
        meanwhile, so the index under-reports but never over-reports); a resync snapshot (a
        batch that starts with AllBlocksCleared) re-trusts it.
        """
        return self._apply_batch(worker_id, dp_rank, epoch, seq, events, now_s)[0]

    def _apply_batch(self, worker_id: str, dp_rank: int, epoch: int, seq: int, events: Sequence[KV.KvEvent],
                     now_s: float) -> tuple[str | None, bool]:
        """:meth:`apply_events`, also saying whether the batch was applied (not a duplicate)."""
        stream = (worker_id, dp_rank)
        bs = self._bs.by_worker.get(worker_id, self.block_size)
        self.counters["batches"] += 1
        if events and type(events[0]) is KV.AllBlocksCleared and not self.index.is_trusted(stream):
            self.index.reset_stream(stream, epoch, seq)
            self._resync_pending.pop(stream, None)
            self.counters["resyncs_applied"] += 1
            self._apply(stream, events[1:], bs)
            return None, True
        v = self.index.begin_batch(stream, epoch, seq)
        if v.apply:  # begin_batch already advanced the stream: the batch must be applied
            self._apply(stream, events, bs)
        else:
            self.counters[str(v.verdict.value)] += 1
        if v.verdict is Verdict.GAP:
            self.counters["gaps"] += 1
        if not self.index.is_trusted(stream):
            last = self._resync_pending.get(stream)
            if last is None or now_s - last >= self.resync_retry_s:
                self._resync_pending[stream] = now_s
                return "gap", v.apply
        return None, v.apply

    def _apply(self, stream, events: Sequence[KV.KvEvent], bs: int) -> None:
        ops: list[Any] = []
        for ev in events:
            t = type(ev)
            if t is KV.BlockStored:
                if ev.block_size != bs:
                    self.counters["wrong_block_size"] += 1
                    continue
                if ev.unmatched_blocks:
                    self.counters["unmatched_blocks"] += ev.unmatched_blocks
                root = ROOT_KEY
                if ev.parent_block_hash is None and (ev.lora_name is not None or ev.cache_salt is not None):
                    root = event_root_key(ev.lora_name, ev.cache_salt)  # a namespaced root store
                ops.append(Store(ev.block_hashes, ev.parent_block_hash, token_ids=ev.token_ids, block_size=bs, root_key=root))
            elif t is KV.BlockRemoved:
                ops.append(Remove(ev.block_hashes))
            elif t is KV.AllBlocksCleared:
                ops.append(Clear())
        if ops:
            self.index.apply(stream, ops)

    # ------------------------------------------------------------------ broker adapter
    def on_worker_ready(self, ready) -> None:
        self.add_worker(ready.worker_id, ready.block_size)

    def on_worker_removed(self, worker_id: str) -> None:
        self.remove_worker(worker_id)

    def on_kv_events(self, worker_id: str, msg, now_s: float = 0.0) -> list[tuple[int, str]]:
        """Broker entry point: decode a KV_EVENTS message (tolerantly) and apply it."""
        events = self._decode(msg.events)
        why = self.apply_events(worker_id, msg.dp_rank, msg.epoch, msg.seq, events, now_s)
        return [(msg.dp_rank, why)] if why else []

    def kv_slices(self, worker_id: str, msg, now_s: float = 0.0, step: int = 1024):
        """:meth:`on_kv_events` in slices of ``step`` events: a generator that yields between
        slices (so a broker can serve and heartbeat while a 4 MB batch is applied) and returns
        the resync requests. The first slice decides, as for a whole batch, whether the batch
        is applied (sequence check); matches in between see a partly applied batch, which only
        under-reports."""
        raw = msg.events
        why, applied = self._apply_batch(worker_id, msg.dp_rank, msg.epoch, msg.seq, self._decode(raw[:step]), now_s)
        stream = (worker_id, msg.dp_rank)
        for start in range(step, len(raw) if applied else 0, step):
            yield
            bs = self._bs.by_worker.get(worker_id)
            if bs is None:
                break  # the worker left meanwhile: its entries are gone, do not re-add them
            self._apply(stream, self._decode(raw[start:start + step]), bs)
        return [(msg.dp_rank, why)] if why else []

    def _decode(self, raw: list) -> list[KV.KvEvent]:
        events, skipped = KV.decode_events(raw)
        for reason, n in skipped.items():
            self.counters[f"skipped_{reason}"] += n
        return events

    def stats(self) -> dict[str, Any]:
        return {**self.index.stats(), **{f"provider_{k}": v for k, v in self.counters.items()}, **self.peer_route_stats()}


class ApproxProvider(PeerRouteSharing):
    """Learns from routing decisions only (no KV events): a prompt sent to a worker is assumed
    cached there for ``ttl_s`` (and, with the exchange, a prompt a peer router sent there)."""

    def __init__(self, *, block_size: int = 16, ttl_s: float = 120.0, max_entries: int = 2_000_000) -> None:
        self.name = "approx"
        self.ttl_s = ttl_s
        self.index = ApproxIndex(max_entries=max_entries, default_ttl_s=ttl_s)
        self._bs = _BlockSizeVote(block_size)

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
