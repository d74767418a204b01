"""``mesh sim --fairness``: tenants and priority bands through the broker's own core in virtual time.

The broker's :class:`~mesh.broker_core.BrokerCore` (its park queue, per-tenant quotas, priority
bands with aging, fair shares) in front of ``workers`` simulated workers with ``slots`` requests
each (``--max-inflight-per-worker``) and exponential service times. Every tenant offers Poisson
load as a share of the fleet's capacity (``workers x slots / service_s`` requests per second); the
report gives each tenant's offered, served and refused requests and its queue wait (SUBMIT
accepted -> first attempt sent) p50 and p95.

Two checks (issue 31's fairness targets), each a pair of runs on the same seed:

* ``flood``: two tenants of one band, weight 1, each offering 45% of capacity; then the second
  offers ten times that (its share x 10). The first tenant's p95 queue wait under the flood may be
  at most 1.2x its p95 without it.
* ``bands``: a ``high`` tenant offering 60% and a ``low`` one 90% (overload): the high band's p95
  queue wait at most 0.2x the low band's.

``--tenant NAME:BAND:WEIGHT:SHARE`` (repeatable) runs one workload of your own instead.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass
from typing import Any

from mesh import protocol as P
from mesh.broker_core import TO_CLIENT, TO_WORKER, BrokerCore
from mesh.config import BrokerSettings, build
from mesh.errors import ConfigError
from mesh.routing.router import Router, make_policy
from mesh.stats import percentile
from mesh.tenants import BANDS, KeyRing, Tenant

__all__ = ["TenantLoad", "parse_tenant", "run_fairness", "fairness_checks"]

_REQUEST = bytes([P.Cmd.REQUEST])
_FLOOD_MAX_RATIO = 1.2
_BANDS_MAX_RATIO = 0.2


@dataclass(frozen=True)
class TenantLoad:
    name: str
    band: str = "normal"
    weight: float = 1.0
    share: float = 0.5  # offered load, a fraction of the fleet's capacity


def parse_tenant(text: str) -> TenantLoad:
    """``NAME:BAND:WEIGHT:SHARE`` (``--tenant``); a ConfigError names the part."""
    parts = text.split(":")
    if len(parts) != 4:
        raise ConfigError(f"tenant: expected NAME:BAND:WEIGHT:SHARE, got {text!r}")
    name, band, weight, share = parts
    if band not in BANDS:
        raise ConfigError(f"tenant: band must be one of {', '.join(BANDS)}, got {band!r}")
    try:
        w, s = float(weight), float(share)
    except ValueError:
        raise ConfigError(f"tenant: WEIGHT and SHARE must be numbers, got {text!r}") from None
    if not (0 < w <= 1e6 and 0 < s <= 100):
        raise ConfigError(f"tenant: WEIGHT must be in (0, 1e6] and SHARE in (0, 100], got {text!r}")
    return TenantLoad(name, band, w, s)


class _QuietLog:
    def __getattr__(self, name: str):
        return lambda *a, **k: None


def run_fairness(tenants: list[TenantLoad], *, workers: int = 8, slots: int = 4, service_s: float = 0.2,
                 duration_s: float = 60.0, seed: int = 0, aging_s: float = 5.0, queue_timeout_s: float = 5.0) -> dict[str, Any]:
    """One run: per-tenant offered / served / refused and queue-wait percentiles (seconds)."""
    s = build(BrokerSettings, {"policy": "round_robin", "max_inflight_per_worker": slots, "queue_timeout_s": queue_timeout_s,
                               "park_aging_s": aging_s, "progress_timeout_ms": 0, "default_deadline_ms": 600_000,
                               "max_inflight_per_client": 1_000_000, "max_inflight": 1_000_000, "max_parked": 1_000_000})
    core = BrokerCore(s, Router(make_policy("round_robin", rng=random.Random(seed)), None), log=_QuietLog())
    core.intake.tenants = KeyRing(tenants={t.name: Tenant(t.name, BANDS.index(t.band), t.weight) for t in tenants},
                                  digests={}, zmq_tenant=tenants[0].name)
    rng = random.Random(seed)
    capacity = workers * slots / service_s
    seq = itertools.count()
    events: list[tuple[float, int, str, Any]] = []  # (t, seq, kind, payload)
    for t in tenants:
        at = 0.0
        while True:
            at += rng.expovariate(t.share * capacity)
            if at >= duration_s:
                break
            heapq.heappush(events, (at, next(seq), "arrive", t))
    for w in range(workers):
        heapq.heappush(events, (0.0, next(seq), "hb", w))
    core.start(0.0)
    for w in range(workers):
        core.worker_frames([f"W{w}".encode(), *P.encode_ready(P.Ready(f"w{w}", "m", "mixed", {}, 16, 256, 400_000, 1, 0, 500))], 0.0)
        core.worker_frames([f"W{w}".encode(), *P.encode_heartbeat()], 0.0)
    core.take()
    arrived: dict[bytes, tuple[str, float]] = {}  # client identity -> (tenant, arrival)
    stats = {t.name: {"offered": 0, "served": 0, "refused": 0, "waits": []} for t in tenants}
    n = 0
    end = duration_s + queue_timeout_s + 10 * service_s
    while events:
        now, _, kind, x = heapq.heappop(events)
        if now > end:
            break
        if kind == "arrive":
            n += 1
            ident = b"\x00sim:" + n.to_bytes(8, "big")
            arrived[ident] = (x.name, now)
            stats[x.name]["offered"] += 1
            body = P.submit_body(f"r{n}", input_ids=[1 + n % 7, 2, 3], params={"max_new_tokens": 1}, tenant=x.name,
                                 priority=x.band)
            core.submit(ident, P.submit_of_body(body, P.pack(body)), now)
        elif kind == "done":
            ident, rid, attempt = x
            core.worker_frames([ident, *P.encode_worker_final(rid, attempt, "stop", {"prompt_tokens": 3}, b"")], now)
        elif kind == "hb":
            if now < end:
                core.worker_frames([f"W{x}".encode(), *P.encode_heartbeat()], now)
                heapq.heappush(events, (now + 0.4, next(seq), "hb", x))
        else:  # tick
            core.tick(now)
        for snd in core.take():
            if snd.to == TO_WORKER and snd.frames[1] == _REQUEST:
                inf = snd.ref
                if snd.attempt == 1:
                    tenant, t0 = arrived[inf.client]
                    stats[tenant]["waits"].append(now - t0)
                heapq.heappush(events, (now + rng.expovariate(1.0 / service_s), next(seq), "done", (snd.identity, inf.rid, snd.attempt)))
            elif snd.to == TO_CLIENT:
                m = P.decode_client_reply(snd.frames)
                tenant = arrived.get(snd.identity, ("?", 0.0))[0]
                if isinstance(m, P.ClientError) and tenant in stats:
                    stats[tenant]["refused"] += 1
                elif isinstance(m, P.ClientFinal) and tenant in stats:
                    stats[tenant]["served"] += 1
        wake = core.wakeup_s()
        if wake < end and (not events or wake < events[0][0]):
            heapq.heappush(events, (max(wake, now), next(seq), "tick", None))
    out = {}
    for name, st in stats.items():
        w = sorted(st.pop("waits"))
        out[name] = {**st, "wait_p50_s": round(percentile(w, 50, presorted=True), 6),
                     "wait_p95_s": round(percentile(w, 95, presorted=True), 6)}
    return {"capacity_rps": capacity, "tenants": out,
            "loads": [t.__dict__ for t in tenants], "parked_left": len(core.parked)}


def fairness_checks(*, workers: int = 8, slots: int = 4, service_s: float = 0.2, duration_s: float = 60.0,
                    seed: int = 0, aging_s: float = 5.0) -> dict[str, Any]:
    """The two target checks (module docstring): each run's report, the ratios and pass/fail."""
    kw = dict(workers=workers, slots=slots, service_s=service_s, duration_s=duration_s, seed=seed, aging_s=aging_s)
    base = run_fairness([TenantLoad("a", "normal", 1.0, 0.45), TenantLoad("b", "normal", 1.0, 0.45)], **kw)
    flood = run_fairness([TenantLoad("a", "normal", 1.0, 0.45), TenantLoad("b", "normal", 1.0, 4.5)], **kw)
    bands = run_fairness([TenantLoad("hi", "high", 1.0, 0.6), TenantLoad("lo", "low", 1.0, 0.9)], **kw)
    a0, a1 = base["tenants"]["a"]["wait_p95_s"], flood["tenants"]["a"]["wait_p95_s"]
    hi, lo = bands["tenants"]["hi"]["wait_p95_s"], bands["tenants"]["lo"]["wait_p95_s"]
    # a p95 of zero (never waited) cannot be made worse by a ratio: compare with one service slot's grain
    grain = service_s / (workers * slots) / 100
    flood_ratio = (a1 + grain) / (a0 + grain)
    bands_ratio = (hi + grain) / (lo + grain)
    return {
        "flood": {"without": base, "with": flood, "p95_ratio": round(flood_ratio, 4), "max": _FLOOD_MAX_RATIO,
                  "pass": flood_ratio <= _FLOOD_MAX_RATIO},
        "bands": {"run": bands, "p95_ratio": round(bands_ratio, 4), "max": _BANDS_MAX_RATIO,
                  "pass": bands_ratio <= _BANDS_MAX_RATIO},
    }
