"""Sends that fail: a registered worker whose connection is gone, a client that went away.

Both go through real ROUTER_MANDATORY sockets. The vanished worker is a registration whose
identity has no connection, which is the state a broker is in between a worker's crash and its
liveness expiry; its READY and first heartbeat are fed to the broker as if read from its worker
socket (``Broker.feed_worker_frames``), on the broker's own loop.
"""

from __future__ import annotations

import asyncio
import threading
import time

from brokers.main import build_broker
from mesh import protocol as P
from mesh.broker_core import HB_SLICES
from mesh.client import Client
from mesh.config import BrokerSettings, build
from mesh.lab.up import wait_for_workers

from conftest import run, until


class _BrokerThread:
    """An in-process broker serving on its own event loop in a thread (real sockets)."""

    def __init__(self, **settings) -> None:
        self.broker = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._up = threading.Event()
        self._error: BaseException | None = None
        self._settings = {"frontend": "tcp://127.0.0.1:*", "backend": "tcp://127.0.0.1:*", **settings}
        self._thread = threading.Thread(target=self._main, name="broker", daemon=True)

    def _main(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            self.broker = build_broker(build(BrokerSettings, self._settings))
            task = asyncio.create_task(self.broker.run())
            await self.broker.ready.wait()
            self._up.set()
            await task

        try:
            asyncio.run(serve())
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self._error = exc
            self._up.set()

    def __enter__(self) -> "_BrokerThread":
        self._thread.start()
        assert self._up.wait(10), "broker thread did not start"
        if self._error is not None:
            raise self._error
        return self

    def call(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]

    def ask(self, fn, timeout_s: float = 5.0):
        """Run ``fn()`` on the broker's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(self._run(fn), self.loop).result(timeout_s)  # type: ignore[arg-type]

    @staticmethod
    async def _run(fn):
        return fn()

    def __exit__(self, *exc) -> None:
        if self.loop is not None and self._thread.is_alive():
            self.call(self.broker.request_stop)
        self._thread.join(15)
        assert not self._thread.is_alive(), "broker thread did not stop"
        if self._error is not None:
            raise self._error


def test_request_for_a_worker_whose_connection_is_gone_goes_to_another_worker(procs):
    # The broker heartbeats every 5 s: the ghost's own heartbeat (which fails and removes it, as it
    # should) is then seconds away while the requests below meet its dead connection first.
    with _BrokerThread(policy="round_robin", heartbeat_ms=5000, max_worker_heartbeat_ms=5000) as bt:
        b = bt.broker
        procs.workers("live", [b.backend_endpoint], "--heartbeat-ms", "1000", count=1)
        run(wait_for_workers(b.frontend_endpoint, 1))
        ghost = P.Ready("ghost", "sim-llama-8b", "mixed", {}, 16, 256, 400_000, 1, 1, 1000)
        ident = b"ghost-identity-never-connected"
        core = b.core

        def register_the_ghost() -> None:
            # One step of the broker's loop, so no heartbeat tick can come in between: READY, then
            # a heartbeat (it had been serving, a confirmed session, when its connection went
            # away), then the ghost moves to the heartbeat slice just served, so that its first
            # heartbeat is a whole interval away. (Fed as two posts with the move after them, the
            # heartbeat could come first: it did in 4 of 10 runs, and in CI.)
            now = time.monotonic()
            core.worker_frames([ident, *P.encode_ready(ghost)], now, None)
            core.worker_frames([ident, *P.encode_heartbeat()], now, None)
            sess = core.pool.by_identity[ident]
            sess.hb_slot = (core.workers._hb_slot - 1) % HB_SLICES
            b._kick()  # flush what the core queued (the welcome heartbeat, which fails unreceipted)

        bt.ask(register_the_ghost)
        run(wait_for_workers(b.frontend_endpoint, 2))  # the ghost is listed (healthy until its liveness expires)

        async def body():
            async with Client(b.frontend_endpoint) as c:
                rs = [await c.generate(input_ids=[4] * 16 + [i], max_new_tokens=2, deadline_ms=10_000) for i in range(6)]
                counters = (await c.status()).counters
            assert all(r.worker == "live" for r in rs), [r.worker for r in rs]
            # round robin sent some to the ghost first: their send failed at once (no deadline
            # wait, no liveness expiry) and they went to the live worker as attempt 2
            assert any(r.attempt == 2 for r in rs), [r.attempt for r in rs]
            assert counters.get("retries.send_failed", 0) >= 1, counters
            assert counters.get("dropped.worker_unreachable", 0) >= 1, counters
            assert counters.get("requests.ok", 0) == 6

        run(body(), timeout_s=30)


def test_client_that_disconnects_mid_stream_is_forgotten_and_its_work_cancelled(procs):
    b = procs.broker("b", "--heartbeat-ms", "200")
    procs.workers("slow", [b.backend], "--decode-base-ms", "40", count=1)
    run(wait_for_workers(b.frontend, 1))

    async def body():
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        gone = ctx.socket(zmq.DEALER)
        gone.setsockopt(zmq.LINGER, 0)
        gone.connect(b.frontend)
        await gone.send_multipart(P.encode_submit("r1", input_ids=[6] * 32, params={"max_new_tokens": 400},
                                                  stream=True, deadline_ms=60_000))
        # wait for the first streamed chunk: the request is running on the worker
        while True:
            frames = await asyncio.wait_for(gone.recv_multipart(), 10)
            if frames[1] == bytes([P.Cmd.C_CHUNK]):
                break
        async with Client(b.frontend) as c:
            async def worker_running(n_ok) -> P.StatusReply | None:
                st = await c.status()
                load = st.workers[0]["load"]
                return st if load is not None and n_ok(load["running"]) else None

            await until(lambda: worker_running(lambda n: n >= 1), what="the worker's LoadStat shows the stream")
            gone.close(linger=0)  # the client goes away without a CANCEL
            ctx.term()
            # Wait for the broker to notice (its next CHUNK relay fails), forget the request and
            # CANCEL it on the worker: the worker's own LoadStat then shows nothing running.
            # Uncancelled, the 400-token stream would run for about 16 s.
            async def forgotten_and_cancelled() -> P.StatusReply | None:
                st = await worker_running(lambda n: n == 0)
                if st and st.counters.get("requests.client_gone", 0) >= 1 and not st.workers[0]["inflight"]:
                    return st
                return None

            st = await until(forgotten_and_cancelled, what="client_gone counted, the stream cancelled on the worker")
            assert st.counters.get("dropped.client_unreachable", 0) >= 1
            # and it keeps serving
            r = await c.generate(input_ids=[6] * 8, max_new_tokens=2, deadline_ms=10_000)
            assert r.finish_reason == "length"

    run(body(), timeout_s=40)
