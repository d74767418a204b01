"""Micro-benchmark of the prefix index: apply throughput, match latency vs fleet size, memory.

``run_index_bench(...) -> dict`` (``python -m mesh.lab.bench.index_bench [--quick]`` prints it as JSON):

* **apply**: blocks/s of ``resolve_parent_key`` + ``store`` with precomputed content keys, batched
  like real events (32-512 blocks per Store), while building a realistic index;
* **match**: p50/p99 latency of ``match`` for an 8k-token prompt (512 keys of 16-token pages) at
  each fleet size, plus ``match`` + ``top(8)``. The index is "realistic": every worker holds
  several conversations (a shared system prompt + a long unique history), 16 system prompts of
  which one is held by every worker and the rest by Zipf-popular subsets. Queries mix deep hits on
  one worker's history (60%), shared-system-prompt-only prompts (30%) and misses (10%);
* **memory**: ``tracemalloc`` bytes per (block, stream) entry of a realistic index built from
  scratch inside the measurement window (everything counted is retained by the index only);
* **approx**: insert rate and match latency of the standalone speculative index.

The total number of entries is capped (``max_total_entries``) so 4,096 workers fit in memory and
time: large fleets hold fewer conversations per worker, never fewer holders per shared prefix.
Timing uses ``time.perf_counter_ns`` -- this is a benchmark harness, not index code.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
import tracemalloc
from typing import Any

from mesh.index.prefix import PrefixIndex
from mesh.index.speculative import ApproxIndex
from mesh.stats import percentile

__all__ = ["run_index_bench", "build_realistic_index"]

U64 = (1 << 64) - 1
TARGETS = {
    "apply_blocks_per_s_min": 500_000,
    "match_p50_ms_at_64_max": 0.1,
    "match_p99_ratio_4096_vs_64_max": 2.0,
    "bytes_per_entry_max": 200,
}


def _keys(rng: random.Random, n: int) -> list[int]:
    # Random u64s stand in for chained xxh3 content keys: the index never recomputes a key.
    g = rng.getrandbits
    return [g(64) for _ in range(n)]


def build_realistic_index(
    ix: PrefixIndex,
    workers: int,
    rng: random.Random,
    *,
    blocks_per_worker: int,
    system_prompts: int = 16,
    system_blocks: int = 64,
    tail_blocks: tuple[int, int] = (128, 960),
    keep_conversations: bool = True,
) -> tuple[list[tuple[str, list[int]]], list[list[int]], int, float]:
    """Fill ``ix``; returns (conversations, system prompt keys, blocks stored, seconds in store)."""
    sys_keys = [_keys(rng, system_blocks) for _ in range(system_prompts)]
    weights = [1.0 / (i + 1) for i in range(system_prompts)]
    convs: list[tuple[str, list[int]]] = []
    stored = 0
    busy_ns = 0
    clock = time.perf_counter_ns
    for w in range(workers):
        wid = f"worker-{w:05d}"
        stream = (wid, 0)
        # Engine hashes are per-worker objects (as decoded from each worker's own events).
        held_sys: dict[int, list[int]] = {}
        budget = blocks_per_worker
        first = True
        while budget > system_blocks:
            p = 0 if first else rng.choices(range(system_prompts), weights)[0]
            first = False
            skeys = sys_keys[p]
            tail_n = min(budget - system_blocks, rng.randint(*tail_blocks))
            tail = _keys(rng, tail_n)
            sehs = held_sys.get(p)
            t0 = clock()
            if sehs is None:
                sehs = held_sys[p] = [k ^ 0x5A5A5A5A5A5A5A5A for k in skeys]
                ix.resolve_parent_key(stream, None)
                ix.store(stream, None, sehs, skeys)
                stored += system_blocks
                budget -= system_blocks
            parent = sehs[-1]
            i = 0
            while i < tail_n:
                n = min(tail_n - i, rng.randint(32, 512))
                ehs = [(k * 0x9E3779B97F4A7C15) & U64 for k in tail[i : i + n]]
                ix.resolve_parent_key(stream, parent)
                ix.store(stream, parent, ehs, tail[i : i + n])
                parent = ehs[-1]
                i += n
            busy_ns += clock() - t0
            stored += tail_n
            budget -= tail_n
            if keep_conversations:
                convs.append((wid, skeys + tail))
    return convs, sys_keys, stored, busy_ns / 1e9


def _queries(rng: random.Random, convs, sys_keys, n: int, prompt_blocks: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.6:  # continue one worker's conversation
            _, keys = rng.choice(convs)
            q = keys[:prompt_blocks]
        elif r < 0.9:  # new conversation under a popular system prompt
            q = list(rng.choice(sys_keys[:4]))
        else:  # nobody has it
            q = []
        if len(q) < prompt_blocks:
            q = q + _keys(rng, prompt_blocks - len(q))
        out.append(q)
    return out


def _bench_match(ix: PrefixIndex, queries: list[list[int]]) -> dict[str, float]:
    clock = time.perf_counter_ns
    for q in queries[:50]:  # warm-up
        ix.match(q).top(8)
    lat: list[int] = []
    lat_top: list[int] = []
    for q in queries:
        t0 = clock()
        res = ix.match(q)
        t1 = clock()
        res.top(8)
        t2 = clock()
        lat.append(t1 - t0)
        lat_top.append(t2 - t0)
    lat.sort()
    lat_top.sort()
    return {
        "p50_ms": round(percentile(lat, 50, presorted=True) / 1e6, 4),
        "p99_ms": round(percentile(lat, 99, presorted=True) / 1e6, 4),
        "top8_p50_ms": round(percentile(lat_top, 50, presorted=True) / 1e6, 4),
        "top8_p99_ms": round(percentile(lat_top, 99, presorted=True) / 1e6, 4),
    }


def _measure_bytes(workers: int, blocks_per_worker: int, seed: int) -> dict[str, Any]:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ix = PrefixIndex()
        build_realistic_index(
            ix, workers, random.Random(seed), blocks_per_worker=blocks_per_worker, keep_conversations=False
        )
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    entries = ix.entries
    return {
        "workers": workers,
        "entries": entries,
        "unique_blocks": len(ix._holders),
        "bytes_total": after - before,
        "bytes_per_entry": round((after - before) / max(1, entries), 1),
        "bytes_estimate_per_entry": round(ix._bytes_estimate() / max(1, entries), 1),
    }


def _bench_approx(seed: int, inserts: int, prompt_blocks: int) -> dict[str, float]:
    rng = random.Random(seed)
    ax = ApproxIndex(max_entries=2_000_000, default_ttl_s=120.0)
    sys_keys = [_keys(rng, 64) for _ in range(8)]
    prompts = [rng.choice(sys_keys) + _keys(rng, prompt_blocks - 64) for _ in range(inserts)]
    clock = time.perf_counter_ns
    t0 = clock()
    for i, p in enumerate(prompts):
        ax.insert(f"worker-{i % 64:05d}", p, now_s=i * 0.001)
    ins_s = (clock() - t0) / 1e9
    lat = []
    now = inserts * 0.001
    for p in prompts[: min(1000, inserts)]:
        t = clock()
        ax.match(p, now).top(8)
        lat.append(clock() - t)
    lat.sort()
    return {
        "inserts_per_s": round(inserts / ins_s),
        "insert_blocks_per_s": round(inserts * prompt_blocks / ins_s),
        "match_top8_p50_ms": round(percentile(lat, 50, presorted=True) / 1e6, 4),
        "match_top8_p99_ms": round(percentile(lat, 99, presorted=True) / 1e6, 4),
        "entries": ax.entries,
    }


def run_index_bench(
    workers: tuple[int, ...] = (8, 64, 512, 4096),
    *,
    blocks_per_worker: int = 16_384,
    max_total_entries: int = 1_000_000,
    queries: int = 2_000,
    prompt_blocks: int = 512,
    memory_workers: int = 64,
    approx_inserts: int = 5_000,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the benchmark; returns a JSON-ready dict (figures, config, targets, pass/fail)."""
    out: dict[str, Any] = {
        "config": {
            "workers": list(workers),
            "blocks_per_worker": blocks_per_worker,
            "max_total_entries": max_total_entries,
            "queries": queries,
            "prompt_blocks": prompt_blocks,
            "page_tokens": 16,
            "seed": seed,
        },
        "fleets": {},
    }
    stored_total = 0
    busy_total = 0.0
    for w in workers:
        bpw = max(256, min(blocks_per_worker, max_total_entries // w))
        rng = random.Random(seed + w)
        ix = PrefixIndex()
        gc.collect()
        gc.disable()  # the build allocates millions of ints; cyclic GC pauses are not index cost
        try:
            convs, sys_keys, stored, busy_s = build_realistic_index(ix, w, rng, blocks_per_worker=bpw)
        finally:
            gc.enable()
        stored_total += stored
        busy_total += busy_s
        qs = _queries(rng, convs, sys_keys, queries, prompt_blocks)
        m = _bench_match(ix, qs)
        # Removal: evict the history of 10% of conversations (leaf-first, like SGLang).
        victims = rng.sample(convs, max(1, len(convs) // 10))
        t0 = time.perf_counter_ns()
        removed = 0
        for wid, keys in victims:
            stream = (wid, 0)
            s = ix._streams[stream]
            tail_ehs = [e for e in ((k * 0x9E3779B97F4A7C15) & U64 for k in keys[64:]) if e in s.ehmap]
            removed += ix.remove(stream, tail_ehs)
        rm_s = (time.perf_counter_ns() - t0) / 1e9
        out["fleets"][str(w)] = {
            "blocks_per_worker": bpw,
            "entries": ix.entries + removed,
            "unique_blocks": len(ix._holders),
            "apply_blocks_per_s": round(stored / busy_s),
            "remove_blocks_per_s": round(removed / rm_s) if rm_s > 0 else None,
            "match": m,
        }
        del ix, convs, qs, victims
        gc.collect()
    out["apply_blocks_per_s"] = round(stored_total / busy_total)
    mem = _measure_bytes(memory_workers, min(blocks_per_worker, max_total_entries // memory_workers), seed)
    out["memory"] = mem
    out["bytes_per_entry"] = mem["bytes_per_entry"]
    out["approx"] = _bench_approx(seed, approx_inserts, prompt_blocks)
    fl = out["fleets"]
    checks: dict[str, bool] = {"apply": out["apply_blocks_per_s"] >= TARGETS["apply_blocks_per_s_min"]}
    if "64" in fl:
        checks["match_p50_at_64"] = fl["64"]["match"]["p50_ms"] <= TARGETS["match_p50_ms_at_64_max"]
        if "4096" in fl:
            ratio = fl["4096"]["match"]["p99_ms"] / max(1e-9, fl["64"]["match"]["p99_ms"])
            out["match_p99_ratio_4096_vs_64"] = round(ratio, 2)
            checks["match_p99_flat"] = ratio <= TARGETS["match_p99_ratio_4096_vs_64_max"]
    checks["bytes_per_entry"] = out["bytes_per_entry"] <= TARGETS["bytes_per_entry_max"]
    out["targets"] = TARGETS
    out["pass"] = checks
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mesh.lab.bench.index_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run, seconds)")
    ap.add_argument("--workers", type=int, nargs="+", default=None)
    ap.add_argument("--queries", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    kw: dict[str, Any] = {"seed": a.seed}
    if a.quick:
        kw.update(
            workers=(8, 64), blocks_per_worker=2048, max_total_entries=100_000, queries=300,
            memory_workers=16, approx_inserts=500,
        )
    if a.workers:
        kw["workers"] = tuple(a.workers)
    if a.queries:
        kw["queries"] = a.queries
    print(json.dumps(run_index_bench(**kw), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
