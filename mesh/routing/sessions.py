"""Session affinity: the turns of one session go to the same worker. Pure: no I/O, no clock.

A request may carry a session key (:attr:`mesh.protocol.Submit.session`; the HTTP ingress takes
it from ``x-session-id``, OpenAI's ``prompt_cache_key`` or ``user``, or SGLang's
``session_params.id``, see :func:`session_key`). :class:`SessionTable` maps the key's 64-bit
hash to the worker its session is pinned to, with a TTL (counted from the session's last use)
and a bounded size (least recently used evicted first, counted). :class:`SessionRouter` wraps
the broker's router (:class:`~mesh.routing.router.Router` or
:class:`~mesh.routing.bucket_router.BucketRouter`, same ``route`` / ``release`` contract):

* **off**: sessions are ignored.
* **soft** (the default): the first turn is routed by the policy and pinned; a later turn goes to
  the pinned worker while it is routable for this request (healthy, not excluded: not tried,
  not at its in-flight cap, serves the LoRA) and within the policy's imbalance bound (SGLang's:
  its pressure exceeds the least loaded candidate's by more than ``balance_abs_threshold``
  requests *and* ``balance_rel_threshold`` times, the policy's own values, 32 and 1.1 for
  policies without them). Otherwise the policy routes the turn and the session is re-pinned
  (counted ``repin_gone``, ``repin_excluded``, ``repin_imbalance``, ``repin_refused``).
* **hard** (engines that keep session state, e.g. SGLang's ``session_params``): always the
  pinned worker while it is registered and healthy. When it is gone the turn fails
  (``Decision(None, "session_worker_gone")``, the client gets ``no_worker``) and the pin is
  dropped, so the session's next request starts again on a worker the policy picks; when it
  lives but cannot take this request (at its cap, already tried) the decision is
  ``session_worker_busy`` and the broker waits (parks) or fails as for any busy worker.

Only the routing stage that keeps the session's state is pinned: the mixed worker, or in
prefill/decode mode the **decode** worker (its prefill worker is chosen by the policy each
turn). The pin is made by restricting that stage's candidates to the pinned worker and letting
the wrapped router do the rest, so buckets, admission, ranks and the provider's bookkeeping are
exactly those of an ordinary decision.

**Shared between routers.** Every pin this router makes or uses is offered to the peer exchange
(``listener(hash, worker_id, last_s)``: :meth:`mesh.routing.peers.PeerPublisher.note_session`);
a peer's pins arrive through :meth:`SessionTable.apply_remote` with their age, so any router
honours a session another pinned. A remote pin replaces a local one only when it is more
recent. Each peer may hold at most ``peer_share`` entries of the table (``size // (peers + 1)``
by default): a peer flooding pins cannot evict more than its share (``remote_over_share``).

Counters (``stats``, the broker's ``mesh_sessions{what}``): ``new``, ``hit``, ``repin_*``,
``hard_gone``, ``hard_busy``, ``evicted``, ``expired``, ``remote_applied``, ``remote_stale``,
``remote_over_share``.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Sequence

from mesh.protocol import MAX_SESSION_BYTES
from mesh.routing.view import Decision, RouteRequest, WorkerState

__all__ = ["MODES", "SOURCES", "SessionKeyError", "SessionRouter", "SessionTable", "over_imbalance_bound",
           "session_hash", "session_key", "with_sessions"]

MODES = ("off", "soft", "hard")
#: where the HTTP ingress may take a session key from, in order of precedence
SOURCES = ("header", "prompt_cache_key", "user", "session_params")
SESSION_HEADER = "x-session-id"
SWEEP_PER_ROUTE = 4  # expired pins dropped from the LRU end per routed request (bounded work)


def session_hash(key: str) -> int:
    """The 64-bit hash a session is known by in the table and on the exchange."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


class SessionKeyError(ValueError):
    """A session key the ingress refuses; ``field`` names where it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _digest(v: str) -> str:
    return "sha256:" + hashlib.sha256(v.encode("utf-8", "surrogatepass")).hexdigest()


def session_key(header: str | None, body: dict[str, Any], sources: Collection[str] = SOURCES) -> str | None:
    """The session key of one HTTP request from the first of ``sources`` that gives one.

    ``header`` is the ``x-session-id`` value: over :data:`~mesh.protocol.MAX_SESSION_BYTES` bytes
    or empty is a :class:`SessionKeyError`. The OpenAI body fields ``prompt_cache_key`` and
    ``user`` must be strings (else the error names them); longer ones are replaced by their
    SHA-256 (they are the client's own identifiers, sent as they are to the engine).
    ``session_params`` (SGLang ``/generate``) gives its ``id``."""
    for src in sources:
        if src == "header":
            if header is None:
                continue
            if not header or len(header.encode("utf-8", "surrogatepass")) > MAX_SESSION_BYTES:
                raise SessionKeyError(SESSION_HEADER, f"must be 1..{MAX_SESSION_BYTES} bytes")
            return header
        if src == "session_params":
            sp = body.get("session_params")
            v = sp.get("id") if isinstance(sp, dict) else None
            field = "session_params.id"
        else:
            v = body.get(src)
            field = src
        if v is None:
            continue
        if type(v) is not str:
            raise SessionKeyError(field, f"must be a string, got {type(v).__name__}")
        if not v:
            continue
        return v if len(v.encode("utf-8", "surrogatepass")) <= MAX_SESSION_BYTES else _digest(v)
    return None


def over_imbalance_bound(load: float, lo: float, abs_threshold: float, rel_threshold: float) -> bool:
    """SGLang's imbalance bound, as the cache-aware policies apply it: ``load`` exceeds the least
    loaded ``lo`` by more than ``abs_threshold`` requests and ``rel_threshold`` times."""
    return load - lo > abs_threshold and load > lo * rel_threshold


@dataclass(slots=True)
class _Pin:
    worker_id: str
    last_s: float
    origin: str | None  # None: this router; else the peer broker id it came from


class SessionTable:
    """Session hash -> pinned worker, with a TTL from last use and an LRU size bound."""

    def __init__(self, ttl_s: float, max_size: int, *, peer_share: int | None = None, peers: int = 1) -> None:
        if not ttl_s > 0:
            raise ValueError("session_ttl_s must be > 0")
        if max_size < 1:
            raise ValueError("session_table_size must be >= 1")
        self.ttl_s = ttl_s
        self.max_size = max_size
        self.peer_share = peer_share if peer_share is not None else max(1, max_size // (max(1, peers) + 1))
        self._pins: OrderedDict[int, _Pin] = OrderedDict()  # least recently used first
        self._by_origin: Counter[str] = Counter()  # remote entries per peer
        self.stats: Counter[str] = Counter()
        self.listener: Callable[[int, str, float], None] | None = None  # local pins, to the exchange

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, h: int, now_s: float) -> str | None:
        """The worker session ``h`` is pinned to, or None (an expired pin is dropped)."""
        p = self._pins.get(h)
        if p is None:
            return None
        if now_s - p.last_s > self.ttl_s:
            self._remove(h, p)
            self.stats["expired"] += 1
            return None
        return p.worker_id

    def pin(self, h: int, worker_id: str, now_s: float) -> None:
        """This router sent session ``h`` to ``worker_id`` at ``now_s`` (a new pin or a use)."""
        self._put(h, self._pins.get(h), worker_id, now_s, None)
        if self.listener is not None:
            self.listener(h, worker_id, now_s)

    def drop(self, h: int) -> None:
        p = self._pins.get(h)
        if p is not None:
            self._remove(h, p)

    def sweep(self, now_s: float, budget: int = SWEEP_PER_ROUTE) -> int:
        """Drop up to ``budget`` expired pins from the least recently used end."""
        n = 0
        while n < budget and self._pins:
            h, p = next(iter(self._pins.items()))
            if now_s - p.last_s <= self.ttl_s:
                break
            self._remove(h, p)
            self.stats["expired"] += 1
            n += 1
        return n

    def apply_remote(self, peer: str, pins: Iterable[tuple[int, str, int]], now_s: float) -> int:
        """Pins a peer router made or used (``(hash, worker_id, age_ms)``); returns how many were
        applied. Older than what this table knows, expired, or past the peer's share: skipped."""
        applied = 0
        for h, wid, age_ms in pins:
            last_s = now_s - age_ms / 1000.0
            if now_s - last_s > self.ttl_s:
                self.stats["remote_stale"] += 1
                continue
            p = self._pins.get(h)
            if p is not None and p.last_s >= last_s:
                self.stats["remote_stale"] += 1
                continue
            if (p is None or p.origin != peer) and self._by_origin[peer] >= self.peer_share:
                self.stats["remote_over_share"] += 1
                continue
            self._put(h, p, wid, last_s, peer)
            applied += 1
        self.stats["remote_applied"] += applied
        return applied

    def remote_entries(self, peer: str) -> int:
        return self._by_origin[peer]

    def _put(self, h: int, p: _Pin | None, worker_id: str, last_s: float, origin: str | None) -> None:
        """Pin ``h`` (whose entry is ``p``, or None) to ``worker_id``, most recently used."""
        if p is None:
            self._make_room()
            self._pins[h] = _Pin(worker_id, last_s, origin)
        else:
            if p.origin is not None:
                self._by_origin[p.origin] -= 1
            p.worker_id, p.last_s, p.origin = worker_id, last_s, origin
            self._pins.move_to_end(h)
        if origin is not None:
            self._by_origin[origin] += 1

    def _make_room(self) -> None:
        while len(self._pins) >= self.max_size:
            h, p = next(iter(self._pins.items()))
            self._remove(h, p)
            self.stats["evicted"] += 1

    def _remove(self, h: int, p: _Pin) -> None:
        del self._pins[h]
        if p.origin is not None:
            self._by_origin[p.origin] -= 1
            if self._by_origin[p.origin] <= 0:
                del self._by_origin[p.origin]


def _sticky(d: Decision) -> str | None:
    """The worker a decision pins the session to: the decode worker in P/D, else the worker."""
    return d.decode_worker_id or d.worker_id


class SessionRouter:
    """The session stage around a router (module docstring); everything else is delegated."""

    def __init__(self, inner: Any, table: SessionTable, mode: str = "soft", *,
                 balance_abs_threshold: float | None = None, balance_rel_threshold: float | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"session_affinity must be one of {', '.join(MODES)}, not {mode!r}")
        self.inner = inner
        self.table = table
        self.mode = mode
        pol = inner.policy
        self.balance_abs_threshold = (balance_abs_threshold if balance_abs_threshold is not None
                                      else getattr(pol, "balance_abs_threshold", 32.0))
        self.balance_rel_threshold = (balance_rel_threshold if balance_rel_threshold is not None
                                      else getattr(pol, "balance_rel_threshold", 1.1))
        self.freshness_s = getattr(inner, "freshness_s", getattr(pol, "freshness_s", 5.0))

    def __getattr__(self, name: str) -> Any:  # policy, provider, pool, members, observe, release ...
        return getattr(self.inner, name)

    @property
    def stats(self) -> Counter[str]:
        return self.table.stats

    @property
    def session_table(self) -> SessionTable:
        return self.table

    def route(self, req: RouteRequest, pool: Sequence[WorkerState], now_s: float, exclude: Collection[str] = ()) -> Decision:
        key = req.session
        if key is None or self.mode == "off":
            return self.inner.route(req, pool, now_s, exclude)
        table = self.table
        table.sweep(now_s)
        h = session_hash(key)
        wid = table.get(h, now_s)
        if wid is None:
            return self._route_and_pin(req, pool, now_s, exclude, h, "new")
        pinned = next((w for w in pool if w.worker_id == wid), None)
        if pinned is None or not pinned.healthy:
            if self.mode == "hard":
                table.drop(h)
                table.stats["hard_gone"] += 1
                return Decision(None, "session_worker_gone",
                                detail={"session_error": f"session worker {wid} is gone (hard session affinity); "
                                               "the session's next request starts on another worker"})
            return self._route_and_pin(req, pool, now_s, exclude, h, "repin_gone")
        if wid in exclude:
            if self.mode == "hard":
                table.stats["hard_busy"] += 1
                return Decision(None, "session_worker_busy", detail={"session_error": f"session worker {wid} cannot take it"})
            return self._route_and_pin(req, pool, now_s, exclude, h, "repin_excluded")
        role = pinned.role
        if self.mode == "soft":
            fr = self.freshness_s
            mine = pinned.pressure(now_s, fr)
            # (no worker's load is below 0: under the absolute bound the scan cannot find an imbalance)
            if mine > self.balance_abs_threshold:
                lo = min(w.pressure(now_s, fr) for w in pool if w.role == role and w.worker_id not in exclude)
                if over_imbalance_bound(mine, lo, self.balance_abs_threshold, self.balance_rel_threshold):
                    return self._route_and_pin(req, pool, now_s, exclude, h, "repin_imbalance")
        others = {w.worker_id for w in pool if w.role == role and w is not pinned}  # excluded for this turn
        d = self.inner.route(req, pool, now_s, others.union(exclude) if exclude else others)
        if d.worker_id is not None:
            if _sticky(d) == wid:
                table.pin(h, wid, now_s)
                table.stats["hit"] += 1
                d.detail["session"] = "hit"
                return d
            # pinned at the other stage (a P/D router's pin names the decode worker; one of a
            # peer routing mixed workers named a prefill one): undo, and pin this router's way
            self._release(d, pool)
        elif d.reason == "bad_slo" or self.mode == "hard":
            return d  # hard: the pinned worker's bucket cannot take this request
        return self._route_and_pin(req, pool, now_s, exclude, h, "repin_refused")

    def _route_and_pin(self, req, pool, now_s: float, exclude, h: int, why: str) -> Decision:
        d = self.inner.route(req, pool, now_s, exclude)
        wid = _sticky(d)
        if d.worker_id is not None and wid is not None:
            self.table.pin(h, wid, now_s)
            self.table.stats[why] += 1
            d.detail["session"] = why
        return d

    def _release(self, d: Decision, pool: Sequence[WorkerState]) -> None:
        for w in pool:
            if w.worker_id in (d.worker_id, d.decode_worker_id):
                self.inner.release(w, d)


def with_sessions(router: Any, mode: str, ttl_s: float, table_size: int, *, peers: int = 1) -> Any:
    """``router`` wrapped in the session stage (``mode`` off: ``router`` itself)."""
    if mode not in MODES:
        raise ValueError(f"session_affinity must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off":
        return router
    return SessionRouter(router, SessionTable(ttl_s, table_size, peers=peers), mode)
