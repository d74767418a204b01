"""The client resubmits a request that ended ``worker_lost`` before any output reached it.

A broker with ``--max-attempts 1`` cannot re-dispatch a request whose worker dies: it answers
``worker_lost``. When no CHUNK was streamed the request did not run for the client, so
``Client.generate`` (idempotent by default) submits it again and it succeeds on another worker.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from mesh.client import Client
from mesh.errors import RetryableError
from mesh.lab.up import wait_for_workers
from tests.conftest import run, until

FAST = ["--heartbeat-ms", "200"]
# the victim's first prefill step takes a minute: it holds the request and streams nothing
SLOW = ["--heartbeat-ms", "200", "--prefill-overhead-ms", "60000"]


async def _held_by(c: Client, worker_id: str) -> bool:
    return any(w["worker_id"] == worker_id and w.get("inflight") for w in (await c.status()).workers)


def _victim_then_survivor(procs):
    b = procs.broker("b", *FAST, "--max-attempts", "1")
    victim = procs.workers("victim", [b.backend], *SLOW)
    run(wait_for_workers(b.frontend, 1))
    return b, victim


@pytest.mark.parametrize("stream", [True, False])
def test_worker_lost_without_output_is_resubmitted(procs, stream):
    b, victim = _victim_then_survivor(procs)

    async def body():
        async with Client(b.frontend) as c:
            job = asyncio.create_task(c.generate(input_ids=[5] * 48, max_new_tokens=4, stream=stream, deadline_ms=20_000))
            await until(lambda: _held_by(c, "victim"), 10, "the victim holds the request")
            # only now a second worker: the request cannot have gone there first
            await asyncio.to_thread(procs.workers, "survivor", [b.backend], *FAST)
            await wait_for_workers(b.frontend, 2)
            victim.signal(signal.SIGKILL)
            res = await asyncio.wait_for(job, 20)
            counters = (await c.status()).counters
            return res, counters

    res, counters = run(body(), timeout_s=60)
    assert res.worker == "survivor" and res.token_ids and res.finish_reason, res
    # the broker did answer worker_lost (one attempt only), and the resubmission ran on the survivor
    assert counters.get("requests.worker_lost") == 1 and counters.get("requests.ok") == 1, counters


def test_worker_lost_is_not_resubmitted_when_not_idempotent(procs):
    b, victim = _victim_then_survivor(procs)

    async def body():
        async with Client(b.frontend) as c:
            job = asyncio.create_task(c.generate(input_ids=[6] * 48, max_new_tokens=4, idempotent=False, deadline_ms=20_000))
            await until(lambda: _held_by(c, "victim"), 10, "the victim holds the request")
            victim.signal(signal.SIGKILL)
            with pytest.raises(RetryableError) as ei:
                await asyncio.wait_for(job, 20)
            return ei.value

    err = run(body(), timeout_s=60)
    assert err.code.value == "worker_lost"
