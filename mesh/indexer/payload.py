"""The indexer's batch helpers: a payload decoded (a big one lazily), its events cut into slices.

Pure code (msgpack and the event types only): :class:`mesh.indexer.core.IndexerCore` decodes
(:func:`decode_payload`) and applies (:func:`event_slices`) a big batch in slices with these, so
the service can yield to queries in between.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from typing import Any

import msgpack

from mesh import kv_events as KV
from mesh.errors import ProtocolError
from mesh.protocol import unpack

__all__ = ["decode_payload", "raw_event_chunks", "split_store", "event_slices"]

_SLICED_DECODE_BYTES = 128 << 10  # payloads above this are unpacked event by event, with yields
_DECODE_SLICE_EVENTS = 256  # events unpacked + decoded between two chances to yield

_APPLY_SLICE_BLOCKS = 256  # blocks applied between two chances to yield
_SPLIT_STORE_BLOCKS = 1024  # a BlockStored longer than this is applied as parent-linked pieces

_ARRAY_HEADERS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_MAP_HEADERS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def decode_payload(payload: bytes, max_events: int) -> Generator[None, None, tuple[list[KV.KvEvent], Counter[str]]]:
    """A batch payload (the events array, or a whole KV_EVENTS body: its ``events``) as events and
    the ``skipped`` counts of what could not be decoded. A big payload is unpacked event by event,
    yielding between slices, and no further than just past ``max_events``. Raises
    ProtocolError(bad_msgpack)."""
    skipped: Counter[str] = Counter()
    if len(payload) <= _SLICED_DECODE_BYTES:
        obj = unpack(payload)
        if type(obj) is dict:  # a whole KV_EVENTS body
            obj = obj.get("events")
        events, sk = KV.decode_events(obj)
        skipped.update(sk)
        return events, skipped
    events = []
    for chunk in raw_event_chunks(payload, _DECODE_SLICE_EVENTS):
        if chunk is None:
            skipped["bad_batch"] += 1
            break
        evs, sk = KV.decode_events(chunk)
        events.extend(evs)
        skipped.update(sk)
        if len(events) > max_events:
            break
        yield
    return events, skipped


def _events_value_offset(payload: bytes) -> int | None:
    """Offset of the (last) ``events`` value of a msgpack map, None without one. Raises on bad msgpack."""
    u = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(payload))
    u.feed(payload)
    pos = None
    for _ in range(u.read_map_header()):
        if u.unpack() == "events":
            pos = u.tell()
        u.skip()
    if u.tell() != len(payload):
        raise ValueError("extra data after the body")
    return pos


def raw_event_chunks(payload: bytes, n: int) -> Iterator[list[Any] | None]:
    """Unpack a big payload (events array, or a KV_EVENTS map with ``events``) lazily: lists of at
    most ``n`` undecoded events; one ``None`` when there is no events array (a bad_batch).
    Raises ProtocolError(bad_msgpack) like :func:`mesh.protocol.unpack`."""
    try:
        first = payload[0]
        if first in _MAP_HEADERS:
            start = _events_value_offset(payload)
            whole = False
        elif first in _ARRAY_HEADERS:
            start, whole = 0, True
        else:
            unpack(payload)  # a scalar: must still be valid msgpack to count as a bad_batch
            start = None
        if start is None or payload[start] not in _ARRAY_HEADERS:
            yield None  # no events array: decode_events would call it a bad_batch
            return
        u = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(payload))
        u.feed(memoryview(payload)[start:])
        buf: list[Any] = []
        for _ in range(u.read_array_header()):
            buf.append(u.unpack())
            if len(buf) >= n:
                yield buf
                buf = []
        if buf:
            yield buf
        if whole and u.tell() != len(payload):
            raise ValueError("extra data after the events array")
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several non-UnpackException types
        raise ProtocolError("bad_msgpack", f"{type(exc).__name__}: {exc}") from exc


def split_store(ev: KV.BlockStored, n: int) -> list[KV.BlockStored]:
    """One long BlockStored as parent-linked pieces of ``n`` blocks (the same chain, stored in steps)."""
    hs, toks, bs = ev.block_hashes, ev.token_ids, ev.block_size
    out = []
    parent = ev.parent_block_hash
    for i in range(0, len(hs), n):
        piece = hs[i:i + n]
        last = i + n >= len(hs)
        out.append(dataclasses.replace(ev, block_hashes=piece, parent_block_hash=parent,
                                       token_ids=toks[i * bs:(i + len(piece)) * bs],
                                       lookahead_token_id=ev.lookahead_token_id if last else None,
                                       unmatched_blocks=ev.unmatched_blocks if last else 0))
        parent = piece[-1]
    return out


def event_slices(events: list[KV.KvEvent], bs: int | None, reject: Callable[[int], None]) -> Iterator[list[KV.KvEvent]]:
    """A batch's events in slices of about ``_APPLY_SLICE_BLOCKS`` blocks, with stores of another
    block size than ``bs`` taken out (``reject(their block size)`` is called for each) and very
    long stores split into parent-linked pieces.
    """
    out: list[KV.KvEvent] = []
    blocks = 0
    for ev in events:
        if type(ev) is KV.BlockStored:
            if bs is not None and ev.block_size != bs:
                reject(ev.block_size)
                continue
            n = len(ev.block_hashes)
            if n > _SPLIT_STORE_BLOCKS:
                if out:
                    yield out
                for piece in split_store(ev, _APPLY_SLICE_BLOCKS):
                    yield [piece]
                out, blocks = [], 0
                continue
            blocks += n
        else:
            blocks += 1
        out.append(ev)
        if blocks >= _APPLY_SLICE_BLOCKS:
            yield out
            out, blocks = [], 0
    if out:
        yield out
