"""End to end: cache_aware's stall escape over a real broker and real simulated worker processes.

A worker holds a short prefix and is then given a 40k-token prefill (a long conversation turn
that hits its 64k context). A request for the short prefix must not wait behind that prefill:
the broker sends it to the idle worker and counts the decision as ``stall_escape``. With
``--stall-escape-ms 0`` the same request waits at its holder (the old behaviour), which is what
makes the first assertion mean something.
"""

from __future__ import annotations

import random

import pytest

from mesh.client import Client
from mesh.lab.up import wait_for_workers
from tests.conftest import run

# 20k prefill tokens/s: the 40k-token suffix keeps its holder busy for 2 s, past the 1 s floor,
# while recomputing the 4k-token prefix elsewhere takes 0.2 s.
ENGINE = ["--prefill-tokens-per-s", "20000", "--heartbeat-ms", "200"]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 30_000) for _ in range(n)]


@pytest.mark.parametrize("escape", [True, pytest.param(False, marks=pytest.mark.soak)], ids=["escape_on", "escape_off"])  # the control in make soak
def test_a_request_does_not_wait_behind_another_sessions_long_prefill(procs, escape):
    extra = [] if escape else ["--stall-escape-ms", "0"]
    b = procs.broker("b", "--heartbeat-ms", "200", "--policy", "cache_aware", *extra)
    procs.workers("w", [b.backend], *ENGINE, count=2)
    run(wait_for_workers(b.frontend, 2))
    rng = random.Random(7)
    short = _ids(rng, 4096)

    async def body():
        async with Client(b.frontend) as c:
            # a context that grows on one worker: every turn holds at least half of the next
            ctx = list(short)
            first = await c.generate(input_ids=ctx + _ids(rng, 16), max_new_tokens=1, deadline_ms=30_000)
            holder = first.worker
            for n in (4096, 8192, 16_384, 32_768):
                ctx += _ids(rng, n)
                r = await c.generate(input_ids=ctx, max_new_tokens=1, deadline_ms=30_000)
                assert r.worker == holder  # a hit of at least half the prompt stays with its holder
            # the long turn: 40k new tokens on top of the 64k the holder has (2 s of prefill), and
            # right behind it, on the same connection (the broker reads one connection in order and
            # routes each request as it reads it), the follow-up: it is routed while all of the long
            # turn's prefill is still ahead, however slow the machine. (Sent after a STATUS poll saw
            # the long turn routed, it lost the race to that prefill beside two CPU burners.)
            long_turn = await c.submit(input_ids=ctx + _ids(rng, 40_000), max_new_tokens=1, deadline_ms=30_000)
            follow = await c.generate(input_ids=short + _ids(rng, 32), max_new_tokens=1, deadline_ms=30_000)
            done_long = await long_turn.result()
            counters = (await c.status()).counters
        return holder, done_long.worker, follow.worker, counters

    holder, long_worker, follow_worker, counters = run(body(), timeout_s=120)
    assert long_worker == holder
    if escape:
        assert follow_worker != holder, counters
        assert counters.get("decisions.stall_escape", 0) == 1, counters
    else:
        assert follow_worker == holder, counters
        assert counters.get("decisions.stall_escape", 0) == 0, counters
