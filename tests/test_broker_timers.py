"""The broker core's timer bookkeeping, driven through its public inputs in virtual time."""

from __future__ import annotations

from brokers.main import build_broker
from mesh import protocol as P
from mesh.broker_core import HB_SLICES, BrokerCore
from mesh.config import BrokerSettings, build


def _core_with_workers(n: int, **settings) -> BrokerCore:
    b = build_broker(build(BrokerSettings, {"policy": "power_of_two", "default_deadline_ms": 60_000, **settings}))
    core = BrokerCore(b.s, b.router)
    core.start(100.0)
    for i in range(n):
        ident = f"id{i}".encode()
        core.worker_frames([ident, *P.encode_ready(P.Ready(f"w{i}", "m", "mixed", {}, 16, 256, 400_000, 1, 1, 500))], 100.0)
        core.worker_frames([ident, *P.encode_heartbeat()], 100.0)  # its first heartbeat confirms it
    core.take()
    return core


def test_finished_requests_do_not_keep_the_deadline_timer_busy():
    """Deadlines of finished requests stay in the heap (lazy deletion); the next wake-up must skip
    them, or a busy broker would wake once per finished request when their deadlines come due."""
    core = _core_with_workers(4)
    client = b"\x00client-1"
    now = 100.0
    for i in range(200):
        core.client_frames([client, *P.encode_submit(f"r{i}", input_ids=[1, 2, 3], params={"max_new_tokens": 1},
                                                     stream=False, deadline_ms=1_000)], now, local=True)
        (req,) = [s for s in core.take() if s.frames[1:2] == [bytes([P.Cmd.REQUEST])]]
        inf = core.inflight[max(core.inflight)]
        fin = P.encode_worker_final(inf.rid, inf.attempt, "length", {"prompt_tokens": 3, "completion_tokens": 1,
                                                                     "cached_tokens": 0}, {"token_ids": [1]})
        core.worker_frames([req.identity, *fin], now)
        assert [s.frames[1] for s in core.take()] == [bytes([P.Cmd.C_FINAL])]
    assert not core.inflight and core.pending_deadlines == 200  # all finished, all still in the heap
    core.client_frames([client, *P.encode_submit("live", input_ids=[1], params={"max_new_tokens": 1},
                                                 stream=False, deadline_ms=50_000)], now, local=True)
    wake = core.wakeup_s()
    assert core.pending_deadlines == 1  # the finished requests' entries were dropped from the top
    # the next wake-up is the next heartbeat slice / sweep, not a dead request's deadline
    assert wake > now and wake <= now + 0.5 / HB_SLICES + 1e-9


def test_deadline_tick_fails_the_request_and_cancels_it_on_the_worker():
    core = _core_with_workers(1)
    client = b"c1"
    core.client_frames([client, *P.encode_submit("r", input_ids=[1, 2], params={"max_new_tokens": 4},
                                                 stream=False, deadline_ms=200)], 100.0)
    core.take()
    core.tick(100.1)
    assert core.inflight  # not yet
    core.tick(100.25)
    sends = core.take()
    cmds = [(s.to, s.frames[1]) for s in sends if s.frames[1] != bytes([P.Cmd.HEARTBEAT])]
    assert (0, bytes([P.Cmd.CANCEL])) in cmds
    err = [s for s in sends if s.frames[1] == bytes([P.Cmd.C_ERROR])]
    assert len(err) == 1 and P.decode_client_reply(err[0].frames).code == "deadline_exceeded"
    assert not core.inflight
