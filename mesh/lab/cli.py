"""The lab's ``mesh`` commands: ``mesh up``, ``mesh bench ...``, ``mesh sim``, ``mesh fuzz``.

:mod:`mesh.cli` loads this module only for these commands (the ``lab`` extra); each adder imports
its command's modules, and building a parser imports neither matplotlib nor openai.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mesh.cli_run import host_port, int_list, nonneg_float, positive_float, positive_int, writable_file, zmq_endpoint
from mesh.errors import ConfigError

__all__ = ["COMMANDS"]


# ----------------------------------------------------------------------------- up


def _float_list(text: str) -> tuple[float, ...]:
    """``0,5`` -> (0.0, 5.0): comma-separated numbers >= 0."""
    try:
        out = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        out = ()
    if not out or any(not 0 <= v < float("inf") for v in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers >= 0 (like 0,5), got {text!r}")
    return out


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="all-in-one local mesh: HTTP -> broker -> adapters -> SGLang stubs, then ZeroMQ -> simulated workers",
                       description="Start a broker on 127.0.0.1 with N SGLang stub engines, each attached by a `mesh attach "
                                   "sglang` adapter, and drive open-loop shared-prefix load through the OpenAI HTTP API (part 1, "
                                   "the path users run); then N simulated workers driven by ZeroMQ clients for a third of the "
                                   "time (part 2). Prints a summary table per part and exits 0 when no request failed.")
    from mesh.routing.router import POLICIES

    p.add_argument("--workers", type=positive_int, default=8, help="engines + adapters in part 1, simulated workers in part 2 (default 8)")
    p.add_argument("--policy", default="cache_aware", choices=sorted(POLICIES), help="broker routing policy (default cache_aware)")
    p.add_argument("--rate", type=positive_float, default=30.0, help="requests per second, Poisson (default 30)")
    p.add_argument("--duration", type=positive_float, default=15.0, help="seconds of offered load (default 15)")
    p.add_argument("--groups", type=positive_int, default=8, help="shared system prompts (default 8)")
    p.add_argument("--system-tokens", type=positive_int, default=2048)
    p.add_argument("--question-tokens", type=positive_int, default=256)
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=writable_file, help="also write both summaries as JSON ({\"http\": ..., \"zmq\": ...}) to this file")
    p.add_argument("--log-dir", help="keep process logs here (default: a temporary directory)")
    p.add_argument("--serve", action="store_true",
                   help="no load: keep the engines, adapters and simulated workers serving until Ctrl-C / SIGTERM")
    p.add_argument("--http", type=host_port, help="HOST:PORT of the OpenAI-compatible ingress (default 127.0.0.1, any free port)")
    p.add_argument("--telemetry", type=zmq_endpoint, help="telemetry PUB endpoint (default tcp://127.0.0.1:*)")
    p.add_argument("--time-scale", type=positive_float, default=1.0,
                   help="engines' and simulated workers' modelled durations x this (default 1.0: an 8B model on an H100)")
    p.set_defaults(func=_cmd_up)


def _cmd_up(args) -> int:
    from mesh.lab.up import run_up

    return run_up(args)


# ----------------------------------------------------------------------------- bench


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (results printed and optionally saved as JSON)")
    bsub = p.add_subparsers(dest="what", required=True)
    b = bsub.add_parser("broker", help="requests/s and added latency through one broker vs a minimal ZMQ forwarder")
    b.add_argument("--workers", type=positive_int, default=64, help="instant workers (default 64)")
    b.add_argument("--seconds", type=positive_float, default=4.0, help="duration of each throughput phase (default 4)")
    b.add_argument("--concurrency", type=positive_int, default=256, help="requests kept in flight in the throughput phase")
    b.add_argument("--rounds", type=positive_int, default=3, help="rounds of both arms; headline figures are medians (default 3)")
    b.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin the process under test to one CPU and the harness to the others "
                        "(pinning is the default with 2+ CPUs on Linux)")
    b.add_argument("--json", type=writable_file, help="write results to this JSON file")
    b.set_defaults(func=_cmd_bench_broker)
    r = bsub.add_parser("routing", help="decision time at 8..4096 workers, index apply rate, bytes per block")
    r.add_argument("--sizes", type=int_list, default=(8, 64, 512, 4096), help="comma-separated fleet sizes (default 8,64,512,4096)")
    r.add_argument("--decisions", type=positive_int, default=2000, help="decisions timed per fleet size (after 50 untimed warm-up decisions)")
    r.add_argument("--regret-audit", choices=("on", "off"), default="on",
                   help="also time each decision with the regret audit on (default on)")
    r.add_argument("--json", type=writable_file, help="write results to this JSON file")
    r.set_defaults(func=_cmd_bench_routing)
    x = bsub.add_parser(
        "exchange", help="how long a broker's dispatch takes to show in its peer-exchange messages, per --exchange-interval-ms",
        description="Two real brokers A and B (--exchange / --peer each other, policy cache_aware), real worker-stub "
                    "processes registered with both, Poisson background load through B only; probes through A only, one "
                    "at a time. Delay = arrival of the first PEER_LOAD message from A showing the probe (read on a SUB of "
                    "A's exchange endpoint) - the probe's submit: an upper bound of dispatch-to-peer visibility. One arm "
                    "(fresh processes) per interval per round, intervals interleaved; ratios are against the smallest interval.")
    x.add_argument("--intervals-ms", type=_float_list, default=(0.0, 5.0), help="comma-separated --exchange-interval-ms values to compare (default 0,5)")
    x.add_argument("--rounds", type=positive_int, default=2, help="rounds over the intervals, interleaved (0,5,0,5): shows the noise (default 2)")
    x.add_argument("--workers", type=positive_int, default=4, help="simulated workers (one worker-stub process, both brokers) (default 4)")
    x.add_argument("--probes", type=positive_int, default=200, help="timed probes through A per arm (default 200)")
    x.add_argument("--background-rate", type=positive_float, default=100.0, help="background requests/s through B (Poisson; default 100)")
    x.add_argument("--background-max-new-tokens", type=positive_int, default=24,
                   help="max_new_tokens of a background request: ~7 ms per decode step, so ~200 ms in flight (default 24)")
    x.add_argument("--probe-max-new-tokens", type=positive_int, default=8, help="max_new_tokens of a probe (default 8)")
    x.add_argument("--gap-ms", type=nonneg_float, default=10.0,
                   help="random gap, uniform in [0, GAP], before each probe: probes land at every phase of A's publishing (default 10)")
    x.add_argument("--timeout-s", type=positive_float, default=10.0, help="bound of every wait of one probe (default 10)")
    x.add_argument("--log-dir", help="the processes' logs (default a new temporary folder)")
    x.add_argument("--json", type=writable_file, help="write results (every probe included) to this JSON file")
    x.set_defaults(func=_cmd_bench_exchange)
    add_bench_indexer_parser(bsub)
    from mesh.lab.bench.http_cli import add_bench_http_parser

    add_bench_http_parser(bsub)
    from mesh.lab.bench.replay_cli import add_bench_replay_parser

    add_bench_replay_parser(bsub)
    from mesh.lab.bench.tokenizer_bench import add_bench_tokenizer_parser

    add_bench_tokenizer_parser(bsub)
    from mesh.lab.bench.tokenize_load import add_bench_tokenize_load_parser

    add_bench_tokenize_load_parser(bsub)


def _cmd_bench_broker(args) -> int:
    from mesh.lab.bench.broker_bench import run_broker_bench

    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("rounds (mesh + forwarder)", total=args.rounds)
        res = run_broker_bench(workers=args.workers, seconds=args.seconds, concurrency=args.concurrency,
                               rounds=args.rounds, quiet=True, progress=lambda k: bar.update(task, completed=k), pin=args.pin)
    from mesh.lab.bench.broker_bench import print_results

    print_results(res)
    if args.json:
        _write_json(args.json, res)
    return 0


def _cmd_bench_exchange(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mesh.lab.bench.exchange_bench import print_results, run_exchange_bench

    intervals = list(args.intervals_ms)
    con = Console()
    if not con.is_terminal:
        con = Console(width=max(con.width, 170))  # a log file or pipe: keep the table's columns whole
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, transient=True) as bar:
        task = bar.add_task("probes", total=len(intervals) * args.rounds * args.probes)
        try:
            res = run_exchange_bench(intervals, workers=args.workers, probes=args.probes, rounds=args.rounds,
                                     background_rate=args.background_rate,
                                     background_max_new_tokens=args.background_max_new_tokens,
                                     probe_max_new_tokens=args.probe_max_new_tokens, gap_ms=args.gap_ms,
                                     timeout_s=args.timeout_s, log_dir=args.log_dir, quiet=True,
                                     progress=lambda n: bar.advance(task, n))
        except ValueError as exc:
            con.print(f"mesh bench exchange: {exc}")
            return 2
    print_results(res, con)
    if args.json:
        _write_json(args.json, res)
    return 0 if res["ok"] else 1


def _write_json(path: str, res) -> None:
    """Write a benchmark's result, creating the folder (``bench/`` holds no file in git)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))


def _cmd_bench_routing(args) -> int:
    from mesh.lab.bench.routing_bench import run_routing_bench

    res = run_routing_bench(sizes=args.sizes, decisions=args.decisions, audit=args.regret_audit == "on")
    if args.json:
        _write_json(args.json, res)
    return 0


# ----------------------------------------------------------------------------- sim, fuzz


def _add_sim(sub) -> None:
    from mesh.lab.sim.cli import add_sim_parser

    add_sim_parser(sub)


def _add_fuzz(sub) -> None:
    from mesh.lab.fuzz.cli import add_fuzz_parser

    add_fuzz_parser(sub)


# ----------------------------------------------------------------------------- bench indexer


def add_bench_indexer_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add ``indexer`` to ``mesh bench``'s subparsers."""
    b = bench_subparsers.add_parser(
        "indexer", help="indexer over gRPC: ingest blocks/s, match p50/p99 (client and server), bytes per block",
        description="Start 'mesh indexer' as a subprocess, ingest >= 1M blocks for 1,000 workers over gRPC, then "
                    "time 512-block prefix queries.")
    b.add_argument("--workers", type=positive_int, default=1000, help="simulated workers (default 1000)")
    b.add_argument("--blocks", type=positive_int, default=1_050_000, help="blocks to index in total (default 1050000)")
    b.add_argument("--queries", type=positive_int, default=2000, help="timed prefix queries (default 2000)")
    b.add_argument("--backend", default="both", choices=("both", "memory", "valkey"),
                   help="which backends to run on the same workload, side by side (default both: memory, then "
                        "valkey on a private redis-server/valkey-server this command starts; memory alone when none "
                        "is installed)")
    b.add_argument("--json", type=writable_file, help="write results to this JSON file")
    b.set_defaults(func=_cmd_bench_indexer)
    return b


def _cmd_bench_indexer(args) -> int:
    from mesh.lab.bench.indexer_bench import run_indexer_bench, valkey_server_binary

    if args.backend == "both":
        backends: tuple[str, ...] = ("memory", "valkey") if valkey_server_binary() else ("memory",)
        if len(backends) == 1:
            print("mesh bench indexer: no valkey-server/redis-server installed: the memory backend only", file=sys.stderr)
    else:
        backends = (args.backend,)
        if args.backend == "valkey" and not valkey_server_binary():
            raise ConfigError("backend: valkey needs valkey-server or redis-server on PATH (apt-get install redis-server)")
    res = run_indexer_bench(workers=args.workers, total_blocks=args.blocks, queries=args.queries, backends=backends)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


#: The lab's subcommands and the functions that add their parsers (mesh.cli orders them in --help).
def _add_report(sub) -> None:
    from mesh.lab.report import add_report_parser

    add_report_parser(sub)


COMMANDS = {"up": _add_up, "sim": _add_sim, "fuzz": _add_fuzz, "bench": _add_bench, "report": _add_report}
