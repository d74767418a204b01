"""The live counterfactual regret audit of ``cache_aware``. Pure: no I/O, no clock.

For every decision ``cache_aware`` makes, :class:`RegretAudit` predicts -- with the calibrated TTFT
model the policy keeps (:meth:`mesh.routing.cache_policies.CacheAware.predicted_ttft_ms`, the
prediction the decision itself carries) -- the time to first token of the worker chosen and of
the workers ``power_of_two`` and ``cache_aware_greedy`` would have chosen **from the same view**:
the same candidates, the same matches (the hits the policy computed, tier-weighted as it weighs
them), the same loads (the request pressure it read). Per decision and baseline::

    regret_ms = predicted(baseline's pick) - predicted(cache_aware's pick)

positive when cache_aware's choice is predicted to be faster (it *saves* that much), negative
when the baseline would have done better; exactly 0 when both pick the same worker (no
prediction is made then).

* **greedy's pick** is SGLang's rule (:class:`~mesh.routing.cache_policies.CacheAwareGreedy`)
  over the policy's candidates: the least loaded worker when the fleet is over the imbalance
  bound, else the least loaded holder of more than ``cache_threshold`` of the prompt, else the
  least loaded worker (ties: lowest id). On pools larger than the policy's ``full_scan_max`` the
  policy scores a bounded sample (the deepest holders plus random others) and greedy is judged
  over that sample: its least loaded worker is the sample's, not the fleet's.
* **power_of_two's pick** is drawn: two distinct candidates from the audit's own seeded RNG
  (never the policy's: the audit must not change a single decision), the less loaded kept.
  Drawn rather than its expectation over all pairs because the expectation needs a prediction
  for every candidate (n predictions per decision, against the 10 us budget) while one draw
  needs one; the draw is an unbiased sample of that expectation, so the mean over a few hundred
  decisions -- what the gauge shows -- converges to it, and the histogram shows what p2c would
  actually have done decision by decision.

State is bounded: per baseline one fixed-bucket histogram (:data:`REGRET_BUCKETS_MS`), the
cumulative sum and count, and an exponentially weighted mean over about ``window`` decisions
(the exact mean until ``window`` decisions were seen). :meth:`RegretAudit.pays_ms` is the
"cache-aware pays X ms per request on this traffic" figure: that mean per baseline, and
``best``, the smaller of the two (against the better baseline).

**Cost (the sample).** An audit is one or two predictions; above ``large_pool`` (32)
candidates power-of-two's pick usually lies outside the policy's scored sample and its match is
looked up in the index. To keep the amortised cost within ``mesh bench routing``'s 10 us, the
audit predicts every ``every``-th decision of pools up to ``large_pool`` candidates (1: all) and
every ``every_large``-th (3) above: a deterministic systematic sample per pool class, each
audited decision standing for k decisions (weight k in the counts, the histogram, the sum and
the windowed mean), so the figures stay unbiased over a stream that mixes both classes.

**Observed figure.** :meth:`RegretAudit.observe` (``Router.observe``: the request's first
token came back) replaces cache_aware's predicted TTFT by the measured one on the decisions
where a baseline's pick differed: the prediction cache_aware chose by is the minimum of noisy
estimates and runs low; the baseline's pick was not selected by it. ``observed`` in
:meth:`~RegretAudit.snapshot` and :func:`merged_pays`.

**Limits (myopic).** The prediction is per decision: it does not see that a choice builds (or
spreads) the cache later requests hit, nor the queueing a choice causes for the requests after
it, and the counterfactual is judged on cache_aware's own state (a p2c fleet would hold its
prefixes elsewhere). docs/routing.md "Regret audit" says how far it matched the measured
difference in the quality matrix, and how much of the gap is the TTFT model's and how much what
no single decision shows (``mesh sim --regret-truth`` replays sampled decisions on copies of the
engines). ``shadow_rate`` (off by default) adds the shadow
counterfactual of :mod:`mesh.routing.regret_shadow`, which sees a baseline's own history.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from typing import Any, Protocol, Sequence

from mesh.routing.regret_shadow import ShadowAudit
from mesh.stats import LatencyHistogram
from mesh.routing.view import Decision, RouteRequest, WorkerState

__all__ = ["RegretAudit", "BaselineRegret", "REGRET_BUCKETS_MS", "BASELINES", "AUDIT_MODES", "audit_enabled", "merged_pays"]

#: the baselines judged, by policy name (labels of ``mesh_regret_ms``)
BASELINES = ("power_of_two", "cache_aware_greedy")
#: histogram bounds of one decision's regret in ms (signed: a baseline can be predicted faster)
REGRET_BUCKETS_MS = (-3000.0, -1000.0, -300.0, -100.0, -30.0, -10.0, -3.0, 0.0, 3.0, 10.0, 30.0, 100.0, 300.0,
                     1000.0, 3000.0, 10000.0)
#: values of ``--regret-audit``
AUDIT_MODES = ("on", "off")


def audit_enabled(mode: str) -> bool:
    """``--regret-audit``'s value as a bool (ValueError naming the field otherwise)."""
    if mode not in AUDIT_MODES:
        raise ValueError(f"regret_audit must be on or off, not {str(mode)[:40]!r}")
    return mode == "on"


class AuditedPolicy(Protocol):
    """What the audit reads from ``cache_aware`` (:class:`mesh.routing.cache_policies.CacheAware`)."""

    freshness_s: float
    cost: Any  # its CostModel (prefill_tokens_per_s: the rate of a worker that reported none)
    balance_abs_threshold: float
    balance_rel_threshold: float

    def last_view(self) -> tuple[list, dict[str, float] | None]: ...

    def predicted_ttft_ms(self, w: WorkerState, uncached: int, prompt_tokens: int, now_s: float) -> float: ...


class BaselineRegret:
    """One baseline's figures: histogram, cumulative sum and count, windowed mean, same picks.

    Every figure counts *decisions*: an audited decision that stands for ``weight`` decisions
    (the audit samples, :class:`RegretAudit`) adds ``weight`` to the counts, the histogram and
    the sum, and moves the windowed mean as ``weight`` equal decisions would. ``audited`` is how
    many were actually predicted."""

    __slots__ = ("hist", "n", "sum_ms", "mean_ms", "same", "alpha", "audited", "_keep")

    def __init__(self, window: int) -> None:
        self.hist = LatencyHistogram(REGRET_BUCKETS_MS)
        self.n = 0  # decisions stood for (the sum of the weights)
        self.audited = 0  # decisions predicted
        self.sum_ms = 0.0
        self.mean_ms = 0.0  # EWMA over ~window decisions (the exact mean while n < window)
        self.same = 0  # decisions where the baseline would have picked the same worker
        self.alpha = 1.0 / window
        self._keep: dict[int, float] = {}  # weight -> (1 - alpha) ** weight

    def add(self, regret_ms: float, weight: int = 1) -> None:
        h = self.hist
        h.counts[bisect_left(REGRET_BUCKETS_MS, regret_ms)] += weight
        h.sum_s += weight * regret_ms
        h.n += weight
        self.n += weight
        self.audited += 1
        self.sum_ms += weight * regret_ms
        if self.n * self.alpha >= 1.0:  # weight steps of the EWMA at once
            keep = self._keep.get(weight)
            if keep is None:
                keep = self._keep[weight] = (1.0 - self.alpha) ** weight
            self.mean_ms += (1.0 - keep) * (regret_ms - self.mean_ms)
        else:  # the exact (weighted) mean
            self.mean_ms += weight / self.n * (regret_ms - self.mean_ms)
        if regret_ms == 0.0:
            self.same += weight

    def snapshot(self) -> dict[str, float | int]:
        return {"decisions": self.n, "audited": self.audited, "pays_ms": round(self.mean_ms, 3),
                "mean_ms": round(self.sum_ms / self.n, 3) if self.n else 0.0, "same_pick": self.same}


class RegretAudit:
    """The counterfactual audit (module docstring). :meth:`record` is called by
    :meth:`mesh.routing.router.Router.route` right after cache_aware chose, before the dispatch
    is recorded (the view is the one the policy saw)."""

    def __init__(self, rng: random.Random | None = None, *, window: int = 1000, cache_threshold: float = 0.5,
                 every: int = 1, every_large: int = 3, large_pool: int = 32, shadow_rate: float | None = None) -> None:
        if type(window) is not int or window < 1:
            raise ValueError(f"regret window must be an int >= 1, not {window!r}")
        for name, v in (("every", every), ("every_large", every_large), ("large_pool", large_pool)):
            if type(v) is not int or v < 1:
                raise ValueError(f"regret {name} must be an int >= 1, not {v!r}")
        self.rng = rng or random.Random(0x2E6)
        self.cache_threshold = cache_threshold  # greedy's (SGLang's) holder threshold
        self.window = window
        self.baselines = {b: BaselineRegret(window) for b in BASELINES}
        self.skipped = 0  # decisions not audited (one candidate, or no prediction to compare)
        # The sample (module docstring, "Cost"): every k-th decision of each pool class is
        # audited and stands for k; pools above large_pool candidates cost more to audit.
        self.large_pool = large_pool
        self._every = (every, every_large)
        self._tick = [0, 0]
        self.unsampled = 0  # decisions the sample passed over (each audited one stands for k)
        self.observed_n = 0  # audited decisions whose outcome came back (weighted; observe())
        self.observed_sum = {b: 0.0 for b in BASELINES}
        # the shadow counterfactual (mesh.routing.regret_shadow); None: off
        self.shadow = None if shadow_rate is None else ShadowAudit(BASELINES, random.Random(self.rng.random()),
                                                                 rate=shadow_rate, cache_threshold=cache_threshold)

    # ------------------------------------------------------------------ record
    def record(self, policy: AuditedPolicy, req: RouteRequest, cands: Sequence[WorkerState], match: Any,
               decision: Decision, now_s: float) -> None:
        """Audit one decision of ``policy`` over ``cands`` (the candidates it was given), or
        pass over it (the sample)."""
        n = len(cands)
        if self.shadow is not None and decision.worker_id is not None:
            cm = policy.cost
            self.shadow.observe(req, cands, decision.worker_id, now_s, cm.prefill_tokens_per_s,
                                decision.detail.get("uncached_tokens"), cm.decode_base_ms + cm.prefill_overhead_ms)
        c = 1 if n > self.large_pool else 0
        k = self._every[c]
        if k > 1:  # a deterministic systematic sample: the k-th decision of its class stands for k
            t = self._tick[c] + 1
            if t < k:
                self._tick[c] = t
                self.unsampled += 1
                return
            self._tick[c] = 0
        chosen_ms = decision.detail.get("predicted_ttft_ms")
        scored, load = policy.last_view()
        if n < 2 or chosen_ms is None or not scored or not math.isfinite(chosen_ms):
            self.skipped += k
            return
        fr = policy.freshness_s
        if load is None:  # that choice did not read loads (cost-only mode): read them as it would
            load = {t[2]: t[4].pressure(now_s, fr) for t in scored}
        chosen = decision.worker_id
        L = req.prompt_tokens
        preds: dict[str, float] = {}

        def regret(wid: str, w: WorkerState, hit: int) -> float:
            if wid == chosen:
                return 0.0
            p = preds.get(wid)
            if p is None:
                p = preds[wid] = policy.predicted_ttft_ms(w, L - hit, L, now_s)
            return p - chosen_ms

        g = self._greedy(policy, scored, load, req, match)
        r_g = regret(g[2], g[4], g[3])
        wid, w, hit = self._p2c(cands, scored, load, req, match, now_s, fr, chosen)
        r_p = regret(wid, w, hit)
        if not (math.isfinite(r_g) and math.isfinite(r_p)):  # a NaN or infinite prediction (hostile telemetry)
            self.skipped += k
            return
        self.baselines["cache_aware_greedy"].add(r_g, k)
        self.baselines["power_of_two"].add(r_p, k)
        # for observe(): the baselines' predictions (None: the same pick) against the outcome, and
        # their picks (the simulator's one-step truth, mesh.lab.sim.regret_truth, reads them)
        decision.detail["regret_audit"] = (k, None if r_g == 0.0 else r_g + chosen_ms, None if r_p == 0.0 else r_p + chosen_ms,
                                           g[2], wid)

    def observe(self, decision: Decision, ttft_ms: float) -> None:
        """An audited decision's first token came after ``ttft_ms``: the *observed* figure
        (:attr:`observed`) charges each baseline its predicted TTFT minus cache_aware's measured
        one where the picks differ (0 where they agree), weighted as the decision. The measured
        side takes out the bias of a prediction that chose the minimum (cache_aware acted on its
        lowest estimate, so that estimate runs low; the baseline's pick was not chosen by it)."""
        a = decision.detail.get("regret_audit")
        if a is None or not isinstance(ttft_ms, (int, float)) or not math.isfinite(ttft_ms):
            return
        k = a[0]
        self.observed_n += k
        for b, pred in zip(("cache_aware_greedy", "power_of_two"), a[1:3]):
            if pred is not None:
                self.observed_sum[b] += k * (pred - ttft_ms)

    def _greedy(self, policy: AuditedPolicy, scored: list, load: dict[str, float], req: RouteRequest, match: Any):
        """cache_aware_greedy's pick among the scored candidates (module docstring): one pass."""
        bs = req.block_size or 16
        qb = max(1, (getattr(match, "query_blocks", 0) or 0) or math.ceil(req.prompt_tokens / bs))
        # a holder: more than cache_threshold of the query's blocks, i.e. ceil(hit / bs) > th x qb
        hot_above = bs * math.floor(self.cache_threshold * qb)
        lo_t = hot_t = None
        lo_l = hot_l = hi_l = 0.0
        for t in scored:
            ld = load[t[2]]
            if lo_t is None or ld < lo_l or (ld == lo_l and t[2] < lo_t[2]):
                lo_t, lo_l = t, ld
            if ld > hi_l:
                hi_l = ld
            if t[3] > hot_above and (hot_t is None or ld < hot_l or (ld == hot_l and t[2] < hot_t[2])):
                hot_t, hot_l = t, ld
        if hi_l - lo_l > policy.balance_abs_threshold and hi_l > lo_l * policy.balance_rel_threshold:
            return lo_t
        return hot_t if hot_t is not None else lo_t

    def _p2c(self, cands: Sequence[WorkerState], scored: list, load: dict[str, float], req: RouteRequest, match: Any,
             now_s: float, fr: float, chosen: str | None) -> tuple[str, WorkerState, int]:
        """power_of_two's pick: two distinct candidates from the audit's RNG, the less loaded
        (ties: lower id); its hit is looked up only when it is not cache_aware's pick."""
        n = len(cands)
        rnd = self.rng.random
        i = int(rnd() * n)
        j = int(rnd() * (n - 1))
        if j >= i:
            j += 1
        a, b = cands[i], cands[j]
        la, lb = load.get(a.worker_id), load.get(b.worker_id)
        if la is None:
            la = a.pressure(now_s, fr)
        if lb is None:
            lb = b.pressure(now_s, fr)
        w = a if (la, a.worker_id) <= (lb, b.worker_id) else b
        wid = w.worker_id
        if wid == chosen:
            return wid, w, 0
        k = i if w is a else j
        if len(scored) == n and scored[k][4] is w:  # small pools: scored[k] is cands[k] (the policy keeps the order)
            return wid, w, scored[k][3]
        for t in scored:
            if t[4] is w:
                return wid, w, t[3]
        hit = 0
        if match is not None:
            hit = min(match.matched_blocks(wid) * (req.block_size or 16), max(0, req.prompt_tokens - 1))
        return wid, w, hit

    # ------------------------------------------------------------------ read
    def pays_ms(self) -> dict[str, float]:
        """Per baseline the windowed mean regret (ms per request cache_aware saves against it;
        negative: it costs that much), and ``best``: against the better of the baselines.
        Empty before the first audited decision."""
        bl = self.baselines
        if not any(b.n for b in bl.values()):
            return {}
        out = {k: b.mean_ms for k, b in bl.items()}
        out["best"] = min(out.values())
        return out

    def snapshot(self) -> dict[str, Any]:
        """STATUS / telemetry / the simulator's arm result: per baseline its figures, the
        decisions skipped, and ``pays_ms`` (:meth:`pays_ms`, rounded)."""
        out = {"baselines": {k: b.snapshot() for k, b in self.baselines.items()}, "skipped": self.skipped,
               "unsampled": self.unsampled, "pays_ms": {k: round(v, 3) for k, v in self.pays_ms().items()}}
        if self.shadow is not None:
            out["shadow"] = self.shadow.snapshot()
        if self.observed_n:
            out["observed"] = {"decisions": self.observed_n, "pays_ms": self.observed_pays_ms()}
        return out

    def observed_pays_ms(self) -> dict[str, float]:
        """The observed figure (:meth:`observe`) per baseline and ``best``; empty before an outcome."""
        if not self.observed_n:
            return {}
        out = {b: round(v / self.observed_n, 3) for b, v in self.observed_sum.items()}
        out["best"] = min(out.values())
        return out


def merged_pays(audits: Sequence[RegretAudit | None]) -> dict[str, Any] | None:
    """Several routers' audits as one (the simulator's arm result): per baseline the decisions
    audited, the whole-run mean regret (``mean_ms``: cumulative, not windowed) and the same
    picks; ``pays_ms`` those means with ``best`` (the smaller); ``skipped``. None when no
    audit saw a decision (a policy other than cache_aware)."""
    live = [a for a in audits if a is not None]
    n = {b: sum(a.baselines[b].n for a in live) for b in BASELINES}
    if not live or not any(n.values()):
        return None
    out: dict[str, Any] = {"baselines": {}, "skipped": sum(a.skipped for a in live)}
    pays: dict[str, float] = {}
    for b in BASELINES:
        tot = math.fsum(a.baselines[b].sum_ms for a in live)
        mean_ms = tot / n[b] if n[b] else 0.0
        out["baselines"][b] = {"decisions": n[b], "mean_ms": round(mean_ms, 3),
                               "same_pick": sum(a.baselines[b].same for a in live)}
        pays[b] = round(mean_ms, 3)
    pays["best"] = min(pays.values())
    out["pays_ms"] = pays
    no = sum(a.observed_n for a in live)
    if no:  # the observed figure over every router's audited outcomes
        op = {b: round(math.fsum(a.observed_sum[b] for a in live) / no, 3) for b in BASELINES}
        op["best"] = min(op.values())
        out["observed"] = {"decisions": no, "pays_ms": op}
    sh = [a.shadow for a in live if a.shadow is not None and a.shadow.n]
    if sh:  # the shadow counterfactual over every router's shadowed requests
        ns = sum(s.n for s in sh)
        sp = {b: round(math.fsum(s.sum_ms[b] for s in sh) / ns, 3) for b in BASELINES}
        sp["best"] = min(sp.values())
        out["shadow"] = {"requests": ns, "pays_ms": sp}
    return out
