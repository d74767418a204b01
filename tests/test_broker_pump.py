"""The broker shell's pump: the mailbox (HTTP submits, cancels, admin actions) within its budget."""

from __future__ import annotations

import asyncio
import time

import pytest

import brokers.broker as shell
from brokers.main import build_broker
from mesh.config import BrokerSettings, build


def _broker(name: str):
    b = build_broker(build(BrokerSettings, {"frontend": f"inproc://{name}-f", "backend": f"inproc://{name}-b"}))
    b.core.start(time.monotonic())
    return b


def test_a_mailbox_burst_stops_at_the_pump_budget_and_the_rest_waits_in_order():
    """Past its budget the mailbox handles one item and leaves the rest, in order, for the next
    pump (which reads the sockets first): a burst of HTTP submits cannot hold the worker replies
    queued behind it for longer than a pump's budget."""
    async def main() -> None:
        b = _broker("pump-budget")
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in range(3)]
        for f in futs:
            b.post("admin", ("list", "", None, f))
        b._drain_mail(budget_end=0.0)  # the pump's budget is spent already
        assert [f.done() for f in futs] == [True, False, False] and len(b._mail) == 2
        b._drain_mail()
        assert all(f.done() for f in futs) and not b._mail

    asyncio.run(main())


def test_a_pump_that_leaves_mail_keeps_the_gone_clients_until_their_cancels_ran(monkeypatch):
    """A local client that went away keeps its entry (replies to it are counted unreachable) until
    the mailbox holding its cancel is drained, also when that takes several pumps."""
    monkeypatch.setattr(shell, "_PUMP_BUDGET_S", -1.0)  # every pump is over budget: one mail item each
    monkeypatch.setattr(shell, "_MAIL_MIN_S", -1.0)

    async def main() -> None:
        b = _broker("pump-gone")
        b.bind()
        try:
            b._aloop = asyncio.get_running_loop()
            b._readers = [-1]  # as if the loop watched the sockets: a pump with mail left kicks another
            ident = b"\x00local-client-1"
            fut = b._aloop.create_future()
            b._local[ident] = asyncio.Queue()
            b.post("admin", ("list", "", None, fut))
            b.cancel(ident)
            b.forget(ident)
            b._pump_scheduled = False
            b._pump_once()
            assert fut.done() and len(b._mail) == 1  # the cancel is still queued
            assert ident in b._local and b._local[ident] is None and b._pump_scheduled  # kept; next pump asked for
            b._pump_once()
            assert not b._mail and ident not in b._local
        finally:
            b._readers = []
            b.close()

    asyncio.run(main())


@pytest.mark.parametrize("hold_s, flushes", [(10.0, [5]), (0.0, [1, 1, 1, 1, 1])])
def test_what_a_drained_batch_asks_to_send_goes_out_together_held_at_most_the_send_hold(monkeypatch, hold_s, flushes):
    """The sends of one socket batch are made together (one deliver, so a burst of SUBMITs'
    REQUESTs leave back to back), in the order the messages asked for them; none is held longer
    than ``_SEND_HOLD_S`` (at 0, each message's sends go out before the next is read)."""
    import zmq

    from mesh import protocol as P

    monkeypatch.setattr(shell, "_SEND_HOLD_S", hold_s)
    b = _broker(f"pump-batch-{len(flushes)}")
    b.bind()
    client = zmq.Context.shadow(b.ctx.underlying).socket(zmq.DEALER)
    try:
        client.connect(b.frontend_endpoint)
        for i in range(5):  # unreadable SUBMITs: each is answered bad_request
            client.send_multipart([P.CLIENT_HEADER, bytes([P.Cmd.C_SUBMIT]), b"\xc1" + bytes([i])])
        assert b._front.poll(5000)
        seen = []
        real = b._flush
        b._flush = lambda: (seen.append(len(b.core.out)), real())
        assert b._drain(b._front, b.core.client_frames) is False  # all read, the socket is idle
        assert seen == flushes
        replies = [P.decode_client_reply(client.recv_multipart()) for _ in range(5)]
        assert [r.code for r in replies] == ["bad_request"] * 5
    finally:
        client.close(linger=0)
        b.close()
