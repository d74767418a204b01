"""SGLang's ZMQ telemetry wire, publisher side: KV events (PUB + replay ROUTER) and LoadStat (PUB).

Byte-for-byte what SGLang 0.5.23 sends (``worker-telemetry.md`` §1-§4, §10):

* live KV batch: ``[topic, seq (8-byte unsigned big-endian, from 0 per rank), msgpack [ts, events, rank]]``;
* replay: a DEALER sends ``[b"", start_seq8]``; the ROUTER answers every buffered batch with
  ``seq >= start`` as ``[b"", topic, seq8, payload]`` (``replay_frames=4``, SGLang >= 0.5.22 and
  vLLM) or ``[b"", seq8, payload]`` (``replay_frames=3``, SGLang <= 0.5.21), then the end marker
  ``[b"", b"", ff*8, b""]`` / ``[b"", ff*8, b""]``; malformed requests are ignored;
* load: ``[b"load", seq8, msgpack LoadStat tagged array]`` on a PUB with HWM 8, no replay.

Event encodings: ``map`` (SGLang >= 0.5.20), ``array`` (SGLang 0.5.18 tagged arrays, trailing nils
present) and ``vllm`` (vLLM 0.33 maps: unsigned hashes, ``lora_name``/``extra_keys``/``group_idx``
keys, batch rank = ``data_parallel_rank``).

Debug knobs (stub only, used by tests): :meth:`KvPublisher.drop_next` keeps the next N batches out
of the live stream (they still enter the replay buffer, as a slow subscriber's HWM drop would), and
:meth:`KvPublisher.publish_raw` publishes an arbitrary payload under the next sequence number.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from typing import Any, Iterable

import zmq
import zmq.asyncio

from mesh import kv_events as KV
from mesh.load import LoadStat
from mesh.logs import get_logger
from mesh.protocol import pack
from mesh.sockets import SocketSpec, make_socket, send_frames

__all__ = [
    "SGLANG_PUB",
    "SGLANG_REPLAY_ROUTER",
    "SGLANG_LOAD_PUB",
    "END_SEQ",
    "EVENT_FORMATS",
    "encode_events",
    "bind_port_range",
    "KvPublisher",
    "LoadPublisher",
]

# SGLang's KV PUB: hwm 100,000 (its KVEventsConfig default), no linger (publisher thread exits).
SGLANG_PUB = SocketSpec(zmq.PUB, sndhwm=100_000, rcvhwm=1000, linger_ms=0)
# Replay ROUTER: mandatory routing so the stub never silently drops a reply to a live requester
# (the send waits instead); an unknown identity just fails that reply.
SGLANG_REPLAY_ROUTER = SocketSpec(zmq.ROUTER, sndhwm=10_000, rcvhwm=1000, linger_ms=0, router_mandatory=True)
# LoadStat PUB: HWM 8, linger 0 (SGLang's load_publisher).
SGLANG_LOAD_PUB = SocketSpec(zmq.PUB, sndhwm=8, rcvhwm=8, linger_ms=0)

END_SEQ = b"\xff" * 8
EVENT_FORMATS = ("map", "array", "vllm")


def _vllm_extra_keys(ev: KV.BlockStored) -> list | None:
    """vLLM's per-block ``extra_keys`` for a text prompt: the LoRA name on every block, the cache
    salt on the prompt's first block (a root event's block 0); None when no block has any."""
    lora, salt = ev.lora_name, ev.cache_salt
    if lora is None and (salt is None or ev.parent_block_hash is not None):
        return None
    out: list = []
    for i in range(len(ev.block_hashes)):
        keys = [lora] if lora is not None else []
        if i == 0 and salt is not None and ev.parent_block_hash is None:
            keys.append(salt)
        out.append(keys or None)
    return out


def _vllm_event(ev: KV.KvEvent) -> dict[str, Any]:
    if type(ev) is KV.BlockStored:
        return {
            "type": "BlockStored",
            "block_hashes": list(ev.block_hashes),  # unsigned 64-bit, as vLLM publishes by default
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": None,
            "medium": ev.medium or "GPU",
            "lora_name": ev.lora_name,
            "extra_keys": _vllm_extra_keys(ev),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if type(ev) is KV.BlockRemoved:
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium or "GPU", "group_idx": 0}
    return {"type": "AllBlocksCleared"}


def encode_events(ts: float, events: Iterable[KV.KvEvent], rank: int | None, form: str) -> bytes:
    """Frame-2 payload of one batch in the given encoding (``map``, ``array`` or ``vllm``)."""
    if form == "vllm":
        body: list[Any] = [ts, [_vllm_event(e) for e in events]]
        if rank is not None:
            body.append(rank)
        return pack(body)
    return KV.encode_batch(ts, events, rank, form=form)  # type: ignore[arg-type]


def bind_port_range(ctx: zmq.asyncio.Context, spec: SocketSpec, host: str, base: int, n: int,
                    avoid: set[int] | None = None, tries: int = 64) -> tuple[list[zmq.asyncio.Socket], int]:
    """Bind ``n`` sockets on ``host:base+r``. ``base == 0``: find a free consecutive range.

    Returns the sockets (rank order) and the base port. Raises zmq.ZMQError when an explicit
    range is taken, RuntimeError when no free range was found.
    """
    avoid = avoid or set()
    for _ in range(tries if base == 0 else 1):
        socks: list[zmq.asyncio.Socket] = []
        try:
            if base == 0:
                first = make_socket(ctx, spec, bind=f"tcp://{host}:*")
                socks.append(first)
                b = int(first.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            else:
                b = base
            if any(b + r in avoid for r in range(n)):
                raise zmq.ZMQError(errno.EADDRINUSE)
            for r in range(len(socks), n):
                socks.append(make_socket(ctx, spec, bind=f"tcp://{host}:{b + r}"))
            return socks, b
        except zmq.ZMQError:
            for s in socks:
                s.close(linger=0)
            if base != 0:
                raise
    raise RuntimeError(f"no free range of {n} consecutive ports on {host}")


class KvPublisher:
    """One DP rank's KV event publisher: live PUB, replay buffer and replay ROUTER."""

    def __init__(self, rank: int, pub: zmq.asyncio.Socket, replay: zmq.asyncio.Socket | None, *, topic: str = "",
                 form: str = "map", replay_frames: int = 4, buffer_steps: int = 10_000) -> None:
        if form not in EVENT_FORMATS:
            raise ValueError(f"event format must be one of {EVENT_FORMATS}, got {form!r}")
        if replay_frames not in (3, 4):
            raise ValueError("replay_frames must be 3 or 4")
        self.rank = rank
        self.pub = pub
        self._pub_sync = zmq.Socket.shadow(pub.underlying)
        self.replay = replay
        self.topic = topic.encode()
        self.form = form
        self.replay_frames = replay_frames
        self.seq = 0
        self.buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=max(1, buffer_steps))  # (seq, seq8, payload)
        self._drop = 0
        self.dropped = 0
        self.hwm_drops = 0
        self.replays_served = 0
        self.log = get_logger(service="sglang_stub", dp_rank=rank)

    def drop_next(self, n: int) -> None:
        """Debug: keep the next ``n`` batches out of the live stream (still replayable)."""
        self._drop += max(0, n)

    def publish(self, events: list[KV.KvEvent]) -> int:
        """Publish one batch; returns its sequence number."""
        rank = self.rank
        return self.publish_raw(encode_events(time.time(), events, rank, self.form))

    def publish_raw(self, payload: bytes) -> int:
        seq = self.seq
        self.seq += 1
        seq8 = seq.to_bytes(8, "big")
        self.buffer.append((seq, seq8, payload))
        if self._drop > 0:
            self._drop -= 1
            self.dropped += 1
            return seq
        try:
            send_frames(self._pub_sync, [self.topic, seq8, payload])
        except zmq.Again:
            self.hwm_drops += 1
        return seq

    def send_raw_frames(self, frames: list[bytes]) -> None:
        """Debug: put arbitrary frames on the live PUB (no sequence number consumed)."""
        try:
            send_frames(self._pub_sync, frames)
        except zmq.Again:
            self.hwm_drops += 1

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled."""
        sock = self.replay
        if sock is None:
            return
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.log.warning("replay_request_ignored", frames=len(frames))
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            self.replays_served += 1
            try:
                for seq, seq8, payload in list(self.buffer):
                    if seq < start:
                        continue
                    if self.replay_frames == 4:
                        await sock.send_multipart([ident, b"", self.topic, seq8, payload])
                    else:
                        await sock.send_multipart([ident, b"", seq8, payload])
                if self.replay_frames == 4:
                    await sock.send_multipart([ident, b"", b"", END_SEQ, b""])
                else:
                    await sock.send_multipart([ident, b"", END_SEQ, b""])
            except zmq.ZMQError as exc:  # requester vanished (EHOSTUNREACH): drop the rest
                self.log.warning("replay_aborted", errno=exc.errno)

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


class LoadPublisher:
    """One DP rank's LoadStat PUB: ``[b"load", seq8, msgpack LoadStat]``."""

    TOPIC = b"load"

    def __init__(self, rank: int, pub: zmq.asyncio.Socket) -> None:
        self.rank = rank
        self.pub = pub
        self._sync = zmq.Socket.shadow(pub.underlying)
        self.seq = 0
        self.last: list[Any] | None = None
        self.last_s = 0.0

    def maybe_publish(self, stat: LoadStat, now_s: float, *, heartbeat_s: float = 1.0) -> bool:
        """Publish on change, and at least every ``heartbeat_s``."""
        wire = stat.to_wire()
        if wire == self.last and now_s - self.last_s < heartbeat_s:
            return False
        self.last, self.last_s = wire, now_s
        seq8 = self.seq.to_bytes(8, "big")
        self.seq += 1
        try:
            send_frames(self._sync, [self.TOPIC, seq8, pack(wire)])
        except zmq.Again:
            pass  # HWM 8: a slow subscriber simply misses samples
        return True

    def close(self) -> None:
        self.pub.close(linger=0)
