"""The gateway's broker links without pyzmq's asyncio layer: replies read by a reader callback on the
socket's FD, the SUBMITs of one loop turn sent in one burst, every other send after them (order kept),
a SUBMIT the pipe refuses answered ``overloaded`` and counted. In process, against a fake broker."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from brokers.gateway import BrokerPool
from mesh import protocol as P
from mesh.errors import ErrorCode
from tests.conftest import run, until
from tests.gateway_support import FakeBroker as _FakeBroker, next_reply as _next, submit as _submit


def test_one_turns_submits_go_in_order_then_a_cancel_and_replies_come_back_through_the_reader():
    async def body():
        ctx = zmq.asyncio.Context.instance()
        b = _FakeBroker(ctx)
        pool = BrokerPool([b.endpoint], ctx)
        pool.start()
        try:
            await until(lambda: pool._links[0].up, 10, "the gateway's broker link")
            qs = [_submit(pool, f"h{i}".encode(), f"r{i}") for i in range(300)]  # one loop turn
            pool.cancel(b"h7")  # after them on the wire, though asked in the same turn
            assert len(pool._links[0].outbox) == 0  # the cancel sent what was queued first
            got = [(await b.submit()).rid for _ in range(300)]
            assert got == [f"r{i}" for i in range(300)]
            _, *frames = await asyncio.wait_for(b.sock.recv_multipart(), 10)
            m = P.decode_client(frames)
            assert isinstance(m, P.Cancel) and m.rid == "r7", m
            # 300 finals in one burst: read in slices of 256 a loop turn, every one reaches its request
            for i in range(300):
                await b.send(P.encode_client_final(f"r{i}", "stop", {"prompt_tokens": 3, "completion_tokens": 1,
                                                                      "cached_tokens": 0}, "w", 0, P.pack({})))
            finals = [await _next(q) for q in qs]
            assert all(isinstance(f, P.ClientFinal) and f.rid == f"r{i}" for i, f in enumerate(finals))
            assert pool.stats.dropped.get("gateway_unknown_reply", 0) == 0
        finally:
            await pool.close()
            b.die()

    run(body(), 60)


def test_a_submit_the_pipe_refuses_is_answered_overloaded_and_counted():
    async def body():
        ctx = zmq.asyncio.Context.instance()
        pool = BrokerPool(["tcp://127.0.0.1:9"], ctx)  # nobody there: the pipe holds SNDHWM messages, then refuses
        pool.start()
        try:
            link = pool._links[0]
            link.up = True  # as if connected: the SUBMITs queue on the pipe
            hwm = link.sync.getsockopt(zmq.SNDHWM)
            qs = [_submit(pool, f"h{i}".encode(), f"r{i}") for i in range(hwm + 5)]
            await until(lambda: not link.outbox, 10, "the burst sent")
            refused = [q for q in qs if not q.empty()]
            assert len(refused) >= 5 and pool.stats.dropped["gateway_send_failed"] == len(refused)
            for q in refused:
                m = await _next(q)
                assert isinstance(m, P.ClientError) and m.code == ErrorCode.OVERLOADED.value, m
            assert len(pool._queues) == len(qs) - len(refused) and len(link.pending) == len(qs) - len(refused)
        finally:
            await pool.close()

    run(body(), 60)
