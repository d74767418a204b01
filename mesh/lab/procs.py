"""Start mesh processes as real subprocesses on 127.0.0.1 and wait for their readiness signals.

Used by ``mesh up``, the benchmarks and the end-to-end tests. Every process logs JSON lines to
its own file; readiness is read from those lines (``broker_listening`` carries the bound
endpoints, so every port can be ``*``), never guessed with a sleep. :class:`ProcGroup` owns the
processes and stops them (SIGTERM, then SIGKILL after a grace period) on exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

__all__ = ["Proc", "ProcGroup", "BrokerProc", "wait_for_log_event", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for a process whose address must be known before it
    starts (two brokers that are each other's ``--peer``) or must stay the same across a restart;
    everything else binds port 0 (or ``*``) and reads the port it got."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_log_event(path: Path, event: str, timeout_s: float, proc: subprocess.Popen | None = None, *,
                       start: int = 0) -> dict:
    """Block until a JSON log line with ``"event": event`` appears in ``path`` at or after byte
    ``start``; return it. (Logs are appended to: a process restarted under the same name must
    not be taken as ready on its predecessor's line, so spawners pass the size at spawn time.)

    Raises TimeoutError (with the log tail) if it does not appear in time, or RuntimeError if
    ``proc`` exits first.
    """
    deadline = time.monotonic() + timeout_s
    pos = start
    buf = ""
    while True:
        if path.exists():
            with path.open() as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
            buf += chunk
            *lines, buf = buf.split("\n")
            for line in lines:
                if f'"{event}"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("event") == event:
                    return rec
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before {event!r}; log tail:\n{_tail(path)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {event!r} within {timeout_s}s; log tail:\n{_tail(path)}")
        time.sleep(0.02)  # file polling interval, not a readiness guess: we wait for the event itself


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-n:])
    except OSError:
        return "(no log)"


_PR_SET_PDEATHSIG = 1
_prctl = None
if sys.platform.startswith("linux"):  # resolved here, in the parent: the child may not import
    try:
        import ctypes

        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        _prctl = None


def _set_parent_death_signal() -> None:  # pragma: no cover - runs in the child, between fork and exec
    """SIGTERM this (child) process when its parent dies (Linux; elsewhere nothing)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def die_with_parent(parent_pid: int) -> None:
    """A pool worker's initializer (``ProcessPoolExecutor(initializer=die_with_parent,
    initargs=(os.getpid(),))``): SIGTERM this worker when the process that started it dies, so a
    ``mesh sim --matrix`` killed by a signal leaves no workers behind (they waited forever on the
    dead pool's queue); a parent already gone before this ran ends the worker at once."""
    _set_parent_death_signal()
    if os.getppid() != parent_pid:
        os._exit(1)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    log_start: int = 0  # size of the (appended) log when this process was spawned

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL. Returns the exit code."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait(5)


@dataclass
class BrokerProc(Proc):
    frontend: str = ""
    backend: str = ""


@dataclass
class ProcGroup:
    """Owns a set of mesh subprocesses and their log directory."""

    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def spawn(self, name: str, args: list[str]) -> Proc:
        """Start ``mesh ARGS...`` as a child process named ``name`` (its log in ``log_dir``)."""
        return self._spawn(name, args)

    def _spawn(self, name: str, args: list[str]) -> Proc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        start = log_path.stat().st_size if log_path.exists() else 0
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        # A child outlives a parent that is SIGKILLed (a test's teardown, an OOM kill of `mesh up`),
        # and its own session keeps it from the terminal's signals: ask the kernel to SIGTERM it
        # when the parent goes. Only from the main thread: the signal follows the spawning
        # *thread*, so a child spawned from a short-lived thread would be killed with it.
        pdeath = _set_parent_death_signal if _prctl is not None and threading.current_thread() is threading.main_thread() else None
        with log_path.open("ab") as log:
            p = subprocess.Popen([sys.executable, "-m", "mesh.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, start_new_session=True, preexec_fn=pdeath)
        proc = Proc(name, p, log_path, start)
        self.procs.append(proc)
        return proc

    def broker(self, name: str = "broker", *extra: str, frontend: str = "tcp://127.0.0.1:*", backend: str = "tcp://127.0.0.1:*",
               timeout_s: float = 30.0) -> BrokerProc:
        """Start a broker and wait for its ``broker_listening`` line (which names the real ports)."""
        p = self._spawn(name, ["broker", "--frontend", frontend, "--backend", backend, "--broker-id", name, *extra])
        rec = wait_for_log_event(p.log_path, "broker_listening", timeout_s, p.popen, start=p.log_start)
        bp = BrokerProc(p.name, p.popen, p.log_path, p.log_start, frontend=rec["frontend"], backend=rec["backend"])
        self.procs[-1] = bp
        return bp

    def workers(self, name: str, backends: list[str], *extra: str, count: int = 1, timeout_s: float = 30.0,
                wait: bool = True) -> Proc:
        """Start ``count`` simulated workers in one process and wait for ``workers_started``
        (``wait=False``: the caller waits, e.g. for several started together)."""
        args = ["worker-stub", "--count", str(count), "--worker-id", name]
        for b in backends:
            args += ["--broker", b]
        p = self._spawn(name, [*args, *extra])
        if wait:
            wait_for_log_event(p.log_path, "workers_started", timeout_s, p.popen, start=p.log_start)
        return p

    def stop_all(self, grace_s: float = 10.0, procs: Sequence[Proc] | None = None) -> list[str]:
        """SIGTERM every live process of ``procs`` (default: the group's, newest first) at once,
        give each ``grace_s`` from that signal to exit, SIGKILL the rest; returns their names.
        (One by one, each wait would start only after the previous process had gone: the same
        bound, paid in series.)"""
        live = [p for p in (reversed(self.procs) if procs is None else procs) if p.alive()]
        for p in live:
            p.popen.send_signal(signal.SIGTERM)
        t_end = time.monotonic() + grace_s
        stubborn = []
        for p in live:
            try:
                p.popen.wait(max(0.1, t_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(5)
                stubborn.append(p.name)
        return stubborn

    def __enter__(self) -> "ProcGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
