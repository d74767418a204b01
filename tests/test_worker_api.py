"""The one worker API (mesh/worker/): the pure per-broker session, the "forever" reconnect policy,
and a worker built on :class:`mesh.worker.WorkerAPI` against real broker processes: it registers,
heartbeats (LoadStat from its callback), serves a request, comes back after its broker is
SIGKILLed and restarted on the same ports, and fans KV events out to two brokers.
"""

from __future__ import annotations

import ast
import asyncio
import re
import time
from pathlib import Path

import pytest
import zmq.asyncio

from mesh import kv_events as KV
from mesh import protocol as P
from mesh.client import Client
from mesh.errors import ConfigError
from mesh.load import LoadStat
from mesh.retry import RetryPolicy
from mesh.lab.up import wait_for_workers
from mesh.worker import Capabilities, LinkSession, Send, WorkerAPI, make_epoch
from tests.conftest import run, until

ROOT = Path(__file__).resolve().parent.parent
HB_MS = 100
FAST = ["--heartbeat-ms", str(HB_MS)]


# --------------------------------------------------------------------------- retry policies


def test_forever_policy_never_stops_and_caps_its_waits():
    p = RetryPolicy.forever(base_ms=10.0, cap_ms=40.0)
    assert p.is_forever and p.max_attempts is None
    assert all(p.should_retry(n, remaining_s=1.0) for n in (1, 10, 1000, 10**9))
    assert not p.should_retry(5, remaining_s=0.0)  # a deadline still ends it
    waits = [p.delay_s(n) for n in (*range(1, 200), 10**6)]
    assert max(waits) <= 0.040 and all(w >= 0 for w in waits)
    assert max(waits) > 0.010  # it does back off towards the cap

    # tenacity-based: an operation that fails 300 times is retried until it succeeds
    tiny = RetryPolicy.forever(base_ms=0.001, cap_ms=0.01)
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls <= 300:
            raise ConnectionError("not yet")
        return "up"

    async def body() -> str:
        async for attempt in tiny.async_retrying((ConnectionError,)):
            with attempt:
                return await flaky()
        raise AssertionError("unreachable")

    assert run(body(), 30) == "up" and calls == 301


def test_every_other_policy_keeps_a_stop():
    for p in (RetryPolicy(), RetryPolicy(4, 25.0, 250.0), RetryPolicy(max_attempts=1, base_ms=1, cap_ms=1)):
        assert not p.is_forever and p.max_attempts is not None
        assert not p.should_retry(p.max_attempts, remaining_s=10.0)

        calls = 0

        async def body(policy=p) -> None:
            nonlocal calls
            async for attempt in RetryPolicy(policy.max_attempts, 0.001, 0.01).async_retrying((ConnectionError,)):
                with attempt:
                    calls += 1
                    raise ConnectionError("down")

        with pytest.raises(ConnectionError):
            run(body(), 10)
        assert calls == p.max_attempts
    with pytest.raises(ConfigError):
        RetryPolicy(max_attempts=0)
    # no construction in the source asks for a giant attempt count or None outside forever()
    for path in _sources("mesh", "brokers", "workers_stub"):
        text = path.read_text()
        if path.name == "retry.py":
            continue  # where forever() is defined
        assert not re.search(r"max_attempts\s*=\s*(None|\d[\d_]{6,})", text), path
        if ".forever(" in text:  # only workers waiting for what they serve may retry forever:
            # reconnects to brokers, and an adapter's discovery of its engine (an engine loading its
            # weights takes minutes; --discovery-timeout-s bounds it); and an indexer replica's tail
            # of the Valkey log it serves from
            assert path.relative_to(ROOT).as_posix() in {"mesh/worker/api.py", "workers_stub/instant.py",
                                                         "mesh/adapters/base.py", "mesh/indexer/shared.py"}, path


# --------------------------------------------------------------------------- imports


def _sources(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


#: Files under mesh/ that may import workers_stub, and why. Everything else (the adapters, the
#: worker API, the cores) must not: mesh/ holds the worker side of the protocol.
_MAY_IMPORT_WORKERS_STUB = {
    "mesh/cli.py": "the mesh command, top of the stack: dispatches to worker-stub, stub-sglang, instant-engine",
    "mesh/lab/bench/broker_bench.py": "the broker benchmark drives the instant benchmark workers (InstantFleet)",
}


def _imports_workers_stub(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__"):
            names = [node.args[0].value]
        if any(n == "workers_stub" or n.startswith("workers_stub.") for n in names):
            lines.append(node.lineno)
    return lines


def test_nothing_under_mesh_imports_workers_stub():
    found = {p.relative_to(ROOT).as_posix(): ln for p in _sources("mesh") if (ln := _imports_workers_stub(p))}
    unexpected = {k: v for k, v in found.items() if k not in _MAY_IMPORT_WORKERS_STUB}
    assert unexpected == {}, f"mesh/ must not import workers_stub (file: lines): {unexpected}"
    assert not [k for k in found if k.startswith("mesh/adapters/")]
    # an exception that no longer imports workers_stub is removed from the list
    assert set(found) == set(_MAY_IMPORT_WORKERS_STUB), (found, _MAY_IMPORT_WORKERS_STUB)


# --------------------------------------------------------------------------- the pure session


def test_link_session_registration_liveness_and_backoff():
    s = LinkSession(heartbeat_ms=100, liveness=3, reconnect=RetryPolicy.forever(50, 400), ready_timeout_s=1.0)
    s.open(10.0)
    assert s.conn_no == 1 and s.identity("w", 7) == b"w/7/1"
    assert s.ready_due and not s.may_send() and not s.registered
    assert s.next_timer_s() == pytest.approx(10.15)  # READY fallback at half the liveness window
    assert s.on_handshake() is Send.READY
    s.ready_result(True)
    assert s.may_send() and s.ready_sent == 1 and s.on_handshake() is Send.HEARTBEAT  # same socket reconnected
    s.heard(10.05)
    assert s.on_message(P.Heartbeat([])) == (Send.HEARTBEAT, None) and s.registered  # confirm at once
    assert s.on_message(P.Heartbeat([])) == (None, None)
    assert s.on_message(P.Disconnect("restart")) == (Send.READY, "disconnect:restart") and not s.registered
    s.ready_result(False)  # no pipe: READY stays owed, other sends are refused
    assert not s.may_send()
    assert not s.expired(10.34) and s.expired(10.36)
    delays = [s.lost() for _ in range(30)]
    assert s.reconnects == 30 and max(delays) <= 0.4
    s.open(20.0)
    assert s.conn_no == 2 and s.identity("w", 7) == b"w/7/2" and s.ready_due
    assert s.timer(20.1) is None and s.timer(20.15) is Send.READY and s.ready_fallbacks == 1
    assert s.timer(20.2) is None and s.timer(20.25) is Send.READY  # then once per heartbeat interval
    s.ready_result(True)
    s.on_message(P.Heartbeat([]))
    assert s.attempt == 0  # registered again: the back-off starts over


def test_link_session_does_not_count_its_own_stall_as_broker_silence():
    s = LinkSession(heartbeat_ms=100, liveness=3, reconnect=RetryPolicy.forever(50, 400))
    s.open(10.0)
    s.heard(10.0)
    assert s.expired(12.0)  # 2 s without a word: silent...
    s.stalled(12.0)  # ...unless we ourselves could not run: the broker gets one interval from now
    assert not s.expired(12.0) and not s.expired(12.09) and s.expired(12.1)
    s.heard(12.05)  # its heartbeats were waiting in the socket
    assert not s.expired(12.3)
    s.stalled(12.1)  # a short stall never moves what was heard back
    assert s.last_heard_s == 12.05


def test_epoch_formula():
    assert make_epoch(1_700_000_000.1234, 42) == 1_700_000_000_123 * 1000 + 42
    assert make_epoch(1.0, 1042) == 1000 * 1000 + 42


# --------------------------------------------------------------------------- against real brokers


class EchoWorker:
    """A worker built on WorkerAPI: answers every REQUEST with its first prompt token."""

    def __init__(self, brokers: list[str]) -> None:
        self.heartbeats = 0
        self.served = 0
        self.lost: list[str] = []
        self.api = WorkerAPI(zmq.asyncio.Context.instance(), brokers, "wapi", lambda: Capabilities(model="wapi-model", block_size=16),
                             on_message=self._on_message, on_session_lost=lambda link, why: self.lost.append(why),
                             load=self._load, heartbeat_ms=HB_MS, liveness=3, reconnect_base_ms=20, reconnect_cap_ms=200)

    def _load(self) -> list[LoadStat]:
        self.heartbeats += 1
        return [LoadStat(num_running_reqs=0, num_waiting_reqs=0, num_tokens=0, max_total_num_tokens=400_000,
                         max_running_requests=256)]

    def _on_message(self, link, msg) -> None:
        if type(msg) is P.Request:
            ids = msg.submit.input_ids or []
            usage = {"prompt_tokens": len(ids), "completion_tokens": 1, "cached_tokens": 0}
            link.send(P.encode_worker_final(msg.rid, msg.attempt, "length", usage, {"token_ids": ids[:1]}))
            self.served += 1


async def _status(frontend: str) -> P.StatusReply:
    async with Client(frontend) as c:
        return await c.status(timeout_s=5)


async def _generate(frontend: str) -> str:
    async with Client(frontend) as c:
        r = await c.generate(input_ids=[5, 6, 7], max_new_tokens=1, deadline_ms=5000)
        assert r.token_ids == [5], r
        return r.worker


def test_worker_api_registers_heartbeats_serves_and_survives_a_broker_restart(procs):
    b = procs.broker("b", *FAST)

    async def body() -> None:
        w = EchoWorker([b.backend])
        task = asyncio.create_task(w.api.run())
        try:
            await wait_for_workers(b.frontend, 1, 20, ids={"wapi"})
            st = await _status(b.frontend)
            (me,) = [x for x in st.workers if x["worker_id"] == "wapi"]
            assert me["model"] == "wapi-model" and me["role"] == "mixed" and me["epoch"] == w.api.epoch
            # heartbeats carry the callback's LoadStat: the broker has a fresh load for us
            hb0 = w.heartbeats
            await until(lambda: w.heartbeats >= hb0 + 3, 5, "heartbeats")
            st = await _status(b.frontend)
            assert [x for x in st.workers if x["worker_id"] == "wapi"][0]["load"] is not None
            assert await _generate(b.frontend) == "wapi" and w.served == 1

            # SIGKILL the broker: no DISCONNECT; the link notices the silence and reconnects
            link = w.api.links[0]
            b.popen.kill()
            await asyncio.to_thread(b.popen.wait, 5)
            procs.procs.remove(b)
            await until(lambda: link.reconnects >= 1, 5, "the link gave the silent broker up")
            assert w.lost and w.lost[0] == "broker_silent"
            b2 = await asyncio.to_thread(procs.broker, "b-restarted", *FAST, frontend=b.frontend, backend=b.backend)
            t0 = time.monotonic()
            await wait_for_workers(b2.frontend, 1, 20, ids={"wapi"})
            print(f"re-registered {time.monotonic() - t0:.3f} s after the restarted broker listened")
            await until(lambda: link.registered, 5, "registered again")
            assert link.conn_no >= 2 and w.api.links == [link]  # a new socket, a new identity
            st = await _status(b2.frontend)
            assert [x for x in st.workers if x["worker_id"] == "wapi"][0]["epoch"] == w.api.epoch  # same worker, same epoch
            assert await _generate(b2.frontend) == "wapi" and w.served == 2
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert w.api.links == []

    run(body(), 60)


def test_worker_api_fans_kv_events_out_to_two_brokers(procs):
    b1 = procs.broker("b1", *FAST)
    b2 = procs.broker("b2", *FAST)

    async def batches(frontend: str) -> int:
        return int((await _status(frontend)).counters.get("kv.batches", 0))

    async def body() -> None:
        w = EchoWorker([b1.backend, b2.backend])
        task = asyncio.create_task(w.api.run())
        try:
            for b in (b1, b2):
                await wait_for_workers(b.frontend, 1, 20, ids={"wapi"})
            await until(lambda: all(link.registered for link in w.api.links), 5, "both links registered")
            before = [await batches(b.frontend) for b in (b1, b2)]
            stored = KV.BlockStored(block_hashes=(11, 12), parent_block_hash=None, token_ids=tuple(range(32)), block_size=16)
            assert w.api.publish_kv([KV.encode_event_map(stored)]) == 2
            assert w.api.publish_kv([KV.encode_event_map(KV.AllBlocksCleared())]) == 2

            async def arrived() -> bool:
                return all([await batches(b.frontend) >= n + 2 for b, n in zip((b1, b2), before)])

            await until(arrived, 10, "both brokers got both batches")
            # each broker is served by the one worker
            assert await _generate(b1.frontend) == "wapi" and await _generate(b2.frontend) == "wapi"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    run(body(), 60)


def test_instant_fleet_reconnects_after_a_broker_restart(procs):
    """The benchmarks' instant workers run the same sessions from a synchronous poller loop: they
    now notice a dead broker (liveness), back off, reconnect with a new identity and register."""
    import threading

    import zmq

    from mesh.sockets import ReadyPoller
    from workers_stub.instant import InstantFleet

    b = procs.broker("b", *FAST)
    stop = threading.Event()
    state: dict[str, int] = {}

    def drive() -> None:  # the fleet's one owner: every socket is used from this thread only
        ctx = zmq.Context()
        poller = ReadyPoller()
        fleet = InstantFleet(ctx, poller, [b.backend], count=2, worker_id="inst", heartbeat_ms=HB_MS,
                             reconnect_base_ms=20, reconnect_cap_ms=200)
        try:
            while not stop.is_set():
                next_s = fleet.tick(time.monotonic())
                for sk in poller.wait(min(0.05, max(0.0, next_s - time.monotonic()))):
                    fleet.serve(sk)
                state.update(reconnects=fleet.reconnects, registered=fleet.registered, requests=fleet.requests)
        finally:
            fleet.close()
            poller.close()
            ctx.term()

    th = threading.Thread(target=drive, name="instant-fleet")
    th.start()
    try:
        async def body() -> None:
            await wait_for_workers(b.frontend, 2, 20, ids={"inst-0", "inst-1"})
            assert (await _generate(b.frontend)).startswith("inst-")
            b.popen.kill()
            await asyncio.to_thread(b.popen.wait, 5)
            procs.procs.remove(b)
            await until(lambda: state.get("reconnects", 0) >= 2, 5, "both connections given up")
            b2 = await asyncio.to_thread(procs.broker, "b-restarted", *FAST, frontend=b.frontend, backend=b.backend)
            await wait_for_workers(b2.frontend, 2, 20, ids={"inst-0", "inst-1"})
            await until(lambda: state.get("registered") == 2, 5, "both registered again")
            assert (await _generate(b2.frontend)).startswith("inst-") and state["requests"] >= 2

        run(body(), 60)
    finally:
        stop.set()
        th.join(10)
    assert not th.is_alive()
