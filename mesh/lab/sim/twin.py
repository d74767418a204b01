"""The policy-level regret audit: the traffic replayed through every policy on a twin of the fleet.

The broker's live audit (:mod:`mesh.routing.regret`) judges each decision on the fleet as
cache_aware left it; it cannot see the fleet a baseline would have built (its queues, its caches),
and on the quality matrix that myopia, not the TTFT model, is most of its error (docs/routing.md).
The question an operator asks, "what would switching the whole fleet to power-of-two or greedy
cost on my traffic", is a policy-level one, and the simulator answers it: replay the same requests
(``mesh broker --record-decisions`` records them) through cache_aware and each baseline on a
simulated twin of the fleet (its workers, its routers, the engine model the operator describes)
and take the difference of mean TTFTs. ``mesh sim --trace RECORDING --audit`` does that; the
quality matrix (``twin = true``) does the same on every cell's stream and judges the figure
against the arms it measured, beside the live audit's.

Nothing here is the router's: the twin is the simulator (lab only), run offline on a recording.
Every arm of the twin sees the identical stream, so the differences are paired and their 95 %
intervals come from paired batch means (:mod:`mesh.lab.sim.metrics`). The twin draws its own
random numbers (:data:`TWIN_SEED_OFFSET`) and, in the matrix, names its workers in another order
(:data:`TWIN_TAG`): it never replays the measured arms' draws or tie-breaks, so its figure carries
its own noise, as a replay of real traffic would. It does run the arms' engine model: the matrix
shows how close a twin with a right engine model comes, and whether a fleet's engine model is right
is what :func:`fidelity` checks on a recording (and ``mesh bench replay`` against real processes).

**Fidelity.** A twin is as good as its engine model. For a recording, :func:`fidelity` sets the
twin's cache_aware mean TTFT beside the mean TTFT the broker observed on the same requests (it
routed them with cache_aware): a ratio far from 1 says the engine description (``--config``'s
``[engine]``) does not match the fleet, and the audit's figure is not to be trusted.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from mesh.lab.sim.fit import fit_engine, observed_from_recording, scaled_engine
from mesh.lab.sim.metrics import paired_se, t975

__all__ = ["SUBJECT", "BASELINES", "TWIN_SEED_OFFSET", "TWIN_TAG", "FIDELITY_BAND", "FIDELITY_FLOOR_MS", "MAX_DRAWS",
           "DRAW_SEED_STRIDE", "verdict", "plain_config", "twin_config", "draw_config", "twin_arms", "twin_pays", "pooled_pays", "fidelity",
           "fit_twin", "write_textfile"]

SUBJECT = "cache_aware"
BASELINES = ("cache_aware_greedy", "power_of_two")
#: the twin's seed is the stream's seed plus this: its policies' and heartbeats' draws are its own
TWIN_SEED_OFFSET = 7919
#: ``fidelity`` calls the engine model matching when the twin's mean TTFT is within this factor of the
#: observed. Tight on purpose: on the 70B-class matrix, a twin whose engine was 20 % too fast (prefill
#: rate and decode step) saw 0.80-0.85x the arms' mean TTFT, and its figure fell from 23 to 9 of 30
#: cell-seeds within 25 % of the measured difference (docs/routing.md).
FIDELITY_BAND = 1.10
#: ... or within this many ms of it: the process and network hops a twin does not model (a real
#: broker in front of stub engines on a busy 2-core host observed 3-5 ms more than its twin at a
#: 25 ms mean TTFT, tests/test_record_decisions.py), which a difference between policies cancels
FIDELITY_FLOOR_MS = 5.0


#: the matrix's twin names its workers in another order (``policy@twin``, mesh.lab.sim.fleet.worker_ids)
TWIN_TAG = "twin"


def plain_config(cfg: Any, **changes: Any) -> Any:
    """A copy of the :class:`~mesh.lab.sim.runner.SimConfig` ``cfg`` with ``changes`` and without
    the per-decision audit's lab extras (one-step truth, shadow) or a recording: what every
    twin, draw and fit evaluation runs."""
    return dataclasses.replace(cfg, regret_truth_every=0, regret_shadow_rate=None, record_decisions=None, **changes)


def twin_config(cfg: Any, subject: str = SUBJECT, baselines: Sequence[str] = BASELINES, tag: str | None = TWIN_TAG) -> Any:
    """A copy of the :class:`~mesh.lab.sim.runner.SimConfig` ``cfg`` that runs ``subject`` and
    the baselines on its own draws (seed + :data:`TWIN_SEED_OFFSET`) and, with ``tag``, with its
    workers named in another order (``policy@tag``: every tie that hangs on a name goes another
    way), without the per-decision audit's lab extras (one-step truth, shadow) or a recording.
    The quality matrix tags its twin so that no arm of it can replay a measured arm draw for draw
    (a deterministic policy on the same stream and names would); a recording's replay keeps the
    recorded names (``tag=None``)."""
    pols = [subject, *baselines]
    if tag:
        pols = [f"{p}@{tag}" for p in pols]
    return plain_config(cfg, seed=cfg.seed + TWIN_SEED_OFFSET, policies=pols)


#: the most independent draws an audit (``mesh sim --audit-draws``) or a matrix's ``replicas`` and
#: ``twin_draws`` may ask for
MAX_DRAWS = 16
#: draw ``k`` of a twin (or replica ``k`` of a measured arm) adds ``k`` times this to the seed
DRAW_SEED_STRIDE = 104729


def draw_config(cfg: Any, k: int, tag: str | None = None) -> Any:
    """Draw ``k`` of the :class:`~mesh.lab.sim.runner.SimConfig` ``cfg`` (0: ``cfg`` itself): its
    own random numbers (seed + ``k`` x :data:`DRAW_SEED_STRIDE`) and, with ``tag``, its workers
    named in another order per draw (``policy@TAGk``), without the per-decision audit's lab
    extras. Independent draws of the same stream average to a figure with a narrower interval
    (:func:`pooled_pays`); the matrix measures its arms so when ``replicas`` > 1."""
    if k == 0:
        return cfg
    pols = [f"{p.partition('@')[0]}@{tag}{k}" if tag else p for p in cfg.policies]
    return plain_config(cfg, seed=cfg.seed + k * DRAW_SEED_STRIDE, policies=pols)


def verdict(pays_ms: float, ci95_ms: float | None) -> str:
    """What a difference of mean TTFTs says: ``saves`` (cache_aware is faster beyond the 95 %
    interval), ``costs`` (slower beyond it) or ``tie`` (the interval holds 0: on this traffic the
    two policies cannot be told apart, and switching changes nothing measurable). Without an
    interval, its sign (0: ``tie``)."""
    band = ci95_ms if ci95_ms is not None else 0.0
    return "saves" if pays_ms > band else "costs" if pays_ms < -band else "tie"


_VERDICT_VALUE = {"saves": 1, "tie": 0, "costs": -1}


def twin_arms(arms: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the audit keeps of each twin arm: its policy (without a twin tag), mean TTFT and batch means."""
    return [{"policy": a["policy"].partition("@")[0], "ttft_mean_ms": a["ttft_mean_ms"],
             "ttft_batch_means_ms": a.get("ttft_batch_means_ms")} for a in arms]


def twin_pays(arms: Sequence[dict[str, Any]], subject: str = SUBJECT) -> dict[str, Any] | None:
    """``pays_ms`` per baseline: its twin mean TTFT minus the subject's (positive: cache_aware is
    faster), with the paired 95 % half-width (``ci95_ms``, None without batch means); ``against``:
    the baseline with the lowest twin mean TTFT, and ``best`` its figure. None without the subject
    or a baseline among ``arms``. One draw of :func:`pooled_pays`."""
    return pooled_pays([arms], subject)


def pooled_pays(draws: Sequence[Sequence[dict[str, Any]]], subject: str = SUBJECT) -> dict[str, Any] | None:
    """:func:`twin_pays` over independent draws of the same stream (each a list of arms, as
    :func:`twin_arms` keeps them): per policy the mean of the draws' mean TTFTs (every draw
    replays the same requests, so they weigh alike), ``pays_ms`` the baseline's pooled mean minus
    the subject's, ``against`` the baseline with the lowest pooled mean. ``ci95_ms``: the paired
    batch means' standard errors of the draws combined (``sqrt(sum se^2) / n``: independent
    draws), Student's t on every batch; None when a draw has no batch means. ``se_ms`` keeps the
    combined standard error; ``per_draw_ms`` each draw's own ``pays_ms``; ``ttft_mean_ms`` the
    pooled mean TTFT per policy; ``verdict`` (:func:`verdict`) and ``best_of_ttft`` (``best``
    over the subject's mean TTFT) against ``against``. None without the subject
    or a baseline in every draw."""
    draws = [d for d in draws if d]
    if not draws:
        return None
    bys = [{a["policy"]: a for a in d} for d in draws]
    if any(subject not in by for by in bys):
        return None
    names = [a["policy"] for a in draws[0] if a["policy"] != subject and "@" not in a["policy"]]
    names = [b for b in names if all(b in by for by in bys)]
    if not names:
        return None
    n = len(bys)
    mean = {p: math.fsum(by[p]["ttft_mean_ms"] for by in bys) / n for p in [subject, *names]}
    pays: dict[str, float] = {}
    ci: dict[str, float | None] = {}
    se_out: dict[str, float | None] = {}
    for b in names:
        pays[b] = round(mean[b] - mean[subject], 3)
        ses = [paired_se(by[b].get("ttft_batch_means_ms") or [], by[subject].get("ttft_batch_means_ms") or []) for by in bys]
        if any(x is None for x in ses):
            ci[b] = se_out[b] = None
            continue
        se = math.sqrt(math.fsum(x[1] ** 2 for x in ses)) / n
        se_out[b] = round(se, 4)
        ci[b] = round(t975(sum(x[2] for x in ses)) * se, 3)
    against = min(names, key=lambda b: mean[b])
    per_draw = [{b: round(by[b]["ttft_mean_ms"] - by[subject]["ttft_mean_ms"], 3) for b in names} for by in bys]
    return {"subject": subject, "against": against, "best": pays[against], "pays_ms": pays, "ci95_ms": ci,
            "verdict": verdict(pays[against], ci[against]),
            "best_of_ttft": round(pays[against] / mean[subject], 5) if mean[subject] > 0 else None,
            "se_ms": se_out, "draws": n, "per_draw_ms": per_draw, "ttft_mean_ms": {p: round(v, 3) for p, v in mean.items()}}


def fidelity(subject_arm: dict[str, Any], recorded: Sequence[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The twin's subject mean TTFT beside the mean TTFT a recording observed (its ``ok`` records
    with a ``ttft_ms``), their ratio and whether they match: within :data:`FIDELITY_BAND` or
    :data:`FIDELITY_FLOOR_MS`; None without observed TTFTs."""
    seen = observed_from_recording(recorded)
    if seen is None or subject_arm["ttft_mean_ms"] <= 0:
        return None
    observed = seen.ttft_mean_ms
    ratio = subject_arm["ttft_mean_ms"] / observed if observed > 0 else None
    twin = subject_arm["ttft_mean_ms"]
    close = ratio is not None and (1.0 / FIDELITY_BAND <= ratio <= FIDELITY_BAND or abs(twin - observed) <= FIDELITY_FLOOR_MS)
    return {"observed_ttft_mean_ms": round(observed, 3), "twin_ttft_mean_ms": twin,
            "requests": seen.requests, "ratio": None if ratio is None else round(ratio, 4), "matches": close}


def fit_twin(cfg: Any, workload: Any, policy: str, target: Any,
             on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Fit ``cfg``'s engine (:func:`mesh.lab.sim.fit.fit_engine`) so that ``policy`` on the twin
    (``cfg``: one fleet shape) sees ``target`` (:class:`~mesh.lab.sim.fit.Observed`) on
    ``workload``: each evaluation is one simulator arm of ``policy`` with the engine scaled.
    Returns the fit with ``engine``, the fitted :class:`~mesh.engine_model.EngineConfig`."""
    from mesh.lab.sim.runner import run_sim

    def evaluate(prefill_speed: float, decode_speed: float) -> tuple[float, float | None]:
        c = plain_config(cfg, policies=[policy], engine=scaled_engine(cfg.engine, prefill_speed, decode_speed))
        arm = run_sim(c, workload=workload)["arms"][0]
        return arm["ttft_mean_ms"], arm.get("tpot_mean_ms")

    fit = fit_engine(evaluate, target, on_step=on_step)
    fit["engine"] = scaled_engine(cfg.engine, fit["prefill_speed"], fit["decode_speed"])
    return fit


def write_textfile(path: str, audit: dict[str, Any], *, requests: int) -> None:
    """``audit`` (``mesh sim --audit``'s ``{"pays", "fidelity"}``) as Prometheus gauges in the
    text format, written atomically (prometheus_client's ``write_to_textfile``: a temporary file,
    then a rename) for node_exporter's textfile collector."""
    from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

    reg = CollectorRegistry()
    pays = Gauge("mesh_audit_pays_ms", "Policy-level audit (mesh sim --audit): the baseline's mean TTFT minus "
                 "cache_aware's on the recorded traffic, ms per request (positive: cache_aware is faster)",
                 ["baseline"], registry=reg)
    ci = Gauge("mesh_audit_pays_ci95_ms", "95 % confidence half-width of mesh_audit_pays_ms (paired batch means)",
               ["baseline"], registry=reg)
    tp = audit["pays"]
    for b, v in tp["pays_ms"].items():
        pays.labels(baseline=b).set(v)
        if tp["ci95_ms"].get(b) is not None:
            ci.labels(baseline=b).set(tp["ci95_ms"][b])
    pays.labels(baseline="best").set(tp["best"])
    if tp.get("verdict") in _VERDICT_VALUE:
        Gauge("mesh_audit_verdict", "The policy-level audit's verdict against the better baseline: 1 cache_aware saves, "
              "-1 it costs (beyond the 95 % interval), 0 a tie (the interval holds 0)", registry=reg).set(
            _VERDICT_VALUE[tp["verdict"]])
    Gauge("mesh_audit_requests", "Requests the audit replayed", registry=reg).set(requests)
    f = audit.get("fidelity")
    if f is not None:
        Gauge("mesh_audit_engine_fidelity_ratio", "The twin's mean TTFT over the one the broker observed (1: the engine "
              "model matches the fleet; outside 0.91 .. 1.10 the audit's figures are not to be trusted)",
              registry=reg).set(f["ratio"])
    fit = audit.get("engine_fit")
    if fit is not None:
        Gauge("mesh_audit_engine_prefill_speed", "The engine fit's prefill speed: the fleet's prefill side is this many "
              "times as fast as described (mesh sim --audit --fit-engine)", registry=reg).set(fit["prefill_speed"])
        Gauge("mesh_audit_engine_decode_speed", "The engine fit's decode speed: the fleet's decode side is this many "
              "times as fast as described", registry=reg).set(fit["decode_speed"])
    write_to_textfile(path, reg)
