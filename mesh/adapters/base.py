"""What every adapter shares: KV stream relay, block mirror, load, health gating, request proxy.

One :class:`Adapter` = one inference server attached as one mesh worker. Engine specifics (how to
discover, which HTTP endpoint serves a request, how load is polled) live in a :class:`Backend`
(:mod:`mesh.adapters.sglang`, :mod:`mesh.adapters.vllm`).

KV events (``worker-telemetry.md`` §1-§6, §15-§16), per DP rank (:class:`KvRelay`)
-----------------------------------------------------------------------------------
* One SUB per rank (``tcp://host:base+r``, ``SUBSCRIBE = topic``) and, when the server has a
  replay endpoint, one DEALER per rank for replay. Envelopes are ``[topic, seq8, payload]``;
  payloads are decoded tolerantly (:func:`mesh.kv_events.decode_batch`: maps or arrays, 2- or
  3-element batches, vLLM shapes). A malformed frame is counted (``kv.malformed_*``) and skipped;
  a bad event inside a good batch is counted (``kv.skipped_*``) and the rest is relayed.
* Sequence tracking per rank: ``seq == last + 1`` -> relay. ``seq > last + 1`` -> **gap**: replay
  from ``last`` over the DEALER (``[b"", seq8]``; 3- and 4-frame replies and the ``ff*8`` end
  marker accepted). Asking from ``last`` (not ``last + 1``) re-fetches one known batch so its
  timestamp can be compared: a different ``ts`` for the same seq means the server restarted
  behind our back. When the replay cannot cover the hole (first replayed seq above the one
  needed: history lost; or no replay endpoint / timeout) the adapter drops its mirror of that
  rank and relays ``AllBlocksCleared``: the brokers then under-report that rank's cache until new
  events arrive, but never route on blocks that may have been evicted meanwhile.
* ``seq <= last`` with an unknown ``(seq, ts)`` -> the server **restarted** (its counter went back
  to 0). Chosen handling: the rank's mesh KV stream gets a **new epoch** (``KV_EVENTS.epoch``,
  mesh seq back to 0) whose first batch is ``AllBlocksCleared``; brokers' indexes see NEW_EPOCH
  and drop the rank's blocks, then the new publisher's history is replayed from 0 and relayed.
  The broker session itself (READY epoch) is kept: requests in flight on the dead server fail over
  HTTP and are retried by the brokers. The same happens when ``/server_info.startup_time``
  changed across a health outage.
* Startup: the adapter replays each rank from seq 0, so attaching to a warm server rebuilds its
  cache state (as far as the server's replay buffer reaches).
* Relayed batches carry the adapter's own per-rank ``seq`` (contiguous per epoch) and tagged-map
  events (:func:`mesh.kv_events.encode_event_map`), split so no batch exceeds
  ``max_batch_tokens`` tokens.

Mirror and resync: the adapter keeps a :class:`BlockMirror` per rank (engine hash -> parent and
tokens, built from the events it relayed). A broker RESYNC for rank r, and every (re)registration
with a broker, is answered with a snapshot: ``AllBlocksCleared`` then ``BlockStored`` for every
mirrored block, parent first, relayed like any batch (to every broker, one sequence per rank).

Load: the LoadStat PUB when the server has one (one SUB per rank, ``[b"load", seq8, LoadStat]``);
otherwise (or when it is stale) the backend polls HTTP. Every HEARTBEAT carries the fresh
LoadStats.

Errors: one boundary, :func:`engine_error`, turns what talking to the engine raised into the mesh
error tree (:mod:`mesh.errors`), naming the engine URL: the worker reports its code in the ERROR
frame of the request, discovery retries what is retryable, health and load polls count it.

=====================================================  ==============================
raised while talking to the engine                     becomes
=====================================================  ==============================
a non-200 answer (aiohttp.ClientResponseError too)     error_code_for_status(status)
TimeoutError (a per-call timeout: connect, health)     RetryableError(unavailable)
EngineConnectionError, aiohttp.ClientError, OSError    RetryableError(unavailable)
(refused, reset, truncated body)
a body that is not JSON, or JSON of the wrong shape    RetryableError(worker_error)
(ValueError, KeyError, TypeError)
anything else (a bug)                                  FatalRequestError(internal)
=====================================================  ==============================

The request's own deadline passing is ``deadline_exceeded`` (not retried: the time is gone).

Health gating: ``GET <health_path>`` every ``health_interval_ms``. The adapter registers with the
brokers only while the server is healthy; after ``unhealthy_after`` failed checks it sends
DISCONNECT and closes its broker links (brokers stop offering work and retry what was in
flight), and registers again (READY, then a KV snapshot) when the server answers again.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable
from urllib.parse import urlsplit

import aiohttp
import orjson
import zmq
import zmq.asyncio

from mesh import kv_events as KV
from mesh.adapters.engine_http import EngineConnectionError, EngineHttp
from mesh import protocol as P
from mesh.errors import ConfigError, ErrorCode, FatalRequestError, MeshError, ProtocolError, RequestError, RetryableError, error_for
from mesh.load import LoadStat
from mesh import tracing
from mesh.logs import RateLimiter, announce, get_logger
from mesh.adapters.settings import AttachSettings  # noqa: F401 - re-exported: the adapters' settings
from mesh.retry import RetryPolicy
from mesh.openai_logprobs import LOGPROB_KEYS
from mesh.sockets import SocketSpec, make_socket, recv_frames, socket_readable
from mesh.worker import BrokerLink, Capabilities, WorkerAPI

__all__ = [
    "ENGINE_SUB",
    "REPLAY_DEALER",
    "LOAD_SUB",
    "AttachSettings",
    "EngineInfo",
    "BlockMirror",
    "RankStream",
    "KvRelay",
    "Backend",
    "StreamState",
    "Adapter",
    "rank_endpoint",
    "split_events",
    "sse_events",
    "parse_prometheus",
    "error_code_for_status",
    "engine_error",
    "END_SEQ",
]

# Engine-side sockets (the engine binds; the adapter connects). A KV SUB must never be the slow
# joiner that drops: a deep receive queue, and no message size cap below what an engine sends.
_BIG = 256 * 1024 * 1024
ENGINE_SUB = SocketSpec(zmq.SUB, sndhwm=1000, rcvhwm=100_000, linger_ms=0, maxmsgsize=_BIG)
REPLAY_DEALER = SocketSpec(zmq.DEALER, sndhwm=100, rcvhwm=100_000, linger_ms=0, maxmsgsize=_BIG, immediate=False)
LOAD_SUB = SocketSpec(zmq.SUB, sndhwm=100, rcvhwm=1000, linger_ms=0, maxmsgsize=1024 * 1024)

END_SEQ = b"\xff" * 8
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")



# Engine request ids must be unique per engine: the broker's rid and attempt are unique per broker,
# and a salt drawn at start plus a counter keeps two brokers' (or two runs') ids apart without a
# random draw per request.
_RID_SALT = secrets.token_hex(3)
_RID_SEQ = itertools.count(1)


def engine_request_id(r: "P.Request") -> str:
    """The id the engine is given for one attempt: the caller's id (the HTTP ``x-request-id``,
    else the broker's), then the broker's request number and attempt, so the engine's logs name
    the caller's request (SGLang ``rid``, vLLM ``request_id``)."""
    return f"{r.submit.rid}/{r.rid}.{r.attempt}.{_RID_SALT}{next(_RID_SEQ):x}"[:256]


def _log_crash(log, task: asyncio.Task) -> None:
    """Done-callback: a background task must never die silently."""
    if not task.cancelled() and task.exception() is not None:
        log.error("adapter_task_crashed", task=task.get_name(), error=repr(task.exception())[:500])


# --------------------------------------------------------------------------- settings


@dataclass
class EngineInfo:
    """What the adapter knows about the server (discovery + flags)."""

    model: str
    block_size: int
    dp_size: int
    topic: str = ""
    kv_endpoints: list[str | None] = field(default_factory=list)  # per rank; None = no KV events
    replay_endpoints: list[str | None] = field(default_factory=list)
    load_endpoints: list[str | None] = field(default_factory=list)
    max_running_requests: int = 256
    max_total_num_tokens: int = 1 << 20
    incremental_streaming: bool = False
    startup_time: float | None = None

    def describe(self) -> dict[str, Any]:
        return {"model": self.model, "block_size": self.block_size, "dp_size": self.dp_size, "topic": self.topic,
                "kv_endpoints": self.kv_endpoints, "replay_endpoints": self.replay_endpoints, "load_endpoints": self.load_endpoints}


def rank_endpoint(base: str, rank: int) -> str:
    """SGLang's per-rank endpoint: ``tcp://h:P`` -> ``tcp://h:P+r``; ``inproc://x``/``ipc://x`` -> ``x_dp{r}``."""
    if rank == 0:
        return base
    if base.startswith("tcp://"):
        host, _, port = base[6:].rpartition(":")
        return f"tcp://{host}:{int(port) + rank}"
    return f"{base}_dp{rank}"


def replace_wildcard(endpoint: str, host: str) -> str:
    """``tcp://*:5557`` -> ``tcp://<host>:5557`` (a worker reports its bind address)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    h, _, port = endpoint[6:].rpartition(":")
    if h in _WILDCARD_HOSTS:
        h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{h}:{port}"


# --------------------------------------------------------------------------- KV relay


def split_events(events: list[KV.KvEvent], max_tokens: int, max_hashes: int = 16_384) -> list[list[KV.KvEvent]]:
    """Cut an event list into batches of at most ``max_tokens`` stored tokens (order kept).

    A BlockStored larger than the budget is split into consecutive BlockStored events (the
    parent of each piece is the last hash of the previous one); long BlockRemoved lists are split
    at ``max_hashes``.
    """
    out: list[list[KV.KvEvent]] = []
    cur: list[KV.KvEvent] = []
    used = 0
    for ev in events:
        t = type(ev)
        if t is KV.BlockStored:
            bs = ev.block_size
            per = max(1, min(max_tokens // bs, max_hashes))
            hashes, toks, parent = ev.block_hashes, ev.token_ids, ev.parent_block_hash
            i = 0
            while i < len(hashes):
                room = max(0, (max_tokens - used) // bs)
                if room == 0:
                    out.append(cur)
                    cur, used = [], 0
                    room = per
                n = min(room, per, len(hashes) - i)
                last_piece = i + n >= len(hashes)
                piece = KV.BlockStored(hashes[i:i + n], parent, toks[i * bs:(i + n) * bs], bs, ev.medium, ev.lora_name,
                                       ev.lookahead_token_id if last_piece else None, ev.cache_salt)
                if n == len(hashes):
                    piece = ev
                cur.append(piece)
                used += n * bs
                parent = hashes[i + n - 1]
                i += n
        elif t is KV.BlockRemoved and len(ev.block_hashes) > max_hashes:
            hs = ev.block_hashes
            for i in range(0, len(hs), max_hashes):
                cur.append(KV.BlockRemoved(hs[i:i + max_hashes], ev.medium))
        else:
            cur.append(ev)
    if cur:
        out.append(cur)
    return out


class BlockMirror:
    """The engine's cached blocks of one rank, as learned from its events (for resync snapshots).

    Keyed by (medium, engine hash); values are (parent hash, tokens, block size, namespace) with
    namespace = (lora name, cache salt) or None (plain).
    """

    def __init__(self) -> None:
        self.blocks: dict[tuple[str | None, int], tuple[int | None, tuple[int, ...], int, tuple | None]] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def clear(self) -> None:
        self.blocks.clear()

    def apply(self, events: list[KV.KvEvent]) -> None:
        blocks = self.blocks
        for ev in events:
            t = type(ev)
            if t is KV.BlockStored:
                bs, toks, parent, m = ev.block_size, ev.token_ids, ev.parent_block_hash, ev.medium
                lora = None if ev.lora_name is None and ev.cache_salt is None else (ev.lora_name, ev.cache_salt)
                for i, h in enumerate(ev.block_hashes):
                    blocks[(m, h)] = (parent, toks[i * bs:(i + 1) * bs], bs, lora)
                    parent = h
            elif t is KV.BlockRemoved:
                m = ev.medium
                for h in ev.block_hashes:
                    if blocks.pop((m, h), None) is None and m is None:
                        blocks.pop(("GPU", h), None)
            elif t is KV.AllBlocksCleared:
                blocks.clear()

    def snapshot_events(self) -> list[KV.BlockStored]:
        """BlockStored events for every block, each parent before its children, chains merged."""
        blocks = self.blocks
        out: list[KV.BlockStored] = []
        emitted: set[tuple[str | None, int]] = set()
        cur: list[Any] | None = None  # [medium, hashes, parent, tokens, bs, lora]

        def flush() -> None:
            if cur is not None:
                ns = cur[5] or (None, None)
                out.append(KV.BlockStored(tuple(cur[1]), cur[2], tuple(cur[3]), cur[4], cur[0], ns[0], cache_salt=ns[1]))

        for key in list(blocks):
            if key in emitted:
                continue
            chain = []
            k: tuple[str | None, int] | None = key
            seen: set = set()
            while k is not None and k in blocks and k not in emitted and k not in seen:
                seen.add(k)
                chain.append(k)
                p = blocks[k][0]
                k = (k[0], p) if p is not None else None
            for k in reversed(chain):
                parent, toks, bs, lora = blocks[k]
                emitted.add(k)
                if cur is not None and cur[0] == k[0] and cur[4] == bs and cur[5] == lora and cur[1][-1] == parent:
                    cur[1].append(k[1])
                    cur[3].extend(toks)
                else:
                    flush()
                    cur = [k[0], [k[1]], parent, list(toks), bs, lora]
        flush()
        return out


ACCEPT, DUP, GAP, RESTART = "accept", "dup", "gap", "restart"


class RankStream:
    """Sequencing state, sockets and mirror of one DP rank's engine KV stream."""

    RECENT = 4096  # (seq, ts) pairs remembered to tell replay overlap from a publisher restart

    def __init__(self, rank: int, kv_endpoint: str, replay_endpoint: str | None, topic: str, block_size: int, epoch: int) -> None:
        self.rank = rank
        self.kv_endpoint = kv_endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.block_size = block_size
        self.epoch = epoch
        self.mesh_seq = 0
        self.last_seq = -1  # last engine seq relayed (or skipped as malformed); -1 = none yet
        self.recent: OrderedDict[int, float | None] = OrderedDict()
        self.mirror = BlockMirror()
        self.lock = asyncio.Lock()
        self.sub: zmq.asyncio.Socket | None = None
        self.dealer: zmq.asyncio.Socket | None = None

    def classify(self, seq: int, ts: float | None) -> str:
        last = self.last_seq
        if last < 0 or seq == last + 1:
            return ACCEPT
        if seq <= last:
            if seq in self.recent and self.recent[seq] == ts:
                return DUP
            return RESTART
        return GAP

    def mark(self, seq: int, ts: float | None) -> None:
        self.last_seq = seq
        r = self.recent
        r[seq] = ts
        while len(r) > self.RECENT:
            r.popitem(last=False)


class KvRelay:
    """Engine KV event streams (one per DP rank) -> mesh KV_EVENTS batches through ``send``.

    ``send(rank, frames)`` delivers one encoded KV_EVENTS message to the brokers.
    """

    def __init__(self, ctx: zmq.asyncio.Context, ranks: list[RankStream], send: Callable[[int, list[bytes]], None], *,
                 counters: Counter | None = None, replay_timeout_s: float = 2.0, max_batch_tokens: int = 131_072,
                 log=None) -> None:
        self.ctx = ctx
        self.ranks = ranks
        self.by_rank = {rs.rank: rs for rs in ranks}
        self.send = send
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self.replay_timeout_s = replay_timeout_s
        self.max_batch_tokens = max_batch_tokens
        self.log = log or get_logger(service="adapter")
        self._limiter = RateLimiter(5.0)
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for rs in self.ranks:
            t = asyncio.create_task(self._rank_loop(rs), name=f"kv-rank-{rs.rank}")
            t.add_done_callback(lambda t: _log_crash(self.log, t))
            self._tasks.append(t)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for rs in self.ranks:
            for s in (rs.sub, rs.dealer):
                if s is not None:
                    s.close(linger=0)
            rs.sub = rs.dealer = None

    async def _rank_loop(self, rs: RankStream) -> None:
        rs.sub = make_socket(self.ctx, ENGINE_SUB, connect=rs.kv_endpoint)
        rs.sub.setsockopt(zmq.SUBSCRIBE, rs.topic)
        sync = zmq.Socket.shadow(rs.sub.underlying)
        if rs.replay_endpoint is not None:
            async with rs.lock:
                await self._replay(rs, 0)  # rebuild what a warm server already holds
        # Wait on the socket's FD directly (pyzmq's async poll builds a poller and futures per
        # call, which showed in the adapter's profile under KV traffic). The FD is edge-triggered:
        # sleep only after EVENTS said there is nothing left (nothing is ever sent on a SUB).
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        fd = sync.getsockopt(zmq.FD)
        loop.add_reader(fd, wake.set)
        try:
            while True:
                wake.clear()
                more = False
                async with rs.lock:
                    for _ in range(256):
                        try:
                            frames = recv_frames(sync)
                        except zmq.Again:
                            break
                        await self.on_live(rs, frames)
                    else:
                        more = True
                if more:
                    await asyncio.sleep(0)  # a long burst: let requests run, then drain on
                    continue
                if socket_readable(sync):
                    continue
                try:
                    async with asyncio.timeout(1.0):
                        await wake.wait()
                except TimeoutError:
                    pass
        finally:
            loop.remove_reader(fd)

    # ------------------------------------------------------------------ live stream

    def _envelope(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        if len(frames) != 3 or len(frames[1]) != 8 or frames[1] == END_SEQ:
            self.counters["malformed_envelope"] += 1
            if self._limiter.allow("envelope"):
                self.log.warning("kv_frame_malformed", frames=len(frames), seq_len=len(frames[1]) if len(frames) > 1 else None)
            return None
        return int.from_bytes(frames[1], "big"), frames[2]

    async def on_live(self, rs: RankStream, frames: list[bytes]) -> None:
        """Handle one live SUB message (may replay first)."""
        env = self._envelope(frames)
        if env is None:
            return
        seq, payload = env
        batch = KV.decode_batch(payload)
        ts = batch.ts if isinstance(batch, KV.EventBatch) else None
        v = rs.classify(seq, ts)
        if v is ACCEPT:
            self._accept(rs, seq, ts, batch)
            return
        if v is DUP:
            self.counters["duplicates"] += 1
            return
        if v is RESTART:
            self._restart(rs, "sequence_went_back", seq=seq)
            if rs.replay_endpoint is not None:
                await self._replay(rs, 0)
        elif rs.replay_endpoint is not None:
            self.counters["gaps"] += 1
            await self._replay(rs, rs.last_seq)  # from last: also verifies the publisher is the same one
        else:
            self.counters["gaps"] += 1
        v = rs.classify(seq, ts)
        if v is DUP:
            return
        if v is not ACCEPT:  # the replay could not fill the hole
            self._lost(rs, "gap_not_replayable", seq=seq)
        self._accept(rs, seq, ts, batch)

    # ------------------------------------------------------------------ replay

    def _dealer(self, rs: RankStream) -> zmq.asyncio.Socket:
        if rs.dealer is None:
            assert rs.replay_endpoint is not None
            rs.dealer = make_socket(self.ctx, REPLAY_DEALER, connect=rs.replay_endpoint)
        return rs.dealer

    async def _replay(self, rs: RankStream, start: int) -> None:
        if await self._replay_once(rs, start):
            self._restart(rs, "replay_timestamp_mismatch")
            await self._replay_once(rs, 0)

    async def _replay_once(self, rs: RankStream, start: int) -> bool:
        """Fetch and relay batches ``>= start``. Returns True if they show a publisher restart."""
        sock = self._dealer(rs)
        self.counters["replay_requests"] += 1
        await sock.send_multipart([b"", max(0, start).to_bytes(8, "big")])
        restarted = False
        first = True
        n = 0
        while True:
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), self.replay_timeout_s)
            except asyncio.TimeoutError:
                self.counters["replay_timeouts"] += 1
                self.log.warning("kv_replay_timeout", dp_rank=rs.rank, endpoint=rs.replay_endpoint, start=start)
                sock.close(linger=0)  # late replies must not leak into the next replay
                rs.dealer = None
                return restarted
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 2:
                seq8, payload = frames
            elif len(frames) == 3:
                seq8, payload = frames[1], frames[2]
            else:
                self.counters["malformed_replay_frame"] += 1
                continue
            if seq8 == END_SEQ:
                break
            if len(seq8) != 8:
                self.counters["malformed_replay_frame"] += 1
                continue
            if restarted:
                continue  # drain to the end marker; the caller replays the new publisher from 0
            seq = int.from_bytes(seq8, "big")
            if first:
                first = False
                if seq > start and rs.last_seq < 0 and start == 0:
                    self.counters["history_truncated_at_start"] += 1
            batch = KV.decode_batch(payload)
            ts = batch.ts if isinstance(batch, KV.EventBatch) else None
            v = rs.classify(seq, ts)
            if v is ACCEPT:
                self._accept(rs, seq, ts, batch)
                n += 1
            elif v is RESTART:
                restarted = True
            elif v is GAP:  # the buffer no longer reaches back to what we miss
                self._lost(rs, "replay_history_lost", seq=seq)
                self._accept(rs, seq, ts, batch)
                n += 1
        self.counters["replayed_batches"] += n
        return restarted

    async def verify(self, restarted: bool) -> None:
        """After a health outage: detect a server restart (given, or by replay timestamps)."""
        for rs in self.ranks:
            async with rs.lock:
                if restarted:
                    self._restart(rs, "startup_time_changed")
                    if rs.replay_endpoint is not None:
                        await self._replay(rs, 0)
                elif rs.replay_endpoint is not None and rs.last_seq >= 0:
                    await self._replay(rs, rs.last_seq)

    # ------------------------------------------------------------------ state changes

    def _accept(self, rs: RankStream, seq: int, ts: float | None, batch: KV.EventBatch | ProtocolError) -> None:
        rs.mark(seq, ts)
        if isinstance(batch, ProtocolError):
            self.counters[f"malformed_{batch.reason}"] += 1
            if self._limiter.allow(("malformed", batch.reason)):
                self.log.warning("kv_batch_malformed", dp_rank=rs.rank, seq=seq, reason=batch.reason, detail=batch.detail[:200])
            return
        for reason, n in batch.skipped.items():
            self.counters[f"skipped_{reason}"] += n
        if batch.dp_rank is not None and batch.dp_rank != rs.rank:
            self.counters["rank_mismatch"] += 1
            if self._limiter.allow("rank"):
                self.log.warning("kv_batch_rank_mismatch", dp_rank=rs.rank, batch_rank=batch.dp_rank)
            return
        events: list[KV.KvEvent] = []
        bs = rs.block_size
        for e in batch.events:
            if type(e) is KV.BlockStored and e.block_size != bs:
                self.counters["wrong_block_size"] += 1
                if self._limiter.allow("bs"):
                    self.log.warning("kv_block_size_mismatch", dp_rank=rs.rank, event_block_size=e.block_size, block_size=bs)
                continue
            events.append(e)
        self.counters["engine_batches"] += 1
        if events:
            rs.mirror.apply(events)
            self._relay(rs, batch.ts, events)

    def _relay(self, rs: RankStream, ts: float, events: list[KV.KvEvent]) -> None:
        for chunk in split_events(events, self.max_batch_tokens):
            wire = [KV.encode_event_map(e) for e in chunk]
            frames = P.encode_kv_events(rs.rank, rs.epoch, rs.mesh_seq, ts, wire)
            rs.mesh_seq += 1
            self.counters["relayed_batches"] += 1
            self.counters["relayed_events"] += len(chunk)
            self.send(rs.rank, frames)

    def _lost(self, rs: RankStream, why: str, **kw) -> None:
        self.counters["history_lost"] += 1
        self.log.warning("kv_history_lost", dp_rank=rs.rank, why=why, last_seq=rs.last_seq, dropped_blocks=len(rs.mirror), **kw)
        rs.mirror.clear()
        self._relay(rs, time.time(), [KV.AllBlocksCleared()])

    def _restart(self, rs: RankStream, why: str, **kw) -> None:
        self.counters["engine_restarts"] += 1
        self.counters[f"restart_{why}"] += 1
        self.log.warning("kv_publisher_restarted", dp_rank=rs.rank, why=why, last_seq=rs.last_seq, new_epoch=rs.epoch + 1, **kw)
        rs.epoch += 1
        rs.mesh_seq = 0
        rs.last_seq = -1
        rs.recent.clear()
        rs.mirror.clear()
        self._relay(rs, time.time(), [KV.AllBlocksCleared()])

    def snapshot(self, rank: int) -> bool:
        """Relay AllBlocksCleared + every mirrored block of ``rank`` (a broker RESYNC). False: no such rank."""
        rs = self.by_rank.get(rank)
        if rs is None:
            return False
        self.counters["snapshots"] += 1
        self._relay(rs, time.time(), [KV.AllBlocksCleared(), *rs.mirror.snapshot_events()])
        return True


# --------------------------------------------------------------------------- HTTP helpers


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The ``data`` payloads of a server-sent-event stream, from body pieces of any size (an event
    may span pieces, a piece may hold many events; CRLF or LF line ends; multi-line data joined
    with LF, as the SSE spec says)."""
    buf = b""
    data: list[bytes] = []
    async for chunk in chunks:
        buf = buf + chunk if buf else chunk
        pos = 0
        while True:
            i = buf.find(b"\n", pos)
            if i < 0:
                break
            line = buf[pos:i]
            pos = i + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if data:
                    yield data[0] if len(data) == 1 else b"\n".join(data)
                    data = []
            elif line.startswith(b"data:"):
                v = line[5:]
                data.append(v[1:] if v.startswith(b" ") else v)
        buf = buf[pos:]
    if buf.startswith(b"data:"):
        v = buf[5:].rstrip(b"\r")
        data.append(v[1:] if v.startswith(b" ") else v)
    if data:
        yield b"\n".join(data)


_PROM_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_PROM_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line)
        if not m:
            continue
        try:
            v = float(m.group(4))
        except ValueError:
            continue
        labels = dict(_PROM_LABEL.findall(m.group(3) or ""))
        out.append((m.group(1), labels, v))
    return out


def error_code_for_status(status: int) -> ErrorCode:
    """HTTP status of an engine reply -> mesh error code (retryable or not)."""
    if status in (400, 404, 405, 413, 414, 415, 422):
        return ErrorCode.BAD_REQUEST  # the request itself is wrong: no other worker will accept it
    if status == 429:
        return ErrorCode.OVERLOADED
    if status == 503:
        return ErrorCode.UNAVAILABLE
    if status == 504 or status == 408:
        return ErrorCode.WORKER_ERROR
    return ErrorCode.WORKER_ERROR  # 401/403 (adapter misconfigured for this server), 500, 502, ...


def engine_error(exc: BaseException, where: str) -> MeshError:
    """The adapter's one error boundary: what talking to the engine at ``where`` (its URL and
    path) raised, as a :mod:`mesh.errors` exception (table in the module docstring) whose message
    names ``where``. A :class:`~mesh.errors.MeshError` is returned as it is; the original is the
    ``__cause__``."""
    if isinstance(exc, MeshError):
        return exc
    err: RequestError
    if isinstance(exc, aiohttp.ContentTypeError):  # a ClientResponseError, but about the body
        err = RetryableError(ErrorCode.WORKER_ERROR, f"{where}: the engine's answer is not JSON")
    elif isinstance(exc, aiohttp.ClientResponseError):
        err = error_for(error_code_for_status(exc.status), f"{where}: HTTP {exc.status} {exc.message}"[:512])
    elif isinstance(exc, TimeoutError):  # asyncio's and aiohttp's timeouts (an OSError: first)
        err = RetryableError(ErrorCode.UNAVAILABLE, f"{where}: the engine did not answer in time")
    elif isinstance(exc, (EngineConnectionError, aiohttp.ClientError, OSError)):
        err = RetryableError(ErrorCode.UNAVAILABLE, f"{where}: engine connection failed: {type(exc).__name__}: {exc}"[:512])
    elif isinstance(exc, ValueError):  # json.JSONDecodeError, orjson.JSONDecodeError
        err = RetryableError(ErrorCode.WORKER_ERROR, f"{where}: the engine's answer is not valid: {exc}"[:512])
    elif isinstance(exc, (KeyError, TypeError)):
        err = RetryableError(ErrorCode.WORKER_ERROR, f"{where}: the engine's answer has an unexpected shape: {exc!r}"[:512])
    else:
        err = FatalRequestError(ErrorCode.INTERNAL, f"{where}: {exc!r}"[:512])
    err.__cause__ = exc
    return err


# --------------------------------------------------------------------------- backend interface


@dataclass(slots=True)
class StreamState:
    """Progress of one proxied request; a backend's ``parse`` fills the ``new_*`` fields per chunk."""

    n_ids: int = 0  # cumulative output ids seen (cumulative streams)
    text_len: int = 0
    new_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finish: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    error: tuple[ErrorCode, str] | None = None
    prompt_len: int = 0
    meta: dict[str, Any] | None = None  # the engine's own metadata of the latest event (SGLang meta_info)
    # positional meta lists (logprobs): the entries new in this event, and how many a cumulative
    # stream has shown so far, per key
    new_lists: dict[str, list] = field(default_factory=dict)
    lists_seen: dict[str, int] = field(default_factory=dict)


class Backend:
    """Engine-specific parts of an adapter. Subclasses: SglangBackend, VllmBackend."""

    kind = "engine"
    default_health_path = "/health"

    def __init__(self, s: AttachSettings) -> None:
        self.s = s
        self.log = get_logger(service="adapter", engine=self.kind)

    async def discover(self, http: aiohttp.ClientSession) -> EngineInfo:  # pragma: no cover - abstract
        raise NotImplementedError

    async def restarted(self, http: aiohttp.ClientSession, info: EngineInfo) -> bool:
        """True when the server is known to have restarted since discovery (False: unknown)."""
        return False

    def request(self, r: P.Request, info: EngineInfo) -> tuple[str, dict[str, Any]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def parse(self, obj: Any, st: StreamState, info: EngineInfo) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    async def poll_load(self, http: aiohttp.ClientSession, info: EngineInfo) -> list[LoadStat] | None:
        return None

    def prefill_leg(self, r: P.Request, info: EngineInfo) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
        """PD prefill leg (``bootstrap.mode == "prefill"``): (path, body, FINAL data) or None if unsupported."""
        return None

    # The engine's side API (discovery, health, load): every failure leaves through engine_error.
    async def get_json(self, http: aiohttp.ClientSession, path: str, timeout_s: float = 5.0) -> tuple[int, Any]:
        """(status, decoded JSON body or None when not 200); raises :func:`engine_error`'s errors."""
        url = self.s.base_url + path
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    return resp.status, None
                return 200, await resp.json(content_type=None)
        except Exception as exc:
            raise engine_error(exc, f"GET {url}") from exc

    async def get_text(self, http: aiohttp.ClientSession, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
        """(status, body text or "" when not 200); raises :func:`engine_error`'s errors."""
        url = self.s.base_url + path
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, (await resp.text() if resp.status == 200 else "")
        except Exception as exc:
            raise engine_error(exc, f"GET {url}") from exc

    async def get_status(self, http: aiohttp.ClientSession, path: str, timeout_s: float = 5.0) -> int:
        """The status of ``GET path`` (body read and dropped); raises :func:`engine_error`'s errors."""
        url = self.s.base_url + path
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                return resp.status
        except Exception as exc:
            raise engine_error(exc, f"GET {url}") from exc

    def not_ready(self, path: str, status: int) -> RetryableError:
        """Discovery's answer to a non-200 side-API reply: the engine is not serving yet (retried)."""
        return RetryableError(ErrorCode.UNAVAILABLE, f"GET {self.s.base_url}{path}: HTTP {status}")


# --------------------------------------------------------------------------- the adapter


class Adapter:
    """One attached server = one mesh worker. ``await run()`` until ``request_stop()``."""

    def __init__(self, s: AttachSettings, backend: Backend, *, ctx: zmq.asyncio.Context | None = None) -> None:
        s.validate()
        self.s = s
        self.backend = backend
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.worker_id = s.worker_id or f"{backend.kind}-{s.url_host}-{urlsplit(s.url).port or 80}"
        self.api = WorkerAPI(self.ctx, s.brokers, self.worker_id, self._capabilities, on_message=self._on_message,
                             on_session_lost=self._on_session_lost, load=lambda: self._fresh_loads(time.monotonic()),
                             heartbeat_ms=s.heartbeat_ms, liveness=s.liveness, reconnect_base_ms=s.reconnect_base_ms,
                             reconnect_cap_ms=s.reconnect_cap_ms, kv_events_to=s.kv_events_to)
        self.epoch = self.api.epoch
        self.log = get_logger(service="adapter", worker_id=self.worker_id)
        self.counters: Counter[str] = Counter()
        self.info: EngineInfo | None = None
        self.relay: KvRelay | None = None
        self.http: aiohttp.ClientSession | None = None  # discovery, health, load polls
        self.engine: EngineHttp | None = None  # the request path (see engine_http for why not aiohttp)
        self.healthy = False
        self._was_healthy = False
        self._need_snapshot: set[int] = set()
        self._serving: dict[tuple[int, int, int], asyncio.Task] = {}
        self._loads: list[tuple[LoadStat, float, str] | None] = []  # per rank: (stat, received at, source)
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()
        self._force = asyncio.Event()  # a second stop signal: skip the drain
        self._force_stop = False
        self._health_kick = asyncio.Event()
        self._stopping = False

    @property
    def links(self) -> list[BrokerLink]:
        return self.api.links

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Discover the server, start the KV relay, load and health tasks (registration follows health)."""
        s = self.s
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024), read_bufsize=1 << 20,
                                          timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self.engine = EngineHttp.for_url(s.base_url)
        self.info = info = await self._discover()
        ranks = []
        for r in range(info.dp_size):
            kv = info.kv_endpoints[r] if r < len(info.kv_endpoints) else None
            if kv is not None:
                rp = info.replay_endpoints[r] if r < len(info.replay_endpoints) else None
                ranks.append(RankStream(r, kv, rp, info.topic, info.block_size, self.epoch))
        self.relay = KvRelay(self.ctx, ranks, self._send_kv, counters=self.counters, replay_timeout_s=s.replay_timeout_ms / 1000,
                             max_batch_tokens=s.max_batch_tokens, log=self.log)
        self.relay.start()
        self._loads = [None] * info.dp_size
        for r, ep in enumerate(info.load_endpoints):
            if ep is not None and r < info.dp_size:
                self._tasks.append(asyncio.create_task(self._load_sub_loop(r, ep), name=f"load-{r}"))
        self._tasks.append(asyncio.create_task(self._load_poll_loop(), name="load-poll"))
        self.api.start()  # heartbeats (they go out only while links are open: while the server is healthy)
        self._tasks.append(asyncio.create_task(self._health_loop(), name="health"))
        self._tasks.append(asyncio.create_task(self._stats_loop(), name="stats"))
        for t in self._tasks:
            t.add_done_callback(lambda t: _log_crash(self.log, t))
        announce("adapter_attached", worker_id=self.worker_id, engine=self.backend.kind, url=s.url, brokers=list(s.brokers),
                 **info.describe())

    async def run(self) -> None:
        """Start, serve until :meth:`request_stop`, drain, close. A stop requested while the
        adapter is still starting (e.g. waiting for an unreachable engine) ends it at once."""
        starting = asyncio.create_task(self.start(), name="adapter-start")
        stopped = asyncio.create_task(self._stop.wait(), name="adapter-stop")
        try:
            await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():  # stop requested first: give up starting
                starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            if starting.cancelled():
                self.log.info("adapter_stopped_before_attach", reason="stop requested while waiting for the engine",
                              url=self.s.url, discovery_failures=self.counters["discovery_failures"])
                await self.close()
                return
            if starting.exception() is not None:  # e.g. discovery gave up (ConfigError)
                await self.close()
                raise starting.exception()  # type: ignore[misc]
            await stopped
        finally:
            for t in (starting, stopped):
                t.cancel()
            await asyncio.gather(starting, stopped, return_exceptions=True)
        if self._force_stop:
            await self.close()
        else:
            await self.drain_and_stop()

    def request_stop(self, *, force: bool = False) -> None:
        """Ask :meth:`run` to finish: drain in-flight requests (bounded by ``drain_timeout_s``), or
        with ``force`` (a second signal) close at once."""
        if force:
            self._force_stop = True
            self._force.set()
        self._stop.set()

    async def drain_and_stop(self) -> None:
        """Graceful stop: DISCONNECT(draining), finish in-flight requests (bounded), close everything."""
        self._stopping = True
        self.api.drain()
        t_end = time.monotonic() + self.s.drain_timeout_s
        if self._serving:
            self.log.info("adapter_draining", inflight=len(self._serving), timeout_s=self.s.drain_timeout_s)
        force = asyncio.ensure_future(self._force.wait())
        try:
            while self._serving and time.monotonic() < t_end and not self._force.is_set():
                await asyncio.wait([*self._serving.values(), force], timeout=max(0.01, t_end - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            force.cancel()
        await self.close()

    async def _stats_loop(self, period_s: float = 30.0) -> None:
        last: dict[str, int] = {}
        while True:
            await asyncio.sleep(period_s)
            cur = dict(self.counters)
            if cur != last:
                self.log.info("adapter_stats", healthy=self.healthy, **cur)
                last = cur

    async def close(self) -> None:
        if self.info is not None:
            announce("adapter_stopped", worker_id=self.worker_id, counters=dict(self.counters))
        self._close_links()
        for t in [*self._tasks, *self._serving.values()]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._serving.values(), self.api.aclose(), return_exceptions=True)
        self._tasks.clear()
        if self.relay is not None:
            await self.relay.stop()
        if self.http is not None:
            await self.http.close()
        if self.engine is not None:
            await self.engine.close()

    #: Discovery back-off: an engine loading its weights may take minutes, so by default (no
    #: ``discovery_timeout_s``) the adapter waits for it as a worker waits for its brokers.
    DISCOVERY_RETRY = RetryPolicy.forever(base_ms=100.0, cap_ms=2000.0)

    async def _discover(self) -> EngineInfo:
        """Ask the engine what it is, retrying (:attr:`DISCOVERY_RETRY`) what :func:`engine_error`
        calls retryable, until ``discovery_timeout_s`` (then a ConfigError naming the URL)."""
        assert self.http is not None
        s = self.s
        deadline = time.monotonic() + s.discovery_timeout_s if s.discovery_timeout_s else None
        try:
            async for attempt in self.DISCOVERY_RETRY.async_retrying((RetryableError,), deadline_s=deadline):
                with attempt:
                    try:
                        info = await self.backend.discover(self.http)
                    except ConfigError:
                        raise
                    except Exception as exc:
                        err = engine_error(exc, f"discovery at {s.url}")
                        if self.counters["discovery_failures"] == 0:
                            announce("adapter_waiting_for_engine", url=s.url, error=str(err)[:200])
                        if self.counters["discovery_failures"] % 20 == 0:
                            self.log.warning("discovery_retry", url=s.url, error=str(err)[:200])
                        self.counters["discovery_failures"] += 1
                        raise err from exc
        except RetryableError as err:
            raise ConfigError(f"url: no answer from {s.url} within {s.discovery_timeout_s}s ({err})") from None
        self.log.info("engine_discovered", **info.describe())
        return info

    # ------------------------------------------------------------------ broker links

    def _capabilities(self) -> Capabilities:
        info = self.info
        assert info is not None
        return Capabilities(model=info.model[:256], role=self.s.role, labels=dict(self.s.labels), block_size=info.block_size,
                            max_running_requests=max(1, info.max_running_requests),
                            max_total_num_tokens=max(1, info.max_total_num_tokens), dp_size=info.dp_size)

    def _open_links(self) -> None:
        """Register with every broker (the API continues the connection numbering)."""
        self.api.connect()
        self._need_snapshot.update(id(link) for link in self.api.links)

    def _close_links(self) -> None:
        self.api.disconnect()
        self._need_snapshot.clear()

    def _send_kv(self, rank: int, frames: list[bytes]) -> None:
        self.api.send_kv(frames)

    def _on_session_lost(self, link: BrokerLink, why: str) -> None:
        self._need_snapshot.add(id(link))
        for key, task in list(self._serving.items()):
            if key[0] == id(link):
                task.cancel()  # the broker already re-dispatched or failed it

    def _on_message(self, link: BrokerLink, msg: object) -> None:
        t = type(msg)
        if t is P.Request:
            self._on_request(link, msg)  # type: ignore[arg-type]
        elif t is P.WorkerCancel:
            task = self._serving.get((id(link), msg.rid, msg.attempt))  # type: ignore[union-attr]
            if task is not None:
                self.counters["requests_cancelled"] += 1
                task.cancel()
        elif t is P.Heartbeat:
            if id(link) in self._need_snapshot and link.registered:
                self._need_snapshot.discard(id(link))
                self.log.info("adapter_registered", broker=link.endpoint)
                if self.relay is not None:
                    for rs in self.relay.ranks:
                        self.relay.snapshot(rs.rank)  # this broker starts from the mirror (the others just re-sync)
        elif t is P.Resync:
            if self.relay is not None and self.relay.snapshot(msg.dp_rank):  # type: ignore[union-attr]
                self.counters["resyncs_answered"] += 1
        elif isinstance(msg, Exception):
            self.counters["broker_frames_rejected"] += 1

    # ------------------------------------------------------------------ health

    async def _health_loop(self) -> None:
        s = self.s
        path = s.health_path or self.backend.default_health_path
        fails = 0
        while True:
            ok, why = await self._check_health(path)
            if ok:
                fails = 0
                if not self.healthy:
                    await self._become_healthy()
            else:
                fails += 1
                self.counters["health_failures"] += 1
                if self.healthy and fails >= s.unhealthy_after:
                    self._become_unhealthy(why)
                elif not self._was_healthy and fails == 1:
                    self.log.warning("engine_not_healthy_yet", reason=why)
            try:
                await asyncio.wait_for(self._health_kick.wait(), s.health_interval_ms / 1000)
            except asyncio.TimeoutError:
                pass
            self._health_kick.clear()

    async def _check_health(self, path: str) -> tuple[bool, str]:
        """(healthy, why): ``http_<status>``, or the mapped error's code and cause (``unavailable:
        ClientConnectorError``)."""
        assert self.http is not None
        try:
            status = await self.backend.get_status(self.http, path, self.s.health_timeout_ms / 1000)
        except RequestError as err:
            return False, f"{err.code.value}: {type(err.__cause__).__name__}"
        return status == 200, f"http_{status}"

    async def _become_healthy(self) -> None:
        if self._was_healthy and self.relay is not None and self.info is not None:
            try:
                restarted = await self.backend.restarted(self.http, self.info)  # type: ignore[arg-type]
            except Exception as exc:
                self.log.info("restart_check_failed", error=str(engine_error(exc, f"restart check at {self.s.url}"))[:200])
                restarted = False
            await self.relay.verify(restarted)
        self.healthy = True
        self._was_healthy = True
        self._open_links()
        announce("adapter_healthy", worker_id=self.worker_id)

    def _become_unhealthy(self, why: str) -> None:
        self.healthy = False
        self.counters["unhealthy_episodes"] += 1
        self._close_links()
        for task in list(self._serving.values()):
            task.cancel()
        announce("adapter_unhealthy", worker_id=self.worker_id, reason=why)

    # ------------------------------------------------------------------ load

    async def _load_sub_loop(self, rank: int, endpoint: str) -> None:
        sock = make_socket(self.ctx, LOAD_SUB, connect=endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, b"load")
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.counters["load_malformed"] += 1
                    continue
                try:
                    ls = LoadStat.from_wire(P.unpack(frames[2]))
                except ProtocolError:
                    self.counters["load_malformed"] += 1
                    continue
                ls.attn_dp_rank = rank
                self._loads[rank] = (ls, time.monotonic(), "zmq")
                self.counters["load_stream_samples"] += 1
        finally:
            sock.close(linger=0)

    def _fresh_loads(self, now: float) -> list[LoadStat]:
        max_age = self.s.load_stale_ms / 1000
        return [x[0] for x in self._loads if x is not None and now - x[1] <= max_age]

    async def _load_poll_loop(self) -> None:
        assert self.info is not None and self.http is not None
        period = self.s.load_poll_ms / 1000
        while True:
            now = time.monotonic()
            fresh_zmq = sum(1 for x in self._loads if x is not None and x[2] == "zmq" and now - x[1] <= self.s.load_stale_ms / 1000)
            if fresh_zmq < self.info.dp_size:
                try:
                    stats = await self.backend.poll_load(self.http, self.info)
                except Exception as exc:  # this loop must not die: count, say why, poll again
                    stats = None
                    self.counters["load_poll_errors"] += 1
                    self.log.debug("load_poll_failed", error=str(engine_error(exc, f"load poll at {self.s.url}"))[:200])
                if stats:
                    t = time.monotonic()
                    for ls in stats:
                        if 0 <= ls.attn_dp_rank < len(self._loads):
                            cur = self._loads[ls.attn_dp_rank]
                            # never overwrite a fresh sample of the (better) LoadStat stream
                            if cur is None or cur[2] == "http" or t - cur[1] > self.s.load_stale_ms / 1000:
                                self._loads[ls.attn_dp_rank] = (ls, t, "http")
                    self.counters["load_polls"] += 1
            await asyncio.sleep(period)

    # ------------------------------------------------------------------ requests

    def _on_request(self, link: BrokerLink, r: P.Request) -> None:
        if self._stopping or not self.healthy:
            link.send(P.encode_worker_error(r.rid, r.attempt, ErrorCode.UNAVAILABLE, "worker draining or unhealthy"))
            return
        key = (id(link), r.rid, r.attempt)
        if key in self._serving:
            return  # duplicate delivery
        self.counters["requests"] += 1
        self._serving[key] = asyncio.create_task(self._serve(link, r, key), name=f"req-{r.rid}")

    async def _serve(self, link: BrokerLink, r: P.Request, key: tuple[int, int, int]) -> None:
        """Serve one REQUEST; every outcome but a cancel ends in a FINAL or an ERROR frame. An
        exception of the engine path is mapped by :func:`engine_error` into the ERROR's code."""
        try:
            try:
                if (r.bootstrap or {}).get("mode") == "prefill":
                    code, msg = self._prefill_leg(link, r)
                else:
                    code, msg = await self._proxy(link, r)
            except Exception as exc:
                err = engine_error(exc, f"{self.backend.kind} engine at {self.s.url}")
                if err.code is ErrorCode.INTERNAL:
                    self.log.error("request_failed", rid=r.rid, error=str(err)[:500], exc_info=exc)
                elif err.code is ErrorCode.UNAVAILABLE:
                    self._health_kick.set()  # is the engine still there? check now, not in a second
                code, msg = (err.code, err.message) if isinstance(err, RequestError) else (ErrorCode.INTERNAL, str(err))
            if code is not None:
                self.counters[f"errors_{code.value}"] += 1
                link.send(P.encode_worker_error(r.rid, r.attempt, code, msg))
        except asyncio.CancelledError:
            pass
        finally:
            self._serving.pop(key, None)

    def _prefill_leg(self, link: BrokerLink, r: P.Request) -> tuple[ErrorCode | None, str]:
        """PD prefill leg. A disaggregated prefill server only finishes once the decode server
        pulls the KV, so the adapter starts the request in the background and answers the broker
        at once with FINAL ``prefill_done`` carrying the bootstrap address for the decode leg."""
        assert self.info is not None
        plan = self.backend.prefill_leg(r, self.info)
        if plan is None:
            return ErrorCode.BAD_REQUEST, f"{self.backend.kind} adapter: prefill/decode disaggregation is not supported"
        path, body, data = plan
        task = asyncio.create_task(self._background(path, body, r.deadline_ms / 1000 if r.deadline_ms > 0 else None))
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)
        prompt = len(r.submit.input_ids) if r.submit.input_ids is not None else 0
        link.send(P.encode_worker_final(r.rid, r.attempt, "prefill_done",
                                        {"prompt_tokens": prompt, "completion_tokens": 0, "cached_tokens": 0}, data))
        self.counters["prefill_legs"] += 1
        return None, ""

    async def _background(self, path: str, body: dict[str, Any], timeout_s: float | None) -> None:
        assert self.engine is not None
        try:
            async with asyncio.timeout(timeout_s):
                status, _ = await self.engine.request("POST", path, orjson.dumps(body))
                if status != 200:
                    self.counters["prefill_leg_errors"] += 1
                    self.log.warning("prefill_leg_failed", status=status)
        except Exception as exc:
            self.counters["prefill_leg_errors"] += 1
            self.log.warning("prefill_leg_failed", error=str(engine_error(exc, f"{self.s.base_url}{path}"))[:200])

    async def _proxy(self, link: BrokerLink, r: P.Request) -> tuple[ErrorCode | None, str]:
        """:meth:`_proxy_engine`, in a CLIENT span continuing the caller's trace when tracing is on
        and the SUBMIT carries a ``traceparent``; the engine gets this span's ``traceparent``
        header (SGLang and vLLM continue it with their own OpenTelemetry tracing)."""
        tp = r.submit.traceparent
        if tp is None or not tracing.enabled():
            return await self._proxy_engine(link, r, None)
        with tracing.client_span(f"mesh adapter {self.backend.kind}", tp,
                                 {"mesh.request_id": r.submit.rid, "mesh.worker": self.worker_id,
                                  "mesh.attempt": r.attempt, "server.address": self.s.url}):
            mine = tracing.current_traceparent()
            code, msg = await self._proxy_engine(link, r, {"traceparent": mine} if mine else None)
            if code is not None:
                tracing.annotate(error_code=code.value)
            return code, msg

    async def _proxy_engine(self, link: BrokerLink, r: P.Request,
                            headers: dict[str, str] | None) -> tuple[ErrorCode | None, str]:
        """Run one request against the server; returns an error to send, or (None, "") when done.

        A request the client does not stream is sent unstreamed when the backend allows it (one
        JSON body, no SSE). A streamed one becomes CHUNKs for every engine event but the one that
        carries the finish reason, whose delta rides in the FINAL, so a stream ends as the
        engine's does. The engine's own per-event metadata (SGLang's ``meta_info``) is passed
        through: scalars on every CHUNK, all of it (bounded) on an unstreamed FINAL. Positional
        lists (logprobs, :data:`~mesh.openai_logprobs.LOGPROB_KEYS`) travel as their new part: a
        CHUNK carries the entries of its own tokens (the input ones with the first), a streamed
        FINAL those of its delta, whether the engine streams them cumulatively or not."""
        assert self.engine is not None and self.info is not None
        sub = r.submit
        try:
            path, body = self.backend.request(r, self.info)
        except ValueError as exc:  # a parameter this engine has no equivalent for (vLLM): refused by name
            self.counters["params_refused"] += 1
            return ErrorCode.BAD_REQUEST, f"{self.backend.kind} adapter: {exc}"[:512]
        engine_streams = bool(body.get("stream"))
        try:
            payload = orjson.dumps(body)
        except (orjson.JSONEncodeError, TypeError) as exc:  # e.g. an integer param beyond 64 bits
            return ErrorCode.BAD_REQUEST, f"request parameters cannot be sent to the engine as JSON: {exc}"[:512]
        st = StreamState(prompt_len=len(sub.input_ids) if sub.input_ids is not None else 0)
        timeout_s = r.deadline_ms / 1000 if r.deadline_ms > 0 else None
        final_sent = False
        try:
            async with asyncio.timeout(timeout_s):
                if not engine_streams:
                    status, raw = await self.engine.request("POST", path, payload, headers)
                    if status != 200:
                        return error_code_for_status(status), f"HTTP {status} from {path}: {raw[:512].decode('utf-8', 'replace')}"
                    obj = orjson.loads(raw)  # not JSON: engine_error's worker_error
                    self.backend.parse(obj, st, self.info)
                    if st.error is not None:
                        return st.error
                    if st.finish is None:
                        return ErrorCode.WORKER_ERROR, "engine answer holds no finish reason"
                    self._send_final(link, r, st, st.new_ids, st.new_text)
                    return None, ""
                # What the FINAL carries: everything for an unstreamed client; for a streaming one
                # the deltas from the event with the finish reason on (usage may follow it).
                held_ids: list[int] = []
                held_text: list[str] = []
                held_lists: dict[str, list] = {}
                seq = 0
                async with self.engine.stream("POST", path, payload, headers) as (status, chunks):
                    if status != 200:
                        head = b""
                        async for piece in chunks:
                            head += piece
                            if len(head) >= 512:
                                break
                        return error_code_for_status(status), f"HTTP {status} from {path}: {head[:512].decode('utf-8', 'replace')}"
                    async for data in sse_events(chunks):
                        if final_sent:
                            continue  # read to the end: the connection is then reused
                        if data == b"[DONE]":
                            if st.finish is not None:
                                self._send_final(link, r, st, held_ids, "".join(held_text), held_lists)
                                final_sent = True
                            continue
                        try:
                            obj = orjson.loads(data)
                        except orjson.JSONDecodeError:
                            self.counters["bad_stream_chunks"] += 1
                            continue
                        st.new_ids, st.new_text = [], ""
                        if st.new_lists:
                            st.new_lists = {}
                        self.backend.parse(obj, st, self.info)
                        if st.error is not None:
                            return st.error
                        if sub.stream and st.finish is None and (st.new_ids or st.new_text):
                            chunk: dict[str, Any] = {"token_ids": st.new_ids}
                            if st.new_text:
                                chunk["text"] = st.new_text
                            if st.meta is not None:
                                chunk["meta_info"] = _scalar_meta(st.meta)
                            if st.new_lists or held_lists:
                                _extend_lists(held_lists, st.new_lists)
                                chunk["meta_info"] = {**chunk.get("meta_info", {}), **self.bounded_lists(held_lists)}
                                held_lists = {}
                            link.send(P.encode_worker_chunk(r.rid, r.attempt, seq, chunk))
                            seq += 1
                        else:
                            held_ids.extend(st.new_ids)
                            held_text.append(st.new_text)
                            _extend_lists(held_lists, st.new_lists)
                    if not final_sent and st.finish is not None:  # a stream without [DONE]
                        self._send_final(link, r, st, held_ids, "".join(held_text), held_lists)
                        final_sent = True
        except TimeoutError:
            if final_sent:
                return None, ""
            return ErrorCode.DEADLINE_EXCEEDED, "deadline passed while the engine was generating"
        except Exception:
            if final_sent:
                return None, ""  # the answer is out; the engine only failed to end the stream cleanly
            raise  # mapped by engine_error in _serve
        if not final_sent:
            return ErrorCode.WORKER_ERROR, "engine stream ended without a finish reason"
        return None, ""

    def _send_final(self, link: BrokerLink, r: P.Request, st: StreamState, ids: list[int], text: str,
                    lists: dict[str, list] | None = None) -> None:
        """``lists``: for a streamed answer, the positional lists of the delta sent here (the
        engine's last meta then contributes its scalars only); None: the meta is the whole answer's."""
        usage = {"prompt_tokens": st.usage.get("prompt_tokens", st.prompt_len),
                 "completion_tokens": st.usage.get("completion_tokens", 0),
                 "cached_tokens": st.usage.get("cached_tokens", 0)}
        data: dict[str, Any] = {"token_ids": ids}
        if text:
            data["text"] = text
        if lists is not None:
            meta = _scalar_meta(st.meta) if st.meta is not None else {}
            if lists:
                meta.update(self.bounded_lists(lists))
            if st.meta is not None or lists:
                data["meta_info"] = meta
        elif st.meta is not None:
            data["meta_info"] = self._final_meta(st.meta)
        link.send(P.encode_worker_final(r.rid, r.attempt, st.finish or "stop", usage, data))
        self.counters["requests_ok"] += 1

    def _final_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The engine's final metadata, whole unless it would crowd the frame (logprobs of a long
        answer): then its scalars only, counted."""
        if len(meta) <= 32 and all(type(v) in _META_SCALARS or type(v) is dict and len(v) <= 8 for v in meta.values()):
            return meta  # the common case, nothing to measure
        try:
            if len(P.pack(meta)) <= _MAX_META_BYTES:
                return meta
        except (TypeError, ValueError, OverflowError):
            pass
        lists = {k: v for k, v in meta.items() if k in LOGPROB_KEYS and type(v) is list}
        kept = self.bounded_lists(lists, measure=True) if lists else {}
        if len(kept) == len(lists):  # what was dropped is not a list
            self.counters["meta_info_truncated"] += 1
        return {**_scalar_meta(meta), **kept}

    def bounded_lists(self, lists: dict[str, list], measure: bool = False) -> dict[str, list]:
        """Positional meta lists within the frame budget: whole when they fit, else without the
        input lists, then without the alternatives (top logprobs), then none (counted as
        ``meta_info_truncated`` when anything is dropped)."""
        if not measure and sum(len(v) for v in lists.values()) <= 256:
            return lists  # a chunk's worth: nothing to measure
        for keep in (lambda k: True, lambda k: not k.startswith("input_"), lambda k: k == "output_token_logprobs"):
            cand = {k: v for k, v in lists.items() if keep(k)}
            try:
                if len(P.pack(cand)) <= _MAX_META_BYTES:
                    if len(cand) < len(lists):
                        self.counters["meta_info_truncated"] += 1
                    return cand
            except (TypeError, ValueError, OverflowError):
                pass
        self.counters["meta_info_truncated"] += 1
        return {}


_META_SCALARS = (int, float, str, bool, type(None))
_MAX_META_BYTES = 1 << 20  # FINAL frames stay far below the 4 MiB frame cap


def _extend_lists(into: dict[str, list], new: dict[str, list]) -> None:
    for k, v in new.items():
        into.setdefault(k, []).extend(v)


def _scalar_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """Per-chunk metadata: the scalar fields (counts, ids, latencies) and the finish reason, not
    the lists (logprobs) that SGLang repeats cumulatively in every chunk."""
    return {k: v for k, v in meta.items() if type(v) in _META_SCALARS or (k == "finish_reason" and type(v) is dict)}
