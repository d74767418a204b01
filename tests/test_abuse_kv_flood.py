"""A neighbour's KV flood against a real broker process (issue 32).

One registered raw DEALER sends KV batches as fast as the broker takes them, cycling through the
attack's oversize batch (73,728 blocks in 3.9 MB, refused at decode), one just over the block
cap (unpacked, then refused) and the largest accepted one (8,192 blocks: index work), while a normal worker serves and a client sends a request every
50 ms. Before the fix the broker refused 44-47 % of the client's requests as ``overloaded``
(46 % here, 49 of 107); the target is at most 10 % (0 of 115 measured). The per-turn budget itself has a fast in-process test in tests/test_kv_budget.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from mesh import protocol as P
from mesh.client import Client
from mesh.errors import ErrorCode, RequestError
from mesh.kv_events import BlockStored, encode_event_map
from mesh.lab.up import wait_for_workers
from tests.abuse_peers import FakeWorker, status
from tests.conftest import run

FLOOD_S = 5.0  # how long the client sends requests under the flood
ARRIVAL_S = 0.05  # the client's requests: one every 50 ms
PACE_S = 0.05  # between the attacker's batches: 20 a second, ~40 MB/s
MAX_BLOCKS = 8192  # mesh.protocol.MAX_KV_BATCH_BLOCKS (a literal: the attack runs against older brokers too)


def _events(first: int, events: int, per_event: int) -> bytes:
    """The packed ``events`` array of a batch (packed once: the flood splices it into each batch)."""
    return P.pack([encode_event_map(BlockStored(tuple(range(first + i * per_event, first + (i + 1) * per_event)), None,
                                                tuple(1000 + j % 30_000 for j in range(per_event * 16)), 16)) for i in range(events)])


def _batch(seq: int, packed_events: bytes) -> list[bytes]:
    """``P.encode_kv_events(0, 1, seq, 0.0, events)`` without re-packing the events each time
    (the flooder must not starve the client's event loop)."""
    head = P.encode_kv_events(0, 1, seq, 0.0, [])
    body = P.pack({"dp_rank": 0, "epoch": 1, "seq": seq, "ts": 0.0, "events": []})
    assert body.endswith(b"\x90") and head[2] == body
    return [head[0], head[1], body[:-1] + packed_events]


def _flood_main(backend: str, seconds: float) -> None:
    """The attacker, in its own process (as from another host): register, then send KV batches
    as fast as the broker's socket takes them for ``seconds``; print how many."""
    oversize = _events(1, 36, 2048)  # 73,728 blocks in 3.9 MB, the attack as found
    overcap = _events(2_000_000, 1, MAX_BLOCKS + 8)  # just over the block cap, under 1 MiB: unpacked, refused
    maxsize = _events(1_000_000, 4, MAX_BLOCKS // 4)  # the largest accepted batch
    kinds = (oversize, overcap, maxsize, maxsize)

    async def main() -> int:
        atk = await FakeWorker(backend, "flood", SNDHWM=4).start()
        t_end = time.monotonic() + seconds
        seq = 0
        while (left := t_end - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(atk.send(_batch(seq, kinds[seq % len(kinds)])), left)
            except asyncio.TimeoutError:
                break  # the broker stopped reading: the flood is over anyway
            seq += 1
            await asyncio.sleep(PACE_S)  # pacing: the attacker's rate (faster only buffers at its HWM)
        await atk.close()
        return seq

    print(asyncio.run(main()), flush=True)


@pytest.mark.soak  # a 8 s flood run: make soak
def test_kv_flood_sheds_at_most_a_tenth_of_other_clients(procs):
    b = procs.broker("b", "--heartbeat-ms", "200")
    procs.workers("w", [b.backend], "--heartbeat-ms", "200", count=1)
    run(wait_for_workers(b.frontend, 1))
    attacker = subprocess.Popen([sys.executable, "-c", f"from tests.test_abuse_kv_flood import _flood_main; "
                                 f"_flood_main({b.backend!r}, {FLOOD_S + 2.0})"], stdout=subprocess.PIPE, text=True)
    tally = {"ok": 0, "shed": 0, "other": []}

    async def body():
        await asyncio.sleep(1.0)  # the flood is under way before the client starts
        async with Client(b.frontend) as c:

            async def one(i: int) -> None:
                try:
                    r = await c.generate(input_ids=[5, 6, i], max_new_tokens=2, deadline_ms=30_000)
                    assert r.finish_reason == "length"
                    tally["ok"] += 1
                except RequestError as exc:
                    if exc.code is ErrorCode.OVERLOADED:
                        tally["shed"] += 1
                    else:
                        tally["other"].append(exc.code.value)

            tasks = []
            t_end = time.monotonic() + FLOOD_S
            while time.monotonic() < t_end:  # open loop: arrivals do not wait for answers
                tasks.append(asyncio.create_task(one(len(tasks))))
                await asyncio.sleep(ARRIVAL_S)
            await asyncio.gather(*tasks)
        return (await status(b.frontend)).counters

    try:
        counters = run(body(), timeout_s=90)
        print(f"kv flood: {tally}")
        batches = int(attacker.communicate(timeout=30)[0].strip() or 0)
    finally:
        if attacker.poll() is None:
            attacker.kill()
    total = tally["ok"] + tally["shed"] + len(tally["other"])
    print(f"kv flood: {batches} batches sent, {total} requests, {tally['shed']} shed, counters "
          f"{ {k: v for k, v in counters.items() if k.startswith(('kv.', 'frames_rejected', 'loop.'))} }")
    assert batches >= 10  # the flood happened
    assert total >= 20 and tally["other"] == [], tally
    assert tally["shed"] <= 0.10 * total, tally
