"""``mesh gateway --processes N``: N gateway processes serving one port (SO_REUSEPORT), under a supervisor.

Each process is a whole gateway (:func:`brokers.gateway.serve_gateway`: its own broker DEALERs,
tokenizer pools, prefix cache and connection limits); the kernel spreads new connections over
their listening sockets (Linux ``SO_REUSEPORT``), so tokenisation and HTTP parsing use N cores
while the brokers see N clients and stay free of tokenisation.

The parent (:class:`Supervisor`) does no HTTP. It

* reserves the port before any child starts: a socket bound with ``SO_REUSEPORT`` and never
  listening (it resolves port 0, keeps the port while a child restarts, and fails at once when
  something listens there without the flag: a plain ``mesh gateway`` cannot split the port with the
  group, nor the group with it), and an abstract Unix socket named by the port, so that a second
  ``--processes`` group of the same user cannot silently join this one's port either;
* starts the N children (``mesh gateway ... --process-slot FD:INDEX:RESTARTS``) and waits for each
  one's readiness over its control socket (a socketpair): ``ready`` after it listens, or ``error WHY``.
  A child that cannot start exits the parent non-zero with the child's reason (a port taken, a
  tokenizer that does not load); once all serve, the parent announces ``gateway_listening``;
* restarts a child that dies, after a back-off drawn by :class:`mesh.retry.RetryPolicy` (tenacity)
  and within a budget (:class:`RestartBudget`): ``--restart-budget`` restarts of one process in a
  row, a process that served ``STABLE_S`` getting its budget back. A process whose budget is spent
  stays down (``gateway_process_given_up``, logged as an error); the others serve on, and when none
  is left the parent exits 1;
* forwards SIGTERM/SIGINT to every child (each drains as a single gateway does) and waits for them
  (SIGKILL past ``drain_timeout_s``).

A child reads EOF on its control socket when the parent dies, however it dies, and then drains and
exits too. Every log line of a child carries ``process`` (its index); the parent's carry
``service=gateway_supervisor``.
"""

from __future__ import annotations

import asyncio
import errno
import signal
import socket
import sys
import time
from dataclasses import dataclass

from mesh.errors import ConfigError
from mesh.logs import announce, get_logger
from mesh.retry import RetryPolicy

__all__ = ["MAX_PROCESSES", "RestartBudget", "Supervisor", "ChildControl", "check_processes", "parse_slot"]

MAX_PROCESSES = 64
STABLE_S = 30.0  # a process that served this long gets its restart budget back
_BACKOFF = (250.0, 5000.0)  # ms: first back-off bound, cap (full jitter)


def check_processes(processes: int, restart_budget: int) -> None:
    """``--processes`` 1..64 and ``--restart-budget`` 0..1000; more than one process needs a kernel
    that balances ``SO_REUSEPORT`` listeners (Linux). Raises ConfigError naming the field."""
    if type(processes) is not int or not 1 <= processes <= MAX_PROCESSES:
        raise ConfigError(f"processes: must be an integer in 1..{MAX_PROCESSES}, got {processes!r}")
    if type(restart_budget) is not int or not 0 <= restart_budget <= 1000:
        raise ConfigError(f"restart_budget: must be an integer in 0..1000, got {restart_budget!r}")
    if processes > 1 and not (sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")):
        raise ConfigError(f"processes: {processes} processes on one port need SO_REUSEPORT load balancing (Linux), not "
                          f"available on {sys.platform}; run N gateways on their own ports behind a load balancer instead")


def parse_slot(text: str) -> tuple[int, int, int]:
    """``FD:INDEX:RESTARTS`` (the supervisor's ``--process-slot``) -> the three integers."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() and len(p) <= 6 for p in parts) or int(parts[1]) >= MAX_PROCESSES:
        raise ConfigError(f"process_slot: expected FD:INDEX:RESTARTS (set by the supervisor), got {text[:64]!r}")
    fd, index, restarts = (int(p) for p in parts)
    return fd, index, restarts


class RestartBudget:
    """When (and whether) to restart a process that exited: pure, the shell passes how long it ran.

    ``budget`` restarts in a row per process; one that ran ``stable_s`` or more starts a new row.
    The back-off before restart ``n`` of a row is :meth:`mesh.retry.RetryPolicy.delay_s` (full
    jitter, capped); the row stops at ``budget`` (the policy's attempt cap: never unbounded)."""

    def __init__(self, budget: int, stable_s: float = STABLE_S) -> None:
        self.policy = RetryPolicy(max_attempts=budget + 1, base_ms=_BACKOFF[0], cap_ms=_BACKOFF[1])
        self.stable_s = stable_s
        self._row: dict[int, int] = {}  # process index -> failures in the current row
        self.restarts: dict[int, int] = {}  # process index -> restarts so far (counted)

    def exited(self, index: int, ran_s: float) -> float | None:
        """Seconds to wait before restarting process ``index``, or None: its budget is spent."""
        n = (0 if ran_s >= self.stable_s else self._row.get(index, 0)) + 1
        self._row[index] = n
        if not self.policy.should_retry(n, remaining_s=1.0):
            return None
        self.restarts[index] = self.restarts.get(index, 0) + 1
        return self.policy.delay_s(n)


class ChildControl:
    """A child's end of its control socket: says ``ready`` / ``error WHY``, and stops the child when
    the parent goes (EOF)."""

    def __init__(self, fd: int, index: int, restarts: int) -> None:
        try:
            self.sock = socket.socket(fileno=fd)
        except OSError as exc:
            raise ConfigError(f"process_slot: descriptor {fd} is not this process's control socket ({exc})") from None
        self.index = index
        self.restarts = restarts

    def _say(self, line: str) -> None:
        try:
            self.sock.sendall(line.encode(errors="replace")[:4000] + b"\n")
        except OSError:  # the parent is gone: nothing to tell
            pass

    def ready(self, url: str) -> None:
        self._say(f"ready {url}")

    def failed(self, why: str) -> None:
        self._say("error " + " ".join(why.split()))

    def stop_with_parent(self, stop: asyncio.Event) -> None:
        """Set ``stop`` when the parent's end closes (on the running loop)."""
        loop = asyncio.get_running_loop()
        self.sock.setblocking(False)

        def readable() -> None:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(self.sock.fileno())
                stop.set()

        loop.add_reader(self.sock.fileno(), readable)

    def close(self) -> None:
        try:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        except (RuntimeError, ValueError, OSError):
            pass
        self.sock.close()


@dataclass
class _Slot:
    index: int
    proc: asyncio.subprocess.Process | None = None
    control: socket.socket | None = None
    started_at: float = 0.0
    given_up: bool = False


class Supervisor:
    """Starts, watches and stops the N gateway processes (see the module docstring)."""

    def __init__(self, child_argv: list[str], processes: int, host: str, port: int, *, restart_budget: int = 5,
                 start_timeout_s: float = 60.0, drain_timeout_s: float = 15.0, brokers: list[str] | None = None) -> None:
        self.child_argv = list(child_argv)  # `mesh gateway ...` as given; --process-slot and --http are appended
        self.processes = processes
        self.host = host
        self.port = port
        self.budget = RestartBudget(restart_budget)
        self.start_timeout_s = start_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.brokers = brokers or []
        self.slots = [_Slot(i) for i in range(processes)]
        self.stopping = False
        self.log = get_logger(service="gateway_supervisor")
        self._reserved: list[socket.socket] = []

    # ------------------------------------------------------------------ the port
    def reserve_port(self) -> int:
        """Bind (not listen) the port with SO_REUSEPORT, and take the port's group lock; -> the port.
        ConfigError naming the port when a listener without the flag, or another group, holds it."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((self.host, self.port))
        except OSError as exc:
            s.close()
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"http: {self.host}:{self.port} is already in use by a process that did not set "
                                  "SO_REUSEPORT (another mesh gateway without --processes?): stop it or choose another "
                                  "port; the port is not split") from None
            raise ConfigError(f"http: cannot bind {self.host}:{self.port}: {exc}") from None
        self.port = s.getsockname()[1]
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lock.bind(f"\0mesh-gateway-port-{self.port}")
        except OSError:
            lock.close()
            s.close()
            raise ConfigError(f"http: port {self.port} is already served by another `mesh gateway --processes` group; "
                              "stop it or choose another port (two groups would silently split the connections)") from None
        self._reserved = [s, lock]
        return self.port

    # ------------------------------------------------------------------ children
    async def _spawn(self, slot: _Slot) -> str | None:
        """Start process ``slot.index``; wait for its readiness. None when it serves, else why not."""
        parent, child = socket.socketpair()
        restarts = self.budget.restarts.get(slot.index, 0)
        argv = [sys.executable, "-m", "mesh.cli", *self.child_argv, "--http", f"{self._http_host()}:{self.port}",
                "--process-slot", f"{child.fileno()}:{slot.index}:{restarts}"]
        try:
            slot.proc = await asyncio.create_subprocess_exec(*argv, pass_fds=(child.fileno(),), stdin=asyncio.subprocess.DEVNULL)
        except OSError as exc:
            parent.close()
            return f"cannot start it: {exc}"
        finally:
            child.close()
        slot.control, slot.started_at = parent, time.monotonic()
        parent.setblocking(False)
        line = b""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.start_timeout_s):
                while not line.endswith(b"\n"):
                    chunk = await loop.sock_recv(parent, 4096)
                    if not chunk:
                        break
                    line += chunk
        except TimeoutError:
            slot.proc.kill()
            return f"not listening within {self.start_timeout_s:g} s"
        text = line.decode(errors="replace").strip()
        if text.startswith("ready"):
            announce("gateway_process_started", process=slot.index, pid=slot.proc.pid, restarts=restarts)
            return None
        code = await slot.proc.wait()
        return (text[6:] if text.startswith("error ") else "") or f"exited with code {code} before it listened"

    def _http_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    async def _watch(self, slot: _Slot) -> None:
        """Restart process ``slot.index`` whenever it exits, within the budget."""
        while not self.stopping:
            assert slot.proc is not None
            code = await slot.proc.wait()
            if slot.control is not None:
                slot.control.close()
                slot.control = None
            if self.stopping:
                return
            ran_s = time.monotonic() - slot.started_at
            delay_s = self.budget.exited(slot.index, ran_s)
            if delay_s is None:
                slot.given_up = True
                self.log.error("gateway_process_given_up", process=slot.index, exit_code=code, ran_s=round(ran_s, 3),
                               restarts=self.budget.restarts.get(slot.index, 0),
                               why="it kept exiting: its restart budget (--restart-budget) is spent; the others serve on")
                return
            self.log.warning("gateway_process_exited", process=slot.index, exit_code=code, ran_s=round(ran_s, 3),
                             restart_in_s=round(delay_s, 3), restarts=self.budget.restarts[slot.index])
            await asyncio.sleep(delay_s)
            while not self.stopping:
                why = await self._spawn(slot)
                if why is None:
                    announce("gateway_process_restarted", process=slot.index, restarts=self.budget.restarts[slot.index])
                    break
                delay_s = self.budget.exited(slot.index, 0.0)
                if delay_s is None:
                    slot.given_up = True
                    self.log.error("gateway_process_given_up", process=slot.index, restarts=self.budget.restarts.get(slot.index, 0),
                                   why=f"it could not start again: {why}; its restart budget (--restart-budget) is spent")
                    return
                await asyncio.sleep(delay_s)

    def _signal_all(self, sig: int) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                try:
                    slot.proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    async def _stop_all(self) -> None:
        self.stopping = True
        self._signal_all(signal.SIGTERM)
        procs = [s.proc for s in self.slots if s.proc is not None]
        done = asyncio.gather(*(p.wait() for p in procs))
        try:
            await asyncio.wait_for(asyncio.shield(done), self.drain_timeout_s)
        except TimeoutError:
            self.log.warning("gateway_process_drain_timeout", timeout_s=self.drain_timeout_s)
            self._signal_all(signal.SIGKILL)
            await done
        for slot in self.slots:
            if slot.control is not None:
                slot.control.close()
                slot.control = None

    # ------------------------------------------------------------------ run
    async def run(self) -> int:
        """Serve until SIGINT/SIGTERM (0), or until every process gave up (1). ConfigError (exit 2)
        when the port is taken or a process cannot start."""
        self.reserve_port()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            failures = await asyncio.gather(*(self._spawn(s) for s in self.slots))
            bad = [(i, why) for i, why in enumerate(failures) if why is not None]
            if bad:
                await self._stop_all()
                i, why = bad[0]
                raise ConfigError(f"gateway process {i} of {self.processes} could not start: {why}")
            url = f"http://{self._http_host()}:{self.port}"
            announce("gateway_listening", url=url, brokers=self.brokers, processes=self.processes)
            watchers = [asyncio.create_task(self._watch(s), name=f"gw-proc-{s.index}") for s in self.slots]
            stopped = asyncio.create_task(stop.wait())
            all_gone = asyncio.create_task(asyncio.wait(watchers))
            await asyncio.wait([stopped, all_gone], return_when=asyncio.FIRST_COMPLETED)
            given_up = all(s.given_up for s in self.slots) and not stop.is_set()
            await self._stop_all()
            for t in (*watchers, stopped, all_gone):
                t.cancel()
            await asyncio.gather(*watchers, stopped, all_gone, return_exceptions=True)
            restarts = dict(self.budget.restarts)
            if given_up:
                self.log.error("gateway_supervisor_failed", why="every gateway process gave up", restarts=restarts)
                return 1
            announce("gateway_stopped", processes=self.processes, restarts=restarts)
            return 0
        finally:
            for s in self._reserved:
                s.close()
