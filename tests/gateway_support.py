"""Shared by the gateway link tests: a fake broker (a ROUTER this test drives) and BrokerPool helpers."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from brokers.gateway import BrokerPool
from mesh import protocol as P
from tests.conftest import until


class FakeBroker:
    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peer = b""

    async def submit(self) -> P.Submit:
        """The next SUBMIT (STATUS queries are answered with an empty fleet)."""
        while True:
            ident, *frames = await asyncio.wait_for(self.sock.recv_multipart(), 10)
            self.peer = ident
            m = P.decode_client(frames)
            if isinstance(m, P.StatusQuery):
                await self.sock.send_multipart([ident, *P.encode_status_reply({}, [], {})])
                continue
            assert isinstance(m, P.Submit), m
            return m

    async def send(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart([self.peer, *frames])

    def die(self) -> None:
        self.sock.close(linger=0)


async def pool_of(n: int = 2):
    ctx = zmq.asyncio.Context.instance()
    brokers = [FakeBroker(ctx) for _ in range(n)]
    pool = BrokerPool([b.endpoint for b in brokers], ctx)
    pool.start()
    await until(lambda: all(link.up for link in pool._links), 10, "the gateway's broker links")
    return pool, brokers


async def next_reply(q: asyncio.Queue):
    return P.decode_client_reply(await asyncio.wait_for(q.get(), 10))


def submit(pool: BrokerPool, ident: bytes, rid: str, **kw) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    body = P.submit_body(rid, input_ids=[1, 2, 3], params={"max_new_tokens": 4, **kw.pop("params", {})}, **kw)
    sub = P.submit_of_body(body, P.pack(body))
    pool.submit(ident, sub, q)
    return q
