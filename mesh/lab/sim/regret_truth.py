"""The regret audit's one-step truth, measured in the simulator (``mesh sim --regret-truth K``).

The live audit (:mod:`mesh.routing.regret`) predicts, per decision, the time to first token of
cache_aware's pick and of the workers power-of-two and greedy would have chosen from the same
view. The matrix compares its mean with the measured difference between whole arms, which also
holds everything a decision does to the requests after it (the cache it builds, the queue it
leaves). This module measures what lies between the two: for every ``every``-th audited decision
whose baseline pick differs from cache_aware's, it copies that worker's engine as it is at the
decision, submits the request to the copy and steps the copy alone until the first token; the
same for cache_aware's own pick. Their difference is the decision's *one-step* regret, exact on
the engine model except that later arrivals are not in the copies.

So per arm, against each baseline:

* ``predicted_ms`` - ``one_step_ms``: the TTFT model's error (what calibration can fix);
* ``one_step_ms`` - the arms' measured difference: what a per-decision figure cannot see.

Both figures are per request (the sampled disagreements' mean times the share of audited
decisions that disagreed), as the audit's ``pays_ms``. Lab only: deep copies of engines are far
too slow for a router. DP-attention engines are not sampled (the copy would need the rank the
baseline would have picked).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from mesh.engine_model import EngineModel

__all__ = ["OneStepTruth"]

#: the baselines the audit judges, in the order its decision detail carries them
_BASELINES = ("cache_aware_greedy", "power_of_two")
#: engine steps a copy may take before it gives up on the first token (a model bug, not a result)
_MAX_STEPS = 100_000


class OneStepTruth:
    """Samples every ``every``-th audited decision per baseline (see the module docstring)."""

    def __init__(self, every: int) -> None:
        if not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
            raise ValueError(f"every must be an integer >= 1, not {str(every)[:40]!r}")
        self.every = every
        self.audited = 0  # audited decisions seen (agreeing ones included)
        self.differ = dict.fromkeys(_BASELINES, 0)  # ... whose baseline pick differed
        self.sampled = dict.fromkeys(_BASELINES, 0)
        self.pred_sum = dict.fromkeys(_BASELINES, 0.0)  # predicted regret over the sampled ones
        self.fork_sum = dict.fromkeys(_BASELINES, 0.0)  # one-step regret over the sampled ones
        self.err_sq = dict.fromkeys(_BASELINES, 0.0)  # squared (predicted - one-step) over them

    def sample(self, detail: dict[str, Any], chosen_engine: Any, chosen_free_s: float, engines: dict[str, tuple[Any, float]],
               rid: object, prompt: Any, max_new_tokens: int, submit_s: float) -> None:
        """One routed request: ``detail`` is its decision's (the audit's ``regret_audit`` entry in
        it), ``chosen_engine`` the engine it went to, free for a new step at ``chosen_free_s``,
        ``engines`` every worker id's (engine, free at), ``submit_s`` when the request reaches it."""
        a = detail.get("regret_audit")
        chosen_ms = detail.get("predicted_ttft_ms")
        if a is None or len(a) < 5 or chosen_ms is None or not isinstance(chosen_engine, EngineModel):
            return
        self.audited += a[0]
        own_ms: float | None = None
        for b, pred, wid in zip(_BASELINES, a[1:3], a[3:5]):
            if pred is None or wid not in engines:
                continue
            self.differ[b] += a[0]
            if self.differ[b] % self.every:
                continue
            eng, free_s = engines[wid]
            if not isinstance(eng, EngineModel):
                continue
            if own_ms is None:
                own_ms = _first_token_ms(chosen_engine, chosen_free_s, rid, prompt, max_new_tokens, submit_s)
            base_ms = _first_token_ms(eng, free_s, rid, prompt, max_new_tokens, submit_s)
            if not (math.isfinite(own_ms) and math.isfinite(base_ms)):
                continue
            self.sampled[b] += 1
            self.pred_sum[b] += pred - chosen_ms
            self.fork_sum[b] += base_ms - own_ms
            self.err_sq[b] += ((pred - chosen_ms) - (base_ms - own_ms)) ** 2

    def snapshot(self) -> dict[str, Any]:
        """Per baseline: ``predicted_ms`` and ``one_step_ms`` per request, ``sampled`` decisions and
        ``error_ci95_ms``, the 95 % half-width of their difference's mean over the sample (per
        request, as they are): what a sample of this size knows of the model's error."""
        out: dict[str, Any] = {"every": self.every, "audited": self.audited}
        for b in _BASELINES:
            n = self.sampled[b]
            share = self.differ[b] / self.audited if self.audited else 0.0
            ci = None
            if n > 1:
                m = (self.pred_sum[b] - self.fork_sum[b]) / n
                var = max(0.0, (self.err_sq[b] - n * m * m) / (n - 1))
                ci = round(share * 1.96 * math.sqrt(var / n), 2)
            out[b] = {"sampled": n, "differ_share": round(share, 4),
                      "predicted_ms": round(share * self.pred_sum[b] / n, 2) if n else None,
                      "one_step_ms": round(share * self.fork_sum[b] / n, 2) if n else None,
                      "error_ci95_ms": ci}
        return out


def _first_token_ms(engine: EngineModel, free_s: float, rid: object, prompt: Any, max_new_tokens: int,
                    submit_s: float) -> float:
    """ms from ``submit_s`` to the first token of the request on a copy of ``engine`` (nan when
    the copy never produces it)."""
    e = copy.deepcopy(engine)
    key = ("one-step", rid)
    e.submit(key, prompt, max_new_tokens, submit_s)
    t = max(submit_s, free_s)
    for _ in range(_MAX_STEPS):
        res = e.step(t)
        t += res.duration_s
        if any(x[0] == key for x in res.first_tokens):
            return (t - submit_s) * 1e3
        if not e.has_work():
            break
    return math.nan
