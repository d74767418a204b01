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
from mesh.settings_fields import Spec, add_flags

__all__ = ["add_attach_parser", "settings_from_args", "main"]

# How AttachSettings' fields (mesh/adapters/settings.py) appear on the command line: the one
# description from which the flags and the [attach] TOML keys (field or flag names) are made.
_SPECS: dict[str, Spec] = {
    "url": Spec(help="the server's HTTP address, e.g. http://10.0.0.5:30000"),
    "brokers": Spec(flag="--broker", help="broker backend endpoint tcp://HOST:PORT (repeat for a mesh)"),
    "worker_id": Spec(help="worker id in the mesh", default_text="<engine>-<host>-<port>"),
    "model": Spec(help="model name in READY", default_text="discovered"),
    "role": Spec(choices=("mixed", "prefill", "decode"), help="worker role"),
    "labels": Spec(cli=False, help="labels sent in READY (flag: --label KEY=VALUE)"),
    # engine telemetry (SGLang: overrides /server_info discovery)
    "kv_endpoint": Spec(help="KV event PUB of rank 0, tcp://HOST:PORT (rank r = PORT + r; '*' host = the --url host)",
                        default_text="discovered"),
    "replay_endpoint": Spec(help="replay ROUTER of rank 0, tcp://HOST:PORT", default_text="discovered"),
    "load_endpoint": Spec(help="LoadStat PUB of rank 0, tcp://HOST:PORT", default_text="discovered"),
    "block_size": Spec(unit="tokens", help="tokens per KV block (the server's page size)", default_text="discovered"),
    "dp_size": Spec(help="DP ranks (one event stream each)", default_text="discovered"),
    "topic": Spec(help="ZMQ topic prefix to subscribe to", default_text="discovered, else empty = all"),
    "max_running_requests": Spec(help="announce this capacity instead of the discovered one", default_text="discovered"),
    "max_total_num_tokens": Spec(help="announce this KV capacity (tokens) instead of the discovered one",
                                 default_text="discovered"),
    "incremental_streaming": Spec(help="the server runs with --incremental-streaming-output", default_text="discovered"),
    "bootstrap_host": Spec(help="PD prefill server: host of its KV bootstrap server", default_text="the --url host"),
    "bootstrap_port": Spec(help="PD prefill server: its --disaggregation-bootstrap-port"),
    "bootstrap_timeout_s": Spec(unit="s", help="PD prefill server: its request (the prefill and the KV handoff to the "
                                               "decode server) must end within this, else the broker is told and "
                                               "retries the pair (SGLang's own bootstrap timeout is 300 s)"),
    # health, load, timing
    "heartbeat_ms": Spec(unit="ms", help="heartbeat interval towards brokers"),
    "liveness": Spec(help="broker heartbeats missed before reconnecting"),
    "reconnect_base_ms": Spec(unit="ms", cli=False, help="reconnect back-off base"),
    "reconnect_cap_ms": Spec(unit="ms", cli=False, help="reconnect back-off cap"),
    "health_path": Spec(help="health endpoint (/ready is cheaper on SGLang)", default_text="/health"),
    "health_interval_ms": Spec(unit="ms", help="health check period"),
    "health_timeout_ms": Spec(unit="ms", help="one health check's timeout"),
    "unhealthy_after": Spec(help="failed checks before the worker leaves the mesh"),
    "load_poll_ms": Spec(unit="ms", help="HTTP load polling period when there is no LoadStat stream"),
    "load_stale_ms": Spec(unit="ms", help="a load sample older than this is not reported"),
    "lora_refresh_ms": Spec(unit="ms", help="re-read the engine's loaded LoRA adapters (/v1/models) this often; "
                                            "0 = only at registration"),
    "replay_timeout_ms": Spec(unit="ms", help="wait for one replay reply"),
    "discovery_timeout_s": Spec(unit="s", help="give up if the server never answers (0 = keep trying)"),
    "max_batch_tokens": Spec(unit="tokens", cli=False, help="largest batch of tokens relayed at once"),
    "kv_events_to": Spec(choices=("all", "one"), help="send KV events to every broker (local indexes) or one (shared "
                                                      "indexer)"),
    "drain_timeout_s": Spec(unit="s", help="SIGTERM: wait this long for in-flight requests"),
    "log_level": Spec(add=add_log_level_arg),
    "trace_exporter": Spec(choices=("none", "console", "otlp"),
                           help="OpenTelemetry: a CLIENT span per engine call, continuing the trace the broker's "
                                "HTTP span began (the 'tracing' extra): none, console (stderr) or otlp"),
    "trace_endpoint": Spec(metavar="URL", help="OTLP/HTTP traces endpoint, e.g. http://otel-collector:4318/v1/traces"),
}
_TOP = ["url", "brokers", "worker_id", "model", "role"]
_TELEMETRY = ["kv_endpoint", "replay_endpoint", "load_endpoint", "block_size", "dp_size", "topic", "max_running_requests",
              "max_total_num_tokens"]
_SGLANG_ONLY = ["incremental_streaming", "bootstrap_host", "bootstrap_port"]
_TIMING = ["health_path", "health_interval_ms", "health_timeout_ms", "unhealthy_after", "load_poll_ms", "load_stale_ms",
           "lora_refresh_ms", "replay_timeout_ms", "discovery_timeout_s", "bootstrap_timeout_s", "heartbeat_ms", "liveness", "kv_events_to", "drain_timeout_s",
           "log_level", "trace_exporter", "trace_endpoint"]
_VLLM_REQUIRED = ("kv_endpoint", "block_size")


def _specs(vllm: bool) -> dict[str, Spec]:
    """vLLM discovers nothing: its telemetry fields default to none (two of them are required)."""
    if not vllm:
        return _SPECS
    out = dict(_SPECS)
    shown = {"dp_size": "1", "topic": "empty = all", **{n: "required" for n in _VLLM_REQUIRED}}
    for name in _TELEMETRY:
        out[name] = dataclasses.replace(_SPECS[name], default_text=shown.get(name, "none"))
    return out


def _common(p: argparse.ArgumentParser, *, vllm: bool) -> None:
    from mesh.adapters.settings import AttachSettings

    specs = _specs(vllm)
    p.add_argument("--config", help="TOML file; its [attach] table uses these flag names")
    add_flags(p, AttachSettings, only=_TOP, specs=specs)
    p.add_argument("--label", dest="labels_list", action="append", help="KEY=VALUE label sent in READY (repeatable)")
    g = p.add_argument_group("engine telemetry" + ("" if vllm else " (override /server_info discovery)"))
    add_flags(g, AttachSettings, only=_TELEMETRY + ([] if vllm else _SGLANG_ONLY), specs=specs)
    add_flags(p.add_argument_group("health, load, timing"), AttachSettings, only=_TIMING, specs=specs)


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
    """AttachSettings: defaults < the [attach] table of --config < flags (labels: the file's, then
    each --label); validated, errors naming the field."""
    from mesh.adapters.settings import AttachSettings
    from mesh.config import load_toml, settings_from_args as build_settings
    from mesh.settings_fields import toml_aliases

    vllm = getattr(args, "engine", None) == "vllm"
    specs = _specs(vllm)
    allowed = [f.name for f in dataclasses.fields(AttachSettings)] + list(toml_aliases(AttachSettings, specs))
    file_vals = load_toml(args.config, "attach", allowed) if getattr(args, "config", None) else {}
    labels = dict(file_vals.pop("labels", {}) or {})
    for it in getattr(args, "labels_list", None) or []:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise ConfigError(f"labels: expected KEY=VALUE, got {it!r}")
        labels[k] = v
    if not (getattr(args, "url", None) or file_vals.get("url")):
        raise ConfigError("url: --url http://HOST:PORT is required")
    if "brokers" not in file_vals and "broker" not in file_vals:
        file_vals["brokers"] = ()  # unless a --broker flag gives some, validate() names the missing endpoint
    return build_settings(AttachSettings, args, "attach", specs=specs, file_vals=file_vals, extra={"labels": labels},
                          only=_TOP + _TELEMETRY + ([] if vllm else _SGLANG_ONLY) + _TIMING)


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
    from mesh.tracing import configure_tracing

    configure_tracing(s.trace_exporter, s.trace_endpoint, service="mesh-adapter")
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
    from mesh.gc_tuning import freeze_startup_heap

    freeze_startup_heap()  # collections while serving scan only what serving allocated (as the broker's)
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
    from mesh.cli_run import run_one

    return run_one("attach", add_attach_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
