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
from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers
from tests.conftest import run, until

FAST = ["--heartbeat-ms", "200", "--exchange-stale-ms", "600"]
N_LONG = 6


async def _status(endpoint: str):
    async with Client(endpoint) as c:
        return await c.status()


async def _inflight_by_worker(endpoint: str, key: str) -> dict[str, int]:
    st = await _status(endpoint)
    return {w["worker_id"]: w.get(key, 0) for w in st.workers}


async def _submit_raw(endpoint: str, n: int, max_new_tokens: int, curve=None) -> zmq.asyncio.Socket:
    """Streamed requests through a raw DEALER (a CURVE client with ``curve``: CurveKeys);
    returns once every one was dispatched (ACCEPTED)."""
    s = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        s.curve_secretkey, s.curve_publickey, s.curve_serverkey = curve.secret_key, curve.public_key, curve.server_key
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


def test_under_curve_the_exchange_is_encrypted_and_only_key_holders_take_part(procs, tmp_path):
    """Two CURVE brokers sharing the brokers' key pair exchange figures; a stranger with another
    key can neither subscribe to a broker's exchange nor be taken as its peer (both handshakes
    fail and are counted), and a plaintext subscriber gets nothing."""
    from mesh.security import client_keys, keygen, server_keys

    keys, other = tmp_path / "keys", tmp_path / "other"
    keygen(keys, "broker")
    keygen(keys, "app")
    keygen(other, "stranger")
    curve = ["--curve-secret", str(keys / "broker.key_secret")]
    a = procs.broker("a", *FAST, *curve, "--exchange", "tcp://127.0.0.1:*")
    ex_a = wait_for_log_event(a.log_path, "broker_listening", 5.0, start=a.log_start)["exchange"]
    # the stranger's own publisher, which B is (wrongly) pointed at as a second peer
    ctx = zmq.asyncio.Context.instance()
    fake_pub = ctx.socket(zmq.PUB)
    fake_pub.setsockopt(zmq.LINGER, 0)
    fake = server_keys(other / "stranger.key_secret")
    fake_pub.curve_secretkey, fake_pub.curve_publickey, fake_pub.curve_server = fake.secret_key, fake.public_key, True
    fake_port = fake_pub.bind_to_random_port("tcp://127.0.0.1")
    b = procs.broker("b", *FAST, *curve, "--exchange", "tcp://127.0.0.1:*", "--peer", ex_a,
                     "--peer", f"tcp://127.0.0.1:{fake_port}")
    ck = ["--curve-secret", str(keys / "app.key_secret"), "--curve-server-key", str(keys / "broker.key")]
    procs.workers("w", [a.backend, b.backend], *ck, count=2)
    app = client_keys(keys / "app.key_secret", keys / "broker.key")

    async def st(endpoint):
        async with Client(endpoint, curve=app) as c:
            return await c.status()

    async def lie():
        seq = 0
        while True:
            seq += 1
            lie = P.PeerLoad("fake", 1, seq, True, [("w-0", 1000, 10**6, 10**6 * seq), ("w-1", 1000, 10**6, 10**6 * seq)])
            await fake_pub.send_multipart(P.encode_peer_load(lie))
            await asyncio.sleep(0.02)

    async def body():
        liar = asyncio.ensure_future(lie())
        # a stranger subscribing to A's exchange, with its own key and with none
        spies = []
        for keyed in (True, False):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            if keyed:
                k = client_keys(other / "stranger.key_secret", keys / "broker.key")
                s.curve_secretkey, s.curve_publickey, s.curve_serverkey = k.secret_key, k.public_key, k.server_key
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(ex_a)
            spies.append(s)
        try:
            await until(lambda: _n_workers(a.frontend, app), 20.0, "both workers on A")

            async def fresh_and_counted():
                sa, sb = await st(a.frontend), await st(b.frontend)
                rej_a = sa.counters.get("frames_rejected.exchange.auth_failed", 0)
                return sb.broker["exchange"] if sb.broker["exchange"]["fresh"] == 1 and rej_a >= 1 else None

            ex_b = await until(fresh_and_counted, 15.0, "A fresh at B, the spies' handshakes counted at A")
            # the stranger's publisher never counts as a peer: B says it is degraded, 1 of 2 fresh
            assert ex_b["expected"] == 2 and ex_b["degraded"] and set(ex_b["by_peer"]) == {"a"}

            sock = await _submit_raw(a.frontend, 3, 2000, curve=app)
            try:
                async def seen():
                    own = {w["worker_id"]: w.get("inflight", 0) for w in (await st(a.frontend)).workers}
                    peer = {w["worker_id"]: w.get("peer_inflight", 0) for w in (await st(b.frontend)).workers}
                    return sum(own.values()) == 3 and own == peer  # A's work, none of the liar's

                await until(seen, 10.0, "B sees A's work over the encrypted exchange")
                sb = await st(b.frontend)
                assert set(sb.broker["exchange"]["by_peer"]) == {"a"} and not sb.counters.get("exchange.rejected_bad_field")
            finally:
                sock.close(linger=0)
            for s in spies:  # nothing readable reached either spy
                assert await s.poll(0) == 0
        finally:
            liar.cancel()
            for s in spies:
                s.close(linger=0)
            fake_pub.close(linger=0)

    run(body(), 60.0)



async def _n_workers(endpoint: str, curve) -> bool:
    async with Client(endpoint, curve=curve) as c:
        return len((await c.status()).workers) == 2


def test_a_follow_up_through_the_other_broker_lands_where_its_prefix_is_being_computed(procs):
    """A (routes on, the default) routes a long prompt; while its prefill still runs (no token
    yet, so the KV events cover a chunk at most), its follow-up reaches B. B was told of A's
    route through the exchange and sends the follow-up to the same worker as a cache hit.
    Without routes B sees only the queued load there and sends it to the other worker, which
    recomputes the whole prompt."""
    slow = ["--prefill-tokens-per-s", "4000", "--chunked-prefill-size", "2048"]  # 16k tokens: 4 s of prefill
    a = procs.broker("a", *FAST, "--exchange", "tcp://127.0.0.1:*")
    ex_a = wait_for_log_event(a.log_path, "broker_listening", 5.0, start=a.log_start)["exchange"]
    b = procs.broker("b", *FAST, "--exchange", "tcp://127.0.0.1:*", "--peer", ex_a,
                     "--no-exchange-routes")  # takes routes without sending any
    procs.workers("w", [a.backend, b.backend], *slow, count=2)
    first = list(range(1, 16_001))
    follow = first + list(range(20_000, 20_100))
    ctx = zmq.asyncio.Context.instance()

    async def submit(endpoint: str, rid: str, ids: list[int]):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        await s.send_multipart(P.encode_submit(rid, input_ids=ids, params={"max_new_tokens": 4}, stream=True,
                                               deadline_ms=60_000))
        while True:
            m = P.decode_client_reply(await asyncio.wait_for(s.recv_multipart(), 10.0))
            assert not isinstance(m, P.ClientError), m
            if isinstance(m, P.Accepted):
                return s, m

    async def body():
        await wait_for_workers(a.frontend, 2)
        await wait_for_workers(b.frontend, 2)
        await until(lambda: _fresh(b.frontend), 10.0, "A fresh at B")
        sa, acc1 = await submit(a.frontend, "first", first)
        sb = None
        try:
            async def told():
                return (await _status(b.frontend)).counters.get("exchange.routes_received", 0) >= 1

            await until(told, 5.0, "B told of A's route")
            sb, acc2 = await submit(b.frontend, "follow", follow)
            assert await sa.poll(0) == 0  # the first request has no token yet: its prefill still runs
            assert (acc2.worker, acc2.reason) == (acc1.worker, "cache_hit")
        finally:
            sa.close(linger=0)
            if sb is not None:
                sb.close(linger=0)

    run(body(), 60.0)


def test_in_plaintext_only_the_peer_hosts_may_subscribe_and_a_refusal_is_counted(procs):
    """Issue 32: a stranger's subscriptions grew a plaintext broker to 2.41 GB. With --peer the
    broker's exchange admits subscribers from the --peer hosts' addresses only (ZAP): one from
    another address (127.0.0.2) is refused at the handshake, counted, and gets nothing."""
    a = procs.broker("a", *FAST, "--exchange", "tcp://127.0.0.1:*", "--peer", "tcp://127.0.0.1:9")
    ex_a = wait_for_log_event(a.log_path, "broker_listening", 5.0, start=a.log_start)["exchange"]
    assert wait_for_log_event(a.log_path, "exchange_subscribers_allowed", 5.0, start=a.log_start)
    ctx = zmq.asyncio.Context.instance()
    stranger = ctx.socket(zmq.XSUB)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(f"tcp://127.0.0.2:0;{ex_a[len('tcp://'):]}")

    async def body():
        try:
            await stranger.send(b"\x01" + b"z" * 10_000)

            async def counted():
                st = await _status(a.frontend)
                return st.counters.get("frames_rejected.exchange.auth_failed", 0) >= 1

            await until(counted, 10.0, "the stranger's handshake refused and counted")
            assert await stranger.poll(0) == 0
        finally:
            stranger.close(linger=0)

    run(body(), 30.0)
