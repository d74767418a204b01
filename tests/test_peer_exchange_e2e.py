"""The peer exchange between real broker processes.

Broker A publishes (``--exchange``), broker B subscribes to it (``--exchange`` + ``--peer A``); two
simulated workers serve both. Requests through A show up in B's STATUS view of their workers
(``peer_inflight``) while they run and leave it when they finish. After A is SIGKILLed, B marks it
stale (metric, STATUS), drops its figures and routes on its own view, and its own requests are
unaffected. Waits are readiness polls on STATUS, never sleeps.
"""

from __future__ import annotations

import asyncio
import signal
import time

import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.client import Client
from mesh.procs import wait_for_log_event
from mesh.up import wait_for_workers
from tests.conftest import run, until

FAST = ["--heartbeat-ms", "200", "--exchange-stale-ms", "600"]
N_LONG = 6


async def _status(endpoint: str):
    async with Client(endpoint) as c:
        return await c.status()


async def _inflight_by_worker(endpoint: str, key: str) -> dict[str, int]:
    st = await _status(endpoint)
    return {w["worker_id"]: w.get(key, 0) for w in st.workers}


async def _submit_raw(endpoint: str, n: int, max_new_tokens: int) -> zmq.asyncio.Socket:
    """Streamed requests through a raw DEALER; returns once every one was dispatched (ACCEPTED)."""
    s = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    for i in range(n):
        await s.send_multipart(P.encode_submit(f"long-{i}", input_ids=list(range(1 + 97 * i, 400 + 97 * i)),
                                               params={"max_new_tokens": max_new_tokens}, stream=True, deadline_ms=60_000))
    accepted = 0
    while accepted < n:
        m = P.decode_client_reply(await asyncio.wait_for(s.recv_multipart(), 10.0))
        if isinstance(m, P.Accepted):
            accepted += 1
        assert not isinstance(m, P.ClientError), m
    return s


def test_two_brokers_see_each_others_work_and_fall_back_when_a_peer_dies(procs):
    a = procs.broker("a", *FAST, "--exchange", "tcp://127.0.0.1:*")
    ex_a = wait_for_log_event(a.log_path, "broker_listening", 5.0, start=a.log_start)["exchange"]
    assert ex_a.startswith("tcp://127.0.0.1:") and not ex_a.endswith("*")
    b = procs.broker("b", *FAST, "--exchange", "tcp://127.0.0.1:*", "--peer", ex_a)
    procs.workers("w", [a.backend, b.backend], count=2)

    async def body():
        await wait_for_workers(a.frontend, 2)
        await wait_for_workers(b.frontend, 2)
        # A's first full snapshot reaches B: the peer is fresh, B is not degraded
        st = await until(lambda: _fresh(b.frontend), 10.0, "A fresh at B")
        assert st["expected"] == 1 and not st["degraded"]

        # long requests through A: B's view of each worker shows exactly what A has there
        sock = await _submit_raw(a.frontend, N_LONG, max_new_tokens=400)
        try:
            async def views_agree():
                own = await _inflight_by_worker(a.frontend, "inflight")
                seen = await _inflight_by_worker(b.frontend, "peer_inflight")
                return own if sum(own.values()) == N_LONG and seen == own else None

            own = await until(views_agree, 10.0, "B's peer_inflight == A's inflight")
            assert sum(own.values()) == N_LONG
            b_own = await _inflight_by_worker(b.frontend, "inflight")
            assert sum(b_own.values()) == 0  # B itself has nothing there: it is A's work it sees
            st_b = await _status(b.frontend)
            assert st_b.counters.get("exchange.applied", 0) > 0

            # they finish: B's view empties again
            async def drained():
                seen = await _inflight_by_worker(b.frontend, "peer_inflight")
                return sum(seen.values()) == 0

            await until(drained, 20.0, "B's peer_inflight back to 0")

            # more work through A, then A dies (SIGKILL: no goodbye) while it runs
            sock2 = await _submit_raw(a.frontend, N_LONG, max_new_tokens=2000)
            try:
                await until(lambda: _peer_total(b.frontend, N_LONG), 10.0, "B sees A's second batch")
                a.signal(signal.SIGKILL)
                t_kill = time.monotonic()

                async def stale():
                    st = (await _status(b.frontend)).broker["exchange"]
                    return st if st["degraded"] and st["stale"] == 1 and st["fresh"] == 0 else None

                await until(stale, 5.0, "B marks A stale")
                assert time.monotonic() - t_kill < 3.0  # 600 ms bound, plus the STATUS polling
                assert await _peer_total(b.frontend, 0)  # A's figures dropped: B's own view
                c = (await _status(b.frontend)).counters
                assert c.get("exchange.expired", 0) == 1
            finally:
                sock2.close(linger=0)
        finally:
            sock.close(linger=0)

        # B serves its own requests as before, and says they were routed on its own view
        async with Client(b.frontend) as cl:
            res = await asyncio.gather(*(cl.generate(input_ids=[5, 6, 7, i], max_new_tokens=4, deadline_ms=10_000)
                                         for i in range(8)))
        assert all(r.finish_reason for r in res)
        c = (await _status(b.frontend)).counters
        assert c.get("exchange.decisions_peer_stale", 0) >= 8

    run(body(), 60.0)


async def _fresh(endpoint: str):
    st = (await _status(endpoint)).broker.get("exchange")
    return st if st and st["fresh"] == 1 else None


async def _peer_total(endpoint: str, n: int) -> bool:
    return sum((await _inflight_by_worker(endpoint, "peer_inflight")).values()) == n
