"""``mesh bench replay``: a trace replayed through real processes, every policy, beside ``mesh sim``.

Per policy, fresh processes on 127.0.0.1 (:class:`mesh.lab.procs.ProcGroup`): ``W`` ``mesh
stub-sglang`` engines (``--time-scale`` = the slowdown, see :mod:`mesh.lab.bench.replay_core`),
each behind a ``mesh attach sglang`` adapter; ``K`` ``mesh broker --http`` with the policy, the
exchange (``--exchange``/``--peer`` each other, when ``K`` > 1 and the exchange is on) and the
prefix provider (``indexer``: one ``mesh indexer`` all brokers query, adapters send KV events to one
broker; ``radix_tree``: each broker its own index, adapters send to all). Then the HTTP clients
(:mod:`mesh.lab.bench.replay_client`) send the identical request stream at its (scaled) trace times.

Beside it, :func:`mesh.lab.sim.runner.run_sim` replays the same stream (the same ``Workload``
object, so the same token ids, arrivals and output lengths) through the same fleet shape: the same
policies, provider, router count, exchange, and the stubs' engine config slowed the same way.

CPU honesty, per policy run: the client's send lag (actual send - scheduled), how long each
process's event loop waited for a CPU while runnable (:class:`WaitSampler`, ``schedstat``), the
machine's CPU busy share over the run (``/proc/stat``) and the replay's own processes' CPU
(:class:`mesh.lab.bench.proc_cpu.CpuSampler`); :func:`mesh.lab.bench.replay_core.cpu_verdict`
marks the run ``cpu_bound`` with its reasons, and the output says so instead of presenting the
figures as the mesh's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh.engine_model import EngineConfig
from mesh.errors import MeshError
from mesh.lab.bench.proc_cpu import CpuSampler
from mesh.lab.bench.replay_client import Planned, encode_body, run_clients
from mesh.lab.bench.replay_core import ReplayConfig, client_figures, compare, cpu_verdict, slowed_engine
from mesh.lab.procs import ProcGroup, free_port, wait_for_log_event
from mesh.lab.sim.runner import SimConfig, build_workload, run_sim
from mesh.lab.sim.workloads import Workload
from mesh.lab.up import wait_for_workers

__all__ = ["build_replay_workload", "sim_config", "run_replay_bench", "machine_busy"]

MODEL = "replay"
_STARTUP_S = 90.0
_DRAIN_S = 2.0
_SIM_FIGURES = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "e2e_p95_ms", "goodput", "hit_rate", "worker_cv",
                "served_per_worker", "completed", "requests")

Say = Callable[[str], None]


def sim_config(cfg: ReplayConfig) -> SimConfig:
    """The ``mesh sim`` configuration of the same replay (fleet shape, policies, slowed engines)."""
    return SimConfig(trace=cfg.trace, workload=cfg.workload, rate=cfg.rate, duration_s=None, time_scale=cfg.arrival_factor,
                     max_requests=cfg.max_requests, seed=cfg.seed, policies=list(cfg.policies), providers=[cfg.provider],
                     routers=[cfg.routers], workers=[cfg.workers], exchange=cfg.exchange and cfg.routers > 1,
                     net_ms=cfg.net_ms, ttft_slo_ms=cfg.slo_ms, engine=slowed_engine(EngineConfig(), cfg.slowdown))


def build_replay_workload(cfg: ReplayConfig) -> Workload:
    """The request stream both sides replay: the trace slice with arrivals x time_scale x slowdown, or
    the generated workload (``rate`` requests/s) with its arrivals stretched the same way."""
    sc = sim_config(cfg)
    wl = build_workload(sc)
    if cfg.workload is not None and cfg.arrival_factor != 1:
        for r in wl.requests:
            r.arrival_s *= cfg.arrival_factor
    return wl


def machine_busy() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from ``/proc/stat`` (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
    except OSError:
        return None
    if not parts or parts[0] != "cpu":
        return None
    vals = [int(x) for x in parts[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return total - idle, total


def run_delay_s(pid: int) -> float | None:
    """Seconds the main thread of ``pid`` (its event loop) spent runnable but waiting for a CPU
    (``/proc/PID/task/PID/schedstat``, field 2), None where there is none."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class WaitSampler:
    """Run-queue wait of each process's main thread over a window: ``start()``, then ``stop(wall_s)``
    -> {role: the largest share of the window one of its processes waited}, and the process that
    waited most (``worst``: (role, name, share))."""

    def __init__(self, names: dict[str, dict[int, str]]) -> None:
        self.names = names
        self._t0: dict[int, float | None] = {}
        self.worst: tuple[str, str, float] | None = None

    def start(self) -> None:
        self._t0 = {pid: run_delay_s(pid) for pids in self.names.values() for pid in pids}

    def stop(self, wall_s: float) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for role, pids in self.names.items():
            shares = []
            for pid, name in pids.items():
                a, b = self._t0.get(pid), run_delay_s(pid)
                if a is None or b is None or wall_s <= 0:
                    continue
                shares.append((max(0.0, b - a) / wall_s, name))
                if self.worst is None or shares[-1][0] > self.worst[2]:
                    self.worst = (role, name, shares[-1][0])
            out[role] = round(max(shares)[0], 4) if shares else None
        return out


def _busy_share(a: tuple[int, int] | None, b: tuple[int, int] | None) -> float | None:
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


# ----------------------------------------------------------------------------- processes


def _start_fleet(g: ProcGroup, cfg: ReplayConfig, policy: str) -> tuple[list[str], dict[str, list[int]]]:
    """Start the indexer, brokers, engines and adapters of one policy run; returns the brokers' HTTP
    URLs and the processes' pids by role, once every broker has every worker healthy."""
    roles: dict[str, list[int]] = {"brokers": [], "engines": [], "adapters": [], "indexer": []}
    quiet = ["--log-level", "warning"]
    engines = [g.spawn(f"engine-{i}", ["stub-sglang", "--port", "0", "--time-scale", repr(float(cfg.slowdown)),
                                       "--model", MODEL, *quiet]) for i in range(cfg.workers)]
    extra = ["--policy", policy, "--seed", str(cfg.seed), "--http", "127.0.0.1:0", "--drain-timeout-s", str(_DRAIN_S), *quiet]
    if cfg.provider == "indexer":
        idx = g.spawn("indexer", ["indexer", "--listen", "127.0.0.1:0", *quiet])
        ep = wait_for_log_event(idx.log_path, "indexer_listening", _STARTUP_S, idx.popen)["endpoint"]
        extra += ["--cache-prefix-provider", "indexer", "--kv-indexer-endpoint", ep if ep.startswith("http") else "http://" + ep]
        roles["indexer"].append(idx.pid)
    else:
        extra += ["--cache-prefix-provider", "radix_tree"]
    x_eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(cfg.routers)] if cfg.exchange and cfg.routers > 1 else []
    brokers, urls = [], []
    for k in range(cfg.routers):
        xs = ["--exchange", x_eps[k], *(a for j, e in enumerate(x_eps) if j != k for a in ("--peer", e))] if x_eps else []
        b = g.broker(f"broker-{k}", *extra, *xs, timeout_s=_STARTUP_S)
        urls.append(wait_for_log_event(b.log_path, "http_listening", _STARTUP_S, b.popen, start=b.log_start)["url"])
        brokers.append(b)
        roles["brokers"].append(b.pid)
    backends = [a for b in brokers for a in ("--broker", b.backend)]
    to = ["--kv-events-to", "one" if cfg.provider == "indexer" else "all"]
    ids = [f"w{i:02d}" for i in range(cfg.workers)]
    for i, p in enumerate(engines):
        url = wait_for_log_event(p.log_path, "sglang_stub_listening", _STARTUP_S, p.popen, start=p.log_start)["url"]
        a = g.spawn(f"adapter-{i}", ["attach", "sglang", "--url", url, *backends, "--worker-id", ids[i], *to,
                                     "--drain-timeout-s", str(_DRAIN_S), *quiet])
        roles["engines"].append(p.pid)
        roles["adapters"].append(a.pid)
    for b in brokers:
        asyncio.run(wait_for_workers(b.frontend, cfg.workers, _STARTUP_S, ids=set(ids)))
    return urls, roles


def _plan(wl: Workload) -> list[Planned]:
    return [Planned(r.idx, r.arrival_s, encode_body(MODEL, wl.prompt(r), r.output_len)) for r in wl.requests]


class FleetStartError(MeshError, RuntimeError):
    """A process of the replay's fleet did not come up (its log tail is in the message)."""


class _PortTaken(FleetStartError):
    """A broker's exchange port, chosen free before it started, was taken meanwhile."""


#: fleet starts at most, when an exchange port chosen free was taken before its broker bound it
_FLEET_ATTEMPTS = 3


def _start_fleet_retrying(cfg: ReplayConfig, policy: str, log_dir: Path) -> tuple[ProcGroup, list[str], dict[str, list[int]]]:
    """:func:`_start_fleet` in a fresh group, again (fresh ports, every process restarted) when a
    broker found its pre-chosen exchange port taken: two brokers that are each other's ``--peer``
    need their ports before either starts, so another process may bind one in between."""
    import tenacity

    tries = 0

    def attempt() -> tuple[ProcGroup, list[str], dict[str, list[int]]]:
        nonlocal tries
        tries += 1
        g = ProcGroup(log_dir / policy if tries == 1 else log_dir / f"{policy}-start{tries}")
        try:
            urls, roles = _start_fleet(g, cfg, policy)
        except RuntimeError as exc:
            g.stop_all(grace_s=5.0)
            if "already in use" in str(exc):
                raise _PortTaken(str(exc)) from None
            raise FleetStartError(str(exc)) from None
        except BaseException:
            g.stop_all(grace_s=5.0)
            raise
        return g, urls, roles

    return tenacity.Retrying(stop=tenacity.stop_after_attempt(_FLEET_ATTEMPTS), retry=tenacity.retry_if_exception_type(_PortTaken),
                             reraise=True)(attempt)


def _run_policy(cfg: ReplayConfig, policy: str, plan: list[Planned], log_dir: Path,
                progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    g, urls, roles = _start_fleet_retrying(cfg, policy, log_dir)
    try:
        roles["client"] = [os.getpid()]
        sampler = CpuSampler(roles)
        waits = WaitSampler({role: {pid: f"{role.rstrip('s')}-{i}" for i, pid in enumerate(pids)} for role, pids in roles.items()})
        sampler.start()
        waits.start()
        busy0, t0 = machine_busy(), time.monotonic()
        results = asyncio.run(run_clients(urls, plan, deadline_ms=int(max(600_000, 60_000 * cfg.slowdown)), progress=progress))
        wall = time.monotonic() - t0
        busy = _busy_share(busy0, machine_busy())
        cpu = sampler.stop()
        wait = waits.stop(wall)
    finally:
        g.stop_all(grace_s=5.0)
    fig = client_figures(results, cfg.slo_ms, [f"w{i:02d}" for i in range(cfg.workers)])
    ncpu = os.cpu_count() or 1
    own = sum(cpu.values()) / (wall * ncpu) if wall > 0 else None
    worst = waits.worst
    bound, reasons = cpu_verdict(lag_p95_ms=fig["lag_p95_ms"], cpu_busy=busy, own_cpu_share=own,
                                 wait_share=worst[2] if worst else None, wait_who=worst[1] if worst else "",
                                 max_lag_ms=cfg.max_lag_ms, max_cpu_busy=cfg.max_cpu_busy, max_wait_share=cfg.max_wait_share)
    return {**fig, "wall_s": round(wall, 3), "machine_cpu_busy": None if busy is None else round(busy, 4),
            "own_cpu_share": None if own is None else round(own, 4), "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
            "cpu_wait_share": wait, "cpu_wait_worst": list(worst) if worst else None,
            "cpu_bound": bound, "cpu_bound_reasons": reasons}


def _fitted_sim(sc: SimConfig, wl: Workload, real: dict[str, Any],
                say: Say) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The simulator once more on an engine fitted to the real cache_aware run's mean TTFT and
    time per output token (what ``mesh sim --audit`` does with a recording): every policy's
    figures on it, and the fit. (None, None) without a complete cache_aware run."""
    from mesh.lab.sim.fit import Observed
    from mesh.lab.sim.twin import SUBJECT, fit_twin

    r = real.get(SUBJECT)
    if not r or not r.get("ttft_mean_ms"):
        return None, None
    fit = fit_twin(sc, wl, SUBJECT, Observed(r["ttft_mean_ms"], r.get("tpot_mean_ms"), r["completed"]))
    engine = fit.pop("engine")
    fit.pop("steps", None)
    say(f"  engine fitted to the real {SUBJECT} run in {fit['evaluations']} simulator runs: prefill x{fit['prefill_speed']:.2f}, "
        f"decode x{fit['decode_speed']:.2f} of the stubs' own")
    arms = run_sim(dataclasses.replace(sc, engine=engine), workload=wl)["arms"]
    return {a["policy"]: {k: a.get(k) for k in _SIM_FIGURES} for a in arms}, fit


def run_replay_bench(cfg: ReplayConfig, *, log_dir: str | None = None, say: Say = print,
                     progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Run ``mesh sim`` and then the real replay of every policy; returns the JSON-ready result.
    ``progress(phase, done, total)`` as requests complete (phase "sim" or the policy)."""
    cfg.validate()
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mesh-replay-"))
    logs.mkdir(parents=True, exist_ok=True)
    wl = build_replay_workload(cfg)
    stats = wl.stats()
    say(f"replay: {stats['requests']} requests over {stats['span_s']:.1f} s, {cfg.workers} engines, {cfg.routers} brokers "
        f"({cfg.provider}{', exchange' if cfg.exchange and cfg.routers > 1 else ''}), slowdown {cfg.slowdown:g}; logs in {logs}")
    sc = sim_config(cfg)
    sim_prog = None if progress is None else (lambda arm, arms, done, total: progress(f"sim {arm + 1}/{arms}", done, total))
    sim = run_sim(sc, workload=wl, progress=sim_prog)
    sim_by = {a["policy"]: {k: a.get(k) for k in _SIM_FIGURES} for a in sim["arms"]}
    plan = _plan(wl)
    load_avg = os.getloadavg() if hasattr(os, "getloadavg") else None
    real: dict[str, Any] = {}
    for pol in cfg.policies:
        cb = None if progress is None else (lambda sent, done, pol=pol: progress(pol, done, len(plan)))
        real[pol] = _run_policy(cfg, pol, plan, logs, cb)
        say(f"  {pol}: TTFT p95 {real[pol]['ttft_p95_ms']} ms real vs {sim_by[pol]['ttft_p95_ms']} ms sim"
            + ("  [CPU-BOUND]" if real[pol]["cpu_bound"] else ""))
    fitted_by, engine_fit = _fitted_sim(sc, wl, real, say)
    cmp = compare(real, sim_by, fitted=fitted_by)
    reasons = [f"{p}: {r}" for p in cfg.policies for r in real[p]["cpu_bound_reasons"]]
    return {
        "bench": "replay",
        "config": cfg.to_dict(),
        "sim_config": {**sc.to_dict(), "trace": cfg.trace},
        "workload": {"name": wl.name, **stats},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_at_start": [round(x, 2) for x in load_avg] if load_avg else None},
        "real": real,
        "sim": sim_by,
        "sim_fitted": fitted_by,
        "engine_fit": engine_fit,
        "comparison": cmp,
        "cpu_bound": bool(reasons),
        "cpu_bound_reasons": reasons,
        "ok": all(real[p]["completed"] == real[p]["requests"] for p in cfg.policies),
        "log_dir": str(logs),
    }


# ----------------------------------------------------------------------------- output


def print_results(res: dict[str, Any], console) -> None:
    from rich.table import Table

    from mesh.lab.bench.report import fmt

    cfg = res["config"]
    s = cfg["slowdown"]
    x = ", exchange" if cfg["exchange"] and cfg["routers"] > 1 else ""
    t = Table(title=f"mesh bench replay: {res['workload']['name']}, {res['workload']['requests']} requests, "
                    f"{cfg['workers']} engines, {cfg['routers']} broker(s) ({cfg['provider']}{x}), slowdown {s:g} "
                    f"(real ms; / {s:g} = full-speed engine)")
    t.caption = ("each cell: real / sim; per worker and send lag: real; CPU: the verdict, the most a replay process "
                 "waited for a CPU / the machine's busy share")
    for c in ("policy", "TTFT p50 ms", "TTFT p95 ms", "p95 ratio", "goodput", "hit rate", "worker CV", "per worker",
              "lag p95", "CPU"):
        t.add_column(c, justify="left" if c in ("policy", "per worker") else "right")
    cmp = res["comparison"]
    for pol in cfg["policies"]:
        r, m = res["real"][pol], res["sim"][pol]
        t.add_row(pol, f"{fmt(r['ttft_p50_ms'])} / {fmt(m['ttft_p50_ms'])}", f"{fmt(r['ttft_p95_ms'])} / {fmt(m['ttft_p95_ms'])}",
                  fmt(cmp["p95_real_over_sim"].get(pol), "{:.2f}x"), f"{fmt(r['goodput'], '{:.3f}')} / {fmt(m['goodput'], '{:.3f}')}",
                  f"{fmt(r['hit_rate'], '{:.3f}')} / {fmt(m['hit_rate'], '{:.3f}')}",
                  f"{fmt(r['worker_cv'], '{:.2f}')} / {fmt(m['worker_cv'], '{:.2f}')}",
                  " ".join(str(v) for v in r["served_per_worker"].values()), fmt(r["lag_p95_ms"], "{:.0f} ms"),
                  ("[red]BOUND[/]" if r["cpu_bound"] else "ok")
                  + f" {fmt((r.get('cpu_wait_worst') or [None] * 3)[2], '{:.1%}')} / {fmt(r['machine_cpu_busy'], '{:.0%}')}")
    console.print(t)
    console.print(f"ranking by TTFT p95: real {' < '.join(cmp['ranking_real'])}; sim {' < '.join(cmp['ranking_sim'])}: "
                  + ("[green]agree[/]" if cmp["ranking_agrees"] else "[yellow]differ[/]")
                  + f"; p95 within {cmp['p95_tolerance']:.0%}: " + ("[green]yes[/]" if cmp["p95_within_tolerance"] else "[yellow]no[/]"))
    if cmp.get("pays"):
        console.print("cache_aware pays per request (the baseline's mean TTFT minus its own), real / sim (the policy-level "
                      "audit's twin): " + "; ".join(f"{p} {fmt(v['real_ms'], '{:+.0f}')} / {fmt(v['sim_ms'], '{:+.0f}')} ms"
                                                      for p, v in cmp["pays"].items()))
        ef = res.get("engine_fit")
        fc = cmp.get("fitted")
        if ef and fc:
            console.print(f"on the engine fitted to the real cache_aware run: ranking {' < '.join(fc['ranking'])}: "
                          + ("[green]agree[/]" if fc["ranking_agrees"] else "[yellow]differ[/]") + "; p95 real/sim "
                          + " ".join(f"{p} {fmt(v, '{:.2f}x')}" for p, v in fc["p95_real_over_sim"].items())
                          + f", within {cmp['p95_tolerance']:.0%}: " + ("[green]yes[/]" if fc["p95_within_tolerance"] else "[yellow]no[/]"))
        if ef and all(v.get("fitted_ms") is not None for v in cmp["pays"].values()):
            console.print(f"  on the engine fitted to the real cache_aware run (prefill x{ef['prefill_speed']:.2f}, decode "
                          f"x{ef['decode_speed']:.2f}): " + "; ".join(f"{p} {fmt(v['real_ms'], '{:+.0f}')} / "
                                                                       f"{fmt(v['fitted_ms'], '{:+.0f}')} ms"
                                                                       for p, v in cmp["pays"].items()))
    if res["cpu_bound"]:
        console.print("[bold red]CPU-BOUND[/]: these real figures measure this machine's CPU more than the mesh; "
                      "do not read them as the mesh's (raise --slowdown, shorten the slice, or use a quieter machine):")
        for why in res["cpu_bound_reasons"]:
            console.print(f"  - {why}")
    failed = {p: res["real"][p]["errors"] for p in cfg["policies"] if res["real"][p]["errors"]}
    if failed:
        console.print(f"[red]failed requests[/]: {failed} (logs in {res['log_dir']})")
