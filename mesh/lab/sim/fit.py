"""Fitting the twin's engine model to what a fleet observed.

The policy-level audit (:mod:`mesh.lab.sim.twin`) is only as right as the engine model it runs:
on the 70B-class matrix, a twin whose engine was 20 % too fast saw 0.80-0.85x the arms' mean TTFT
and its figure fell from 23 to 9 of 30 cell-seeds within 25 % of the measured difference. An
operator rarely knows their engine's prefill rate and decode step to 10 %; a recording does: every
``ok`` record carries the TTFT and (``e2e_ms``) the time to the last token the broker observed.

:func:`fit_engine` scales the described engine by two speeds until the twin, replaying the
recording under the recorded policy, sees the recording's mean TTFT and mean time per output
token (TPOT) within :data:`FIT_TOLERANCE`:

* ``prefill_speed`` multiplies ``prefill_tokens_per_s`` and divides ``prefill_overhead_ms`` and
  ``attention_coef_ms`` (the prefill side: what TTFT is mostly made of, with the queue before it);
* ``decode_speed`` divides ``decode_base_ms`` and ``decode_per_req_ms`` (the decode side: TPOT,
  and the decode steps a prefill waits behind).

The solver is Broyden's method on the logarithms (log speed -> log of twin / observed, for both
figures at once): it starts from "TTFT goes as 1 / prefill speed, TPOT as 1 / decode speed" and
learns the real slopes and the cross terms (decode steps delay prefills; prefills stretch decode
steps) from each evaluation; each step is capped at a factor of 2 and each speed kept within
:data:`SPEED_BOUNDS`. Without decode figures (old recordings, single-token outputs) it fits the
prefill speed alone. The evaluation (a simulator run) is the caller's: this module does no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["FIT_TOLERANCE", "MAX_EVALUATIONS", "SPEED_BOUNDS", "Observed", "observed_from_recording",
           "observed_from_arm", "scaled_engine", "fit_engine"]

#: the fit stops when both figures are within this share of the observed ones
FIT_TOLERANCE = 0.02
#: evaluations (simulator runs) at most; the best one seen is kept when the fit does not converge
MAX_EVALUATIONS = 10
#: each speed stays within these factors of the described engine's
SPEED_BOUNDS = (1.0 / 8.0, 8.0)
_MAX_STEP = math.log(2.0)  # one step moves a speed by a factor of 2 at most


@dataclass(frozen=True)
class Observed:
    """What a fleet observed: mean TTFT (ms), mean time per output token (ms; None without
    requests of two or more output tokens) and how many requests gave them."""

    ttft_mean_ms: float
    tpot_mean_ms: float | None
    requests: int


def _finite(v: Any) -> bool:
    return type(v) in (int, float) and 0.0 <= v < math.inf


def observed_from_recording(recorded: Sequence[dict[str, Any]] | None) -> Observed | None:
    """The means over a recording's ``ok`` records (:func:`mesh.lab.sim.recorded.load_decisions`'s
    ``recorded``): TTFT over records with a usable ``ttft_ms``; TPOT, ``(e2e_ms - ttft_ms) /
    (output_length - 1)``, over those that also carry ``e2e_ms`` and two or more output tokens.
    A forged or broken figure (NaN, infinity, negative, bool, string, an end before the first
    token) is left out, not averaged. None without a usable TTFT."""
    ttft: list[float] = []
    tpot: list[float] = []
    for r in recorded or ():
        if r.get("outcome") != "ok" or not _finite(t := r.get("ttft_ms")):
            continue
        ttft.append(float(t))
        e, n = r.get("e2e_ms"), r.get("output_length")
        if _finite(e) and type(n) is int and n >= 2 and e >= t:
            tpot.append((e - t) / (n - 1))
    if not ttft:
        return None
    return Observed(sum(ttft) / len(ttft), sum(tpot) / len(tpot) if tpot else None, len(ttft))


def observed_from_arm(arm: dict[str, Any]) -> Observed:
    """An arm's own figures as the observation (the quality matrix: the arms play the fleet)."""
    return Observed(arm["ttft_mean_ms"], arm.get("tpot_mean_ms"), arm.get("completed", arm.get("requests", 0)))


def scaled_engine(engine: Any, prefill_speed: float, decode_speed: float) -> Any:
    """``engine`` (an :class:`~mesh.engine_model.EngineConfig`) with its prefill side
    ``prefill_speed`` times and its decode side ``decode_speed`` times as fast."""
    return dataclasses.replace(
        engine,
        prefill_tokens_per_s=engine.prefill_tokens_per_s * prefill_speed,
        prefill_overhead_ms=engine.prefill_overhead_ms / prefill_speed,
        attention_coef_ms=engine.attention_coef_ms / prefill_speed,
        decode_base_ms=engine.decode_base_ms / decode_speed,
        decode_per_req_ms=engine.decode_per_req_ms / decode_speed,
    )


def _clamp(x: float) -> float:
    lo, hi = math.log(SPEED_BOUNDS[0]), math.log(SPEED_BOUNDS[1])
    return min(hi, max(lo, x))


def fit_engine(evaluate: Callable[[float, float], tuple[float, float | None]], target: Observed, *,
               tolerance: float = FIT_TOLERANCE, max_evaluations: int = MAX_EVALUATIONS,
               on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The speeds at which ``evaluate(prefill_speed, decode_speed)`` (the twin's mean TTFT and
    mean TPOT, ms) meets ``target`` within ``tolerance``, from (1, 1). Returns ``prefill_speed``,
    ``decode_speed``, ``converged``, ``evaluations``, ``ttft_ratio`` and ``tpot_ratio`` (twin /
    observed at the speeds returned) and ``steps`` (every evaluation). When no step lands within
    ``tolerance`` (on a short stream each run's mean moves by several per cent with a 1 % change
    of speed: the steps chase that noise), the speeds are where the least-squares plane through
    every evaluation crosses zero (``least_squares``), evaluated once more, not the evaluation
    that happened to land closest.
    ``on_step`` gets each step as it is made (a progress line)."""
    if not (_finite(target.ttft_mean_ms) and target.ttft_mean_ms > 0):
        raise ValueError("target: needs a positive mean TTFT")
    two = target.tpot_mean_ms is not None and target.tpot_mean_ms > 0
    goal = math.log(1.0 + tolerance)
    x = [0.0, 0.0]  # log prefill speed, log decode speed
    jac = [[-1.0, 0.0], [0.0, -1.0]]  # d log(figure ratio) / d log(speed): rows TTFT, TPOT
    steps: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    f_prev: list[float] | None = None
    x_prev: list[float] | None = None
    xs: list[list[float]] = []  # every point evaluated (log speeds) ...
    fs: list[list[float]] = []  # ... and its log ratios: the least-squares fallback's data

    def run(p: float, d: float) -> tuple[list[float], dict[str, Any]]:
        ttft, tpot = evaluate(p, d)
        if not (_finite(ttft) and ttft > 0):
            raise ValueError(f"evaluate({p:.4g}, {d:.4g}): no usable mean TTFT ({ttft!r})")
        f = [math.log(ttft / target.ttft_mean_ms),
             math.log(tpot / target.tpot_mean_ms) if two and _finite(tpot) and tpot > 0 else 0.0]
        step = {"prefill_speed": round(p, 4), "decode_speed": round(d, 4), "ttft_ms": round(ttft, 3),
                "tpot_ms": None if tpot is None else round(tpot, 4),
                "ttft_ratio": round(math.exp(f[0]), 4), "tpot_ratio": round(math.exp(f[1]), 4) if two else None}
        steps.append(step)
        xs.append([math.log(p), math.log(d)])
        fs.append(f)
        if on_step is not None:
            on_step(step)
        return f, step

    for _ in range(max_evaluations - 1):  # the last evaluation is kept for the least-squares point
        f, step = run(math.exp(x[0]), math.exp(x[1]))
        err = max(abs(f[0]), abs(f[1]))
        if best is None or err < best["err"]:
            best = {"err": err, **step}
        if err <= goal:
            break
        if f_prev is not None and x_prev is not None:  # Broyden's update from the last step
            dx = [x[0] - x_prev[0], x[1] - x_prev[1]]
            df = [f[0] - f_prev[0], f[1] - f_prev[1]]
            nn = dx[0] * dx[0] + dx[1] * dx[1]
            if nn > 1e-12:
                for i in range(2):
                    r = (df[i] - (jac[i][0] * dx[0] + jac[i][1] * dx[1])) / nn
                    jac[i][0] += r * dx[0]
                    jac[i][1] += r * dx[1]
        if two:
            det = jac[0][0] * jac[1][1] - jac[0][1] * jac[1][0]
            if abs(det) < 1e-6 or jac[0][0] >= 0 or jac[1][1] >= 0:  # lost the slopes' signs: start over
                jac = [[-1.0, 0.0], [0.0, -1.0]]
                det = 1.0
            s0 = -(jac[1][1] * f[0] - jac[0][1] * f[1]) / det
            s1 = -(-jac[1][0] * f[0] + jac[0][0] * f[1]) / det
        else:
            if jac[0][0] >= -1e-6:
                jac[0][0] = -1.0
            s0, s1 = -f[0] / jac[0][0], 0.0
        scale = max(abs(s0), abs(s1)) / _MAX_STEP
        if scale > 1.0:
            s0, s1 = s0 / scale, s1 / scale
        x_prev, f_prev = list(x), f
        x = [_clamp(x[0] + s0), _clamp(x[1] + s1)]
        if x == x_prev:  # pinned at a bound: nothing more to learn
            break
    assert best is not None
    converged = best["err"] <= goal
    least_squares = False
    if not converged:  # a noisy response (a short stream: each run's mean moves by chance): the plane
        root = _least_squares_root(xs, fs, two)  # through every evaluation, where it crosses zero
        if root is not None:
            f, step = run(math.exp(root[0]), math.exp(root[1]))
            least_squares = True
            best = {"err": max(abs(f[0]), abs(f[1])), **step}
            converged = best["err"] <= goal
    return {"prefill_speed": best["prefill_speed"], "decode_speed": best["decode_speed"], "converged": converged,
            "least_squares": least_squares, "evaluations": len(steps), "ttft_ratio": best["ttft_ratio"],
            "tpot_ratio": best["tpot_ratio"], "fitted_tpot": two, "steps": steps}


def _least_squares_root(xs: list[list[float]], fs: list[list[float]], two: bool) -> list[float] | None:
    """Where the least-squares plane (line, without TPOT) through the evaluations' log ratios
    crosses zero, kept within the speeds evaluated; None with too few or degenerate points."""
    import numpy as np

    x = np.asarray(xs, dtype=float)
    f = np.asarray(fs, dtype=float)
    cols = [0, 1] if two else [0]
    if len(x) < len(cols) + 2:
        return None
    a = np.column_stack([np.ones(len(x)), x[:, cols]])
    if np.linalg.matrix_rank(a) < a.shape[1]:
        return None
    coef = np.linalg.lstsq(a, f[:, : len(cols)], rcond=None)[0]  # rows: intercept, slopes; columns: outputs
    slopes, icpt = coef[1:].T, coef[0]
    if abs(np.linalg.det(slopes)) < 1e-9:
        return None
    root = np.linalg.solve(slopes, -icpt)
    lo, hi = x[:, cols].min(axis=0), x[:, cols].max(axis=0)
    root = np.clip(root, lo, hi)
    return [float(root[0]), float(root[1]) if two else 0.0]
