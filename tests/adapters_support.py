"""Helpers shared by the adapter and stub-sglang tests (no tests here).

* :func:`spawn_module` / :func:`start_stub` / :func:`start_adapter`: real processes through their
  module entry points (``python -m workers_stub.sglang_cli`` / ``python -m mesh.adapters.cli``),
  registered in the test's ProcGroup so teardown stops them; readiness from announce lines.
* :class:`FakeBroker`: a minimal broker backend (ROUTER) that registers workers, heartbeats them,
  records what they send and feeds KV_EVENTS into a real :class:`LocalIndexProvider` (the broker's
  own index code), so tests can watch a worker's index entries.
* :func:`until`: a bounded wait for a condition (polls; never a readiness guess).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.lab.procs import Proc, ProcGroup, wait_for_log_event
from mesh.routing.providers import LocalIndexProvider
from mesh.sockets import BROKER_BACKEND, make_socket, recv_frames, send_frames
from mesh.lab.up import wait_for_workers
from tests.conftest import run, until  # noqa: F401 - the adapter tests import until from here

DATA = Path(__file__).parent / "data"


def load_frames(name: str) -> dict[str, Any]:
    doc = json.loads((DATA / name).read_text())
    for key in ("live", "replay_from_0"):
        if key in doc:
            doc[key] = [[bytes.fromhex(f) for f in m] for m in doc[key]]
    return doc


def spawn_module(group: ProcGroup, name: str, module: str, args: list[str]) -> Proc:
    group.log_dir.mkdir(parents=True, exist_ok=True)
    log_path = group.log_dir / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **group.env}
    with log_path.open("ab") as log:
        p = subprocess.Popen([sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    proc = Proc(name, p, log_path)
    group.procs.append(proc)
    return proc


def start_stub(group: ProcGroup, name: str, *args: str, timeout_s: float = 30.0) -> tuple[Proc, dict]:
    """Start ``stub-sglang`` (free ports unless given) and return its readiness record."""
    p = spawn_module(group, name, "workers_stub.sglang_cli", ["--port", "0", *args])
    rec = wait_for_log_event(p.log_path, "sglang_stub_listening", timeout_s, p.popen)
    return p, rec


def start_stubs(group: ProcGroup, specs: dict[str, tuple[str, ...]], timeout_s: float = 30.0) -> dict[str, dict]:
    """:func:`start_stub` for several at once (name -> args): all spawned, then each one's readiness
    record awaited as start_stub does."""
    ps = {name: spawn_module(group, name, "workers_stub.sglang_cli", ["--port", "0", *args]) for name, args in specs.items()}
    return {name: wait_for_log_event(p.log_path, "sglang_stub_listening", timeout_s, p.popen) for name, p in ps.items()}


def _adapter_cmd(name: str, engine: str, url: str, brokers: list[str], args: tuple[str, ...]) -> list[str]:
    cmd = [engine, "--url", url, "--worker-id", name]
    for b in brokers:
        cmd += ["--broker", b]
    return [*cmd, *args]


def start_adapter(group: ProcGroup, name: str, engine: str, url: str, brokers: list[str], *args: str,
                  timeout_s: float = 30.0) -> tuple[Proc, dict]:
    p = spawn_module(group, name, "mesh.adapters.cli", _adapter_cmd(name, engine, url, brokers, args))
    rec = wait_for_log_event(p.log_path, "adapter_attached", timeout_s, p.popen)
    return p, rec


def start_adapters(group: ProcGroup, specs: list[tuple[str, str, str, list[str], tuple[str, ...]]],
                   timeout_s: float = 30.0) -> dict[str, dict]:
    """:func:`start_adapter` for several at once ((name, engine, url, brokers, args) each): all
    spawned, then each one's ``adapter_attached`` awaited."""
    ps = {name: spawn_module(group, name, "mesh.adapters.cli", _adapter_cmd(name, engine, url, brokers, args))
          for name, engine, url, brokers, args in specs}
    return {name: wait_for_log_event(p.log_path, "adapter_attached", timeout_s, p.popen) for name, p in ps.items()}


class FakeBroker:
    """Worker-facing half of a broker, enough to register an adapter and index its KV events."""

    def __init__(self, ctx: zmq.asyncio.Context | None = None, heartbeat_s: float = 0.2) -> None:
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.sock = make_socket(self.ctx, BROKER_BACKEND, bind="tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sync = zmq.Socket.shadow(self.sock.underlying)
        self.provider = LocalIndexProvider(speculative_ttl_s=0)
        self.heartbeat_s = heartbeat_s
        self.sessions: dict[bytes, str] = {}
        self.readies: list[P.Ready] = []
        self.kv: list[P.KvEventsMsg] = []
        self.heartbeats: list[P.Heartbeat] = []
        self.disconnects: list[str] = []
        self.entries_log: list[int] = []  # worker entries after every applied KV batch
        self.chunks: dict[int, list[dict]] = {}
        self.finals: dict[int, P.WorkerFinal] = {}
        self.errors: dict[int, P.WorkerError] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> "FakeBroker":
        self._task = asyncio.create_task(self._run())
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close(linger=0)

    def entries(self, worker_id: str) -> int:
        return self.provider.index.worker_entries(worker_id)

    def request(self, rid: int, submit_raw: bytes, *, attempt: int = 1, deadline_ms: int = 20_000,
                bootstrap: dict | None = None) -> None:
        """Dispatch one REQUEST (a client's SUBMIT body) to the first registered worker."""
        ident = next(iter(self.sessions))
        self.send(ident, P.encode_request(rid, attempt, deadline_ms, f"c-{rid}", submit_raw, bootstrap))

    def cancel(self, rid: int, attempt: int = 1) -> None:
        self.send(next(iter(self.sessions)), P.encode_worker_cancel(rid, attempt))

    def send(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            send_frames(self.sync, [ident, *frames])
        except zmq.ZMQError:
            pass

    async def _run(self) -> None:
        next_hb = time.monotonic()
        while True:
            timeout = max(0, int((next_hb - time.monotonic()) * 1000))
            if await self.sock.poll(timeout, zmq.POLLIN):
                while True:
                    try:
                        frames = recv_frames(self.sync)
                    except zmq.Again:
                        break
                    self._handle(frames[0], frames[1:])
            if time.monotonic() >= next_hb:
                next_hb = time.monotonic() + self.heartbeat_s
                for ident in list(self.sessions):
                    self.send(ident, P.encode_heartbeat())

    def _handle(self, ident: bytes, frames: list[bytes]) -> None:
        m = P.decode_worker(frames)
        if isinstance(m, P.Ready):
            self.readies.append(m)
            self.sessions[ident] = m.worker_id
            self.provider.on_worker_ready(m)
            self.send(ident, P.encode_heartbeat())
            return
        wid = self.sessions.get(ident)
        if wid is None:
            if not isinstance(m, P.Disconnect):
                self.send(ident, P.encode_disconnect("not registered; send READY"))
            return
        if isinstance(m, P.KvEventsMsg):
            self.kv.append(m)
            for rank, why in self.provider.on_kv_events(wid, m, time.monotonic()):
                self.send(ident, P.encode_resync(rank, why))
            self.entries_log.append(self.entries(wid))
        elif isinstance(m, P.Heartbeat):
            self.heartbeats.append(m)
        elif isinstance(m, P.WorkerChunk):
            self.chunks.setdefault(m.rid, []).append(P.unpack(m.data))
        elif isinstance(m, P.WorkerFinal):
            self.finals[m.rid] = m
        elif isinstance(m, P.WorkerError):
            self.errors[m.rid] = m
        elif isinstance(m, P.Disconnect):
            self.disconnects.append(m.reason)
            if m.reason != P.DRAINING:
                del self.sessions[ident]
                if wid not in self.sessions.values():
                    self.provider.on_worker_removed(wid)


HB_MS = 1000  # a stall would last about one heartbeat (the worker link's poll timeout)


def http_adapter_path(procs: ProcGroup, n: int = 2, *, engine_urls: list[str] | None = None, time_scale: str = "0.001",
          broker_args: tuple[str, ...] = (), heartbeat_ms: int = HB_MS):
    """The HTTP path with real processes: ``mesh broker --http`` + ``n`` adapters, each attached to
    a ``mesh stub-sglang`` it starts (or to ``engine_urls``); returns (HTTP url, engine urls)."""
    engines = list(engine_urls or [])
    # the engines need nothing of the broker: they start while it does
    stubs = [procs.spawn(f"stub{i}", ["stub-sglang", "--port", "0", "--time-scale", time_scale]) for i in range(n - len(engines))]
    b = procs.broker("b", "--http", "127.0.0.1:0", "--policy", "round_robin", "--heartbeat-ms", str(heartbeat_ms),
                     "--max-worker-heartbeat-ms", str(max(heartbeat_ms, 2000)), *broker_args)
    url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen, start=b.log_start)["url"]
    engines += [wait_for_log_event(p.log_path, "sglang_stub_listening", 30, p.popen, start=p.log_start)["url"] for p in stubs]
    for i, e in enumerate(engines):
        procs.spawn(f"a{i}", ["attach", "sglang", "--url", e, "--broker", b.backend, "--worker-id", f"a{i}",
                               "--heartbeat-ms", str(heartbeat_ms)])
    run(wait_for_workers(b.frontend, len(engines)), 40)
    return url, engines


async def start_attached(url: str, **settings: Any):
    """A :class:`FakeBroker` and an in-process SGLang adapter (worker id ``w``) attached to the
    server at ``url``, registered with it: (broker, adapter). The caller stops both."""
    from mesh.adapters.base import Adapter
    from mesh.adapters.settings import AttachSettings
    from mesh.adapters.sglang import SglangBackend

    fb = FakeBroker().start()
    s = AttachSettings(url=url, brokers=(fb.endpoint,), worker_id="w", **settings)
    ad = Adapter(s, SglangBackend(s))
    await ad.start()
    await until(lambda: fb.readies and fb.sessions, 10, "registration")
    return fb, ad
