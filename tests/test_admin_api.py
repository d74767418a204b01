"""The admin API (issue 17 part 5): list, drain, eject and reinstate workers over HTTP and `mesh ctl`,
against a real broker process with real workers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mesh.broker_core import BrokerCore, SessionState
from mesh.client import Client
from mesh.config import BrokerSettings, build
from mesh import protocol as P
from mesh.lab.procs import wait_for_log_event
from mesh.routing.router import Router, make_policy
from mesh.lab.up import wait_for_workers

from conftest import run

KEY = "admin-test-key-0123456789"


def _ctl(url: str, key_file: str | None, *args: str, process: bool = False) -> subprocess.CompletedProcess:
    """``mesh ctl ARGS`` against the real broker: as a child process (``process``), or in this
    process through the same parser and command (each child costs half a second of imports)."""
    argv = ["ctl", *args, "--url", url] + (["--api-key-file", key_file] if key_file else [])
    if process:
        return subprocess.run([sys.executable, "-m", "mesh.cli", *argv], capture_output=True, text=True, timeout=30,
                              env={"PATH": "/usr/bin:/bin"})
    import contextlib
    import io

    from mesh.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            rc = int(exc.code or 0)
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


def _workers(url: str, key_file: str) -> dict[str, dict]:
    r = _ctl(url, key_file, "workers", "--json")
    assert r.returncode == 0, r.stderr
    return {w["worker_id"]: w for w in json.loads(r.stdout)["data"]}


async def _served_by(frontend: str, n: int) -> set[str]:
    async with Client(frontend) as c:
        return {(await c.generate(input_ids=[7, i, 3], max_new_tokens=1, deadline_ms=10_000)).worker for i in range(n)}


@pytest.fixture
def admin_mesh(procs, tmp_path):
    kf = tmp_path / "api.key"
    kf.write_text(KEY + "\n")
    b = procs.broker("b", "--http", "127.0.0.1:0", "--api-key-file", str(kf), "--heartbeat-ms", "200",
                     "--policy", "round_robin")
    url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen)["url"]
    procs.workers("w", [b.backend], "--instant", count=2)
    run(wait_for_workers(b.frontend, 2))
    return b, url, str(kf)


def test_ctl_lists_drains_ejects_and_reinstates_workers(admin_mesh):
    b, url, kf = admin_mesh
    ws = _workers(url, kf)
    assert len(ws) == 2 and all(w["state"] == "routable" for w in ws.values()), ws
    assert all(w["kv_capacity_tokens"] > 0 for w in ws.values())
    a, other = sorted(ws)

    r = _ctl(url, kf, "drain", a, process=True)  # the installed command, as an operator runs it
    assert r.returncode == 0 and r.stdout.strip() == f"{a}: draining", (r.stdout, r.stderr)
    assert run(_served_by(b.frontend, 6), timeout_s=30) == {other}  # no new requests for the drained worker
    assert _ctl(url, kf, "reinstate", a).returncode == 0
    assert _workers(url, kf)[a]["state"] == "routable"
    assert run(_served_by(b.frontend, 6), timeout_s=30) == {a, other}

    r = _ctl(url, kf, "eject", other, "--for-s", "60")
    assert r.returncode == 0 and "ejected for" in r.stdout, r.stdout
    w = _workers(url, kf)[other]
    assert w["state"] == "ejected" and 50 < w["ejected_for_s"] <= 60
    assert run(_served_by(b.frontend, 6), timeout_s=30) == {a}
    assert _ctl(url, kf, "reinstate", other).returncode == 0
    assert _workers(url, kf)[other]["state"] == "routable"

    # the table form, and precise refusals: unknown worker (1), no key (1, 401), usage (2)
    table = _ctl(url, kf, "workers")
    assert table.returncode == 0 and a in table.stdout and "routable" in table.stdout
    r = _ctl(url, kf, "drain", "nobody")
    assert r.returncode == 1 and "404" in r.stderr and "nobody" in r.stderr
    r = _ctl(url, None, "workers", process=True)
    assert r.returncode == 1 and "401" in r.stderr
    assert _ctl(url, kf, "drain").returncode == 2
    assert _ctl("http://127.0.0.1:9", kf, "workers").returncode == 2  # nothing listens: a clear error, no traceback


def _core_with(n: int) -> BrokerCore:
    s = build(BrokerSettings, {"policy": "round_robin"})
    core = BrokerCore(s, Router(make_policy("round_robin"), None))
    core.start(0.0)
    for i in range(n):
        ident = f"id{i}".encode()
        core.worker_frames([ident, *P.encode_ready(P.Ready(f"w{i}", "m", "mixed", {}, 16, 256, 400_000, 1, 1, 500))], 0.0)
        core.worker_frames([ident, *P.encode_heartbeat()], 0.0)
    core.take()
    return core


def _beat(core: BrokerCore, n: int, now: float) -> None:
    for i in range(n):
        core.worker_frames([f"id{i}".encode(), *P.encode_heartbeat()], now)


def test_admin_actions_follow_the_session_table():
    core = _core_with(2)
    sess = core.pool.by_id["w0"]
    assert core.admin("eject", "w0", 1.0, for_s=5)["state"] == "ejected"
    _beat(core, 2, 6.9)
    core.tick(7.0)  # an operator's ejection ends by itself, as an outlier's does
    assert sess.status is SessionState.ROUTABLE
    core.admin("drain", "w0", 8.0)
    with pytest.raises(ValueError, match="routable or ejected"):
        core.admin("eject", "w0", 8.0)
    # the worker then announces it is leaving: an operator can no longer put it back
    core.worker_frames([b"id0", *P.encode_disconnect(P.DRAINING)], 8.0)
    with pytest.raises(ValueError, match="leaving"):
        core.admin("reinstate", "w0", 8.0)
    with pytest.raises(KeyError):
        core.admin("drain", "w9", 8.0)
    with pytest.raises(ValueError, match="for_s"):
        core.admin("eject", "w1", 8.0, for_s=-1)
    with pytest.raises(ValueError, match="unknown action"):
        core.admin("explode", "w1", 8.0)
