"""A server restart (its KV sequence back to 0) drops and rebuilds that worker's index entries.

Real stub-sglang processes, restarted on the same ports; the adapter runs in-process against a
FakeBroker whose index is the broker's own LocalIndexProvider, so the worker's entries can be
watched batch by batch. Two ways a restart is noticed: by the KV stream alone (the restart is
faster than the health checks), and across a health outage (``/server_info.startup_time``).
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp

from mesh import protocol as P
from mesh.adapters.base import Adapter
from mesh.adapters.settings import AttachSettings
from mesh.adapters.sglang import SglangBackend
from mesh.hashing import content_keys
from tests.conftest import run
from tests.adapters_support import FakeBroker, start_stub, until

STUB = ["--time-scale", "0.05"]


def _same_ports(rec: dict) -> list[str]:
    return ["--port", str(rec["port"]), "--kv-port", str(rec["kv_port_base"]), "--replay-port", str(rec["replay_port_base"]),
            "--load-port", str(rec["load_port_base"])]


async def _warm(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
    async with http.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}) as r:
        assert r.status == 200


def _matched(fb: FakeBroker, wid: str, prompt: list[int]) -> int:
    return fb.provider.index.match(content_keys(prompt, 16), time.monotonic()).matched_blocks(wid)


def _restart_stub(procs, proc, rec):
    proc.stop(grace_s=5)
    return start_stub(procs, "stub-2", *STUB, *_same_ports(rec)[2:], "--port", str(rec["port"]))


def test_restart_seen_on_the_kv_stream_new_epoch_drops_then_rebuilds(procs):
    proc, rec = start_stub(procs, "stub", *STUB)
    rng = random.Random(3)
    p1 = [rng.randrange(1, 30_000) for _ in range(1024)]
    p2 = [rng.randrange(1, 30_000) for _ in range(512)]

    async def go():
        fb = FakeBroker().start()
        s = AttachSettings(url=rec["url"], brokers=(fb.endpoint,), worker_id="w", heartbeat_ms=200, health_interval_ms=60_000)
        ad = Adapter(s, SglangBackend(s))
        await ad.start()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                await until(lambda: fb.readies, 10, "registration")
                await _warm(http, rec["url"], p1)
                await until(lambda: _matched(fb, "w", p1) == 64, 10, "p1 indexed")
                # A long history first: the restarted server counts from 0 again, and the first seq the
                # reconnected SUB sees must fall inside it (one that lands just after it looks like
                # the old server going on, and no restart would ever be seen).
                n_p1 = fb.entries("w")
                for i in range(30):
                    await _warm(http, rec["url"], [20_000 + i] * 20)
                await until(lambda: fb.entries("w") >= n_p1 + 30, 10, "the history indexed")
                epoch0 = fb.kv[-1].epoch
                n_before = fb.entries("w")
                # a broker RESYNC is answered with a snapshot of the adapter's mirror: same index
                k0 = len(fb.kv)
                fb.send(next(iter(fb.sessions)), P.encode_resync(0, "test"))
                await until(lambda: len(fb.kv) > k0, 5, "snapshot")
                assert fb.kv[k0].events[0] == {"type": "AllBlocksCleared"} and ad.counters["resyncs_answered"] == 1
                assert fb.entries("w") == n_before
                await asyncio.to_thread(_restart_stub, procs, proc, rec)  # same ports, sequence from 0
                await _warm(http, rec["url"], p2)
                warmups = iter(range(1, 10**6))

                async def restart_detected() -> bool:  # small requests until the SUB has reconnected
                    if ad.counters["engine_restarts"] == 0:
                        await _warm(http, rec["url"], [next(warmups) % 1000 + 1] * 20)
                    return ad.counters["engine_restarts"] > 0

                await until(restart_detected, 15, "the engine restart detected", step_s=0.05)
                await until(lambda: _matched(fb, "w", p2) == 32, 10, "p2 (warmed on the new server) indexed")
                assert _matched(fb, "w", p1) == 0  # the old server's blocks are gone
                assert fb.kv[-1].epoch == epoch0 + 1 and len(fb.readies) == 1  # new KV epoch, same session
                log = fb.entries_log
                k = log.index(n_before)
                assert 0 in log[k:], log  # dropped to nothing, then rebuilt from the new server's replay
                assert ad.counters["history_lost"] == 0
        finally:
            await ad.close()
            await fb.close()

    run(go(), 60)


def _across_an_outage(procs, seed: int, new_ports: bool) -> None:
    """An engine restarted across a health outage (same ports, or new free KV/replay/load ports):
    the adapter re-registers, its old blocks are gone and the new server's are indexed."""
    proc, rec = start_stub(procs, "stub", *STUB)
    rng = random.Random(seed)
    p1 = [rng.randrange(1, 30_000) for _ in range(512)]
    p2 = [rng.randrange(1, 30_000) for _ in range(256)]

    def restart():
        if not new_ports:
            return _restart_stub(procs, proc, rec)
        proc.stop(grace_s=5)
        return start_stub(procs, "stub-2", *STUB, "--port", str(rec["port"]))  # KV, replay, load: new free ports

    async def go():
        fb = FakeBroker().start()
        s = AttachSettings(url=rec["url"], brokers=(fb.endpoint,), worker_id="w", heartbeat_ms=200, health_interval_ms=100,
                           unhealthy_after=1)
        ad = Adapter(s, SglangBackend(s))
        await ad.start()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                await until(lambda: fb.readies, 10, "registration")
                await _warm(http, rec["url"], p1)
                await until(lambda: _matched(fb, "w", p1) == 32, 10, "p1 indexed")
                _, rec2 = await asyncio.to_thread(restart)
                await until(lambda: len(fb.readies) == 2, 15, "re-registration after the outage")
                assert fb.disconnects
                if new_ports:
                    assert rec2["kv_port_base"] != rec["kv_port_base"]
                    assert ad.counters["engine_endpoints_moved"] == 1 and ad.counters["restart_endpoints_moved"] == 1
                    assert ad.relay.ranks[0].kv_endpoint.endswith(f":{rec2['kv_port_base']}")
                else:
                    assert ad.counters["restart_startup_time_changed"] == 1
                    assert _matched(fb, "w", p1) == 0  # the snapshot sent on re-registration holds no stale block
                await _warm(http, rec["url"], p2)
                await until(lambda: _matched(fb, "w", p2) == 16, 10, "p2 (warmed on the restarted server) indexed")
                assert _matched(fb, "w", p1) == 0
        finally:
            await ad.close()
            await fb.close()

    run(go(), 60)


def test_restart_across_a_health_outage_is_found_by_startup_time(procs):
    _across_an_outage(procs, 4, new_ports=False)


def test_restart_on_new_zmq_ports_resubscribes_to_the_new_endpoints(procs):
    """Issue 30 (a): an engine restarted on new KV/replay/load ports. The adapter used to notice
    (``kv_publisher_restarted``), re-register and keep listening on the old ports: none of the new
    server's KV events were relayed again."""
    _across_an_outage(procs, 5, new_ports=True)
