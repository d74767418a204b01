"""``mesh up``: an all-in-one local mesh on 127.0.0.1, driven the way users drive it.

Part 1, the path users run: HTTP clients (the official ``openai`` package, streaming
``/v1/completions``) -> ``mesh broker --http`` -> one ``mesh attach sglang`` adapter per engine ->
``mesh stub-sglang`` engines (SGLang's HTTP API, KV events and LoadStat over the GPU server model).
Part 2, the ZeroMQ client path: :class:`mesh.client.Client` -> the same broker -> ``mesh
worker-stub`` simulated workers, for a third of the duration. Both parts offer the same seeded
open-loop shared-prefix load (:mod:`mesh.lab.loadgen`, :mod:`mesh.lab.loadgen_http`) and print the same
summary table; the exit code is 0 only when every request of both parts succeeded.

``--serve`` starts the engines and their adapters on one broker (one consistent fleet: every
worker is an SGLang stub engine, which honours what the API promises; no simulated workers mixed
in under the same model name), prints where to point applications and keeps serving until
Ctrl-C / SIGTERM.

Readiness is always an event: the broker's and engines' listening lines, then STATUS polling until
the expected worker ids are healthy. Every process is stopped on the way out, also after Ctrl-C or
SIGTERM (a second signal during that bounded stop is ignored, so nothing is left behind).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from mesh.client import Client
from mesh.errors import ConfigError
from mesh.lab.loadgen import LoadSpec, Pace, run_load, summarize
from mesh.lab.procs import BrokerProc, Proc, ProcGroup, wait_for_log_event

__all__ = ["HttpPath", "run_up", "start_http_path", "wait_for_workers"]

_START_TIMEOUT_S = 60.0  # 2N + 1 Python processes starting at once on a small shared machine


async def wait_for_workers(frontend: str, n: int, timeout_s: float = 30.0, *, ids: set[str] | None = None) -> None:
    """Wait until the broker at ``frontend`` reports ``n`` healthy workers (STATUS polling).

    With ``ids``: until the healthy workers are exactly ``ids`` (so workers that are leaving, for
    example draining adapters, are not counted in place of the ones just started)."""
    deadline = time.monotonic() + timeout_s
    async with Client(frontend) as c:
        while True:
            st = await c.status(timeout_s=max(0.1, deadline - time.monotonic()))
            healthy = {w.get("worker_id") for w in st.workers if w.get("healthy")}
            if (healthy == ids) if ids is not None else len(healthy) >= n:
                return
            if time.monotonic() > deadline:
                want = sorted(ids) if ids is not None else f"{n} workers"
                raise TimeoutError(f"healthy workers after {timeout_s}s: {sorted(healthy)}; wanted {want}")
            await asyncio.sleep(0.05)  # STATUS polling period


async def _broker_counters(frontend: str) -> dict:
    async with Client(frontend) as c:
        return (await c.status()).counters


#: The one model the demo fleet serves: the engines and the simulated workers say the same name,
#: so requests without a model (or under ``mesh``) may go to either.
DEMO_MODEL = "stub-sglang-8b"

#: The policy of the demo's baseline pass: what the hit rate of cache-aware routing is compared with.
BASELINE_POLICY = "power_of_two"


def _scrape(url: str) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def histogram_figures(before: str, after: str, name: str) -> dict | None:
    """p50 / p99 (upper bucket bounds, ms), count and share under 200 ms of the Prometheus histogram
    ``name`` between two scrapes (summed over its label sets). None when it saw nothing."""
    from mesh.adapters.engine_client import parse_prometheus

    def buckets(text: str) -> dict[float, float]:
        out: dict[float, float] = {}
        for metric, labels, v in parse_prometheus(text):
            if metric == name + "_bucket" and "le" in labels:
                le = float(labels["le"])
                out[le] = out.get(le, 0.0) + v
        return out

    b0, b1 = buckets(before), buckets(after)
    cum = sorted((le, v - b0.get(le, 0.0)) for le, v in b1.items())
    total = cum[-1][1] if cum else 0.0
    if total <= 0:
        return None

    def q(x: float) -> float:
        return next(le for le, c in cum if c >= x * total) * 1000

    under = max((c for le, c in cum if le <= 0.2), default=0.0)
    return {"count": int(total), "p50_ms": q(0.5), "p99_ms": q(0.99), "under_200ms": under / total}


def _pace_rows(pace: Pace, ttft: dict | None) -> list[tuple[str, str]]:
    rows = []
    if ttft is not None:
        rows.append(("TTFT p50 / p99 (broker's histogram)", f"<= {ttft['p50_ms']:g} / <= {ttft['p99_ms']:g} ms "
                                                             f"({ttft['under_200ms']:.0%} under 200 ms)"))
    rows.append(("offered / achieved rate", f"{pace.offered_rps:g} / {pace.achieved_rps:.1f} req/s"
                                            + ("  [yellow](lagging)[/]" if pace.lagging() else "")))
    return rows


def _baseline_pass(path: HttpPath, spec: LoadSpec, outcomes: list, console: Console):
    """A short pass (a third of the duration: the same seeded prompts, in the same order) through the
    baseline broker, on flushed engine caches; returns (the main policy's summary over the same
    first requests, the baseline's summary, how many requests)."""
    import urllib.request

    from mesh.lab.loadgen_http import run_http_load

    for u in path.engine_urls:  # cold caches, as at the start of the main pass (their adapters relay the clear)
        try:
            urllib.request.urlopen(urllib.request.Request(u + "/flush_cache", method="POST"), timeout=5).close()
        except OSError as exc:
            console.print(f"[yellow]baseline: could not flush {u}: {exc}[/]")
    short = dataclasses.replace(spec, duration_s=spec.duration_s / 3)
    pace = Pace()
    with _progress(console) as prog:
        task = prog.add_task(f"baseline {BASELINE_POLICY}", total=short.duration_s, done=0)
        out, wall = asyncio.run(run_http_load(path.baseline_url, short, pace=pace,
                                              progress=lambda t, k: prog.update(task, completed=t, done=k)))
    n = pace.started
    same = [o for o in outcomes if 0 <= o.seq < n]
    return summarize(same, wall), summarize(out, wall), n


def _baseline_table(main, base, n: int, console: Console) -> None:
    t = Table(title=f"the hit rate in context: the first {n} requests, cold caches, two policies", show_header=True)
    t.add_column("metric")
    for title in ("main policy (above)", f"{BASELINE_POLICY} (baseline)"):
        t.add_column(title, justify="right")
    for label, f in (("cache hit rate (tokens)", lambda s: f"{s.hit_rate:.1%}"),
                     ("TTFT p50 / p99", lambda s: f"{s.ttft_p50_ms:.1f} / {s.ttft_p99_ms:.1f} ms"),
                     ("E2E p50", lambda s: f"{s.e2e_p50_ms:.1f} ms"), ("ok / requests", lambda s: f"{s.ok} / {s.requests}")):
        t.add_row(label, f(main), f(base))
    console.print(t)


def _retries(before: dict, after: dict) -> int:
    return sum(int(v) - int(before.get(k, 0)) for k, v in after.items() if k.startswith("retries."))


def _table(summary, console: Console, title: str = "mesh up: summary", *, retried_label: str = "retried requests",
           adapter_ok: dict[str, int | None] | None = None, extra: list[tuple[str, str]] | None = None) -> None:
    t = Table(title=title, show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")
    errors = sum(summary.errors.values())
    rows = [
        ("requests", f"{summary.requests}"),
        ("ok / errors", f"{summary.ok} / {errors}" + (f" {dict(summary.errors)}" if errors else "")),
        ("throughput", f"{summary.throughput_rps:.1f} req/s"),
        ("TTFT p50 / p99", f"{summary.ttft_p50_ms:.1f} / {summary.ttft_p99_ms:.1f} ms"),
        ("E2E p50", f"{summary.e2e_p50_ms:.1f} ms"),
        ("cache hit rate (tokens)", f"{summary.hit_rate:.1%}"),
        (retried_label, f"{summary.retried}"),
        *(extra or ()),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    w = Table(title="per worker", show_header=True)
    cols = ["worker", "requests", "cache hit rate"] + (["adapter ok"] if adapter_ok is not None else [])
    for c in cols:
        w.add_column(c, justify="right" if c != "worker" else "left")
    for wid in sorted(set(summary.per_worker) | set(adapter_ok or ())):
        d = summary.per_worker.get(wid, {"requests": 0, "hit_rate": 0.0})
        row = [wid or "(not named)", str(d["requests"]), f"{d['hit_rate']:.1%}"]
        if adapter_ok is not None:
            n = adapter_ok.get(wid)
            row.append("?" if n is None else str(n))
        w.add_row(*row)
    console.print(w)


def _metrics_excerpt(url: str) -> list[str]:
    """A few live lines of the broker's Prometheus endpoint (what a scraper sees)."""
    text = _scrape(url)
    if not text:
        return ["(metrics unavailable)"]
    keep = ("mesh_requests_total", "mesh_decisions_total", "mesh_routed_cached_tokens_total", "mesh_routed_prompt_tokens_total",
            "mesh_decision_latency_seconds_count", "mesh_retries_total")
    return [line for line in text.splitlines() if line.startswith(keep)]


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), TextColumn("{task.fields[done]} done"),
                    TimeRemainingColumn(), console=console, transient=True)


def _serve(args, console: Console, group: ProcGroup) -> int:
    """Keep the local mesh up until SIGINT/SIGTERM, printing where to point applications."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    console.print("[bold green]serving[/]; press Ctrl-C to stop")
    while not stop.wait(1.0):
        dead = [p.name for p in group.procs if not p.alive()]
        if dead:
            console.print(f"[red]processes exited: {dead}[/]")
            return 1
    console.print("stopping (draining in-flight work) ...")
    return 0


def _stop_procs(procs: list[Proc], grace_s: float = 15.0) -> None:
    """SIGTERM all of ``procs`` at once, then wait for each (SIGKILL after the grace period)."""
    for p in procs:
        if p.alive():
            p.popen.send_signal(signal.SIGTERM)
    t_end = time.monotonic() + grace_s
    for p in procs:
        p.stop(max(0.1, t_end - time.monotonic()))


def _adapter_ok(adapters: list[Proc], ids: list[str]) -> dict[str, int | None]:
    """Each stopped adapter's own ``requests_ok`` counter (from its ``adapter_stopped`` line)."""
    out: dict[str, int | None] = {}
    for p, wid in zip(adapters, ids):
        try:
            rec = wait_for_log_event(p.log_path, "adapter_stopped", 0, start=p.log_start)
        except TimeoutError:  # it did not stop cleanly: no counters
            out[wid] = None
            continue
        out[rec.get("worker_id", wid)] = int(rec.get("counters", {}).get("requests_ok", 0))
    return out


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


@dataclasses.dataclass
class HttpPath:
    """A running broker with ``--http`` and its engines, each behind a ``mesh attach sglang`` adapter."""

    broker: BrokerProc
    url: str  # the broker's HTTP ingress (OpenAI API under url + "/v1")
    telemetry: str
    engines: list[Proc]
    engine_urls: list[str]
    adapters: list[Proc]
    worker_ids: list[str]  # adapter i attaches engine i as worker_ids[i]
    baseline: BrokerProc | None = None  # a second broker (another policy) the same adapters attach to
    baseline_url: str = ""


def start_http_path(group: ProcGroup, n: int, *, policy: str = "cache_aware", seed: int = 0, http: str = "127.0.0.1:0",
                    time_scale: str = "1.0", telemetry: str = "tcp://127.0.0.1:*", wait: bool = True,
                    timeout_s: float = _START_TIMEOUT_S, baseline_policy: str | None = None) -> HttpPath:
    """Start ``mesh broker --http``, ``n`` ``mesh stub-sglang --port 0`` engines and one ``mesh attach
    sglang --worker-id stub-<i>`` adapter per engine in ``group``. The engines start while the
    broker does; each adapter starts once its engine's ``sglang_stub_listening`` line names its
    URL. With ``wait``, returns once the broker has exactly these ``n`` workers healthy."""
    engines = [group._spawn(f"engine-{i}", ["stub-sglang", "--port", "0", "--time-scale", time_scale, "--model", DEMO_MODEL])
               for i in range(n)]
    broker = group.broker("broker", "--policy", policy, "--seed", str(seed), "--http", http, "--telemetry", telemetry,
                          timeout_s=timeout_s)
    url = wait_for_log_event(broker.log_path, "http_listening", timeout_s, broker.popen, start=broker.log_start)["url"]
    tel = wait_for_log_event(broker.log_path, "broker_listening", 5, start=broker.log_start)["telemetry"]
    base, base_url, backends = None, "", ["--broker", broker.backend]
    if baseline_policy is not None:  # the adapters register with both; each broker routes its own clients
        base = group.broker("broker-baseline", "--policy", baseline_policy, "--seed", str(seed), "--http", "127.0.0.1:0",
                            timeout_s=timeout_s)
        base_url = wait_for_log_event(base.log_path, "http_listening", timeout_s, base.popen, start=base.log_start)["url"]
        backends += ["--broker", base.backend]
    ids = [f"stub-{i}" for i in range(n)]
    engine_urls, adapters = [], []
    for i, p in enumerate(engines):
        engine_urls.append(wait_for_log_event(p.log_path, "sglang_stub_listening", timeout_s, p.popen, start=p.log_start)["url"])
        adapters.append(group._spawn(f"adapter-{i}", ["attach", "sglang", "--url", engine_urls[-1], *backends,
                                                      "--worker-id", ids[i]]))
    if wait:
        asyncio.run(wait_for_workers(broker.frontend, n, timeout_s, ids=set(ids)))
        if base is not None:
            asyncio.run(wait_for_workers(base.frontend, n, timeout_s, ids=set(ids)))
    return HttpPath(broker, url, tel, engines, engine_urls, adapters, ids, base, base_url)


def run_up(args) -> int:
    console = Console()
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="mesh-up-"))
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / ".mesh-up-check").touch()
        (log_dir / ".mesh-up-check").unlink()
    except OSError as exc:
        raise ConfigError(f"log_dir: cannot write logs in {str(log_dir)!r}: {exc.strerror or exc} (give --log-dir a folder "
                          "you can write)") from None
    group = ProcGroup(log_dir)
    main_thread = threading.current_thread() is threading.main_thread()
    old = {}
    if main_thread:
        # Ctrl-C and SIGTERM raise KeyboardInterrupt wherever the main thread is. asyncio.run's own
        # SIGINT handling (it installs one only over the default handler) instead cancels the main
        # task, and a cleanup that awaits a task it cancelled can swallow that cancellation: the
        # demo would go on running.
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, _raise_interrupt)
    try:
        return _run(args, console, group, log_dir)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: stopping every process")
        return 130
    finally:
        # The stop is bounded (SIGTERM, grace, SIGKILL); a second Ctrl-C must not cut it short.
        for sig in old:
            signal.signal(sig, signal.SIG_IGN)
        try:
            group.stop_all()
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)


def _check_free(host: str, port: int, flag: str) -> None:
    """A fixed listening port that is taken fails ``mesh up`` before any process starts (the
    broker would find out only after the engines, adapters and workers were started)."""
    import errno
    import socket

    if port == 0:
        return
    host = host.strip("[]") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, port))
    except OSError as exc:
        why = "is already in use: stop what listens there or" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror}):"
        raise ConfigError(f"{flag}: {host}:{port} {why} give another port (0 = any free port)") from None


def _check_ports(args) -> None:
    http = getattr(args, "http", None)
    if http:
        host, _, port = http.rpartition(":")
        _check_free(host, int(port), "http")
    tel = getattr(args, "telemetry", None)
    if tel and tel.startswith("tcp://") and not tel.endswith(":*"):
        host, _, port = tel[6:].rpartition(":")
        _check_free("127.0.0.1" if host == "*" else host, int(port), "telemetry")


def _run(args, console: Console, group: ProcGroup, log_dir: Path) -> int:
    n = args.workers
    if n < 1:
        console.print("[red]--workers must be at least 1[/]")
        return 2
    _check_ports(args)
    ts = str(getattr(args, "time_scale", None) or 1.0)
    spec = LoadSpec(rate_rps=args.rate, duration_s=args.duration, groups=args.groups, system_tokens=args.system_tokens,
                    question_tokens=args.question_tokens, max_new_tokens=args.max_new_tokens, seed=args.seed)
    spec_zmq = dataclasses.replace(spec, duration_s=args.duration / 3)
    serve = getattr(args, "serve", False)
    http = getattr(args, "http", None) or "127.0.0.1:0"
    if not serve:
        try:  # part 1's HTTP clients; checked before any process starts
            import openai  # noqa: F401
        except ImportError:
            console.print("[red]mesh up drives its HTTP part with the openai package: pip install openai[/] "
                          "(or use --serve, which needs no client)")
            return 2
    console.print(f"[bold]mesh up[/]: a broker, {n} SGLang stub engines each behind a `mesh attach sglang` adapter"
                  f"{f', {n} simulated workers (part 2)' if not serve else ''} (logs in {log_dir})")

    baseline = BASELINE_POLICY if not serve and args.policy != BASELINE_POLICY else None
    path = start_http_path(group, n, policy=args.policy, seed=args.seed, http=http, time_scale=ts,
                           telemetry=getattr(args, "telemetry", None) or "tcp://127.0.0.1:*", wait=False,
                           baseline_policy=baseline)
    broker, url, tel, engine_urls, stub_ids = path.broker, path.url, path.telemetry, path.engine_urls, path.worker_ids
    engines, adapters = path.engines, path.adapters
    sim_ids = [f"worker-{i}" for i in range(n)] if n > 1 else ["worker"]
    asyncio.run(wait_for_workers(broker.frontend, n, _START_TIMEOUT_S, ids=set(stub_ids)))
    if path.baseline is not None:
        asyncio.run(wait_for_workers(path.baseline.frontend, n, _START_TIMEOUT_S, ids=set(stub_ids)))

    console.print(f"  OpenAI HTTP      {url}/v1   (/v1/completions, /v1/chat/completions, /generate)")
    console.print(f"  ZeroMQ clients   {broker.frontend}   (mesh.client.Client)")
    console.print(f"  workers          {broker.backend}   (mesh attach sglang|vllm --broker ..., mesh worker-stub --broker ...)")
    hosts = {u.rsplit(":", 1)[0] for u in engine_urls}
    where = (f"{hosts.pop()} ports {', '.join(u.rsplit(':', 1)[1] for u in engine_urls)}" if len(hosts) == 1
             else ", ".join(engine_urls))
    console.print(f"  SGLang engines   {where}   (mesh stub-sglang, attached as {stub_ids[0]}..{stub_ids[-1]})")
    console.print(f"  metrics          {url}/metrics")
    console.print(f"  live view        mesh top --telemetry {tel}")
    if serve:
        return _serve(args, console, group)

    # ---- part 1: HTTP clients -> broker --http -> mesh attach sglang -> mesh stub-sglang
    import gc

    from mesh.lab.loadgen_http import run_http_load

    # A full collection over everything imported so far (openai is, see above) is a pause of
    # 0.1-0.2 s in the load generator's loop, measured as TTFT; frozen objects are not scanned again.
    gc.freeze()
    console.rule("[bold]part 1: the path users run[/] (HTTP)")
    console.print("openai client -> mesh broker --http -> mesh attach sglang -> mesh stub-sglang")
    console.print(f"policy {args.policy}; {n} engines (time scale {ts}); streaming /v1/completions at {spec.rate_rps:g} req/s "
                  f"for {spec.duration_s:g} s")
    before = asyncio.run(_broker_counters(broker.frontend))
    metrics_before = _scrape(url)
    pace = Pace()
    with _progress(console) as prog:
        task = prog.add_task("part 1 HTTP", total=spec.duration_s, done=0)
        outcomes, wall = asyncio.run(run_http_load(url, spec, progress=lambda t, k: prog.update(task, completed=t, done=k),
                                                   pace=pace))
    http_summary = summarize(outcomes, wall)
    http_summary.retried = _retries(before, asyncio.run(_broker_counters(broker.frontend)))
    broker_ttft = histogram_figures(metrics_before, _scrape(url), "mesh_ttft_seconds")
    base = None
    if path.baseline is not None:  # the same first prompts, cold caches again, routed by the baseline policy
        base = _baseline_pass(path, spec, outcomes, console)
    _stop_procs(adapters)  # adapters first: they DISCONNECT and report their counters, then the engines
    adapter_ok = _adapter_ok(adapters, stub_ids)
    _stop_procs(engines)
    _table(http_summary, console, "part 1: HTTP path summary", retried_label="retries (broker STATUS)",
           adapter_ok=adapter_ok, extra=_pace_rows(pace, broker_ttft))
    if pace.lagging():
        console.print(f"[yellow]warning[/]: the load generator fell behind ({pace.achieved_rps:.1f} of {pace.offered_rps:g} "
                      f"req/s started; 90 % of starts within {pace.late_ms(0.9):.0f} ms of their slot): the client's TTFT "
                      "includes its own delay on this busy machine; the broker's histogram above is what the mesh added")
    if base is not None:
        _baseline_table(*base, console)

    # ---- part 2: ZeroMQ clients -> the same broker -> simulated workers
    console.rule("[bold]part 2: the ZeroMQ client path[/]")
    console.print("mesh.client.Client -> the same broker -> mesh worker-stub (simulated workers)")
    group.workers("worker", [broker.backend], "--time-scale", ts, "--model", DEMO_MODEL, count=n, timeout_s=_START_TIMEOUT_S)
    asyncio.run(wait_for_workers(broker.frontend, n, _START_TIMEOUT_S, ids=set(sim_ids)))
    console.print(f"{n} simulated workers; ZeroMQ SUBMITs (token ids) at {spec_zmq.rate_rps:g} req/s for {spec_zmq.duration_s:g} s")
    with _progress(console) as prog:
        task = prog.add_task("part 2 ZeroMQ", total=spec_zmq.duration_s, done=0)
        outcomes, wall = asyncio.run(run_load([broker.frontend], spec_zmq,
                                              progress=lambda t, k: prog.update(task, completed=t, done=k)))
    zmq_summary = summarize(outcomes, wall)
    metrics = _metrics_excerpt(url)
    _table(zmq_summary, console, "part 2: ZeroMQ path summary")
    console.print("[bold]live broker metrics[/] (GET /metrics, excerpt, both parts):")
    for line in metrics:
        console.print("  " + line, markup=False, highlight=False)
    if args.json:
        http_d = http_summary.as_dict()
        http_d["retries_broker"] = http_d.pop("retried")
        for wid, k in adapter_ok.items():
            http_d["per_worker"].setdefault(wid, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "hit_rate": 0.0})
            http_d["per_worker"][wid]["adapter_requests_ok"] = k
        http_d["broker_ttft"] = broker_ttft
        http_d["pace"] = {"offered_rps": pace.offered_rps, "achieved_rps": round(pace.achieved_rps, 2),
                          "late_p90_ms": round(pace.late_ms(0.9), 1), "lagging": pace.lagging()}
        out = {"http": http_d, "zmq": zmq_summary.as_dict()}
        if base is not None:
            out["baseline"] = {"policy": BASELINE_POLICY, "requests": base[2],
                               args.policy: base[0].as_dict(), BASELINE_POLICY: base[1].as_dict()}
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    ok = all(s.requests > 0 and s.ok == s.requests for s in (http_summary, zmq_summary))
    return 0 if ok else 1
