"""End to end: a real broker process and real simulated worker processes on 127.0.0.1.

Covers hostile input (the broker survives, counts, answers), exactly-one terminal frame per
request with several clients and workers, SIGKILL of a busy worker, SIGSTOP/SIGCONT of a busy worker
(expiry, retry, fencing of its late frames, re-registration), a pause shorter than the liveness
window (no expiry), and a broker restart.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.client import Client
from mesh.errors import ErrorCode, RequestError
from mesh.lab.up import wait_for_workers
from tests.conftest import run, until

FAST = ["--heartbeat-ms", "200"]  # brokers: faster liveness for quicker tests (T_detect = 0.8 s)


def _record(m, terminals: dict[str, list], seqs: dict[str, list[int]] | None = None) -> None:
    """File one decoded client reply: terminal frames per rid, and chunk sequence numbers."""
    if isinstance(m, P.ClientChunk) and seqs is not None:
        seqs.setdefault(m.rid, []).append(m.seq)
    elif isinstance(m, (P.ClientFinal, P.ClientError)):
        terminals.setdefault(m.rid, []).append(m)


async def _late_terminals(s: zmq.asyncio.Socket, terminals: dict[str, list], quiet_s: float = 0.3) -> None:
    """Read replies until ``quiet_s`` passes without one: any late duplicate terminal shows up."""
    try:
        while True:
            _record(P.decode_client_reply(await asyncio.wait_for(s.recv_multipart(), quiet_s)), terminals)
    except asyncio.TimeoutError:
        pass


async def _raw_exchange(endpoint: str, frames: list[bytes], expect_reply: bool, timeout_s: float = 3.0) -> list[bytes] | None:
    ctx = zmq.asyncio.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        await s.send_multipart(frames)
        if not expect_reply:
            return None
        return await asyncio.wait_for(s.recv_multipart(), timeout_s)
    finally:
        s.close(linger=2000)  # linger so an unanswered frame is still delivered


async def _wait_counters(endpoint: str, want: dict[str, int], timeout_s: float = 5.0) -> dict:
    """Poll STATUS until every counter in ``want`` reached its value (frames land asynchronously)."""
    t_end = time.monotonic() + timeout_s
    while True:
        c = await _counters(endpoint)
        if all(c.get(k, 0) >= v for k, v in want.items()) or time.monotonic() > t_end:
            return c
        await asyncio.sleep(0.05)


async def _counters(endpoint: str) -> dict:
    async with Client(endpoint) as c:
        return (await c.status()).counters


def test_hostile_client_input_is_rejected_counted_and_answered(procs):
    b = procs.broker("b", *FAST)
    procs.workers("w", [b.backend], count=2)
    run(wait_for_workers(b.frontend, 2))

    good = P.encode_submit("ok", input_ids=[1, 2, 3], params={"max_new_tokens": 2})
    cases = [
        # (frames, broker answers with ERROR bad_request?, frames_rejected reason)
        ([P.CLIENT_HEADER, b"\x11", good[2][:-2]], True, "bad_msgpack"),                   # truncated msgpack
        ([P.CLIENT_HEADER, b"\x11", good[2] + b"\x01"], True, "bad_msgpack"),              # trailing bytes
        ([P.CLIENT_HEADER, b"\x11"], True, "bad_frame_count"),                             # wrong frame count
        ([P.CLIENT_HEADER, b"\x20", P.pack({})], True, "unknown_command"),                 # unknown command
        ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "t", "input_ids": "abc"})], True, "bad_field"),  # wrong types
        ([P.WORKER_HEADER, b"\x01", P.pack({"worker_id": "evil"})], False, "wrong_path"),  # worker command from a client
        ([b"GET / HTTP/1.1"], False, "bad_frame_count"),
    ]

    async def body():
        for frames, answered, reason in cases:
            reply = await _raw_exchange(b.frontend, frames, expect_reply=answered)
            if answered:
                m = P.decode_client_reply(reply)
                assert isinstance(m, P.ClientError) and m.code == ErrorCode.BAD_REQUEST.value, m
            # the broker still serves after each bad frame
            async with Client(b.frontend) as c:
                r = await c.generate(input_ids=[5, 6, 7], max_new_tokens=2, deadline_ms=5000)
                assert r.finish_reason == "length" and len(r.token_ids) == 2
        # the rid of a readable-but-invalid SUBMIT is echoed in the error
        reply = await _raw_exchange(b.frontend, [P.CLIENT_HEADER, b"\x11", P.pack({"rid": "named", "input_ids": [-1]})], True)
        assert P.decode_client_reply(reply).rid == "named"
        # oversized frame: ZMQ_MAXMSGSIZE drops the connection; the broker keeps serving others
        await _raw_exchange(b.frontend, [P.CLIENT_HEADER, b"\x11", b"\x00" * (P.MAX_FRAME_BYTES + 128 * 1024)], expect_reply=False)
        async with Client(b.frontend) as c:
            assert (await c.generate(input_ids=[1], max_new_tokens=1, deadline_ms=5000)).finish_reason == "length"
        counters = await _wait_counters(b.frontend, {"frames_rejected.client.wrong_path": 1, "frames_rejected.client.bad_frame_count": 2})
        for _, _, reason in cases:
            path_reasons = [k for k in counters if k.startswith("frames_rejected.") and k.endswith("." + reason)]
            assert path_reasons, (reason, counters)

    run(body())
    assert b.alive()


def test_hostile_worker_input_and_unregistered_peer(procs):
    b = procs.broker("b", *FAST)
    procs.workers("w", [b.backend], count=1)
    run(wait_for_workers(b.frontend, 1))

    async def body():
        # garbage on the worker path, a heartbeat from a peer that never sent READY, a bad READY
        await _raw_exchange(b.backend, [P.WORKER_HEADER, b"\x02", b"\xc1"], expect_reply=False)
        reply = await _raw_exchange(b.backend, P.encode_heartbeat(), expect_reply=True)
        assert isinstance(P.decode_broker_to_worker(reply), P.Disconnect)  # "send READY first"
        await _raw_exchange(b.backend, [P.WORKER_HEADER, b"\x01", P.pack({"worker_id": "x", "role": "mixed"})], expect_reply=False)
        # a READY-d fake worker that then sends a stale FINAL is fenced
        ctx = zmq.asyncio.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(b.backend)
        await s.send_multipart(P.encode_ready(P.Ready("fake", "m", "mixed", {}, 16, 8, 1000, 1, 1, 200)))
        await asyncio.wait_for(s.recv_multipart(), 3)
        await s.send_multipart(P.encode_worker_final(999, 1, "length", {}))
        # the same READY again (a worker that re-sent it after a stall) is acknowledged, not flapped
        await s.send_multipart(P.encode_ready(P.Ready("fake", "m", "mixed", {}, 16, 8, 1000, 1, 1, 200)))
        assert isinstance(P.decode_broker_to_worker(await asyncio.wait_for(s.recv_multipart(), 3)), P.Heartbeat)
        # a READY of another registration on the same live session is a violation: start over
        await s.send_multipart(P.encode_ready(P.Ready("fake", "m", "mixed", {}, 16, 8, 1000, 1, 2, 200)))
        m = P.decode_broker_to_worker(await asyncio.wait_for(s.recv_multipart(), 3))
        while isinstance(m, P.Heartbeat):
            m = P.decode_broker_to_worker(await asyncio.wait_for(s.recv_multipart(), 3))
        assert isinstance(m, P.Disconnect)
        s.close(linger=0)
        async with Client(b.frontend) as c:
            for _ in range(5):
                assert (await c.generate(input_ids=[1, 2], max_new_tokens=1, deadline_ms=5000)).worker == "w"
        c = await _wait_counters(b.frontend, {"frames_rejected.worker.bad_msgpack": 1, "frames_rejected.worker.bad_field": 1})
        assert c.get("frames_rejected.worker.bad_msgpack") == 1
        assert c.get("frames_rejected.worker.unregistered_peer", 0) >= 1
        assert c.get("frames_rejected.worker.bad_field") == 1
        assert c.get("frames_rejected.worker.duplicate_ready") == 1
        assert c.get("workers.ready_repeated") == 1
        assert c.get("dropped.stale_reply") == 1

    run(body())


def test_many_clients_many_workers_exactly_one_terminal(procs):
    b = procs.broker("b", *FAST)
    with procs.together():
        procs.workers("wa", [b.backend], "--time-scale", "0.2", count=3)
        procs.workers("wb", [b.backend], "--time-scale", "0.2", count=2)
    run(wait_for_workers(b.frontend, 5))
    n_clients, per_client = 4, 40

    async def one_client(k: int) -> dict[str, list[bytes]]:
        """A raw DEALER client so every frame is seen; returns terminal commands per rid."""
        ctx = zmq.asyncio.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(b.frontend)
        terminals: dict[str, list[bytes]] = {}
        seqs: dict[str, list[int]] = {}
        for i in range(per_client):
            prompt = [k + 1] * 64 + list(range(i, i + 40))
            await s.send_multipart(P.encode_submit(f"c{k}-{i}", input_ids=prompt, params={"max_new_tokens": 8},
                                                   deadline_ms=20_000, stream=bool(i % 2)))
        t_end = time.monotonic() + 30
        while sum(len(v) for v in terminals.values()) < per_client and time.monotonic() < t_end:
            _record(P.decode_client_reply(await asyncio.wait_for(s.recv_multipart(), 30)), terminals, seqs)
        await _late_terminals(s, terminals)
        s.close(linger=0)
        for rid, sq in seqs.items():
            assert sq == list(range(len(sq))), (rid, sq)  # contiguous chunk sequence
        return terminals

    async def body():
        results = await asyncio.gather(*(one_client(k) for k in range(n_clients)))
        for terminals in results:
            assert len(terminals) == per_client
            for rid, frames in terminals.items():
                assert len(frames) == 1, (rid, frames)
                assert isinstance(frames[0], P.ClientFinal), frames[0]

    run(body(), timeout_s=90)


@pytest.mark.soak  # chaos/flood run: make soak
def test_sigkill_busy_worker_requests_retried_or_worker_lost(procs):
    # round_robin: the test is about worker loss, so the victim must hold work in every run; the
    # default cost policy samples, and with two workers it put all ten streams on one of them ~1/1000
    b = procs.broker("b", *FAST, "--max-attempts", "3", "--retry-budget-min", "20", "--policy", "round_robin")
    with procs.together():
        victim = procs.workers("victim", [b.backend], "--decode-base-ms", "40", count=1)
        procs.workers("survivor", [b.backend], "--decode-base-ms", "40", count=1)
    run(wait_for_workers(b.frontend, 2))

    async def body():
        async with Client(b.frontend) as c:
            # non-streaming requests: nothing is streamed, so they are retry-safe
            quiet = [await c.submit(input_ids=[7] * 32 + [i], max_new_tokens=30, stream=False, deadline_ms=20_000) for i in range(10)]
            # streaming requests: once a chunk arrived they can only fail with worker_lost (100 tokens
            # at 40 ms: the victim's streams run for 4 s after the kill below, sent at their first token)
            loud = [await c.submit(input_ids=[9] * 32 + [i], max_new_tokens=100, stream=True, deadline_ms=20_000) for i in range(10)]
            # wait until the victim is busy streaming
            t_end = time.monotonic() + 10
            while not any(st.worker == "victim" and st.first_token_s for st in loud) and time.monotonic() < t_end:
                await asyncio.sleep(0.02)
            assert any(st.worker == "victim" for st in quiet + loud)
            victim.signal(signal.SIGKILL)
            t_kill = time.monotonic()
            outcomes = []
            for st in quiet + loud:
                try:
                    r = await st.result()
                    outcomes.append(("ok", r.worker, r.attempt, st))
                except RequestError as e:
                    outcomes.append((e.code.value, st.worker, st.attempt, st))
            elapsed = time.monotonic() - t_kill
            for code, worker, attempt, st in outcomes:
                if st in quiet:
                    assert code == "ok", (code, worker)
                    assert worker == "survivor"
                else:
                    assert code in ("ok", "worker_lost"), code
            lost = [o for o in outcomes if o[0] == "worker_lost"]
            retried = [o for o in outcomes if o[0] == "ok" and o[2] > 1]
            assert lost or retried
            # worker_lost answers arrive within the detection time (0.2 s x 3) plus margin
            assert elapsed < 15
            counters = (await c.status()).counters
            lost = ("workers.expired", "workers.disconnected", "workers.connection_lost")
            assert sum(counters.get(k, 0) for k in lost) >= 1, counters

    run(body(), timeout_s=60)


def test_broker_restart_workers_reregister(procs, tmp_path):
    b = procs.broker("b1", *FAST)
    # restart on the same ports so the workers' DEALERs reconnect to the new process
    procs.workers("w", [b.backend], "--heartbeat-ms", "200", count=2)
    run(wait_for_workers(b.frontend, 2))

    async def ask():
        async with Client(b.frontend) as c:
            return await c.generate(input_ids=[1, 2, 3, 4], max_new_tokens=3, deadline_ms=5000)

    assert run(ask()).finish_reason == "length"
    b.signal(signal.SIGKILL)
    b.popen.wait(5)
    b2 = procs.broker("b2", *FAST, frontend=b.frontend, backend=b.backend)
    t0 = time.monotonic()
    run(wait_for_workers(b2.frontend, 2, timeout_s=15))
    assert time.monotonic() - t0 < 5  # re-registered well within T_detect + reconnect back-off
    assert run(ask()).finish_reason == "length"


def test_deadline_and_cancel(procs):
    b = procs.broker("b", *FAST)
    procs.workers("w", [b.backend], "--decode-base-ms", "50", count=1)
    run(wait_for_workers(b.frontend, 1))

    async def body():
        async with Client(b.frontend) as c:
            st = await c.submit(input_ids=[1] * 16, max_new_tokens=500, deadline_ms=300)
            with pytest.raises(RequestError) as ei:
                await st.result()
            assert ei.value.code is ErrorCode.DEADLINE_EXCEEDED
            st = await c.submit(input_ids=[2] * 16, max_new_tokens=500, deadline_ms=10_000)
            async for _ in st:
                await st.cancel()
                break
            with pytest.raises(RequestError) as ei:
                await st.result()
            assert ei.value.code is ErrorCode.CANCELLED
        # the same rid twice while the first is in flight: the second gets DUPLICATE, the first completes
        ctx = zmq.asyncio.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(b.frontend)
        sub = P.encode_submit("dup", input_ids=[3] * 16, params={"max_new_tokens": 20}, stream=False)
        await s.send_multipart(sub)
        await s.send_multipart(sub)
        got = []
        while len(got) < 2:
            m = P.decode_client_reply(await asyncio.wait_for(s.recv_multipart(), 10))
            got.append(type(m).__name__ if not isinstance(m, P.ClientError) else m.code)
        s.close(linger=0)
        assert sorted(got) == ["ClientFinal", "duplicate"]

    run(body())


def test_no_worker_is_a_clear_error(procs):
    b = procs.broker("b", *FAST)

    async def body():
        async with Client(b.frontend) as c:
            with pytest.raises(RequestError) as ei:
                await c.generate(input_ids=[1], max_new_tokens=1, deadline_ms=2000)
            assert ei.value.code is ErrorCode.NO_WORKER

    run(body())


def test_graceful_sigterm_drains(procs):
    b = procs.broker("b", *FAST)
    procs.workers("w", [b.backend], "--decode-base-ms", "20", count=1)
    run(wait_for_workers(b.frontend, 1))

    async def body():
        async with Client(b.frontend) as c:
            sts = [await c.submit(input_ids=[4] * 16 + [i], max_new_tokens=20, deadline_ms=10_000) for i in range(5)]
            async for _ in sts[0]:
                break
            b.signal(signal.SIGTERM)
            for st in sts:
                assert (await st.result()).finish_reason == "length"

    run(body())
    assert b.popen.wait(10) == 0


def test_failing_worker_is_ejected_then_reinstated(procs):
    b = procs.broker("b", *FAST, "--eject-after-failures", "3", "--eject-base-s", "2", "--retry-budget-min", "50",
                     "--policy", "round_robin")
    with procs.together():
        procs.workers("bad", [b.backend], "--fail-requests-every", "1", count=1)
        procs.workers("good", [b.backend], count=2)
    run(wait_for_workers(b.frontend, 3))

    async def body():
        async with Client(b.frontend) as c:
            # every request still succeeds: the failing worker's attempts are retried elsewhere
            rs = [await c.generate(input_ids=[i + 1] * 16, max_new_tokens=2, deadline_ms=10_000) for i in range(12)]
            assert all(r.worker.startswith("good") for r in rs)
            st = await c.status()
            assert st.counters.get("workers.ejected") == 1
            assert {w["worker_id"]: w["healthy"] for w in st.workers}["bad"] is False
            # while ejected it gets nothing; after 2 s it is reinstated automatically
            t_end = time.monotonic() + 10
            while (await c.status()).counters.get("workers.reinstated", 0) < 1:
                assert time.monotonic() < t_end
                await asyncio.sleep(0.1)

    run(body(), timeout_s=60)


def test_stalled_worker_sigstop_is_expired_retried_and_fenced_after_sigcont(procs):
    """SIGSTOP a worker holding requests: it is expired within the detection time and its
    retry-safe requests finish elsewhere. After SIGCONT whatever it still sends for the old
    attempts is dropped (never reaches the client), and it re-registers and serves again."""
    b = procs.broker("b", *FAST, "--policy", "round_robin", "--max-attempts", "3", "--retry-budget-min", "20")
    with procs.together():
        staller = procs.workers("staller", [b.backend], "--decode-base-ms", "30", "--heartbeat-ms", "200", count=1)
        procs.workers("steady", [b.backend], "--decode-base-ms", "30", "--heartbeat-ms", "200", count=1)
    run(wait_for_workers(b.frontend, 2))

    async def body():
        ctx = zmq.asyncio.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(b.frontend)
        terminals: dict[str, list] = {}

        async def collect(n: int, timeout_s: float) -> None:
            t_end = time.monotonic() + timeout_s
            while sum(len(v) for v in terminals.values()) < n:
                left = t_end - time.monotonic()
                assert left > 0, terminals
                _record(P.decode_client_reply(await asyncio.wait_for(s.recv_multipart(), left)), terminals)

        async with Client(b.frontend) as c:
            for i in range(8):  # non-streaming: retry-safe; round robin puts half on the staller
                await s.send_multipart(P.encode_submit(f"s{i}", input_ids=[2] * 16 + [i], params={"max_new_tokens": 40},
                                                       deadline_ms=30_000, stream=False))
            async def staller_busy() -> bool:
                return any(w["worker_id"] == "staller" and w["inflight"] for w in (await c.status()).workers)

            await until(staller_busy, what="the staller holds requests")
            staller.signal(signal.SIGSTOP)
            t_stop = time.monotonic()
            try:
                await collect(8, 15)
                # expiry (3 x 200 ms) + a retry of a 40-token request (~1.2 s): well under 5 s
                assert time.monotonic() - t_stop < 5
                assert all(len(v) == 1 and isinstance(v[0], P.ClientFinal) for v in terminals.values()), terminals
                moved = [v[0] for v in terminals.values() if v[0].attempt >= 2]
                assert moved and all(f.worker == "steady" for f in moved)
                assert (await c.status()).counters.get("workers.expired", 0) >= 1
            finally:
                staller.signal(signal.SIGCONT)
            # it comes back (the broker told it DISCONNECT "expired"): registered and healthy again
            await wait_for_workers(b.frontend, 2)
            # it serves new work
            rs = [await c.generate(input_ids=[8] * 16 + [i], max_new_tokens=2, deadline_ms=10_000) for i in range(4)]
            assert {r.worker for r in rs} == {"staller", "steady"}
        # nothing it sent for the superseded attempts reached the client: still one terminal each
        await _late_terminals(s, terminals)
        s.close(linger=0)
        assert all(len(v) == 1 for v in terminals.values()), terminals

    run(body(), timeout_s=60)


def test_short_pause_below_the_liveness_window_expires_nothing(procs):
    """A worker paused (SIGSTOP) for less than (liveness - 1) x heartbeat, like a long GC pause,
    is not expired, and the request it holds finishes there, on its first attempt."""
    b = procs.broker("b")  # default heartbeat 500 ms x liveness 3: expiry after 1.5 s of silence
    w = procs.workers("pauser", [b.backend], "--decode-base-ms", "20", count=1)
    run(wait_for_workers(b.frontend, 1))

    async def body():
        async with Client(b.frontend) as c:
            st = await c.submit(input_ids=[5] * 16, max_new_tokens=30, stream=True, deadline_ms=20_000)
            await until(lambda: st.first_token_s, what="the first token")
            w.signal(signal.SIGSTOP)
            t_stop = time.monotonic()
            try:
                await asyncio.sleep(0.4)  # the fault itself: a 400 ms pause (< (3 - 1) x 500 ms)
            finally:
                w.signal(signal.SIGCONT)
            r = await st.result()
            assert (r.worker, r.attempt, len(r.token_ids)) == ("pauser", 1, 30)
            # past the moment an expiry would have fired had the silence lasted: nothing expired
            while time.monotonic() < t_stop + 2.0:
                await asyncio.sleep(0.1)
            s = await c.status()
            assert s.counters.get("workers.expired", 0) == 0, s.counters
            assert [x["healthy"] for x in s.workers] == [True]

    run(body(), timeout_s=30)
