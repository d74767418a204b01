"""The misuse table (issue 30): every command's documented misuse is ONE line on stderr naming
the fix, exit code 2, no traceback, found before any process starts.

Each row is a real ``mesh`` process. The rows run a few at a time (one module fixture) and each
row is its own test, so a regression names its command line.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BUSY = "{busy}"  # replaced by a port something listens on
NOWHERE = "/nonexistent-mesh-dir"

#: (command line, a fragment the one line must contain: the flag or the fix it names)
MISUSES: list[tuple[str, str]] = [
    # a busy port, on every command that listens
    (f"broker --frontend tcp://127.0.0.1:{BUSY} --backend tcp://127.0.0.1:0", "frontend: tcp://127.0.0.1:"),
    (f"broker --frontend tcp://127.0.0.1:0 --backend tcp://127.0.0.1:{BUSY}", "backend: tcp://127.0.0.1:"),
    (f"broker --frontend tcp://127.0.0.1:0 --backend tcp://127.0.0.1:0 --telemetry tcp://127.0.0.1:{BUSY}", "telemetry:"),
    (f"broker --frontend tcp://127.0.0.1:0 --backend tcp://127.0.0.1:0 --http 127.0.0.1:{BUSY}", "http: 127.0.0.1:"),
    (f"broker --frontend tcp://127.0.0.1:0 --backend tcp://127.0.0.1:0 --metrics 127.0.0.1:{BUSY}", "metrics: 127.0.0.1:"),
    (f"stub-sglang --port {BUSY}", "already in use"),
    (f"stub-sglang --port 0 --kv-port {BUSY}", "already in use"),
    (f"instant-engine --port {BUSY}", "already in use"),
    (f"up --http 127.0.0.1:{BUSY}", "http: 127.0.0.1:"),
    (f"up --telemetry tcp://127.0.0.1:{BUSY}", "telemetry: 127.0.0.1:"),
    # endpoints and URLs without their scheme, bad addresses
    ("top --telemetry 127.0.0.1:5000", "did you mean tcp://127.0.0.1:5000"),
    ("broker --frontend 127.0.0.1:5555 --backend tcp://127.0.0.1:0", "frontend:"),
    ("worker-stub --broker 127.0.0.1:5555", "brokers:"),
    ("attach sglang --url localhost:30000 --broker tcp://127.0.0.1:5555", "url:"),
    ("attach sglang --url http://127.0.0.1:30000 --broker 127.0.0.1:5555", "brokers:"),
    ("gateway --broker 127.0.0.1:1", "broker:"),
    ("gateway --broker tcp://127.0.0.1:1 --http nope", "http:"),
    ("gateway --broker tcp://127.0.0.1:1 --processes 0", "processes:"),
    (f"gateway --broker tcp://127.0.0.1:1 --http 127.0.0.1:{BUSY} --processes 2", "already in use"),
    ("indexer --listen nope", "listen:"),
    ("ctl --url nope workers", "--url"),
    ("up --telemetry 127.0.0.1:9", "--telemetry"),
    ("up --http 8000", "--http"),
    ("fuzz --broker-frontend nope", "--broker-frontend"),
    ("fuzz --broker-frontend tcp://127.0.0.1:1", "--broker-backend"),
    # numbers out of range
    ("up --rate 0", "--rate: must be > 0"),
    ("up --duration -1", "--duration"),
    ("up --workers 0", "--workers"),
    ("up --max-new-tokens -5", "--max-new-tokens"),
    ("up --time-scale 0", "--time-scale"),
    ("up --rate nan", "--rate"),
    ("top --telemetry tcp://127.0.0.1:1 --duration -1", "--duration"),
    ("worker-stub --broker tcp://127.0.0.1:5555 --count -1", "count:"),
    ("attach vllm --url http://127.0.0.1:30000 --broker tcp://127.0.0.1:5555 --heartbeat-ms -5", "heartbeat_ms"),
    ("stub-sglang --port -3", "--port"),
    ("stub-sglang --port 0 --time-scale 0", "--time-scale"),
    ("instant-engine --port 70000", "--port"),
    ("ctl --timeout-s -1 workers", "--timeout-s"),
    ("bench routing --sizes x", "--sizes"),
    ("bench routing --decisions 0", "--decisions"),
    ("bench routing --regret-audit maybe", "--regret-audit"),
    ("broker --regret-audit maybe", "--regret-audit"),
    ("broker --frontend tcp://127.0.0.1:0 --backend tcp://127.0.0.1:0 --attach sglang", "attach: expected KIND=URL"),
    ("bench broker --rounds 0", "--rounds"),
    ("bench broker --workers -1", "--workers"),
    ("bench exchange --intervals-ms x", "--intervals-ms"),
    ("bench indexer --workers -5", "--workers"),
    ("bench http --seconds -1", "--seconds"),
    ("fuzz --seconds -1", "--seconds"),
    ("sim --workload shared_prefix --rate -1 --duration-s 1", "rate"),
    ("sim --workload shared_prefix --workers 0 --duration-s 1", "workers"),
    # names that do not exist
    ("up --policy bogus", "--policy: invalid choice: 'bogus'"),
    ("sim --workload shared_prefix --policy bogus --duration-s 1", "unknown policy 'bogus'"),
    ("ctl drain", "needs a worker id"),
    ("keygen ../x --dir /tmp", "name"),
    # files and folders that do not exist
    (f"worker-stub --broker tcp://127.0.0.1:5555 --config {NOWHERE}/x.toml", "does not exist"),
    (f"gateway --broker tcp://127.0.0.1:1 --http 127.0.0.1:0 --api-key-file {NOWHERE}/key", "api_key_file"),
    (f"gateway --broker tcp://127.0.0.1:1 --http 127.0.0.1:0 --tokenizer {NOWHERE}", "tokenizer"),
    (f"gateway --broker tcp://127.0.0.1:1 --http 127.0.0.1:0 --processes 2 --tokenizer {NOWHERE}", "tokenizer"),
    (f"gateway --broker tcp://127.0.0.1:1 --http 127.0.0.1:0 --keys-file {NOWHERE}/keys.toml", "keys_file"),
    (f"broker --keys-file {NOWHERE}/keys.toml", "keys_file"),
    ("broker --trust-client-tenant", "trust_client_tenant"),
    ("sim --fairness --tenant a:urgent:1:0.5", "tenant"),
    (f"keygen x --dir /proc/{NOWHERE}", "--dir"),
    (f"up --json {NOWHERE}/x.json", "--json"),
    (f"up --log-dir /proc/{NOWHERE}", "log_dir"),
    (f"bench routing --json {NOWHERE}/x.json", "--json"),
    (f"bench http --tokenizer {NOWHERE}", "tokenizer"),
    (f"bench tokenizer --model-dir {NOWHERE}", "no such directory"),
    (f"sim --trace {NOWHERE}/t.jsonl", "cannot read trace"),
    (f"sim --matrix {NOWHERE}/m.toml", "does not exist"),
    (f"report {NOWHERE}/r.json", "No such file"),
]

#: Rows whose command prints a JSON log line of its own before the error (a process that logs
#: its stop): the error line is still the only line that is not a log record.
_LOG_LINES_OK = ("gateway",)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    busy = held.getsockname()[1]

    dirs = {row: tmp_path_factory.mktemp("up") for row, _ in MISUSES}  # made here: mktemp from threads races

    def one(row: str) -> tuple[int, str, Path]:
        log_dir = dirs[row]
        argv = row.replace(BUSY, str(busy)).split()
        if argv[0] == "up" and "--log-dir" not in argv:
            argv += ["--log-dir", str(log_dir)]
        p = subprocess.run([sys.executable, "-m", "mesh.cli", *argv], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
        return p.returncode, p.stderr + p.stdout, log_dir

    try:
        with ThreadPoolExecutor(4) as pool:
            return dict(zip([r for r, _ in MISUSES], pool.map(one, [r for r, _ in MISUSES])))
    finally:
        held.close()


@pytest.mark.parametrize("row,fragment", MISUSES, ids=[r for r, _ in MISUSES])
def test_misuse_is_one_line_naming_the_fix(results, row: str, fragment: str) -> None:
    rc, out, log_dir = results[row]
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    if row.split()[0] in _LOG_LINES_OK:
        lines = [ln for ln in lines if not ln.startswith("{")]
    assert rc == 2, (rc, out)
    assert len(lines) == 1, out
    assert fragment in lines[0], lines[0]
    assert lines[0].startswith("mesh"), lines[0]
    if row.startswith("up "):  # found before any process started: not one log file
        assert not list(log_dir.glob("*.log")), list(log_dir.iterdir())


def test_top_on_a_dead_endpoint_says_nothing_is_connected() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ep = f"tcp://127.0.0.1:{port}"
    p = subprocess.run([sys.executable, "-m", "mesh.cli", "top", "--telemetry", ep, "--duration", "4.5"],
                       capture_output=True, text=True, timeout=60, env={"COLUMNS": "400", **__import__("os").environ})
    assert p.returncode == 0, p.stderr
    assert f"nothing connected at {ep}" in p.stdout, p.stdout
