"""Foreign models (issue 32): one unauthenticated READY announcing another model name must not
change what a request without a model means (it made every such request a 400, fleet-wide).

In-process broker core (fast); the real-process attack over ZeroMQ and HTTP is in
tests/test_models.py (``test_a_foreign_ready_...``)."""

from __future__ import annotations

import pytest

from mesh import protocol as P
from mesh.broker_core.core import BrokerCore
from mesh.broker_core.models import MAX_ADMITTED_MODELS, ModelGate
from mesh.broker_core.sends import TO_CLIENT, TO_WORKER
from mesh.config import BrokerSettings, build
from mesh.errors import ConfigError, ErrorCode
from mesh.routing.router import Router, make_policy


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def _rec(self, event: str, **kw) -> None:
        self.events.append((event, kw))

    info = warning = error = debug = exception = _rec


def _core(**settings) -> tuple[BrokerCore, _Log]:
    log = _Log()
    core = BrokerCore(build(BrokerSettings, {"policy": "round_robin", "heartbeat_ms": 60_000, "max_worker_heartbeat_ms": 60_000, **settings}),
                      Router(make_policy("round_robin"), None), log=log)
    core.start(0.0)
    return core, log


def _join(core: BrokerCore, wid: str, model: str, now: float) -> None:
    core.worker_frames([wid.encode(), *P.encode_ready(P.Ready(wid, model, "mixed", {}, 16, 64, 400_000, 1, 1, 60_000))], now)
    core.worker_frames([wid.encode(), *P.encode_heartbeat()], now)  # confirmed: routable unless held apart


_N = iter(range(10**9))


def _send(core: BrokerCore, model: str | None, now: float) -> str:
    """One request: the worker it was sent to, or its error code."""
    core.take()
    core.client_frames([b"client", *P.encode_submit(f"r{next(_N)}", input_ids=[1, 2, 3] * 8, model=model)], now)
    for s in core.take():
        if s.to == TO_WORKER and isinstance(P.decode_broker_to_worker(s.frames), P.Request):
            return s.identity.decode()
        if s.to == TO_CLIENT:
            m = P.decode_client_reply(s.frames)
            if isinstance(m, P.ClientError):
                return m.code
    return "parked"


def test_a_foreign_ready_is_held_apart_and_requests_without_a_model_stay_on_the_fleets_model():
    core, log = _core(model_settle_s=1.0)
    _join(core, "a0", "model-a", 0.0)
    _join(core, "a1", "model-a", 0.0)
    _join(core, "intruder", "model-b", 5.0)  # long after the fleet's rollout, no CURVE key
    for name in (None, "mesh", "model-a"):  # today: 400 "model is required" for the first two
        assert {_send(core, name, 6.0) for _ in range(4)} == {"a0", "a1"}, name
    assert _send(core, "model-b", 6.0) == ErrorCode.MODEL_NOT_FOUND.value  # never routed to
    assert core.status.served_models() == {"model-a": 2}
    broker = core.status.broker(6.0, "serving", 0, 0.0, 0.0)
    assert broker["quarantined"] == {"model-b": 1} and broker["default_model"] == "model-a"
    row = {w["worker_id"]: w for w in core.status.workers(6.0)}["intruder"]
    assert row["state"] == "quarantined" and row["healthy"] is False
    assert core.stats.flat()["workers.quarantined"] == 1
    assert [kw["worker_id"] for e, kw in log.events if e == "worker_quarantined"] == ["intruder"]
    # an operator admits it: its model is served by name; unnamed requests stay where the
    # long-registered majority is
    assert core.admin("admit", "intruder", 7.0)["state"] == "routable"
    assert _send(core, "model-b", 7.0) == "intruder"
    assert {_send(core, None, 7.0) for _ in range(4)} == {"a0", "a1"}
    with pytest.raises(ValueError, match="not quarantined"):
        core.admin("admit", "a0", 7.0)
    assert core.stats.workers["admitted_by_operator"] == 1


def test_the_rollout_window_a_trusted_key_and_the_allow_list():
    core, _ = _core(model_settle_s=1.0)
    _join(core, "a", "model-a", 0.0)
    _join(core, "b", "model-b", 0.5)  # within the rollout window: a two-model fleet, as before
    assert _send(core, "model-b", 1.0) == "b"
    assert _send(core, None, 1.0) == "a"  # 1:1, young: the first in name order
    assert _send(core, "mesh", 1.0) == "a"
    # --models: only the listed models are admitted, even at the first registration
    core, _ = _core(models=("model-b",))
    _join(core, "a", "model-a", 0.0)
    _join(core, "b", "model-b", 0.0)
    assert _send(core, None, 1.0) == "b" and _send(core, "model-a", 1.0) == ErrorCode.MODEL_NOT_FOUND.value
    # --default-model: what a request without a model means, whatever the majority
    core, _ = _core(default_model="model-b", model_settle_s=0.0)
    for i in range(3):
        _join(core, f"a{i}", "model-b" if i == 2 else "model-a", 0.0)
    assert _send(core, None, 5.0) == "a2"


def test_the_default_model_is_the_long_registered_majority_ties_by_name():
    gate = ModelGate(build(BrokerSettings, {"model_settle_s": 10.0}))
    reg = [("b", 0.0), ("b", 0.0), ("a", 0.0), ("a", 95.0), ("a", 95.0), ("a", 95.0)]
    assert gate.unnamed({"a", "b"}, reg, 100.0) == "b"  # three fresh "a" registrations do not outvote
    assert gate.unnamed({"a", "b"}, reg, 106.0) == "a"  # ... once they are long-registered they do
    assert gate.unnamed({"a", "b"}, [("b", 0.0), ("a", 0.0)], 50.0) == "a"  # a tie: first in name order
    assert gate.unnamed({"a", "b"}, [("c", 0.0)], 50.0) == "a"  # votes only for served models
    assert gate.unnamed(set(), [], 0.0) is None and gate.unnamed({"x"}, [], 0.0) == "x"
    # trusted (an allow-listed CURVE key) is never held apart; a model first seen late is
    gate.admit("a", 0.0)
    assert not gate.holds_apart("z", True, 99.0) and gate.holds_apart("z", False, 99.0)
    assert not gate.holds_apart("z", False, 5.0) and not gate.holds_apart("a", False, 99.0)


def test_a_flood_of_foreign_models_is_held_apart_and_bounded():
    core, _ = _core(model_settle_s=0.0, max_workers=2000)
    _join(core, "a", "model-a", 0.0)
    for i in range(1000):
        _join(core, f"x{i}", f"m-{i}-" + "y" * 200, 1.0)
    assert core.stats.workers["quarantined"] == 1000
    assert core.intake.models.admitted == {"model-a"}
    assert _send(core, None, 2.0) == "a"
    assert len(core.status.broker(2.0, "serving", 0, 0.0, 0.0)["quarantined"]) == 16
    gate = ModelGate(build(BrokerSettings, {}))
    for i in range(MAX_ADMITTED_MODELS + 10):
        gate.admit(str(i), 0.0)
    assert len(gate.admitted) == MAX_ADMITTED_MODELS


@pytest.mark.parametrize("field,value", [
    ("default_model", "x" * 257), ("default_model", "a\x00b"), ("models", ("",)), ("models", ("é" * 129,)),
    ("models", tuple(str(i) for i in range(1025))), ("model_settle_s", -1.0), ("model_settle_s", float("inf")),
])
def test_hostile_model_flags_are_config_errors_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        build(BrokerSettings, {field: value})
    with pytest.raises(ConfigError, match="default_model"):
        build(BrokerSettings, {"default_model": "c", "models": ("a", "b")})
    build(BrokerSettings, {"default_model": "fast", "models": ("a",), "model_alias": ("fast=a",)})


def test_a_worker_with_an_allow_listed_curve_key_brings_its_new_model_in():
    log = _Log()
    core = BrokerCore(build(BrokerSettings, {"policy": "round_robin", "model_settle_s": 0.0}),
                      Router(make_policy("round_robin"), None), log=log, worker_keys={b"K" * 32: "gpu"})
    core.start(0.0)
    for wid, model, now in (("gpu-0", "model-a", 0.0), ("gpu-1", "model-b", 50.0)):
        core.worker_frames([wid.encode(), *P.encode_ready(P.Ready(wid, model, "mixed", {}, 16, 64, 400_000, 1, 1, 500))],
                           now, peer_key=b"K" * 32)
        core.worker_frames([wid.encode(), *P.encode_heartbeat()], now)
    assert core.stats.workers["quarantined"] == 0 and core.status.served_models() == {"model-a": 1, "model-b": 1}
    assert _send(core, "model-b", 51.0) == "gpu-1" and _send(core, None, 51.0) == "gpu-0"  # 1:1: by name


def test_the_vote_follows_workers_becoming_long_registered_without_a_pool_change():
    core, _ = _core(model_settle_s=10.0)
    for wid, model, now in (("b0", "model-b", 0.0), ("b1", "model-b", 0.0), ("a0", "model-a", 5.0), ("a1", "model-a", 5.0),
                            ("a2", "model-a", 5.0)):
        _join(core, wid, model, now)
    assert _send(core, None, 6.0).startswith("a")  # nobody long-registered yet: every worker votes, 3:2
    assert _send(core, None, 11.0).startswith("b")  # only the b workers are long-registered
    assert _send(core, None, 16.0).startswith("a")  # now all are: 3:2 again
