"""Streams that survive a dying worker or broker (issue 31 item 4), with real processes.

Default run: one broker, two simulated ZMQ workers; the worker a stream is on is SIGKILLed after
its first chunk: the stream completes on the other one, with every token once and one FINAL.

``soak`` (``make soak``; they start many processes and run 50 streams): the Migration targets of
issue 31 -- SIGKILL an SGLang engine (stub-sglang behind ``mesh attach``) in the middle of 50
streams, and separately SIGKILL its adapter: no stream that another worker could continue is
broken, exactly one terminal per stream, chunks contiguous by seq and no token repeated or skipped
(each stream's tokens add up to its ``max_new_tokens``); and ``mesh gateway`` in front of two brokers,
one SIGKILLed under 60 requests: none lost.
"""

from __future__ import annotations

import asyncio
import signal

import pytest
import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.client import Client
from mesh.lab.up import wait_for_workers
from tests.adapters_support import start_adapters, start_stubs
from tests.conftest import run, until

FAST = ["--heartbeat-ms", "200"]
FAST_ADAPTER = ["--heartbeat-ms", "200", "--health-interval-ms", "100", "--unhealthy-after", "1", "--load-poll-ms", "200"]


def test_a_stream_whose_worker_is_killed_after_its_first_chunk_completes_on_the_other(procs):
    b = procs.broker("b", *FAST, "--policy", "round_robin")
    with procs.together():
        procs.workers("wa", [b.backend], "--decode-base-ms", "40", count=1)
        procs.workers("wb", [b.backend], "--decode-base-ms", "40", count=1)
    victims = {p.name: p for p in procs.procs if p.name in ("wa", "wb")}
    run(wait_for_workers(b.frontend, 2))

    async def body():
        async with Client(b.frontend) as c:
            st = await c.submit(input_ids=[5] * 40, max_new_tokens=40, deadline_ms=30_000)
            await until(lambda: st.first_token_s is not None and st.worker, 15, "the stream's first chunk", step_s=0.01)
            first = st.worker
            victims[first].signal(signal.SIGKILL)
            r = await st.result()
            counters = (await c.status()).counters
        assert r.worker != first and r.attempt == 2, (r.worker, r.attempt)
        assert len(r.token_ids) == 40  # every token once: the streamed ones were the continuation's prompt
        assert r.usage["completion_tokens"] == 40, r.usage  # as the client asked, not as the second worker saw it
        assert counters.get("migrations.worker_lost", 0) == 1, counters

    run(body(), timeout_s=60)


async def _streams(frontend: str, n: int, max_new: int, started, victim: str, *, prompt_len: int = 64):
    """``n`` streams on one raw DEALER: every frame per rid; ``started`` is awaited once a third
    of them streamed, among them one on worker ``victim`` (it kills that worker); returns
    (terminals by rid, chunks by rid)."""
    ctx = zmq.asyncio.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(frontend)
    terminals: dict[str, list] = {}
    chunks: dict[str, list] = {}
    on: dict[str, str] = {}  # rid -> the worker its ACCEPTED named
    try:
        for i in range(n):
            await s.send_multipart(P.encode_submit(f"s{i}", input_ids=[(i * 7 + k) % 1000 + 1 for k in range(prompt_len)],
                                                   params={"max_new_tokens": max_new}, deadline_ms=60_000))
        fired = False
        while len(terminals) < n or any(len(v) > 1 for v in terminals.values()):
            try:
                frames = await asyncio.wait_for(s.recv_multipart(), 1.0 if len(terminals) == n else 30.0)
            except TimeoutError:
                break  # (all terminals in and quiet for a second: a late duplicate would have shown)
            m = P.decode_client_reply(frames)
            if isinstance(m, P.Accepted):
                on[m.rid] = m.worker
            elif isinstance(m, P.ClientChunk):
                chunks.setdefault(m.rid, []).append(m)
                if not fired and len(chunks) >= n // 3 and any(on.get(rid) == victim for rid in chunks):
                    fired = True
                    await started()
            elif isinstance(m, (P.ClientFinal, P.ClientError)):
                terminals.setdefault(m.rid, []).append(m)
    finally:
        s.close(linger=0)
    return terminals, chunks


def _check_streams(terminals: dict, chunks: dict, n: int, max_new: int) -> None:
    assert len(terminals) == n, f"{n - len(terminals)} streams got no terminal"
    assert all(len(t) == 1 for t in terminals.values()), "a stream got two terminals"
    broken = {rid: t[0].code + ": " + t[0].message for rid, t in terminals.items() if isinstance(t[0], P.ClientError)}
    assert not broken, broken
    for rid, t in terminals.items():
        cs = chunks.get(rid, [])
        assert [c.seq for c in cs] == list(range(len(cs))), f"{rid}: seqs {[c.seq for c in cs]}"
        tokens = [x for c in cs for x in c.data.get("token_ids", [])] + list(t[0].data.get("token_ids") or [])
        assert len(tokens) == max_new, f"{rid}: {len(tokens)} tokens (repeated or skipped)"


@pytest.mark.soak
@pytest.mark.parametrize("kill", ["engine", "adapter"])
def test_sigkill_an_engine_or_its_adapter_in_the_middle_of_50_streams(procs, kill):
    b = procs.broker("b", *FAST, "--max-attempts", "4", "--retry-budget-min", "100")
    stubs = start_stubs(procs, {"stub-a": ("--time-scale", "0.3"), "stub-b": ("--time-scale", "0.3")})
    start_adapters(procs, [("a", "sglang", stubs["stub-a"]["url"], [b.backend], tuple(FAST_ADAPTER)),
                           ("b", "sglang", stubs["stub-b"]["url"], [b.backend], tuple(FAST_ADAPTER))])
    run(wait_for_workers(b.frontend, 2))
    victim = next(p for p in procs.procs if p.name == ("stub-a" if kill == "engine" else "a"))
    n, max_new = 50, 100

    async def body():
        async def killed():
            victim.signal(signal.SIGKILL)

        terminals, chunks = await _streams(b.frontend, n, max_new, killed, "a")
        _check_streams(terminals, chunks, n, max_new)
        async with Client(b.frontend) as c:
            counters = (await c.status()).counters
        assert sum(v for k, v in counters.items() if k.startswith("migrations.")) >= 1, counters
        assert not any(k.startswith("migration_refused.") for k in counters), counters

    run(body(), timeout_s=180)


@pytest.mark.soak
def test_a_gateway_with_one_of_two_brokers_sigkilled_loses_no_request(procs):
    """Issue 31's gateway target: 40 streams and 20 unstreamed requests through ``mesh gateway`` in
    front of two brokers, one SIGKILLed while they run: 0 requests lost (those that had not started
    were resubmitted, the streams that had continued), every stream whole."""
    import aiohttp

    from mesh.lab.procs import wait_for_log_event

    brokers = [procs.broker(f"b{i}", *FAST, "--policy", "round_robin") for i in range(2)]
    procs.workers("w", [b.backend for b in brokers], "--decode-base-ms", "20", count=2)
    for b in brokers:
        run(wait_for_workers(b.frontend, 2), 40)
    gw = procs.spawn("gw", ["gateway", "--http", "127.0.0.1:0", *(x for b in brokers for x in ("--broker", b.frontend))])
    url = wait_for_log_event(gw.log_path, "gateway_listening", 30, gw.popen, start=gw.log_start)["url"]
    max_tokens = 40

    async def one(s: aiohttp.ClientSession, i: int, stream: bool, streaming: asyncio.Event) -> tuple[int, str]:
        req = {"model": "mesh", "prompt": f"request {i} " * 8, "max_tokens": max_tokens, "stream": stream}
        if stream:
            req["stream_options"] = {"include_usage": True}
        async with s.post(url + "/v1/completions", json=req) as r:
            if r.status != 200:
                return r.status, await r.text()
            if not stream:
                usage = (await r.json())["usage"]
                return 200, "" if usage["completion_tokens"] == max_tokens else f"usage {usage}"
            completion, error = None, ""
            async for line in r.content:
                if line.startswith(b"data: {"):
                    streaming.set()
                    ev = __import__("json").loads(line[6:])
                    error = error or str(ev.get("error") or "")
                    if ev.get("usage"):
                        completion = ev["usage"]["completion_tokens"]
            return 200, error or ("" if completion == max_tokens else f"completion_tokens {completion}")

    async def body():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def healthy() -> bool:
                async with s.get(url + "/health") as r:
                    return r.status == 200 and (await r.json())["workers"] == 2
            await until(healthy, 20, "the gateway sees the workers")
            streaming = asyncio.Event()
            tasks = [asyncio.create_task(one(s, i, i % 3 != 0, streaming)) for i in range(60)]
            await asyncio.wait_for(streaming.wait(), 30)
            brokers[0].signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
        bad = [(i, st, why) for i, (st, why) in enumerate(results) if st != 200 or why]
        assert not bad, bad
        assert 'mesh_migrations_total{cause="gateway_' in metrics, metrics

    run(body(), 120)
