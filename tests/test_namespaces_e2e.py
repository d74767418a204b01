"""End to end: cache namespaces with a real broker and real simulated workers (their KV events
carry lora_name / cache_salt as SGLang's do).

A plain prompt is cached on one worker; the same prompt with a ``cache_salt`` or a ``lora_path``
is not a cache hit anywhere (decision reason, engine cached tokens), while a second request of the
same namespace is a hit on the worker that computed the first one.
"""

from __future__ import annotations

import random

from mesh.client import Client
from mesh.lab.up import wait_for_workers
from tests.conftest import run, until

PROMPT = [random.Random(11).randrange(1, 30_000) for _ in range(512)]


def test_salted_and_lora_requests_do_not_hit_plain_blocks(procs):
    b = procs.broker("b", "--policy", "cache_aware_greedy", "--seed", "1", "--heartbeat-ms", "200")
    procs.workers("w", [b.backend], "--time-scale", "0.05", count=2)
    run(wait_for_workers(b.frontend, 2))

    async def body():
        async with Client(b.frontend) as c:
            async def gen(params=None, tail=0):
                return await c.generate(input_ids=PROMPT + [tail + 1] * 4, max_new_tokens=2, params=params or {},
                                        deadline_ms=20_000)

            first = await gen()
            holder = first.worker

            # readiness: the plain prefix is known to the broker (a hit on its holder, with the
            # engine reporting the cached prefix, i.e. the KV events arrived)
            async def plain_hit():
                r = await gen(tail=1)
                return r if r.reason == "cache_hit" and r.usage["cached_tokens"] >= 496 else None
            hit = await until(plain_hit, 10, "plain prefix indexed", step_s=0.05)
            assert hit.worker == holder

            for params in ({"cache_salt": "tenant-a"}, {"lora_path": "sql-adapter"},
                           {"lora_path": "sql-adapter", "cache_salt": "tenant-a"}):
                r1 = await gen(params, tail=2)
                # not a hit on the plain blocks (before namespaces: cache_hit on the holder)
                assert r1.reason != "cache_hit" and r1.usage["cached_tokens"] == 0, (params, r1.reason, r1.usage)
                # the same namespace again: a hit where the first one was computed
                r2 = await gen(params, tail=3)
                assert r2.reason == "cache_hit" and r2.worker == r1.worker, (params, r1.worker, r2.worker, r2.reason)
                assert r2.usage["cached_tokens"] >= 496, (params, r2.usage)
            # and the plain namespace is untouched by all that
            r = await gen(tail=4)
            assert r.reason == "cache_hit" and r.worker == holder and r.usage["cached_tokens"] >= 496

    run(body(), timeout_s=40)
