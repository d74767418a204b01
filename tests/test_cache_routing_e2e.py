"""End to end: cache-aware routing with a real broker, real simulated workers and their KV events.

Three arms on the identical seeded shared-prefix workload (skewed group popularity), one after
the other in the same test: power_of_two, cache_aware_greedy (SGLang's threshold policy) and
cache_aware (mesh's policy). cache_aware must find clearly more cached tokens than
power_of_two and at least 0.9x cache_aware_greedy's. About 19 s, a quality measurement rather
than a correctness check, so it runs behind the ``bench`` marker (``make test-bench``); the
quality matrix (``mesh sim --matrix``) measures the same thing on many more cells.
"""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest

from mesh.client import Client
from mesh.lab.up import wait_for_workers
from tests.conftest import run

WORKERS = 4
GROUPS = 16
KV_TOKENS = 32_768  # per worker: room for about a third of the system prompts
REQUESTS = 160

pytestmark = pytest.mark.bench
RATE = 40.0


def _workload(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30_000) for _ in range(2048)] for _ in range(GROUPS)]
    # Zipf popularity: a few hot system prompts (the pile-up trap for greedy affinity) and a tail
    # that does not fit in every worker's KV at once (so load-only routing thrashes the caches).
    weights = [1.0 / (k + 1) ** 1.5 for k in range(GROUPS)]
    out = []
    for _ in range(REQUESTS):
        g = rng.choices(range(GROUPS), weights)[0]
        out.append(systems[g] + [rng.randrange(1, 30_000) for _ in range(256)])
    return out


async def _drive(frontend: str, prompts: list[list[int]]) -> tuple[float, float, int]:
    """Open-loop Poisson load; returns (token hit rate, CV of requests per worker, errors)."""
    rng = random.Random(1)
    per_worker: dict[str, int] = {}
    cached = prompt = errors = 0
    async with Client(frontend) as c:
        async def one(p):
            nonlocal cached, prompt, errors
            try:
                r = await c.generate(input_ids=p, max_new_tokens=16, deadline_ms=30_000)
            except Exception:
                errors += 1
                return
            per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
            cached += r.usage["cached_tokens"]
            prompt += r.usage["prompt_tokens"]
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(one(p)))
            await asyncio.sleep(rng.expovariate(RATE))  # pacing: Poisson arrivals at RATE
        await asyncio.gather(*tasks)
    counts = [per_worker.get(f"w-{i}", 0) for i in range(WORKERS)]
    cv = statistics.pstdev(counts) / statistics.mean(counts)
    return cached / prompt, cv, errors


def _arm(procs, policy: str, prompts) -> tuple[float, float, int]:
    b = procs.broker(f"b-{policy}", "--policy", policy, "--seed", "3")
    # time-scale 3: GPUs three times slower than an H100, so 40 req/s is real load
    w = procs.workers("w", [b.backend], "--time-scale", "3", "--max-total-num-tokens", str(KV_TOKENS), count=WORKERS)
    run(wait_for_workers(b.frontend, WORKERS))
    res = run(_drive(b.frontend, prompts), timeout_s=120)
    w.stop()
    b.stop()
    return res


def test_cache_aware_beats_p2_on_hits_and_keeps_greedys(procs):
    prompts = _workload()
    p2_hit, p2_cv, e1 = _arm(procs, "power_of_two", prompts)
    gr_hit, gr_cv, e2 = _arm(procs, "cache_aware_greedy", prompts)
    ca_hit, ca_cv, e3 = _arm(procs, "cache_aware", prompts)
    print(f"\npower_of_two hit={p2_hit:.3f} cv={p2_cv:.3f}; greedy hit={gr_hit:.3f} cv={gr_cv:.3f}; "
          f"cache_aware hit={ca_hit:.3f} cv={ca_cv:.3f}")
    assert e1 == e2 == e3 == 0
    # clearly more cache hits than load-only routing (seen: +0.06..+0.13 on this workload) ...
    assert ca_hit > p2_hit + 0.04, (ca_hit, p2_hit)
    # ... and at least 0.9x greedy's (issue 15's hit-rate target, met in every matrix cell). A
    # lower worker CV than greedy's is no longer claimed: sticking to cache holders within
    # SGLang's imbalance bound is what won the quality matrix (README, simulator section).
    assert ca_hit >= 0.9 * gr_hit, (ca_hit, gr_hit)
