"""The broker's timer bookkeeping, driven in process through its handlers (sockets faked at _send)."""

from __future__ import annotations

import asyncio
import time

from brokers.main import build_broker
from mesh import protocol as P
from mesh.config import BrokerSettings, build


def _broker_with_workers(n: int):
    b = build_broker(build(BrokerSettings, {"policy": "power_of_two", "default_deadline_ms": 60_000}))
    sent: list[tuple[str, bytes, list[bytes]]] = []
    b._send = lambda sock, path, ident, frames: sent.append((path, ident, frames)) or True  # type: ignore[method-assign]
    b._fs = b._bs = None  # never bound: _send above stands in for both sockets
    for i in range(n):
        b._on_ready(f"id{i}".encode(), P.Ready(f"w{i}", "m", "mixed", {}, 16, 256, 400_000, 1, 1, 500))
        b._confirm(b.registry.by_id[f"w{i}"], time.monotonic())  # as its first heartbeat would
    b._state = "serving"
    return b, sent


def test_finished_requests_do_not_keep_the_deadline_timer_busy():
    """Deadlines of finished requests stay in the heap (lazy deletion); arming the timer must skip
    them, or a busy broker would wake once per finished request when their deadlines come due."""

    async def body():
        b, sent = _broker_with_workers(4)
        b._aloop = asyncio.get_running_loop()
        client = b"\x00client-1"
        for i in range(200):
            sent.clear()
            b._on_client_frames([client, *P.encode_submit(f"r{i}", input_ids=[1, 2, 3], params={"max_new_tokens": 1},
                                                          stream=False, deadline_ms=1_000)])
            inf = b._inflight[max(b._inflight)]
            fin = P.encode_worker_final(inf.rid, inf.attempt, "length", {"prompt_tokens": 3, "completion_tokens": 1,
                                                                         "cached_tokens": 0}, {"token_ids": [1]})
            b._on_worker_frames([inf.session.identity, *fin])
        assert not b._inflight and len(b._deadlines) == 200  # all finished, all still in the heap
        # one live request, with a long deadline
        b._on_client_frames([client, *P.encode_submit("live", input_ids=[1], params={"max_new_tokens": 1},
                                                      stream=False, deadline_ms=50_000)])
        now = time.monotonic()
        b._arm_timer(now)
        assert len(b._deadlines) == 1  # the finished requests' entries were dropped from the top
        # the timer waits for the next heartbeat slice / sweep, not for a dead request's deadline
        assert b._timer_at >= min(b._next_hb, b._next_sweep) - 1e-6
        b._timer.cancel()

    asyncio.run(asyncio.wait_for(body(), 10))
