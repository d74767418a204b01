"""Pure MESH/1 frame generators for the fuzzer: a seeded ``random.Random`` in, frame lists out.

No I/O, no clock. Every base frame is built with the real encoders of :mod:`mesh.protocol` (and
SGLang-style KV events with :mod:`mesh.kv_events`), so a valid base always decodes with
:func:`mesh.protocol.decode_client` / :func:`mesh.protocol.decode_worker`. A *case* is then either
sent as is (``mutation is None``), made semantically odd while staying decodable (``semantic``
mutations: extreme but legal values, replies for requests that do not exist, duplicated READY,
sequence gaps ...) or broken on purpose (``body`` and ``frame`` mutations: wrong types, missing
or extra fields, huge/negative ints, NaN, unicode junk, oversize strings and lists, msgpack ext
types, deep nesting, truncated or extra frames, wrong header or command byte, random bytes ...).

Determinism: the same ``random.Random`` state yields the same sequence of cases.
"""

from __future__ import annotations

import json
import math
import random
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from mesh import protocol as P
from mesh.errors import ErrorCode
from mesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_event_array, encode_event_map
from mesh.load import LoadStat

__all__ = [
    "Case",
    "BODY_MUTATIONS",
    "FRAME_MUTATIONS",
    "CLIENT_SEMANTIC",
    "WORKER_SEMANTIC",
    "REPLY_KINDS",
    "ClientGen",
    "WorkerGen",
    "answer_request",
    "http_case",
    "HTTP_MUTATIONS",
    "deep_msgpack",
]

# --------------------------------------------------------------------------- catalogue

#: mutations of a decoded body (a msgpack map) before it is packed again
BODY_MUTATIONS = (
    "wrong_type", "missing_field", "extra_field", "huge_int", "negative_int", "nan_inf", "unicode_junk",
    "oversize_string", "oversize_list", "ext_type", "deep_nesting", "bool_for_int", "null_field",
    "body_not_map", "non_str_key", "bin_for_str",
)
#: mutations of the frame list itself
FRAME_MUTATIONS = (
    "truncated_frames", "extra_frames", "wrong_header", "other_path_header", "bad_command_byte",
    "other_path_command", "multi_byte_command", "empty_command", "random_bytes", "truncated_msgpack",
    "length_bomb", "empty_body", "trailing_garbage", "no_frames",
)
#: decodable client frames with odd semantics
CLIENT_SEMANTIC = (
    "duplicate_rid", "cancel_unknown", "cancel_inflight", "extreme_submit", "unicode_text", "status_junk_ok",
)
#: decodable worker frames with odd semantics (from a registered session)
WORKER_SEMANTIC = (
    "duplicate_ready", "stale_reply", "foreign_reply", "extreme_loadstat", "rank_out_of_range", "kv_seq_gap",
    "kv_epoch_change", "kv_weird_events", "kv_array_form", "disconnect_draining", "error_unknown_code",
    "usage_junk", "reply_garbage_payload",
)
#: how the fuzzing worker answers a REQUEST
REPLY_KINDS = (
    "correct", "error_retryable", "error_fatal", "silent", "seq_gap", "double_final", "final_wrong_attempt",
    "final_after_error", "garbage_payload", "mutated_reply",
)

_UNICODE_JUNK = (
    "\u0000", "\ufeff", "\u202e", "\U0001f4a9", "e\u0301", "\uffff", "\u200b" * 7, "ᚠᛇᚻ", "𝔘𝔫𝔦", "\u0085",
    "%s%n%x", "'; DROP TABLE --", "../../etc/passwd", "\r\n\r\n", "\\u0000",
)
_HUGE_INTS = (2**63 - 1, 2**63, 2**64 - 1, 2**32, 2**32 - 1, 2**31, 10**18)
_NEG_INTS = (-1, -(2**31), -(2**63), -(2**32))
_WEIRD_FLOATS = (math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308)


@dataclass(slots=True)
class Case:
    """One message to send: which path, which base command, what was done to it, the frames."""

    path: str  # "client" | "worker"
    base: str  # base command name (e.g. "SUBMIT", "READY") or "random"
    mutation: str | None  # None = valid as encoded
    frames: list[bytes]
    group: str = "valid"  # valid | semantic | body | frame
    rid: str | None = None  # client rid of a SUBMIT (tracked when group == "valid")
    meta: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "base": self.base, "mutation": self.mutation, "group": self.group,
                "frames_hex": [f[:512].hex() + ("..." if len(f) > 512 else "") for f in self.frames]}


def deep_msgpack(depth: int, kind: str = "map") -> bytes:
    """``depth`` nested maps ({"k": {"k": ...}}) or arrays, built as bytes (no recursion)."""
    head = b"\x81\xa1k" if kind == "map" else b"\x91"
    return head * depth + b"\xc0"


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _junk_value(rng: random.Random) -> Any:
    return rng.choice([
        None, True, False, 0, -1, 2**64 - 1, -(2**63), 1.5, math.nan, math.inf, "", "x" * rng.randint(1, 40),
        rng.choice(_UNICODE_JUNK), b"\x00\xff", [], [1, "a", None], {}, {"a": {"b": [None]}},
        msgpack.ExtType(rng.randint(0, 127), rng.randbytes(rng.randint(0, 9))),
        msgpack.Timestamp(rng.randint(0, 2**34 - 1), rng.randint(0, 999_999_999)),  # ext type -1
    ])


def _other_type(rng: random.Random, v: Any) -> Any:
    for _ in range(16):
        j = _junk_value(rng)
        if type(j) is not type(v):
            return j
    return [v]


# --------------------------------------------------------------------------- generic mutators


def mutate_body(rng: random.Random, body: Any, name: str) -> Any:
    """Return a mutated copy of ``body`` (a decoded map) for one of :data:`BODY_MUTATIONS`.
    Only returns Python objects; ``deep_nesting`` and ``non_str_key`` are handled as bytes."""
    d = dict(body) if isinstance(body, dict) else {"v": body}
    keys = list(d) or ["rid"]
    k = rng.choice(keys)
    if name == "wrong_type":
        d[k] = _other_type(rng, d.get(k))
    elif name == "missing_field":
        d.pop(k, None)
    elif name == "extra_field":
        for _ in range(rng.randint(1, 5)):
            d[rng.choice(["x", "__proto__", "rid2", "", "a" * 300, rng.choice(_UNICODE_JUNK)])] = _junk_value(rng)
    elif name == "huge_int":
        d[k] = rng.choice(_HUGE_INTS)
    elif name == "negative_int":
        d[k] = rng.choice(_NEG_INTS)
    elif name == "nan_inf":
        d[k] = rng.choice(_WEIRD_FLOATS)
    elif name == "unicode_junk":
        d[k] = "".join(rng.choice(_UNICODE_JUNK) for _ in range(rng.randint(1, 8)))
    elif name == "oversize_string":
        d[k] = rng.choice("xé€\U0001f4a9") * rng.choice([257, 4097, 65_537, 300_000])
    elif name == "oversize_list":
        d[k] = [rng.choice([0, 1, 2**32 - 1])] * rng.choice([1025, 65_537, 200_000])
    elif name == "ext_type":
        d[k] = msgpack.ExtType(rng.randint(0, 127), rng.randbytes(rng.choice([0, 1, 4, 8, 12, 300]))) \
            if rng.random() < 0.7 else msgpack.Timestamp(rng.randint(0, 2**34 - 1), 0)
    elif name == "bool_for_int":
        d[k] = rng.choice([True, False])
    elif name == "null_field":
        d[k] = None
    elif name == "body_not_map":
        return rng.choice([[d.get(k)], "map", 42, None, b"\x01", list(d.items())])
    elif name == "bin_for_str":
        v = d.get(k)
        d[k] = v.encode() if isinstance(v, str) else rng.randbytes(8)
    return d


def _body_frame(rng: random.Random, body: Any, name: str) -> bytes:
    if name == "deep_nesting":
        depth = rng.choice([64, 600, 1100, 5000, 100_000])
        kind = rng.choice(["map", "array"])
        inner = deep_msgpack(depth, kind)
        # put the deep value under a real key so the body is still a map at the top
        keys = [k for k in (body if isinstance(body, dict) else {}) if isinstance(k, str)] or ["rid"]
        k = rng.choice(keys).encode()
        rest = {kk: vv for kk, vv in (body.items() if isinstance(body, dict) else []) if kk != k.decode()}
        n = len(rest) + 1
        hdr = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
        out = hdr
        for kk, vv in rest.items():
            out += _pack(kk) + _pack(vv)
        return out + _pack(k.decode()) + inner
    if name == "ext_type" and rng.random() < 0.3:
        # negative (reserved) ext codes and a malformed timestamp, as raw bytes under the first key
        keys = [k for k in (body if isinstance(body, dict) else {}) if isinstance(k, str)] or ["rid"]
        ext = rng.choice([b"\xd4\xfe\x00", b"\xd6\xff\x00\x00", b"\xc7\x03\xff\x00\x00\x00", b"\xd5\x80\x00\x01"])
        return b"\x81" + _pack(rng.choice(keys)) + ext
    if name == "non_str_key":
        # int and bin keys: strict_map_key=True only allows str (and bytes) keys
        key = rng.choice([1, -7, 2.5, None, True])
        if isinstance(body, dict) and body:
            items = list(body.items())
            return b"\x81" + _pack(key) + _pack(items[0][1]) if rng.random() < 0.5 else \
                bytes([0x80 | min(len(items) + 1, 15)]) + b"".join(_pack(a) + _pack(b) for a, b in items[:14]) + _pack(key) + b"\xc0"
        return b"\x81" + _pack(key) + b"\xc0"
    return _pack(mutate_body(rng, body, name))


def mutate_frames(rng: random.Random, frames: list[bytes], name: str, path: str) -> list[bytes]:
    """One of :data:`FRAME_MUTATIONS` applied to a frame list (header, command, body[, payload])."""
    f = list(frames)
    own = P.CLIENT_HEADER if path == "client" else P.WORKER_HEADER
    other = P.WORKER_HEADER if path == "client" else P.CLIENT_HEADER
    if name == "truncated_frames":
        return f[: rng.randint(0, max(0, len(f) - 1))]
    if name == "extra_frames":
        return f + [rng.randbytes(rng.randint(0, 32)) for _ in range(rng.randint(1, 4))]
    if name == "wrong_header":
        f[0] = rng.choice([b"", b"MESHC2", b"MESHW0", b"meshc1", own + b"\x00", own[:5], b"MDPC01", rng.randbytes(6),
                           b"\x00" * 6, b"GET / HTTP/1.1\r\n"])
        return f
    if name == "other_path_header":
        f[0] = other
        return f
    if name == "bad_command_byte":
        known = {c.value for c in P.Cmd}
        f[1] = bytes([rng.choice([b for b in range(256) if b not in known])])
        return f
    if name == "other_path_command":
        cmds = [c for c in P.Cmd if (c.value >= 0x11) != (path == "client")] + \
               [P.Cmd.REQUEST, P.Cmd.CANCEL, P.Cmd.RESYNC, P.Cmd.C_ACCEPTED, P.Cmd.C_FINAL, P.Cmd.C_STATUS_REPLY]
        f[1] = bytes([rng.choice(cmds).value])
        return f
    if name == "multi_byte_command":
        f[1] = f[1] + rng.randbytes(rng.randint(1, 3))
        return f
    if name == "empty_command":
        f[1] = b""
        return f
    if name == "random_bytes":
        i = rng.randrange(2, len(f)) if len(f) > 2 else len(f) - 1
        f[i] = rng.randbytes(rng.choice([0, 1, 7, 64, 4096]))
        return f
    if name == "truncated_msgpack":
        b = f[2]
        f[2] = b[: rng.randrange(0, max(1, len(b)))]
        return f
    if name == "length_bomb":
        f[2] = rng.choice([b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
                           b"\xde\xff\xff" + b"\xa1k\xc0" * 3, b"\xc9\xff\xff\xff\xff\x01"])
        return f
    if name == "empty_body":
        f[2] = b""
        return f
    if name == "trailing_garbage":
        f[2] = f[2] + rng.choice([b"\xc0", b"\x81\xa1k\xc0", rng.randbytes(5)])
        return f
    if name == "no_frames":
        return [rng.choice([b"", own])]
    raise ValueError(name)


def random_case(rng: random.Random, path: str) -> Case:
    n = rng.randint(1, 6)
    frames = [rng.randbytes(rng.choice([0, 1, 6, 16, 200])) for _ in range(n)]
    if rng.random() < 0.5 and n >= 2:
        frames[0] = P.CLIENT_HEADER if path == "client" else P.WORKER_HEADER
    return Case(path, "random", "random_bytes", frames, group="frame")


# --------------------------------------------------------------------------- client path


class ClientGen:
    """Cases for the client path (frontend ROUTER). ``rid_prefix`` keeps tracked rids apart."""

    def __init__(self, rng: random.Random, rid_prefix: str = "c") -> None:
        self.rng = rng
        self.prefix = rid_prefix
        self.n = 0
        self.inflight: list[str] = []  # rids the runner reported as still in flight

    def next_rid(self, tag: str = "v") -> str:
        self.n += 1
        return f"{self.prefix}-{tag}{self.n}"

    def prompt(self) -> dict[str, Any]:
        r = self.rng
        if r.random() < 0.25:
            return {"text": "".join(r.choice(["hello ", "The quick brown fox ", "日本語 ", "x"]) for _ in range(r.randint(1, 30)))}
        base = r.choice([[1, 2, 3, 4] * 8, list(range(100, 164)), [7] * 16])
        return {"input_ids": base + [r.randrange(0, 50_000) for _ in range(r.randint(1, 64))]}

    def valid_submit(self, rid: str | None = None, *, deadline_ms: int = 3000) -> Case:
        r = self.rng
        rid = rid or self.next_rid("v")
        params: dict[str, Any] = {"max_new_tokens": r.choice([0, 1, 2, 4, 8, 16])}
        if r.random() < 0.3:
            params["temperature"] = r.choice([0.0, 0.7, 1.0])
        slo = None
        if r.random() < 0.2:
            slo = {"ttft_ms": r.choice([1, 100, 5000])} if r.random() < 0.5 else {"tps": r.choice([0.5, 10.0, 1e6])}
        frames = P.encode_submit(rid, **self.prompt(), params=params, deadline_ms=deadline_ms, stream=r.random() < 0.7,
                                 idempotent=r.random() < 0.8, slo=slo)
        return Case("client", "SUBMIT", None, frames, rid=rid)

    def base(self) -> tuple[str, list[bytes]]:
        r = self.rng.random()
        if r < 0.7:
            return "SUBMIT", self.valid_submit(self.next_rid("m")).frames
        if r < 0.85:
            return "CANCEL", P.encode_cancel(self.next_rid("m"))
        return "STATUS", P.encode_status_query()

    def semantic(self, name: str) -> Case:
        r = self.rng
        if name == "duplicate_rid":
            rid = r.choice(self.inflight) if self.inflight else self.next_rid("d")
            return Case("client", "SUBMIT", name, self.valid_submit(rid).frames, group="semantic")
        if name == "cancel_unknown":
            return Case("client", "CANCEL", name, P.encode_cancel(r.choice([self.next_rid("u"), "x" * 256, "\U0001f4a9"])), group="semantic")
        if name == "cancel_inflight":
            rid = r.choice(self.inflight) if self.inflight else self.next_rid("u")
            return Case("client", "CANCEL", name, P.encode_cancel(rid), group="semantic")
        if name == "extreme_submit":
            rid = self.next_rid("e")
            choice = r.randrange(7)
            if choice == 0:
                frames = P.encode_submit(rid, input_ids=[0, 2**32 - 1] * r.choice([1, 4096, 60_000]), params={"max_new_tokens": 1},
                                         deadline_ms=2000)
            elif choice == 1:
                frames = P.encode_submit(rid, input_ids=[1], params={"max_new_tokens": r.choice([0, P.MAX_NEW_TOKENS])}, deadline_ms=r.choice([1, 2]))
            elif choice == 2:
                frames = P.encode_submit(rid, input_ids=[5, 6], params={"max_new_tokens": 1}, deadline_ms=2000,
                                         slo={"ttft_ms": 2**63 - 1, "tps": 1.7976931348623157e308})
            elif choice == 3:
                frames = P.encode_submit(rid, input_ids=[True, False, True], params={"max_new_tokens": 1}, deadline_ms=2000)
            elif choice == 4:
                frames = P.encode_submit("r" * 256, input_ids=[1, 2], params={"max_new_tokens": 1, "stop": ["\x00"] * 50,
                                                                           "nested": {"a": [{"b": None}] * 20}}, deadline_ms=2000)
            elif choice == 5:
                frames = P.encode_submit(rid, text="\U0001f4a9" * r.choice([1, 1000, 100_000]), params={"max_new_tokens": 1}, deadline_ms=2000)
            else:
                frames = P.encode_submit(rid, input_ids=[1, 2, 3], params={"max_new_tokens": 1, "temperature": math.nan},
                                         deadline_ms=2000, slo={"ttft_ms": 1})
            return Case("client", "SUBMIT", name, frames, group="semantic")
        if name == "unicode_text":
            rid = self.next_rid("t") + r.choice(_UNICODE_JUNK)
            txt = "".join(r.choice(_UNICODE_JUNK) for _ in range(r.randint(1, 20)))
            return Case("client", "SUBMIT", name, P.encode_submit(rid, text=txt, params={"max_new_tokens": 1}, deadline_ms=2000), group="semantic")
        if name == "status_junk_ok":
            # STATUS only requires a map body: any map must do
            body = {"x": _junk_value(r), "workers": [1, 2], "verbose": True}
            return Case("client", "STATUS", name, [P.CLIENT_HEADER, bytes([P.Cmd.C_STATUS]), _pack(body)], group="semantic")
        raise ValueError(name)

    def case(self, *, valid: float = 0.25, semantic: float = 0.2, body: float = 0.3) -> Case:
        """One random case: valid (tracked when it is a SUBMIT), semantic, body or frame mutation."""
        r = self.rng
        x = r.random()
        if x < valid:
            if r.random() < 0.85:
                return self.valid_submit()
            if r.random() < 0.5 and self.inflight:
                return Case("client", "CANCEL", None, P.encode_cancel(r.choice(self.inflight)))
            return Case("client", "STATUS", None, P.encode_status_query())
        if x < valid + semantic:
            return self.semantic(r.choice(CLIENT_SEMANTIC))
        if x < valid + semantic + body:
            base, frames = self.base()
            name = r.choice(BODY_MUTATIONS)
            return Case("client", base, name, frames[:2] + [_body_frame(r, P.unpack(frames[2]), name)], group="body")
        if r.random() < 0.08:
            return random_case(r, "client")
        base, frames = self.base()
        name = r.choice(FRAME_MUTATIONS)
        return Case("client", base, name, mutate_frames(r, frames, name, "client"), group="frame")


# --------------------------------------------------------------------------- worker path


def loadstat(rng: random.Random, *, rank: int = 0, extreme: bool = False) -> LoadStat:
    if extreme:
        # The extremes a decoder accepts (LoadStat values are ints in [0, 2**40)); values beyond
        # that are body mutations (huge_int), rejected as bad_loadstat.
        v = lambda: rng.choice([0, 1, 2**32, 10**12, 2**40 - 1])  # noqa: E731
        return LoadStat(v(), v(), v(), v(), rng.choice([rank, 1023, 1024, 2**32, 2**40 - 1]), v(), v(), v(), v(), v(),
                        extended=rng.random() < 0.7)
    mt = rng.choice([100_000, 500_000])
    return LoadStat(rng.randint(0, 8), rng.randint(0, 4), rng.randint(0, mt), mt, rank, rng.randint(0, 4096),
                    rng.randint(0, mt), 64, rng.randint(0, 10**9), rng.randint(0, 10**9))


def kv_event(rng: random.Random, block_size: int, *, weird: bool = False) -> Any:
    """One SGLang event as a tagged map (or, when weird, an oddity the decoder must tolerate)."""
    r = rng
    nblk = r.randint(1, 4)
    hashes = [r.randrange(0, 2**64) for _ in range(nblk)]
    toks = [r.randrange(0, 50_000) for _ in range(nblk * block_size)]
    parent = r.choice([None, r.randrange(0, 2**64)])
    if not weird:
        k = r.random()
        if k < 0.65:
            return encode_event_map(BlockStored(tuple(hashes), parent, tuple(toks), block_size))
        if k < 0.95:
            return encode_event_map(BlockRemoved(tuple(hashes)))
        return encode_event_map(AllBlocksCleared())
    choice = r.randrange(12)
    if choice == 0:  # EAGLE bigram pairs that chain
        ev = encode_event_map(BlockStored(tuple(hashes), parent, tuple(toks), block_size, lookahead_token_id=r.randrange(0, 2**32)))
        return ev
    if choice == 1:  # bigram pairs that do not chain
        return {"type": "BlockStored", "block_hashes": hashes[:1], "parent_block_hash": None,
                "token_ids": [[1, 2], [5, 6]] + [[0, 0]] * (block_size - 2), "block_size": block_size}
    if choice == 2:
        return {"type": r.choice(["BlockUpdated", "", "blockstored", "\U0001f4a9" * 100]), "block_hashes": hashes}
    if choice == 3:  # vLLM hybrid groups / kinds
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": toks,
                "block_size": block_size, "group_idx": r.choice([1, -1, 2**63 - 1, "0", None]),
                "kv_cache_spec_kind": r.choice(["sliding_window", "full_attention", 7, None])}
    if choice == 4:  # bytes hashes (vLLM), extremes, signed
        return {"type": "BlockStored", "block_hashes": [r.choice([b"\x01" * 32, b"", b"\xff" * 65, -(2**63), 2**64 - 1, -1])
                                                          for _ in range(nblk)],
                "parent_block_hash": r.choice([b"\x00" * 8, -(2**63), 2**64 - 1]), "token_ids": toks, "block_size": block_size}
    if choice == 5:  # token count that does not match
        return {"type": "BlockStored", "block_hashes": hashes, "token_ids": toks[:-1] + [2**32], "block_size": block_size}
    if choice == 6:
        return {"type": "BlockStored", "block_hashes": hashes, "token_ids": [], "block_size": r.choice([0, -1, 1 << 17, 2**64 - 1])}
    if choice == 7:
        return {"type": "BlockRemoved", "block_hashes": r.choice([[], hashes * 2, "abc", None, [None], [1.5]])}
    if choice == 8:  # array forms (0.5.18 and friends)
        return encode_event_array(BlockStored(tuple(hashes), parent, tuple(toks), block_size, lora_name=r.choice([None, "l"])))
    if choice == 9:
        return r.choice([["BlockStored"], ["BlockRemoved"], [], [None], ["AllBlocksCleared", 1, 2, 3], 42, "x", None,
                         {"type": None}, {}])
    if choice == 10:  # many removals of hashes never stored
        return {"type": "BlockRemoved", "block_hashes": [r.randrange(0, 2**64) for _ in range(r.choice([1, 100, 5000]))]}
    return {"type": "BlockStored", "block_hashes": [r.randrange(0, 2**64) for _ in range(1000)],
            "parent_block_hash": r.randrange(0, 2**64), "token_ids": [1] * (1000 * block_size), "block_size": block_size}


class WorkerGen:
    """Cases for the worker path (backend ROUTER), for one fuzzing worker identity."""

    def __init__(self, rng: random.Random, worker_id: str, *, block_size: int = 16, epoch: int = 1, dp_size: int = 1) -> None:
        self.rng = rng
        self.worker_id = worker_id
        self.block_size = block_size
        self.epoch = epoch
        self.dp_size = dp_size
        self.kv_seq = [0] * dp_size
        self.requests: list[tuple[int, int]] = []  # (rid, attempt) the broker sent this worker, recent
        self.max_rid_seen = 0

    def ready(self, *, heartbeat_ms: int = 200) -> list[bytes]:
        return P.encode_ready(P.Ready(self.worker_id, "fuzz-model", "mixed", {"fuzz": "1"}, self.block_size, 64, 500_000,
                                      self.dp_size, self.epoch, heartbeat_ms))

    def heartbeat(self) -> list[bytes]:
        return P.encode_heartbeat([loadstat(self.rng, rank=i) for i in range(self.dp_size)])

    def kv_events(self, *, weird: bool = False, rank: int | None = None, seq: int | None = None, epoch: int | None = None) -> list[bytes]:
        r = self.rng
        rank = r.randrange(self.dp_size) if rank is None else rank
        if seq is None:
            seq = self.kv_seq[rank] if rank < self.dp_size else 0
            if rank < self.dp_size:
                self.kv_seq[rank] += 1
        events = [kv_event(r, self.block_size, weird=weird) for _ in range(r.randint(1, 6))]
        return P.encode_kv_events(rank, self.epoch if epoch is None else epoch, seq, r.random() * 1e9, events)

    def _reply_target(self) -> tuple[int, int]:
        r = self.rng
        if self.requests and r.random() < 0.5:
            return r.choice(self.requests)
        return r.randint(0, max(10, self.max_rid_seen + 5)), r.randint(1, 3)

    def base(self) -> tuple[str, list[bytes]]:
        r = self.rng
        k = r.randrange(8)
        rid, att = self._reply_target()
        if k == 0:
            return "READY", self.ready()
        if k == 1:
            return "HEARTBEAT", self.heartbeat()
        if k == 2:
            return "KV_EVENTS", self.kv_events()
        if k == 3:
            return "CHUNK", P.encode_worker_chunk(rid, att, r.randint(0, 3), {"token_ids": [1, 2]})
        if k == 4:
            return "FINAL", P.encode_worker_final(rid, att, "length", {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0},
                                                  {"token_ids": [9]})
        if k == 5:
            return "ERROR", P.encode_worker_error(rid, att, r.choice(list(ErrorCode)), "fuzz")
        if k == 6:
            return "DISCONNECT", P.encode_disconnect(r.choice(["bye", P.DRAINING, ""]))
        return "HEARTBEAT", P.encode_heartbeat()

    def semantic(self, name: str) -> Case:
        r = self.rng
        if name == "duplicate_ready":
            return Case("worker", "READY", name, self.ready(heartbeat_ms=r.choice([1, 200, 600_000])), group="semantic")
        if name == "stale_reply":
            rid = r.choice([0, 2**63 - 1, self.max_rid_seen + 10_000])
            kind = r.randrange(3)
            frames = [P.encode_worker_chunk(rid, 1, 0, {"token_ids": [1]}),
                      P.encode_worker_final(rid, 1, "stop", {}, {}),
                      P.encode_worker_error(rid, 1, "worker_error", "stale")][kind]
            return Case("worker", ["CHUNK", "FINAL", "ERROR"][kind], name, frames, group="semantic")
        if name == "foreign_reply":
            # broker rids are sequential: guess ones handed to *other* workers, and wrong attempts of ours
            mine = {x for x, _ in self.requests}
            cands = [x for x in range(max(1, self.max_rid_seen - 50), self.max_rid_seen + 3) if x not in mine] or [1]
            rid = r.choice(cands) if r.random() < 0.7 or not self.requests else r.choice(self.requests)[0]
            att = r.randint(1, 4)
            kind = r.randrange(3)
            frames = [P.encode_worker_chunk(rid, att, 0, {"token_ids": [666]}),
                      P.encode_worker_final(rid, att, "stop", {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}, {"token_ids": [666]}),
                      P.encode_worker_error(rid, att, r.choice(["worker_error", "bad_request", "internal"]), "foreign")][kind]
            return Case("worker", ["CHUNK", "FINAL", "ERROR"][kind], name, frames, group="semantic", meta={"rid": rid, "attempt": att})
        if name == "extreme_loadstat":
            return Case("worker", "HEARTBEAT", name, P.encode_heartbeat([loadstat(r, rank=i, extreme=True)
                                                                          for i in range(r.choice([1, self.dp_size, 64]))]), group="semantic")
        if name == "rank_out_of_range":
            if r.random() < 0.5:
                return Case("worker", "HEARTBEAT", name, P.encode_heartbeat([loadstat(r, rank=r.choice([5, 1023, 2**31]))]), group="semantic")
            return Case("worker", "KV_EVENTS", name, self.kv_events(rank=r.choice([self.dp_size, 1023])), group="semantic")
        if name == "kv_seq_gap":
            rank = r.randrange(self.dp_size)
            self.kv_seq[rank] += r.choice([2, 1000, 2**40])
            return Case("worker", "KV_EVENTS", name, self.kv_events(rank=rank), group="semantic")
        if name == "kv_epoch_change":
            return Case("worker", "KV_EVENTS", name, self.kv_events(epoch=r.choice([0, self.epoch + 1, 2**63 - 1]), seq=r.choice([0, 5])),
                        group="semantic")
        if name == "kv_weird_events":
            return Case("worker", "KV_EVENTS", name, self.kv_events(weird=True), group="semantic")
        if name == "kv_array_form":
            rank = r.randrange(self.dp_size)
            seq = self.kv_seq[rank]
            self.kv_seq[rank] += 1
            evs = [encode_event_array(BlockStored((r.randrange(2**64),), None, tuple(range(self.block_size)), self.block_size))]
            return Case("worker", "KV_EVENTS", name, P.encode_kv_events(rank, self.epoch, seq, 0.0, evs), group="semantic")
        if name == "disconnect_draining":
            return Case("worker", "DISCONNECT", name, P.encode_disconnect(P.DRAINING), group="semantic")
        if name == "error_unknown_code":
            rid, att = self._reply_target()
            return Case("worker", "ERROR", name, P.encode_worker_error(rid, att, r.choice(["", "nope", "x" * 64, "WORKER_ERROR"]), "?"),
                        group="semantic")
        if name == "usage_junk":
            rid, att = self._reply_target()
            usage = {"prompt_tokens": _junk_value(r), "completion_tokens": _junk_value(r), "cached_tokens": _junk_value(r),
                     "extra": _junk_value(r)}
            return Case("worker", "FINAL", name, P.encode_worker_final(rid, att, r.choice(["stop", "", "\U0001f4a9" * 64]), usage, {}),
                        group="semantic")
        if name == "reply_garbage_payload":
            rid, att = self._reply_target()
            frames = P.encode_worker_final(rid, att, "stop", {}, {}) if r.random() < 0.5 else P.encode_worker_chunk(rid, att, 0, {})
            frames[3] = r.choice([b"", b"\xc1", r.randbytes(16), _pack([1, 2]), _pack("str"), b"\x81\xa1k"])
            return Case("worker", "FINAL" if frames[1] == bytes([P.Cmd.FINAL]) else "CHUNK", name, frames, group="semantic")
        raise ValueError(name)

    def case(self, *, valid: float = 0.2, semantic: float = 0.35, body: float = 0.25, allow_ready: bool = True) -> Case:
        r = self.rng
        x = r.random()
        if x < valid:
            k = r.random()
            if k < 0.5:
                return Case("worker", "HEARTBEAT", None, self.heartbeat())
            return Case("worker", "KV_EVENTS", None, self.kv_events())
        if x < valid + semantic:
            names = WORKER_SEMANTIC if allow_ready else tuple(n for n in WORKER_SEMANTIC if n not in ("duplicate_ready", "disconnect_draining"))
            return self.semantic(r.choice(names))
        if x < valid + semantic + body:
            base, frames = self.base()
            name = r.choice(BODY_MUTATIONS)
            return Case("worker", base, name, frames[:2] + [_body_frame(r, P.unpack(frames[2]), name)] + frames[3:], group="body")
        if r.random() < 0.08:
            return random_case(r, "worker")
        base, frames = self.base()
        name = r.choice(FRAME_MUTATIONS)
        return Case("worker", base, name, mutate_frames(r, frames, name, "worker"), group="frame")


def answer_request(rng: random.Random, req: P.Request, kind: str | None = None) -> tuple[str, list[list[bytes]]]:
    """How a fuzzing worker answers one REQUEST: returns (kind, frame lists to send in order).

    ``correct`` streams ``max_new_tokens`` one-token chunks (CHUNKs are sent for every request;
    the broker forwards them only when the client streams) and a FINAL with every token.
    """
    r = rng
    kind = kind or r.choices(REPLY_KINDS, weights=[45, 8, 4, 5, 5, 5, 5, 5, 9, 9])[0]
    n = max(0, min(req.submit.max_new_tokens, 8))
    toks = [r.randrange(0, 50_000) for _ in range(n)]
    prompt = req.submit.prompt_len
    usage = {"prompt_tokens": prompt, "completion_tokens": n, "cached_tokens": 0}
    rid, att = req.rid, req.attempt
    chunks = [P.encode_worker_chunk(rid, att, i, {"token_ids": [t]}) for i, t in enumerate(toks)]
    final = P.encode_worker_final(rid, att, "length", usage, {"token_ids": toks})
    if kind == "correct":
        return kind, chunks + [final]
    if kind == "error_retryable":
        return kind, [P.encode_worker_error(rid, att, r.choice(["worker_error", "overloaded", "unavailable", "worker_lost"]), "fuzz")]
    if kind == "error_fatal":
        return kind, [P.encode_worker_error(rid, att, r.choice(["bad_request", "internal", "context_length_exceeded"]), "fuzz")]
    if kind == "silent":
        return kind, []
    if kind == "seq_gap":
        return kind, [P.encode_worker_chunk(rid, att, r.choice([1, 5, -1 + 2**63]), {"token_ids": [1]})] + chunks + [final]
    if kind == "double_final":
        return kind, chunks + [final, final, P.encode_worker_error(rid, att, "worker_error", "after final")]
    if kind == "final_wrong_attempt":
        return kind, [P.encode_worker_final(rid, att + r.choice([1, 100]), "stop", usage, {}),
                      P.encode_worker_final(rid, max(1, att - 1), "stop", usage, {})] + chunks + [final]
    if kind == "final_after_error":
        return kind, [P.encode_worker_error(rid, att, "bad_request", "fuzz"), final]
    if kind == "garbage_payload":
        bad = r.choice([b"", b"\xc1", r.randbytes(12), _pack([1, 2]), _pack("s"), _pack({1: 2})[:-1]])
        frames = list(final)
        frames[3] = bad
        return kind, chunks + [frames]
    # mutated_reply: a body mutation of one of our chunk/final frames, then the correct answer
    frames = list(r.choice(chunks + [final]))
    name = r.choice(BODY_MUTATIONS)
    frames[2] = _body_frame(r, P.unpack(frames[2]), name)
    return kind, [frames] + chunks + [final]


# --------------------------------------------------------------------------- HTTP ingress

HTTP_MUTATIONS = ("valid", "wrong_type", "missing_field", "extra_field", "huge_int", "negative_int", "nan_inf",
                  "unicode_junk", "lone_surrogate", "oversize_string", "deep_nesting", "not_object", "bad_json",
                  "bad_header", "huge_number", "empty")


def http_case(rng: random.Random) -> tuple[str, str, bytes, dict[str, str], str]:
    """A POST to the HTTP ingress: (path, mutation, body bytes, extra headers, description)."""
    r = rng
    path = r.choice(["/v1/completions", "/v1/chat/completions", "/generate"])
    if path == "/v1/completions":
        body: Any = {"model": "mesh", "prompt": r.choice(["hi", [1, 2, 3]]), "max_tokens": r.randint(0, 4),
                     "stream": r.random() < 0.3}
    elif path == "/v1/chat/completions":
        body = {"model": "mesh", "messages": [{"role": "user", "content": "hi"}], "max_tokens": r.randint(0, 4),
                "stream": r.random() < 0.3}
    else:
        body = {"text": "hello", "sampling_params": {"max_new_tokens": r.randint(0, 4)}, "stream": r.random() < 0.3}
    m = r.choice(HTTP_MUTATIONS)
    headers: dict[str, str] = {}
    k = r.choice(list(body))
    raw: bytes | None = None
    if m == "wrong_type":
        body[k] = r.choice([None, 1, "s", [], {}, [None], {"a": 1}, True, 1.5])
    elif m == "missing_field":
        body.pop(k)
    elif m == "extra_field":
        body[r.choice(["stream_options", "temperature", "top_p", "stop", "rid", "input_ids", "n", "logprobs",
                       "user", "prompt_cache_key", "session_params"])] = \
            r.choice([None, 1, "s", [], {}, [None], {"include_usage": True}, 2**70, -1, "x" * 100])
    elif m == "huge_int":
        body[k] = r.choice([2**63, 2**64, 2**70, 10**30])
    elif m == "negative_int":
        body[k] = r.choice([-1, -(2**63)])
    elif m == "nan_inf":
        raw = json.dumps({**body, k: math.nan}).encode().replace(b"NaN", r.choice([b"NaN", b"Infinity", b"-Infinity"]))
    elif m == "unicode_junk":
        body[k] = "".join(r.choice(_UNICODE_JUNK) for _ in range(5))
    elif m == "lone_surrogate":
        raw = json.dumps(body).encode()
        raw = raw.replace(b'"hi"', b'"\\ud800"').replace(b'"hello"', b'"\\udfff x"')
    elif m == "oversize_string":
        body[k] = "x" * r.choice([10_000, 1_000_000])
    elif m == "deep_nesting":
        d = r.choice([100, 5000, 100_000])
        raw = (b'{"' + k.encode() + b'":' + b"[" * d + b"]" * d + b"}")
    elif m == "not_object":
        raw = r.choice([b"[]", b"1", b'"s"', b"null", b"true"])
    elif m == "bad_json":
        raw = r.choice([b"{", b"{'a':1}", b"\xff\xfe", b'{"a":}', b"{}}"])
    elif m == "bad_header":
        headers[r.choice(["x-mesh-deadline-ms", "x-sgl-ttft-slo-ms", "x-sgl-tps-slo", "x-session-id"])] = \
            r.choice(["soon", "-1", "0", "1e3", "nan", "9" * 5000, "1", "inf", " 5 "])
    elif m == "huge_number":
        raw = b'{"' + k.encode() + b'":' + b"9" * r.choice([30, 5000]) + b"}"
    elif m == "empty":
        raw = b""
    if raw is None:
        try:
            raw = json.dumps(body).encode()
        except ValueError:  # int too large to convert to str (Python's digit limit)
            raw = b'{"' + k.encode() + b'":' + b"9" * 5000 + b"}"
    return path, m, raw, headers, f"{path} {m}"
