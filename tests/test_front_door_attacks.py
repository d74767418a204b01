"""Attacks on the HTTP front doors' shared work (issue 32, "front doors"), from another address than the
legitimate client's (the attacker binds 127.0.0.2: loopback answers the whole 127/8):

- a flood of 2 MiB prompts to tokenise: the attacker's jobs wait in its own queue of the tokenizer pool and
  run on at most one of its two threads, its excess is refused (429) at once; the legitimate client's chat
  requests keep being served;
- hundreds of streams that are never read: the attacker holds at most its per-address share of the HTTP
  connections; the legitimate client's connections are admitted and served.

Outcomes are asserted (every legitimate request served); the latency ratios are printed (they are
targets of ``mesh bench``, not of a test on a shared machine). The gateway's variants run in
``make soak`` (the same ingress code as the broker's)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
pytest.importorskip("mistral_common")

from mesh.lab.procs import wait_for_log_event  # noqa: E402
from mesh.lab.tokenizer_builtin import build_model_dir  # noqa: E402
from mesh.lab.up import wait_for_workers  # noqa: E402
from tests.conftest import run  # noqa: E402

ATTACKER = "127.0.0.2"

# The flooding client: CONNS connections from ADDRESS, each posting a 2 MiB prompt of digits (the slowest
# text to tokenise, just under the body limit) again as soon as it is answered; on SIGINT it prints its
# answers by status as JSON.
_FLOOD = r"""
import asyncio, json, signal, sys
import aiohttp
url, address, conns = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = json.dumps({"prompt": "7" * (2 * 1024 * 1024 - 4096), "max_tokens": 1}).encode()
seen = {}
async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    conn = aiohttp.TCPConnector(local_addr=(address, 0), limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def one():
            while not stop.is_set():
                try:
                    async with s.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        seen[r.status] = seen.get(r.status, 0) + 1
                except aiohttp.ClientError:
                    seen[0] = seen.get(0, 0) + 1
        tasks = [asyncio.create_task(one()) for _ in range(conns)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps(seen), flush=True)
asyncio.run(main())
"""


def _attacker_reachable() -> bool:
    import socket

    s = socket.socket()
    try:
        s.bind((ATTACKER, 0))
        return True
    except OSError:
        return False
    finally:
        s.close()


pytestmark = pytest.mark.skipif(not _attacker_reachable(), reason="127.0.0.2 is not a local address here")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_cache) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tok"), tokenizer="mistral_v3")


def _door(procs, model_dir: Path, gateway: bool, *extra: str) -> str:
    tok = ("--tokenizer", str(model_dir))
    if gateway:
        b = procs.broker("b", "--max-inflight-per-client", "100000")
        door, ready = procs.spawn("gw", ["gateway", "--broker", b.frontend, "--http", "127.0.0.1:0", *tok, *extra]), "gateway_listening"
    else:
        b = procs.broker("b", "--http", "127.0.0.1:0", *tok, *extra)
        door, ready = b, "http_listening"
    procs.workers("w", [b.backend], "--count", "2", "--time-scale", "0.01")
    run(wait_for_workers(b.frontend, 2), 30)
    url = wait_for_log_event(door.log_path, ready, 30, door.popen, start=door.log_start)["url"]
    return url.replace("0.0.0.0", "127.0.0.1")


async def _legit(url: str, n: int) -> list[float]:
    """``n`` chat requests one after another (a user's turns): their latencies; each must be a 200."""
    lats = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for i in range(n):
            t0 = time.monotonic()
            async with s.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"turn {i}: what is the capital of France?"}],
                    "max_tokens": 4}) as r:
                body = await r.read()
                assert r.status == 200, (r.status, body[:300])
            lats.append(time.monotonic() - t0)
    return lats


@pytest.mark.timeout(300)
@pytest.mark.parametrize("gateway", [False, pytest.param(True, marks=pytest.mark.soak)], ids=["broker", "gateway"])
def test_a_tokenizer_flood_from_one_address_leaves_the_others_served(procs, model_dir, gateway):
    url = _door(procs, model_dir, gateway)
    # the attacker is a process of its own (its 40 connections must not share the legitimate client's loop)
    attacker = subprocess.Popen([sys.executable, "-c", _FLOOD, url, ATTACKER, "40"], stdout=subprocess.PIPE, text=True)

    async def body() -> tuple[list[float], list[float]]:
        base = await _legit(url, 20)
        await asyncio.sleep(2.0)  # the flood under way (the attacker's requests are queued or refused)
        under = await _legit(url, 20)
        return base, under

    try:
        base, under = run(body(), 300)
    finally:
        attacker.send_signal(signal.SIGINT)  # it prints its answers by status and exits
        out, _ = attacker.communicate(timeout=60)
    outcomes = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    p50_base, p50_under = statistics.median(base), statistics.median(under)
    print(f"\nlegitimate p50 {p50_base * 1000:.0f} ms alone, {p50_under * 1000:.0f} ms beside 40 flooding connections "
          f"({p50_under / p50_base:.1f}x); attacker's answers by status {outcomes}")
    assert outcomes.get(429, 0) > 0, outcomes  # the attacker's excess is refused, not queued without bound
    # 413: its tokens make a SUBMIT over the frame limit; 0: a connection closed under a refused body
    assert set(outcomes) <= {0, 200, 400, 413, 429}, outcomes


@pytest.mark.parametrize("gateway", [False, pytest.param(True, marks=pytest.mark.soak)], ids=["broker", "gateway"])
def test_streams_never_read_take_only_their_addresss_share(procs, model_dir, gateway):
    url = _door(procs, model_dir, gateway, "--http-max-connections", "64", "--http-max-connections-per-address", "16")

    async def body() -> tuple[int, int]:
        conn = aiohttp.TCPConnector(local_addr=(ATTACKER, 0), limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
            held, refused = [], 0
            for i in range(60):  # streams it opens and never reads
                try:
                    r = await s.post(url + "/generate", json={"input_ids": [i + 1] * 8, "stream": True,
                                                              "sampling_params": {"max_new_tokens": 4000}})
                except aiohttp.ClientError:
                    refused += 1
                    continue
                if r.status == 200:
                    held.append(r)
                else:
                    refused += 1
                    r.release()
            lats = await _legit(url, 10)  # the legitimate client is admitted and served meanwhile
            for r in held:
                r.close()
            return len(held), refused, lats

    held, refused, lats = run(body(), 180)
    print(f"\nattacker held {held} streams, {refused} refused; legitimate p50 {statistics.median(lats) * 1000:.0f} ms")
    assert held <= 16 and refused >= 44, (held, refused)


def _inflight(frontend: str):
    from mesh.client import Client

    async def q() -> int:
        async with Client(frontend) as c:
            st = await c.status()
        return sum(int(w.get("inflight", 0) or 0) for w in st.workers)
    return q


@pytest.mark.parametrize("gateway", [False, pytest.param(True, marks=pytest.mark.soak)], ids=["broker", "gateway"])
def test_streams_of_clients_that_vanish_are_cancelled_at_once(procs, model_dir, gateway):
    """30 long streams whose client goes away after the first chunk: the broker's workers are freed
    (their in-flight count back to 0) long before the streams would have ended (4,000 tokens each at
    the workers' modelled speed: minutes)."""
    tok = ("--tokenizer", str(model_dir))
    if gateway:
        b = procs.broker("b")
        door, ready = procs.spawn("gw", ["gateway", "--broker", b.frontend, "--http", "127.0.0.1:0", *tok]), "gateway_listening"
    else:
        b = procs.broker("b", "--http", "127.0.0.1:0", *tok)
        door, ready = b, "http_listening"
    procs.workers("w", [b.backend], "--count", "2", "--time-scale", "1.0")
    run(wait_for_workers(b.frontend, 2), 30)
    url = wait_for_log_event(door.log_path, ready, 30, door.popen, start=door.log_start)["url"]
    inflight = _inflight(b.frontend)

    async def body() -> list[int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def one(i: int) -> None:
                async with s.post(url + "/generate", json={"input_ids": [i + 1] * 16, "stream": True,
                                                           "sampling_params": {"max_new_tokens": 4000}}) as r:
                    assert r.status == 200
                    await r.content.readline()  # the first chunk: the stream runs; then the client vanishes

            await asyncio.gather(*(one(i) for i in range(30)))
        seen = [await inflight()]
        t_end = time.monotonic() + 30
        while seen[-1] and time.monotonic() < t_end:
            await asyncio.sleep(0.2)
            seen.append(await inflight())
        return seen

    seen = run(body(), 90)
    print(f"\nin flight after the clients left: {seen[:3]} ... {seen[-1]} ({len(seen)} looks)")
    assert seen[-1] == 0, seen


def test_a_stream_never_read_ends_at_the_write_timeout_counted_without_a_traceback(procs):
    """A client that opens a long stream and never reads: once the kernel's buffers are full the door's
    write waits out ``--http-body-timeout-s`` and gives up: the request is cancelled, the drop counted
    (``http_client_gone``), and the log holds no traceback."""
    b = procs.broker("b", "--http", "127.0.0.1:0", "--http-body-timeout-s", "1")
    procs.workers("w", [b.backend], "--time-scale", "0.0001")
    run(wait_for_workers(b.frontend, 1), 30)
    url = wait_for_log_event(b.log_path, "http_listening", 30, b.popen)["url"]

    async def body():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            r = await s.post(url + "/generate", json={"input_ids": [5] * 8, "stream": True,
                                                       "sampling_params": {"max_new_tokens": 250_000}})
            assert r.status == 200

            async def gone():
                from mesh.client import Client

                async with Client(b.frontend) as c:
                    return (await c.status()).counters.get("dropped.http_client_gone", 0) >= 1
            from tests.conftest import until

            await until(gone, 40, "the unread stream given up")
            r.close()

    run(body(), 90)
    assert "Traceback" not in b.log_path.read_text()
