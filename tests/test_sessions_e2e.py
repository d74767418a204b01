"""Session affinity through real broker processes (mesh.routing.sessions).

One broker, three simulated workers, ``round_robin``: requests without a session rotate over the
workers, yet every turn of a session (each with a different prompt, so no prefix keeps them
together) lands on its session's worker, over ZeroMQ (``session`` in SUBMIT) and over HTTP
(``x-session-id``, ``prompt_cache_key``, ``user``). Malformed and oversized session keys are
refused naming the field; a flood of unique sessions leaves the table bounded (evictions
counted). Two brokers exchanging pins: turns alternating between them stay on one worker.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.client import Client
from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers
from tests.conftest import free_port, run, until

FAST = ["--heartbeat-ms", "200", "--policy", "round_robin"]


async def _status(endpoint: str):
    async with Client(endpoint) as c:
        return await c.status()


def _prompt(session: int, turn: int) -> list[int]:
    return [1000 * session + 37 * turn + k for k in range(1, 40)]  # a different prompt every turn


def test_turns_of_a_session_stay_on_one_worker_zmq_and_http(procs):
    b = procs.broker("b", *FAST, "--http", "127.0.0.1:0", "--session-table-size", "64")
    url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen, start=b.log_start)["url"]
    procs.workers("w", [b.backend], "--instant", count=3)

    async def body():
        await wait_for_workers(b.frontend, 3)
        async with Client(b.frontend) as c:
            # without a session, round robin spreads consecutive requests over every worker
            plain = [await c.generate(input_ids=_prompt(99, t), max_new_tokens=2) for t in range(6)]
            assert len({r.worker for r in plain}) == 3
            # 4 sessions x 5 turns, interleaved: each session keeps its worker
            where: dict[int, set[str]] = {s: set() for s in range(4)}
            for t in range(5):
                for s in range(4):
                    r = await c.generate(input_ids=_prompt(s, t), max_new_tokens=2, session=f"agent-{s}")
                    where[s].add(r.worker)
            assert all(len(ws) == 1 for ws in where.values()), where
            assert len(set().union(*where.values())) >= 2  # the sessions themselves were spread

        # hostile: an oversized or mistyped session key is refused at the decode boundary
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(b.frontend)
        try:
            for i, bad in enumerate(("s" * 300, 12, "")):
                body_ = P.submit_body(f"bad-{i}", input_ids=[1, 2, 3])
                body_["session"] = bad
                await sock.send_multipart([P.CLIENT_HEADER, bytes([P.Cmd.C_SUBMIT]), P.pack(body_)])
                m = P.decode_client_reply(await asyncio.wait_for(sock.recv_multipart(), 10.0))
                assert isinstance(m, P.ClientError) and m.code == "bad_request" and "session" in m.message, m
        finally:
            sock.close(linger=0)

        async with aiohttp.ClientSession() as http:
            async def chat(turn: int, **kw):
                headers = kw.pop("headers", {})
                payload = {"model": "mesh", "messages": [{"role": "user", "content": f"turn {turn} {kw}"}],
                           "max_tokens": 2, **kw}
                async with http.post(f"{url}/v1/chat/completions", json=payload, headers=headers) as r:
                    return r.status, r.headers.get("x-mesh-worker"), await r.json()

            for how in ({"headers": {"x-session-id": "http-a"}}, {"prompt_cache_key": "http-b"}, {"user": "http-c"}):
                got = set()
                for t in range(4):
                    status, worker, js = await chat(t, **how)
                    assert status == 200, js
                    got.add(worker)
                assert len(got) == 1, (how, got)
            got = set()
            for t in range(4):  # SGLang's /generate with session_params
                async with http.post(f"{url}/generate", json={"text": f"turn {t}", "sampling_params": {"max_new_tokens": 2},
                                                              "session_params": {"id": "gen-d"}}) as r:
                    assert r.status == 200, await r.text()
                    got.add(r.headers.get("x-mesh-worker"))
            assert len(got) == 1, got
            status, _, js = await chat(0, headers={"x-session-id": "h" * 300})
            assert status == 400 and "x-session-id" in js["error"]["message"], js
            status, _, js = await chat(0, user=["not", "a", "string"])
            assert status == 400 and "user" in js["error"]["message"], js

        # a flood of unique sessions: the table stays within --session-table-size, evictions counted
        async with Client(b.frontend) as c:
            await asyncio.gather(*(c.generate(input_ids=[7, 8, i], max_new_tokens=1, session=f"flood-{i}")
                                   for i in range(200)))
        st = await _status(b.frontend)
        assert st.broker["sessions"] == {"mode": "soft", "pinned": 64, "max": 64}, st.broker
        cnt = st.counters
        assert cnt.get("sessions.hit", 0) >= 4 * 4 + 3 * 3, cnt
        assert cnt.get("sessions.evicted", 0) >= 200 + 4 + 3 - 64, cnt
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/metrics") as r:
                text = await r.text()
        assert 'mesh_sessions_total{what="hit"}' in text and 'mesh_sessions_total{what="evicted"}' in text
        assert 'mesh_sessions_pinned{broker_id="b"} 64.0' in text

    run(body(), 120.0)


def test_turns_alternating_between_two_brokers_stay_on_one_worker(procs):
    pa, pb = free_port(), free_port()
    ea, eb = f"tcp://127.0.0.1:{pa}", f"tcp://127.0.0.1:{pb}"
    a = procs.broker("a", *FAST, "--exchange", ea, "--peer", eb)
    b = procs.broker("b", *FAST, "--exchange", eb, "--peer", ea)
    procs.workers("w", [a.backend, b.backend], "--instant", count=3)

    async def body():
        await wait_for_workers(a.frontend, 3)
        await wait_for_workers(b.frontend, 3)
        await until(lambda: _fresh_peer(a.frontend), 10.0, "B fresh at A")
        await until(lambda: _fresh_peer(b.frontend), 10.0, "A fresh at B")
        async with Client(a.frontend) as ca, Client(b.frontend) as cb:
            where: dict[int, list[str]] = {s: [] for s in range(3)}
            for t in range(6):
                for s in range(3):
                    r = await (ca if t % 2 == 0 else cb).generate(input_ids=_prompt(s, t), max_new_tokens=2,
                                                                 session=f"x-{s}")
                    where[s].append(r.worker)
                other = b.frontend if t % 2 == 0 else a.frontend

                async def applied(ep=other, n=3 * (t // 2 + 1)):  # this turn's pins reached the other broker
                    return (await _status(ep)).counters.get("sessions.remote_applied", 0) >= n

                await until(applied, 10.0, f"turn {t}'s pins applied at the other broker")
            assert all(len(set(ws)) == 1 for ws in where.values()), where
        ca_c = (await _status(a.frontend)).counters
        cb_c = (await _status(b.frontend)).counters
        assert ca_c.get("sessions.hit", 0) + cb_c.get("sessions.hit", 0) == 3 * 5, (ca_c, cb_c)
        assert ca_c.get("sessions.new", 0) + cb_c.get("sessions.new", 0) == 3, (ca_c, cb_c)

    run(body(), 120.0)


def test_a_peer_flooding_pins_gets_no_more_than_its_share(procs):
    """A peer (a plain PUB speaking the exchange) sends thousands of distinct pins and malformed
    ones: the broker applies at most its share of the table (size / (peers + 1)), counts the rest
    and the malformed messages, and its own sessions keep their workers."""
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    b = procs.broker("b", *FAST, "--exchange", "tcp://127.0.0.1:*", "--peer", f"tcp://127.0.0.1:{port}",
                     "--session-table-size", "1000")
    procs.workers("w", [b.backend], "--instant", count=2)

    async def body():
        await wait_for_workers(b.frontend, 2)
        async with Client(b.frontend) as c:
            mine = {s: (await c.generate(input_ids=_prompt(s, 0), max_new_tokens=1, session=f"own-{s}")).worker
                    for s in range(4)}
            seq = 0

            async def flooded():
                nonlocal seq
                seq += 1
                pins = [(seq * 10_000 + i, "w-0", 0) for i in range(P.MAX_EXCHANGE_SESSIONS)]
                await pub.send_multipart(P.encode_peer_load(P.PeerLoad("evil", 1, seq, True, [], 1000, [], pins)))
                bad = P.encode_peer_load(P.PeerLoad("evil", 1, 0, True, []))
                body_ = P.unpack(bad[2])
                body_["sessions"] = [[1, "w-0", 0]] * (P.MAX_EXCHANGE_SESSIONS + 1)
                await pub.send_multipart([bad[0], bad[1], P.pack(body_)])
                cnt = (await _status(b.frontend)).counters
                return cnt if cnt.get("sessions.remote_over_share", 0) > 0 and \
                    cnt.get("exchange.rejected_too_many_sessions", 0) > 0 else None

            cnt = await until(flooded, 20.0, "the flood is bounded and counted", step_s=0.05)
            assert cnt["sessions.remote_applied"] <= 1000 // 2, cnt
            for s in range(4):  # the broker's own sessions were not pushed out
                r = await c.generate(input_ids=_prompt(s, 1), max_new_tokens=1, session=f"own-{s}")
                assert r.worker == mine[s]

    run(body(), 120.0)


def test_an_agent_loop_through_the_gateway_keeps_each_session_on_one_worker(procs):
    """The official ``openai`` client through ``mesh gateway`` (round robin over two brokers that
    exchange pins): every turn of a session (``user``, ``prompt_cache_key`` or ``x-session-id``)
    is answered by its session's worker, whichever broker carried it."""
    openai = pytest.importorskip("openai")
    pa, pb = free_port(), free_port()
    ea, eb = f"tcp://127.0.0.1:{pa}", f"tcp://127.0.0.1:{pb}"
    a = procs.broker("a", *FAST, "--exchange", ea, "--peer", eb)
    b = procs.broker("b", *FAST, "--exchange", eb, "--peer", ea)
    procs.workers("w", [a.backend, b.backend], "--instant", count=3)
    args = ["gateway", "--http", "127.0.0.1:0", "--broker", a.frontend, "--broker", b.frontend]
    gw = procs.spawn("gw", args)
    url = wait_for_log_event(gw.log_path, "gateway_listening", 30, gw.popen, start=gw.log_start)["url"]

    async def body():
        await wait_for_workers(a.frontend, 3)
        await wait_for_workers(b.frontend, 3)
        for ep in (a.frontend, b.frontend):
            await until(lambda ep=ep: _fresh_peer(ep), 10.0, "the peer is fresh")
        async with aiohttp.ClientSession() as s:
            async def healthy() -> bool:
                async with s.get(url + "/health") as r:
                    return r.status == 200 and (await r.json())["workers"] == 3
            await until(healthy, 20, "the gateway sees the workers")
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)
        how = [{"user": "agent-0"}, {"extra_body": {"prompt_cache_key": "agent-1"}},
               {"extra_headers": {"x-session-id": "agent-2"}}, {"user": "agent-3"}]
        where: dict[int, set[str]] = {s: set() for s in range(len(how))}
        history: dict[int, list] = {s: [] for s in range(len(how))}
        for turn in range(6):
            for s, kw in enumerate(how):
                history[s].append({"role": "user", "content": f"session {s} turn {turn}: call the tool"})
                raw = await client.chat.completions.with_raw_response.create(
                    model="mesh", messages=history[s], max_tokens=2, **kw)
                r = raw.parse()
                assert r.choices[0].finish_reason == "length"
                history[s].append({"role": "assistant", "content": r.choices[0].message.content or ""})
                where[s].add(raw.headers["x-mesh-worker"])
            # the pins of this round are known to both brokers before the next round
            async def both_know(n=len(how)):
                ca = (await _status(a.frontend)).broker["sessions"]["pinned"]
                cb = (await _status(b.frontend)).broker["sessions"]["pinned"]
                return ca >= n and cb >= n
            await until(both_know, 10.0, "both brokers hold every session's pin")
        assert all(len(ws) == 1 for ws in where.values()), where
        hits = 0
        for ep in (a.frontend, b.frontend):
            hits += (await _status(ep)).counters.get("sessions.hit", 0)
        assert hits == len(how) * 5

    run(body(), 120.0)


async def _fresh_peer(ep: str) -> bool:
    return (await _status(ep)).broker["exchange"]["fresh"] >= 1
