"""``mesh attach sglang|vllm``: command-line wiring of the adapters.

``add_attach_parser(subparsers)`` registers ``attach`` on the ``mesh`` parser; this module also runs
on its own (``python -m mesh.adapters.cli sglang --url ... --broker ...``). ``--config FILE`` reads
the ``[attach]`` TOML table (keys = flag names); command-line flags win.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys

from mesh import aio
from mesh.errors import ConfigError
from mesh.logs import add_log_level_arg

__all__ = ["add_attach_parser", "settings_from_args", "main"]

_FIELDS = ["url", "brokers", "worker_id", "model", "role", "kv_endpoint", "replay_endpoint", "load_endpoint", "block_size",
           "dp_size", "topic", "max_running_requests", "max_total_num_tokens", "heartbeat_ms", "liveness", "health_path",
           "health_interval_ms", "health_timeout_ms", "unhealthy_after", "load_poll_ms", "load_stale_ms", "replay_timeout_ms",
           "discovery_timeout_s", "kv_events_to", "drain_timeout_s", "log_level", "bootstrap_host", "bootstrap_port"]


def _common(p: argparse.ArgumentParser, *, vllm: bool) -> None:
    p.add_argument("--config", help="TOML file; its [attach] table uses these flag names")
    p.add_argument("--url", help="the server's HTTP address, e.g. http://10.0.0.5:30000 (required)")
    p.add_argument("--broker", dest="brokers", action="append", help="broker backend endpoint tcp://HOST:PORT (repeat for a mesh)")
    p.add_argument("--worker-id", help="worker id in the mesh (default <engine>-<host>-<port>)")
    p.add_argument("--model", help="model name in READY (default: discovered)")
    p.add_argument("--role", choices=["mixed", "prefill", "decode"], help="worker role (default mixed)")
    p.add_argument("--label", dest="labels_list", action="append", help="KEY=VALUE label sent in READY (repeatable)")
    g = p.add_argument_group("engine telemetry" + ("" if vllm else " (override /server_info discovery)"))
    g.add_argument("--kv-endpoint", help="KV event PUB of rank 0, tcp://HOST:PORT (rank r = PORT + r; '*' host = the --url host)"
                   + (" [required]" if vllm else ""))
    g.add_argument("--replay-endpoint", help="replay ROUTER of rank 0, tcp://HOST:PORT")
    g.add_argument("--load-endpoint", help="LoadStat PUB of rank 0, tcp://HOST:PORT")
    g.add_argument("--block-size", type=int, help="tokens per KV block (the server's page size)" + (" [required]" if vllm else ""))
    g.add_argument("--dp-size", type=int, help="DP ranks (one event stream each)")
    g.add_argument("--topic", help="ZMQ topic prefix to subscribe to (default: discovered, else empty = all)")
    g.add_argument("--max-running-requests", type=int, help="announce this capacity instead of the discovered one")
    g.add_argument("--max-total-num-tokens", type=int, help="announce this KV capacity (tokens) instead of the discovered one")
    if not vllm:
        g.add_argument("--incremental-streaming", action="store_true", default=None,
                       help="the server runs with --incremental-streaming-output (default: discovered)")
        g.add_argument("--bootstrap-host", help="PD prefill server: host of its KV bootstrap server (default: the --url host)")
        g.add_argument("--bootstrap-port", type=int, help="PD prefill server: its --disaggregation-bootstrap-port (default 8998)")
    h = p.add_argument_group("health, load, timing")
    h.add_argument("--health-path", help="health endpoint (default /health; /ready is cheaper on SGLang)")
    h.add_argument("--health-interval-ms", type=int, help="health check period (default 1000)")
    h.add_argument("--health-timeout-ms", type=int, help="one health check's timeout (default 5000)")
    h.add_argument("--unhealthy-after", type=int, help="failed checks before the worker leaves the mesh (default 2)")
    h.add_argument("--load-poll-ms", type=int, help="HTTP load polling period when there is no LoadStat stream (default 1000)")
    h.add_argument("--load-stale-ms", type=int, help="a load sample older than this is not reported (default 3000)")
    h.add_argument("--replay-timeout-ms", type=int, help="wait for one replay reply (default 2000)")
    h.add_argument("--discovery-timeout-s", type=float, help="give up if the server never answers (default 0 = keep trying)")
    h.add_argument("--heartbeat-ms", type=int, help="heartbeat interval towards brokers (default 500)")
    h.add_argument("--liveness", type=int, help="broker heartbeats missed before reconnecting (default 3)")
    h.add_argument("--kv-events-to", choices=["all", "one"], help="send KV events to every broker (default) or one (shared indexer)")
    h.add_argument("--drain-timeout-s", type=float, help="SIGTERM: wait this long for in-flight requests (default 10)")
    add_log_level_arg(h)


def add_attach_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("attach", help="attach a running SGLang or vLLM server to the mesh as a worker",
                              description="Run an adapter next to one inference server: it relays the server's KV events and "
                                          "load to the brokers and serves mesh requests through the server's HTTP API.")
    sub = p.add_subparsers(dest="engine", required=True, metavar="ENGINE")
    s = sub.add_parser("sglang", help="an SGLang server (discovers events, page size and DP size from /server_info)",
                       description="Attach an SGLang server. Start it with --page-size 16 --kv-events-config "
                                   "'{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\"}' "
                                   "--load-publish-endpoint auto --enable-metrics.")
    _common(s, vllm=False)
    s.set_defaults(func=_cmd_attach)
    v = sub.add_parser("vllm", help="a vLLM server (event endpoints and block size come from flags)",
                       description="Attach a vLLM server started with --kv-events-config "
                                   "'{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\","
                                   "\"replay_endpoint\":\"tcp://*:5558\"}'.")
    _common(v, vllm=True)
    v.set_defaults(func=_cmd_attach)
    return p


def settings_from_args(args: argparse.Namespace):
    from mesh.adapters.base import AttachSettings
    from mesh.config import load_toml

    allowed = [f.name for f in dataclasses.fields(AttachSettings)]
    vals = load_toml(args.config, "attach", allowed) if getattr(args, "config", None) else {}
    for name in _FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            vals[name] = v
    if getattr(args, "incremental_streaming", None) is not None:
        vals["incremental_streaming"] = args.incremental_streaming
    labels = dict(vals.pop("labels", {}) or {})
    for it in getattr(args, "labels_list", None) or []:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise ConfigError(f"labels: expected KEY=VALUE, got {it!r}")
        labels[k] = v
    if not vals.get("url"):
        raise ConfigError("url: --url http://HOST:PORT is required")
    if "broker" in vals:  # TOML written with the flag name
        b = vals.pop("broker")
        vals.setdefault("brokers", [b] if isinstance(b, str) else list(b))
    if isinstance(vals.get("brokers"), str):
        vals["brokers"] = [vals["brokers"]]
    vals["brokers"] = tuple(vals.get("brokers") or ())
    try:
        s = AttachSettings(labels=labels, **vals)
    except TypeError as exc:
        raise ConfigError(f"attach: {exc}") from None
    s.validate()
    return s


def make_backend(engine: str, s):
    if engine == "sglang":
        from mesh.adapters.sglang import SglangBackend

        return SglangBackend(s)
    if engine == "vllm":
        from mesh.adapters.vllm import VllmBackend

        return VllmBackend(s)
    raise ConfigError(f"engine: unknown engine {engine!r}")


async def _run(engine: str, s) -> int:
    """Run the adapter until SIGTERM/SIGINT; returns the exit code (0, or 130 after SIGINT).

    The first signal stops it in any state: while it waits for the engine it exits at once,
    while it serves it drains (bounded by ``drain_timeout_s``); a second signal skips the drain."""
    from mesh.adapters.base import Adapter
    from mesh.logs import configure, get_logger

    configure(s.log_level)
    log = get_logger(service="adapter")
    adapter = Adapter(s, make_backend(engine, s))
    loop = asyncio.get_running_loop()
    got: list[int] = []

    def _on_signal(sig: int) -> None:
        got.append(sig)
        again = len(got) > 1
        log.info("adapter_signal", signal=signal.Signals(sig).name, action="stop now" if again else "stop",
                 worker_id=adapter.worker_id)
        adapter.request_stop(force=again)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig)
    try:
        await adapter.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("adapter_exit", signal=signal.Signals(got[0]).name if got else None)
    return 130 if got and got[0] == signal.SIGINT else 0


def _cmd_attach(args) -> int:
    s = settings_from_args(args)
    make_backend(args.engine, s)  # flag errors (e.g. vLLM without --kv-endpoint) before any I/O
    return aio.run(_run(args.engine, s))


def main(argv: list[str] | None = None) -> int:
    """``python -m mesh.adapters.cli`` = ``mesh attach`` (one CLI entry point)."""
    from mesh.cli import main as mesh_main

    return mesh_main(["attach", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
