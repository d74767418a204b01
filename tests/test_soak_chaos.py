"""Soak / chaos run (``make soak``; excluded from ``make test``): SIGKILL a random worker every
few seconds under steady load for a minute, restart it, and check that every request ended with
exactly one outcome, successes had full outputs, and nothing hung past its deadline."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import pytest

from mesh.client import Client
from mesh.errors import RequestError
from mesh.lab.up import wait_for_workers
from tests.conftest import run

pytestmark = pytest.mark.soak


def test_chaos_kill_workers_under_load(procs):
    b = procs.broker("b", "--heartbeat-ms", "200", "--retry-budget-min", "20")
    workers = {i: procs.workers(f"w{i}", [b.backend], "--heartbeat-ms", "200", count=1) for i in range(5)}
    run(wait_for_workers(b.frontend, 5))
    rng = random.Random(11)

    async def body():
        outcomes: dict[int, str] = {}
        stop = asyncio.Event()

        async def client_load():
            async with Client(b.frontend) as c:
                async def one(i):
                    t0 = time.monotonic()
                    try:
                        r = await c.generate(input_ids=[i % 13 + 1] * 128 + [i], max_new_tokens=16, deadline_ms=15_000)
                        assert len(r.token_ids) == 16
                        outcomes[i] = "ok"
                    except RequestError as e:
                        outcomes[i] = e.code.value
                    assert time.monotonic() - t0 < 15 + 3  # nothing hangs past its deadline
                tasks, i = [], 0
                while not stop.is_set():
                    tasks.append(asyncio.create_task(one(i)))
                    i += 1
                    await asyncio.sleep(rng.expovariate(40))  # pacing: Poisson arrivals, 40/s
                await asyncio.gather(*tasks)
                return i

        load = asyncio.create_task(client_load())
        t_end = time.monotonic() + 60
        while time.monotonic() < t_end:
            await asyncio.sleep(3)  # the fault schedule: one worker SIGKILLed every 3 s
            k = rng.randrange(5)
            workers[k].signal(signal.SIGKILL)
            procs.procs.remove(workers[k])
            workers[k] = await asyncio.to_thread(procs.workers, f"w{k}", [b.backend], "--heartbeat-ms", "200", count=1)
        stop.set()
        sent = await load
        return sent, outcomes

    sent, outcomes = run(body(), timeout_s=180)
    assert len(outcomes) == sent  # exactly one outcome per request
    bad = {k: v for k, v in outcomes.items() if v not in ("ok", "worker_lost")}
    assert not bad, bad
    assert sum(1 for v in outcomes.values() if v == "ok") > 0.9 * sent
