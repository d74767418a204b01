"""``mesh fuzz``: fuzz a broker's ZeroMQ ports (and optionally its HTTP ingress), then check it."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from mesh.cli_run import http_url as http_url_arg, positive_float, positive_int, writable_file, zmq_endpoint
from mesh.errors import ConfigError

__all__ = ["add_fuzz_parser", "run_cli"]

_DESC = """\
Protocol-aware fuzzer for a mesh broker. Registers fuzzing workers on the backend (valid READY,
heartbeats, answers REQUESTs correctly and with garbage), runs junk workers and clients (some with
ROUTING_IDs beginning with 0x00), sends valid MESH/1 frames built with the real encoders and their
mutations (wrong types, missing/extra fields, huge/negative ints, NaN, unicode, oversize, msgpack
ext types, deep nesting, truncated/extra frames, wrong header/command, random bytes, duplicated
READY, replies for unknown or foreign requests ...), paced then unpaced. Afterwards it checks that
the broker process is alive, answers STATUS and serves real requests with FINAL, and reports the
broker's counters (frames_rejected ...) and RSS before/after.

Without --broker-frontend/--broker-backend it starts its own broker and simulated worker
(mesh broker / mesh worker-stub) in a temporary log directory. Exit code 0 when no finding.
"""


def add_fuzz_parser(sub) -> None:
    p = sub.add_parser("fuzz", help="protocol-aware fuzzer for a broker (ZeroMQ ports, optional HTTP ingress)",
                       description=_DESC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--broker-frontend", type=zmq_endpoint, help="client endpoint of the broker under test (default: start one)")
    p.add_argument("--broker-backend", type=zmq_endpoint, help="worker endpoint of the broker under test (default: start one)")
    p.add_argument("--broker-pid", type=int, help="pid of the broker under test (liveness and RSS; known when started here)")
    p.add_argument("--seconds", type=positive_float, default=10.0, help="fuzzing time, paced then unpaced (default 10)")
    p.add_argument("--seed", type=int, default=None, help="seed (default: random, printed); the same seed sends the same cases")
    p.add_argument("--peers", type=positive_int, default=4, help="fuzzing peers per port (default 4: 2 registered + 2 junk workers, 4 clients)")
    p.add_argument("--paced-rate", type=positive_float, default=200.0, help="frames per second per peer in the paced phase (default 200)")
    p.add_argument("--paced-share", type=float, default=0.5, help="share of --seconds spent paced; the rest is unpaced (default 0.5)")
    p.add_argument("--unpaced-max-frames", type=int, default=50_000, help="frames per peer bound of the unpaced phase (default 50000)")
    p.add_argument("--no-zero-ids", dest="zero_ids", action="store_false", help="no ROUTING_IDs beginning with 0x00")
    p.add_argument("--only", choices=["client", "worker"], help="fuzz only this path (the other path's peers stay valid)")
    p.add_argument("--real-requests", type=int, default=5, help="real requests sent after fuzzing (default 5)")
    p.add_argument("--http", action="store_true", help="also fuzz the HTTP ingress (started here with --http, or give --http-url)")
    p.add_argument("--http-url", type=http_url_arg, help="base URL of the HTTP ingress under test")
    p.add_argument("--http-seconds", type=positive_float, default=None, help="HTTP fuzzing time (default: --seconds / 2)")
    p.add_argument("--log-dir", help="logs of the processes started here (default: a temporary directory)")
    p.add_argument("--json", type=writable_file, help="write the JSON summary to this file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    import random

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from mesh.lab.fuzz.runner import FuzzConfig, run_fuzz

    if (args.broker_frontend is None) != (args.broker_backend is None):
        raise ConfigError("broker_frontend: give both --broker-frontend and --broker-backend, or neither")
    console = Console(stderr=True)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    console.print(f"mesh fuzz: seed {seed}")
    group = None
    frontend, backend, pid, log = args.broker_frontend, args.broker_backend, args.broker_pid, None
    http_url = args.http_url
    if frontend is None:
        from mesh.lab.procs import ProcGroup

        log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="mesh-fuzz-"))
        group = ProcGroup(log_dir)
        extra = ["--http", "127.0.0.1:0"] if args.http and not http_url else []
        b = group.broker("fuzz-broker", *extra, "--heartbeat-ms", "200")
        frontend, backend, pid, log = b.frontend, b.backend, b.pid, str(b.log_path)
        if extra:
            from mesh.lab.procs import wait_for_log_event

            http_url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen)["url"]
        group.workers("real-w", [backend], "--time-scale", "0.2", count=1)
        console.print(f"started broker pid {pid} ({frontend}, {backend}) and a simulated worker; logs in {log_dir}")
    try:
        cfg = FuzzConfig(frontend, backend, seconds=args.seconds, seed=seed, peers=args.peers, paced_rate=args.paced_rate,
                         paced_share=args.paced_share, unpaced_max_frames=args.unpaced_max_frames, zero_ids=args.zero_ids,
                         broker_pid=pid, broker_log=log, real_requests=args.real_requests,
                         client_fuzz=args.only != "worker", worker_fuzz=args.only != "client")
        if args.quiet:
            summary = asyncio.run(run_fuzz(cfg))
        else:
            with Progress(TextColumn("fuzzing"), BarColumn(), TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                          console=console, transient=True) as bar:
                task = bar.add_task("fuzz", total=args.seconds, info="")

                def prog(elapsed: float, info: dict) -> None:
                    rss = info.get("rss_kb")
                    bar.update(task, completed=min(elapsed, args.seconds),
                               info=f"{info['frames']} frames" + (f", broker RSS {rss / 1024:.0f} MB" if rss else ""))

                summary = asyncio.run(run_fuzz(cfg, progress=prog))
        if args.http or http_url:
            if not http_url:
                console.print("[yellow]--http: no --http-url and the broker was not started here; skipped[/]")
            else:
                from mesh.lab.fuzz.http import run_http_fuzz

                hs = args.http_seconds if args.http_seconds is not None else max(2.0, args.seconds / 2)
                summary["http"] = asyncio.run(run_http_fuzz(http_url, frontend, seconds=hs, seed=seed, broker_pid=pid))
                summary["findings"].extend(summary["http"]["findings"])
                summary["alive"] = summary["http"].get("alive", summary["alive"])
    finally:
        if group is not None:
            group.stop_all()
    _print(summary, console)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
    return 1 if summary["findings"] else 0


def _print(s: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"mesh fuzz (seed {s['seed']})")
    t.add_column("check")
    t.add_column("result", overflow="fold")
    fr = s.get("frames", {})
    rss = s.get("rss_kb", {})
    t.add_row("frames sent", f"{fr.get('total')} ({fr.get('paced')} paced, {fr.get('unpaced')} unpaced, {fr.get('rate_per_s')}/s)")
    t.add_row("broker alive", str(s.get("alive")))
    t.add_row("STATUS after", str(s.get("status_after")))
    t.add_row("real requests", "all FINAL" if s.get("real_ok") else json.dumps(s.get("real_requests"))[:400])
    t.add_row("frames_rejected (delta)", str(s.get("frames_rejected_total")))
    t.add_row("RSS before/after/peak", f"{rss.get('before')} / {rss.get('after')} / {rss.get('peak')} kB (growth {rss.get('growth_mb')} MB)")
    if "http" in s:
        h = s["http"]
        t.add_row("HTTP statuses", json.dumps(h.get("statuses")))
    console.print(t)
    if s["findings"]:
        console.print(f"[bold red]{len(s['findings'])} finding(s):[/]")
        for f in s["findings"]:
            console.print(f" - {f[:1500]}")
    else:
        console.print("[green]no findings[/]")


if __name__ == "__main__":  # pragma: no cover
    from mesh.cli_run import run_one

    sys.exit(run_one("fuzz", add_fuzz_parser))
