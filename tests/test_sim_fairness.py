"""``mesh sim --fairness``: the fairness targets of issue 31 measured through the broker's own core
in virtual time (a small fleet, a short run: the full figures come from the command)."""

from __future__ import annotations

import json

import pytest

from mesh.errors import ConfigError
from mesh.lab.sim.fairness import TenantLoad, fairness_checks, parse_tenant, run_fairness


def test_the_fairness_targets_hold_in_a_short_run():
    r = fairness_checks(workers=4, duration_s=15.0, seed=1)
    assert r["flood"]["pass"], r["flood"]["p95_ratio"]
    assert r["bands"]["pass"], r["bands"]["p95_ratio"]
    flood = r["flood"]["with"]["tenants"]
    assert flood["a"]["refused"] == 0 and flood["b"]["refused"] > flood["b"]["served"]  # the flood pays, not a


def test_a_tenant_workload_of_your_own():
    r = run_fairness([TenantLoad("x", "critical", 1.0, 0.3), TenantLoad("y", "low", 2.0, 0.3)], workers=2, duration_s=5.0)
    assert set(r["tenants"]) == {"x", "y"} and all(t["offered"] == t["served"] for t in r["tenants"].values())


@pytest.mark.parametrize("spec", ["a:normal:1", "a:urgent:1:0.5", "a:low:x:0.5", "a:low:0:0.5", "a:low:1:-1"])
def test_bad_tenant_specs_name_the_option(spec):
    with pytest.raises(ConfigError, match="tenant"):
        parse_tenant(spec)


def test_mesh_sim_fairness_command(tmp_path, capsys):
    from mesh.cli import main

    out = tmp_path / "f.json"
    rc = main(["sim", "--fairness", "--tenant", "a:high:1:0.5", "--tenant", "b:low:1:1.0", "--workers", "2",
               "--duration-s", "5", "--json", str(out)])
    assert rc == 0 and "wait p50" in capsys.readouterr().out
    assert set(json.loads(out.read_text())["run"]["tenants"]) == {"a", "b"}
    assert main(["sim", "--workload", "zipf", "--tenant", "a:high:1:0.5"]) != 0
    assert "--tenant needs --fairness" in capsys.readouterr().err
