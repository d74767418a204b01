"""Tenants over HTTP against a real broker process and a simulated worker (issue 31, item 3): keys,
the admin right, per-tenant 429 with Retry-After, priority headers, and the order of service of
a higher band over a lower one that waited longer (outcomes, not timings)."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from mesh.client import Client
from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers

from conftest import run

KEYS = """
[[tenant]]
name = "chat"
priority = "high"
keys = ["chat-key-0123456789"]

[[tenant]]
name = "batch"
priority = "low"
keys = ["batch-key-0123456789"]

[[tenant]]
name = "metered"
tokens_per_min = 60
keys = ["metered-key-0123456789"]

[[tenant]]
name = "solo"
max_inflight = 1
keys = ["solo-key-0123456789"]
"""
ADMIN = "admin-key-0123456789"


@pytest.fixture
def tenant_mesh(procs, tmp_path):
    kf, af = tmp_path / "keys.toml", tmp_path / "admin.key"
    kf.write_text(KEYS)
    af.write_text(ADMIN + "\n")
    b = procs.broker("b", "--http", "127.0.0.1:0", "--keys-file", str(kf), "--admin-key-file", str(af),
                     "--max-inflight-per-worker", "1", "--queue-timeout-s", "60", "--park-aging-s", "0")
    url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen)["url"]
    procs.workers("w", [b.backend], count=1)
    run(wait_for_workers(b.frontend, 1))
    return url, b.frontend, b, kf


def _h(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


async def _complete(s: aiohttp.ClientSession, url: str, key: str, n: int, done: list, name: str, **hdr: str) -> int:
    async with s.post(f"{url}/v1/completions", headers=_h(key, **hdr),
                      json={"prompt": f"hello {name}", "max_tokens": n}) as r:
        await r.read()
        done.append(name)
        return r.status


def test_tenants_over_http(tenant_mesh):
    """One broker for every check (each real-process start costs seconds on a loaded host)."""
    url, frontend, broker, keys_file = tenant_mesh

    async def go():
        async with aiohttp.ClientSession() as s:
            # a wrong key, an inference key on the admin API, the admin key, a bad priority header
            async with s.get(f"{url}/workers", headers=_h("wrong-key-0123456789")) as r:
                assert r.status == 401
            async with s.get(f"{url}/workers", headers=_h("chat-key-0123456789")) as r:
                assert r.status == 403 and (await r.json())["error"]["code"] == "forbidden"
            async with s.post(f"{url}/workers/nope/drain", headers=_h("chat-key-0123456789")) as r:
                assert r.status == 403
            async with s.get(f"{url}/workers", headers=_h(ADMIN)) as r:
                assert r.status == 200 and len((await r.json())["data"]) == 1
            async with s.post(f"{url}/v1/completions", headers=_h("chat-key-0123456789", **{"x-mesh-priority": "urgent"}),
                              json={"prompt": "x", "max_tokens": 1}) as r:
                assert r.status == 400 and "x-mesh-priority" in (await r.json())["error"]["message"]

            # order of service: low requests that ask for "critical" (spoofing: clamped to their
            # tenant's low), parked before a high one, are served after it
            done: list = []
            blocker = asyncio.create_task(_complete(s, url, "solo-key-0123456789", 300, done, "blocker"))
            await asyncio.sleep(0.3)  # the blocker holds the only slot
            async with s.post(f"{url}/v1/completions", headers=_h("solo-key-0123456789"),
                              json={"prompt": "x", "max_tokens": 1}) as r:  # solo: 1 in flight at most
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
                assert "tenant 'solo'" in (await r.json())["error"]["message"]
            lows = [asyncio.create_task(_complete(s, url, "batch-key-0123456789", 4, done, f"low{i}",
                                                  **{"x-mesh-priority": "critical"})) for i in range(3)]
            await asyncio.sleep(0.2)
            high = asyncio.create_task(_complete(s, url, "chat-key-0123456789", 4, done, "high"))
            assert set(await asyncio.gather(blocker, high, *lows)) == {200}
            if done[0] == "blocker":  # (else the blocker finished before the others queued: a very loaded host)
                assert done[1] == "high", done  # parked after the low ones, served before them

            # tokens per minute: 429 with the seconds to wait; per-tenant metrics
            assert await _complete(s, url, "metered-key-0123456789", 40, done, "m1") == 200
            async with s.post(f"{url}/v1/completions", headers=_h("metered-key-0123456789"),
                              json={"prompt": "again", "max_tokens": 40}) as r:  # over 60 tokens a minute
                assert r.status == 429 and int(r.headers["Retry-After"]) > 1, r.headers
                assert "tokens per minute" in (await r.json())["error"]["message"]
            async with s.get(f"{url}/metrics", headers=_h(ADMIN)) as r:
                text = await r.text()
            assert 'mesh_tenant_requests_total{tenant="metered",what="rejected_429"} 1.0' in text
            assert 'mesh_tenant_queue_wait_seconds_count{tenant="batch"} 3.0' in text
        async with Client(frontend) as c:  # a ZeroMQ client: the default tenant, its priority clamped
            assert (await c.generate(input_ids=[5, 6, 7], max_new_tokens=1, priority="critical", deadline_ms=20_000)).worker

        # SIGHUP reads the keys file again: a new key works, a removed one is refused; a broken file keeps the keys
        keys_file.write_text(KEYS.replace("chat-key-0123456789", "chat-key-rotated-0123"))
        os.kill(broker.popen.pid, signal.SIGHUP)
        wait_for_log_event(broker.log_path, "keys_reloaded", 20, broker.popen)
        async with aiohttp.ClientSession() as s:
            assert await _complete(s, url, "chat-key-rotated-0123", 1, [], "rotated") == 200
            async with s.get(f"{url}/v1/models", headers=_h("chat-key-0123456789")) as r:
                assert r.status == 401
            keys_file.write_text('[[tenant]]\nname = "x"\npriority = "urgent"\n')
            os.kill(broker.popen.pid, signal.SIGHUP)
            wait_for_log_event(broker.log_path, "keys_reload_failed", 20, broker.popen)
            assert await _complete(s, url, "chat-key-rotated-0123", 1, [], "kept") == 200

    run(go(), timeout_s=120)


def test_tenants_through_a_gateway_that_brokers_trust_over_curve(procs, tmp_path):
    """mesh gateway --keys-file stamps the key's tenant; a broker with --trust-client-tenant takes it
    from the gateway's CURVE-listed connection (and the clamped priority), counted per tenant."""
    from mesh.security import client_keys, keygen

    keys, allow = tmp_path / "curve", tmp_path / "allow-c"
    keygen(keys, "broker")
    pub, _ = keygen(keys, "gw")
    allow.mkdir()
    (allow / pub.name).write_bytes(pub.read_bytes())
    kf = tmp_path / "keys.toml"
    kf.write_text(KEYS)
    b = procs.broker("b", "--curve-secret", str(keys / "broker.key_secret"), "--curve-allow-clients", str(allow),
                     "--trust-client-tenant", "--keys-file", str(kf), "--heartbeat-ms", "200")
    procs.workers("w", [b.backend], "--curve-secret", str(keys / "gw.key_secret"), "--curve-server-key",
                  str(keys / "broker.key"), count=1)
    gw = procs.spawn("gw", ["gateway", "--http", "127.0.0.1:0", "--broker", b.frontend, "--keys-file", str(kf),
                            "--curve-secret", str(keys / "gw.key_secret"), "--curve-server-key", str(keys / "broker.key")])
    url = wait_for_log_event(gw.log_path, "gateway_listening", 30, gw.popen, start=gw.log_start)["url"]

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/completions", headers=_h("wrong-key-0123456789"), json={"prompt": "x"}) as r:
                assert r.status == 401
            for _ in range(100):  # the gateway's connection and the worker come up
                async with s.post(f"{url}/v1/completions", headers=_h("chat-key-0123456789"),
                                  json={"prompt": "hello", "max_tokens": 1}) as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.1)
            assert r.status == 200
            assert await _complete(s, url, "batch-key-0123456789", 1, [], "b", **{"x-mesh-priority": "critical"}) == 200
        async with Client(b.frontend, curve=client_keys(keys / "gw.key_secret", keys / "broker.key")) as c:
            counters = (await c.status()).counters
        assert counters.get("tenants.chat.admitted", 0) >= 1 and counters.get("tenants.batch.admitted") == 1, counters

    run(go(), timeout_s=90)
