"""``mesh gateway --processes N``: N gateway processes on one port (SO_REUSEPORT) under a supervisor
(brokers/gateway_supervisor.py). Fast: the flags' checks and the restart budget in process, and one
small real-process test (both processes answer, a killed one is restarted, the port cannot be split,
SIGTERM drains all); the attacks that take longer (a crash loop, a flood, a child that cannot start,
the parent killed) are ``soak``."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from brokers.gateway_supervisor import RestartBudget, check_processes, parse_slot
from mesh.cli import main
from mesh.errors import ConfigError
from mesh.lab.procs import ProcGroup, wait_for_log_event
from tests.conftest import run, until

_NO_BROKER = "tcp://127.0.0.1:9"  # nothing listens there: the gateway serves /metrics and 503s
_PROC = re.compile(r'^mesh_gateway_process_restarts\{process="(\d+)"\} ([0-9.]+)$', re.M)


# ----------------------------------------------------------------------------- in process


@pytest.mark.parametrize("flags, field", [
    (["--processes", "0"], "processes"), (["--processes", "65"], "processes"), (["--processes", "-3"], "processes"),
    (["--restart-budget", "-1"], "restart_budget"), (["--restart-budget", "100000"], "restart_budget"),
    (["--process-slot", "x"], "process_slot"), (["--process-slot", "1:99:0"], "process_slot"),
    (["--process-slot", "9" * 1000], "process_slot"), (["--process-slot", "987:0:0"], "process_slot"),
])
def test_a_bad_processes_flag_is_refused_at_startup_naming_the_field(flags, field, capsys):
    assert main(["gateway", "--broker", _NO_BROKER, "--http", "127.0.0.1:0", *flags]) == 2
    err = capsys.readouterr().err
    assert f"configuration error: {field}:" in err, err


def test_processes_must_be_an_integer():
    with pytest.raises(SystemExit):
        main(["gateway", "--broker", _NO_BROKER, "--processes", "two"])


def test_the_restart_budget_bounds_a_crash_loop_and_a_stable_process_gets_it_back():
    b = RestartBudget(2, stable_s=30.0)
    delays = [b.exited(0, 0.5), b.exited(0, 0.5)]
    assert all(d is not None and 0 <= d <= 5.0 for d in delays)  # backed off, capped
    assert b.exited(0, 0.5) is None  # the third crash in a row: given up
    assert b.restarts == {0: 2}
    b2 = RestartBudget(1, stable_s=30.0)
    assert b2.exited(1, 0.1) is not None
    assert b2.exited(1, 31.0) is not None  # it served 30 s: a new row
    assert b2.exited(1, 0.1) is None and b2.restarts == {1: 2}
    assert RestartBudget(0).exited(0, 100.0) is None  # no restarts at all


def test_more_than_one_process_needs_so_reuseport_balancing(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ConfigError, match="processes: 2 processes on one port need SO_REUSEPORT .*load balancer"):
        check_processes(2, 5)
    check_processes(1, 5)  # one process needs nothing of the kernel


def test_a_process_slot_is_parsed_strictly():
    assert parse_slot("5:1:3") == (5, 1, 3)
    for bad in ("", "1:2", "1:2:3:4", "-1:0:0", "a:b:c", "1:64:0", "1 :0:0"):
        with pytest.raises(ConfigError, match="process_slot"):
            parse_slot(bad)


# ----------------------------------------------------------------------------- real processes


def _group(procs: ProcGroup, name: str, *extra: str):
    p = procs.spawn(name, ["gateway", "--broker", _NO_BROKER, "--http", "127.0.0.1:0", "--processes", "2", *extra])
    url = wait_for_log_event(p.log_path, "gateway_listening", 60, p.popen, start=p.log_start)["url"]
    return p, url


def _pids(log) -> dict[int, int]:
    """process index -> pid of its latest start, from the supervisor's log."""
    out: dict[int, int] = {}
    for line in log.read_text().splitlines():
        if '"gateway_process_started"' in line:
            rec = json.loads(line)
            out[rec["process"]] = rec["pid"]
    return out


def _who(url: str) -> dict[int, float]:
    """process index -> its restarts, as /metrics says, over fresh connections until both answered once."""
    seen: dict[int, float] = {}
    for _ in range(200):
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:  # a new connection each time
            for i, n in _PROC.findall(r.read().decode()):
                seen[int(i)] = float(n)
        if len(seen) == 2:
            break
    return seen


def test_two_processes_on_one_port_both_answer_a_killed_one_is_restarted_and_the_port_is_not_split(procs):
    p, url = _group(procs, "gw")
    assert _who(url) == {0: 0.0, 1: 0.0}  # both serve the one port
    port = url.rsplit(":", 1)[1]
    first = _pids(p.log_path)
    os.kill(first[1], signal.SIGKILL)  # one child dies: restarted (counted), the other serves meanwhile
    rec = wait_for_log_event(p.log_path, "gateway_process_restarted", 30, p.popen, start=p.log_start)
    assert rec["process"] == 1 and rec["restarts"] == 1
    assert run(until(lambda: _who(url) == {0: 0.0, 1: 1.0}, 30, "the restarted process answers"), 60)
    # a plain gateway cannot take (a share of) the port the group serves: a clear error, no split
    plain = subprocess.run([sys.executable, "-m", "mesh.cli", "gateway", "--broker", _NO_BROKER, "--http", f"127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == 2 and "already in use" in plain.stderr, plain.stderr
    p.signal(signal.SIGTERM)  # forwarded: every child drains, the parent exits 0
    assert p.popen.wait(30) == 0
    stopped = wait_for_log_event(p.log_path, "gateway_stopped", 5, start=p.log_start)
    assert stopped.get("processes") == 2 and stopped["restarts"] == {"1": 1}
    for pid in _pids(p.log_path).values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.soak
def test_a_crash_looping_process_stops_being_restarted_and_the_other_serves_on(procs):
    p, url = _group(procs, "gw", "--restart-budget", "1")
    for n in range(2):  # killed as soon as it serves, twice in a row: the budget of 1 is spent
        pid = _pids(p.log_path)[1]
        os.kill(pid, signal.SIGKILL)
        if n == 0:
            wait_for_log_event(p.log_path, "gateway_process_restarted", 30, p.popen, start=p.log_start)
    rec = wait_for_log_event(p.log_path, "gateway_process_given_up", 30, p.popen, start=p.log_start)
    assert rec["process"] == 1 and "restart budget" in rec["why"]
    assert p.alive()
    assert all(set(_who_once(url)) == {0} for _ in range(20))  # only process 0 answers now, and it does


def _who_once(url: str) -> dict[int, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        return {int(i): float(n) for i, n in _PROC.findall(r.read().decode())}


@pytest.mark.soak
def test_a_flood_on_the_shared_port_is_bounded_per_process(procs):
    p, url = _group(procs, "gw", "--http-max-connections", "4", "--http-max-connections-per-address", "0")
    host, port = url[7:].rsplit(":", 1)
    flood = [socket.create_connection((host, int(port)), timeout=5) for _ in range(60)]  # idle: no request head

    def still_open() -> int:
        n = 0
        for s in flood:
            s.setblocking(False)
            try:
                n += s.recv(1, socket.MSG_PEEK) != b""  # data: the 503 of a refused one (closed after it)
            except BlockingIOError:
                n += 1
            except OSError:
                pass
        return n

    # each process evicts its longest-waiting connections past its own 4: at most 8 stay open, more than one
    # process's 4 (each keeps its own limit; nothing is shared, nothing unbounded)
    assert run(until(lambda: still_open() <= 8, 30, "evictions"), 60)
    assert still_open() > 4
    assert set(_who(url)) == {0, 1}  # and both still answer new connections
    for s in flood:
        s.close()


@pytest.mark.soak
def test_a_process_that_cannot_start_exits_the_supervisor_naming_why(tmp_path):
    (tmp_path / "tok").mkdir()
    r = subprocess.run([sys.executable, "-m", "mesh.cli", "gateway", "--broker", _NO_BROKER, "--http", "127.0.0.1:0",
                        "--processes", "2", "--tokenizer", str(tmp_path / "tok")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "gateway process" in r.stderr and "could not start" in r.stderr \
        and "tokenizer.json" in r.stderr, r.stderr
    with socket.socket() as held:  # a port a plain listener holds: refused before any child starts
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "mesh.cli", "gateway", "--broker", _NO_BROKER, "--http",
                            f"127.0.0.1:{port}", "--processes", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"127.0.0.1:{port} is already in use" in r.stderr, r.stderr


@pytest.mark.soak
def test_a_second_group_or_plain_gateway_on_the_same_port_is_refused_and_children_follow_a_killed_parent(procs):
    p, url = _group(procs, "gw")
    port = url.rsplit(":", 1)[1]
    second = subprocess.run([sys.executable, "-m", "mesh.cli", "gateway", "--broker", _NO_BROKER, "--http",
                             f"127.0.0.1:{port}", "--processes", "2"], capture_output=True, text=True, timeout=60)
    assert second.returncode == 2 and "another `mesh gateway --processes` group" in second.stderr, second.stderr
    children = _pids(p.log_path)
    p.signal(signal.SIGKILL)  # the parent dies: its children read EOF on their control sockets and drain

    def gone() -> bool:
        for pid in children.values():
            try:
                os.kill(pid, 0)
                return False
            except ProcessLookupError:
                pass
        return True
    deadline = time.monotonic() + 30
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)  # a readiness wait for the children's exit
    assert gone()


@pytest.mark.soak
def test_two_plain_gateways_on_one_port_is_a_clear_error(procs):
    p = procs.spawn("gw", ["gateway", "--broker", _NO_BROKER, "--http", "127.0.0.1:0"])
    url = wait_for_log_event(p.log_path, "gateway_listening", 30, p.popen, start=p.log_start)["url"]
    r = subprocess.run([sys.executable, "-m", "mesh.cli", "gateway", "--broker", _NO_BROKER, "--http", url[7:]],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "already in use" in r.stderr, r.stderr


@pytest.mark.soak
def test_a_child_killed_under_load_costs_only_its_own_connections_and_is_restarted(procs):
    import threading

    from mesh.lab.up import wait_for_workers

    b = procs.broker("b", "--log-level", "warning")
    procs.workers("w", [b.backend], "--instant", "--model", "instant", "--log-level", "warning", count=2)
    run(wait_for_workers(b.frontend, 2), 40)
    p = procs.spawn("gw", ["gateway", "--broker", b.frontend, "--http", "127.0.0.1:0", "--processes", "2"])
    url = wait_for_log_event(p.log_path, "gateway_listening", 60, p.popen, start=p.log_start)["url"]
    body = json.dumps({"model": "instant", "prompt": "hello", "max_tokens": 2}).encode()

    def post() -> bool:
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:  # a fresh connection each time
                return r.status == 200
        except OSError:
            return False

    assert run(until(lambda: all(post() for _ in range(8)), 30, "both processes see the workers"), 60)
    results: list[tuple[float, bool]] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            ok = post()
            results.append((time.monotonic(), ok))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        run(until(lambda: len(results) >= 40, 30, "load running"), 40)
        t_kill = time.monotonic()
        os.kill(_pids(p.log_path)[1], signal.SIGKILL)
        wait_for_log_event(p.log_path, "gateway_process_restarted", 30, p.popen, start=p.log_start)
        t_back = time.monotonic()
        n = len(results)
        run(until(lambda: len(results) >= n + 40, 30, "load after the restart"), 40)
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    during = [ok for t, ok in results if t_kill < t < t_back]
    failed = sum(not ok for _, ok in results)
    assert sum(during) > 0  # the other process served while the killed one was down
    assert failed <= 8, failed  # only what the killed process held (4 clients: in flight or queued on its socket)
    assert all(ok for t, ok in results[-20:])  # and all is well after the restart
