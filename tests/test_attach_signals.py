"""``mesh attach`` stops on SIGTERM / SIGINT in every state, within about 2 s, with a log line:
while it waits for an engine that is not there (it used to retry discovery forever, deaf to
signals), after the engine went away, and while attached and idle."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import pytest

from mesh.lab.procs import Proc, ProcGroup, wait_for_log_event
from mesh.lab.up import wait_for_workers
from tests.conftest import run
from tests.adapters_support import start_stub

STOP_BOUND_S = 8.0  # prompt (a hang waits out 30 s timeouts), with room for a busy machine
FAST = ["--heartbeat-ms", "200", "--health-interval-ms", "100", "--unhealthy-after", "1"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


def _attach(procs: ProcGroup, name: str, url: str, backend: str, *extra: str) -> Proc:
    return procs.spawn(name, ["attach", "sglang", "--url", url, "--broker", backend, "--worker-id", name, *FAST, *extra])


def _stop_within(p: Proc, sig: int, bound_s: float = STOP_BOUND_S) -> tuple[int, float]:
    t0 = time.monotonic()
    p.signal(sig)
    try:
        code = p.popen.wait(bound_s + 3.0)  # bounded: a hung adapter fails here, not at teardown
    except subprocess.TimeoutExpired:
        p.popen.kill()
        p.popen.wait(5)
        pytest.fail(f"{p.name} still running {bound_s + 3.0:.0f} s after {signal.Signals(sig).name}; log tail:\n"
                    + p.log_path.read_text()[-2000:])
    return code, time.monotonic() - t0


@pytest.mark.parametrize("sig,expect", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_stop_while_waiting_for_an_unreachable_engine(procs, sig, expect):
    b = procs.broker("b", "--heartbeat-ms", "200")
    p = _attach(procs, "a", f"http://127.0.0.1:{_closed_port()}", b.backend)
    # its first failed discovery is logged as adapter_waiting_for_engine (and discovery_retry)
    wait_for_log_event(p.log_path, "discovery_retry", 30, p.popen)
    code, took = _stop_within(p, sig)
    log = p.log_path.read_text()
    print(f"{sig.name}: exit {code} after {took:.3f} s")
    assert code == expect, log[-2000:]
    assert took < STOP_BOUND_S, (took, log[-2000:])
    assert "adapter_waiting_for_engine" in log, log[-2000:]
    assert "adapter_stopped_before_attach" in log and "Traceback" not in log, log[-2000:]


def test_stop_after_the_engine_went_away_and_when_attached(procs):
    b = procs.broker("b", "--heartbeat-ms", "200")
    stub, rec = start_stub(procs, "stub", "--time-scale", "0.05")
    url = rec["url"]
    # attached, registered, idle: SIGTERM ends it (nothing to drain)
    p = _attach(procs, "a1", url, b.backend)
    wait_for_log_event(p.log_path, "adapter_attached", 30, p.popen)
    run(wait_for_workers(b.frontend, 1))
    code, took = _stop_within(p, signal.SIGTERM)
    assert code == 0 and took < STOP_BOUND_S, (code, took)

    # the engine dies under an attached adapter: it goes unhealthy; SIGTERM still ends it
    p = _attach(procs, "a2", url, b.backend)
    wait_for_log_event(p.log_path, "adapter_attached", 30, p.popen)
    wait_for_log_event(p.log_path, "adapter_healthy", 30, p.popen)  # healthy first: then the engine dies
    stub.popen.kill()
    stub.popen.wait(5)
    wait_for_log_event(p.log_path, "adapter_unhealthy", 30, p.popen)
    code, took = _stop_within(p, signal.SIGTERM)
    print(f"attached idle / engine gone: exit {code} after {took:.3f} s")
    assert code == 0 and took < STOP_BOUND_S, (code, took, p.log_path.read_text()[-2000:])
    assert "adapter_signal" in p.log_path.read_text()
