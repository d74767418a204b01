"""KV cache events: the types, tolerant decoding of every shape we accept, and SGLang encoders.

Accepted shapes (``worker-telemetry.md`` §2, §12, §16):

* SGLang >= 0.5.20 / vLLM tagged **maps** (``{"type": "BlockStored", ...}``); unknown keys ignored;
* SGLang 0.5.4-0.5.19 tagged **arrays** (``["BlockStored", hashes, parent, tokens, block_size,
  lora_id, medium, metadata_or_lora_name, extra_keys, ...]``); missing trailing positions read as
  nil, extra ones ignored, position 7 is ``lora_name`` when it is a string and 0.5.18's metadata
  map (its ``cache_salt``) when it is a map; position 8 is llm-d's padded ``extra_keys``;

Cache namespace fields (``mesh.namespaces``): ``lora_name``, ``cache_salt`` (SGLang 0.5.20+ map
key, 0.5.18 array metadata map) and vLLM's per-block ``extra_keys`` (LoRA name on every block, the
cache salt on a prompt's first block; blocks whose extra keys name anything else -- multimodal
inputs, prompt embeddings -- cannot match a text request and are cut off the event, counted in
``unmatched_blocks``; an event with no matchable block is rejected as ``unmatchable_blocks``).
* batches ``[ts, events]`` or ``[ts, events, rank]``.

Normalisation: every hash becomes an unsigned 64-bit int (:func:`mesh.hashing.norm_hash`: ints by
two's complement, vLLM ``bytes`` by their last 8 bytes). The encoders turn them back into signed
int64, as SGLang sends them.

EAGLE bigram tokens: SGLang workers running EAGLE publish ``token_ids`` as ``[t_i, t_{i+1}]`` pairs,
one per cached position. We flatten them like NVIDIA Dynamo does: the first element of each pair is
the position's token (so ``token_ids`` keeps ``n_blocks * block_size`` entries and content keys stay
comparable with non-EAGLE workers) and the second element of the last pair, the token *after* the
event's last block, is kept as ``lookahead_token_id`` (a bigram page is only reusable when that
next token matches too; an index may fold it in or ignore it, over-claiming at most one position).
Pairs that do not chain (``pair[i][1] != pair[i+1][0]``) are not bigrams we understand and are
rejected with reason ``unsupported_tokens``.

Rejection reasons (the ``ProtocolError.reason`` / skip-count label): ``bad_event`` (shape, type or
range), ``unknown_event_type``, ``skipped_group`` (vLLM hybrid-model event for a KV group other
than 0 / a non-main-attention kind: not an error, but not ours), ``unsupported_tokens``,
``unmatchable_blocks`` (vLLM blocks of multimodal / prompt-embeds content, see above),
``bad_batch`` (batch envelope), ``bad_msgpack`` (from :func:`mesh.protocol.unpack`).

Pure code: no I/O, no clock.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from mesh.errors import ProtocolError
from mesh.hashing import to_signed64
from mesh.protocol import pack, unpack

__all__ = [
    "MAX_HASHES_PER_EVENT",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KvEvent",
    "EventBatch",
    "decode_event",
    "decode_events",
    "split_events",
    "event_blocks",
    "decode_batch",
    "encode_event_map",
    "encode_event_array",
    "encode_batch",
]

#: SGLang's slim router accepted at most this many hashes per event; larger events are rejected.
MAX_HASHES_PER_EVENT = 65_536
_MAX_BLOCK_SIZE = 1 << 16
_MAX_HASH_BYTES = 64
_MAX_TOKEN_ID = 2**32
_I64_MIN = -(1 << 63)
_U64_END = 1 << 64
# Dynamo keeps only main-attention KV groups of hybrid vLLM models.
_MAIN_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly cached, in prompt order; block i covers ``token_ids[i*bs:(i+1)*bs]``.

    Hashes are unsigned 64-bit. ``parent_block_hash`` is the block before ``block_hashes[0]``
    (None under the radix root); each later block's parent is the previous block of this event.
    ``lookahead_token_id`` is set only for EAGLE bigram events (see the module docstring).

    Cache namespace (``mesh.namespaces``): ``lora_name`` and ``cache_salt`` as published (SGLang
    fields, or read from vLLM's per-block ``extra_keys``). ``unmatched_blocks``: blocks the decoder
    cut off the event's tail because their vLLM ``extra_keys`` name content no text request can
    match (multimodal ``(identifier, offset)``, prompt-embeds digests; see :func:`_vllm_extra_keys`).
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    lookahead_token_id: int | None = None
    cache_salt: str | None = None
    unmatched_blocks: int = 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted (unsigned 64-bit hashes)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The worker's whole cache (this rank) was reset."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch. ``dp_rank`` is None for the old 2-element form.

    ``skipped`` counts events dropped by tolerant decoding, by reason.
    """

    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None
    skipped: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------- validation


def _bad(detail: str) -> ProtocolError:
    return ProtocolError("bad_event", detail)


def _hash(v: Any, what: str) -> int:
    t = type(v)
    if t is int:
        if v < _I64_MIN or v >= _U64_END:
            raise _bad(f"{what} {v} outside int64/uint64")
        return v & 0xFFFF_FFFF_FFFF_FFFF
    if t is bytes:
        if not v or len(v) > _MAX_HASH_BYTES:
            raise _bad(f"{what} of {len(v)} bytes")
        return int.from_bytes(v[-8:], "big")
    raise _bad(f"{what} must be int or bytes, got {t.__name__}")


def _hashes(v: Any, *, allow_empty: bool) -> tuple[int, ...]:
    if type(v) is not list and type(v) is not tuple:
        raise _bad(f"block_hashes must be a list, got {type(v).__name__}")
    n = len(v)
    if n > MAX_HASHES_PER_EVENT:
        raise _bad(f"{n} block hashes > {MAX_HASHES_PER_EVENT}")
    if n == 0 and not allow_empty:
        raise _bad("no block hashes")
    return tuple(_hash(h, "block hash") for h in v)


def _opt_str(v: Any, what: str) -> str | None:
    if v is None or type(v) is str:
        return v
    raise _bad(f"{what} must be a string, got {type(v).__name__}")


def _tokens(v: Any) -> tuple[tuple[int, ...], int | None]:
    """Validate token ids; returns (tokens, lookahead) with EAGLE bigram pairs flattened."""
    if type(v) is not list and type(v) is not tuple:
        raise _bad(f"token_ids must be a list, got {type(v).__name__}")
    if v and type(v[0]) in (list, tuple):
        return _bigram_tokens(v)
    try:
        # C-speed range and type check; array("I") rejects negatives, >= 2**32, floats and None
        # (it accepts bool, which msgpack never produces for token ids).
        array("I", v)
    except (OverflowError, TypeError) as exc:
        raise _bad(f"token_ids must be ints in [0, 2**32): {exc}") from None
    return tuple(v), None


def _bigram_tokens(pairs: list) -> tuple[tuple[int, ...], int | None]:
    firsts: list[int] = []
    prev_second: int | None = None
    for p in pairs:
        if type(p) not in (list, tuple) or len(p) != 2:
            raise ProtocolError("unsupported_tokens", "mixed token_ids: pairs and scalars")
        a, b = p
        if type(a) is not int or type(b) is not int or not (0 <= a < _MAX_TOKEN_ID and 0 <= b < _MAX_TOKEN_ID):
            raise _bad("bigram token ids must be ints in [0, 2**32)")
        if prev_second is not None and a != prev_second:
            raise ProtocolError("unsupported_tokens", "bigram pairs do not chain")
        firsts.append(a)
        prev_second = b
    return tuple(firsts), prev_second


def _check_group(group_idx: Any, kind: Any) -> None:
    if type(kind) is str and kind not in _MAIN_ATTENTION_KINDS:
        raise ProtocolError("skipped_group", f"kv_cache_spec_kind={kind}")
    if group_idx is not None and group_idx != 0:
        raise ProtocolError("skipped_group", f"group_idx={group_idx!r}")


def _stored(hashes: Any, parent: Any, tokens: Any, block_size: Any, medium: Any, lora_name: Any,
            cache_salt: Any = None, extra_keys: Any = None) -> BlockStored:
    hs = _hashes(hashes, allow_empty=False)
    ph = None if parent is None else _hash(parent, "parent_block_hash")
    if type(block_size) is not int or not 0 < block_size <= _MAX_BLOCK_SIZE:
        raise _bad(f"block_size must be an int in [1, {_MAX_BLOCK_SIZE}], got {block_size!r}")
    toks, lookahead = _tokens(tokens)
    if len(toks) != len(hs) * block_size:
        raise _bad(f"{len(toks)} tokens for {len(hs)} blocks of {block_size}")
    lora = lora_name if type(lora_name) is str else None
    salt = cache_salt if type(cache_salt) is str else None
    cut = 0
    if extra_keys is not None:
        keep, xsalt = _vllm_extra_keys(extra_keys, len(hs), lora, ph is None)
        if salt is None:
            salt = xsalt
        if keep < len(hs):
            if keep == 0:
                raise ProtocolError("unmatchable_blocks", "extra_keys name content no text request can match")
            cut = len(hs) - keep
            hs, toks, lookahead = hs[:keep], toks[:keep * block_size], None
    return BlockStored(hs, ph, toks, block_size, _opt_str(medium, "medium"), lora, lookahead, salt, cut)


def _vllm_extra_keys(xk: Any, n: int, lora: str | None, root: bool) -> tuple[int, str | None]:
    """Read vLLM's per-block ``extra_keys``: (blocks a text request can match, cache salt).

    vLLM's order per block is LoRA name, multimodal ``(identifier, offset)`` pairs, the cache salt
    (first block of a prompt only), prompt-embeds digests (``worker-telemetry.md`` §12). A block
    whose keys are the event's ``lora_name`` and, on a root event's first block, one more string
    (the salt) is explained; the first block with anything else ends the matchable prefix (every
    later block chains from it).
    """
    if type(xk) is not list and type(xk) is not tuple:
        raise _bad(f"extra_keys must be a list, got {type(xk).__name__}")
    salt = None
    for i in range(min(n, len(xk))):
        keys = xk[i]
        if keys is None:
            continue
        if type(keys) is not list and type(keys) is not tuple:
            return i, salt
        rest = list(keys)
        if rest and lora is not None and rest[0] == lora:
            rest.pop(0)
        if not rest:
            continue
        if i == 0 and root and len(rest) == 1 and type(rest[0]) is str and rest[0]:
            salt = rest[0]
            continue
        return i, salt
    return n, salt


def _metadata_salt(v: Any) -> tuple[Any, Any]:
    """Position 7 of an array BlockStored: (lora_name, cache_salt). A string is the lora name; a
    map is SGLang 0.5.18's metadata (``cache_salt``; a ``lora_name`` there is read too)."""
    if type(v) is dict:
        return v.get("lora_name"), v.get("cache_salt")
    return v, None


# --------------------------------------------------------------------------- decoding


def _from_map(d: dict) -> KvEvent:
    tag = d.get("type")
    if tag == "BlockStored":
        _check_group(d.get("group_idx"), d.get("kv_cache_spec_kind"))
        return _stored(
            d.get("block_hashes"), d.get("parent_block_hash"), d.get("token_ids"), d.get("block_size"),
            d.get("medium"), d.get("lora_name"), d.get("cache_salt"), d.get("extra_keys"),
        )
    if tag == "BlockRemoved":
        _check_group(d.get("group_idx"), d.get("kv_cache_spec_kind"))
        return BlockRemoved(_hashes(d.get("block_hashes"), allow_empty=True), _opt_str(d.get("medium"), "medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if type(tag) is str:
        raise ProtocolError("unknown_event_type", tag[:64])
    raise _bad("map event without a string 'type'")


def _trailing_group(items: list | tuple) -> None:
    # vLLM appends group_idx (int) and kv_cache_spec_kind (str) right after the known positions;
    # the caller passes only that window, anything later is ignored.
    group = kind = None
    for v in items:
        if type(v) is int and group is None:
            group = v
        elif type(v) is str and kind is None:
            kind = v
    _check_group(group, kind)


def _from_array(a: list | tuple) -> KvEvent:
    if not a or type(a[0]) is not str:
        raise _bad("array event without a leading type tag")
    tag = a[0]
    if tag == "BlockStored":
        if len(a) < 5:
            raise _bad(f"BlockStored array of {len(a)} positions")
        p = list(a[:8]) + [None] * (8 - min(len(a), 8))
        _trailing_group(a[9:12])
        lora, salt = _metadata_salt(p[7])
        return _stored(p[1], p[2], p[3], p[4], p[6], lora, salt, a[8] if len(a) > 8 else None)
    if tag == "BlockRemoved":
        if len(a) < 2:
            raise _bad("BlockRemoved array without hashes")
        _trailing_group(a[3:5])
        return BlockRemoved(_hashes(a[1], allow_empty=True), _opt_str(a[2] if len(a) > 2 else None, "medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ProtocolError("unknown_event_type", tag[:64])


def decode_event(obj: Any) -> KvEvent:
    """Decode one event (tagged map or tagged array). Raises ProtocolError (see reasons above)."""
    t = type(obj)
    if t is dict:
        return _from_map(obj)
    if t is list or t is tuple:
        return _from_array(obj)
    raise _bad(f"event must be a map or an array, got {t.__name__}")


def decode_events(objs: Any) -> tuple[list[KvEvent], dict[str, int]]:
    """Decode a list of events, skipping bad ones. Never raises.

    Returns the decoded events in order and the number skipped per reason. A non-list input
    counts as one ``bad_batch``.
    """
    skipped: dict[str, int] = {}
    if type(objs) is not list and type(objs) is not tuple:
        return [], {"bad_batch": 1}
    out: list[KvEvent] = []
    for o in objs:
        try:
            out.append(decode_event(o))
        except ProtocolError as exc:
            skipped[exc.reason] = skipped.get(exc.reason, 0) + 1
        except Exception:  # defensive: one pathological event must never fail the batch
            skipped["internal_decode_error"] = skipped.get("internal_decode_error", 0) + 1
    return out, skipped


def decode_batch(payload: bytes) -> EventBatch | ProtocolError:
    """Decode a raw ZMQ frame-2 payload (``[ts, events]`` or ``[ts, events, rank]``). Never raises."""
    try:
        b = unpack(payload)
        if type(b) is not list or len(b) < 2:
            raise ProtocolError("bad_batch", "batch must be an array [ts, events, rank?]")
        ts, events = b[0], b[1]
        if type(ts) not in (int, float) or not math.isfinite(ts):
            raise ProtocolError("bad_batch", f"ts must be a finite number, got {ts!r}"[:128])
        if type(events) is not list:
            raise ProtocolError("bad_batch", "events must be an array")
        rank = b[2] if len(b) > 2 else None
        if rank is not None and (type(rank) is not int or rank < 0):
            raise ProtocolError("bad_batch", f"rank must be a non-negative int, got {rank!r}"[:128])
        evs, skipped = decode_events(events)
        return EventBatch(float(ts), tuple(evs), rank, skipped)
    except ProtocolError as exc:
        return exc
    except Exception as exc:  # pragma: no cover - defensive
        return ProtocolError("internal_decode_error", repr(exc)[:256])


# --------------------------------------------------------------------------- encoding


def _wire_tokens(ev: BlockStored) -> list:
    if ev.lookahead_token_id is None:
        return list(ev.token_ids)
    nxt = list(ev.token_ids[1:]) + [ev.lookahead_token_id]
    return [[a, b] for a, b in zip(ev.token_ids, nxt)]


def encode_event_map(ev: KvEvent) -> dict[str, Any]:
    """SGLang 0.5.23 tagged map (signed int64 hashes; None-valued optional keys omitted)."""
    if type(ev) is BlockStored:
        d: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [to_signed64(h) for h in ev.block_hashes],
            "parent_block_hash": None if ev.parent_block_hash is None else to_signed64(ev.parent_block_hash),
            "token_ids": _wire_tokens(ev),
            "block_size": ev.block_size,
            "lora_id": None,
        }
        if ev.medium is not None:
            d["medium"] = ev.medium
        if ev.cache_salt is not None:
            d["cache_salt"] = ev.cache_salt
        if ev.lora_name is not None:
            d["lora_name"] = ev.lora_name
        return d
    if type(ev) is BlockRemoved:
        d = {"type": "BlockRemoved", "block_hashes": [to_signed64(h) for h in ev.block_hashes]}
        if ev.medium is not None:
            d["medium"] = ev.medium
        return d
    if type(ev) is AllBlocksCleared:
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {type(ev).__name__}")


def encode_event_array(ev: KvEvent) -> list[Any]:
    """SGLang 0.5.18-style tagged array with trailing nils present.

    BlockStored position 7: with a cache salt, 0.5.18's metadata map ``{"cache_salt": salt}``
    (plus ``lora_name`` when set, a mesh addition); else ``lora_name`` (a string) or nil.
    """
    if type(ev) is BlockStored:
        if ev.cache_salt is not None:
            meta: Any = {"cache_salt": ev.cache_salt}
            if ev.lora_name is not None:
                meta["lora_name"] = ev.lora_name
        else:
            meta = ev.lora_name
        return [
            "BlockStored",
            [to_signed64(h) for h in ev.block_hashes],
            None if ev.parent_block_hash is None else to_signed64(ev.parent_block_hash),
            _wire_tokens(ev),
            ev.block_size,
            None,
            ev.medium,
            meta,
        ]
    if type(ev) is BlockRemoved:
        return ["BlockRemoved", [to_signed64(h) for h in ev.block_hashes], ev.medium]
    if type(ev) is AllBlocksCleared:
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {type(ev).__name__}")


def encode_batch(
    ts: float, events: Iterable[KvEvent], dp_rank: int | None, *, form: Literal["map", "array"] = "map"
) -> bytes:
    """A ZMQ frame-2 payload: msgpack ``[ts, events, dp_rank]`` (``[ts, events]`` when rank is None)."""
    if form == "map":
        enc = encode_event_map
    elif form == "array":
        enc = encode_event_array
    else:
        raise ValueError(f"form must be 'map' or 'array', got {form!r}")
    body: list[Any] = [ts, [enc(e) for e in events]]
    if dp_rank is not None:
        body.append(dp_rank)
    return pack(body)


def event_blocks(events: list[KvEvent]) -> int:
    """The blocks ``events`` name, each event at least 1 (the unit of
    :func:`mesh.protocol.kv_block_count`, for decoded events)."""
    return sum(len(getattr(e, "block_hashes", ())) or 1 for e in events)


def split_events(events: list[KvEvent], max_tokens: int, max_hashes: int = 16_384,
                 max_blocks: int | None = None) -> list[list[KvEvent]]:
    """Cut an event list into batches of at most ``max_tokens`` stored tokens and, given
    ``max_blocks``, at most that many blocks (each event counts its hashes, at least 1: the
    unit of :func:`mesh.protocol.kv_block_count`); order kept.

    A BlockStored larger than the budget is split into consecutive BlockStored events (the
    parent of each piece is the last hash of the previous one); long BlockRemoved lists are split
    at ``max_hashes`` (and at the block budget).
    """
    cap = max_blocks if max_blocks is not None else 1 << 62
    out: list[list[KvEvent]] = []
    cur: list[KvEvent] = []
    used = 0
    nb = 0  # blocks in cur

    def room_blocks() -> int:
        nonlocal cur, used, nb
        if nb >= cap:
            out.append(cur)
            cur, used, nb = [], 0, 0
        return cap - nb

    for ev in events:
        t = type(ev)
        if t is BlockStored:
            bs = ev.block_size
            per = max(1, min(max_tokens // bs, max_hashes, cap))
            hashes, toks, parent = ev.block_hashes, ev.token_ids, ev.parent_block_hash
            i = 0
            while i < len(hashes):
                room = max(0, min((max_tokens - used) // bs, cap - nb))
                if room == 0:
                    out.append(cur)
                    cur, used, nb = [], 0, 0
                    room = per
                n = min(room, per, len(hashes) - i)
                last_piece = i + n >= len(hashes)
                piece = BlockStored(hashes[i:i + n], parent, toks[i * bs:(i + n) * bs], bs, ev.medium, ev.lora_name,
                                    ev.lookahead_token_id if last_piece else None, ev.cache_salt)
                if n == len(hashes):
                    piece = ev
                cur.append(piece)
                used += n * bs
                nb += n
                parent = hashes[i + n - 1]
                i += n
        elif t is BlockRemoved and len(ev.block_hashes) > min(max_hashes, cap - nb):
            hs = ev.block_hashes
            i = 0
            while i < len(hs):
                n = min(max_hashes, room_blocks(), len(hs) - i)
                cur.append(BlockRemoved(hs[i:i + n], ev.medium))
                nb += n
                i += n
        else:
            room_blocks()
            cur.append(ev)
            nb += max(1, len(ev.block_hashes)) if t is BlockRemoved else 1
    if cur:
        out.append(cur)
    return out
