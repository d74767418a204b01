"""Admission, pressure orderings and the pressure guard (``sglang-router-design.md`` §3).

Pure code: every function takes the worker views it needs; nothing reads a clock.

* :class:`Snapshot` -- one per request: the :class:`LoadView` of each worker it touches, built
  once from fresh, complete LoadStat (§13.3) and reused for every decision on that request.
* Admission (§3.2): ``kv_ok(T)`` := ``running + 1 <= max_running_requests`` and
  ``num_total_tokens + T <= max_total_num_tokens``; a prefill worker in a domain also needs
  ``num_waiting_uncached_tokens + L <= max_pending_prefill_tokens`` when the domain sets it; a
  cache candidate uses its own uncached work ``E_i`` instead of ``L``; a decode worker needs
  ``kv_ok(L + max_new_tokens)``. A worker without fresh complete telemetry is **admitted**
  (fail-open) and compared by router-local load.
* Live correction (mesh addition): the snapshot is corrected by what this router dispatched or
  finished since it arrived (``inflight - inflight_at_load`` requests and
  ``pending_since_load_tokens`` uncached tokens), so a burst between two heartbeats cannot
  over-admit a worker.
* Pressure orderings (§3.3): prefill by ``estimated_prefill_queue_ms`` when every compared
  worker has it, else ``(waiting_uncached, waiting, running)``, then router-local load; decode
  by ``(waiting, running, kv_usage, used_tokens)``, then router-local load. When any compared
  worker lacks fresh data the whole comparison uses router-local load; ties break by worker id.
* Pressure guard (§3.4): a backup/challenger overrides the primary only when both the absolute
  gap (``> abs_tokens`` waiting uncached tokens, or ``> abs_ms`` of queue time when set and both
  report it) and the relative gap (``primary > backup * rel``) hold. Both need fresh data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from mesh.routing.view import WorkerState

__all__ = [
    "LoadView",
    "Snapshot",
    "PressureGuard",
    "kv_ok",
    "admit_prefill",
    "admit_cache_candidate",
    "admit_decode",
    "admitted_workers",
    "prefill_key",
    "decode_key",
    "least_prefill_pressure",
    "least_decode_pressure",
]


@dataclass(slots=True)
class LoadView:
    """One worker's load as the router sees it for one request (see module docstring)."""

    worker_id: str
    fresh: bool
    local: int  # router-local active load: this router's in-flight requests on the worker
    running: int = 0
    waiting: int = 0
    waiting_uncached: int = 0
    total_tokens: int = 0
    used_tokens: int = 0
    max_tokens: int = 0
    max_running: int = 0
    sent_since: int = 0  # requests this router dispatched since the snapshot (not yet in it)
    queue_ms: float | None = None

    @property
    def kv_usage(self) -> float:
        return self.used_tokens / self.max_tokens if self.max_tokens > 0 else 0.0

    @classmethod
    def of(cls, w: WorkerState, now_s: float, freshness_s: float) -> "LoadView":
        agg = w.fresh_load(now_s, freshness_s)
        if agg is None:
            return cls(w.worker_id, False, w.inflight)
        delta = w.inflight - w.inflight_at_load
        sent = delta if delta > 0 else 0
        done = -delta if delta < 0 else 0
        wu = agg.waiting_uncached_tokens + w.pending_since_load_tokens
        rate = w.prefill_tokens_per_s
        q = 1000.0 * wu / rate if rate else None
        return cls(w.worker_id, True, w.inflight, max(0, agg.running - done), agg.waiting + sent, wu,
                   agg.total_tokens + w.pending_since_load_tokens, agg.used_tokens, agg.max_tokens, agg.max_running,
                   sent, q)


class Snapshot:
    """Per-request cache of :class:`LoadView` objects (one telemetry snapshot per request)."""

    __slots__ = ("now_s", "freshness_s", "_views")

    def __init__(self, now_s: float, freshness_s: float) -> None:
        self.now_s = now_s
        self.freshness_s = freshness_s
        self._views: dict[str, LoadView] = {}

    def view(self, w: WorkerState) -> LoadView:
        v = self._views.get(w.worker_id)
        if v is None:
            v = self._views[w.worker_id] = LoadView.of(w, self.now_s, self.freshness_s)
        return v


# --------------------------------------------------------------------------- admission


def kv_ok(v: LoadView, kv_tokens: int) -> bool:
    """Room for one more running request holding ``kv_tokens`` (fail-open without fresh data)."""
    if not v.fresh:
        return True
    return v.running + v.sent_since + 1 <= v.max_running and v.total_tokens + kv_tokens <= v.max_tokens


def admit_prefill(v: LoadView, input_tokens: int, max_pending_prefill_tokens: int | None) -> bool:
    """A prefill (or mixed) worker in a domain: ``kv_ok(L)`` and the domain's queue limit on L."""
    if not v.fresh:
        return True
    if not kv_ok(v, input_tokens):
        return False
    return max_pending_prefill_tokens is None or v.waiting_uncached + input_tokens <= max_pending_prefill_tokens


def admit_cache_candidate(v: LoadView, input_tokens: int, uncached_tokens: int, max_pending_prefill_tokens: int | None) -> bool:
    """A global cache candidate: ``kv_ok(L)`` and the queue limit on its own uncached work E_i."""
    if not v.fresh:
        return True
    if not kv_ok(v, input_tokens):
        return False
    return max_pending_prefill_tokens is None or v.waiting_uncached + uncached_tokens <= max_pending_prefill_tokens


def admit_decode(v: LoadView, kv_tokens: int) -> bool:
    """A decode worker: ``kv_ok(L + max_new_tokens)`` (or ``kv_ok(L)`` when the output is unbounded)."""
    return kv_ok(v, kv_tokens)


def admitted_workers(workers: Sequence[WorkerState], now_s: float, freshness_s: float, kv_tokens: int,
                     queue_tokens: int = 0, max_pending: int | None = None) -> list[WorkerState]:
    """The admitted subset of ``workers``: ``kv_ok(kv_tokens)`` and, when ``max_pending`` is set,
    ``waiting_uncached + queue_tokens <= max_pending``. Same result as building a
    :class:`LoadView` per worker and calling :func:`admit_prefill` (``kv_tokens = queue_tokens = L``)
    or :func:`admit_decode`, but with an inline single-rank fast path: a saturated fleet is scanned
    whole on every request, so this loop is the hot one."""
    out = []
    for w in workers:
        load = w.load
        if len(load) != 1:
            v = LoadView.of(w, now_s, freshness_s)
            if not v.fresh or (kv_ok(v, kv_tokens) and (max_pending is None or v.waiting_uncached + queue_tokens <= max_pending)):
                out.append(w)
            continue
        ls = load[0]
        if (ls is None or now_s - w.load_at_s[0] > freshness_s or not ls.extended
                or ls.max_total_num_tokens <= 0 or ls.max_running_requests <= 0):
            out.append(w)  # fail open
            continue
        delta = w.inflight - w.inflight_at_load
        running = ls.num_running_reqs
        if delta < 0:
            running = running + delta if running + delta > 0 else 0
            delta = 0
        pend = w.pending_since_load_tokens
        if (running + delta + 1 <= ls.max_running_requests
                and ls.num_total_tokens + pend + kv_tokens <= ls.max_total_num_tokens
                and (max_pending is None or ls.num_waiting_uncached_tokens + pend + queue_tokens <= max_pending)):
            out.append(w)
    return out


# --------------------------------------------------------------------------- pressure orderings


def prefill_key(views: Sequence[LoadView]) -> Callable[[LoadView], tuple]:
    """Sort key for prefill pressure among ``views`` (lower = less pressured)."""
    if views and all(v.fresh for v in views):
        if all(v.queue_ms is not None for v in views):
            return lambda v: (v.queue_ms, v.local, v.worker_id)
        return lambda v: (v.waiting_uncached, v.waiting, v.running, v.local, v.worker_id)
    return lambda v: (v.local, v.worker_id)


def decode_key(views: Sequence[LoadView]) -> Callable[[LoadView], tuple]:
    """Sort key for decode pressure among ``views`` (lower = less pressured)."""
    if views and all(v.fresh for v in views):
        return lambda v: (v.waiting, v.running, v.kv_usage, v.used_tokens, v.local, v.worker_id)
    return lambda v: (v.local, v.worker_id)


def least_prefill_pressure(views: Sequence[LoadView]) -> LoadView:
    return min(views, key=prefill_key(views))


def least_decode_pressure(views: Sequence[LoadView]) -> LoadView:
    return min(views, key=decode_key(views))


# --------------------------------------------------------------------------- pressure guard


@dataclass(frozen=True, slots=True)
class PressureGuard:
    """§3.4 with SGLang's defaults (1024 tokens, ms variant unset, x1.5); ``enabled=False`` is
    ``--disable-pressure-guard``."""

    enabled: bool = True
    abs_tokens: int = 1024
    abs_ms: float | None = None
    rel: float = 1.5

    def prefers(self, primary: LoadView, backup: LoadView) -> bool:
        """True when ``backup`` should override ``primary`` (primary materially more pressured)."""
        if not self.enabled or not (primary.fresh and backup.fresh):
            return False
        if self.abs_ms is not None and primary.queue_ms is not None and backup.queue_ms is not None:
            p, b, gap = primary.queue_ms, backup.queue_ms, self.abs_ms
        else:
            p, b, gap = primary.waiting_uncached, backup.waiting_uncached, self.abs_tokens
        return p - b > gap and p > b * self.rel
