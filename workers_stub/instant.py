"""Instant workers for benchmarks: N DEALERs served by one synchronous poll loop.

They speak the full worker protocol (READY, heartbeats both ways, DISCONNECT -> READY again)
but answer every REQUEST with a FINAL at once, echoing up to ``max_new_tokens`` prompt tokens.
One thread and one poller for all sockets keeps their own overhead far below the broker's, so
``mesh bench broker`` measures the broker, not the fake fleet (the baseline arm's echo workers
are built the same way).
"""

from __future__ import annotations

import os
import signal
import time

import zmq

from mesh import protocol as P
from mesh.config import WorkerSettings
from mesh.logs import announce
from mesh.sockets import WORKER_DEALER, make_socket, recv_frames, send_frames

__all__ = ["run_instant_fleet"]


def run_instant_fleet(settings: WorkerSettings) -> None:
    """Serve until SIGTERM/SIGINT. Each worker connects to every broker in ``settings.brokers``."""
    ctx = zmq.Context()
    base = settings.worker_id or f"instant-{os.getpid()}"
    epoch = int(time.time() * 1000)
    socks: list[tuple[zmq.Socket, list[bytes]]] = []
    poller = zmq.Poller()
    for i in range(settings.count):
        wid = base if settings.count == 1 else f"{base}-{i}"
        ready = P.encode_ready(P.Ready(wid, settings.model, settings.role, dict(settings.labels), 16, 256, 400_000, 1, epoch,
                                       settings.heartbeat_ms))
        for j, ep in enumerate(settings.brokers):
            sk = make_socket(ctx, WORKER_DEALER.with_identity(f"{wid}/{epoch}/{j}".encode()), connect=ep)
            poller.register(sk, zmq.POLLIN)
            socks.append((sk, ready))  # READY goes out on the first heartbeat tick
    stop = False

    def _stop(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    announce("workers_started", count=settings.count, brokers=list(settings.brokers), instant=True)
    hb = P.encode_heartbeat()
    hb_s = settings.heartbeat_ms / 1000.0
    next_hb = 0.0
    pending_ready = {id(sk) for sk, _ in socks}
    by_id = {id(sk): (sk, ready) for sk, ready in socks}
    while not stop:
        now = time.monotonic()
        if now >= next_hb:
            for sk, ready in socks:
                _try_send(sk, ready if id(sk) in pending_ready else hb)
            next_hb = now + hb_s
        for sk, _ in poller.poll(max(1, int((next_hb - time.monotonic()) * 1000))):
            _, ready = by_id[id(sk)]
            for _ in range(256):
                try:
                    frames = recv_frames(sk)
                except zmq.Again:
                    break
                msg = P.decode_broker_to_worker(frames)
                t = type(msg)
                if t is P.Request:
                    sub = msg.submit
                    prompt = sub.input_ids or list((sub.text or "").encode())
                    out = prompt[: sub.max_new_tokens]
                    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out), "cached_tokens": 0}
                    _try_send(sk, P.encode_worker_final(msg.rid, msg.attempt, "length", usage, {"token_ids": out}))
                elif t is P.Heartbeat:
                    pending_ready.discard(id(sk))
                elif t is P.Disconnect:
                    pending_ready.add(id(sk))
                    _try_send(sk, ready)
    for sk, _ in socks:
        _try_send(sk, P.encode_disconnect("worker_shutdown"))
        sk.close(linger=100)
    ctx.term()


def _try_send(sk: zmq.Socket, frames: list[bytes]) -> bool:
    try:
        send_frames(sk, frames)
        return True
    except zmq.Again:
        return False
