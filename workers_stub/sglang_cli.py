"""``mesh stub-sglang``: command-line wiring of the SGLang-compatible simulated server.

``add_stub_sglang_parser(subparsers)`` registers the subcommand on the ``mesh`` parser; this module
also runs on its own (``python -m workers_stub.sglang_cli --port 30000``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from mesh.cli_run import port_number, port_or_off, positive_float, positive_int
from mesh.logs import add_log_level_arg
from mesh.config import build
from mesh.engine_model import EngineConfig
from mesh.errors import ConfigError
from mesh.settings_fields import add_flags

__all__ = ["add_stub_sglang_parser", "settings_from_args", "main"]

_ENGINE_FLAGS = ["max_total_num_tokens", "page_size", "max_running_requests", "prefill_tokens_per_s", "prefill_overhead_ms",
                 "chunked_prefill_size", "decode_base_ms", "decode_per_req_ms", "decode_log_interval", "host_kv_tokens"]


def _port_of(endpoint: str, what: str) -> int:
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ConfigError(f"{what}: expected tcp://HOST:PORT, got {endpoint!r}")
    try:
        return int(endpoint.rsplit(":", 1)[1])
    except ValueError:
        raise ConfigError(f"{what}: bad port in {endpoint!r}") from None


def add_stub_sglang_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "stub-sglang", help="run an SGLang-compatible simulated server (HTTP API + ZMQ KV events + LoadStat, no GPU)",
        description="Run a simulated SGLang server: SGLang's HTTP API (/generate, OpenAI endpoints, /server_info, /v1/loads, "
                    "/metrics, ...) and its ZMQ KV event / replay / LoadStat sockets, driven by mesh's GPU server model. "
                    "Ports default to free ones; the readiness line 'sglang_stub_listening' names them.")
    p.add_argument("--config", help="TOML file; its [stub_sglang] table uses these flag names (flags win)")
    p.add_argument("--host", default="127.0.0.1", help="bind address for HTTP and ZMQ (0.0.0.0 = all; advertised as '*')")
    p.add_argument("--port", type=port_number, default=30000, help="HTTP port (0 = any free port; default 30000)")
    p.add_argument("--kv-port", type=port_number, default=0, help="KV event PUB port of rank 0, rank r uses +r (0 = free range)")
    p.add_argument("--replay-port", type=port_or_off, default=0, help="replay ROUTER port of rank 0 (0 = free range, -1 = no replay)")
    p.add_argument("--load-port", type=port_or_off, default=0, help="LoadStat PUB port of rank 0 (0 = free range, -1 = off)")
    p.add_argument("--no-kv-events", action="store_true", help="publish no KV events (kv_events discovery block is null)")
    p.add_argument("--kv-events-config", help="SGLang-style JSON ({\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\","
                                              "\"replay_endpoint\":...,\"topic\":...,\"buffer_steps\":...}); overrides the port flags")
    p.add_argument("--load-publish-endpoint", help="SGLang-style off | auto | tcp://*:PORT (overrides --load-port)")
    p.add_argument("--dp-size", type=positive_int, default=1, help="DP ranks, each its own engine, publisher and ports (default 1)")
    p.add_argument("--event-format", choices=["map", "array", "vllm"], default="map",
                   help="KV event encoding: map (SGLang >= 0.5.20, default), array (<= 0.5.19), vllm (vLLM 0.33 maps)")
    p.add_argument("--topic", default=None, help="ZMQ topic frame (default empty)")
    p.add_argument("--replay-frames", type=int, choices=[3, 4], default=4,
                   help="replay reply shape: 4 = [b'', topic, seq, payload] (>= 0.5.22), 3 = [b'', seq, payload] (<= 0.5.21)")
    p.add_argument("--buffer-steps", type=positive_int, default=None, help="replay buffer length in batches (default 10000)")
    p.add_argument("--time-scale", type=positive_float, default=1.0, help="multiply every modelled duration (0.1 = ten times faster)")
    p.add_argument("--model", "--served-model-name", dest="model", default="stub-sglang-8b", help="served model name")
    p.add_argument("--fail-health", action="store_true", help="/health and /ready answer 503 (health gating tests)")
    p.add_argument("--incremental-streaming-output", action="store_true", help="/generate streams deltas, not cumulative chunks")
    p.add_argument("--http-load-api", choices=["v1_loads", "get_load", "metrics"], default="v1_loads",
                   help="HTTP load endpoints: v1_loads (0.5.21+), get_load (/get_load + /v1/loads, 0.5.12-0.5.20), metrics (only /metrics)")
    p.add_argument("--tokenizer", help="a model folder (tokenizer.json, tokenizer_config.json) or a model id in the local "
                                      "Hugging Face cache: text prompts and chat messages are tokenised as the real engine "
                                      "would (default: --model-path's, else UTF-8 bytes as ids)")
    p.add_argument("--model-path", default="", help="SGLang's --model-path: a model id (ORG/NAME, from the local Hugging "
                                                    "Face cache) or folder whose tokenizer the stub uses and announces")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-paths): /v1/models lists "
                                                               "them, /load_lora_adapter and /v1/load_lora_adapter change them")
    p.add_argument("--lora-paths", nargs="*", default=[], metavar="NAME[=PATH]", help="LoRA adapters loaded at start (SGLang's flag)")
    p.add_argument("--lora-dynamic", action="store_true", help="load an unknown adapter on its first request (as vLLM's LoRA "
                                                               "resolvers do) instead of refusing it")
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null",
                   help="P/D leg this server serves: SGLang's bootstrap_* on /generate, vLLM's kv_transfer_params on "
                        "/v1/completions (the KV pull is on the HTTP port; default null = neither)")
    p.add_argument("--pd-fault", choices=["prefill_error", "bootstrap_hang", "decode_error"], default=None,
                   help="P/D fault to inject: the prefill leg fails, its KV handoff never completes, or the decode leg fails")
    p.add_argument("--pd-waiting-timeout-s", type=float, default=300.0,
                   help="a decode leg waits this long for its KV (SGLang's SGLANG_DISAGGREGATION_WAITING_TIMEOUT; default 300)")
    add_log_level_arg(p, "info")
    g = p.add_argument_group("engine model (defaults: 8B model on one H100; --page-size is SGLang's flag too)")
    add_flags(g, EngineConfig, only=_ENGINE_FLAGS)  # generated from the EngineConfig fields (help, units)
    p.set_defaults(func=_cmd_stub_sglang, _parser=p)
    return p


def settings_from_args(args: argparse.Namespace):
    from workers_stub.sglang_server import StubSettings

    eng = {n: getattr(args, n) for n in _ENGINE_FLAGS if getattr(args, n, None) is not None}
    if "page_size" not in eng:
        eng["page_size"] = 16
    engine = build(EngineConfig, eng)  # the shared validated builder: errors name the field
    kv_port: int | None = None if args.no_kv_events else args.kv_port
    replay_port: int | None = None if args.replay_port < 0 else args.replay_port
    load_port: int | None = None if args.load_port < 0 else args.load_port
    topic = args.topic or ""
    buffer_steps = args.buffer_steps or 10_000
    if args.kv_events_config:
        try:
            cfg = json.loads(args.kv_events_config)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"kv_events_config: invalid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise ConfigError("kv_events_config: must be a JSON object")
        if cfg.get("publisher", "null") != "zmq":
            kv_port = replay_port = None  # SGLang publishes nothing unless publisher is "zmq"
        else:
            kv_port = _port_of(cfg.get("endpoint", "tcp://*:5557"), "kv_events_config.endpoint")
            replay_port = _port_of(cfg["replay_endpoint"], "kv_events_config.replay_endpoint") if cfg.get("replay_endpoint") else None
            if args.topic is None:
                topic = str(cfg.get("topic", ""))
            if args.buffer_steps is None and cfg.get("buffer_steps") is not None:
                buffer_steps = int(cfg["buffer_steps"])
    if args.load_publish_endpoint:
        lp = args.load_publish_endpoint
        load_port = None if lp == "off" else 0 if lp == "auto" else _port_of(lp, "load_publish_endpoint")
    s = StubSettings(
        host=args.host, port=args.port, kv_port=kv_port, replay_port=replay_port if kv_port is not None else None,
        load_port=load_port, dp_size=args.dp_size, event_format=args.event_format, topic=topic,
        replay_frames=args.replay_frames, buffer_steps=buffer_steps, time_scale=args.time_scale, model=args.model,
        fail_health=args.fail_health, incremental_streaming_output=args.incremental_streaming_output,
        http_load_api=args.http_load_api, engine=engine, log_level=args.log_level, tokenizer=args.tokenizer or "",
        enable_lora=args.enable_lora or bool(args.lora_paths), lora_paths=tuple(args.lora_paths), lora_dynamic=args.lora_dynamic,
        model_path=args.model_path,
        disaggregation_mode=args.disaggregation_mode, pd_fault=args.pd_fault or "", pd_waiting_timeout_s=args.pd_waiting_timeout_s,
    )
    try:
        s.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return s


def _cmd_stub_sglang(args) -> int:
    from mesh.config import apply_toml_to_args
    from workers_stub.sglang_server import serve_stub

    if args.config:
        apply_toml_to_args(args, args._parser, args.config, "stub_sglang", getattr(args, "_argv", None))

    asyncio.run(serve_stub(settings_from_args(args)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m workers_stub.sglang_cli`` = ``mesh stub-sglang`` (one CLI entry point)."""
    from mesh.cli_run import run_one

    return run_one("stub-sglang", add_stub_sglang_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
