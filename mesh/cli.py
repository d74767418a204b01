"""The ``mesh`` command. Each subcommand's ``--help`` documents its flags.

Every process subcommand also takes ``--config FILE`` (TOML); keys in its table use the flag
names, and flags given on the command line win.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from mesh.config import BrokerSettings, WorkerSettings, settings_from_args
from mesh.errors import ConfigError
from mesh.settings_fields import add_flags

__all__ = ["main"]


def _labels(items: list[str] | None) -> dict[str, str] | None:
    if not items:
        return None
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise ConfigError(f"labels: expected KEY=VALUE, got {it!r}")
        out[k] = v
    return out


# ----------------------------------------------------------------------------- broker


def _add_broker(sub) -> None:
    p = sub.add_parser("broker", help="run a broker (ROUTER for clients + ROUTER for workers)",
                       description="Run one mesh broker. Clients connect to --frontend, workers to --backend.")
    p.add_argument("--config", help="TOML file; its [broker] table uses these flag names")
    add_flags(p, BrokerSettings)  # one flag per field (mesh.config.BrokerSettings holds each help text)
    p.set_defaults(func=_cmd_broker)


def _cmd_broker(args) -> int:
    import os

    from brokers.main import main as broker_main

    if getattr(args, "api_key", None) is None and getattr(args, "api_key_file", None) is None and os.environ.get("MESH_API_KEY"):
        args.api_key = os.environ["MESH_API_KEY"]
    settings = settings_from_args(BrokerSettings, args, "broker")
    broker_main(settings)
    return 0


# ----------------------------------------------------------------------------- worker-stub

# engine model fields worker-stub takes as flags (every EngineConfig field may be in [engine])
_ENGINE_FLAGS = ["max_total_num_tokens", "page_size", "max_running_requests", "prefill_tokens_per_s", "prefill_overhead_ms",
                 "chunked_prefill_size", "decode_base_ms", "decode_per_req_ms", "decode_log_interval"]


def _add_worker(sub) -> None:
    from mesh.engine_model import EngineConfig

    p = sub.add_parser("worker-stub", help="run simulated GPU workers (no GPU needed)",
                       description="Run N simulated GPU workers that register with every given broker.")
    p.add_argument("--config", help="TOML file; [worker] and [engine] tables use these flag names")
    add_flags(p, WorkerSettings)
    p.add_argument("--label", dest="labels_list", action="append", help="KEY=VALUE label sent in READY (repeatable)")
    p.add_argument("--kv-events-to", choices=["all", "one"], default="all",
                   help="send KV event batches to every broker (local indexes) or to one (shared indexer)")
    p.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed chunk")
    p.add_argument("--fail-requests-every", type=int, default=0,
                   help="answer every Nth request with worker_error (fault injection; 0 = never)")
    p.add_argument("--fail-transfer-every", type=int, default=0,
                   help="PD decode workers: fail every Nth modelled KV transfer (fault injection; 0 = never)")
    add_flags(p.add_argument_group("engine model (defaults: 8B model on one H100)"), EngineConfig, only=_ENGINE_FLAGS)
    p.set_defaults(func=_cmd_worker)


def _engine_cfg(args):
    from mesh.engine_model import EngineConfig

    return settings_from_args(EngineConfig, args, "engine", only=_ENGINE_FLAGS)


def _cmd_worker(args) -> int:
    from workers_stub.main import serve_workers

    extra = {}
    labels = _labels(args.labels_list)
    if labels:
        extra["labels"] = labels
    settings = settings_from_args(WorkerSettings, args, "worker", extra=extra)
    curve = None
    if settings.curve_secret:
        from mesh.security import client_keys

        curve = client_keys(settings.curve_secret, settings.curve_server_key)
    if settings.instant:
        from mesh.logs import configure
        from workers_stub.instant import run_instant_fleet

        configure(settings.log_level)
        run_instant_fleet(settings)
        return 0
    asyncio.run(serve_workers(settings, _engine_cfg(args), kv_events_to=args.kv_events_to, stream_interval=args.stream_interval,
                              curve=curve, fail_transfer_every=args.fail_transfer_every,
                              fail_requests_every=args.fail_requests_every))
    return 0


# ----------------------------------------------------------------------------- up


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="all-in-one local mesh: HTTP -> broker -> adapters -> SGLang stubs, then ZeroMQ -> simulated workers",
                       description="Start a broker on 127.0.0.1 with N SGLang stub engines, each attached by a `mesh attach "
                                   "sglang` adapter, and drive open-loop shared-prefix load through the OpenAI HTTP API (part 1, "
                                   "the path users run); then N simulated workers driven by ZeroMQ clients for a third of the "
                                   "time (part 2). Prints a summary table per part and exits 0 when no request failed.")
    p.add_argument("--workers", type=int, default=8, help="engines + adapters in part 1, simulated workers in part 2 (default 8)")
    p.add_argument("--policy", default="cache_aware", help="broker routing policy (default cache_aware)")
    p.add_argument("--rate", type=float, default=30.0, help="requests per second, Poisson (default 30)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of offered load (default 15)")
    p.add_argument("--groups", type=int, default=8, help="shared system prompts (default 8)")
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write both summaries as JSON ({\"http\": ..., \"zmq\": ...}) to this file")
    p.add_argument("--log-dir", help="keep process logs here (default: a temporary directory)")
    p.add_argument("--serve", action="store_true",
                   help="no load: keep the engines, adapters and simulated workers serving until Ctrl-C / SIGTERM")
    p.add_argument("--http", help="HOST:PORT of the OpenAI-compatible ingress (default 127.0.0.1, any free port)")
    p.add_argument("--telemetry", help="telemetry PUB endpoint (default tcp://127.0.0.1:*)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="engines' and simulated workers' modelled durations x this (default 1.0: an 8B model on an H100)")
    p.set_defaults(func=_cmd_up)


def _cmd_up(args) -> int:
    from mesh.up import run_up

    return run_up(args)


# ----------------------------------------------------------------------------- keygen


def _add_keygen(sub) -> None:
    p = sub.add_parser("keygen", help="create a CURVE key pair (NAME.key public, NAME.key_secret private)")
    p.add_argument("name", help="file name stem, e.g. broker, worker-0, client-app ([A-Za-z0-9._-], at most 64, no leading .)")
    p.add_argument("--dir", default=".", help="output directory (default .; created with mode 0700 if missing)")
    p.add_argument("--force", action="store_true", help="replace an existing key pair of that name (default: refuse)")

    def _run(a) -> int:
        from mesh.security import keygen

        try:
            pub, sec = keygen(a.dir, a.name, force=a.force)
        except ConfigError as exc:
            print(f"mesh keygen: {exc}", file=sys.stderr)
            return 2
        print(f"public key:  {pub}\nsecret key:  {sec}  (mode 0600, keep private)")
        return 0

    p.set_defaults(func=_run)


# ----------------------------------------------------------------------------- top


def _add_top(sub) -> None:
    p = sub.add_parser("top", help="live table of workers and routing from brokers' telemetry streams",
                       description="Subscribe to one or more brokers' --telemetry endpoints and show a live table.")
    p.add_argument("--telemetry", action="append", required=True, help="broker telemetry endpoint (repeatable)")
    p.add_argument("--duration", type=float, help="exit after this many seconds (default: until Ctrl-C)")
    p.set_defaults(func=lambda a: __import__("mesh.top", fromlist=["run_top"]).run_top(a.telemetry, duration_s=a.duration))


# ----------------------------------------------------------------------------- bench


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (results printed and optionally saved as JSON)")
    bsub = p.add_subparsers(dest="what", required=True)
    b = bsub.add_parser("broker", help="requests/s and added latency through one broker vs a minimal ZMQ forwarder")
    b.add_argument("--workers", type=int, default=64, help="instant workers (default 64)")
    b.add_argument("--seconds", type=float, default=4.0, help="duration of each throughput phase (default 4)")
    b.add_argument("--concurrency", type=int, default=256, help="requests kept in flight in the throughput phase")
    b.add_argument("--rounds", type=int, default=3, help="rounds of both arms; headline figures are medians (default 3)")
    b.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin the process under test to one CPU and the harness to the others "
                        "(pinning is the default with 2+ CPUs on Linux)")
    b.add_argument("--json", help="write results to this JSON file")
    b.set_defaults(func=_cmd_bench_broker)
    r = bsub.add_parser("routing", help="decision time at 8..4096 workers, index apply rate, bytes per block")
    r.add_argument("--sizes", default="8,64,512,4096", help="comma-separated fleet sizes")
    r.add_argument("--decisions", type=int, default=2000, help="decisions timed per fleet size (after 50 untimed warm-up decisions)")
    r.add_argument("--json", help="write results to this JSON file")
    r.set_defaults(func=_cmd_bench_routing)
    x = bsub.add_parser(
        "exchange", help="how long a broker's dispatch takes to show in its peer-exchange messages, per --exchange-interval-ms",
        description="Two real brokers A and B (--exchange / --peer each other, policy cache_aware), real worker-stub "
                    "processes registered with both, Poisson background load through B only; probes through A only, one "
                    "at a time. Delay = arrival of the first PEER_LOAD message from A showing the probe (read on a SUB of "
                    "A's exchange endpoint) - the probe's submit: an upper bound of dispatch-to-peer visibility. One arm "
                    "(fresh processes) per interval per round, intervals interleaved; ratios are against the smallest interval.")
    x.add_argument("--intervals-ms", default="0,5", help="comma-separated --exchange-interval-ms values to compare (default 0,5)")
    x.add_argument("--rounds", type=int, default=2, help="rounds over the intervals, interleaved (0,5,0,5): shows the noise (default 2)")
    x.add_argument("--workers", type=int, default=4, help="simulated workers (one worker-stub process, both brokers) (default 4)")
    x.add_argument("--probes", type=int, default=200, help="timed probes through A per arm (default 200)")
    x.add_argument("--background-rate", type=float, default=100.0, help="background requests/s through B (Poisson; default 100)")
    x.add_argument("--background-max-new-tokens", type=int, default=24,
                   help="max_new_tokens of a background request: ~7 ms per decode step, so ~200 ms in flight (default 24)")
    x.add_argument("--probe-max-new-tokens", type=int, default=8, help="max_new_tokens of a probe (default 8)")
    x.add_argument("--gap-ms", type=float, default=10.0,
                   help="random gap, uniform in [0, GAP], before each probe: probes land at every phase of A's publishing (default 10)")
    x.add_argument("--timeout-s", type=float, default=10.0, help="bound of every wait of one probe (default 10)")
    x.add_argument("--log-dir", help="the processes' logs (default a new temporary folder)")
    x.add_argument("--json", help="write results (every probe included) to this JSON file")
    x.set_defaults(func=_cmd_bench_exchange)
    from mesh.indexer.cli import add_bench_parser

    add_bench_parser(bsub)
    from mesh.bench.http_cli import add_bench_http_parser

    add_bench_http_parser(bsub)
    from mesh.tokenization.bench import add_bench_tokenizer_parser

    add_bench_tokenizer_parser(bsub)
    from mesh.bench.tokenize_load import add_bench_tokenize_load_parser

    add_bench_tokenize_load_parser(bsub)


def _cmd_bench_broker(args) -> int:
    from mesh.bench.broker_bench import run_broker_bench

    from rich.progress import Progress

    if args.rounds < 1:
        raise SystemExit("--rounds: must be >= 1")
    with Progress(transient=True) as bar:
        task = bar.add_task("rounds (mesh + forwarder)", total=args.rounds)
        res = run_broker_bench(workers=args.workers, seconds=args.seconds, concurrency=args.concurrency,
                               rounds=args.rounds, quiet=True, progress=lambda k: bar.update(task, completed=k), pin=args.pin)
    from mesh.bench.broker_bench import _print

    _print(res)
    if args.json:
        _write_json(args.json, res)
    return 0


def _cmd_bench_exchange(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mesh.bench.exchange_bench import print_results, run_exchange_bench

    try:
        intervals = [float(v) for v in args.intervals_ms.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--intervals-ms: comma-separated numbers, got {args.intervals_ms!r}") from None
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
    from mesh.bench.routing_bench import run_routing_bench

    sizes = tuple(int(x) for x in args.sizes.split(","))
    res = run_routing_bench(sizes=sizes, decisions=args.decisions)
    if args.json:
        _write_json(args.json, res)
    return 0


# ----------------------------------------------------------------------------- main


def _add_indexer(sub) -> None:
    from mesh.indexer.cli import add_indexer_parser

    add_indexer_parser(sub)


def _add_sim(sub) -> None:
    from mesh.sim.cli import add_sim_parser

    add_sim_parser(sub)


def _add_attach(sub) -> None:
    from mesh.adapters.cli import add_attach_parser

    add_attach_parser(sub)


def _add_stub_sglang(sub) -> None:
    from workers_stub.sglang_cli import add_stub_sglang_parser

    add_stub_sglang_parser(sub)


def _add_instant_engine(sub) -> None:
    from workers_stub.instant_http import add_instant_engine_parser

    add_instant_engine_parser(sub)


def _add_gateway(sub) -> None:
    from brokers.gateway import add_gateway_parser

    add_gateway_parser(sub)


def _add_fuzz(sub) -> None:
    from mesh.fuzz.cli import add_fuzz_parser

    add_fuzz_parser(sub)


def _add_ctl(sub) -> None:
    from mesh.ctl import add_ctl_parser

    add_ctl_parser(sub)


# Every subcommand, in --help order, with the function that adds its parser. The adders import
# their command's modules; a process building only its own parser skips the others' imports (the
# simulator, the gateway, the benchmarks: ~0.15 s of start-up per process, and tests start hundreds).
_COMMANDS: dict[str, object] = {
    "broker": _add_broker, "worker-stub": _add_worker, "up": _add_up, "top": _add_top,
    "keygen": _add_keygen, "indexer": _add_indexer, "sim": _add_sim, "attach": _add_attach,
    "stub-sglang": _add_stub_sglang, "instant-engine": _add_instant_engine, "gateway": _add_gateway,
    "fuzz": _add_fuzz, "ctl": _add_ctl, "bench": _add_bench,
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``mesh`` parser: every subcommand, or with ``only`` (a name in ``_COMMANDS``) just that one."""
    p = argparse.ArgumentParser(prog="mesh", description="mesh: a ZeroMQ request-router mesh for LLM inference fleets.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for name, add in _COMMANDS.items():
        if only is None or name == only:
            add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    # The command is the first argument ("mesh" takes no options of its own but --help): a known
    # one builds only its parser; anything else (--help, a typo) builds all, for the full usage.
    only = given[0] if given and given[0] in _COMMANDS else None
    parser = build_parser(only)
    args = parser.parse_args(given)
    args._argv = given  # which flags were given (explicit beats file)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"mesh: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _exit(code: int) -> None:
    """Exit with ``code``. A process that imported gRPC and exits right away (a configuration
    error found while validating) can abort in gRPC's teardown: its poller thread, still starting,
    meets the epoll fd that the exit's static destructors closed ('epoll_wait error: Bad file
    descriptor', exit -6 instead of 2; seen once under load). Such an early exit skips them."""
    if code == 2 and "grpc" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def run() -> None:
    """The ``mesh`` console script."""
    _exit(main())


if __name__ == "__main__":
    run()
