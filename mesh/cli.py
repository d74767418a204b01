"""The ``mesh`` command. Each subcommand's ``--help`` documents its flags.

Every process subcommand also takes ``--config FILE`` (TOML); keys in its table use the flag
names, and flags given on the command line win.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from mesh.cli_run import dispatch, new_parser, positive_float, zmq_endpoint
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
                 "chunked_prefill_size", "decode_base_ms", "decode_per_req_ms", "decode_log_interval", "host_kv_tokens"]


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
        except OSError as exc:
            print(f"mesh keygen: dir: cannot write keys in {a.dir!r}: {exc.strerror or exc} (give --dir a folder you can write)",
                  file=sys.stderr)
            return 2
        print(f"public key:  {pub}\nsecret key:  {sec}  (mode 0600, keep private)")
        return 0

    p.set_defaults(func=_run)


# ----------------------------------------------------------------------------- top


def _add_top(sub) -> None:
    p = sub.add_parser("top", help="live table of workers and routing from brokers' telemetry streams",
                       description="Subscribe to one or more brokers' --telemetry endpoints and show a live table.")
    p.add_argument("--telemetry", action="append", required=True, type=zmq_endpoint,
                   help="broker telemetry endpoint, tcp://HOST:PORT (repeatable)")
    p.add_argument("--duration", type=positive_float, help="exit after this many seconds (default: until Ctrl-C)")
    p.set_defaults(func=lambda a: __import__("mesh.top", fromlist=["run_top"]).run_top(a.telemetry, duration_s=a.duration))


# ----------------------------------------------------------------------------- main


def _add_indexer(sub) -> None:
    from mesh.indexer.cli import add_indexer_parser

    add_indexer_parser(sub)


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


def _add_ctl(sub) -> None:
    from mesh.ctl import add_ctl_parser

    add_ctl_parser(sub)


def _lab(name: str):
    """The adder of the lab command ``name`` (``mesh.lab.cli``): the only import of ``mesh.lab``
    outside it, made when that command's parser is built."""

    def add(sub) -> None:
        from mesh.lab.cli import COMMANDS

        COMMANDS[name](sub)

    return add


def _lab_missing(command: str) -> list[str]:
    """The modules of the ``lab`` extra that ``command`` needs and that are not installed."""
    import importlib.util

    from mesh.lab import COMMAND_REQUIRES, REQUIRES

    return [m for m in COMMAND_REQUIRES.get(command, REQUIRES) if importlib.util.find_spec(m) is None]


# Every subcommand, in --help order, with the function that adds its parser. The adders import
# their command's modules; a process building only its own parser skips the others' imports (the
# simulator, the gateway, the benchmarks: ~0.15 s of start-up per process, and tests start hundreds).
_COMMANDS: dict[str, object] = {
    "broker": _add_broker, "worker-stub": _add_worker, "up": _lab("up"), "top": _add_top,
    "keygen": _add_keygen, "indexer": _add_indexer, "sim": _lab("sim"), "attach": _add_attach,
    "stub-sglang": _add_stub_sglang, "instant-engine": _add_instant_engine, "gateway": _add_gateway,
    "fuzz": _lab("fuzz"), "ctl": _add_ctl, "bench": _lab("bench"), "report": _lab("report"),
}
_LAB_COMMANDS = ("up", "sim", "fuzz", "bench", "report")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``mesh`` parser: every subcommand, or with ``only`` (a name in ``_COMMANDS``) just that one."""
    p, sub = new_parser()
    for name, add in _COMMANDS.items():
        if only is None or name == only:
            add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    # The command is the first argument ("mesh" takes no options of its own but --help): a known
    # one builds only its parser; anything else (--help, a typo) builds all, for the full usage.
    only = given[0] if given and given[0] in _COMMANDS else None
    if only in _LAB_COMMANDS and (missing := _lab_missing(only)):
        from mesh.lab import EXTRA_HINT

        print(f"mesh {only}: needs the lab extra ({', '.join(missing)} missing): {EXTRA_HINT}", file=sys.stderr)
        return 2
    return dispatch(build_parser(only), given)


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
