"""Online calibration of cache_aware's TTFT prediction. Pure: no I/O, no clock.

``cache_aware`` predicts a worker's time to first token from a handful of terms (see
:mod:`mesh.routing.cache_policies`); their constants describe one model on one GPU. This module
learns how the terms map to what actually happens on *this* fleet, from the outcomes the router
sees anyway (dispatch -> first reply), and says how far the prediction can be trusted.

Model: ``ttft_ms = theta . x`` with the features of one prediction

    x = (1, prefill_ms, step_ms, kv_full)

``prefill_ms`` is the queued plus own uncached prefill at the worker's measured (LoadStat) or
configured rate, ``step_ms`` the decode work sharing those chunks, ``kv_full`` 1 when the prompt
would not fit beside the worker's active KV. The prior ``theta`` is the fixed cost model
(overhead, 1, 1, penalty): with no observations the calibrated prediction is the old one.

Learning: recursive least squares with a forgetting factor (``forget``, memory about
``1 / (1 - forget)`` outcomes), started at the prior with a per-term prior variance, so a few
outcomes move the parameters only as far as they justify. Residuals are clipped (a request that
queued behind a burst the router could not see must not teach the model that prefill is 10x
slower) and every parameter stays inside a plausible range.

Trust: an exponentially weighted mean of the relative error of the predictions the policy acted
on (``|actual - predicted| / actual``). :attr:`trusted` is true once ``min_observations`` outcomes
were seen and that error is at most ``trust_rel_err``. ``cache_aware`` only lets the cost model
break ties while it is trusted and otherwise falls back to request counts (see its docstring):
where predictions are poor the policy degrades to the load/affinity rule, not to a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["TtftCalibrator", "CalibrationSettings", "TierCostLearner"]

N_FEATURES = 4
# plausible range of each fitted term: overhead ms, prefill multiplier, step multiplier, kv-full ms
# (the overhead may go negative: with the step term it fits the intercept of a steady fleet)
_BOUNDS = ((-1_000.0, 5_000.0), (0.0, 20.0), (0.0, 20.0), (0.0, 60_000.0))


@dataclass(frozen=True, slots=True)
class CalibrationSettings:
    """Knobs of :class:`TtftCalibrator` (defaults chosen on the quality matrix, docs/routing.md)."""

    forget: float = 0.998  # RLS forgetting factor: memory ~500 outcomes
    err_alpha: float = 0.02  # EWMA weight of one outcome in the relative-error estimate (~50)
    trust_rel_err: float = 0.10  # the cost model breaks ties only while its error is at most this
    min_observations: int = 32  # ... and after this many outcomes
    prior_sd: tuple[float, float, float, float] = (50.0, 0.5, 0.5, 1_000.0)  # prior std-dev per term


class TtftCalibrator:
    """Learns ``theta`` online and tracks the prediction error (module docstring)."""

    __slots__ = ("settings", "prior", "theta", "_p", "observations", "rel_err", "raw_rel_err", "fit_rel_err", "resets")

    def __init__(self, prior: Sequence[float], settings: CalibrationSettings | None = None) -> None:
        if len(prior) != N_FEATURES:
            raise ValueError(f"prior needs {N_FEATURES} terms, got {len(prior)}")
        self.settings = settings or CalibrationSettings()
        self.prior = tuple(float(v) for v in prior)
        self.resets = 0
        self._reset()
        self.observations = 0
        self.rel_err: float | None = None  # EWMA of the calibrated predictions' relative error
        self.raw_rel_err: float | None = None  # ... of the prior (fixed-constant) model's
        self.fit_rel_err: float | None = None  # ... and of the fitted model's (both on every outcome)

    def _reset(self) -> None:
        sd = self.settings.prior_sd
        self.theta = list(self.prior)
        self._p = [[(sd[i] ** 2 if i == j else 0.0) for j in range(N_FEATURES)] for i in range(N_FEATURES)]

    # ------------------------------------------------------------------ predict
    def predict(self, x: Sequence[float]) -> float:
        """Calibrated TTFT in ms for features ``x`` (never negative)."""
        t = self.theta
        v = t[0] * x[0] + t[1] * x[1] + t[2] * x[2] + t[3] * x[3]
        return v if v > 0.0 else 0.0

    def predict_prior(self, x: Sequence[float]) -> float:
        p = self.prior
        return p[0] * x[0] + p[1] * x[1] + p[2] * x[2] + p[3] * x[3]

    @property
    def use_fit(self) -> bool:
        """Whether the fitted parameters predict better than the prior so far (compared on the
        same outcomes): the prior stays in use where fitting does not pay (a fleet whose
        workload mixes regimes that one linear map cannot serve)."""
        return (self.observations >= self.settings.min_observations and self.fit_rel_err is not None
                and self.raw_rel_err is not None and self.fit_rel_err < self.raw_rel_err)

    def best(self, x: Sequence[float]) -> float:
        """The prediction the policy should act on: the fit's or the prior's (:attr:`use_fit`)."""
        return self.predict(x) if self.use_fit else self.predict_prior(x)

    @property
    def trusted(self) -> bool:
        s = self.settings
        err = self.fit_rel_err if self.use_fit else self.raw_rel_err
        return self.observations >= s.min_observations and err is not None and err <= s.trust_rel_err

    # ------------------------------------------------------------------ learn
    def observe(self, x: Sequence[float], actual_ms: float, predicted_ms: float | None = None) -> None:
        """One outcome: the request predicted from features ``x`` (``predicted_ms`` when the
        policy acted on it) got its first reply after ``actual_ms``. Bad values are ignored."""
        if len(x) != N_FEATURES or not (actual_ms >= 0.0) or actual_ms == float("inf"):
            return
        s = self.settings
        a = s.err_alpha
        denom = actual_ms if actual_ms > 1.0 else 1.0
        if predicted_ms is not None and predicted_ms >= 0.0:
            e = abs(actual_ms - predicted_ms) / denom
            self.rel_err = e if self.rel_err is None else (1 - a) * self.rel_err + a * e
        raw = abs(actual_ms - self.predict_prior(x)) / denom
        self.raw_rel_err = raw if self.raw_rel_err is None else (1 - a) * self.raw_rel_err + a * raw
        fit = abs(actual_ms - self.predict(x)) / denom  # the fit before it learns from this outcome
        self.fit_rel_err = fit if self.fit_rel_err is None else (1 - a) * self.fit_rel_err + a * fit
        self.observations += 1
        # RLS step (unrolled over the 4 terms: this runs once per request on a broker's loop)
        P = self._p
        t = self.theta
        x0, x1, x2, x3 = x
        r0, r1, r2, r3 = P
        px0 = r0[0] * x0 + r0[1] * x1 + r0[2] * x2 + r0[3] * x3
        px1 = r1[0] * x0 + r1[1] * x1 + r1[2] * x2 + r1[3] * x3
        px2 = r2[0] * x0 + r2[1] * x1 + r2[2] * x2 + r2[3] * x3
        px3 = r3[0] * x0 + r3[1] * x1 + r3[2] * x2 + r3[3] * x3
        lam = s.forget
        den = lam + x0 * px0 + x1 * px1 + x2 * px2 + x3 * px3
        if not den > 0.0:
            return
        k0, k1, k2, k3 = px0 / den, px1 / den, px2 / den, px3 / den
        pred = self.predict(x)
        resid = actual_ms - pred
        # clip (against the prior, not the moving prediction, so the bound cannot run away):
        # one burst the router could not see is not a new slope
        lim = max(50.0, self.predict_prior(x))
        if resid > lim:
            resid = lim
        elif resid < -lim:
            resid = -lim
        # No per-parameter clamping: projecting one parameter back while RLS believes it moved
        # makes the correlated ones (overhead vs step time: both near-constant on a steady fleet)
        # run away to compensate. The parameters move freely; a fit that leaves the plausible
        # range (_BOUNDS) is thrown away and learning restarts from the prior.
        t[0] += k0 * resid
        t[1] += k1 * resid
        t[2] += k2 * resid
        t[3] += k3 * resid
        for v, (lo, hi) in zip(t, _BOUNDS):
            if not (lo - 1.0 <= v <= hi):
                self.resets += 1
                self._reset()
                return
        # P <- (P - k Px^T) / lam (P stays symmetric: Px is P x)
        inv = 1.0 / lam
        for row, ki in ((r0, k0), (r1, k1), (r2, k2), (r3, k3)):
            row[0] = (row[0] - ki * px0) * inv
            row[1] = (row[1] - ki * px1) * inv
            row[2] = (row[2] - ki * px2) * inv
            row[3] = (row[3] - ki * px3) * inv
        # Forgetting inflates P along directions no outcome excites (a fleet that never fills its
        # KV says nothing about kv_full): scale the whole matrix back (keeps it positive
        # definite) once any variance exceeds 4x its prior.
        sd = s.prior_sd
        worst = max(r0[0] / (sd[0] * sd[0]), r1[1] / (sd[1] * sd[1]), r2[2] / (sd[2] * sd[2]), r3[3] / (sd[3] * sd[3]))
        if worst > 4.0:
            f = 4.0 / worst
            for row in P:
                row[0] *= f
                row[1] *= f
                row[2] *= f
                row[3] *= f

    def snapshot(self) -> dict[str, float | int | bool | None]:
        """What the calibration learnt (metrics, the simulator's report)."""
        return {"overhead_ms": round(self.theta[0], 3), "prefill_scale": round(self.theta[1], 4),
                "step_scale": round(self.theta[2], 4), "kv_full_ms": round(self.theta[3], 1),
                "observations": self.observations, "resets": self.resets, "trusted": self.trusted,
                "use_fit": self.use_fit,
                "fit_rel_err": None if self.fit_rel_err is None else round(self.fit_rel_err, 4),
                "rel_err": None if self.rel_err is None else round(self.rel_err, 4),
                "raw_rel_err": None if self.raw_rel_err is None else round(self.raw_rel_err, 4)}


class TierCostLearner:
    """Learns what a hit on a lower KV tier costs, from outcomes (``cache_aware``'s tier weights).

    ``cache_aware`` credits a matched token held only on the host (or on disk / a shared store)
    ``w`` of a device hit (:mod:`mesh.index.tiers`; Dynamo's 0.75 / 0.25 by default): such a
    token costs ``u = 1 - w`` of its recompute time (the transfer). This learner fits ``u`` per
    tier from the decisions whose pick had lower-tier tokens: with ``c_t`` the recompute time of
    the tier's tokens (ms, at the prefill rate the prediction used) and ``r`` the prediction's
    error, the tier part of the first-reply time was ``y = r + sum(u_used_t * c_t)``, and
    ``y ~ u . c`` is a two-term least-squares fit with forgetting, pulled toward the configured
    ``u`` by a ridge worth ``prior_weight`` typical outcomes. Outcomes without lower-tier
    tokens teach it nothing (a fleet without tiers never moves it). The fit is used after
    ``min_observations`` outcomes, each ``u`` kept in [0, 1] (a lower tier never beats the
    device, nor costs more than recomputing). Pure: no I/O, no clock.
    """

    __slots__ = ("prior_u", "forget", "min_observations", "prior_weight", "_n", "_s", "observations")

    def __init__(self, weights: Sequence[float], *, forget: float = 0.99, min_observations: int = 16,
                 prior_weight: float = 4.0) -> None:
        if len(weights) != 3 or not all(0.0 <= w <= 1.0 for w in weights):
            raise ValueError(f"tier weights must be three numbers in [0, 1] (device, host, store), not {weights!r}")
        self.prior_u = (1.0 - weights[1], 1.0 - weights[2])
        self.forget = forget
        self.min_observations = min_observations
        self.prior_weight = prior_weight
        self._n = 0.0  # outcomes seen, with forgetting
        self._s = [0.0, 0.0, 0.0, 0.0, 0.0]  # sums of c_h^2, c_h c_s, c_s^2, c_h y, c_s y (forgetting)
        self.observations = 0

    def costs(self) -> tuple[float, float]:
        """``(u_host, u_store)``: the fitted cost of a host / store token, as a share of its
        recompute time (the configured one until ``min_observations`` outcomes)."""
        if self.observations < self.min_observations:
            return self.prior_u
        hh, hs, ss, hy, sy = self._s
        g = self.prior_weight * (hh + ss) / self._n  # prior_weight outcomes of the mean size
        uh0, us0 = self.prior_u
        a, b, d = hh + g, hs, ss + g
        e, f = hy + g * uh0, sy + g * us0
        det = a * d - b * b
        if det <= 0.0:
            return self.prior_u
        uh = (e * d - b * f) / det
        us = (a * f - b * e) / det
        return min(1.0, max(0.0, uh)), min(1.0, max(0.0, us))

    def weights(self, device: float = 1.0) -> tuple[float, float, float]:
        """The tier weights to route by: ``(device, 1 - u_host, 1 - u_store)``."""
        uh, us = self.costs()
        return device, 1.0 - uh, 1.0 - us

    def observe(self, tier_ms: Sequence[float], used_u: Sequence[float], actual_ms: float, predicted_ms: float) -> None:
        """One outcome of a pick with lower-tier tokens: ``tier_ms`` their recompute times
        ``(c_host, c_store)``, ``used_u`` the costs the prediction assumed. Bad values are ignored."""
        ch, cs = tier_ms
        if not (actual_ms >= 0.0) or actual_ms == float("inf") or not (ch > 0.0 or cs > 0.0):
            return
        y = actual_ms - predicted_ms + used_u[0] * ch + used_u[1] * cs
        y = min(max(y, 0.0), 2.0 * (ch + cs))  # clip: one burst the router could not see is not a slow tier
        lam = self.forget
        s = self._s
        for i, v in enumerate((ch * ch, ch * cs, cs * cs, ch * y, cs * y)):
            s[i] = lam * s[i] + v
        self._n = lam * self._n + 1.0
        self.observations += 1

    def snapshot(self) -> dict[str, float | int]:
        uh, us = self.costs()
        return {"host_weight": round(1.0 - uh, 4), "store_weight": round(1.0 - us, 4), "observations": self.observations}
