"""Interleavings of a client link's retirement (its broker left the DNS answer) with the replies
and requests in flight on it, forced one at a time. A real broker process on 127.0.0.1, a
scripted worker (tests/abuse_peers.FakeWorker) so the test decides when each reply is sent, and a
resolver the test answers; the only timing device is where the test blocks the event loop.

Found as a once-in-50 failure of tests/test_discovery_bounds.py::
test_a_client_following_a_flapping_answer_fails_no_stream: a whole batch of streams ended with
``deadline_exceeded`` ("no reply from the broker before the deadline") after 30 s.
"""

from __future__ import annotations

import asyncio
import select
import sys

import pytest
import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.client import Client
from mesh.errors import ErrorCode
from mesh.lab.up import wait_for_workers
from tests.abuse_peers import FakeWorker
from tests.conftest import free_port, run, until


class Answers:
    """A resolver whose answer the test sets."""

    def __init__(self, ips: list[str]) -> None:
        self.ips = ips

    async def resolve(self, name: str) -> list[str] | None:
        return list(self.ips)


async def _ends_unavailable(st) -> None:
    """A swept request's stream ends with ``unavailable`` (resubmittable), never a result."""
    try:
        await st.result()
    except Exception as exc:  # noqa: BLE001 - which error is the assertion
        assert getattr(exc, "code", None) is ErrorCode.UNAVAILABLE, repr(exc)
    else:
        raise AssertionError("a swept request returned a result")


def test_a_reply_arriving_as_the_link_retires_still_reaches_its_stream(procs):
    """The retiring link's first look for queued replies (``_drain_replies``) must not lose the
    receive task's wake-up. Before: it read ZMQ_EVENTS through pyzmq's raw ``getsockopt``, which
    processes the socket's command mailbox and clears its file descriptor without telling the
    pending ``recv_multipart``; a CHUNK that reached the DEALER after the loop's last poll was
    never read, nor anything after it (libzmq signals a pipe once until it is read dry). The
    stream had output, so the retire kept it open while the link stayed up, and it waited for
    its deadline: ``deadline_exceeded``, "no reply from the broker before the deadline"."""
    port = free_port("127.0.0.1")
    b = procs.broker("b", "--heartbeat-ms", "1000", frontend=f"tcp://127.0.0.1:{port}")

    async def body():
        go = asyncio.Event()
        held: dict[str, P.Request] = {}

        async def behaviour(w: FakeWorker, r: P.Request) -> None:  # chunk 0; chunk 1 is the test's; then the rest
            held["r"] = r
            await w.send(P.encode_worker_chunk(r.rid, r.attempt, 0, {"token_ids": [10]}))
            await go.wait()
            await w.send(P.encode_worker_chunk(r.rid, r.attempt, 2, {"token_ids": [12]}))
            await w.send(P.encode_worker_final(r.rid, r.attempt, "length", {"prompt_tokens": 3, "completion_tokens": 3}))

        w = await FakeWorker(b.backend, "w", behaviour, heartbeat_ms=1000).start()
        try:
            await wait_for_workers(b.frontend, 1)
            resolver = Answers(["127.0.0.1"])
            # refreshed by the test only: the retire happens exactly where the test calls it
            async with Client(f"dns+tcp://brokers.test:{port}", discovery_refresh_s=3600, resolver=resolver) as c:
                (link,) = c.links
                await until(lambda: link.up, 10, "the link up")
                st = await c.submit(input_ids=[1, 2, 3], max_new_tokens=3, deadline_ms=3_000)
                await until(lambda: st.chunks == 1, 10, "the stream started")
                await asyncio.sleep(0.05)  # quiet: every signal on the link's socket has been handled
                r = held["r"]
                fd = link.sock.getsockopt(zmq.FD)

                def reply_arrives() -> None:
                    # Runs after the loop's poll and before the retire's first step (both are
                    # in this iteration's ready queue, in this order): chunk 1 goes through the
                    # broker and reaches the DEALER (its descriptor turns readable) meanwhile.
                    w.sock.send_multipart(P.encode_worker_chunk(r.rid, r.attempt, 1, {"token_ids": [11]}))
                    assert select.select([fd], [], [], 5.0)[0], "chunk 1 never reached the client's socket"

                asyncio.get_running_loop().call_soon(reply_arrives)
                resolver.ips = []
                await c.refresh_discovery()  # the broker left the answer: the link retires (a task, queued)
                assert link not in c.links and link in c._retiring
                go.set()
                res = await st.result()  # bounded: deadline + grace
                assert res.token_ids == [10, 11, 12] and res.finish_reason == "length"
                await until(lambda: not c._retiring, 5, "the retired link closed")
                assert link.sock.closed and c.open_streams == 0
        finally:
            await w.close()

    run(body(), 30)


def test_a_link_that_leaves_again_before_a_waiting_submit_resumes_is_waited_for_again():
    """A submit waiting for a link (the name resolved to nothing) is woken when one opens, and
    resumes a few loop iterations later (``asyncio.wait_for`` runs the wait as a task of its own
    on Python 3.11): a flapping answer can retire the link in between. Before: ``_pick`` on no
    link raised IndexError out of submit (and generate). Now the submit waits again, bounded by
    its deadline. No broker: nothing listens at the address, the request never gets that far."""
    port = free_port("127.0.0.1")

    async def body():
        resolver = Answers([])
        async with Client(f"dns+tcp://brokers.test:{port}", discovery_refresh_s=3600, resolver=resolver) as c:
            sub = asyncio.create_task(c.submit(input_ids=[1, 2, 3], max_new_tokens=1, deadline_ms=1_000))
            await asyncio.sleep(0.05)  # the submit waits for a link
            assert not sub.done() and not c.links
            resolver.ips = ["127.0.0.1"]
            await c.refresh_discovery()  # a link opens: the submit's wait ends...
            await asyncio.sleep(0)  # (its wait task returns; the submit itself resumes two iterations later)
            resolver.ips = []
            await c.refresh_discovery()  # ...and the link is gone again before the submit resumes
            assert not c.links
            try:
                await sub
            except Exception as exc:  # noqa: BLE001 - which error is the assertion
                err = exc
            else:
                raise AssertionError("a submit with no link returned a stream")
            assert getattr(err, "code", None) is ErrorCode.DEADLINE_EXCEEDED, repr(err)
            assert c.open_streams == 0

    run(body(), 30)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's wait_for runs the send inline: no iteration between "
                                                        "registering a request and sending it")
def test_a_request_swept_before_its_send_ran_never_reaches_the_broker(procs):
    """``submit`` registers a request on its link, then sends it from a task of its own
    (``asyncio.wait_for`` on 3.11), an iteration later. A sweep of the link landing in between
    (its retire, or its loss while it drains) fails the request ``unavailable``, and ``generate``
    resubmits it elsewhere. Before: the SUBMIT still went out after that, and the broker ran a
    copy nobody read. Now the send is skipped: the worker's first request is the next one."""
    port = free_port("127.0.0.1")
    b = procs.broker("b", "--heartbeat-ms", "1000", frontend=f"tcp://127.0.0.1:{port}")

    async def body():
        seen: list[list[int]] = []

        async def behaviour(w: FakeWorker, r: P.Request) -> None:
            seen.append(list(r.submit.input_ids or []))
            await w.send(P.encode_worker_final(r.rid, r.attempt, "length", {"prompt_tokens": 3, "completion_tokens": 0}))

        w = await FakeWorker(b.backend, "w", behaviour, heartbeat_ms=1000).start()
        try:
            await wait_for_workers(b.frontend, 1)
            async with Client(b.frontend) as c:
                (link,) = c.links
                await until(lambda: link.up, 10, "the link up")
                sub = asyncio.create_task(c.submit(input_ids=[1, 1, 1], max_new_tokens=1, deadline_ms=3_000))
                await asyncio.sleep(0)  # the submit registered its request; its send is a queued task
                (rid,) = link.pending
                assert c._fail_pending(link, "swept") == [rid]  # the sweep lands before the send runs
                st = await sub
                await _ends_unavailable(st)
                res = await c.generate(input_ids=[2, 2, 2], max_new_tokens=1, deadline_ms=5_000)
                assert res.finish_reason == "length"
                assert seen == [[2, 2, 2]]  # the swept request never ran: the broker got the next one first
        finally:
            await w.close()

    run(body(), 30)


def test_a_submit_queued_when_its_link_is_lost_is_followed_by_its_cancel():
    """The client's DEALER keeps what it had not written when a connection drops and sends it on
    reconnect. A request that was queued so when the link's loss swept it (``unavailable``:
    ``generate`` resubmits it elsewhere) would run at that broker too. Now the sweep queues a
    CANCEL behind it. Forced: the SUBMIT is queued while no broker listens, the sweep runs, then
    a ROUTER binds and reads what arrives, in order."""
    port = free_port("127.0.0.1")
    ep = f"tcp://127.0.0.1:{port}"

    async def body():
        async with Client(ep) as c:
            (link,) = c.links
            st = await c.submit(input_ids=[1, 1, 1], max_new_tokens=1, deadline_ms=10_000)
            assert link.pending == {st.rid} and not link.up  # queued on the DEALER, nothing listening
            await c._on_link_lost(link)  # what the monitor's DISCONNECTED runs
            await _ends_unavailable(st)
            ctx = zmq.asyncio.Context.instance()
            router = ctx.socket(zmq.ROUTER)
            router.linger = 0
            router.bind(ep)
            try:
                got = []
                while len(got) < 2:
                    assert await router.poll(10_000), f"only {got} arrived"
                    got.append(P.decode_client((await router.recv_multipart())[1:]))
            finally:
                router.close(0)
            assert isinstance(got[0], P.Submit) and got[0].rid == st.rid
            assert isinstance(got[1], P.Cancel) and got[1].rid == st.rid

    run(body(), 30)
