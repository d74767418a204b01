"""A broker link's batched replies (BrokerLink.post / .replies, mesh/worker/link.py), in process
against a FakeBroker or a bare ROUTER: what one loop turn posts leaves in one burst and in order
(with the immediate sends around it), every reply is delivered or counted as a failed send, and
replies queued when the link closes still go out; a handler that raises ends the link's run as
it did when frames were read inline."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import pytest
import zmq

from mesh import protocol as P
from mesh.errors import ErrorCode
from mesh.retry import RetryPolicy
from mesh.sockets import BROKER_BACKEND, make_socket, recv_frames
from mesh.worker.link import BrokerLink
from tests.adapters_support import FakeBroker
from tests.conftest import run, until

USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}


def _ready() -> list[bytes]:
    return P.encode_ready(P.Ready("w", "m", "mixed", {}, 16, 8, 1000, 1, 1, 5000))


def _link(endpoint: str, ctx, on_message=lambda *_: None) -> BrokerLink:
    return BrokerLink(ctx, endpoint, "w", 1, _ready, on_message, lambda *_: None, heartbeat_ms=5000, liveness=3,
                      reconnect=RetryPolicy(1000, 100, 1000))


def _final(rid: int, pad: bytes = b"") -> list[bytes]:
    return P.encode_worker_final(rid, 1, "stop", USAGE, {"token_ids": [rid], "text": pad.decode()})


class _OrderedBroker(FakeBroker):
    """A FakeBroker that also keeps the order of what the worker sent."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[tuple[str, int]] = []

    def _handle(self, ident: bytes, frames: list[bytes]) -> None:
        m = P.decode_worker(frames)
        if isinstance(m, (P.WorkerFinal, P.WorkerError)):
            self.order.append((type(m).__name__, m.rid))
        elif isinstance(m, P.Disconnect):
            self.order.append(("Disconnect", 0))
        super()._handle(ident, frames)


@asynccontextmanager
async def _registered(on_message=lambda *_: None):
    """An _OrderedBroker and a link registered with it: (broker, link, the link's run task)."""
    fb = _OrderedBroker().start()
    link = _link(fb.endpoint, fb.ctx, on_message)
    task = asyncio.create_task(link.run())
    try:
        await until(lambda: link.registered, 10, "registered")
        yield fb, link, task
    finally:
        link.close()
        await asyncio.gather(task, return_exceptions=True)
        await fb.close()


def test_one_turns_replies_leave_in_one_burst_in_order_with_the_immediate_sends():
    async def go():
        async with _registered() as (fb, link, _):
            batches = link.posted_batches
            for rid in range(1, 41):  # one loop turn: 40 replies, an immediate send in the middle
                assert link.replies.send(_final(rid))
                if rid == 20:
                    assert link.send(P.encode_worker_error(1000, 1, ErrorCode.WORKER_ERROR, "x"))
            await until(lambda: len(fb.order) == 41, 10, "all replies")
            return fb.order, link.posted_batches - batches, link.send_failures

    order, bursts, failures = run(go(), 30)
    expected = [("WorkerFinal", r) for r in range(1, 21)] + [("WorkerError", 1000)] + \
               [("WorkerFinal", r) for r in range(21, 41)]
    assert order == expected
    assert bursts == 2  # the immediate send flushed the first 20; the turn's end sent the rest
    assert failures == 0


def test_a_reply_is_delivered_or_counted_when_the_pipe_is_full():
    """A broker that stops reading: the DEALER's pipe fills (SNDHWM + socket buffers) and the
    burst's later sends fail. Every posted reply is then either read by the broker or counted."""
    posted = 40_000

    async def go():
        ctx = zmq.asyncio.Context()
        router = make_socket(ctx, BROKER_BACKEND, bind="tcp://127.0.0.1:*")
        link = _link(router.getsockopt_string(zmq.LAST_ENDPOINT), ctx)
        task = asyncio.create_task(link.run())
        sync = zmq.Socket.shadow(router.underlying)
        try:
            await until(lambda: link.ready_sent >= 1, 10, "READY out")
            pad = b"x" * 512
            for rid in range(posted):
                link.replies.send(_final(rid, pad))
            await asyncio.sleep(0)  # the burst
            await asyncio.sleep(0)
            failed = link.send_failures
            got = 0
            idle_since = time.monotonic()
            while time.monotonic() - idle_since < 2.0:  # read until the pipe has been empty a while
                try:
                    frames = recv_frames(sync)
                except zmq.Again:
                    await asyncio.sleep(0.01)
                    continue
                idle_since = time.monotonic()
                if type(P.decode_worker(frames[1:])) is P.WorkerFinal:
                    got += 1
            return failed, got
        finally:
            link.close(say_goodbye=False)
            await asyncio.gather(task, return_exceptions=True)
            router.close(linger=0)
            ctx.term()

    failed, got = run(go(), 60)
    assert failed > 0, "the pipe never filled: the test does not test the counting"
    assert failed + got == posted, (failed, got)


def test_replies_queued_when_the_link_closes_still_go_out():
    async def go():
        async with _registered() as (fb, link, _):
            for rid in (7, 8):
                link.replies.send(_final(rid))
            link.close()  # same turn: before the burst would have gone out
            await until(lambda: "worker_shutdown" in fb.disconnects, 10, "goodbye")
            return fb.order, link.send_failures

    order, failures = run(go(), 30)
    assert order == [("WorkerFinal", 7), ("WorkerFinal", 8), ("Disconnect", 0)] and failures == 0  # replies first


def test_a_reply_posted_on_a_link_that_cannot_send_is_refused_and_counted():
    async def go():
        fb = FakeBroker().start()
        link = _link(fb.endpoint, fb.ctx)
        try:
            return link.replies.send(_final(1)), link.send_failures  # never opened: no socket
        finally:
            await fb.close()

    assert run(go(), 10) == (False, 1)


def test_a_handler_that_raises_ends_the_links_run():
    class Boom(Exception):
        pass

    def on_message(link, msg):
        if type(msg) is P.Request:
            raise Boom("handler bug")

    async def go():
        async with _registered(on_message) as (fb, _, task):
            fb.request(1, P.encode_submit("r", input_ids=[1], params={})[2])
            await asyncio.wait_for(asyncio.shield(task), 10)

    with pytest.raises(Boom):
        run(go(), 30)
