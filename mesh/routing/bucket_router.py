"""Bucket-aware routing: domain selection, admission, the two-pass search and PD pairing.

:class:`BucketRouter` is a drop-in replacement for :class:`mesh.routing.router.Router` (same
``route`` / ``release`` contract and bookkeeping) implementing SGLang #38108 + #38814
(``sglang-router-design.md`` §2-§4, §6.3, §15.1). Pure: no I/O, no clock reads.

One request, in order:

1. **SLO check**: an invalid ``ttft_slo_ms`` / ``tps_slo`` gives ``Decision(None, "bad_slo")``.
2. **Global cache winner** (#38814; only with a cache-aware policy and ``global_cache_winner``):
   the bounded candidate tournament of §6.3 over the *complete* prefill pool; an admitted winner
   is routed regardless of its bucket (reason ``cache_candidate``). Its own bucket's
   ``max_context_tokens`` is still honoured (a hard limit, not a preference).
3. **Prefill domains** (§2.1): compatible prefill buckets by input tokens L and TTFT SLO,
   ordered by rank and ``ttft_slo_policy``, intersected with the pool; no config = one global
   domain. In non-PD mode prefill buckets hold ``mixed`` workers, in PD mode ``prefill`` ones.
4. **Pass 1** (admitted only), per domain in order: the configured policy proposes a primary
   inside the domain, a power-of-two sample of the rest gives the backup; then
   ``primary`` / ``backup_pressure_guard`` (guard §3.4, only when the backup's uncached work is
   within ``cache_switch_margin_tokens`` of the primary's, so the guard never throws away a
   cache hit) / ``backup_primary_admission``; when neither is admitted, the policy runs again over
   the domain's admitted workers only (``range_fallback``). The first domain that yields wins.
5. **Pass 2**, only when pass 1 found nothing in any domain: power-of-two by prefill pressure
   in the first non-empty domain, ignoring admission (``capacity_fallback_power_of_two``).
6. **Decode** (PD only, after the prefill worker is final, chosen independently): compatible
   decode buckets by peak sequence S = L + max_new_tokens and TPS SLO (global pool when no
   decode bucket is configured; none when decode buckets exist but none fits), then the same
   two passes with decode pressure and ``kv_ok(S)`` admission. ``decode_policy``
   ``legacy_host_affinity`` first prefers admitted decode workers whose ``host`` label equals
   the prefill worker's.

``Decision.worker_id`` is None only when no compatible healthy (non-excluded) worker exists at
all: reasons ``no_worker`` (prefill side) and ``no_decode_worker``. ``detail`` carries
``bucket``, ``pass``, ``policy_reason``, ``cache`` (winner|none|rejected|off) and in PD
``decode_reason``, ``decode_bucket``, ``decode_kv_tokens`` and a ``bootstrap_room``.

Membership (explicit ids, then label selectors) is computed once per pool version (callers
pass the same list object until membership or health changes), so per-request domain lists
cost O(buckets), not O(workers).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Collection, Iterable, Sequence

from mesh.routing.admission import (
    LoadView,
    PressureGuard,
    Snapshot,
    admit_cache_candidate,
    admit_decode,
    admit_prefill,
    admitted_workers,
    least_decode_pressure,
    least_prefill_pressure,
    prefill_key,
)
from mesh.routing.buckets import BucketConfig, BucketSpec, SloError, decode_buckets_for, prefill_buckets_for, validate_slo
from mesh.routing.cache_policies import CacheAware
from mesh.routing.policies import MatchView, Policy
from mesh.routing.ranks import assign_rank
from mesh.routing.router import PrefixProvider, Router
from mesh.routing.view import Decision, RouteRequest, WorkerState

__all__ = ["BucketRouter", "Domain", "DECODE_POLICIES", "GLOBAL"]

DECODE_POLICIES = ("power_of_two", "legacy_host_affinity")
GLOBAL = "global"


@dataclass(slots=True)
class Domain:
    """A candidate domain: one bucket (or the global pool) intersected with the live pool."""

    id: str
    stage: str
    workers: list[WorkerState] = field(default_factory=list)
    by_id: dict[str, WorkerState] = field(default_factory=dict)
    max_pending_prefill_tokens: int | None = None

    def add(self, w: WorkerState) -> None:
        self.workers.append(w)
        self.by_id[w.worker_id] = w


class _Membership:
    """Who is where, for one pool version."""

    __slots__ = ("prefill", "decode", "prefill_domains", "decode_domains", "prefill_bucket_of")

    def __init__(self, pool: Sequence[WorkerState], cfg: BucketConfig | None, pd: bool) -> None:
        self.prefill = Domain(GLOBAL, "prefill")
        self.decode = Domain(GLOBAL, "decode")
        self.prefill_domains: dict[str, Domain] = {}
        self.decode_domains: dict[str, Domain] = {}
        self.prefill_bucket_of: dict[str, BucketSpec] = {}
        pre_role = "prefill" if pd else "mixed"
        specs = {"prefill": cfg.prefill if cfg else (), "decode": cfg.decode if cfg else ()}
        explicit = {st: {wid: b for b in specs[st] for wid in b.worker_ids} for st in specs}
        for st in specs:
            for b in specs[st]:
                (self.prefill_domains if st == "prefill" else self.decode_domains)[b.id] = Domain(
                    b.id, st, max_pending_prefill_tokens=b.max_pending_prefill_tokens)
        for w in pool:
            if not w.healthy:
                continue
            if w.role == pre_role:
                st, glob, doms = "prefill", self.prefill, self.prefill_domains
            elif pd and w.role == "decode":
                st, glob, doms = "decode", self.decode, self.decode_domains
            else:
                continue
            glob.add(w)
            b = explicit[st].get(w.worker_id)
            if b is None and w.labels:
                b = next((s for s in specs[st] if s.selects(w.labels)), None)
            if b is not None:
                doms[b.id].add(w)
                if st == "prefill":
                    self.prefill_bucket_of[w.worker_id] = b


@dataclass(slots=True)
class _Pick:
    worker: WorkerState
    reason: str
    domain: str
    pass_: int
    policy_reason: str | None = None
    policy_detail: dict | None = None  # the policy's own detail when its choice stood (prediction)


class BucketRouter:
    """Bucket domains + admission + two passes (+ PD pairing) around a policy (module docstring)."""

    def __init__(
        self,
        cfg: BucketConfig | None,
        policy: Policy,
        provider: PrefixProvider | None = None,
        *,
        rng: random.Random | None = None,
        freshness_s: float = 5.0,
        pd: bool = False,
        global_cache_winner: bool = True,
        decode_policy: str = "power_of_two",
        pressure_guard: bool = True,
        pressure_abs_threshold_tokens: int = 1024,
        pressure_abs_threshold_ms: float | None = None,
        pressure_rel_threshold: float = 1.5,
        cache_min_matched_tokens: int = 1024,
        cache_min_match_ratio: float | None = None,
        cache_candidate_min_workers: int = 8,
        cache_candidate_ratio: float = 0.05,
        cache_candidate_max_workers: int = 32,
        cache_switch_margin_tokens: int = 1024,
    ) -> None:
        if decode_policy not in DECODE_POLICIES:
            raise ValueError(f"unknown decode policy {decode_policy!r}; choose one of {', '.join(DECODE_POLICIES)}")
        self.cfg = cfg
        self.policy = policy
        self.audit = None  # Router.observe (shared below) feeds a regret audit; bucket routers run none
        self.provider = provider
        self.rng = rng or random.Random()
        self.freshness_s = freshness_s
        self.pd = pd
        self.global_cache_winner = global_cache_winner
        self.decode_policy = decode_policy
        self.guard = PressureGuard(pressure_guard, pressure_abs_threshold_tokens, pressure_abs_threshold_ms, pressure_rel_threshold)
        self.cache_min_matched_tokens = cache_min_matched_tokens
        self.cache_min_match_ratio = cache_min_match_ratio
        self.cache_candidate_min_workers = cache_candidate_min_workers
        self.cache_candidate_ratio = cache_candidate_ratio
        self.cache_candidate_max_workers = cache_candidate_max_workers
        self.cache_switch_margin_tokens = cache_switch_margin_tokens
        # Memberships of the pools routed over (the broker keeps one cached pool per model),
        # keyed by the pool object: rebuilt when a pool changes, dropped wholesale past a bound.
        self._memberships: dict[int, tuple[Sequence[WorkerState], int, _Membership]] = {}

    # ------------------------------------------------------------------ pool and membership

    @staticmethod
    def pool(workers: Iterable[WorkerState]) -> list[WorkerState]:
        """The routable pool: healthy workers of every role (callers cache this list)."""
        return [w for w in workers if w.healthy]

    def _members(self, pool: Sequence[WorkerState]) -> _Membership:
        hit = self._memberships.get(id(pool))
        if hit is not None and hit[0] is pool and hit[1] == len(pool):
            return hit[2]
        if len(self._memberships) >= 64:
            self._memberships.clear()
        m = _Membership(pool, self.cfg, self.pd)
        self._memberships[id(pool)] = (pool, len(pool), m)
        return m

    def members(self, pool: Sequence[WorkerState]) -> dict[str, list[str]]:
        """Bucket id -> worker ids for ``pool`` (``global`` entries list the whole role pools)."""
        m = self._members(pool)
        out = {d.id: [w.worker_id for w in d.workers] for d in (*m.prefill_domains.values(), *m.decode_domains.values())}
        out["global_prefill"] = [w.worker_id for w in m.prefill.workers]
        out["global_decode"] = [w.worker_id for w in m.decode.workers]
        return out

    def prefill_domains(self, req: RouteRequest, pool: Sequence[WorkerState]) -> list[Domain]:
        """Compatible non-empty prefill domains for ``req``, in search order."""
        m = self._members(pool)
        if self.cfg is None:
            return [m.prefill] if m.prefill.workers else []
        specs = prefill_buckets_for(self.cfg, req.prompt_tokens, req.ttft_slo_ms)
        return [d for d in (m.prefill_domains[b.id] for b in specs) if d.workers]

    def decode_domains(self, req: RouteRequest, pool: Sequence[WorkerState]) -> list[Domain]:
        """Compatible non-empty decode domains for ``req`` (PD), in search order."""
        m = self._members(pool)
        specs = None
        if self.cfg is not None:
            specs = decode_buckets_for(self.cfg, req.prompt_tokens, _peak(req), req.tps_slo)
        if specs is None:
            return [m.decode] if m.decode.workers else []
        return [d for d in (m.decode_domains[b.id] for b in specs) if d.workers]

    # ------------------------------------------------------------------ entry point

    def route(self, req: RouteRequest, pool: Sequence[WorkerState], now_s: float, exclude: Collection[str] = ()) -> Decision:
        """Choose the (prefill or mixed) worker and, in PD mode, the decode worker."""
        try:
            validate_slo(req.ttft_slo_ms, req.tps_slo)
        except SloError as exc:
            return Decision(None, "bad_slo", detail={"error": exc.message})
        m = self._members(pool)
        snap = Snapshot(now_s, self.freshness_s)
        L = req.prompt_tokens
        match: MatchView | None = None
        degraded = False
        if self.policy.needs_match and self.provider is not None and m.prefill.workers:
            match = self.provider.match(req, now_s)
            degraded = match is None or getattr(match, "incomplete", False)
        detail: dict = {}
        pick = None
        if self.policy.needs_match and self.global_cache_winner:
            if match is None:
                detail["cache"] = "none"
            else:
                pick, detail["cache"] = self._cache_candidate(req, m, match, snap, exclude)
        else:
            detail["cache"] = "off"
        if pick is None:
            domains = self.prefill_domains(req, pool)
            if not domains:
                return Decision(None, "no_worker", degraded=degraded, detail={**detail, "stage": "prefill", "why": "no compatible prefill bucket"})
            pick = self._select_prefill(req, domains, match, snap, exclude)
            if pick is None:
                return Decision(None, "no_worker", degraded=degraded, detail={**detail, "stage": "prefill", "why": "every compatible worker excluded"})
        dec = None
        if self.pd:
            ddoms = self.decode_domains(req, pool)
            dec = self._select_decode(req, ddoms, snap, exclude, pick.worker) if ddoms else None
            if dec is None:
                why = "no compatible decode bucket" if not ddoms else "every compatible decode worker excluded"
                return Decision(None, "no_decode_worker", degraded=degraded, detail={**detail, "stage": "decode", "why": why})
        w = pick.worker
        blocks = match.matched_blocks(w.worker_id) if match is not None else 0
        uncached = L - _hit_tokens(blocks, req)
        detail["bucket"] = pick.domain
        detail["pass"] = pick.pass_
        if pick.policy_reason is not None:
            detail["policy_reason"] = pick.policy_reason
        pdt = pick.policy_detail
        if pdt and "cost_x" in pdt:  # the prediction the policy acted on (calibration, observe)
            detail["cost_x"] = pdt["cost_x"]
            detail["predicted_ttft_ms"] = pdt.get("predicted_ttft_ms")
        detail["uncached_tokens"] = uncached
        d = Decision(w.worker_id, pick.reason, matched_blocks=blocks, degraded=degraded, uncached_tokens=uncached, detail=detail)
        w.record_dispatch(uncached, now_s)
        assign_rank(d, w, match, now_s, self.freshness_s)  # the prefill (or mixed) leg's rank
        if dec is not None:
            kv = _kv_tokens(req)
            d.decode_worker_id = dec.worker.worker_id
            detail["decode_reason"] = dec.reason
            detail["decode_bucket"] = dec.domain
            detail["decode_pass"] = dec.pass_
            detail["decode_kv_tokens"] = kv
            detail["bootstrap_room"] = self.rng.getrandbits(63)
            dec.worker.record_dispatch(kv, now_s)
        if self.provider is not None:
            self.provider.on_routed(req, w.worker_id, now_s)
        return d

    # the prefill (or mixed) leg's first reply teaches the policy, exactly as for the plain router
    observe = Router.observe

    @staticmethod
    def release(state: WorkerState, decision: Decision) -> None:
        """Undo :meth:`route`'s bookkeeping on one side (prefill/mixed or decode state)."""
        if decision.decode_worker_id is not None and state.worker_id == decision.decode_worker_id:
            state.record_release(decision.detail.get("decode_kv_tokens", 0))
        else:
            state.record_release(decision.uncached_tokens, decision.dp_rank)

    # ------------------------------------------------------------------ global cache winner (§6.3)

    def _cache_candidate(self, req, m: _Membership, match: MatchView, snap: Snapshot, exclude) -> tuple[_Pick | None, str]:
        n = len(m.prefill.workers)
        if n == 0:
            return None, "none"
        k = min(n, self.cache_candidate_max_workers,
                max(self.cache_candidate_min_workers, math.ceil(self.cache_candidate_ratio * n)))
        L = req.prompt_tokens
        by_id = m.prefill.by_id
        fetch = 2 * k + len(exclude)
        while True:
            tops = match.top(fetch)
            cands: list[tuple[WorkerState, int]] = []
            shallow = False
            for t in tops:
                hit = _hit_tokens(t.blocks, req)
                if hit <= 0 or hit < self.cache_min_matched_tokens or (
                        self.cache_min_match_ratio is not None and hit < self.cache_min_match_ratio * L):
                    shallow = True  # top() is deepest first: nothing after this passes the gate
                    break
                w = by_id.get(t.worker_id)
                if w is None or t.worker_id in exclude:
                    continue
                spec = m.prefill_bucket_of.get(t.worker_id)
                if spec is not None and spec.max_context_tokens is not None and L > spec.max_context_tokens:
                    continue
                cands.append((w, L - hit))
            if len(cands) >= k or shallow or len(tops) < fetch:
                break
            fetch *= 2
        if not cands:
            return None, "none"
        views = {w.worker_id: snap.view(w) for w, _ in cands}
        pkey = prefill_key(list(views.values()))
        cands.sort(key=lambda c: (c[1], pkey(views[c[0].worker_id])))
        cands = cands[:k]
        admitted = []
        for w, e in cands:
            spec = m.prefill_bucket_of.get(w.worker_id)
            if admit_cache_candidate(views[w.worker_id], L, e, spec.max_pending_prefill_tokens if spec else None):
                admitted.append((w, e))
        if not admitted:
            return None, "rejected"
        floor = min(e for _, e in admitted)
        margin = self.cache_switch_margin_tokens
        near = [c for c in admitted if c[1] <= floor + margin]
        near.sort(key=lambda c: (c[1], pkey(views[c[0].worker_id])))
        champ = near[0]
        for ch in near[1:]:
            cv, hv = views[champ[0].worker_id], views[ch[0].worker_id]
            if champ[1] - ch[1] > margin:
                champ = ch
            elif ch[1] - champ[1] > margin:
                continue
            elif self.guard.prefers(cv, hv):
                champ = ch
            elif self.guard.prefers(hv, cv):
                continue
            elif (ch[1], pkey(hv)) < (champ[1], pkey(cv)):
                champ = ch
        w = champ[0]
        spec = m.prefill_bucket_of.get(w.worker_id)
        return _Pick(w, "cache_candidate", spec.id if spec else GLOBAL, 1), "winner"

    # ------------------------------------------------------------------ prefill search (§4.2)

    def _select_prefill(self, req, domains: list[Domain], match, snap: Snapshot, exclude) -> _Pick | None:
        live = []
        for d in domains:
            cands = [w for w in d.workers if w.worker_id not in exclude] if exclude else d.workers
            if cands:
                live.append((d, cands))
        for d, cands in live:
            p = self._prefill_pass1(req, d, cands, match, snap, bool(exclude))
            if p is not None:
                return p
        for d, cands in live:
            two = self._sample2(cands, None)
            views = [snap.view(w) for w in two]
            best = least_prefill_pressure(views)
            return _Pick(_of(two, best), "capacity_fallback_power_of_two", d.id, 2)
        return None

    def _choose(self, req, cands, match, now_s, by_id):
        if isinstance(self.policy, CacheAware):
            return self.policy.choose(req, cands, match, now_s, by_id=by_id)
        return self.policy.choose(req, cands, match, now_s)

    def _prefill_pass1(self, req, d: Domain, cands: list[WorkerState], match, snap: Snapshot, filtered: bool) -> _Pick | None:
        L = req.prompt_tokens
        limit = d.max_pending_prefill_tokens
        pd_ = self._choose(req, cands, match, snap.now_s, None if filtered else d.by_id)
        primary = None
        if pd_.worker_id is not None:
            primary = d.by_id.get(pd_.worker_id) if not filtered else next((w for w in cands if w.worker_id == pd_.worker_id), None)
        if primary is not None:
            pv = snap.view(primary)
            p_ok = admit_prefill(pv, L, limit)
            two = self._sample2(cands, primary)
            backup = None
            if two:
                bvs = [snap.view(w) for w in two]
                backup = _of(two, least_prefill_pressure(bvs))
            b_ok = backup is not None and admit_prefill(snap.view(backup), L, limit)
            if p_ok:
                if b_ok and self.guard.prefers(pv, snap.view(backup)) and self._near_tie(req, match, primary, backup):
                    return _Pick(backup, "backup_pressure_guard", d.id, 1, pd_.reason)
                return _Pick(primary, "primary", d.id, 1, pd_.reason, pd_.detail)
            if b_ok:
                return _Pick(backup, "backup_primary_admission", d.id, 1, pd_.reason)
        admitted = admitted_workers(cands, snap.now_s, snap.freshness_s, L, L, limit)
        if not admitted:
            return None
        rd = self._choose(req, admitted, match, snap.now_s, None)
        w = next((x for x in admitted if x.worker_id == rd.worker_id), None)
        if w is None:  # a policy that declines: least pressured admitted worker
            w = _of(admitted, least_prefill_pressure([snap.view(x) for x in admitted]))
        return _Pick(w, "range_fallback", d.id, 1, rd.reason, rd.detail if w.worker_id == rd.worker_id else None)

    def _near_tie(self, req, match, primary: WorkerState, backup: WorkerState) -> bool:
        """The guard may move a request only when that costs at most the switch margin in cache."""
        if match is None:
            return True
        e_p = req.prompt_tokens - _hit_tokens(match.matched_blocks(primary.worker_id), req)
        e_b = req.prompt_tokens - _hit_tokens(match.matched_blocks(backup.worker_id), req)
        return e_b <= e_p + self.cache_switch_margin_tokens

    # ------------------------------------------------------------------ decode search (§4.3)

    def _select_decode(self, req, domains: list[Domain], snap: Snapshot, exclude, prefill: WorkerState) -> _Pick | None:
        T = _kv_tokens(req)
        live = []
        for d in domains:
            cands = [w for w in d.workers if w.worker_id not in exclude] if exclude else d.workers
            if cands:
                live.append((d, cands))
        host = prefill.labels.get("host") if self.decode_policy == "legacy_host_affinity" else None
        for d, cands in live:
            if host is not None:
                same = [snap.view(w) for w in cands if w.labels.get("host") == host]
                same = [v for v in same if admit_decode(v, T)]
                if same:
                    return _Pick(_of(cands, least_decode_pressure(same)), "host_affinity", d.id, 1)
            two = self._sample2(cands, None)
            views = [snap.view(w) for w in two]
            if all(admit_decode(v, T) for v in views):
                return _Pick(_of(two, least_decode_pressure(views)), "primary", d.id, 1)
            admitted = admitted_workers(cands, snap.now_s, snap.freshness_s, T)
            if admitted:
                best = least_decode_pressure([snap.view(w) for w in admitted])
                return _Pick(_of(cands, best), "range_fallback", d.id, 1)
        for d, cands in live:
            two = self._sample2(cands, None)
            views = [snap.view(w) for w in two]
            return _Pick(_of(two, least_decode_pressure(views)), "capacity_fallback_power_of_two", d.id, 2)
        return None

    # ------------------------------------------------------------------ sampling

    def _sample2(self, cands: Sequence[WorkerState], skip: WorkerState | None) -> list[WorkerState]:
        """Up to two distinct random candidates, never ``skip``."""
        n = len(cands)
        if skip is None:
            if n <= 2:
                return list(cands)
            i, j = self.rng.sample(range(n), 2)
            return [cands[i], cands[j]]
        if n <= 3:
            return [w for w in cands if w is not skip]
        while True:
            i, j = self.rng.sample(range(n), 2)
            a, b = cands[i], cands[j]
            if a is not skip and b is not skip:
                return [a, b]


# --------------------------------------------------------------------------- helpers


def _peak(req: RouteRequest) -> int | None:
    """Expected peak sequence tokens S (None when the request states no output limit)."""
    return None if req.max_new_tokens is None else req.prompt_tokens + req.max_new_tokens


def _kv_tokens(req: RouteRequest) -> int:
    """Decode admission size: L + max_new_tokens, or L when the output is unbounded."""
    s = _peak(req)
    return req.prompt_tokens if s is None else s


def _hit_tokens(blocks: int, req: RouteRequest) -> int:
    """Cached tokens for ``blocks`` matched blocks (the last prompt token is always computed)."""
    if not blocks:
        return 0
    return min(blocks * (req.block_size or 16), max(0, req.prompt_tokens - 1))


def _of(ws: Sequence[WorkerState], v: LoadView) -> WorkerState:
    for w in ws:
        if w.worker_id == v.worker_id:
            return w
    raise KeyError(v.worker_id)  # pragma: no cover - views always come from ws

