"""End to end: a real broker, a 2-rank stub-sglang (one KV cache, event stream and LoadStat
stream per rank) attached with ``mesh attach sglang``. A prefix warmed directly on rank 1 (bypassing
the mesh) pulls its follow-ups to rank 1: the broker routes to (worker, rank), the REQUEST carries
``dp_rank``, the adapter passes it as SGLang's ``routed_dp_rank`` and the engine serves it there
with the prefix cached. Without the rank the stub's own DP controller alternates between its idle
ranks, so at least one follow-up would land on the cold rank 0.
"""

from __future__ import annotations

import random

import aiohttp

from mesh.client import Client
from mesh.lab.up import wait_for_workers
from tests.adapters_support import start_adapter, start_stub
from tests.conftest import run, until

FAST_ADAPTER = ["--heartbeat-ms", "200", "--health-interval-ms", "100", "--load-poll-ms", "200"]


async def _stats(http: aiohttp.ClientSession, url: str) -> list[dict]:
    async with http.get(url + "/debug/stats") as r:
        return (await r.json())["ranks"]


def test_the_follow_up_lands_on_the_rank_holding_the_prefix(procs):
    b = procs.broker("b", "--heartbeat-ms", "200", "--policy", "cache_aware")
    _, stub = start_stub(procs, "stub", "--dp-size", "2", "--time-scale", "0.05")
    start_adapter(procs, "w", "sglang", stub["url"], [b.backend], *FAST_ADAPTER)
    run(wait_for_workers(b.frontend, 1))
    rng = random.Random(3)
    prefix = [rng.randrange(1, 30_000) for _ in range(1024)]

    async def go():
        async with Client(b.frontend) as c, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            w = (await c.status()).workers[0]
            assert w["worker_id"] == "w"
            # warm rank 1 directly, then wait until the broker indexed its events
            n0 = (await c.status()).counters.get("kv.batches", 0)
            async with http.post(stub["url"] + "/generate", json={"input_ids": prefix, "routed_dp_rank": 1,
                                                                  "sampling_params": {"max_new_tokens": 1}}) as r:
                assert r.status == 200 and (await r.json())["meta_info"]["dp_rank"] == 1

            async def indexed():
                return (await c.status()).counters.get("kv.batches", 0) > n0
            await until(indexed, 10, "rank 1's events at the broker", step_s=0.05)
            before = await _stats(http, stub["url"])
            for i in range(3):
                r = await c.generate(input_ids=prefix + [rng.randrange(1, 30_000) for _ in range(16)], max_new_tokens=2)
                assert r.worker == "w" and r.usage["cached_tokens"] >= 1008, (i, r.usage, r.reason)
            after = await _stats(http, stub["url"])
            assert after[1]["requests"] - before[1]["requests"] == 3, (before, after)
            assert after[0]["requests"] == before[0]["requests"]
            async with http.get(stub["url"] + "/debug/requests") as resp:
                bodies = [x["body"] for x in await resp.json() if x["path"] == "/generate"][-3:]
            assert [x.get("routed_dp_rank") for x in bodies] == [1, 1, 1]
            counters = (await c.status()).counters
            assert counters.get("decisions.dp_rank_prefix", 0) == 3, counters
            # a prompt nobody holds goes to the least loaded rank, and is counted so
            r = await c.generate(input_ids=[rng.randrange(1, 30_000) for _ in range(64)], max_new_tokens=2)
            assert r.usage["cached_tokens"] == 0
            assert (await c.status()).counters.get("decisions.dp_rank_least_loaded", 0) == 1

    run(go(), 60)
