"""``mesh up``: an all-in-one local mesh (broker + simulated workers) driven by a load generator."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from mesh.client import Client
from mesh.loadgen import LoadSpec, run_load, summarize
from mesh.procs import ProcGroup

__all__ = ["run_up", "wait_for_workers"]


async def wait_for_workers(frontend: str, n: int, timeout_s: float = 30.0) -> None:
    """Wait until the broker at ``frontend`` reports ``n`` healthy workers (STATUS polling)."""
    deadline = time.monotonic() + timeout_s
    async with Client(frontend) as c:
        while True:
            st = await c.status(timeout_s=max(0.1, deadline - time.monotonic()))
            healthy = sum(1 for w in st.workers if w.get("healthy"))
            if healthy >= n:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {healthy}/{n} workers registered after {timeout_s}s")
            await asyncio.sleep(0.05)


def _table(summary, console: Console) -> None:
    t = Table(title="mesh up: summary", show_header=True)
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
        ("retried requests", f"{summary.retried}"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    w = Table(title="per worker", show_header=True)
    for c in ("worker", "requests", "cache hit rate"):
        w.add_column(c, justify="right" if c != "worker" else "left")
    for wid, d in summary.per_worker.items():
        w.add_row(wid, str(d["requests"]), f"{d['hit_rate']:.1%}")
    console.print(w)


def _metrics_excerpt(url: str) -> list[str]:
    """A few live lines of the broker's Prometheus endpoint (what a scraper sees)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError as exc:
        return [f"(metrics unavailable: {exc})"]
    keep = ("mesh_requests_total", "mesh_decisions_total", "mesh_routed_cached_tokens_total", "mesh_routed_prompt_tokens_total",
            "mesh_decision_latency_seconds_count", "mesh_retries_total")
    return [line for line in text.splitlines() if line.startswith(keep)]


def _serve(args, console: Console, group: ProcGroup) -> int:
    """Keep the local mesh up until SIGINT/SIGTERM, printing where to point applications."""
    import signal
    import threading

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


def run_up(args) -> int:
    console = Console()
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="mesh-up-"))
    spec = LoadSpec(rate_rps=args.rate, duration_s=args.duration, groups=args.groups, system_tokens=args.system_tokens,
                    question_tokens=args.question_tokens, max_new_tokens=args.max_new_tokens, seed=args.seed)
    http = getattr(args, "http", None) or "127.0.0.1:0"
    with ProcGroup(log_dir) as group:
        console.print(f"[bold]mesh up[/]: starting a broker and {args.workers} simulated workers (logs in {log_dir})")
        broker = group.broker("broker", "--policy", args.policy, "--seed", str(args.seed), "--http", http,
                              "--telemetry", getattr(args, "telemetry", None) or "tcp://127.0.0.1:*")
        from mesh.procs import wait_for_log_event

        url = wait_for_log_event(broker.log_path, "http_listening", 20, broker.popen)["url"]
        tel = wait_for_log_event(broker.log_path, "broker_listening", 5)["telemetry"]
        group.workers("worker", [broker.backend], count=args.workers)
        asyncio.run(wait_for_workers(broker.frontend, args.workers))
        console.print(f"  ZeroMQ clients   {broker.frontend}   (mesh.client.Client)")
        console.print(f"  workers          {broker.backend}   (mesh worker-stub --broker ...)")
        console.print(f"  OpenAI HTTP      {url}/v1   (/v1/completions, /v1/chat/completions, /generate)")
        console.print(f"  metrics          {url}/metrics")
        console.print(f"  live view        mesh top --telemetry {tel}")
        if getattr(args, "serve", False):
            return _serve(args, console, group)
        console.print(f"policy {args.policy}; offering {args.rate:g} req/s for {args.duration:g} s")
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), TextColumn("{task.fields[done]} done"),
                      TimeRemainingColumn(), console=console, transient=True) as prog:
            task = prog.add_task("load", total=spec.duration_s, done=0)
            outcomes, wall = asyncio.run(run_load([broker.frontend], spec,
                                                  progress=lambda t, n: prog.update(task, completed=t, done=n)))
        summary = summarize(outcomes, wall)
        metrics = _metrics_excerpt(url)
    _table(summary, console)
    console.print("[bold]live broker metrics[/] (GET /metrics, excerpt):")
    for line in metrics:
        console.print("  " + line, markup=False, highlight=False)
    if args.json:
        Path(args.json).write_text(json.dumps(summary.as_dict(), indent=2, default=str))
    return 0 if summary.ok == summary.requests and summary.requests > 0 else 1
