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
    ({"stall_escape_ms": -1}, "stall_escape_ms"),
    ({"stall_queue_ms": float("nan")}, "stall_queue_ms"),
    ({"stall_queue_ms": float("inf")}, "stall_queue_ms"),
    ({"rank_ties": "sometimes"}, "rank_ties"),
    ({"rank_window_ms": -1}, "rank_window_ms"),
    ({"rank_window_ms": float("nan")}, "rank_window_ms"),
    ({"rank_window_ms": float("inf")}, "rank_window_ms"),
    ({"rank_window_ms": 1e12}, "rank_window_ms"),
    ({"rank_window_prefills": -0.5}, "rank_window_prefills"),
    ({"rank_window_prefills": float("nan")}, "rank_window_prefills"),
    ({"rank_window_prefills": float("inf")}, "rank_window_prefills"),
    ({"rank_window_prefills": 1e9}, "rank_window_prefills"),
    ({"rank_window_prefills": "wide"}, "rank_window_prefills"),
    ({"rank_reach": -1}, "rank_reach"),
    ({"rank_reach": 10.5}, "rank_reach"),
    ({"rank_reach": "all"}, "rank_reach"),
])
def test_broker_settings_errors_name_the_field(values, field):
    with pytest.raises(ConfigError, match=field):
        build(BrokerSettings, values)


def test_exchange_settings_from_flags_and_toml():
    s = build(BrokerSettings, {"exchange": "tcp://127.0.0.1:*", "peer": ["tcp://10.0.0.2:5600", "tcp://10.0.0.3:5600"],
                               "exchange_interval_ms": 2, "exchange_stale_ms": 1500})
    assert s.peer == ("tcp://10.0.0.2:5600", "tcp://10.0.0.3:5600") and s.exchange_interval_ms == 2.0
    assert build(BrokerSettings, {}).exchange == "" and build(BrokerSettings, {}).peer == ()


def test_the_stall_escape_reaches_the_broker_policy():
    from brokers.main import build_broker

    b = build_broker(build(BrokerSettings, {"stall_escape_ms": 0, "stall_queue_ms": 250}))
    try:
        pol = b.router.policy
        assert (pol.stall_escape_ms, pol.stall_queue_ms) == (0.0, 250.0)
    finally:
        b.close()
    d = build_broker(build(BrokerSettings, {}))
    try:
        assert (d.router.policy.stall_escape_ms, d.router.policy.stall_queue_ms) == (200.0, 1000.0)
        pol = d.router.policy  # the window derived from 100 prefills, at most 1 s
        assert (pol.rank_ties, pol.window.prefills, pol.window.fixed_s) == ("misses", 100.0, None)
    finally:
        d.close()


def test_tie_parting_settings_reach_the_broker_policy():
    from brokers.main import build_broker

    b = build_broker(build(BrokerSettings, {"rank_ties": "off", "rank_window_ms": 25}))
    try:
        assert (b.router.policy.rank_ties, b.router.policy.rank_window_s) == ("off", 0.025)
    finally:
        b.close()
    b = build_broker(build(BrokerSettings, {"rank_window_prefills": 0.5}))
    try:
        assert (b.router.policy.window.prefills, b.router.policy.window.fixed_s) == (0.5, None)
    finally:
        b.close()


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


# ----------------------------------------------------------------------------- one settings mechanism
# Settings dataclasses declare their flags (mesh.settings_fields.setting); the parser is generated.


def _sub(name: str):
    """The ``mesh NAME`` subparser (``attach sglang`` for nested ones)."""
    import argparse

    from mesh.cli import build_parser

    p = build_parser()
    for part in name.split():
        act = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = act.choices[part]
    return p


def _parse(cmd: str, argv: list[str]):
    from mesh.cli import build_parser

    args = build_parser().parse_args([*cmd.split(), *argv])
    args._argv = [*cmd.split(), *argv]
    return args


def _dests(parser) -> dict[str, list[str]]:
    return {a.dest: a.option_strings for a in parser._actions if a.option_strings}


def test_every_broker_setting_is_a_generated_flag_or_marked_toml_only():
    import dataclasses

    from mesh.settings_fields import spec_of

    dests = _dests(_sub("broker"))
    for f in dataclasses.fields(BrokerSettings):
        spec = spec_of(f)
        assert spec is not None, f"{f.name}: declare it with setting() (help text, flag or cli=False)"
        if spec.cli:
            assert f.name in dests, f"{f.name} has no mesh broker flag"
            want = spec.flag or ("--no-" if f.default is True else "--") + f.name.replace("_", "-")
            assert dests[f.name] == [want]
    # and nothing else: every broker flag but --help/--config is a field
    # (--log-format rides with --log-level: mesh.logs.add_log_level_arg, recorded in the environment)
    assert set(dests) - {f.name for f in dataclasses.fields(BrokerSettings)} == {"help", "config", "log_format"}


def test_generated_flags_default_to_none_and_carry_types():
    args = _parse("broker", [])
    assert all(getattr(args, f) is None for f in ("heartbeat_ms", "pd", "global_cache_winner", "peer", "seed"))
    args = _parse("broker", ["--heartbeat-ms", "200", "--retry-base-ms", "10", "--pd", "--no-global-cache-winner",
                             "--peer", "tcp://a:1", "--peer", "tcp://b:1", "--seed", "7"])
    assert (args.heartbeat_ms, args.retry_base_ms, args.pd, args.global_cache_winner) == (200, 10.0, True, False)
    assert args.peer == ["tcp://a:1", "tcp://b:1"] and args.seed == 7


def test_precedence_flag_beats_file_beats_default(tmp_path):
    from mesh.config import settings_from_args

    cfg = tmp_path / "m.toml"
    cfg.write_text("[broker]\nheartbeat_ms = 200\nmax-attempts = 5\n")
    s = settings_from_args(BrokerSettings, _parse("broker", ["--config", str(cfg)]), "broker")
    assert (s.heartbeat_ms, s.max_attempts, s.liveness) == (200, 5, 3)  # file > default
    # an explicit flag wins even when it equals the default
    s = settings_from_args(BrokerSettings, _parse("broker", ["--config", str(cfg), "--heartbeat-ms", "500"]), "broker")
    assert (s.heartbeat_ms, s.max_attempts) == (500, 5)
    cfg.write_text("[broker]\npd = true\nglobal_cache_winner = false\n")
    s = settings_from_args(BrokerSettings, _parse("broker", ["--config", str(cfg)]), "broker")
    assert s.pd and not s.global_cache_winner


def test_unknown_key_names_file_table_key_and_suggestion(tmp_path):
    from mesh.config import settings_from_args

    cfg = tmp_path / "m.toml"
    cfg.write_text("[broker]\nheartbeat_mss = 200\n")
    with pytest.raises(ConfigError) as ei:
        settings_from_args(BrokerSettings, _parse("broker", ["--config", str(cfg)]), "broker")
    msg = str(ei.value)
    assert msg.startswith("heartbeat_mss:") and "[broker]" in msg and str(cfg) in msg and "'heartbeat_ms'" in msg


def test_help_shows_each_default_with_its_unit():
    import dataclasses

    from mesh.settings_fields import help_text, spec_of

    text = " ".join(_sub("broker").format_help().split())
    assert "application heartbeat interval (default 500 ms)" in text
    assert "how long SIGTERM waits for in-flight work (default 10 s)" in text
    assert "--decode-policy {power_of_two,legacy_host_affinity}" in text
    for f in dataclasses.fields(BrokerSettings):
        spec = spec_of(f)
        if f.name.endswith(("_ms", "_s")) and spec.cli:
            assert spec.unit == f.name.rsplit("_", 1)[1], f"{f.name}: unit {spec.unit!r}"
            assert help_text(f, spec).endswith(f" {spec.unit})"), help_text(f, spec)
    eng = " ".join(_sub("worker-stub").format_help().split())
    assert "--page-size PAGE_SIZE tokens per KV page (block) (default 16 tokens)" in eng


def test_engine_and_worker_settings_through_the_same_builder(tmp_path):
    from mesh.cli import _engine_cfg
    from mesh.config import settings_from_args

    cfg = tmp_path / "w.toml"
    cfg.write_text('[worker]\nbroker = "tcp://10.0.0.1:5556"\ncount = 2\n[engine]\npage_size = 32\ndecode_base_ms = 9\n')
    args = _parse("worker-stub", ["--config", str(cfg), "--page-size", "16", "--count", "1"])
    eng = _engine_cfg(args)
    assert (eng.page_size, eng.decode_base_ms) == (16, 9.0)  # flag (= default) > file
    w = settings_from_args(WorkerSettings, args, "worker")
    assert w.brokers == ("tcp://10.0.0.1:5556",) and w.count == 1  # a TOML key may use the flag's name
    cfg.write_text("[engine]\npage_sise = 32\n")
    with pytest.raises(ConfigError, match=r"page_sise: unknown setting in \[engine\] .*did you mean 'page_size'"):
        _engine_cfg(_parse("worker-stub", ["--config", str(cfg)]))
    cfg.write_text('[worker]\nbroker = "tcp://a:1"\nbrokers = ["tcp://b:1"]\n')
    with pytest.raises(ConfigError, match="brokers: given twice"):
        settings_from_args(WorkerSettings, _parse("worker-stub", ["--config", str(cfg)]), "worker")


def test_a_setting_without_a_declaration_cannot_become_a_flag():
    import argparse
    from dataclasses import dataclass

    from mesh.settings_fields import add_flags, setting

    @dataclass
    class S:
        a: int = setting(1, help="an a", unit="ms")
        b: int = 2

    with pytest.raises(TypeError, match="S.b has no setting"):
        add_flags(argparse.ArgumentParser(), S)
    p = argparse.ArgumentParser()
    assert add_flags(p, S, only=["a"]) == ["a"]
    assert "an a (default 1 ms)" in " ".join(p.format_help().split())


def test_sim_engine_model_from_flags_and_its_engine_table(tmp_path):
    from mesh.lab.sim.cli import config_from_args

    cfg = tmp_path / "e.toml"
    cfg.write_text("[engine]\npage_size = 32\nmax_running_requests = 8\n")
    args = _parse("sim", ["--workload", "zipf", "--config", str(cfg), "--page-size", "16"])
    eng = config_from_args(args).engine
    assert (eng.page_size, eng.max_running_requests) == (16, 8)  # flag (= default) > file > default
    with pytest.raises(ConfigError, match="page_size"):
        config_from_args(_parse("sim", ["--workload", "zipf", "--page-size", "0"]))
    cfg.write_text("[engine]\nmax_runing_requests = 8\n")
    with pytest.raises(ConfigError, match="max_runing_requests: unknown setting in .*did you mean 'max_running_requests'"):
        config_from_args(_parse("sim", ["--workload", "zipf", "--config", str(cfg)]))


def test_indexer_settings_are_a_dataclass_with_generated_flags(tmp_path):
    import dataclasses

    from mesh.indexer.cli import IndexerSettings, indexer_settings

    dests = _dests(_sub("indexer"))
    assert {f.name for f in dataclasses.fields(IndexerSettings)} <= set(dests)
    cfg = tmp_path / "ix.toml"
    cfg.write_text("[indexer]\nworker_ttl_s = 30\nmax_streams = 64\n")
    v = indexer_settings(_parse("indexer", ["--config", str(cfg), "--worker-ttl-s", "900"]))
    assert (v["worker_ttl_s"], v["max_streams"]) == (900.0, 64)
    cfg.write_text("[indexer]\nmax_stream = 64\n")
    with pytest.raises(ConfigError, match=r"max_stream: unknown setting in \[indexer\] of .*ix.toml.*'max_streams'"):
        indexer_settings(_parse("indexer", ["--config", str(cfg)]))
    cfg.write_text("[indexer]\nmax_streams = 'many'\n")
    with pytest.raises(ConfigError, match="max_streams: expected an integer"):
        indexer_settings(_parse("indexer", ["--config", str(cfg)]))


def test_attach_flags_and_attach_table_through_the_same_mechanism(tmp_path):
    import dataclasses

    from mesh.adapters.settings import AttachSettings
    from mesh.adapters.cli import _SPECS, settings_from_args

    assert set(_SPECS) == {f.name for f in dataclasses.fields(AttachSettings)}  # every field described
    sg, vl = _dests(_sub("attach sglang")), _dests(_sub("attach vllm"))
    flags = {n for n, s in _SPECS.items() if s.cli}
    assert flags <= set(sg) and flags - {"incremental_streaming", "bootstrap_host", "bootstrap_port"} <= set(vl)
    cfg = tmp_path / "a.toml"
    cfg.write_text('[attach]\nurl = "http://h:30000"\nbroker = ["tcp://b:1"]\nheartbeat_ms = 200\n'
                   'reconnect_cap_ms = 900\n[attach.labels]\nzone = "a"\n')
    s = settings_from_args(_parse("attach sglang", ["--config", str(cfg), "--label", "rack=7"]))
    assert s.brokers == ("tcp://b:1",) and s.heartbeat_ms == 200 and s.reconnect_cap_ms == 900.0
    assert s.labels == {"zone": "a", "rack": "7"}
    s = settings_from_args(_parse("attach sglang", ["--config", str(cfg), "--heartbeat-ms", "500"]))
    assert s.heartbeat_ms == 500  # an explicit flag at its default beats the file
    with pytest.raises(ConfigError, match="brokers: at least one"):
        settings_from_args(_parse("attach sglang", ["--url", "http://h:1"]))
    cfg.write_text('[attach]\nurl = "http://h:30000"\nhealth_paht = "/ready"\n')
    with pytest.raises(ConfigError, match=r"health_paht: unknown setting in \[attach\] .*'health_path'"):
        settings_from_args(_parse("attach sglang", ["--config", str(cfg)]))
    assert "(default required)" in " ".join(_sub("attach vllm").format_help().split())


def test_gateway_ingress_flags_are_the_brokers_fields(tmp_path):
    from brokers.gateway import _INGRESS_FIELDS

    gw, br = _dests(_sub("gateway")), _dests(_sub("broker"))
    for name in _INGRESS_FIELDS:
        assert gw[name] == br[name], name  # same flag, generated from the same BrokerSettings field
    gw_help, br_help = (" ".join(_sub(c).format_help().split()) for c in ("gateway", "broker"))
    assert "time to receive a complete request head (default 10 s)" in gw_help and \
        "time to receive a complete request head (default 10 s)" in br_help
    p = subprocess.run([sys.executable, "-m", "mesh.cli", "gateway", "--broker", "tcp://127.0.0.1:1",
                        "--http-idle-timeout-s", "0"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "http_idle_timeout_s" in p.stderr, p.stderr[-400:]


def test_log_format_console_gives_readable_lines(tmp_path):
    """--log-format console: key=value lines a person reads (readiness lines stay JSON)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MESH_LOG_FORMAT"}
    code = ("import sys; from mesh.cli import build_parser; from mesh.logs import configure, get_logger; "
            "a = build_parser().parse_args(sys.argv[1:]); configure('info'); get_logger(service='t').info('hello_event', n=1)")
    out = {}
    for fmt in ("json", "console"):
        r = subprocess.run([sys.executable, "-c", code, "broker", "--log-format", fmt], capture_output=True, text=True,
                           timeout=30, env=env)
        assert r.returncode == 0, r.stderr
        out[fmt] = r.stderr.strip().splitlines()[-1]
    assert out["json"].startswith("{") and '"event": "hello_event"' in out["json"]
    assert not out["console"].startswith("{") and "hello_event" in out["console"] and "n=1" in out["console"]
