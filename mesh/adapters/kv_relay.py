"""The KV relay: engine KV event streams (one per DP rank) -> mesh KV_EVENTS batches.

Used by :class:`mesh.adapters.base.Adapter`, which hands it a :class:`KvSend` (its broker links).

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
  ``max_batch_tokens`` tokens nor :data:`mesh.protocol.MAX_KV_BATCH_BLOCKS` blocks (brokers
  refuse larger ones), and halved again if its body would still pass ``MAX_KV_BATCH_BYTES``.

Mirror and resync: the adapter keeps a :class:`BlockMirror` per rank (engine hash -> parent and
tokens, built from the events it relayed). A broker RESYNC for rank r, and every (re)registration
with a broker, is answered with a snapshot: ``AllBlocksCleared`` then ``BlockStored`` for every
mirrored block, parent first, relayed like any batch (to every broker, one sequence per rank).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from typing import Any, Protocol

import zmq
import zmq.asyncio

from mesh import kv_events as KV
from mesh import protocol as P
from mesh.kv_events import split_events
from mesh.errors import ProtocolError
from mesh.logs import RateLimiter, get_logger
from mesh.sockets import SocketSpec, make_socket, recv_frames, socket_readable

__all__ = ["ENGINE_SUB", "REPLAY_DEALER", "END_SEQ", "KvSend", "BlockMirror", "RankStream", "KvRelay", "split_events",
           "log_crash"]

# Engine-side sockets (the engine binds; the adapter connects). A KV SUB must never be the slow
# joiner that drops: a deep receive queue, and no message size cap below what an engine sends.
_BIG = 256 * 1024 * 1024
ENGINE_SUB = SocketSpec(zmq.SUB, sndhwm=1000, rcvhwm=100_000, linger_ms=0, maxmsgsize=_BIG)
REPLAY_DEALER = SocketSpec(zmq.DEALER, sndhwm=100, rcvhwm=100_000, linger_ms=0, maxmsgsize=_BIG, immediate=False)

END_SEQ = b"\xff" * 8


def log_crash(log, task: asyncio.Task) -> None:
    """Done-callback: a background task must never die silently."""
    if not task.cancelled() and task.exception() is not None:
        log.error("adapter_task_crashed", task=task.get_name(), error=repr(task.exception())[:500])


class KvSend(Protocol):
    """The relay's way out: deliver one encoded KV_EVENTS message of ``rank`` to the brokers."""

    def __call__(self, rank: int, frames: list[bytes]) -> None: ...


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

    def __init__(self, ctx: zmq.asyncio.Context, ranks: list[RankStream], send: KvSend, *,
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
        self._tasks: dict[int, asyncio.Task] = {}  # rank -> its loop

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for rs in self.ranks:
            self._start_rank(rs)

    def _start_rank(self, rs: RankStream) -> None:
        t = asyncio.create_task(self._rank_loop(rs), name=f"kv-rank-{rs.rank}")
        t.add_done_callback(lambda t: log_crash(self.log, t))
        self._tasks[rs.rank] = t

    async def stop(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        for rs in self.ranks:
            self._close_sockets(rs)

    @staticmethod
    def _close_sockets(rs: RankStream) -> None:
        for s in (rs.sub, rs.dealer):
            if s is not None:
                s.close(linger=0)
        rs.sub = rs.dealer = None

    async def move(self, rank: int, kv_endpoint: str, replay_endpoint: str | None) -> bool:
        """The engine came back on other ports: a restart (new epoch, AllBlocksCleared); drop the
        rank's sockets and subscribe (and replay from 0) at the new endpoints. False when nothing
        changed (or no such rank)."""
        rs = self.by_rank.get(rank)
        if rs is None or (rs.kv_endpoint, rs.replay_endpoint) == (kv_endpoint, replay_endpoint):
            return False
        self.log.warning("kv_endpoints_moved", dp_rank=rank, kv_endpoint=kv_endpoint, replay_endpoint=replay_endpoint,
                         old_kv_endpoint=rs.kv_endpoint, old_replay_endpoint=rs.replay_endpoint)
        t = self._tasks.pop(rank, None)
        if t is not None:
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
        self._close_sockets(rs)
        rs.kv_endpoint, rs.replay_endpoint = kv_endpoint, replay_endpoint
        self._restart(rs, "endpoints_moved")
        self._start_rank(rs)
        return True

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

    async def verify(self, restarted: bool, skip: frozenset[int] = frozenset()) -> None:
        """After a health outage: detect a server restart (given, or by replay timestamps); the
        ranks in ``skip`` were already restarted by :meth:`move`."""
        for rs in self.ranks:
            if rs.rank in skip:
                continue
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
        for chunk in split_events(events, self.max_batch_tokens, max_blocks=P.MAX_KV_BATCH_BLOCKS):
            self._relay_chunk(rs, ts, chunk)

    def _relay_chunk(self, rs: RankStream, ts: float, chunk: list[KV.KvEvent]) -> None:
        """Send one chunk as the next batch; a body over ``MAX_KV_BATCH_BYTES`` (long token
        ids, a large ``max_batch_tokens``) is split in halves by blocks instead."""
        wire = [KV.encode_event_map(e) for e in chunk]
        frames = P.encode_kv_events(rs.rank, rs.epoch, rs.mesh_seq, ts, wire)
        blocks = KV.event_blocks(chunk)
        if len(frames[2]) > P.MAX_KV_BATCH_BYTES and blocks > 1:
            self.counters["relay_resplit"] += 1
            for part in split_events(chunk, self.max_batch_tokens, max_blocks=blocks // 2):
                self._relay_chunk(rs, ts, part)
            return
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

