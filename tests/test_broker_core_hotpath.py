"""Per-request shortcuts of the broker core keep its answers: what they cache follows the pool."""

from __future__ import annotations

from brokers.main import build_broker
from mesh import protocol as P
from mesh.broker_core import BrokerCore
from mesh.config import BrokerSettings, build


def _core(models: list[str]) -> BrokerCore:
    b = build_broker(build(BrokerSettings, {"policy": "power_of_two", "default_deadline_ms": 60_000}))
    core = BrokerCore(b.s, b.router)
    core.start(100.0)
    for i, m in enumerate(models):
        ident = f"id{i}".encode()
        core.worker_frames([ident, *P.encode_ready(P.Ready(f"w{i}", m, "mixed", {}, 16, 256, 400_000, 1, 1, 500))], 100.0)
        core.worker_frames([ident, *P.encode_heartbeat()], 100.0)
    core.take()
    return core


def test_served_models_is_counted_once_per_pool_change_and_follows_it():
    """The HTTP ingress reads the served models several times per request: the answer is kept
    until the pool changes, and then it is the new one."""
    core = _core(["a", "a", "b"])
    first = core.status.served_models()
    assert first == {"a": 2, "b": 1}
    assert core.status.served_models() is first  # not recounted while nothing changed
    core.worker_frames([b"id2", *P.encode_disconnect("bye")], 101.0)  # b's only worker leaves
    assert core.status.served_models() == {"a": 2}
    core.admin("drain", "w0", 101.0)
    assert core.status.served_models() == {"a": 1}
    assert core.status.model_catalog()[0] == {"a": 1}
