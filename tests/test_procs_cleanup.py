"""Processes a ProcGroup starts do not outlive a parent that is SIGKILLed (no orphaned fleets
after a killed `mesh up` or a test runner that died)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")

_PARENT = """
import sys, time
from pathlib import Path
from mesh.lab.procs import ProcGroup, wait_for_log_event
g = ProcGroup(Path(sys.argv[1]))
b = g.broker("b")
print(b.popen.pid, flush=True)
time.sleep(600)  # the parent just lives on until the test SIGKILLs it
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead (its parent, init, reaps it)
        return f.read().split(")")[-1].split()[0] != "Z"


def test_children_get_sigterm_when_the_parent_is_killed(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())  # after the broker's readiness line
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_until(lambda: not _alive(child), 15, "the broker gone with its killed parent", step_s=0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
