"""The broker's ``indexer`` prefix provider: the shared gRPC KV indexer, queried before routing.

It is *asynchronous* (``is_async``): for each request the broker awaits :meth:`prefetch` (one
``MatchPrefix`` with a deadline, bounded concurrency, replica failover and a circuit breaker in
:class:`mesh.indexer.client.IndexerClient`), then runs the usual synchronous routing, whose
:meth:`match` returns the prefetched answer. No answer (slow, overloaded, down, breaker open)
means a *degraded* decision by load only: an unavailable indexer costs cache affinity, never
availability.

KV events received by this broker are forwarded to every indexer replica (at least once, in
order, retried; overflow and gaps come back through ``on_resync`` as a RESYNC to the worker).
Speculative insert-on-route entries stay local to this broker (merged with the indexer answer),
so one router's guesses never pollute the shared index.
"""

from __future__ import annotations

from typing import Any

from mesh.index import ApproxIndex
from mesh.index.ingest import BlockSizeVote
from mesh.routing.providers import MergedMatch, PeerRouteSharing, request_keys
from mesh.routing.view import RouteRequest

__all__ = ["RemoteIndexProvider"]

_MATCH_KEY = "indexer_match"


class RemoteIndexProvider(PeerRouteSharing):
    name = "indexer"
    is_async = True

    def __init__(self, client: Any, *, block_size: int = 16, speculative_ttl_s: float = 5.0) -> None:
        self.client = client
        self._block_size = block_size
        self.speculative_ttl_s = speculative_ttl_s
        self.spec = ApproxIndex(max_entries=1_000_000, default_ttl_s=speculative_ttl_s or 5.0)
        self._bs = BlockSizeVote(block_size)
        self.broker = None  # set by the broker owner: used for spawn() and post()

    @property
    def block_size(self) -> int:
        return self._bs.value

    async def prefetch(self, req: RouteRequest) -> None:
        keys = request_keys(req, self.block_size)
        if keys is None:
            return
        req.extra[_MATCH_KEY] = await self.client.match(keys, self.block_size)

    def match(self, req: RouteRequest, now_s: float):
        remote = req.extra.get(_MATCH_KEY)
        if remote is None:
            return None  # degraded: route by load
        keys = request_keys(req, self.block_size)
        if self.speculative_ttl_s > 0 and keys:
            return self._with_peer_routes(MergedMatch(remote, self.spec.match(keys, now_s)), keys, now_s)
        return remote

    def on_routed(self, req: RouteRequest, worker_id: str, now_s: float) -> None:
        if self.speculative_ttl_s > 0:
            keys = request_keys(req, self.block_size)
            if keys:
                self.spec.insert(worker_id, keys, now_s, self.speculative_ttl_s)
                self._tell_peers(worker_id, keys)

    # broker event hooks ------------------------------------------------------------
    def on_worker_ready(self, ready) -> None:
        self._bs.set(ready.worker_id, ready.block_size)
        if self.broker is not None:
            self.broker.spawn(self.client.register_worker(ready.worker_id, ready.block_size))

    def on_worker_removed(self, worker_id: str) -> None:
        self._bs.drop(worker_id)
        self.spec.remove_worker(worker_id)
        self._forget_peer_routes(worker_id)
        # The indexer keeps the worker's blocks: another broker may still serve it, and a worker
        # restart arrives as a new epoch there. Forgetting is the indexer's own expiry's job.

    def on_kv_events(self, worker_id: str, msg, now_s: float = 0.0) -> list[tuple[int, str]]:
        self.client.forward(worker_id, msg.dp_rank, msg.epoch, msg.seq, msg.raw)
        return []

    def stats(self) -> dict[str, Any]:
        return {**self.client.stats(), **self.peer_route_stats()}
