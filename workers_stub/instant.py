"""Instant workers for benchmarks: N DEALERs served from one synchronous loop.

They speak the full worker protocol (READY, heartbeats both ways, DISCONNECT -> READY again)
but answer every REQUEST with a FINAL at once, echoing up to ``max_new_tokens`` prompt tokens.

:class:`InstantFleet` holds the sockets and the protocol logic and is driven from outside
through a :class:`~mesh.sockets.ReadyPoller` (cost per wake-up proportional to the sockets with
input, not to all of them). ``mesh worker-stub --instant`` runs one in its own process
(:func:`run_instant_fleet`); ``mesh bench broker`` runs one inside its load driver's loop, so
that on a small machine the process under test keeps a core to itself.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

import zmq

from mesh import protocol as P
from mesh.config import WorkerSettings
from mesh.gc_tuning import freeze_startup_heap
from mesh.logs import announce
from mesh.sockets import WORKER_DEALER, ReadyPoller, SocketSpec, make_socket, recv_frames, send_frames

__all__ = ["InstantFleet", "instant_answer", "run_instant_fleet"]

_HB_SLICES = 10  # heartbeats go out in this many slices per interval


def instant_answer(sub: P.Submit) -> tuple[list[int], dict[str, int]]:
    """What an instant worker generates for ``sub``: its first ``max_new_tokens`` prompt ids
    (text prompts as bytes), and the usage to report with them (nothing cached)."""
    prompt = sub.input_ids or list((sub.text or "").encode())
    out = prompt[: sub.max_new_tokens]
    return out, {"prompt_tokens": len(prompt), "completion_tokens": len(out), "cached_tokens": 0}


class InstantFleet:
    """``count`` instant workers, each connected to every broker in ``brokers``.

    Contract: the owner registers nothing itself; call :meth:`serve` for every socket of this
    fleet that the shared poller returns, and :meth:`tick` at least every ``heartbeat_ms``
    (it returns the next time it is due). READY goes out on the first tick and again after a
    broker's DISCONNECT, until that broker's first HEARTBEAT shows it registered the worker.
    """

    def __init__(self, ctx: zmq.Context, poller: ReadyPoller, brokers: Iterable[str], *, count: int = 1,
                 worker_id: str = "", model: str = "", role: str = "mixed", labels: dict[str, str] | None = None,
                 heartbeat_ms: int = 500, spec: SocketSpec = WORKER_DEALER) -> None:
        self.poller = poller
        self.heartbeat_s = heartbeat_ms / 1000.0
        base = worker_id or f"instant-{os.getpid()}"
        epoch = int(time.time() * 1000)
        self._ready: dict[zmq.Socket, list[bytes]] = {}  # socket -> its READY frames
        self._unacked: set[zmq.Socket] = set()  # sockets whose broker has not answered READY yet
        for i in range(count):
            wid = base if count == 1 else f"{base}-{i}"
            ready = P.encode_ready(P.Ready(wid, model, role, dict(labels or {}), 16, 256, 400_000, 1, epoch, heartbeat_ms))
            for j, ep in enumerate(brokers):
                sk = make_socket(ctx, spec.with_identity(f"{wid}/{epoch}/{j}".encode()), connect=ep)
                poller.register(sk)
                self._ready[sk] = ready
                self._unacked.add(sk)
        self._hb = P.encode_heartbeat()
        self._next_hb_s = 0.0
        self._hb_slot = 0
        self.requests = 0

    @property
    def sockets(self) -> list[zmq.Socket]:
        return list(self._ready)

    def owns(self, sock: zmq.Socket) -> bool:
        return sock in self._ready

    def tick(self, now_s: float) -> float:
        """Send heartbeats (or READY) when due; returns the monotonic time of the next tick.

        Each tick serves one of ``_HB_SLICES`` slices of the sockets, so every socket still
        heartbeats once per interval but the fleet never sends them all at once (N real
        workers are N processes with unrelated phases)."""
        if now_s >= self._next_hb_s:
            slot = self._hb_slot
            for k, (sk, ready) in enumerate(self._ready.items()):
                if k % _HB_SLICES == slot:
                    _try_send(sk, ready if sk in self._unacked else self._hb)
                    self.poller.recheck(sk)
            self._hb_slot = (slot + 1) % _HB_SLICES
            self._next_hb_s = now_s + self.heartbeat_s / _HB_SLICES
        return self._next_hb_s

    def serve(self, sk: zmq.Socket, max_messages: int = 256) -> None:
        """Handle what ``sk`` has queued (up to ``max_messages``), then re-check it."""
        for _ in range(max_messages):
            try:
                frames = recv_frames(sk)
            except zmq.Again:
                break
            msg = P.decode_broker_to_worker(frames)
            t = type(msg)
            if t is P.Request:
                out, usage = instant_answer(msg.submit)
                _try_send(sk, P.encode_worker_final(msg.rid, msg.attempt, "length", usage, {"token_ids": out}))
                self.requests += 1
            elif t is P.Heartbeat:
                if sk in self._unacked:  # registered: confirm at once (the broker routes only then)
                    self._unacked.discard(sk)
                    _try_send(sk, self._hb)
            elif t is P.Disconnect:
                self._unacked.add(sk)
                _try_send(sk, self._ready[sk])
        self.poller.recheck(sk)

    def close(self, *, say_goodbye: bool = True) -> None:
        for sk in self._ready:
            if say_goodbye:
                _try_send(sk, P.encode_disconnect("worker_shutdown"))
            self.poller.unregister(sk)
            sk.close(linger=100 if say_goodbye else 0)
        self._ready.clear()


def run_instant_fleet(settings: WorkerSettings) -> None:
    """Serve until SIGTERM/SIGINT. Each worker connects to every broker in ``settings.brokers``."""
    ctx = zmq.Context()
    poller = ReadyPoller()
    fleet = InstantFleet(ctx, poller, settings.brokers, count=settings.count, worker_id=settings.worker_id,
                         model=settings.model, role=settings.role, labels=dict(settings.labels),
                         heartbeat_ms=settings.heartbeat_ms)
    stop = False

    def _stop(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    freeze_startup_heap()
    announce("workers_started", count=settings.count, brokers=list(settings.brokers), instant=True)
    while not stop:
        next_s = fleet.tick(time.monotonic())
        for sk in poller.wait(max(0.0, next_s - time.monotonic())):
            fleet.serve(sk)
    fleet.close()
    poller.close()
    ctx.term()


def _try_send(sk: zmq.Socket, frames: list[bytes]) -> bool:
    try:
        send_frames(sk, frames)
        return True
    except zmq.Again:
        return False
