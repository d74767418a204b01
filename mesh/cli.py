"""The ``mesh`` command. Each subcommand's ``--help`` documents its flags.

Every process subcommand also takes ``--config FILE`` (TOML); keys in its table use the flag
names, and flags given on the command line win.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

from mesh.config import BrokerSettings, WorkerSettings, build, load_toml
from mesh.errors import ConfigError
from mesh.logs import add_log_level_arg

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


def _settings(cls, args: argparse.Namespace, section: str, names: list[str], extra: dict | None = None):
    allowed = [f.name for f in dataclasses.fields(cls)]
    file_vals = load_toml(args.config, section, allowed) if getattr(args, "config", None) else {}
    flag_vals = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    return build(cls, file_vals, flag_vals, extra or {})


# ----------------------------------------------------------------------------- broker

_BROKER_FLAGS = ["frontend", "backend", "broker_id", "kv_indexer_endpoint", "kv_indexer_query_timeout_ms", "kv_indexer_query_max_inflight", "heartbeat_ms", "liveness", "default_deadline_ms", "max_attempts",
                 "retry_base_ms", "retry_cap_ms", "retry_budget_ratio", "retry_budget_min", "max_inflight", "park_timeout_s", "max_parked", "max_inflight_per_worker", "queue_timeout_s", "eject_after_failures", "eject_base_s", "eject_max_s", "max_ejected_ratio", "drain_timeout_s", "policy", "cache_prefix_provider",
                 "load_freshness_s", "bucket_config", "pd", "global_cache_winner", "decode_policy", "metrics", "http", "api_key", "api_key_file", "http_max_connections", "http_header_timeout_s", "http_idle_timeout_s", "http_body_timeout_s", "http_request_timeout_s", "http_stream_idle_timeout_s", "tokenizer", "chat_template", "model_name", "model_alias", "telemetry", "curve_secret", "curve_allow_workers", "curve_allow_clients", "seed", "log_level"]

# containment limits (issue 12): what one worker or client may ask of a broker
_BROKER_FLAGS += ["max_worker_heartbeat_ms", "max_workers", "max_inflight_per_client", "progress_timeout_ms", "overload_lag_ms",
                  "kv_indexer_token_file"]
# the peer exchange (issue 15): brokers tell each other what they have in flight on each worker
_BROKER_FLAGS += ["exchange", "peer", "exchange_interval_ms", "exchange_stale_ms"]


def _add_broker(sub) -> None:
    p = sub.add_parser("broker", help="run a broker (ROUTER for clients + ROUTER for workers)",
                       description="Run one mesh broker. Clients connect to --frontend, workers to --backend.")
    p.add_argument("--config", help="TOML file; its [broker] table uses these flag names")
    p.add_argument("--frontend", help="client-facing endpoint (default tcp://127.0.0.1:5555; port * = any free port)")
    p.add_argument("--backend", help="worker-facing endpoint (default tcp://127.0.0.1:5556)")
    p.add_argument("--broker-id", help="name used in logs and metrics")
    p.add_argument("--policy", help="routing policy: cache_aware (default), cache_aware_greedy, power_of_two, round_robin, random")
    p.add_argument("--cache-prefix-provider", help="prefix index source: radix_tree (default), approx, indexer")
    p.add_argument("--kv-indexer-endpoint", action="append", help="shared KV indexer http://HOST:PORT (repeat for replicas)")
    p.add_argument("--kv-indexer-query-timeout-ms", type=int, help="deadline of one indexer query (default 100)")
    p.add_argument("--kv-indexer-query-max-inflight", type=int, help="concurrent indexer queries (default 32)")
    p.add_argument("--kv-indexer-token-file", help="file holding the shared KV indexer's bearer token (mesh indexer --token-file)")
    p.add_argument("--bucket-config", help="bucket domains file (TOML or JSON), e.g. configs/buckets-example.toml")
    p.add_argument("--pd", action="store_true", default=None, help="prefill/decode disaggregation (prefill + decode workers)")
    p.add_argument("--no-global-cache-winner", dest="global_cache_winner", action="store_false", default=None,
                   help="keep cache winners inside their bucket (default: an admitted global winner may bypass it)")
    p.add_argument("--decode-policy", choices=["power_of_two", "legacy_host_affinity"])
    p.add_argument("--heartbeat-ms", type=int, help="application heartbeat interval (default 500)")
    p.add_argument("--liveness", type=int, help="heartbeats missed before a worker is expired (default 3)")
    p.add_argument("--default-deadline-ms", type=int, help="deadline for requests that carry none (default 30000)")
    p.add_argument("--max-attempts", type=int, help="dispatch attempts per request, first included (default 3)")
    p.add_argument("--retry-base-ms", type=float, help="retry back-off base (default 25)")
    p.add_argument("--retry-cap-ms", type=float, help="retry back-off cap (default 250)")
    p.add_argument("--retry-budget-ratio", type=float, help="concurrent retries allowed per in-flight request (default 0.2)")
    p.add_argument("--retry-budget-min", type=int, help="concurrent retries always allowed (default 3)")
    p.add_argument("--max-inflight", type=int, help="requests in flight before new ones get 'overloaded'")
    p.add_argument("--park-timeout-s", type=float, help="how long a request waits for a routable worker (default 2)")
    p.add_argument("--max-parked", type=int, help="requests that may wait for a worker at once (default 10000)")
    p.add_argument("--max-inflight-per-worker", type=int, help="per-worker in-flight cap; at the cap requests queue (default off)")
    p.add_argument("--queue-timeout-s", type=float, help="wait for a free slot before 'overloaded' 429 (default 5)")
    p.add_argument("--eject-after-failures", type=int, help="consecutive worker errors before ejection (default 5)")
    p.add_argument("--eject-base-s", type=float, help="ejection time, times the number of ejections (default 30)")
    p.add_argument("--eject-max-s", type=float, help="longest ejection (default 300)")
    p.add_argument("--max-ejected-ratio", type=float, help="share of workers that may be ejected at once (default 0.5)")
    p.add_argument("--drain-timeout-s", type=float, help="how long SIGTERM waits for in-flight work (default 10)")
    p.add_argument("--max-worker-heartbeat-ms", type=int, help="cap on the heartbeat interval a worker may announce (default 2000)")
    p.add_argument("--max-workers", type=int, help="registered worker sessions at most (default 4096)")
    p.add_argument("--max-inflight-per-client", type=int, help="in-flight requests per client before 'rate_limited' 429 (default 4096)")
    p.add_argument("--progress-timeout-ms", type=int, help="an attempt that gets no reply at all for this long fails over "
                                                             "and counts against its worker (default 15000; 0 = off)")
    p.add_argument("--overload-lag-ms", type=float, help="shed new requests while the event loop lags more than this (default 250)")
    p.add_argument("--load-freshness-s", type=float, help="LoadStat older than this is ignored (default 5)")
    p.add_argument("--metrics", help="HOST:PORT for the Prometheus /metrics endpoint (default off; no authentication: "
                                     "an empty HOST, as in :9100, binds 127.0.0.1 only)")
    p.add_argument("--http", help="HOST:PORT of the OpenAI-compatible HTTP ingress (port 0 = any free port)")
    p.add_argument("--api-key", help="require this bearer token on the HTTP ingress (visible in the process list: "
                                     "prefer --api-key-file or MESH_API_KEY)")
    p.add_argument("--api-key-file", help="file holding the HTTP ingress bearer token")
    p.add_argument("--http-max-connections", type=int, help="concurrent HTTP connections (default 512)")
    p.add_argument("--http-header-timeout-s", type=float, help="time to receive a complete request head (default 10)")
    p.add_argument("--http-idle-timeout-s", type=float, help="idle keep-alive HTTP connections are closed after this (default 60)")
    p.add_argument("--http-body-timeout-s", type=float, help="time to receive a request body or drain a streamed write (default 30)")
    p.add_argument("--http-request-timeout-s", type=float,
                   help="lifetime of an unstreamed HTTP request (default 1800; header x-mesh-deadline-ms overrides)")
    p.add_argument("--http-stream-idle-timeout-s", type=float,
                   help="a stream ends when no output came for this long (default 300); streams have no total bound "
                        "unless x-mesh-deadline-ms gives one")
    p.add_argument("--tokenizer", action="append", metavar="[MODEL=]DIR",
                   help="the model folder (tokenizer.json, tokenizer_config.json) whose tokenizer and chat template the "
                        "HTTP ingress uses: prompts are routed and sent as the model's token ids. MODEL=DIR for one "
                        "model (repeatable); a plain DIR for every model without its own")
    p.add_argument("--chat-template", action="append", metavar="[MODEL=]FILE",
                   help="a chat template file (.jinja, or .json with chat_template) instead of the model folder's "
                        "(MODEL=FILE for one model's)")
    p.add_argument("--model-name", help="a name for the fleet's only model: requests may use it or the served "
                                        "model's own name (default mesh)")
    p.add_argument("--model-alias", action="append", metavar="ALIAS=MODEL",
                   help="requests for ALIAS go to the workers that serve MODEL (repeatable)")
    p.add_argument("--telemetry", help="ZeroMQ PUB endpoint for the live telemetry stream (mesh top)")
    p.add_argument("--exchange", metavar="ENDPOINT",
                   help="bind this broker's peer exchange PUB here (tcp://HOST:PORT, port * = any): brokers tell each "
                        "other what they have in flight on each worker, so every broker routes with the fleet's load")
    p.add_argument("--peer", action="append", metavar="ENDPOINT",
                   help="another broker's --exchange endpoint to subscribe to (repeatable; this broker's own is skipped)")
    p.add_argument("--exchange-interval-ms", type=float,
                   help="at most one change message per interval while something changed (default 5)")
    p.add_argument("--exchange-stale-ms", type=float,
                   help="a peer silent this long is dropped: this broker falls back to its own view for it (default 3000)")
    p.add_argument("--curve-secret", help="broker certificate (.key_secret from mesh keygen): CURVE on both sockets")
    p.add_argument("--curve-allow-workers", help="directory of worker public keys allowed to register")
    p.add_argument("--curve-allow-clients", help="directory of client public keys allowed to submit")
    p.add_argument("--seed", type=int, help="seed the routing RNG (deterministic decisions)")
    add_log_level_arg(p)
    p.set_defaults(func=_cmd_broker)


def _cmd_broker(args) -> int:
    import os

    from brokers.main import main as broker_main

    if getattr(args, "api_key", None) is None and getattr(args, "api_key_file", None) is None and os.environ.get("MESH_API_KEY"):
        args.api_key = os.environ["MESH_API_KEY"]
    settings = _settings(BrokerSettings, args, "broker", _BROKER_FLAGS)
    broker_main(settings)
    return 0


# ----------------------------------------------------------------------------- worker-stub

_ENGINE_FLAGS = ["max_total_num_tokens", "page_size", "max_running_requests", "prefill_tokens_per_s", "prefill_overhead_ms",
                 "chunked_prefill_size", "decode_base_ms", "decode_per_req_ms", "decode_log_interval"]


def _add_worker(sub) -> None:
    p = sub.add_parser("worker-stub", help="run simulated GPU workers (no GPU needed)",
                       description="Run N simulated GPU workers that register with every given broker.")
    p.add_argument("--config", help="TOML file; [worker] and [engine] tables use these flag names")
    p.add_argument("--broker", dest="brokers", action="append", help="broker backend endpoint (repeat for a mesh)")
    p.add_argument("--count", type=int, help="workers in this process (default 1)")
    p.add_argument("--worker-id", help="worker id (with --count N: prefix, ids become ID-0..ID-N-1)")
    p.add_argument("--model", help="model name reported in READY")
    p.add_argument("--role", choices=["mixed", "prefill", "decode"])
    p.add_argument("--label", dest="labels_list", action="append", help="KEY=VALUE label sent in READY (repeatable)")
    p.add_argument("--heartbeat-ms", type=int)
    p.add_argument("--liveness", type=int)
    p.add_argument("--time-scale", type=float, help="multiply every modelled duration (0.1 = ten times faster)")
    p.add_argument("--instant", action="store_true", default=None, help="answer at once, no engine (benchmarks)")
    p.add_argument("--kv-events-to", choices=["all", "one"], default="all",
                   help="send KV event batches to every broker (local indexes) or to one (shared indexer)")
    p.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed chunk")
    p.add_argument("--fail-requests-every", type=int, default=0,
                   help="answer every Nth request with worker_error (fault injection; 0 = never)")
    p.add_argument("--fail-transfer-every", type=int, default=0,
                   help="PD decode workers: fail every Nth modelled KV transfer (fault injection; 0 = never)")
    p.add_argument("--curve-secret", help="this worker's certificate (.key_secret)")
    p.add_argument("--curve-server-key", help="the brokers' public key (.key)")
    p.add_argument("--tokenizer", help="a model folder: text prompts are tokenised with the model's tokenizer, as a real "
                                      "engine does, so KV events carry its token ids (default: UTF-8 bytes as ids)")
    add_log_level_arg(p)
    g = p.add_argument_group("engine model (defaults: 8B model on one H100)")
    for name in _ENGINE_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), type=float if name.endswith(("_per_s", "_ms")) else int)
    p.set_defaults(func=_cmd_worker)


def _engine_cfg(args):
    from mesh.engine_model import EngineConfig

    vals = load_toml(args.config, "engine", [f.name for f in dataclasses.fields(EngineConfig)]) if getattr(args, "config", None) else {}
    vals.update({n: getattr(args, n) for n in _ENGINE_FLAGS if getattr(args, n, None) is not None})
    try:
        return EngineConfig(**vals)
    except TypeError as exc:
        raise ConfigError(f"engine: {exc}") from None


def _cmd_worker(args) -> int:
    from workers_stub.main import serve_workers

    extra = {}
    labels = _labels(args.labels_list)
    if labels:
        extra["labels"] = labels
    names = ["brokers", "count", "worker_id", "model", "role", "heartbeat_ms", "liveness", "time_scale", "instant",
             "curve_secret", "curve_server_key", "log_level", "tokenizer"]
    settings = _settings(WorkerSettings, args, "worker", names, extra)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mesh", description="mesh: a ZeroMQ request-router mesh for LLM inference fleets.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_broker(sub)
    _add_worker(sub)
    _add_up(sub)
    _add_top(sub)
    _add_keygen(sub)
    from mesh.indexer.cli import add_indexer_parser

    add_indexer_parser(sub)
    from mesh.sim.cli import add_sim_parser

    add_sim_parser(sub)
    from mesh.adapters.cli import add_attach_parser
    from workers_stub.sglang_cli import add_stub_sglang_parser

    add_attach_parser(sub)
    add_stub_sglang_parser(sub)
    from workers_stub.instant_http import add_instant_engine_parser

    add_instant_engine_parser(sub)
    from brokers.gateway import add_gateway_parser

    add_gateway_parser(sub)
    from mesh.fuzz.cli import add_fuzz_parser

    add_fuzz_parser(sub)
    _add_bench(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # which flags were given (explicit beats file)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"mesh: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
