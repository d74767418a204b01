"""Hand-made fleet views for the pure policy tests (test_policies, test_cache_aware_coherence)."""

from __future__ import annotations

from mesh.load import LoadStat
from mesh.routing.view import RouteRequest, WorkerState


def ws(wid: str, *, running=0, waiting=0, wu=0, used=0, cap=400_000, inflight=0, at=0.0) -> WorkerState:
    """A worker whose LoadStat at ``at`` says what the keywords say (``wu``: uncached tokens waiting)."""
    w = WorkerState(wid, inflight=inflight)
    w.update_load([LoadStat(running, waiting, used, cap, 0, wu, used, 256, 0, 0)], at)
    w.inflight_at_load = inflight
    return w


def req(L=2048, bs=16) -> RouteRequest:
    """A request of ``L`` prompt tokens (ids 0..L-1)."""
    return RouteRequest("r", prompt_tokens=L, block_size=bs, tokens=list(range(L)))
