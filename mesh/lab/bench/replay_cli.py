"""``mesh bench replay``: command-line wiring (light imports: the parser is built on every ``mesh``
invocation). The benchmark is :mod:`mesh.lab.bench.replay_bench`, its pure parts
:mod:`mesh.lab.bench.replay_core`."""

from __future__ import annotations

import argparse
from pathlib import Path

from mesh.cli_run import nonneg_float, positive_float, positive_int, writable_file
from mesh.errors import ConfigError

__all__ = ["add_bench_replay_parser", "config_from_args"]

_POLICIES = ("power_of_two", "cache_aware_greedy", "cache_aware")


def add_bench_replay_parser(bsub) -> argparse.ArgumentParser:
    from mesh.lab.sim.workloads import WORKLOADS

    p = bsub.add_parser(
        "replay", help="a trace replayed through real processes (stub engines, adapters, brokers) per policy, beside mesh sim",
        description="Replay a Mooncake-format trace slice or a generated workload through real processes on 127.0.0.1: "
                    "W `mesh stub-sglang` engines each behind a `mesh attach sglang` adapter, K `mesh broker --http` "
                    "(the peer exchange between them, the shared indexer or each its own index), HTTP clients sending "
                    "each request at its trace time (open loop; prompts are the trace's blocks as token ids, so the "
                    "engines' prefix caches see its reuse). Every policy runs the identical replay on fresh processes. "
                    "`mesh sim` replays the same stream through the same fleet shape; both are printed side by side. "
                    "A run whose client fell behind its schedule or whose machine ran out of CPU is marked CPU-BOUND "
                    "(the JSON says \"cpu_bound\": true and why) rather than printed as the mesh's figures.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake-format JSONL (timestamp ms, input_length, output_length, hash_ids), e.g. "
                                     "../shared/data/mooncake_synthetic_trace.jsonl")
    src.add_argument("--workload", choices=sorted(WORKLOADS), help="a generated workload of mesh sim (see --rate)")
    p.add_argument("--max-requests", type=positive_int, default=400, help="the slice: the first N requests (default 400)")
    p.add_argument("--time-scale", type=positive_float, default=1.0, metavar="X",
                   help="multiply the trace's arrival times, as mesh sim --arrival-scale (0.5 = twice the rate; default 1)")
    p.add_argument("--slowdown", type=positive_float, default=1.0, metavar="S",
                   help="engines S times slower and arrivals S times further apart: the same load factor with S times "
                        "less CPU per second (the simulator models the same slowed engines; default 1)")
    p.add_argument("--rate", type=positive_float, default=4.0, help="generated workloads: requests/s before scaling (default 4)")
    p.add_argument("--seed", type=int, default=0, help="workload and routing seed (default 0)")
    p.add_argument("--workers", type=positive_int, default=4, help="stub engines, each behind an adapter (default 4)")
    p.add_argument("--routers", type=positive_int, default=2, help="brokers; request i goes to broker i %% K (default 2)")
    p.add_argument("--provider", choices=["indexer", "radix_tree"], default="indexer",
                   help="indexer: one shared mesh indexer; radix_tree: each broker its own index (default indexer)")
    p.add_argument("--no-exchange", dest="exchange", action="store_false", help="brokers do not exchange in-flight figures")
    p.add_argument("--policies", type=lambda v: [x.strip() for x in v.split(",") if x.strip()], default=list(_POLICIES),
                   help=f"comma-separated policies, each one replay on fresh processes (default {','.join(_POLICIES)})")
    p.add_argument("--ttft-slo-ms", type=positive_float, default=2000.0,
                   help="goodput's TTFT bound for the full-speed engine; x slowdown in the run (default 2000)")
    p.add_argument("--net-ms", type=nonneg_float, default=1.0, help="the simulator's one-way router<->worker hop (default 1)")
    p.add_argument("--max-lag-ms", type=positive_float, default=50.0,
                   help="client send lag p95 above this marks a run CPU-bound (default 50)")
    p.add_argument("--max-wait-share", type=positive_float, default=0.05,
                   help="a replay process (engine, adapter, broker, client) runnable but waiting for a CPU more than "
                        "this share of the run marks it CPU-bound (default 0.05)")
    p.add_argument("--max-cpu-busy", type=positive_float, default=0.9,
                   help="the replay's own processes using more than this share of the CPUs (or, where the waits cannot "
                        "be measured, the machine busier than it) marks a run CPU-bound (default 0.9)")
    p.add_argument("--log-dir", help="keep the processes' logs here (default: a new temporary folder)")
    p.add_argument("--json", type=writable_file, help="write every figure to this JSON file (mesh report renders it)")
    p.set_defaults(func=_cmd_bench_replay)
    return p


def config_from_args(args: argparse.Namespace):
    from mesh.lab.bench.replay_core import ReplayConfig

    if args.trace is not None and not Path(args.trace).is_file():
        raise ConfigError(f"trace: no file {args.trace!r}")
    cfg = ReplayConfig(trace=args.trace, workload=args.workload, max_requests=args.max_requests, time_scale=args.time_scale,
                       slowdown=args.slowdown, rate=args.rate, seed=args.seed, workers=args.workers, routers=args.routers,
                       provider=args.provider, exchange=args.exchange, policies=list(args.policies),
                       ttft_slo_ms=args.ttft_slo_ms, net_ms=args.net_ms, max_lag_ms=args.max_lag_ms,
                       max_cpu_busy=args.max_cpu_busy, max_wait_share=args.max_wait_share)
    cfg.validate()
    return cfg


def _cmd_bench_replay(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mesh.lab.bench.replay_bench import FleetStartError, print_results, run_replay_bench
    from mesh.lab.bench.report import finish

    cfg = config_from_args(args)
    con = Console()
    if not con.is_terminal:
        con = Console(width=max(con.width, 180))  # a log file or pipe: keep the table's columns whole
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, transient=True) as bar:
        task = bar.add_task("starting", total=1)

        def progress(phase: str, done: int, total: int) -> None:
            bar.update(task, description=phase, completed=done, total=total)

        try:
            res = run_replay_bench(cfg, log_dir=args.log_dir, say=lambda m: bar.console.print(m), progress=progress)
        except KeyboardInterrupt:
            con.print("mesh bench replay: interrupted (every process it started has been stopped)")
            return 130
        except FleetStartError as exc:
            con.print(f"mesh bench replay: the fleet did not start (every process it started has been stopped): {exc}")
            return 1
    return finish(res, con, args.json, print_results)
