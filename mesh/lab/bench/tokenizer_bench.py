"""``mesh bench tokenizer``: what tokenizing in the pool costs a request, for 1k- and 8k-token prompts.

Four arms per prompt size: ``encode`` (a completions prompt, ``add_special_tokens=True``) and ``chat``
(render the model's chat template over a system prompt and one user message of that size, then encode the
result), each awaited through ``TokenizerPool`` from an event loop, as the HTTP ingress will call it.

- **added latency p50 / p99**: one request at a time; the wall time from ``await pool.encode(...)`` to its
  result, i.e. what tokenization adds to a request's time to first token on an idle front end. ``direct
  p50`` is the same work as a blocking call on the loop's thread (what the pool avoids doing there); the
  difference is the cost of the hop to a pool thread and back.
- **tokens/s**: prompt tokens tokenized per second with ``concurrency`` jobs kept in flight (the pool's
  threads all busy), i.e. the throughput ceiling of one front-end process.
- **loop lag p99 / max**: how late a 1 ms ticker on the same loop ran during the throughput phase: how long
  the loop could not serve its sockets (the GIL held by rendering and result conversion, or the CPU taken
  by the pool's threads when they are as many as the cores).

Prompts are pseudo-random words (seeded), trimmed to the exact token count, so BPE meets realistic text
rather than one repeated phrase. ``--builtin`` uses the shipped Mistral-7B-Instruct-v0.3 tokenizer
(``mesh.lab.tokenizer_builtin``) with its chat template (``--builtin tekken``: Mistral-Nemo's Tekken vocabulary); ``--model-dir DIR`` any local model folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from mesh.stats import percentile

__all__ = ["run_tokenizer_bench", "print_table", "make_prompt", "add_bench_tokenizer_parser"]

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
          "you were her she there been one all we their has would when if so no will more what up out about who "
          "kernel cache prefix router worker token latency throughput broker request engine batch memory model "
          "Grüße naïve café déjà 東京 数据 모델 😀 λ 3.14159 2026 #include <stdio.h> {\"key\": [1, 2]} x_y=z;").split()


def make_prompt(tokenizer: Any, n_tokens: int, seed: int = 0) -> str:
    """Text that encodes (without special tokens) to exactly ``n_tokens`` tokens, or as close as the last
    word allows."""
    rng = random.Random(seed)
    words: list[str] = []
    text = ""
    while True:
        words.extend(rng.choice(_WORDS) for _ in range(max(16, n_tokens // 2)))
        text = " ".join(words)
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc.ids) >= n_tokens:
            break
    end = enc.offsets[n_tokens - 1][1]
    return text[:end]


async def _arm(pool: Any, job: Any, direct: Any, iters: int, concurrency: int) -> dict[str, float]:
    for _ in range(3):  # warm-up: thread start, template compile caches
        await job()
        direct()
    lat_direct = []
    for _ in range(iters):  # the same work as a blocking call on this thread: what the pool's hop costs on top
        t0 = time.perf_counter()
        direct()
        lat_direct.append(time.perf_counter() - t0)
    lat = []
    n_tok = 0
    for _ in range(iters):
        t0 = time.perf_counter()
        n_tok = await job()
        lat.append(time.perf_counter() - t0)
    # throughput with the pool saturated, and the loop's lag meanwhile
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            lags.append(now - last - 0.001)
            last = now

    tick = asyncio.create_task(ticker())
    remaining = iters * 2
    total = 0

    async def runner():
        nonlocal remaining, total
        while remaining > 0:
            remaining -= 1
            n = await job()  # not ``total += await job()``: that reads ``total`` before the await
            total += n

    t0 = time.perf_counter()
    await asyncio.gather(*(runner() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    stop.set()
    await tick
    return {"tokens": n_tok, "direct_p50_ms": percentile(lat_direct, 50) * 1e3, "p50_ms": percentile(lat, 50) * 1e3,
            "p99_ms": percentile(lat, 99) * 1e3, "mean_ms": statistics.fmean(lat) * 1e3, "tokens_per_s": total / wall,
            "loop_lag_p99_ms": percentile(lags, 99) * 1e3,  # 0.0 with no lag samples
            "loop_lag_max_ms": max(lags, default=0.0) * 1e3}


def run_tokenizer_bench(model_dir: str | Path | None = None, chat_template_file: str | Path | None = None,
                        builtin: bool | str = False, sizes: tuple[int, ...] = (1024, 8192), iters: int = 100,
                        workers: int = 2, concurrency: int = 8) -> dict[str, Any]:
    """Run the four arms per size; returns a JSON-able dict (see the module docstring for each figure)."""
    from mesh.tokenization.pool import ModelTokenizer, TokenizerPool

    tmp = None
    kind = builtin if isinstance(builtin, str) else "mistral_v3"
    if builtin:
        from mesh.lab.tokenizer_builtin import MISTRAL_V3_TEMPLATE, build_model_dir

        tmp = tempfile.TemporaryDirectory(prefix="mesh-tokbench-")
        model_dir = build_model_dir(Path(tmp.name) / "model", chat_template=MISTRAL_V3_TEMPLATE, tokenizer=kind)
    if model_dir is None:
        raise ValueError("give model_dir or builtin=True")
    try:
        mt = ModelTokenizer.from_dir(model_dir, chat_template_file)
        label = {"mistral_v3": "builtin:mistral-7b-instruct-v0.3 (SentencePiece)",
                 "tekken": "builtin:mistral-nemo tekken (byte-level BPE)"}
        res: dict[str, Any] = {"model_dir": label[kind] if builtin else str(model_dir),
                               "workers": workers, "concurrency": concurrency, "iters": iters, "arms": []}

        async def main():
            with TokenizerPool(mt, workers=workers, max_queued=max(64, concurrency)) as pool:
                for n in sizes:
                    text = make_prompt(mt.files.tokenizer, n)

                    async def enc(text=text):
                        return len(await pool.encode(text))

                    res["arms"].append({"size": n, "arm": "encode",
                                        **await _arm(pool, enc, lambda: mt.encode(text), iters, concurrency)})
                    if mt.chat_template is None:
                        continue
                    msgs = [{"role": "system", "content": "You are a helpful assistant."},
                            {"role": "user", "content": text}]

                    async def chat(msgs=msgs):
                        return len((await pool.render_chat(msgs))[1])

                    res["arms"].append({"size": n, "arm": "render+encode",
                                        **await _arm(pool, chat, lambda: mt.render_chat(msgs), iters, concurrency)})

        asyncio.run(main())
        return res
    finally:
        if tmp is not None:
            tmp.cleanup()


def print_table(res: dict[str, Any]) -> None:
    print(f"tokenizer pool: {res['model_dir']}  ({res['workers']} threads; latency: {res['iters']} sequential "
          f"requests; tokens/s: {res['concurrency']} in flight)")
    head = f"{'prompt':>7}  {'arm':<14}{'tokens':>7}  {'direct p50':>10}  {'p50 ms':>7}  {'p99 ms':>7}  {'tokens/s':>11}  {'loop lag p99/max ms':>19}"
    print(head)
    print("-" * len(head))
    for a in res["arms"]:
        print(f"{a['size']:>7}  {a['arm']:<14}{a['tokens']:>7}  {a['direct_p50_ms']:>10.2f}  {a['p50_ms']:>7.2f}  {a['p99_ms']:>7.2f}  "
              f"{a['tokens_per_s']:>11,.0f}  {a['loop_lag_p99_ms']:>9.2f} / {a['loop_lag_max_ms']:<7.2f}")


def _cmd(args) -> int:
    from mesh.errors import ConfigError

    if not args.builtin and not args.model_dir:
        raise ConfigError("mesh bench tokenizer: give --model-dir DIR or --builtin")
    res = run_tokenizer_bench(model_dir=args.model_dir, chat_template_file=args.chat_template, builtin=args.builtin,
                              sizes=tuple(args.sizes), iters=args.iters, workers=args.workers,
                              concurrency=args.concurrency)
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


def _sizes(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError("expected positive integers")
    return out


def add_bench_tokenizer_parser(bsub) -> argparse.ArgumentParser:
    """Register ``mesh bench tokenizer`` (no heavy imports here: the parser is built on every ``mesh`` run)."""
    p = bsub.add_parser("tokenizer", help="tokens/s and added latency of tokenization in the pool (1k and 8k-token prompts)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="a local model folder (tokenizer.json, tokenizer_config.json)")
    src.add_argument("--builtin", nargs="?", const="mistral_v3", choices=("mistral_v3", "tekken"),
                     help="a tokenizer that mistral-common ships: mistral_v3 (Mistral-7B-Instruct-v0.3's SentencePiece, "
                          "the default) or tekken (Mistral-Nemo's byte-level BPE); needs the dev extra")
    p.add_argument("--chat-template", help="a chat template file, instead of the model folder's")
    p.add_argument("--sizes", type=_sizes, default=[1024, 8192], help="prompt sizes in tokens (default 1024,8192)")
    p.add_argument("--iters", type=int, default=100, help="sequential requests per arm (default 100)")
    p.add_argument("--workers", type=int, default=2, help="pool threads (default 2)")
    p.add_argument("--concurrency", type=int, default=8, help="jobs in flight in the throughput phase (default 8)")
    p.add_argument("--json", help="write results to this JSON file")
    p.set_defaults(func=_cmd)
    return p
