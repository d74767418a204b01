"""A prompt longer than every worker's KV capacity is refused, also when it arrived while no worker
was registered (startup, or the fleet briefly gone on a busy machine): it is parked without a
capacity to check against, and refused when a worker registers, never sent to one. Found beside two
CPU burners: a 4M-token SUBMIT that arrived while the only worker was expired was dispatched to it
once it registered again (an ``Accepted``, not ``context_length_exceeded``). In-process broker core."""

from __future__ import annotations

from mesh import protocol as P
from mesh.broker_core.core import BrokerCore
from mesh.config import BrokerSettings, build
from mesh.errors import ErrorCode
from mesh.routing.router import Router, make_policy
from tests.core_support import outcomes


def _core() -> BrokerCore:
    core = BrokerCore(build(BrokerSettings, {"policy": "round_robin", "heartbeat_ms": 60_000, "max_worker_heartbeat_ms": 60_000}),
                      Router(make_policy("round_robin"), None))
    core.start(0.0)
    return core


def _join(core: BrokerCore, wid: str, capacity: int, now: float) -> None:
    core.worker_frames([wid.encode(), *P.encode_ready(P.Ready(wid, "m", "mixed", {}, 16, 64, capacity, 1, 1, 60_000))], now)
    core.worker_frames([wid.encode(), *P.encode_heartbeat()], now)


def test_a_prompt_parked_before_any_worker_is_refused_when_one_registers():
    core = _core()
    core.client_frames([b"c", *P.encode_submit("big", input_ids=[5] * 5000)], 0.0)
    core.client_frames([b"c", *P.encode_submit("small", input_ids=[5] * 100)], 0.0)
    assert outcomes(core.take()) == []  # no worker yet: both wait
    _join(core, "w", 4096, 1.0)  # it holds 4,096 tokens: the 5,000-token prompt can never run there
    got = outcomes(core.take())
    assert ErrorCode.CONTEXT_LENGTH_EXCEEDED.value in got and "w" in got and len(got) == 2, got
    assert core.stats.flat().get("requests.context_length_exceeded") == 1


def test_a_prompt_that_fits_is_checked_once():
    core = _core()
    _join(core, "w", 4096, 0.0)
    core.take()
    core.client_frames([b"c", *P.encode_submit("ok", input_ids=[5] * 100)], 1.0)
    assert outcomes(core.take()) == ["w"]
