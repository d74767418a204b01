"""``mesh bench http``: command-line wiring (kept free of heavy imports: the parser is built on
every ``mesh`` invocation). The benchmark itself is :mod:`mesh.lab.bench.http_bench`."""

from __future__ import annotations

import argparse
from pathlib import Path

from mesh.cli_run import nonneg_float, positive_float, positive_int, writable_file
from mesh.errors import ConfigError

__all__ = ["add_bench_http_parser"]

_ARMS = ("direct", "broker_zmq", "broker_zmq_tokenized", "broker_adapters", "broker_attached", "gateway_tokenized",
         "sglang_router")


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or any(c < 1 for c in out):
        raise argparse.ArgumentTypeError("expected positive integers")
    return out


def _arms(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [a for a in out if a not in _ARMS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown arm(s) {bad or s!r}: choose from {','.join(_ARMS)}")
    return out


def add_bench_http_parser(bsub) -> argparse.ArgumentParser:
    p = bsub.add_parser(
        "http", help="the HTTP path end to end (wrk or a built-in load generator) vs a direct engine and sglang-router",
        description="Measure the HTTP path in one run, side by side: direct (load -> instant HTTP engine), broker_zmq "
                    "(-> mesh broker --http -> instant ZMQ workers), broker_adapters (-> broker -> mesh attach sglang x4 -> "
                    "instant HTTP engines x4), broker_attached (-> mesh broker --attach sglang=URL x4, the adapters inside the "
                    "broker -> the same engines), gateway_tokenized (-> mesh gateway --processes 2 --tokenizer -> the same; "
                    "with --tokenizer) and sglang_router (SGLang's Rust router -> the same engines; when installed). "
                    "Prints req/s, p50/p99/max latency, errors and CPU microseconds per request of every process role, then "
                    "the targets (PASS/MISS; a miss does not fail the command, a broken arm does).")
    p.add_argument("--arms", type=_arms, default=None, help=f"comma-separated arms (default: all available: {','.join(_ARMS)})")
    p.add_argument("--concurrency", type=_ints, default=[1, 64], help="comma-separated connection counts (default 1,64)")
    p.add_argument("--seconds", type=positive_float, default=8.0, help="measured seconds per cell (default 8; wrk rounds to whole seconds)")
    p.add_argument("--warmup", type=nonneg_float, default=1.0, help="warm-up seconds before each cell (default 1)")
    p.add_argument("--path", default="/generate", choices=["/generate", "/v1/completions", "/v1/chat/completions"],
                   help="endpoint to load (default /generate; arms that do not serve it are skipped)")
    p.add_argument("--stream", action="store_true", help="streamed requests (SSE) instead of one JSON answer")
    p.add_argument("--max-new-tokens", type=positive_int, default=8, help="output tokens per request (default 8)")
    p.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto",
                   help="load generator: wrk (when on PATH, the default) or the built-in Python one")
    p.add_argument("--broker-policy", default="round_robin",
                   help="the broker's --policy in the mesh arms (default round_robin, the Rust router arm's policy: the "
                        "arms then differ in their paths, not in where they send requests; 'default' for the broker's "
                        "own default, cache_aware, which sends this benchmark's one repeated prompt mostly to its holder)")
    p.add_argument("--tokenizer", help="a model folder, or 'builtin' (the Tekken tokenizer mistral-common ships): adds the "
                                      "arms broker_zmq_tokenized (broker_zmq with the broker tokenising every prompt) and "
                                      "gateway_tokenized (the full path behind mesh gateway --processes 2, the gateways "
                                      "tokenising)")
    p.add_argument("--prompt-tokens", type=positive_int, help="prompt length in tokens (of --tokenizer; words without one); "
                                                     "default a 43-byte sentence")
    p.add_argument("--chat-workload", choices=["conversations", "single"], default="conversations",
                   help="with --path /v1/chat/completions: 'conversations' (default: --conversations chats of --turns "
                        "turns sharing one system prompt, each turn re-sending its history plus a new user message, "
                        "--prompt-tokens on average (default 1000); every pass over them is fresh conversations; the "
                        "built-in load generator) or 'single' (one user message, the same body every request)")
    p.add_argument("--conversations", type=positive_int, default=256, help="conversations of the chat workload (default 256)")
    p.add_argument("--turns", type=positive_int, default=4, help="turns per conversation of the chat workload (default 4)")
    p.add_argument("--profile", action="store_true",
                   help="sample the broker, one adapter and one gateway process with py-spy during each mesh arm's "
                        "highest-concurrency cell; the top entries go into the table, the JSON and the report page "
                        "(needs py-spy: pip install '.[bench]')")
    p.add_argument("--log-dir", help="keep the processes' logs here (default: a temporary directory)")
    p.add_argument("--json", type=writable_file, help="write every figure to this JSON file")
    p.set_defaults(func=_cmd_bench_http)
    return p


def _cmd_bench_http(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mesh.lab.bench.http_bench import ALL_ARMS, print_results, run_http_bench, sglang_router_available
    from mesh.lab.bench.report import finish

    if args.tokenizer not in (None, "builtin") and not Path(args.tokenizer).is_dir():
        raise ConfigError(f"tokenizer: no model folder {args.tokenizer!r} (give a folder holding tokenizer.json, or 'builtin')")
    arms = args.arms or [a for a in ALL_ARMS if (a != "sglang_router" or sglang_router_available())
                         and (a not in ("broker_zmq_tokenized", "gateway_tokenized") or args.tokenizer)]
    if args.arms is None and "sglang_router" not in arms:
        Console(stderr=True).print("[bench http] sglang_router: skipped: the sglang_router package is not importable "
                                   "(pip install '.[bench]')")
    total = len(arms) * len(args.concurrency)
    con = Console()
    if not con.is_terminal:
        con = Console(width=max(con.width, 150))  # a log file or pipe: keep the tables' columns whole
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, transient=True) as bar:
        task = bar.add_task("cells", total=total)

        def progress(label: str) -> None:
            bar.update(task, advance=1, description=f"cells (last: {label})")

        try:
            res = run_http_bench(arms=arms, concurrency=args.concurrency, seconds=args.seconds, warmup_s=args.warmup,
                                 path=args.path, stream=args.stream, max_new_tokens=args.max_new_tokens,
                                 loadgen=args.loadgen, broker_policy=None if args.broker_policy == "default" else args.broker_policy, progress=progress,
                                 say=lambda m: bar.console.print(m), log_dir=args.log_dir, tokenizer=args.tokenizer,
                                 prompt_tokens=args.prompt_tokens, profile=args.profile, chat_workload=args.chat_workload,
                                 conversations=args.conversations, turns=args.turns)
        except ValueError as exc:
            con.print(f"mesh bench http: {exc}")
            return 2
        except KeyboardInterrupt:
            con.print("mesh bench http: interrupted (every process it started has been stopped)")
            return 130
    if args.arms is None and not sglang_router_available():
        res["arms"]["sglang_router"] = {"status": "skipped", "reason": "the sglang_router package is not importable"}
    return finish(res, con, args.json, print_results)
