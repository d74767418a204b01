"""Configuration: validation names the field; TOML and flags merge; the CLI exits 2 with the message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mesh.config import BrokerSettings, WorkerSettings, build, load_toml
from mesh.errors import ConfigError
from mesh.retry import RetryBudget, RetryPolicy

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("values,field", [
    ({"heartbeat_ms": 0}, "heartbeat_ms"),
    ({"liveness": 0}, "liveness"),
    ({"max_attempts": 0}, "max_attempts"),
    ({"retry_base_ms": 500.0}, "retry_base_ms"),
    ({"retry_budget_ratio": 2.0}, "retry_budget_ratio"),
    ({"frontend": "http://x"}, "frontend"),
    ({"heartbeat_ms": "fast"}, "heartbeat_ms"),
    ({"log_level": "loud"}, "log_level"),
    ({"no_such_thing": 1}, "no_such_thing"),
    ({"exchange": "http://x"}, "exchange"),
    ({"peer": ["tcp://127.0.0.1:1"]}, "peer"),  # --peer without --exchange
    ({"exchange": "tcp://127.0.0.1:*", "peer": ["tcp://127.0.0.1:*"]}, "peer"),
    ({"exchange": "tcp://127.0.0.1:*", "exchange_interval_ms": -1}, "exchange_interval_ms"),
    ({"exchange": "tcp://127.0.0.1:*", "exchange_stale_ms": 10, "exchange_interval_ms": 5}, "exchange_stale_ms"),
])
def test_broker_settings_errors_name_the_field(values, field):
    with pytest.raises(ConfigError, match=field):
        build(BrokerSettings, values)


def test_exchange_settings_from_flags_and_toml():
    s = build(BrokerSettings, {"exchange": "tcp://127.0.0.1:*", "peer": ["tcp://10.0.0.2:5600", "tcp://10.0.0.3:5600"],
                               "exchange_interval_ms": 2, "exchange_stale_ms": 1500})
    assert s.peer == ("tcp://10.0.0.2:5600", "tcp://10.0.0.3:5600") and s.exchange_interval_ms == 2.0
    assert build(BrokerSettings, {}).exchange == "" and build(BrokerSettings, {}).peer == ()


def test_worker_settings_errors():
    with pytest.raises(ConfigError, match="role"):
        build(WorkerSettings, {"role": "gpu"})
    with pytest.raises(ConfigError, match="labels"):
        build(WorkerSettings, {"labels": {"a": 1}})
    assert build(WorkerSettings, {"brokers": "tcp://127.0.0.1:1"}).brokers == ("tcp://127.0.0.1:1",)


def test_example_configs_load_and_flags_win(tmp_path):
    for f in (REPO / "configs").glob("*.toml"):
        if f.name.startswith(("buckets", "quality-matrix")):  # a bucket config and the sim matrix, not settings
            continue
        build(BrokerSettings, load_toml(f, "broker"))
        build(WorkerSettings, load_toml(f, "worker"))
    s = build(BrokerSettings, load_toml(REPO / "configs" / "single-host.toml", "broker"), {"policy": "power_of_two"})
    assert s.policy == "power_of_two" and s.metrics == "127.0.0.1:9100"
    bad = tmp_path / "bad.toml"
    bad.write_text("[broker\\nx=")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_toml(bad, "broker")
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "missing.toml", "broker")


@pytest.mark.parametrize("argv,needle", [
    (["broker", "--heartbeat-ms", "-5"], "heartbeat_ms"),
    (["broker", "--policy", "nope"], "policy"),
    (["broker", "--cache-prefix-provider", "nope"], "cache_prefix_provider"),
    (["worker-stub", "--count", "0"], "count"),
    (["worker-stub", "--page-size", "0"], "page_size"),
])
def test_cli_rejects_bad_config_with_exit_2(argv, needle):
    p = subprocess.run([sys.executable, "-m", "mesh.cli", *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stderr[-500:])
    assert "configuration error" in p.stderr and needle in p.stderr


def test_retry_policy_and_budget():
    p = RetryPolicy(max_attempts=3, base_ms=25, cap_ms=250)
    for attempt in range(1, 8):
        d = p.delay_s(attempt)
        assert 0 <= d <= min(0.025 * 2 ** attempt, 0.25) + 1e-9
    assert p.should_retry(1, 1.0) and p.should_retry(2, 1.0) and not p.should_retry(3, 1.0)
    assert not p.should_retry(1, 0.0)
    with pytest.raises(ConfigError):
        RetryPolicy(max_attempts=0)
    b = RetryBudget(ratio=0.2, minimum=3)
    assert [b.try_acquire(10) for _ in range(4)] == [True, True, True, False]  # max(3, 2) = 3
    b.release()
    assert b.try_acquire(100)  # 20 allowed at 100 in flight


def _stub_parser():
    """A small argparse-only command (as stub-sglang's) for apply_toml_to_args."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--log-level", default="info")
    return p


def test_toml_for_argparse_commands(tmp_path):
    from mesh.config import apply_toml_to_args

    p = _stub_parser()
    f = tmp_path / "c.toml"
    f.write_text('[stub_sglang]\nport = 31000\nhost = "0.0.0.0"\n')
    args = p.parse_args(["--host", "10.1.1.1"])
    apply_toml_to_args(args, p, f, "stub_sglang", ["--host", "10.1.1.1"])
    assert args.port == 31000 and args.host == "10.1.1.1"  # file fills defaults, flags win
    f.write_text("[stub_sglang]\nnope = 1\n")
    with pytest.raises(ConfigError, match="nope"):
        apply_toml_to_args(p.parse_args([]), p, f, "stub_sglang", [])


def test_misspelled_table_or_key_is_an_error_naming_file_table_and_fix(tmp_path):
    from mesh.config import SETTINGS_TABLES, load_toml

    bad_table = tmp_path / "a.toml"
    bad_table.write_text("[brokr]\nheartbeat_ms = 200\n")
    with pytest.raises(ConfigError) as ei:
        load_toml(bad_table, "broker")
    msg = str(ei.value)
    assert str(bad_table) in msg and "[brokr]" in msg and "did you mean 'broker'" in msg
    bad_key = tmp_path / "b.toml"
    bad_key.write_text("[broker]\nheartbeat_mss = 200\n[worker]\n")
    assert load_toml(bad_key, "worker") == {}  # other tables' keys are theirs to check
    with pytest.raises(ConfigError) as ei:
        load_toml(bad_key, "broker", ["heartbeat_ms", "liveness"])
    msg = str(ei.value)
    assert msg.startswith("heartbeat_mss:") and "[broker]" in msg and str(bad_key) in msg and "'heartbeat_ms'" in msg
    # every table the shipped configs use is known
    for cfg in ("configs/single-host.toml", "configs/multi-host.toml"):
        for t in ("broker", "worker", "engine"):
            load_toml(cfg, t)
    assert "broker" in SETTINGS_TABLES


def test_broker_refuses_a_misspelled_table_at_startup(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "c.toml"
    cfg.write_text("[brokr]\nheartbeat_ms = 200\n")
    r = subprocess.run([sys.executable, "-m", "mesh.cli", "broker", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "unknown table [brokr]" in r.stderr and "did you mean 'broker'" in r.stderr
    assert "Traceback" not in r.stderr


def test_an_explicit_flag_wins_over_toml_even_at_its_default(tmp_path):
    from mesh.config import apply_toml_to_args

    p = _stub_parser()
    cfg = tmp_path / "s.toml"
    cfg.write_text("[stub_sglang]\nport = 31000\nlog_level = 'debug'\n")
    argv = ["--port", "30000"]  # explicitly the default: the flag must still win
    args = p.parse_args(argv)
    apply_toml_to_args(args, p, cfg, "stub_sglang", argv)
    assert args.port == 30000 and args.log_level == "debug"  # the file fills what was not given
    argv = ["--log-lev=info"]  # a unique prefix, argparse style
    args = p.parse_args(argv)
    apply_toml_to_args(args, p, cfg, "stub_sglang", argv)
    assert args.port == 31000 and args.log_level == "info"
    cfg.write_text("[stub_sglang]\nprot = 1\n")
    with pytest.raises(ConfigError, match="prot: unknown setting .*did you mean 'port'"):
        apply_toml_to_args(p.parse_args([]), p, cfg, "stub_sglang", [])


def test_one_log_level_flag_definition():
    # every command takes --log-level from mesh.logs.add_log_level_arg (one set of choices)
    defs = []
    for base in ("mesh", "brokers", "workers_stub"):
        for f in (REPO / base).rglob("*.py"):
            src = f.read_text()
            if 'add_argument("--log-level"' in src:
                defs.append(str(f.relative_to(REPO)))
    assert defs == ["mesh/logs.py"], defs
