"""A configured peer floods a real broker's exchange with valid maximum-size messages (4,096 workers,
about 1.1 MB each, 20 a second) while a client sends requests: the broker's per-peer byte budget
drops the excess before decoding, and requests keep their latency. Outcomes are asserted (every
request served, the excess counted); the p50 ratio is printed (target <= 2x, a benchmark figure)."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import pytest
import zmq

from mesh import protocol as P
from mesh.client import Client
from mesh.lab.up import wait_for_workers
from tests.conftest import run


async def _latencies(frontend: str, n: int) -> list[float]:
    out = []
    async with Client(frontend) as c:
        for i in range(n):
            t0 = time.monotonic()
            await c.generate(input_ids=[i + 1, 2, 3, 4], max_new_tokens=4, deadline_ms=20_000)
            out.append(time.monotonic() - t0)
    return out


@pytest.mark.soak
def test_a_peers_flood_of_maximum_size_messages_leaves_request_latency(procs):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        b = procs.broker("b", "--exchange", "tcp://127.0.0.1:*", "--peer", f"tcp://127.0.0.1:{port}")
        procs.workers("w", [b.backend], "--count", "2", "--time-scale", "0.01")
        run(wait_for_workers(b.frontend, 2), 30)
        big = [(f"worker-{i:04d}-" + "x" * 200, 1, 100, 1000) for i in range(P.MAX_EXCHANGE_WORKERS)]
        frames = [P.encode_peer_load(P.PeerLoad("flooder", 1, seq, True, big, 200)) for seq in range(2)]
        stop = threading.Event()

        def flood() -> None:
            seq = 0
            while not stop.is_set():
                pub.send_multipart(frames[seq % 2])
                seq += 1
                time.sleep(0.05)  # 20 a second

        base = run(_latencies(b.frontend, 40), 60)
        t = threading.Thread(target=flood, daemon=True)
        t.start()
        time.sleep(2.0)
        under = run(_latencies(b.frontend, 40), 120)
        stop.set()
        t.join(5)

        async def counters():
            async with Client(b.frontend) as c:
                return (await c.status()).counters
        c = run(counters(), 20)
    finally:
        pub.close(0)
        ctx.term()
    p50_base, p50_under = statistics.median(base), statistics.median(under)
    print(f"\nrequest p50 {p50_base * 1000:.1f} ms alone, {p50_under * 1000:.1f} ms beside the flood "
          f"({p50_under / p50_base:.2f}x); exchange counters {({k: v for k, v in c.items() if k.startswith('exchange')})}")
    assert len(under) == 40
    assert any(k.startswith("exchange") and "dropped" in k and v > 0 for k, v in c.items()), c
