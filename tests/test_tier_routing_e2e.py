"""End to end, HiCache demotion: a real broker, two workers on the worker API, one of them
publishing the KV events SGLang 0.5.23's own classes encoded (tests/data/tier_frames.json).

After the prefix is demoted GPU -> host memory (``BlockStored`` on ``CPU_PINNED``, then
``BlockRemoved`` on ``GPU``), the next request with that prefix goes to the same engine; after it
is removed from every tier (disk, host), it does not.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import zmq.asyncio

from mesh import protocol as P
from mesh.client import Client
from mesh.lab.up import wait_for_workers
from mesh.load import LoadStat
from mesh.worker import Capabilities, WorkerAPI
from tests.conftest import run, until

DATA = json.loads((Path(__file__).parent / "data" / "tier_frames.json").read_text())
HB_MS = 100
SPECULATION_TTL_S = 5.0  # the broker's insert-on-route guesses (LocalIndexProvider default)


class Engine:
    """A worker on the worker API that answers every request and publishes raw engine events."""

    def __init__(self, broker: str, worker_id: str) -> None:
        self.api = WorkerAPI(zmq.asyncio.Context.instance(), [broker], worker_id,
                             lambda: Capabilities(model="m", block_size=DATA["block_size"]),
                             on_message=self._on_message, on_session_lost=lambda link, why: None,
                             load=lambda: [LoadStat(0, 0, 0, 400_000, 256)], heartbeat_ms=HB_MS)

    def _on_message(self, link, msg) -> None:
        if type(msg) is P.Request:
            usage = {"prompt_tokens": len(msg.submit.input_ids or []), "completion_tokens": 1, "cached_tokens": 0}
            link.send(P.encode_worker_final(msg.rid, msg.attempt, "length", usage, {"token_ids": [1]}))

    def publish_recorded(self, engine: str, step: str) -> None:
        """Relay one recorded batch payload's events as they came from the engine's encoder."""
        payload = DATA["engines"][engine]["payloads"][DATA["steps"].index(step)]
        _ts, events, *_ = P.unpack(bytes.fromhex(payload))
        assert self.api.publish_kv(events) == 1


async def _kv_batches(frontend: str) -> int:
    async with Client(frontend) as c:
        return int((await c.status(timeout_s=5)).counters.get("kv.batches", 0))


async def _route(frontend: str) -> str:
    async with Client(frontend) as c:
        r = await c.generate(input_ids=DATA["tokens"] + [99], max_new_tokens=1, deadline_ms=5000)
        return r.worker


def test_demoted_prefix_keeps_its_engine_and_a_prefix_gone_from_every_tier_does_not(procs):
    b = procs.broker("b", "--heartbeat-ms", str(HB_MS))

    async def publish(w: Engine, *steps: str) -> None:
        before = await _kv_batches(b.frontend)
        for step in steps:
            w.publish_recorded("sglang_0_5_23", step)

        async def applied() -> bool:
            return await _kv_batches(b.frontend) >= before + len(steps)

        await until(applied, 10, "the broker applied the batches")

    async def body() -> None:
        # "a" sorts first: with no holder the miss rule picks it, so only a hit reaches "holder"
        idle, holder = Engine(b.backend, "a-idle"), Engine(b.backend, "holder")
        tasks = [asyncio.create_task(w.api.run()) for w in (idle, holder)]
        try:
            await wait_for_workers(b.frontend, 2, 20, ids={"a-idle", "holder"})
            await until(lambda: holder.api.links[0].registered, 5, "registered")
            await publish(holder, "gpu_store", "host_store", "gpu_remove")  # HiCache demotion GPU -> host
            assert await _route(b.frontend) == "holder"
            await publish(holder, "store_store", "host_remove", "store_remove")  # gone from every tier
            await asyncio.sleep(SPECULATION_TTL_S + 0.5)  # the broker's guess from the request above expires
            assert await _route(b.frontend) == "a-idle"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    run(body(), 60)
