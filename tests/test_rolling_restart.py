"""Lifecycle: rolling restarts of workers and of brokers under steady load fail no request."""

from __future__ import annotations

import asyncio
import random

import pytest

from mesh.client import Client
from mesh.lab.up import wait_for_workers
from tests.conftest import run, until

FAST = ["--heartbeat-ms", "200"]


def _two_brokers_slow_workers(procs):
    """Two brokers and two workers serving both, decoding at 50 ms per step (requests stay in
    flight long enough to kill or drain a broker under them)."""
    b1 = procs.broker("b1", *FAST)
    b2 = procs.broker("b2", *FAST)
    procs.workers("w", [b1.backend, b2.backend], "--heartbeat-ms", "200", "--decode-base-ms", "50", count=2)
    run(wait_for_workers(b1.frontend, 2))
    run(wait_for_workers(b2.frontend, 2))
    return b1, b2


async def _steady_load(frontends: list[str], stop: asyncio.Event, rate: float = 25.0, min_requests: int = 40) -> tuple[int, list[str]]:
    """Submit at ``rate`` until ``stop`` is set and at least ``min_requests`` went out (a fast
    restart must not leave the test with too few requests to mean anything)."""
    rng = random.Random(3)
    ok, errors = 0, []
    async with Client(frontends) as c:
        async def one(i: int):
            nonlocal ok
            try:
                await c.generate(input_ids=[i % 7 + 1] * 64 + [i], max_new_tokens=8, deadline_ms=20_000)
                ok += 1
            except Exception as exc:  # every failure is reported, the test asserts there is none
                errors.append(repr(exc))
        tasks, i = [], 0
        while not stop.is_set() or i < min_requests:
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))  # pacing: Poisson arrivals at `rate`
        await asyncio.gather(*tasks)
    return ok, errors


@pytest.mark.soak  # chaos/flood run: make soak
def test_rolling_worker_restart_fails_nothing(procs):
    b = procs.broker("b", *FAST)
    with procs.together():
        ws = [procs.workers(f"w{i}", [b.backend], "--heartbeat-ms", "200", count=1) for i in range(3)]
    run(wait_for_workers(b.frontend, 3))

    async def body():
        stop = asyncio.Event()
        load = asyncio.create_task(_steady_load([b.frontend], stop))
        for i, w in enumerate(ws):
            await asyncio.to_thread(w.stop, 20)  # SIGTERM: drain, finish in-flight, leave
            procs.procs.remove(w)
            await asyncio.to_thread(procs.workers, f"w{i}", [b.backend], "--heartbeat-ms", "200", count=1)
            await wait_for_workers(b.frontend, 3)
        stop.set()
        return await load

    ok, errors = run(body(), timeout_s=120)
    assert errors == [] and ok > 30


@pytest.mark.soak  # chaos/flood run: make soak
def test_rolling_broker_restart_fails_nothing(procs):
    b1 = procs.broker("b1", *FAST)
    b2 = procs.broker("b2", *FAST)
    procs.workers("w", [b1.backend, b2.backend], "--heartbeat-ms", "200", count=3)
    run(wait_for_workers(b1.frontend, 3))
    run(wait_for_workers(b2.frontend, 3))

    async def body():
        stop = asyncio.Event()
        load = asyncio.create_task(_steady_load([b1.frontend, b2.frontend], stop))
        for old in (b1, b2):
            await asyncio.to_thread(old.stop, 20)  # SIGTERM: drain, then exit
            procs.procs.remove(old)
            new = await asyncio.to_thread(procs.broker, old.name, *FAST, frontend=old.frontend, backend=old.backend)
            await wait_for_workers(new.frontend, 3)
        stop.set()
        return await load

    ok, errors = run(body(), timeout_s=120)
    assert errors == [] and ok > 30


def test_broker_killed_holding_requests_client_resubmits_elsewhere(procs):
    """SIGKILL a broker while it holds requests: the client sees its connection drop and
    resubmits those requests to the other broker at once, instead of waiting for deadlines."""
    import signal
    import time

    b1, b2 = _two_brokers_slow_workers(procs)  # 40 tokens at 50 ms: about two seconds in flight

    async def body():
        async with Client([b1.frontend, b2.frontend]) as c:
            await c.status()  # both links up before the requests are spread over them
            await until(lambda: all(link.up for link in c.links), 10, "both links up")
            t0 = time.monotonic()
            tasks = [asyncio.create_task(c.generate(input_ids=[i + 1] * 32, max_new_tokens=40, deadline_ms=30_000))
                     for i in range(8)]
            await until(lambda: c.links[0].pending, 10, "requests pending on b1")
            # readiness signal: b1 reports requests in flight (dispatched, being decoded)
            async with Client(b1.frontend) as probe:
                async def b1_busy() -> bool:
                    return (await probe.status()).broker.get("inflight", 0) >= 1

                await until(b1_busy, 10, "b1 decoding")
            b1.signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            elapsed = time.monotonic() - t0
            return results, elapsed, c.lost_requests

    results, elapsed, lost = run(body(), timeout_s=60)
    assert all(r.finish_reason == "length" for r in results)
    assert lost >= 1  # b1 held some of them when it died
    assert elapsed < 15, elapsed  # resubmitted on the drop, not after the 30 s deadline


def test_resubmission_after_a_draining_refusal_waits_for_the_other_broker(procs):
    """The rolling-restart race: one broker is down (restarting, its client link not yet
    reconnected) while the other drains. A request refused by the draining broker must not be
    resubmitted to it until the attempts run out; it waits for the restarted broker instead."""
    import signal

    b1, b2 = _two_brokers_slow_workers(procs)

    async def body():
        async with Client([b1.frontend, b2.frontend]) as c:
            await until(lambda: all(link.up for link in c.links), what="both links up")
            await asyncio.to_thread(b1.stop, 20)
            procs.procs.remove(b1)
            await until(lambda: not c.links[0].up, what="the client saw b1 go")
            # b2 holds a long stream (60 x 50 ms), so after SIGTERM it stays draining for seconds
            long = await c.submit(input_ids=[3] * 32, max_new_tokens=60, deadline_ms=30_000)
            await until(lambda: long.first_token_s, what="the long stream's first token")
            b2.signal(signal.SIGTERM)
            async with Client(b2.frontend) as probe:
                async def b2_draining() -> bool:
                    return (await probe.status()).broker.get("state") == "draining"

                async def b2_refused() -> bool:
                    return (await probe.status()).counters.get("requests.unavailable", 0) >= 1

                await until(b2_draining, what="b2 draining")
                job = asyncio.create_task(c.generate(input_ids=[4] * 32, max_new_tokens=4, deadline_ms=30_000))
                await until(b2_refused, what="b2 refused the request (broker is draining)")
            # only now does b1 come back; the client reconnects on its own schedule
            await asyncio.to_thread(procs.broker, "b1", *FAST, frontend=b1.frontend, backend=b1.backend)
            r = await asyncio.wait_for(job, 25)
            assert r.finish_reason == "length" and len(r.token_ids) == 4
            assert (await long.result()).finish_reason == "length"  # the drain finished it

    run(body(), timeout_s=60)
