"""``mesh bench replay``'s pure parts: its settings, the slowed engine, the client's figures, the
CPU-honesty verdict and the comparison with ``mesh sim``. No I/O, no clock: the shell
(:mod:`mesh.lab.bench.replay_bench`) measures, this module judges.

Two clocks are in play. ``time_scale`` multiplies the trace's arrival times, exactly as ``mesh sim
--arrival-scale`` does (0.5 = twice the offered rate): it changes the load. ``slowdown`` makes
every engine ``slowdown`` times slower (``mesh stub-sglang --time-scale``; the simulator gets the
same slowed :class:`~mesh.engine_model.EngineConfig`, :func:`slowed_engine`) and stretches the
arrivals by the same factor: the load factor is unchanged and the machine gets ``slowdown`` times
fewer engine steps, tokens and requests per second to carry. Figures are in real milliseconds on
both sides (the simulator models the slowed engines); divided by ``slowdown`` they are the full-speed
engine's, up to the fixed network and router costs that are not slowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from mesh.engine_model import EngineConfig
from mesh.errors import ConfigError
from mesh.stats import cv, mean, percentile, ratio
from mesh.lab.sim.metrics import tpot_mean_ms

__all__ = ["REPLAY_POLICIES", "PROVIDERS", "ReplayConfig", "RequestResult", "slowed_engine", "client_figures",
           "cpu_verdict", "compare", "ranking"]

REPLAY_POLICIES = ("power_of_two", "cache_aware_greedy", "cache_aware")
PROVIDERS = ("indexer", "radix_tree")
MAX_WORKERS = 16
MAX_ROUTERS = 8
MAX_REQUESTS = 20_000


@dataclass
class ReplayConfig:
    """What one ``mesh bench replay`` runs. ``validate`` names the field of a bad value."""

    trace: str | None = None
    workload: str | None = None
    max_requests: int = 400
    time_scale: float = 1.0
    slowdown: float = 1.0
    rate: float = 4.0  # generated workloads: requests/s (before time_scale and slowdown)
    seed: int = 0
    workers: int = 4
    routers: int = 2
    provider: str = "indexer"
    exchange: bool = True
    policies: list[str] = field(default_factory=lambda: list(REPLAY_POLICIES))
    ttft_slo_ms: float = 2000.0  # of the full-speed engine; the run's SLO is this x slowdown
    net_ms: float = 1.0  # the simulator's one-way router <-> worker hop (HTTP + ZeroMQ on one host)
    max_lag_ms: float = 50.0  # client send lag p95 past this: the figures are not the mesh's
    max_cpu_busy: float = 0.9  # the replay's own processes using more of the CPUs than this: the same
    max_wait_share: float = 0.05  # a replay process runnable but waiting for a CPU this share of the run: the same

    def validate(self) -> None:
        if (self.trace is None) == (self.workload is None):
            raise ConfigError("trace/workload: give exactly one of --trace FILE or --workload NAME")
        for name, lo, hi in (("workers", 1, MAX_WORKERS), ("routers", 1, MAX_ROUTERS), ("max_requests", 1, MAX_REQUESTS)):
            v = getattr(self, name)
            if type(v) is not int or not lo <= v <= hi:
                raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
        for name in ("time_scale", "slowdown", "rate", "ttft_slo_ms", "max_lag_ms"):
            v = getattr(self, name)
            if type(v) not in (int, float) or not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {v!r}")
        if not 0.25 <= self.slowdown <= 20:
            raise ConfigError(f"slowdown must be in [0.25, 20], got {self.slowdown!r}")
        if type(self.net_ms) not in (int, float) or not (math.isfinite(self.net_ms) and self.net_ms >= 0):
            raise ConfigError(f"net_ms must be a finite number >= 0, got {self.net_ms!r}")
        for name in ("max_cpu_busy", "max_wait_share"):
            v = getattr(self, name)
            if type(v) not in (int, float) or not 0 < v <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {v!r}")
        if self.provider not in PROVIDERS:
            raise ConfigError(f"provider must be one of {', '.join(PROVIDERS)}, got {self.provider!r}")
        if not self.policies:
            raise ConfigError("policies: give at least one policy")
        for p in self.policies:
            if p not in REPLAY_POLICIES:
                raise ConfigError(f"policies: unknown policy {p!r}; choose from {', '.join(REPLAY_POLICIES)}")
        if len(set(self.policies)) != len(self.policies):
            raise ConfigError(f"policies: a policy is named twice in {','.join(self.policies)}")

    @property
    def arrival_factor(self) -> float:
        """What the trace's (or generator's) arrival times are multiplied by."""
        return self.time_scale * self.slowdown

    @property
    def slo_ms(self) -> float:
        return self.ttft_slo_ms * self.slowdown

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def slowed_engine(cfg: EngineConfig, slowdown: float) -> EngineConfig:
    """``cfg`` with every modelled duration ``slowdown`` times longer: what ``mesh stub-sglang
    --time-scale slowdown`` runs (its steps sleep ``duration x slowdown``), as an engine config the
    simulator can step. Fixed costs are multiplied, rates divided; memory is unchanged."""
    if slowdown == 1:
        return cfg
    s = float(slowdown)
    return replace(cfg, prefill_tokens_per_s=cfg.prefill_tokens_per_s / s, prefill_overhead_ms=cfg.prefill_overhead_ms * s,
                   attention_coef_ms=cfg.attention_coef_ms * s, decode_base_ms=cfg.decode_base_ms * s,
                   decode_per_req_ms=cfg.decode_per_req_ms * s, hbm_bytes_per_s=cfg.hbm_bytes_per_s / s,
                   kv_transfer_bytes_per_s=cfg.kv_transfer_bytes_per_s / s,
                   host_transfer_bytes_per_s=cfg.host_transfer_bytes_per_s / s)


@dataclass(slots=True)
class RequestResult:
    """One replayed request as the client saw it (times in ms; ``lag_ms`` = actual send - scheduled)."""

    idx: int
    ok: bool
    lag_ms: float = 0.0
    ttft_ms: float | None = None
    e2e_ms: float = 0.0
    worker: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


def _r(x: float, nd: int = 3) -> float:
    return round(x, nd)


def client_figures(results: list[RequestResult], slo_ms: float, workers: list[str] | None = None) -> dict[str, Any]:
    """The replay's figures from the client's records: TTFT p50/p95/p99, goodput (share of all
    requests with TTFT <= ``slo_ms``; a failed request misses it), hit rate (usage cached / prompt
    tokens), per-worker counts and their CV (``workers``: every worker, counted 0 when it got none),
    and the send lag."""
    ok = [r for r in results if r.ok]
    ttft = sorted(r.ttft_ms for r in ok if r.ttft_ms is not None)
    e2e = sorted(r.e2e_ms for r in ok)
    lag = sorted(r.lag_ms for r in results)
    per: dict[str, int] = {w: 0 for w in workers or ()}
    for r in ok:
        per[r.worker] = per.get(r.worker, 0) + 1
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "error"] = errors.get(r.error or "error", 0) + 1
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": dict(sorted(errors.items())),
        "ttft_mean_ms": _r(mean(ttft)) if ttft else None,
        "ttft_p50_ms": _r(percentile(ttft, 50, presorted=True)) if ttft else None,
        "ttft_p95_ms": _r(percentile(ttft, 95, presorted=True)) if ttft else None,
        "ttft_p99_ms": _r(percentile(ttft, 99, presorted=True)) if ttft else None,
        "e2e_p95_ms": _r(percentile(e2e, 95, presorted=True)) if e2e else None,
        "tpot_mean_ms": tpot_mean_ms(((r.ttft_ms or 0.0) / 1e3, r.e2e_ms / 1e3, r.completion_tokens)
                                     for r in ok if r.ttft_ms is not None),
        "goodput": _r(ratio(sum(1 for x in ttft if x <= slo_ms), len(results)), 4),
        "hit_rate": _r(ratio(sum(r.cached_tokens for r in ok), prompt), 4),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "served_per_worker": dict(sorted(per.items())),
        "worker_cv": _r(cv(list(per.values())), 4) if per else None,
        "lag_p50_ms": _r(percentile(lag, 50, presorted=True)) if lag else None,
        "lag_p95_ms": _r(percentile(lag, 95, presorted=True)) if lag else None,
        "lag_max_ms": _r(lag[-1]) if lag else None,
    }


def cpu_verdict(*, lag_p95_ms: float | None, cpu_busy: float | None, max_lag_ms: float, max_cpu_busy: float,
                own_cpu_share: float | None = None, wait_share: float | None = None, wait_who: str = "",
                max_wait_share: float = 0.05) -> tuple[bool, list[str]]:
    """Whether a run's figures say more about the machine than about the mesh, and why.

    CPU-bound when the client sent its requests late (``lag_p95_ms`` > ``max_lag_ms``: arrivals are
    no longer the trace's); or a process of the replay (``wait_who``) spent more than
    ``max_wait_share`` of the run runnable but waiting for a CPU (``wait_share``: its event loop's
    run-queue delay / the run's wall time; an engine that waits runs its modelled steps that much
    late, a broker or adapter delays every hop); or the run's own processes used more than
    ``max_cpu_busy`` of the CPUs (``own_cpu_share``). The machine's busy share (``cpu_busy``) decides
    only when the wait could not be measured (no ``/proc/PID/schedstat``): a machine kept busy by
    other work may still run the replay on time, and the wait says whether it did. A figure that
    could not be measured (None) decides nothing."""
    reasons = []
    if lag_p95_ms is not None and lag_p95_ms > max_lag_ms:
        reasons.append(f"client send lag p95 {lag_p95_ms:.0f} ms > {max_lag_ms:g} ms: requests left later than the trace says")
    if wait_share is not None and wait_share > max_wait_share:
        reasons.append(f"{wait_who or 'a process'} waited for a CPU {wait_share:.1%} of the run > {max_wait_share:.1%}: "
                       "its steps and hops ran late")
    if wait_share is None and cpu_busy is not None and cpu_busy > max_cpu_busy:
        reasons.append(f"machine CPU {cpu_busy:.0%} busy > {max_cpu_busy:.0%} (the replay's own waits unmeasured): "
                       "engine steps and hops may have waited for a CPU")
    if own_cpu_share is not None and own_cpu_share > max_cpu_busy:
        reasons.append(f"the replay's own processes used {own_cpu_share:.0%} of the CPUs > {max_cpu_busy:.0%}")
    return bool(reasons), reasons


def ranking(by_policy: dict[str, float | None]) -> list[str]:
    """Policies best first by the figure (lower is better); policies without one last, by name."""
    have = sorted((v, p) for p, v in by_policy.items() if v is not None)
    return [p for _, p in have] + sorted(p for p, v in by_policy.items() if v is None)


def compare(real: dict[str, dict[str, Any]], sim: dict[str, dict[str, Any]], tolerance: float = 0.2,
            fitted: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Real replay against ``mesh sim`` per policy: both rankings by TTFT p95 and whether they agree,
    each policy's real/sim p95 ratio and whether every one is within ``tolerance``; ``pays``: what
    cache_aware saves against each baseline, real beside the simulator's (and ``fitted_ms``, the
    simulator's on the engine fitted to the real cache_aware run, when ``fitted`` is given)."""
    pols = [p for p in real if p in sim]
    r_rank = ranking({p: real[p].get("ttft_p95_ms") for p in pols})
    s_rank = ranking({p: sim[p].get("ttft_p95_ms") for p in pols})
    ratios: dict[str, float | None] = {}
    for p in pols:
        a, b = real[p].get("ttft_p95_ms"), sim[p].get("ttft_p95_ms")
        ratios[p] = _r(a / b, 4) if a is not None and b else None
    within = bool(ratios) and all(v is not None and abs(v - 1) <= tolerance for v in ratios.values())
    out = {"ranking_real": r_rank, "ranking_sim": s_rank, "ranking_agrees": r_rank == s_rank,
           "p95_real_over_sim": ratios, "p95_tolerance": tolerance, "p95_within_tolerance": within}
    if fitted is not None and all(p in fitted for p in pols):  # the same, on the engine fitted to the real run
        fr = {p: (_r(real[p]["ttft_p95_ms"] / fitted[p]["ttft_p95_ms"], 4)
                  if real[p].get("ttft_p95_ms") is not None and fitted[p].get("ttft_p95_ms") else None) for p in pols}
        f_rank = ranking({p: fitted[p].get("ttft_p95_ms") for p in pols})
        out["fitted"] = {"ranking": f_rank, "ranking_agrees": r_rank == f_rank, "p95_real_over_sim": fr,
                         "p95_within_tolerance": bool(fr) and all(v is not None and abs(v - 1) <= tolerance for v in fr.values())}
    # what cache_aware pays against each baseline (its mean TTFT difference), real beside the
    # simulator's: the policy-level audit (mesh sim --audit) is that simulator run on a recording
    subject = "cache_aware"
    if subject in pols:
        pays = {}
        for p in pols:
            if p == subject:
                continue
            got = []
            for side in (real, sim, fitted or {}):
                a, b = (side.get(p) or {}).get("ttft_mean_ms"), (side.get(subject) or {}).get("ttft_mean_ms")
                got.append(_r(a - b) if a is not None and b is not None else None)
            if got[:2] != [None, None]:
                pays[p] = {"real_ms": got[0], "sim_ms": got[1]}
                if fitted is not None:
                    pays[p]["fitted_ms"] = got[2]
        if pays:
            out["pays"] = pays
    return out
