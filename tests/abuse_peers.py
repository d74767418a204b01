"""Hostile and broken peers for the abuse tests: raw DEALERs that speak MESH/1 on purpose badly.

Each peer is a real socket on 127.0.0.1 against a real broker process. :class:`FakeWorker`
registers (READY), answers the broker's heartbeats, and serves REQUESTs through a behaviour
coroutine, so a test can build a worker that never answers, lies about its load, refuses
everything, or impersonates another worker.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.kv_events import BlockStored, encode_event_map
from mesh.load import LoadStat

__all__ = ["FakeWorker", "raw_dealer", "status"]

_ids = itertools.count(1)


def raw_dealer(endpoint: str, *, identity: bytes | None = None, **opts: int) -> zmq.asyncio.Socket:
    """A DEALER with LINGER 0 (and the given socket options), connected to ``endpoint``."""
    s = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        s.setsockopt(zmq.ROUTING_ID, identity)
    for name, v in opts.items():
        s.setsockopt(getattr(zmq, name), v)
    s.connect(endpoint)  # (CURVE_* options, when given, are set before this)
    return s


async def status(frontend: str, timeout_s: float = 5.0) -> P.StatusReply:
    """STATUS on a fresh DEALER: every page of worker rows (issue 32: a client the broker does
    not authorise gets at most --status-max-workers rows a reply, ``truncated``: page with ``offset``)."""
    s = raw_dealer(frontend)
    try:
        first = None
        rows: list = []
        while True:
            await s.send_multipart(P.encode_status_query(False, len(rows)))
            m = P.decode_client_reply(await asyncio.wait_for(s.recv_multipart(), timeout_s))
            assert isinstance(m, P.StatusReply), m
            first = first or m
            rows += m.workers
            if not m.broker.get("truncated") or not m.workers or len(rows) >= m.broker.get("workers_total", 0):
                break
        first.workers = rows
        return first
    finally:
        s.close()


Behaviour = Callable[["FakeWorker", P.Request], Awaitable[None]]


async def never_answer(w: "FakeWorker", r: P.Request) -> None:
    """Hold the request forever (a wedged engine behind a live event loop)."""


async def answer_ok(w: "FakeWorker", r: P.Request) -> None:
    """An honest answer: ``max_new_tokens`` tokens, streamed as one chunk when the client streams."""
    n = r.submit.max_new_tokens
    toks = [w.token] * n
    usage = {"prompt_tokens": len(r.submit.input_ids or []), "completion_tokens": n}
    if r.submit.stream:
        if n:
            await w.send(P.encode_worker_chunk(r.rid, r.attempt, 0, {"token_ids": toks}))
        await w.send(P.encode_worker_final(r.rid, r.attempt, "length", usage))
    else:
        await w.send(P.encode_worker_final(r.rid, r.attempt, "length", usage, {"token_ids": toks}))


class FakeWorker:
    """A registered MESH/1 worker with a pluggable request behaviour.

    ``load`` (a LoadStat or None) is attached to every heartbeat reply. ``requests`` counts the
    REQUESTs it received; ``disconnects`` the DISCONNECTs.
    """

    def __init__(self, backend: str, worker_id: str, behaviour: Behaviour = answer_ok, *, heartbeat_ms: int = 200,
                 load: LoadStat | None = None, labels: dict[str, str] | None = None, token: int = 7,
                 max_total_num_tokens: int = 400_000, identity: bytes | None = None, **sockopts) -> None:
        self.worker_id = worker_id
        self.behaviour = behaviour
        self.load = load
        self.token = token
        self.ready = P.Ready(worker_id, "sim-llama-8b", "mixed", labels or {}, 16, 256, max_total_num_tokens, 1, next(_ids), heartbeat_ms)
        self.sock = raw_dealer(backend, identity=identity or f"fake-{worker_id}-{next(_ids)}".encode(), **sockopts)
        self.requests = 0
        self.disconnects: list[str] = []
        self.registered = asyncio.Event()
        self.silent = False  # True: read, but never answer heartbeats (a peer that only holds a slot)
        self._task: asyncio.Task | None = None
        self._jobs: set[asyncio.Task] = set()

    async def send(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    async def start(self, wait: bool = True, timeout_s: float = 5.0) -> "FakeWorker":
        await self.send(P.encode_ready(self.ready))
        self._task = asyncio.create_task(self._serve())
        if wait:
            await asyncio.wait_for(self.registered.wait(), timeout_s)
        return self

    async def _serve(self) -> None:
        while True:
            m = P.decode_broker_to_worker(await self.sock.recv_multipart())
            if isinstance(m, P.Heartbeat):
                self.registered.set()
                if not self.silent:
                    await self.send(P.encode_heartbeat([self.load] if self.load is not None else None))
            elif isinstance(m, P.Request):
                self.requests += 1
                t = asyncio.create_task(self.behaviour(self, m))
                self._jobs.add(t)
                t.add_done_callback(self._jobs.discard)
            elif isinstance(m, P.Disconnect):
                self.disconnects.append(m.reason)

    async def close(self) -> None:
        """Cancel the tasks, wait for them, then close the socket. Closing a zmq.asyncio socket
        under a pending receive leaves the loop watching a dead file descriptor, which the next
        socket may reuse: its replies would then never be read."""
        tasks = [t for t in [self._task, *self._jobs] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.sock.close()


def kv_batch(seq: int, events_n: int = 7900) -> list[bytes]:
    """A KV_EVENTS batch just under the frame limit (~4.2 MB, 126k blocks): ~0.35 s of broker CPU."""
    events = [encode_event_map(BlockStored(tuple(range(j * 16 + 1, j * 16 + 17)), None, tuple(range(256)), 16))
              for j in range(events_n)]
    return P.encode_kv_events(0, 1, seq, 0.0, events)


async def impostor_answer(w: FakeWorker, r: P.Request) -> None:
    await w.send(P.encode_worker_final(r.rid, r.attempt, "length", {}, {"token_ids": [666]}))


async def long_stream(w: FakeWorker, r: P.Request) -> None:
    """1,000 chunks of 64 tokens for the slow reader's requests (first token 77); an honest
    answer to anything else (it may be routed other clients' requests)."""
    if not r.submit.input_ids or r.submit.input_ids[0] != 77:
        await answer_ok(w, r)
        return
    for seq in range(1000):
        await w.send(P.encode_worker_chunk(r.rid, r.attempt, seq, {"token_ids": list(range(64))}))
    await w.send(P.encode_worker_final(r.rid, r.attempt, "length", {"prompt_tokens": 2, "completion_tokens": 1000}))
