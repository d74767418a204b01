"""Attacks and broken peers against a real broker process (issue 12): each test performs the
attack over real sockets and fails on the broker as it was before the hardening.

Covered: the libzmq 4.3.5 remote abort (pipe filled, then closed), reserved local identities,
prompts beyond every worker's capacity, KV floods that stall the loop, unbounded labels, a worker
that switches off its own liveness, a worker that holds requests and never answers, one that
refuses everything, one that lies about its load, an impostor claiming a live worker id, a
stalled worker among three under load, per-client quotas, and a client that stops reading.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time

import zmq

from mesh import protocol as P
from mesh.client import Client
from mesh.errors import ErrorCode, RequestError
from mesh.load import LoadStat
from mesh.lab.up import wait_for_workers
from tests.abuse_peers import FakeWorker, answer_ok, impostor_answer, kv_batch, long_stream, never_answer, raw_dealer, status
from tests.conftest import run, until

FAST = ["--heartbeat-ms", "200"]


async def _one(frontend: str, **kw):
    async with Client(frontend) as c:
        return await c.generate(input_ids=kw.pop("ids", [1, 2, 3]), max_new_tokens=kw.pop("n", 2),
                                deadline_ms=kw.pop("deadline_ms", 10_000), **kw)


# --------------------------------------------------------------------------- 1. remote abort

_STALLED_ROUTER = textwrap.dedent("""
    import sys, time, zmq
    from mesh.sockets import BROKER_BACKEND, BROKER_FRONTEND, make_socket
    spec = BROKER_FRONTEND if sys.argv[1] == "frontend" else BROKER_BACKEND
    ctx = zmq.Context()
    s = make_socket(ctx, spec, bind="tcp://127.0.0.1:*")
    print(s.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    sys.stdin.readline()   # the peer filled our pipe and closed: now be a loop that is busy
    time.sleep(2.5)        # > the ZMTP heartbeat interval the broker sockets used to have
    n = 0
    while s.poll(500):
        s.recv_multipart(); n += 1
    print(n, flush=True)
""")


def test_a_peer_that_fills_the_pipe_and_closes_cannot_abort_a_broker_socket():
    """libzmq 4.3.5: an engine whose input stopped at RCVHWM sees the peer's connection die,
    then its ZMTP heartbeat timer writes on it: ``Assertion failed: !_io_error`` (SIGABRT).
    The broker's ROUTER specs must not arm that timer. Before the fix: exit -6, 3 of 3 runs."""
    # both sockets at once (two processes, each its own fault): the 2.5 s busy loop is paid once
    ps = {path: subprocess.Popen([sys.executable, "-c", _STALLED_ROUTER, path], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for path in ("frontend", "backend")}
    try:
        for path, p in ps.items():
            endpoint = p.stdout.readline().strip()
            ctx = zmq.Context()
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.SNDHWM, 0)
            d.connect(endpoint)
            for _ in range(30_000):  # 3x the broker's RCVHWM: its input stops
                d.send(b"x")
            assert d.poll(0, zmq.POLLOUT)
            time.sleep(0.5)  # let the I/O thread push what the kernel takes (the fault being built)
            d.close(linger=0)
            ctx.term()
            p.stdin.write("go\n")
            p.stdin.flush()
        results = {path: (p, *p.communicate(timeout=20)) for path, p in ps.items()}
    finally:
        for p in ps.values():
            if p.poll() is None:
                p.kill()
    for path, (p, out, err) in results.items():
        assert p.returncode == 0, f"{path} socket died ({p.returncode}): {err.strip()[-300:]}"
        assert int(out.strip()) > 0


def test_kv_flood_then_close_does_not_kill_the_broker_nor_expire_healthy_workers(procs):
    """The attack as found: register, send ten 4 MB KV batches (seconds of CPU), 30,000 tiny
    heartbeats, close. Before the fix the broker aborted (exit -6); and the stall expired the
    healthy worker. Now: the broker lives, the real worker stays registered, requests flow."""
    b = procs.broker("b", *FAST)
    procs.workers("w", [b.backend], "--heartbeat-ms", "200", count=1)
    run(wait_for_workers(b.frontend, 1))
    batch = kv_batch(0)

    async def body():
        atk = await FakeWorker(b.backend, "attacker").start()
        for seq in range(10):
            frames = list(batch)
            frames[2] = P.pack({"dp_rank": 0, "epoch": 1, "seq": seq, "ts": 0.0, "events": P.unpack(batch[2])["events"]}) if seq else batch[2]
            await atk.send(frames)
        hb = P.encode_heartbeat()
        for _ in range(30_000):
            await atk.send(hb)
        # a last, malformed frame: refused (counted) whether or not the attacker is still registered,
        # and read after everything it sent before (one connection is read in order)
        await atk.send([b"\xffend of the flood"])
        await atk.close()
        # the broker works through the backlog while serving: a request completes meanwhile
        # (or is shed with 'overloaded' while the loop lags, never left hanging)
        r = await _until_served(b.frontend)
        assert r.finish_reason == "length"
        st = await until(lambda: _flood_read(b.frontend), timeout_s=40, what="the attacker's frames all read")
        c = st.counters
        # every batch read while the attacker was registered was refused at decode (over
        # MAX_KV_BATCH_BLOCKS) or applied (the real worker's own batches count too); on a busy
        # machine the silent attacker may be expired first, and what it sent after that is
        # refused unread as an unregistered peer's
        handled = c.get("kv.batches", 0) + c.get("frames_rejected.worker.kv_batch_too_large", 0)
        assert handled >= 10 or (c.get("workers.expired", 0) == 1 and c.get("frames_rejected.worker.unregistered_peer", 0)), c
        # the real worker was never expired (the attacker, gone silent, may be: with oversize
        # batches refused at decode since issue 32 the broker gets there in time)
        assert c.get("workers.expired", 0) <= 1, c
        assert c.get("workers.registered") == 2, c  # nor re-registered (flapping)
        assert (await _one(b.frontend)).worker == "w"

    run(body(), timeout_s=90)
    assert b.alive(), "broker died"


async def _until_served(frontend: str, timeout_s: float = 20.0):
    t_end = time.monotonic() + timeout_s

    async def served():
        try:
            return await _one(frontend, deadline_ms=max(100, int((t_end - time.monotonic()) * 1000)))
        except RequestError as exc:
            assert exc.code is ErrorCode.OVERLOADED, exc
            return None

    return await until(served, timeout_s, "served once the flood is shed", step_s=0.1)


async def _flood_read(frontend: str):
    """The attacker's last frame (malformed: counted as ``bad_frame_count``) is read, so every frame it
    sent before is (its ten batches handled while it was registered, or refused unread after it expired)."""
    st = await status(frontend)
    return st if st.counters.get("frames_rejected.worker.bad_frame_count", 0) >= 1 else None


# --------------------------------------------------------------------------- 2. injection

def test_a_remote_peer_cannot_use_a_local_client_identity(procs):
    """Identities beginning with a zero byte and longer than 5 bytes belong to in-process (HTTP)
    clients. A remote DEALER may set one; its frames are refused and counted, never answered
    (replies would land in an HTTP request's queue)."""
    b = procs.broker("b", *FAST)
    procs.workers("w", [b.backend], count=1)
    run(wait_for_workers(b.frontend, 1))

    async def body():
        for ident in (b"\x00http:1", b"\x00http:" + bytes(16), b"\x00abcdef"):
            s = raw_dealer(b.frontend, identity=ident)
            await s.send_multipart(P.encode_submit("inj", input_ids=[1, 2], params={"max_new_tokens": 1}))
            await s.send_multipart(P.encode_status_query())
            assert not await s.poll(300), "the broker answered a reserved identity"
            s.close()
        c = (await status(b.frontend)).counters
        assert c.get("frames_rejected.client.reserved_identity") == 6, c
        assert c.get("requests.ok", 0) == 0, c  # nothing was dispatched for them
        # 5-byte zero-led identities are libzmq's own: ordinary clients still work
        assert (await _one(b.frontend)).finish_reason == "length"

    run(body())


# --------------------------------------------------------------------------- 3/4. limits and stalls

def test_prompts_beyond_every_workers_capacity_are_refused_before_hashing(procs):
    """Eight 4M-token SUBMITs (the frame limit allows them): each is refused at once with
    context_length_exceeded (HTTP 400), nothing is hashed, no worker is expired. Before: each
    blocked the loop 0.6-0.9 s hashing in full and the fleet collapsed."""
    # Decoding eight 4M-token frames lags the loop on a busy machine; shedding by loop lag is
    # another test's subject, so it is put out of reach here.
    b = procs.broker("b", *FAST, "--overload-lag-ms", "60000")
    procs.workers("w", [b.backend], "--heartbeat-ms", "200", count=1)
    run(wait_for_workers(b.frontend, 1))
    huge = P.encode_submit("big", input_ids=[5] * 4_000_000, params={"max_new_tokens": 1})
    assert len(huge[2]) < P.MAX_FRAME_BYTES

    async def body():
        s = raw_dealer(b.frontend)
        t0 = time.monotonic()
        for i in range(8):
            await s.send_multipart([*huge[:2], huge[2].replace(b"big", f"bg{i}".encode(), 1)])
        codes = []
        for _ in range(8):
            m = P.decode_client_reply(await asyncio.wait_for(s.recv_multipart(), 10))
            codes.append(m.code)
            assert "exceeds the largest worker's capacity" in m.message
        elapsed = time.monotonic() - t0
        s.close()
        assert codes == [ErrorCode.CONTEXT_LENGTH_EXCEEDED.value] * 8
        assert ErrorCode.CONTEXT_LENGTH_EXCEEDED.http_status == 400
        # The refusal message comes from intake, which runs before any key is hashed; how fast
        # it answers is a benchmark figure (a 3 s bound failed on a busy 2-core machine).
        print(f"8 refusals in {elapsed:.2f} s")
        c = (await status(b.frontend)).counters
        assert c.get("workers.expired", 0) == 0 and c.get("workers.registered") == 1, c
        assert (await _one(b.frontend)).finish_reason == "length"

    run(body())


def test_labels_and_status_replies_are_bounded(procs):
    """64 labels of 60 KB each were accepted and echoed in every STATUS (11.5 MB replies)."""
    b = procs.broker("b", *FAST)

    async def body():
        fat = FakeWorker(b.backend, "fat", labels={f"k{i}": "v" * 60_000 for i in range(64)})
        await fat.start(wait=False)
        ok = await FakeWorker(b.backend, "ok", labels={f"k{i}": "v" * P.MAX_LABEL_VALUE_BYTES for i in range(P.MAX_LABELS)}).start()
        st = await until(lambda: _rejected(b.frontend, "bad_field"), what="fat READY rejected")
        assert [w["worker_id"] for w in st.workers] == ["ok"]
        s = raw_dealer(b.frontend)
        await s.send_multipart(P.encode_status_query())
        reply = await asyncio.wait_for(s.recv_multipart(), 5)
        assert sum(len(f) for f in reply) < 16_000
        s.close()
        await fat.close()
        await ok.close()

    run(body())


async def _rejected(frontend: str, reason: str):
    st = await status(frontend)
    return st if st.counters.get(f"frames_rejected.worker.{reason}", 0) >= 1 else None


# --------------------------------------------------------------------------- 5. containment

def test_a_worker_cannot_switch_off_its_own_liveness(procs):
    """A worker announcing heartbeat_ms=600000 then going silent used to stay registered (and
    routable) for 30 minutes; 200 such registrations made real requests fail. Liveness is now
    capped by the broker (--max-worker-heartbeat-ms): they expire within cap x liveness."""
    b = procs.broker("b", *FAST, "--max-worker-heartbeat-ms", "400")
    procs.workers("w", [b.backend], "--heartbeat-ms", "200", count=1)
    run(wait_for_workers(b.frontend, 1))

    async def body():
        ghosts = [FakeWorker(b.backend, f"ghost{i}", never_answer, heartbeat_ms=600_000) for i in range(200)]
        for g in ghosts:
            g.silent = True
            await g.start(wait=False)
        await until(lambda: _workers(b.frontend, 201), what="ghosts registered")
        t0 = time.monotonic()
        await until(lambda: _workers(b.frontend, 1, exact=True), timeout_s=10, what="ghosts expired")
        assert time.monotonic() - t0 < 3.0  # 400 ms x 3, plus sweep granularity
        rs = await asyncio.gather(*(_one(b.frontend, ids=[9, i]) for i in range(20)))
        assert all(r.worker == "w" for r in rs)
        for g in ghosts:
            await g.close()

    run(body(), timeout_s=60)


async def _workers(frontend: str, n: int, exact: bool = False):
    k = len((await status(frontend)).workers)
    return k == n if exact else k >= n


def test_a_worker_that_heartbeats_but_never_answers_is_failed_over_and_ejected(procs):
    """Its loop is alive (heartbeats), its engine is not. Before: half the requests waited for
    their deadline and failed, and it was never ejected. Now every request completes on the
    healthy worker (no-progress timeout, retry) and the black hole is ejected."""
    b = procs.broker("b", *FAST, "--policy", "round_robin", "--progress-timeout-ms", "300")
    procs.workers("w", [b.backend], "--heartbeat-ms", "200", count=1)
    run(wait_for_workers(b.frontend, 1))

    async def body():
        hole = await FakeWorker(b.backend, "hole", never_answer).start()
        await wait_for_workers(b.frontend, 2)
        async with Client(b.frontend) as c:
            rs = await asyncio.gather(*(c.generate(input_ids=[3, i], max_new_tokens=2, deadline_ms=8000) for i in range(30)))
        assert all(r.worker == "w" for r in rs)
        st = await status(b.frontend)
        assert st.counters.get("workers.no_progress", 0) >= 5, st.counters
        assert st.counters.get("workers.ejected", 0) == 1, st.counters
        assert [w["healthy"] for w in st.workers if w["worker_id"] == "hole"] == [False]
        await hole.close()

    run(body(), timeout_s=60)


async def _refuse_all(w: FakeWorker, r: P.Request) -> None:
    await w.send(P.encode_worker_error(r.rid, r.attempt, ErrorCode.BAD_REQUEST, "no"))


def test_a_worker_that_refuses_everything_its_peers_serve_is_ejected(procs):
    """bad_request answers never ejected a worker: a broken one failed a share of all traffic
    for ever. Its error rate now stands out against its peers' and it is ejected."""
    b = procs.broker("b", *FAST, "--policy", "round_robin")
    procs.workers("w", [b.backend], "--heartbeat-ms", "200", count=2)
    run(wait_for_workers(b.frontend, 2))

    async def body():
        bad = await FakeWorker(b.backend, "refuser", _refuse_all).start()
        await wait_for_workers(b.frontend, 3)
        failed = 0
        async with Client(b.frontend) as c:
            for i in range(90):
                try:
                    await c.generate(input_ids=[4, i], max_new_tokens=1, deadline_ms=5000)
                except RequestError as exc:
                    assert exc.code is ErrorCode.BAD_REQUEST
                    failed += 1
            late = await asyncio.gather(*(c.generate(input_ids=[5, i], max_new_tokens=1, deadline_ms=5000) for i in range(20)))
        assert failed <= 20, failed  # ejected after about 16 of its outcomes, not 30 of 90
        assert all(r.worker != "refuser" for r in late)
        assert (await status(b.frontend)).counters.get("workers.ejected") == 1
        await bad.close()

    run(body(), timeout_s=60)


async def _slow_ok(w: FakeWorker, r: P.Request) -> None:
    await asyncio.sleep(0.5)  # the fault: a slow worker (that claims to be idle)
    await answer_ok(w, r)


def test_a_worker_that_lies_about_its_load_does_not_draw_the_traffic(procs):
    """A slow worker that reports an empty queue in every LoadStat drew 88 % of the requests.
    Telemetry that claims fewer requests than this broker alone has there is ignored."""
    b = procs.broker("b", *FAST, "--seed", "1")
    procs.workers("w", [b.backend], "--heartbeat-ms", "200", count=1)
    run(wait_for_workers(b.frontend, 1))
    empty = LoadStat(0, 0, 0, 400_000, 0, 0, 0, 256, 10**9, 10**6)

    async def body():
        liar = await FakeWorker(b.backend, "liar", _slow_ok, load=empty).start()
        await wait_for_workers(b.frontend, 2)
        async with Client(b.frontend) as c:
            async def one(i):
                await asyncio.sleep(i * 0.02)  # pacing: an arrival every 20 ms, not one burst
                return await c.generate(input_ids=[6] * 32 + [i], max_new_tokens=4, deadline_ms=20_000)
            rs = await asyncio.gather(*(one(i) for i in range(100)))
        share = sum(r.worker == "liar" for r in rs) / len(rs)
        assert share < 0.5, share
        await liar.close()

    run(body(), timeout_s=60)


# --------------------------------------------------------------------------- 6. identity

def test_a_second_peer_cannot_take_over_a_live_worker_id(procs):
    """Before: a READY claiming a live worker's id replaced it (180 of 300 responses carried
    the impostor's tokens). Now the claim is refused while the owner is alive."""
    b = procs.broker("b", *FAST)
    procs.workers("real", [b.backend], "--heartbeat-ms", "200", count=1)
    run(wait_for_workers(b.frontend, 1))

    async def body():
        wid = (await status(b.frontend)).workers[0]["worker_id"]
        imp = FakeWorker(b.backend, wid, impostor_answer)
        await imp.start(wait=False)
        await until(lambda: _counter(b.frontend, "workers.refused_duplicate_id"), what="impostor refused")
        assert "is registered on another live connection" in " ".join(await _disconnects(imp))
        async with Client(b.frontend) as c:
            rs = await asyncio.gather(*(c.generate(input_ids=[8, i], max_new_tokens=2, deadline_ms=5000) for i in range(40)))
        assert not any(666 in r.token_ids for r in rs)
        assert imp.requests == 0
        await imp.close()

    run(body())


async def _counter(frontend: str, name: str, at_least: int = 1):
    return (await status(frontend)).counters.get(name, 0) >= at_least


async def _disconnects(w: FakeWorker) -> list[str]:
    await until(lambda: w.disconnects, what="a DISCONNECT")
    return w.disconnects


# --------------------------------------------------------------------------- 9. retries, fairness

def test_a_stalled_worker_of_three_fails_no_request(procs):
    """SIGSTOP one of three workers for 3 s under steady load. Before: 27 requests failed with
    'retry budget exhausted' while the other two had capacity. Now: none fails."""
    b = procs.broker("b", *FAST)
    with procs.together():
        ws = [procs.workers(f"w{i}", [b.backend], "--heartbeat-ms", "200", "--decode-base-ms", "20", count=1) for i in range(3)]
    run(wait_for_workers(b.frontend, 3))

    async def body():
        errors, ok = [], 0
        async with Client(b.frontend) as c:
            async def one(i):
                nonlocal ok
                try:
                    # not streamed: a request that streamed output before its worker stalled
                    # must end worker_lost (output cannot be taken back); these can all move
                    await c.generate(input_ids=[i % 5 + 1] * 48 + [i], max_new_tokens=16, deadline_ms=20_000,
                                     stream=False, resubmit=0)
                    ok += 1
                except RequestError as exc:
                    errors.append(exc.code.value)
            tasks = []
            for i in range(40):  # a standing backlog on every worker
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.3)  # load shape: the backlog builds for a while before the fault
            ws[1].signal(signal.SIGSTOP)
            try:
                for i in range(40, 160):
                    tasks.append(asyncio.create_task(one(i)))
                    await asyncio.sleep(0.02)  # pacing: an arrival every 20 ms during the stall
                await asyncio.sleep(max(0.0, 3.0 - 0.02 * 120))  # the fault: the stall lasts 3 s in all
            finally:
                ws[1].signal(signal.SIGCONT)
            await asyncio.gather(*tasks)
        assert errors == [] and ok == 160

    run(body(), timeout_s=90)


def test_one_client_cannot_take_the_whole_broker(procs):
    """A per-client in-flight quota: the greedy client is told rate_limited (HTTP 429) at its
    quota while another client is still served."""
    # (a short drain: the held requests are never answered, so the teardown's SIGTERM need not wait for them)
    b = procs.broker("b", *FAST, "--max-inflight-per-client", "5", "--progress-timeout-ms", "0", "--drain-timeout-s", "0.5")

    async def body():
        hold = await FakeWorker(b.backend, "hold", never_answer).start()
        greedy = raw_dealer(b.frontend)
        for i in range(8):
            await greedy.send_multipart(P.encode_submit(f"g{i}", input_ids=[1, i], params={"max_new_tokens": 1}, deadline_ms=60_000,
                                                        stream=False))
        codes = []
        for _ in range(3):
            m = P.decode_client_reply(await asyncio.wait_for(greedy.recv_multipart(), 5))
            if isinstance(m, P.ClientError):
                codes.append(m.code)
        assert codes == [ErrorCode.RATE_LIMITED.value] * 3 and ErrorCode.RATE_LIMITED.http_status == 429
        other = raw_dealer(b.frontend)
        await other.send_multipart(P.encode_submit("o1", input_ids=[2], params={"max_new_tokens": 1}, deadline_ms=60_000))
        await until(lambda: hold.requests >= 6, 5, "the other client's request held")
        assert hold.requests == 6  # 5 greedy + the other client's one
        greedy.close()
        other.close()
        await hold.close()

    run(body())


def test_a_client_that_stops_reading_is_counted_slow_never_ok(procs):
    """Before: a client that never read lost its replies while the broker counted them ok."""
    b = procs.broker("b", *FAST)

    async def body():
        w = await FakeWorker(b.backend, "streamer", long_stream).start()
        lazy = raw_dealer(b.frontend, RCVHWM=1, RCVBUF=4096)
        for i in range(100):  # 100k chunks: more than the broker's send HWM and every buffer
            await lazy.send_multipart(P.encode_submit(f"s{i}", input_ids=[77, i], params={"max_new_tokens": 1000}))
        c = await until(lambda: _final_counts(b.frontend, 100), timeout_s=40, what="every stream ended")
        assert c.get("requests.client_slow", 0) >= 1, c
        assert c.get("requests.ok", 0) < 100, c
        lazy.close()
        await w.close()

    run(body(), timeout_s=60)


async def _final_counts(frontend: str, n: int):
    c = (await status(frontend)).counters
    done = c.get("requests.ok", 0) + c.get("requests.client_slow", 0) + c.get("requests.client_gone", 0)
    return c if done >= n and c.get("requests.client_slow", 0) else None


def test_http_requests_count_against_their_peers_quota(procs):
    """Every HTTP request has a fresh local identity, so a per-identity quota never bound HTTP
    users: the ingress passes the peer's address as the quota key."""
    import aiohttp

    from mesh.lab.procs import wait_for_log_event

    b = procs.broker("b", *FAST, "--http", "127.0.0.1:0", "--max-inflight-per-client", "3", "--progress-timeout-ms", "0")
    url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen)["url"]

    async def body():
        hold = await FakeWorker(b.backend, "hold", never_answer).start()
        async with aiohttp.ClientSession() as http:
            async def post():
                async with http.post(f"{url}/v1/completions", json={"model": "mesh", "prompt": "hi", "max_tokens": 1},
                                     headers={"x-mesh-deadline-ms": "3000"}) as r:
                    return r.status, await r.json()
            first = [asyncio.create_task(post()) for _ in range(3)]
            await until(lambda: hold.requests == 3, what="three requests held")
            status_code, err = await post()
            assert status_code == 429 and err["error"]["code"] == ErrorCode.RATE_LIMITED.value, err
            await asyncio.gather(*first)  # they end at their deadline (504): the quota frees again
        c = (await status(b.frontend)).counters
        assert c.get("requests.rate_limited") == 1, c
        await hold.close()

    run(body())


def test_under_curve_a_key_may_only_claim_its_own_worker_ids(procs, tmp_path):
    """Before: any allow-listed key could register as any worker id (and so replace it). Now
    the key named NAME may register NAME, NAME-* and NAME/* only."""
    from mesh.security import client_keys, keygen

    keys, allow = tmp_path / "keys", tmp_path / "allow"
    keygen(keys, "broker")
    allow.mkdir()
    for name in ("gpu1", "gpu2"):
        pub, _ = keygen(keys, name)
        (allow / pub.name).write_bytes(pub.read_bytes())
    b = procs.broker("b", *FAST, "--curve-secret", str(keys / "broker.key_secret"), "--curve-allow-workers", str(allow))

    def curve_opts(name: str) -> dict:
        ck = client_keys(keys / f"{name}.key_secret", keys / "broker.key")
        return {"CURVE_SERVERKEY": ck.server_key, "CURVE_PUBLICKEY": ck.public_key, "CURVE_SECRETKEY": ck.secret_key}

    async def body():
        mine = await FakeWorker(b.backend, "gpu1-0", **curve_opts("gpu1")).start()
        thief = FakeWorker(b.backend, "gpu1-1", **curve_opts("gpu2"))  # gpu2's key claiming gpu1's id
        await thief.start(wait=False)
        assert "may not register" in " ".join(await _disconnects(thief))
        assert not thief.registered.is_set()
        ok2 = await FakeWorker(b.backend, "gpu2", **curve_opts("gpu2")).start()
        await ok2.close()
        await thief.close()
        await mine.close()

    run(body())
    # (STATUS needs a client key on a CURVE frontend: the refusal is read from the broker's log)
    assert '"why": "key_mismatch"' in b.log_path.read_text()
