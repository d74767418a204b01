"""One router factory (mesh.routing.factory) for the broker and the simulator; the lab's commands
without the lab extra."""

from __future__ import annotations

import random

import pytest

from mesh.config import BrokerSettings, build
from mesh.routing.bucket_router import BucketRouter
from mesh.routing.factory import make_router
from mesh.routing.router import Router, make_policy


def test_plain_router_without_buckets_or_pd_and_the_bucket_router_with_them():
    pol = make_policy("round_robin")
    assert type(make_router(pol)) is Router
    r = make_router(pol, pd=True, rng=random.Random(1), freshness_s=2.0, global_cache_winner=False,
                    decode_policy="legacy_host_affinity")
    assert isinstance(r, BucketRouter) and r.pd and r.freshness_s == 2.0
    assert (r.global_cache_winner, r.decode_policy) == (False, "legacy_host_affinity")


def test_the_broker_and_the_simulator_say_the_same_through_it():
    from brokers.main import build_broker
    from mesh.lab.sim.fleet import make_router as sim_router
    from mesh.lab.sim.runner import SimConfig

    b = build_broker(build(BrokerSettings, {"policy": "round_robin", "pd": True, "global_cache_winner": False,
                                            "decode_policy": "legacy_host_affinity"}))
    try:
        assert (b.router.global_cache_winner, b.router.decode_policy) == (False, "legacy_host_affinity")
    finally:
        b.close()
    cfg = SimConfig(workload="zipf", pd=(2, 2), global_cache_winner=False, decode_policy="legacy_host_affinity")
    cfg.validate()
    r = sim_router(cfg, make_policy("round_robin"), None, 0)
    assert isinstance(r, BucketRouter) and (r.global_cache_winner, r.decode_policy) == (False, "legacy_host_affinity")


def test_a_lab_command_without_the_lab_extra_names_it_in_one_line(monkeypatch, capsys):
    import mesh.lab
    from mesh.cli import main

    monkeypatch.setattr(mesh.lab, "REQUIRES", ("no_such_module_for_this_test",))
    monkeypatch.setattr(mesh.lab, "COMMAND_REQUIRES", {"up": ("no_such_module_for_this_test",)})
    for cmd in ("sim", "bench", "fuzz", "up"):
        assert main([cmd, "--help"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pip install 'mesh-router[lab]'" in err, err
    with pytest.raises(SystemExit) as exc:  # a product command does not ask for it
        main(["keygen", "--help"])
    assert exc.value.code == 0
