"""mesh sim with the broker's own lifecycle core: faults, P/D, and the accounting of losses."""

from __future__ import annotations

import pytest

from mesh.errors import ConfigError
from mesh.lab.sim.core_arm import FaultSpec, parse_faults
from mesh.lab.sim.runner import SimConfig, run_sim


def _run(faults=None, **kw):
    base = dict(workload="shared_prefix", rate=12, duration_s=12, workers=[8], routers=[2], seed=3,
                policies=["cache_aware"], providers=["radix_tree"], lifecycle="core", faults=faults)
    base.update(kw)
    (arm,) = run_sim(SimConfig(**base))["arms"]
    return arm


def _accounted(arm) -> None:
    """Every request ends exactly once, or is lost with a broker that restarted."""
    assert arm["duplicated"] == 0
    assert arm["requests_ok"] + sum(arm["failed"].values()) + arm["lost"] == arm["requests"]


def test_core_arm_without_faults_serves_everything_once():
    arm = _run()
    _accounted(arm)
    assert arm["lifecycle"] == "core"
    assert arm["requests_ok"] == arm["requests"] and arm["lost"] == 0 and arm["retried"] == 0
    assert arm["worker_events"]["registered"] == 16  # 8 workers x 2 routers, each READY once
    assert arm["hit_rate"] > 0.9 * arm["oracle_hit_rate"]  # shared prefixes land on their holders through the core


@pytest.mark.soak  # chaos/flood run: make soak
def test_worker_kills_are_retried_elsewhere_and_nothing_is_lost_or_duplicated():
    arm = _run("kill=20/min,down_s=3")
    _accounted(arm)
    assert arm["faults_injected"].get("kill", 0) >= 2
    assert arm["lost"] == 0  # only a broker restart can lose a request
    assert arm["worker_events"].get("connection_lost", 0) >= 1  # the broker noticed at its next send
    assert arm["retries"].get("worker_lost", 0) >= 1 and arm["retried"] >= 1
    # requests that had streamed nothing finished elsewhere; failures are mid-stream losses only
    assert set(arm["failed"]) <= {"worker_lost"}, arm["failed"]
    # a killed worker came back with a new epoch and registered again
    assert arm["worker_events"]["registered"] > 16


@pytest.mark.soak  # chaos/flood run: make soak
def test_paused_worker_is_expired_and_its_late_replies_are_stale():
    arm = _run("pause=16/min,pause_s=4", heartbeat_ms=200)
    _accounted(arm)
    assert arm["faults_injected"].get("pause", 0) >= 2
    assert arm["worker_events"].get("expired", 0) >= 1
    assert arm["lost"] == 0


@pytest.mark.soak  # chaos/flood run: make soak
def test_broker_restart_loses_only_what_it_held():
    arm = _run("broker_restart=10/min,broker_down_s=1")
    _accounted(arm)
    assert arm["faults_injected"].get("broker_restart", 0) >= 1
    # workers re-registered with the restarted broker (their heartbeat was refused, they sent READY)
    assert arm["worker_events"]["registered"] > 16
    assert arm["requests_ok"] > arm["requests"] // 2


@pytest.mark.soak  # chaos/flood run: make soak
def test_lost_kv_batches_are_resynced():
    arm = _run("kv_loss=0.2")
    _accounted(arm)
    assert arm["kv_batches_lost"] > 0 and arm["kv_resyncs"] > 0
    assert arm["requests_ok"] == arm["requests"]


@pytest.mark.soak  # chaos/flood run: make soak
def test_prefill_decode_runs_the_brokers_handoff():
    arm = _run(pd=(4, 4), workers=[8])
    _accounted(arm)
    # (the P/D pairing finds no decode worker for a couple of requests, as the routing-only arm does)
    assert arm["requests_ok"] >= 0.98 * arm["requests"] and set(arm["failed"]) <= {"no_worker"}
    assert arm["decisions"].get("pd_handoff") == arm["requests_ok"]  # every served request went through the handoff
    assert arm["retried"] == 0  # the decode leg is the second attempt by design, not a retry


def test_core_and_routing_only_arms_agree_without_faults():
    """The same stream through the broker's core and through routing-only arms: same decisions,
    the same hit rate within a point (the core's view differs only by reply timing)."""
    fast = _run(lifecycle="fast")
    core = _run(lifecycle="core")
    assert core["decisions"] == fast["decisions"]
    assert abs(core["hit_rate"] - fast["hit_rate"]) < 0.01
    assert core["requests_ok"] == fast["completed"]


def test_fault_spec_parsing_names_the_item():
    assert parse_faults("kill=2/min,pause=60/h,pause_s=3s,broker_restart=0.1/s,kv_loss=0.01") == FaultSpec(
        kill_per_min=2.0, pause_per_min=1.0, pause_s=3.0, broker_restart_per_min=6.0, kv_loss=0.01)
    for bad, needle in (("kil=2", "unknown key 'kil'"), ("kill=fast", "faults.kill"), ("kill", "KEY=VALUE"),
                        ("kv_loss=2", "probability"), ("pause_s=-1", "faults.pause_s")):
        with pytest.raises(ConfigError, match=needle):
            parse_faults(bad)
    with pytest.raises(ConfigError, match="faults.kill"):
        SimConfig(workload="zipf", faults="kill=x").validate()
