"""The mesh wire contract (MESH/1). Every frame layout is stated here and only here.

Transport
=========
Two ZeroMQ paths meet at a broker, each on its own ROUTER socket:

* **client path**: clients are DEALERs connected to the broker's *frontend* ROUTER;
* **worker path**: workers are DEALERs connected to the broker's *backend* ROUTER. A worker opens
  one DEALER per broker, so one worker serves every broker of a mesh.

There is no empty delimiter frame (as in MDP/0.2). The ROUTER prepends the peer identity on
receive; the frame numbers below are what follows that identity.

Common frames
-------------
* Frame 0: protocol header, 6 bytes: ``b"MESHC1"`` on the client path, ``b"MESHW1"`` on the
  worker path. A wrong or foreign header is rejected (``bad_header``); a header of the other path
  is rejected as ``wrong_path``.
* Frame 1: command, exactly one byte (table below).
* Frame 2: body, one msgpack map with string keys (schema per command below).
* Frame 3: only where stated: an opaque payload passed through the broker without re-encoding.

Commands on the client path
---------------------------
=========  ====  ======  ====================================================================
command    byte  dir     body (frame 2) / frame 3
=========  ====  ======  ====================================================================
SUBMIT     0x11  c->b    ``rid`` str (1..256 bytes, unique among the client's in-flight
                         requests); exactly one of ``input_ids`` list[int] (0 <= id < 2**32) or
                         ``text`` str (msgpack booleans inside ``input_ids`` read as 1/0);
                         ``params`` map (``max_new_tokens`` int >= 0, default
                         128; other sampling keys passed through); ``deadline_ms`` int > 0
                         (remaining budget, optional: broker default); ``stream`` bool (default
                         true: CHUNKs are sent; false: only FINAL with all tokens);
                         ``idempotent`` bool (default true; false forbids re-dispatch once sent
                         to a worker); ``slo`` map (``ttft_ms`` int > 0, ``tps`` float > 0),
                         optional; ``model`` str (1..256 bytes, optional: the served model or an
                         alias; routed only to workers that serve it). Optional ``passthrough``
                         map: ``path`` str (one of ``PASSTHROUGH_PATHS``), ``method`` ``"POST"``,
                         ``body`` bin (at most ``MAX_PASSTHROUGH_BODY_BYTES``): the client's own
                         HTTP body, which the worker sends to its engine's OpenAI-compatible
                         ``path`` unchanged (``input_ids``/``text`` are then only the routing
                         key); its answer comes back as pass-through data maps (below).
                         ``session`` str (1..256 bytes, optional: the session key, turns of one
                         session stick to one worker, see :mod:`mesh.routing.sessions`). The
                         broker forwards this body verbatim as REQUEST frame 3.
CANCEL     0x12  c->b    ``rid``.
ACCEPTED   0x13  b->c    ``rid``, ``worker`` str, ``reason`` str (routing decision reason),
                         ``attempt`` int. Sent for *streaming* requests when dispatched (again
                         on retry); a non-streaming request learns the same from its FINAL.
                         (Also mid-stream: a stream continued on another worker after its
                         worker was lost, :mod:`mesh.broker_core.migrate`.)
CHUNK      0x14  b->c    ``rid``, ``seq`` int (0, 1, 2, ... contiguous per request, also
                         across a continuation on another worker).
                         Frame 3: the worker's chunk data, a msgpack map
                         (``token_ids`` list[int], optional ``text`` str, optional
                         ``meta_info`` map: the engine's own per-event metadata, passed
                         through by adapters: its scalars, plus the logprob lists in SGLang's
                         form (``output_token_logprobs`` ...) for this chunk's tokens only).
FINAL      0x15  b->c    ``rid``, ``finish_reason`` str, ``usage`` map (``prompt_tokens``,
                         ``completion_tokens``, ``cached_tokens``), ``worker`` str, ``attempt``,
                         ``reason`` str (routing decision reason of the final attempt).
                         Frame 3: the worker's final data map: ``token_ids`` (and ``text``)
                         are all of the output when the request was not streamed, otherwise the
                         last delta (adapters send the engine's last event here, so a stream ends
                         as the engine's does; often empty); optional ``meta_info`` map (the
                         engine's final metadata, e.g. SGLang's, passed through to HTTP).
ERROR      0x16  b->c    ``rid`` str or nil (nil when the request id was unreadable), ``code``
                         (an :class:`~mesh.errors.ErrorCode` value), ``message`` str.
STATUS     0x17  c->b    map: ask for the broker's view of the fleet. Optional ``full`` bool (every
                         worker's whole row, for an authorised client: CURVE client allow-list;
                         others get the bounded summary, see :mod:`mesh.broker_core.status`) and
                         ``offset`` int (the first worker row: paging through a large fleet).
STATUS_R   0x18  b->c    ``broker`` map (id, state, inflight, uptime_s; ``exchange`` with the peer
                         exchange on), ``workers`` list of maps (worker_id, model, tokenizer,
                         role, labels, healthy, inflight, peer_inflight, peer_prefill_tokens,
                         load, epoch), ``counters`` map of counter name -> value.
=========  ====  ======  ====================================================================

Exactly one terminal frame (FINAL or ERROR) reaches the client for every accepted ``rid``.

Pass-through answers (a SUBMIT with ``passthrough``): the engine's HTTP answer rides in the data
maps (frame 3) of CHUNKs and the FINAL, byte for byte: ``raw`` bin (a piece of the engine's body,
at most ``MAX_PASSTHROUGH_PIECE_BYTES``), and on the first of them ``status`` int (100..599) and
``content_type`` str (the engine's, at most 256 printable ASCII bytes); ``token_ids`` is empty. An
unstreamed answer, or one the engine refused (any status), is one FINAL holding all of it; a
refusal's ``finish_reason`` is ``http_<status>`` (``REFUSED_PREFIX``). Read
them with :func:`passthrough_reply` (never raises). A worker that does not know ``passthrough``
answers without ``status``: the front door answers 502 then.

Commands on the worker path
---------------------------
==========  ====  ======  ===================================================================
command     byte  dir     body (frame 2) / frame 3
==========  ====  ======  ===================================================================
READY       0x01  w->b    ``worker_id`` str, ``model`` str, ``role`` ``prefill|decode|mixed``,
                          ``labels`` map str->str, ``block_size`` int > 0 (tokens per KV
                          page), ``max_running_requests`` int > 0, ``max_total_num_tokens``
                          int > 0, ``dp_size`` int >= 1, ``epoch`` int >= 0 (changes on every
                          worker start), ``heartbeat_ms`` int > 0 (the worker's interval).
                          Optional: ``loras`` list of str (at most ``MAX_LORAS`` LoRA adapter
                          names of 1..256 bytes, the ones loaded on the engine; absent: the
                          worker does not report adapters); ``tokenizer`` str (the engine's
                          tokenizer as it names it: a model id or a path; absent: unknown, e.g.
                          byte-level simulated workers).
                          Must be the first command; a second READY on a live session is
                          answered with DISCONNECT.
HEARTBEAT   0x02  both    w->b: ``load`` list of LoadStat tagged arrays, one per DP rank
                          (:mod:`mesh.load`); may be empty; optional ``loras`` (as in READY:
                          the worker's adapters changed, this is the whole new list).
                          b->w: empty map. Any inbound message also counts as liveness.
KV_EVENTS   0x03  w->b    ``dp_rank`` int, ``epoch`` int, ``seq`` int >= 0 (per (worker,
                          rank), +1 per batch), ``ts`` float, ``events`` list of SGLang
                          tagged-map events (``BlockStored`` / ``BlockRemoved`` /
                          ``AllBlocksCleared``, :mod:`mesh.kv_events`). At most
                          ``MAX_KV_BATCH_BLOCKS`` blocks (each event counts its hashes, at
                          least 1) in a body of at most ``MAX_KV_BATCH_BYTES``; a larger batch
                          is refused at decode (``kv_batch_too_large``, counted; the body is
                          not unpacked when its bytes are over): senders slice by blocks.
REQUEST     0x04  b->w    ``rid`` int (broker-assigned), ``attempt`` int >= 1, ``deadline_ms``
                          int > 0 (remaining budget), ``client_rid`` str (for logs),
                          ``bootstrap`` map or nil (prefill/decode handoff); optional ``lora``
                          str (the LoRA adapter the broker resolved the request to, from
                          ``model`` ``base:adapter``, an adapter's name or ``lora_path``);
                          ``dp_rank`` int 0..1023, optional: the DP-attention rank to serve it on
                          (sent only to workers with ``dp_size`` > 1; a worker without ranks
                          ignores it).
                          Frame 3: the client's SUBMIT body, verbatim.
CHUNK       0x05  w->b    ``rid``, ``attempt``, ``seq`` (contiguous from 0). Frame 3: data map.
FINAL       0x06  w->b    ``rid``, ``attempt``, ``finish_reason`` str, ``usage`` map. Frame 3:
                          final data map.
ERROR       0x07  w->b    ``rid``, ``attempt``, ``code`` str, ``message`` str. A P/D prefill
                          leg may send it after its FINAL ``prefill_done``: the leg failed
                          after the handoff (the broker aborts the decode leg, retries the pair).
CANCEL      0x08  b->w    ``rid``, ``attempt``.
DISCONNECT  0x09  both    ``reason`` str. b->w: "forget your session and send READY again".
                          w->b with reason ``draining``: stop sending new work, let in-flight
                          requests finish (a plain DISCONNECT follows when the worker leaves).
RESYNC      0x0A  b->w    ``dp_rank`` int, ``reason`` str: the broker lost track of this rank's
                          KV stream; the worker answers with one KV_EVENTS batch holding
                          ``AllBlocksCleared`` then ``BlockStored`` for every cached block.
==========  ====  ======  ===================================================================

Telemetry stream
----------------
With ``--telemetry ENDPOINT`` a broker binds a PUB socket: two-frame messages ``[topic, msgpack
map]`` with topic ``mesh.snapshot`` (every second: broker state, per-worker role, labels, health,
in-flight, running, waiting, KV usage, requests and hit rate; cumulative request and decision
counters) or ``mesh.event`` (``event`` = worker_registered / worker_expired / worker_draining /
worker_disconnected, with ``worker_id``). See :mod:`brokers.telemetry`; ``mesh top`` reads it.

Peer exchange (broker to broker)
--------------------------------
With ``--exchange ENDPOINT`` a broker binds a PUB socket and its SUB connects to every ``--peer``
(subscribed to the header, so nothing else reaches the decoder). Three frames, like the other
paths: frame 0 ``b"MESHX1"``, frame 1 the command byte, frame 2 a msgpack map.

==========  ====  ===================================================================
command     byte  body (frame 2)
==========  ====  ===================================================================
PEER_LOAD   0x21  ``broker`` str (1..256 bytes, the sender's broker id), ``epoch`` int
                  (0..2**63-1, the sender's boot epoch: larger after a restart), ``seq``
                  int >= 0 (+1 per message within an epoch), ``full`` bool (true: the list
                  holds *every* worker the sender has work on, so a worker it omits has
                  none), ``workers`` list of at most ``MAX_EXCHANGE_WORKERS`` arrays
                  ``[worker_id str (1..256 bytes), inflight int (0..2**20), prefill_tokens
                  int (0..2**40), sent_tokens int (0..2**62)]``, worker ids unique;
                  ``full_ms`` int (1..600000, optional, default 1000): the sender's
                  full-snapshot period (receivers never call it stale sooner than 3 x that);
                  ``routes`` (optional) list of at most ``MAX_EXCHANGE_ROUTES`` arrays
                  ``[worker_id str (1..256 bytes), pages int (1..2**31-1), anchors]``:
                  prompts the sender routed there since its last message, each as its
                  full-page count and 1..``MAX_ROUTE_ANCHORS`` content keys (ints
                  0..2**64-1, :func:`mesh.index.peer_routes.route_anchors`);
                  ``sessions`` (optional) list of at most ``MAX_EXCHANGE_SESSIONS`` arrays
                  ``[session_hash int (0..2**64-1), worker_id str (1..256 bytes), age_ms int
                  (0..2**31-1)]``: session pins the sender made or used since its last
                  message, and how long ago (:mod:`mesh.routing.sessions`).
==========  ====  ===================================================================

Figures are the sender's own *absolute* values per worker: requests it has in flight there,
their uncached prefill tokens, and the uncached tokens it ever dispatched there (a counter that
only grows within an epoch). A lost, duplicated or reordered message is therefore harmless: the
next one carries the current values (see :mod:`mesh.routing.peers`). A message is at most
``MAX_EXCHANGE_BYTES``; :func:`decode_exchange` is its decode boundary.

Attempt fencing: a CHUNK/FINAL/ERROR whose ``(rid, attempt)`` is not the broker's current
attempt is dropped and counted (``stale_reply_dropped``).

Decoding
========
:func:`decode_client` and :func:`decode_worker` are the one decode boundary. They never raise:
they return a message object or a :class:`~mesh.errors.ProtocolError` whose ``reason`` is the
metric label (``bad_header``, ``wrong_path``, ``bad_frame_count``, ``unknown_command``,
``bad_msgpack``, ``bad_body``, ``bad_field``, ...). Encoders are plain functions returning the
frame list to send (without the ROUTER identity).
"""

from __future__ import annotations

import math
import re
from array import array
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack

from mesh.errors import ErrorCode, ProtocolError
from mesh.load import LoadStat

__all__ = [
    "CLIENT_HEADER",
    "WORKER_HEADER",
    "MAX_FRAME_BYTES",
    "MAX_LABELS",
    "MAX_LORAS",
    "MAX_STATUS_WORKERS",
    "MAX_STATUS_OFFSET",
    "MAX_NEW_TOKENS",
    "Cmd",
    "Submit",
    "Cancel",
    "StatusQuery",
    "StatusReply",
    "Accepted",
    "ClientChunk",
    "ClientFinal",
    "ClientError",
    "Ready",
    "Heartbeat",
    "KvEventsMsg",
    "Request",
    "WorkerChunk",
    "WorkerFinal",
    "WorkerError",
    "WorkerCancel",
    "Disconnect",
    "Resync",
    "decode_client",
    "decode_client_reply",
    "submit_body",
    "submit_of_body",
    "submit_frames",
    "decode_worker",
    "decode_broker_to_worker",
    "EXCHANGE_HEADER",
    "MAX_EXCHANGE_WORKERS",
    "MAX_EXCHANGE_BYTES",
    "MAX_EXCHANGE_ROUTES",
    "MAX_WORKER_ID_BYTES",
    "MAX_ROUTE_ANCHORS",
    "MAX_KV_BATCH_BLOCKS",
    "MAX_KV_BATCH_BYTES",
    "kv_block_count",
    "PeerLoad",
    "encode_peer_load",
    "decode_exchange",
    "pack",
    "unpack",
    "PASSTHROUGH_PATHS",
    "MAX_PASSTHROUGH_BODY_BYTES",
    "MAX_PASSTHROUGH_PIECE_BYTES",
    "PassthroughReply",
    "passthrough_reply",
    "REFUSED_PREFIX",
]

CLIENT_HEADER = b"MESHC1"
WORKER_HEADER = b"MESHW1"
EXCHANGE_HEADER = b"MESHX1"
MAX_FRAME_BYTES = 4 * 1024 * 1024
MAX_RID_BYTES = 256
# READY labels are echoed in every STATUS reply and telemetry snapshot: bounded so that a fleet
# of MAX_STATUS_WORKERS workers always fits one frame (64 x 60 KB labels made 11.5 MB replies).
MAX_LABELS = 16
MAX_LABEL_KEY_BYTES = 64
MAX_LABEL_VALUE_BYTES = 128
MAX_LORAS = 256  # LoRA adapter names in one READY / HEARTBEAT
MAX_LORA_NAME_BYTES = 256
MAX_STATUS_WORKERS = 1024
MAX_STATUS_OFFSET = 100_000  # STATUS ``offset``: at most the largest --max-workers
MAX_TOKENIZER_ID_BYTES = 1024  # READY ``tokenizer``: a model id or a path
MAX_TOKEN_ID = 2**32
# A non-streamed FINAL carries every output token (and its text) back through one frame:
# 2**18 tokens at up to 5 msgpack bytes each plus their text stays under MAX_FRAME_BYTES, so a
# long answer can never exceed the worker path's frame limit (and drop the worker's connection).
MAX_NEW_TOKENS = 1 << 18
# Peer exchange: one message lists at most this many workers (the default --max-workers, so a
# broker's whole fleet fits one full snapshot); worker ids are at most 256 bytes, so a message
# stays below MAX_EXCHANGE_BYTES, the SUB socket's MAXMSGSIZE.
MAX_EXCHANGE_WORKERS = 4096
MAX_EXCHANGE_BYTES = 2 * 1024 * 1024
MAX_PEER_INFLIGHT = 1 << 20
MAX_PEER_PREFILL_TOKENS = 1 << 40
MAX_PEER_SENT_TOKENS = 1 << 62
MAX_EXCHANGE_ROUTES = 1024  # prompts routed per message: with 64 anchors each, under 1 MiB
MAX_ROUTE_ANCHORS = 64
MAX_SESSION_BYTES = 256  # a SUBMIT's ``session`` key
MAX_EXCHANGE_SESSIONS = 512  # session pins per exchange message (~140 KiB at most)
MAX_SESSION_AGE_MS = 2**31 - 1
# KV_EVENTS: the largest batch a worker may send (larger ones cost the broker's loop, and so every
# other client, time in one piece). 8,192 blocks of 16 tokens at up to 5 msgpack
# bytes each stay under MAX_KV_BATCH_BYTES; the adapter's relay and the stub slice by blocks.
MAX_KV_BATCH_BLOCKS = 8192
MAX_KV_BATCH_BYTES = 1024 * 1024
# A worker id, wherever it travels (READY, the exchange's figures and routes), is at most this
# many UTF-8 bytes (bytes, not characters: READY once counted characters and accepted ids the
# exchange then refused, so peers silently lost that worker's figures).
MAX_WORKER_ID_BYTES = 256
_U64 = (1 << 64) - 1

# Pass-through (SUBMIT ``passthrough``): the engine endpoints a worker may be asked to call, and
# the bounds of the body it forwards and of each answer piece it sends back.
PASSTHROUGH_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                               "/v1/rerank", "/v1/score"})
MAX_PASSTHROUGH_BODY_BYTES = MAX_FRAME_BYTES // 2
MAX_PASSTHROUGH_PIECE_BYTES = 1 << 20
MAX_CONTENT_TYPE_BYTES = 256
REFUSED_PREFIX = "http_"  # finish_reason of a pass-through FINAL the engine refused: http_<status>

ROLES = ("prefill", "decode", "mixed")
DRAINING = "draining"  # DISCONNECT reason: graceful worker drain


class Cmd(IntEnum):
    # worker path
    READY = 0x01
    HEARTBEAT = 0x02
    KV_EVENTS = 0x03
    REQUEST = 0x04
    CHUNK = 0x05
    FINAL = 0x06
    ERROR = 0x07
    CANCEL = 0x08
    DISCONNECT = 0x09
    RESYNC = 0x0A
    # client path
    C_SUBMIT = 0x11
    C_CANCEL = 0x12
    C_ACCEPTED = 0x13
    C_CHUNK = 0x14
    C_FINAL = 0x15
    C_ERROR = 0x16
    C_STATUS = 0x17
    C_STATUS_REPLY = 0x18


# The peer exchange's command byte lives outside Cmd on purpose: the client and worker decoders
# keep answering it as ``unknown_command`` on their paths.
X_PEER_LOAD = 0x21
_X_PEER_LOAD_B = bytes([X_PEER_LOAD])


_B = {c: bytes([c]) for c in Cmd}
_CMD_BY_BYTE = {c.value: c for c in Cmd}  # Cmd(x) goes through EnumMeta.__call__: too slow per frame

_packer_opts: dict[str, Any] = {"use_bin_type": True}
_unpack_limits: dict[str, Any] = {
    "raw": False,
    "strict_map_key": True,
    # Length limits default to the buffer size in msgpack >= 1.0, which already stops
    # "array32 claiming 4 GiB" bombs; frames themselves are capped by ZMQ_MAXMSGSIZE.
}


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, **_packer_opts)


def unpack(data: bytes) -> Any:
    """Strict msgpack decode; raises ProtocolError(bad_msgpack) on any failure (incl. UnicodeDecodeError)."""
    try:
        return msgpack.unpackb(data, **_unpack_limits)
    except Exception as exc:  # msgpack raises several non-UnpackException types
        raise ProtocolError("bad_msgpack", f"{type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------- field checks


def _map(body: Any) -> dict[str, Any]:
    if type(body) is not dict:
        raise ProtocolError("bad_body", f"body must be a map, got {type(body).__name__}")
    return body


def _str(d: dict, k: str, *, required: bool = True, max_bytes: int = 4096, default: str = "") -> str:
    v = d.get(k)
    if v is None:
        if required:
            raise ProtocolError("bad_field", f"{k} is required")
        return default
    if type(v) is not str:
        raise ProtocolError("bad_field", f"{k} must be a string, got {type(v).__name__}")
    if len(v) > max_bytes or (len(v) * 4 > max_bytes and len(v.encode("utf-8", "surrogatepass")) > max_bytes):
        raise ProtocolError("bad_field", f"{k} longer than {max_bytes} bytes")
    return v


def _worker_id(v: Any, what: str) -> str:
    """The one worker-id rule of every decoder: a non-empty str of at most MAX_WORKER_ID_BYTES
    UTF-8 bytes."""
    if type(v) is not str or not v or (len(v) * 4 > MAX_WORKER_ID_BYTES
                                       and len(v.encode("utf-8", "surrogatepass")) > MAX_WORKER_ID_BYTES):
        raise ProtocolError("bad_field", f"{what} must be a string of 1..{MAX_WORKER_ID_BYTES} bytes")
    return v


def _int(d: dict, k: str, *, required: bool = True, default: int = 0, lo: int | None = 0, hi: int | None = 2**63 - 1) -> int:
    v = d.get(k)
    if v is None:
        if required:
            raise ProtocolError("bad_field", f"{k} is required")
        return default
    if type(v) is not int:  # bool is rejected on purpose
        raise ProtocolError("bad_field", f"{k} must be an int, got {type(v).__name__}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ProtocolError("bad_field", f"{k}={v} out of range [{lo}, {hi}]")
    return v


def _bool(d: dict, k: str, default: bool) -> bool:
    v = d.get(k)
    if v is None:
        return default
    if type(v) is not bool:
        raise ProtocolError("bad_field", f"{k} must be a bool, got {type(v).__name__}")
    return v


def _float(d: dict, k: str, *, required: bool = True, default: float = 0.0) -> float:
    v = d.get(k)
    if v is None:
        if required:
            raise ProtocolError("bad_field", f"{k} is required")
        return default
    if type(v) not in (int, float) or not math.isfinite(v):
        raise ProtocolError("bad_field", f"{k} must be a finite number, got {v!r}")
    return float(v)


def _opt_map(d: dict, k: str) -> dict | None:
    v = d.get(k)
    if v is None:
        return None
    if type(v) is not dict:
        raise ProtocolError("bad_field", f"{k} must be a map, got {type(v).__name__}")
    return v


USAGE_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")
_MAX_USAGE = 1 << 40


def _usage(d: dict) -> dict[str, int]:
    """A worker's usage map, reduced to the counts the mesh uses, each an int in [0, 2**40).
    Anything else is dropped: these values are summed into counters that STATUS encodes
    (2**64-1 once overflowed msgpack and silenced STATUS)."""
    u = _opt_map(d, "usage") or {}
    return {k: v for k in USAGE_KEYS if type(v := u.get(k)) is int and 0 <= v < _MAX_USAGE}


def _rid(d: dict) -> str:
    v = d.get("rid")
    if type(v) is not str or not v:
        raise ProtocolError("bad_field", "rid must be a non-empty string")
    if len(v.encode()) > MAX_RID_BYTES:
        raise ProtocolError("bad_field", f"rid longer than {MAX_RID_BYTES} bytes")
    return v


# --------------------------------------------------------------------------- client path


@dataclass(slots=True)
class Submit:
    rid: str
    input_ids: list[int] | None
    text: str | None
    max_new_tokens: int
    params: dict[str, Any]
    deadline_ms: int | None
    stream: bool
    idempotent: bool
    ttft_slo_ms: int | None
    tps_slo: float | None
    raw: bytes  # the body as received: forwarded verbatim to the worker
    packed: Any = None  # input_ids as array('I') (validated once; used for content keys)
    model: str | None = None  # the model asked for (None: the fleet's only model)
    # W3C trace context of the caller's span (HTTP front door): adapters continue the trace to
    # the engine. A malformed one is ignored, as W3C asks, never a reason to refuse a request.
    traceparent: str | None = None
    # pass-through (SUBMIT ``passthrough``): ``{"path", "method", "body"}``, checked; None: mesh renders
    passthrough: dict[str, Any] | None = None
    session: str | None = None  # the session key (turns of one session stick to one worker)
    # Tenants (mesh/tenants.py): the tenant an authenticating front door stamped (trusted only from
    # an in-process client; a ZeroMQ client's is replaced by its connection's tenant) and the
    # priority band asked for (index into PRIORITIES; clamped to the tenant's ceiling by the broker)
    tenant: str | None = None
    priority: int | None = None

    @property
    def prompt_len(self) -> int:
        if self.input_ids is not None:
            return len(self.input_ids)
        return len(self.text or "") // 4 + 1  # rough token estimate for text-only requests


@dataclass(slots=True)
class Cancel:
    rid: str


@dataclass(slots=True)
class StatusQuery:
    full: bool = False  # every worker's whole row (authorised clients only; others get the summary)
    offset: int = 0  # the first worker row of the reply (paging)


@dataclass(slots=True)
class StatusReply:
    broker: dict[str, Any]
    workers: list[dict[str, Any]]
    counters: dict[str, Any]


@dataclass(slots=True)
class Accepted:
    rid: str
    worker: str
    reason: str
    attempt: int


@dataclass(slots=True)
class ClientChunk:
    rid: str
    seq: int
    data: dict[str, Any]


@dataclass(slots=True)
class ClientFinal:
    rid: str
    finish_reason: str
    usage: dict[str, Any]
    worker: str
    attempt: int
    data: dict[str, Any]
    reason: str = ""


@dataclass(slots=True)
class ClientError:
    rid: str | None
    code: str
    message: str


def encode_submit(rid: str, **fields: Any) -> list[bytes]:
    """A client's SUBMIT frames; ``fields`` as :func:`submit_body` takes them."""
    return [CLIENT_HEADER, _B[Cmd.C_SUBMIT], pack(submit_body(rid, **fields))]


def submit_body(
    rid: str,
    *,
    input_ids: list[int] | None = None,
    text: str | None = None,
    params: dict[str, Any] | None = None,
    deadline_ms: int | None = None,
    stream: bool = True,
    idempotent: bool = True,
    slo: dict[str, Any] | None = None,
    model: str | None = None,
    traceparent: str | None = None,
    passthrough: dict[str, Any] | None = None,
    session: str | None = None,
    tenant: str | None = None,
    priority: str | None = None,
) -> dict[str, Any]:
    """The SUBMIT body (frame 2 before packing) :func:`encode_submit` sends."""
    body: dict[str, Any] = {"rid": rid, "params": params or {}, "stream": stream, "idempotent": idempotent}
    optional = {"model": model, "traceparent": traceparent, "input_ids": input_ids, "text": text,
                "deadline_ms": deadline_ms, "slo": slo or None, "passthrough": passthrough, "session": session,
                "tenant": tenant, "priority": priority}
    body.update((k, v) for k, v in optional.items() if v is not None)  # absent, not null: old peers decode it
    return body


def submit_frames(sub: Submit) -> list[bytes]:
    """The SUBMIT frames of a request already built (its body is ``sub.raw``)."""
    return [CLIENT_HEADER, _B[Cmd.C_SUBMIT], sub.raw]


def encode_cancel(rid: str) -> list[bytes]:
    return [CLIENT_HEADER, _B[Cmd.C_CANCEL], pack({"rid": rid})]


def encode_status_query(full: bool = False, offset: int = 0) -> list[bytes]:
    if not full and not offset:
        return [CLIENT_HEADER, _B[Cmd.C_STATUS], _EMPTY_MAP]
    return [CLIENT_HEADER, _B[Cmd.C_STATUS], pack({"full": full, "offset": offset})]


def encode_status_reply(broker: dict, workers: list, counters: dict) -> list[bytes]:
    return [CLIENT_HEADER, _B[Cmd.C_STATUS_REPLY], pack({"broker": broker, "workers": workers, "counters": counters})]


def encode_accepted(rid: str, worker: str, reason: str, attempt: int) -> list[bytes]:
    return [CLIENT_HEADER, _B[Cmd.C_ACCEPTED], pack({"rid": rid, "worker": worker, "reason": reason, "attempt": attempt})]


def encode_client_chunk(rid: str, seq: int, data: bytes) -> list[bytes]:
    return [CLIENT_HEADER, _B[Cmd.C_CHUNK], pack({"rid": rid, "seq": seq}), data]


def encode_client_final(rid: str, finish_reason: str, usage: dict, worker: str, attempt: int, data: bytes, reason: str = "") -> list[bytes]:
    body = {"rid": rid, "finish_reason": finish_reason, "usage": usage, "worker": worker, "attempt": attempt, "reason": reason}
    return [CLIENT_HEADER, _B[Cmd.C_FINAL], pack(body), data]


def encode_client_error(rid: str | None, code: ErrorCode | str, message: str) -> list[bytes]:
    return [CLIENT_HEADER, _B[Cmd.C_ERROR], pack({"rid": rid, "code": str(code), "message": message[:1024]})]


def _check_frames(frames: list[bytes], header: bytes, other: bytes) -> tuple[int, Any]:
    if len(frames) < 3 or len(frames) > 4:
        raise ProtocolError("bad_frame_count", f"{len(frames)} frames")
    h = frames[0]
    if h != header:
        if h == other:
            raise ProtocolError("wrong_path", "header of the other path")
        raise ProtocolError("bad_header", repr(bytes(h[:16])))
    c = frames[1]
    if len(c) != 1:
        raise ProtocolError("bad_command", f"command frame of {len(c)} bytes")
    cmd = _CMD_BY_BYTE.get(c[0])
    if cmd is None:
        raise ProtocolError("unknown_command", f"0x{c[0]:02x}")
    return cmd, frames[2]


def _parse_submit(raw: bytes) -> Submit:
    return _submit_of(_map(unpack(raw)), raw)


def submit_of_body(body: dict[str, Any], raw: bytes) -> Submit | ProtocolError:
    """The request an in-process client built: ``body`` (:func:`submit_body`) checked as
    :func:`decode_client` checks a received SUBMIT, without decoding ``raw`` (``pack(body)``, what
    the worker gets) again. Never raises."""
    try:
        return _submit_of(_map(body), raw)
    except ProtocolError as exc:
        return exc
    except Exception as exc:  # defensive, as at the decode boundary
        return ProtocolError("internal_decode_error", repr(exc))


def _submit_of(d: dict[str, Any], raw: bytes) -> Submit:
    rid = _rid(d)
    ids = d.get("input_ids")
    text = d.get("text")
    if (ids is None) == (text is None):
        raise ProtocolError("bad_field", "exactly one of input_ids or text is required")
    packed = None
    if ids is not None:
        if type(ids) is not list or not ids:
            raise ProtocolError("bad_field", "input_ids must be a non-empty list of ints")
        # One C-level pass validates every id (ints in [0, 2**32)) and packs them for hashing.
        # (msgpack true/false are Python ints and read as 1/0 here: a per-item type check would
        # cost four times the whole pack on an 8k-token prompt.)
        try:
            packed = array("I", ids)
        except (TypeError, OverflowError) as exc:
            raise ProtocolError("bad_field", f"input_ids holds an invalid token id: {exc}") from None
    elif type(text) is not str or not text:
        raise ProtocolError("bad_field", "text must be a non-empty string")
    params = _opt_map(d, "params") or {}
    mnt = _int(params, "max_new_tokens", required=False, default=128, lo=0, hi=MAX_NEW_TOKENS)
    deadline = _int(d, "deadline_ms", required=False, default=0, lo=1, hi=86_400_000) if "deadline_ms" in d else None
    slo = _opt_map(d, "slo") or {}
    ttft = _int(slo, "ttft_ms", required=False, default=0, lo=1) if slo.get("ttft_ms") is not None else None
    tps = None
    if slo.get("tps") is not None:
        tps = _float(slo, "tps")
        if tps <= 0:
            raise ProtocolError("bad_field", "slo.tps must be > 0")
    return Submit(
        rid=rid,
        input_ids=ids,
        text=text,
        max_new_tokens=mnt,
        params=params,
        deadline_ms=deadline,
        stream=_bool(d, "stream", True),
        idempotent=_bool(d, "idempotent", True),
        ttft_slo_ms=ttft,
        tps_slo=tps,
        raw=raw,
        packed=packed,
        model=_str(d, "model", required=False, max_bytes=256) or None,
        traceparent=_traceparent(d.get("traceparent")),
        passthrough=_passthrough(d.get("passthrough")),
        session=_session(d),
        tenant=_str(d, "tenant", required=False, max_bytes=64) or None,
        priority=_priority(d.get("priority")),
    )


def _passthrough(v: Any) -> dict[str, Any] | None:
    """SUBMIT ``passthrough``: None when absent; else a checked ``{"path", "method", "body"}``."""
    if v is None:
        return None
    if type(v) is not dict:
        raise ProtocolError("bad_field", f"passthrough must be a map, got {type(v).__name__}")
    path, method, body = v.get("path"), v.get("method", "POST"), v.get("body")
    if type(path) is not str or path not in PASSTHROUGH_PATHS:
        raise ProtocolError("bad_field", f"passthrough.path must be one of {sorted(PASSTHROUGH_PATHS)}")
    if method != "POST":
        raise ProtocolError("bad_field", "passthrough.method must be POST")
    if type(body) is not bytes:
        raise ProtocolError("bad_field", f"passthrough.body must be bytes, got {type(body).__name__}")
    if len(body) > MAX_PASSTHROUGH_BODY_BYTES:
        raise ProtocolError("bad_field", f"passthrough.body longer than {MAX_PASSTHROUGH_BODY_BYTES} bytes")
    return {"path": path, "method": method, "body": body}


@dataclass(slots=True)
class PassthroughReply:
    """One pass-through data map read: the engine's status and content type (None on a later
    piece) and a piece of its body."""

    status: int | None
    content_type: str | None
    raw: bytes


def passthrough_reply(data: Any) -> PassthroughReply | None:
    """A CHUNK's or FINAL's data map as a pass-through answer piece, or None when it is not one
    (no ``raw`` bytes, or a ``status`` / ``content_type`` out of bounds). Never raises."""
    if type(data) is not dict:
        return None
    raw = data.get("raw")
    if type(raw) is not bytes:
        return None
    status, ctype = data.get("status"), data.get("content_type")
    if status is not None and (type(status) is not int or not 100 <= status <= 599):
        return None
    if ctype is not None and (type(ctype) is not str or len(ctype) > MAX_CONTENT_TYPE_BYTES
                              or not (ctype.isascii() and ctype.isprintable())):
        return None
    return PassthroughReply(status, ctype, raw)


def _session(d: dict[str, Any]) -> str | None:
    """The optional ``session`` key: a non-empty string of at most MAX_SESSION_BYTES bytes."""
    if d.get("session") is None:
        return None
    v = _str(d, "session", max_bytes=MAX_SESSION_BYTES)
    if not v:
        raise ProtocolError("bad_field", "session must be a non-empty string")
    return v


#: Priority bands of a SUBMIT's ``priority``, highest first (mesh.tenants).
PRIORITIES = ("critical", "high", "normal", "low")


def _priority(v: Any) -> int | None:
    if v is None:
        return None
    if type(v) is str and v in PRIORITIES:
        return PRIORITIES.index(v)
    raise ProtocolError("bad_field", f"priority must be one of {', '.join(PRIORITIES)}")


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def _traceparent(v: Any) -> str | None:
    """A valid W3C ``traceparent`` (version-traceid-parentid-flags, lower-case hex), else None."""
    if type(v) is not str or len(v) != 55 or not _TRACEPARENT.fullmatch(v) or v.startswith("ff"):
        return None
    if v[3:35] == "0" * 32 or v[36:52] == "0" * 16:  # all-zero ids are invalid
        return None
    return v


def decode_client(frames: list[bytes]) -> Submit | Cancel | StatusQuery | ProtocolError:
    """Decode what a client sent to the broker (identity already stripped). Never raises."""
    try:
        cmd, body = _check_frames(frames, CLIENT_HEADER, WORKER_HEADER)
        if len(frames) != 3:
            raise ProtocolError("bad_frame_count", f"{len(frames)} frames for {cmd.name}")
        if cmd is Cmd.C_SUBMIT:
            return _parse_submit(body)
        if cmd is Cmd.C_CANCEL:
            return Cancel(_rid(_map(unpack(body))))
        if cmd is Cmd.C_STATUS:
            d = _map(unpack(body))
            return StatusQuery(_bool(d, "full", False), _int(d, "offset", required=False, hi=MAX_STATUS_OFFSET))
        raise ProtocolError("unexpected_command", f"{cmd.name} is not a client command")
    except ProtocolError as exc:
        return exc
    except Exception as exc:  # defensive: the boundary must never raise
        return ProtocolError("internal_decode_error", repr(exc))


def decode_client_reply(frames: list[bytes]) -> Accepted | ClientChunk | ClientFinal | ClientError | ProtocolError:
    """Decode what the broker sent to a client. Never raises."""
    try:
        cmd, body = _check_frames(frames, CLIENT_HEADER, WORKER_HEADER)
        d = _map(unpack(body))
        if cmd is Cmd.C_CHUNK:
            return ClientChunk(_rid(d), _int(d, "seq"), _map(unpack(frames[3])) if len(frames) == 4 else {})
        if cmd is Cmd.C_FINAL:
            data = _map(unpack(frames[3])) if len(frames) == 4 and frames[3] else {}
            return ClientFinal(
                _rid(d), _str(d, "finish_reason"), _opt_map(d, "usage") or {}, _str(d, "worker", required=False),
                _int(d, "attempt", required=False), data, _str(d, "reason", required=False),
            )
        if cmd is Cmd.C_ACCEPTED:
            return Accepted(_rid(d), _str(d, "worker"), _str(d, "reason", required=False), _int(d, "attempt", required=False))
        if cmd is Cmd.C_STATUS_REPLY:
            return StatusReply(_opt_map(d, "broker") or {}, d.get("workers") or [], _opt_map(d, "counters") or {})
        if cmd is Cmd.C_ERROR:
            rid = d.get("rid")
            return ClientError(rid if type(rid) is str else None, _str(d, "code"), _str(d, "message", required=False))
        raise ProtocolError("unexpected_command", f"{cmd.name} is not a broker-to-client command")
    except ProtocolError as exc:
        return exc
    except Exception as exc:
        return ProtocolError("internal_decode_error", repr(exc))


# --------------------------------------------------------------------------- worker path


@dataclass(slots=True)
class Ready:
    worker_id: str
    model: str
    role: str
    labels: dict[str, str]
    block_size: int
    max_running_requests: int
    max_total_num_tokens: int
    dp_size: int
    epoch: int
    heartbeat_ms: int
    loras: list[str] | None = None  # LoRA adapters loaded on the engine (None: not reported)
    # the engine's tokenizer identity (SGLang ``tokenizer_path``, vLLM ``/v1/models`` ``root``): a
    # model id or a path; "" unknown (old workers, simulated workers keyed by bytes)
    tokenizer: str = ""


@dataclass(slots=True)
class Heartbeat:
    load: list[LoadStat] = field(default_factory=list)
    loras: list[str] | None = None  # the worker's adapters changed: the whole new list


@dataclass(slots=True)
class KvEventsMsg:
    dp_rank: int
    epoch: int
    seq: int
    ts: float
    events: list[Any]  # raw SGLang map-form events; decoded by mesh.kv_events
    raw: bytes  # the body as received (forwarded to an external indexer verbatim)
    blocks: int = 0  # what the batch costs: its blocks (:func:`kv_block_count`), set at decode


@dataclass(slots=True)
class Request:
    rid: int
    attempt: int
    deadline_ms: int
    client_rid: str
    bootstrap: dict[str, Any] | None
    submit: Submit
    lora: str | None = None  # the LoRA adapter the broker resolved (None: base model, or an old broker)
    dp_rank: int | None = None  # DP-attention rank chosen by the router (absent: the engine picks)


@dataclass(slots=True)
class WorkerChunk:
    rid: int
    attempt: int
    seq: int
    data: bytes  # opaque to the broker


@dataclass(slots=True)
class WorkerFinal:
    rid: int
    attempt: int
    finish_reason: str
    usage: dict[str, Any]
    data: bytes


@dataclass(slots=True)
class WorkerError:
    rid: int
    attempt: int
    code: str
    message: str
    malformed: bool = False  # made by the decoder from a CHUNK/FINAL whose payload was unusable


@dataclass(slots=True)
class WorkerCancel:
    rid: int
    attempt: int


@dataclass(slots=True)
class Disconnect:
    reason: str


@dataclass(slots=True)
class Resync:
    dp_rank: int
    reason: str


def encode_ready(r: Ready) -> list[bytes]:
    body = {
        "worker_id": r.worker_id,
        "model": r.model,
        "role": r.role,
        "labels": r.labels,
        "block_size": r.block_size,
        "max_running_requests": r.max_running_requests,
        "max_total_num_tokens": r.max_total_num_tokens,
        "dp_size": r.dp_size,
        "epoch": r.epoch,
        "heartbeat_ms": r.heartbeat_ms,
    }
    if r.loras is not None:
        body["loras"] = list(r.loras)
    if r.tokenizer:
        body["tokenizer"] = r.tokenizer
    return [WORKER_HEADER, _B[Cmd.READY], pack(body)]


_EMPTY_MAP = pack({})


def encode_heartbeat(load: list[LoadStat] | None = None, loras: list[str] | None = None) -> list[bytes]:
    if load is None and loras is None:
        return [WORKER_HEADER, _B[Cmd.HEARTBEAT], _EMPTY_MAP]
    body: dict[str, Any] = {"load": [ls.to_wire() for ls in load]} if load is not None else {}
    if loras is not None:
        body["loras"] = list(loras)
    return [WORKER_HEADER, _B[Cmd.HEARTBEAT], pack(body)]


def encode_kv_events(dp_rank: int, epoch: int, seq: int, ts: float, events: list[Any]) -> list[bytes]:
    return [WORKER_HEADER, _B[Cmd.KV_EVENTS], pack({"dp_rank": dp_rank, "epoch": epoch, "seq": seq, "ts": ts, "events": events})]


def encode_request(rid: int, attempt: int, deadline_ms: int, client_rid: str, submit_raw: bytes, bootstrap: dict | None = None,
                   *, lora: str | None = None, dp_rank: int | None = None) -> list[bytes]:
    meta = {"rid": rid, "attempt": attempt, "deadline_ms": deadline_ms, "client_rid": client_rid, "bootstrap": bootstrap}
    if lora is not None:
        meta["lora"] = lora
    if dp_rank is not None:
        meta["dp_rank"] = dp_rank
    return [WORKER_HEADER, _B[Cmd.REQUEST], pack(meta), submit_raw]


def encode_worker_chunk(rid: int, attempt: int, seq: int, data: dict[str, Any]) -> list[bytes]:
    return [WORKER_HEADER, _B[Cmd.CHUNK], pack({"rid": rid, "attempt": attempt, "seq": seq}), pack(data)]


def encode_worker_final(rid: int, attempt: int, finish_reason: str, usage: dict[str, Any], data: dict[str, Any] | None = None) -> list[bytes]:
    meta = {"rid": rid, "attempt": attempt, "finish_reason": finish_reason, "usage": usage}
    return [WORKER_HEADER, _B[Cmd.FINAL], pack(meta), pack(data or {})]


def encode_worker_error(rid: int, attempt: int, code: ErrorCode | str, message: str) -> list[bytes]:
    return [WORKER_HEADER, _B[Cmd.ERROR], pack({"rid": rid, "attempt": attempt, "code": str(code), "message": message[:1024]})]


def encode_worker_cancel(rid: int, attempt: int) -> list[bytes]:
    return [WORKER_HEADER, _B[Cmd.CANCEL], pack({"rid": rid, "attempt": attempt})]


def encode_disconnect(reason: str) -> list[bytes]:
    return [WORKER_HEADER, _B[Cmd.DISCONNECT], pack({"reason": reason[:256]})]


def encode_resync(dp_rank: int, reason: str) -> list[bytes]:
    return [WORKER_HEADER, _B[Cmd.RESYNC], pack({"dp_rank": dp_rank, "reason": reason})]


def _loras(d: dict) -> list[str] | None:
    """The optional ``loras`` field of READY / HEARTBEAT (None when absent)."""
    v = d.get("loras")
    if v is None:
        return None
    if type(v) is not list or len(v) > MAX_LORAS or any(
            type(x) is not str or not 0 < len(x.encode()) <= MAX_LORA_NAME_BYTES for x in v):
        raise ProtocolError("bad_field", f"loras must be a list of at most {MAX_LORAS} names of 1..{MAX_LORA_NAME_BYTES} bytes")
    return v


def _parse_ready(d: dict) -> Ready:
    role = _str(d, "role")
    if role not in ROLES:
        raise ProtocolError("bad_field", f"role must be one of {ROLES}, got {role!r}")
    labels = _opt_map(d, "labels") or {}
    if len(labels) > MAX_LABELS or any(type(k) is not str or type(v) is not str for k, v in labels.items()):
        raise ProtocolError("bad_field", f"labels must be a map of at most {MAX_LABELS} str->str entries")
    if any(len(k.encode()) > MAX_LABEL_KEY_BYTES or len(v.encode()) > MAX_LABEL_VALUE_BYTES for k, v in labels.items()):
        raise ProtocolError("bad_field", f"label keys are at most {MAX_LABEL_KEY_BYTES} bytes, values {MAX_LABEL_VALUE_BYTES}")
    wid = _worker_id(d.get("worker_id"), "worker_id")
    return Ready(
        worker_id=wid,
        model=_str(d, "model", required=False, max_bytes=256),
        role=role,
        labels=labels,
        block_size=_int(d, "block_size", lo=1, hi=1 << 16),
        max_running_requests=_int(d, "max_running_requests", lo=1),
        max_total_num_tokens=_int(d, "max_total_num_tokens", lo=1),
        dp_size=_int(d, "dp_size", required=False, default=1, lo=1, hi=1024),
        epoch=_int(d, "epoch"),
        heartbeat_ms=_int(d, "heartbeat_ms", required=False, default=500, lo=1, hi=600_000),
        loras=_loras(d),
        tokenizer=_str(d, "tokenizer", required=False, max_bytes=MAX_TOKENIZER_ID_BYTES),
    )


def kv_block_count(events: list) -> int:
    """The blocks a list of wire KV events names: each event its ``block_hashes`` (map form) or
    position 1 (array form), and at least 1 (an ``AllBlocksCleared``, a malformed event).
    The unit of KV work: batches are bounded, sliced and budgeted by it. Never raises."""
    n = 0
    for ev in events:
        hs = ev.get("block_hashes") if type(ev) is dict else ev[1] if type(ev) is list and len(ev) > 1 else None
        n += max(1, len(hs)) if type(hs) is list else 1
    return n


def decode_worker(frames: list[bytes]):
    """Decode what a worker sent to the broker (identity stripped). Never raises.

    Returns one of Ready, Heartbeat, KvEventsMsg, WorkerChunk, WorkerFinal, WorkerError,
    Disconnect, or a ProtocolError.
    """
    try:
        cmd, body = _check_frames(frames, WORKER_HEADER, CLIENT_HEADER)
        n = len(frames)
        if cmd is Cmd.CHUNK or cmd is Cmd.FINAL:
            if n != 4:
                raise ProtocolError("bad_frame_count", f"{n} frames for {cmd.name}")
            d = _map(unpack(body))
            rid, attempt = _int(d, "rid"), _int(d, "attempt", lo=1)
            # The payload is forwarded to the client verbatim, so it must be what clients can
            # decode: a map (a FINAL may also carry none). A bad one fails that attempt as a
            # worker error (retried, counted against the worker) instead of reaching a client.
            data = frames[3]
            if data or cmd is Cmd.CHUNK:
                try:
                    _map(unpack(data))
                except ProtocolError as exc:
                    return WorkerError(rid, attempt, "worker_error", f"malformed {cmd.name} payload: {exc}", malformed=True)
            if cmd is Cmd.CHUNK:
                return WorkerChunk(rid, attempt, _int(d, "seq"), data)
            return WorkerFinal(rid, attempt, _str(d, "finish_reason", max_bytes=256), _usage(d), data)
        if n != 3:
            raise ProtocolError("bad_frame_count", f"{n} frames for {cmd.name}")
        if cmd is Cmd.KV_EVENTS and len(body) > MAX_KV_BATCH_BYTES:  # refused before unpacking it
            raise ProtocolError("kv_batch_too_large", f"KV_EVENTS body of {len(body)} bytes > {MAX_KV_BATCH_BYTES}")
        d = _map(unpack(body))
        if cmd is Cmd.HEARTBEAT:
            load = d.get("load")
            loras = _loras(d)
            if load is None:
                return Heartbeat(loras=loras)
            if type(load) is not list or len(load) > 1024:
                raise ProtocolError("bad_field", "load must be a list of LoadStat")
            return Heartbeat([LoadStat.from_wire(x) for x in load], loras)
        if cmd is Cmd.KV_EVENTS:
            events = d.get("events")
            if type(events) is not list:
                raise ProtocolError("bad_field", "events must be a list")
            blocks = kv_block_count(events)
            if blocks > MAX_KV_BATCH_BLOCKS:
                raise ProtocolError("kv_batch_too_large", f"KV_EVENTS of {blocks} blocks > {MAX_KV_BATCH_BLOCKS}")
            return KvEventsMsg(
                _int(d, "dp_rank", hi=1023), _int(d, "epoch"), _int(d, "seq"), _float(d, "ts", required=False), events, body, blocks
            )
        if cmd is Cmd.READY:
            return _parse_ready(d)
        if cmd is Cmd.ERROR:
            return WorkerError(_int(d, "rid"), _int(d, "attempt", lo=1), _str(d, "code", max_bytes=64), _str(d, "message", required=False))
        if cmd is Cmd.DISCONNECT:
            return Disconnect(_str(d, "reason", required=False, max_bytes=256))
        raise ProtocolError("unexpected_command", f"{cmd.name} is not a worker command")
    except ProtocolError as exc:
        return exc
    except Exception as exc:
        return ProtocolError("internal_decode_error", repr(exc))


def decode_broker_to_worker(frames: list[bytes]):
    """Decode what a broker sent to a worker. Never raises.

    Returns Request, WorkerCancel, Heartbeat, Disconnect, Resync, or a ProtocolError.
    """
    try:
        cmd, body = _check_frames(frames, WORKER_HEADER, CLIENT_HEADER)
        d = _map(unpack(body))
        if cmd is Cmd.REQUEST:
            if len(frames) != 4:
                raise ProtocolError("bad_frame_count", f"{len(frames)} frames for REQUEST")
            bootstrap = _opt_map(d, "bootstrap")
            return Request(
                _int(d, "rid"), _int(d, "attempt", lo=1), _int(d, "deadline_ms", lo=0), _str(d, "client_rid", required=False),
                bootstrap, _parse_submit(frames[3]), _str(d, "lora", required=False, max_bytes=MAX_LORA_NAME_BYTES) or None,
                dp_rank=None if d.get("dp_rank") is None else _int(d, "dp_rank", hi=1023),
            )
        if cmd is Cmd.CANCEL:
            return WorkerCancel(_int(d, "rid"), _int(d, "attempt", lo=1))
        if cmd is Cmd.HEARTBEAT:
            return Heartbeat()
        if cmd is Cmd.DISCONNECT:
            return Disconnect(_str(d, "reason", required=False))
        if cmd is Cmd.RESYNC:
            return Resync(_int(d, "dp_rank"), _str(d, "reason", required=False))
        raise ProtocolError("unexpected_command", f"{cmd.name} is not a broker-to-worker command")
    except ProtocolError as exc:
        return exc
    except Exception as exc:
        return ProtocolError("internal_decode_error", repr(exc))


# --------------------------------------------------------------------------- peer exchange


@dataclass(slots=True)
class PeerLoad:
    """One PEER_LOAD message: a broker's own absolute figures per worker (see the module docstring).

    ``workers`` holds ``(worker_id, inflight, prefill_tokens, sent_tokens)`` tuples; ``routes``
    ``(worker_id, pages, anchors)``: prompts routed since the sender's last message."""

    broker: str
    epoch: int
    seq: int
    full: bool
    workers: list[tuple[str, int, int, int]]
    full_ms: int = 1000
    routes: list[tuple[str, int, list[int]]] = field(default_factory=list)
    sessions: list[tuple[int, str, int]] = field(default_factory=list)  # (session hash, worker_id, age_ms)


def encode_peer_load(m: PeerLoad) -> list[bytes]:
    body = {"broker": m.broker, "epoch": m.epoch, "seq": m.seq, "full": m.full, "full_ms": m.full_ms,
            "workers": [list(w) for w in m.workers]}
    if m.routes:
        body["routes"] = [[w, n, list(a)] for w, n, a in m.routes]
    if m.sessions:
        body["sessions"] = [[h, w, a] for h, w, a in m.sessions]
    return [EXCHANGE_HEADER, _X_PEER_LOAD_B, pack(body)]


def decode_exchange(frames: list[bytes]) -> PeerLoad | ProtocolError:
    """Decode a peer exchange message. Never raises: returns a PeerLoad or a ProtocolError whose
    ``reason`` is the metric label (``bad_frame_count``, ``bad_header``, ``unknown_command``,
    ``too_large``, ``bad_msgpack``, ``bad_body``, ``bad_field``, ``too_many_workers``,
    ``duplicate_worker``, ``too_many_routes``, ``too_many_sessions``)."""
    try:
        if len(frames) != 3:
            raise ProtocolError("bad_frame_count", f"{len(frames)} frames")
        if frames[0] != EXCHANGE_HEADER:
            raise ProtocolError("bad_header", repr(bytes(frames[0][:16])))
        c = frames[1]
        if len(c) != 1:
            raise ProtocolError("bad_command", f"command frame of {len(c)} bytes")
        if c[0] != X_PEER_LOAD:
            raise ProtocolError("unknown_command", f"0x{c[0]:02x}")
        if len(frames[2]) > MAX_EXCHANGE_BYTES:
            raise ProtocolError("too_large", f"{len(frames[2])} bytes")
        d = _map(unpack(frames[2]))
        broker = _str(d, "broker", max_bytes=256)
        if not broker:
            raise ProtocolError("bad_field", "broker must be non-empty")
        epoch = _int(d, "epoch")
        seq = _int(d, "seq")
        full = _bool(d, "full", False)
        full_ms = _int(d, "full_ms", required=False, default=1000, lo=1, hi=600_000)
        ws = d.get("workers")
        if type(ws) is not list:
            raise ProtocolError("bad_field", "workers must be a list")
        if len(ws) > MAX_EXCHANGE_WORKERS:
            raise ProtocolError("too_many_workers", f"{len(ws)} workers (max {MAX_EXCHANGE_WORKERS})")
        out: list[tuple[str, int, int, int]] = []
        seen: set[str] = set()
        for w in ws:
            if type(w) is not list or len(w) != 4:
                raise ProtocolError("bad_field", "a worker entry is [worker_id, inflight, prefill_tokens, sent_tokens]")
            wid, n, pre, sent = w
            _worker_id(wid, "worker_id")
            if (type(n) is not int or not 0 <= n <= MAX_PEER_INFLIGHT or type(pre) is not int
                    or not 0 <= pre <= MAX_PEER_PREFILL_TOKENS or type(sent) is not int or not 0 <= sent <= MAX_PEER_SENT_TOKENS):
                raise ProtocolError("bad_field", f"figures of {wid[:64]!r} out of range")
            if wid in seen:
                raise ProtocolError("duplicate_worker", wid[:64])
            seen.add(wid)
            out.append((wid, n, pre, sent))
        routes: list[tuple[str, int, list[int]]] = []
        rs = d.get("routes")
        if rs is not None:
            if type(rs) is not list:
                raise ProtocolError("bad_field", "routes must be a list")
            if len(rs) > MAX_EXCHANGE_ROUTES:
                raise ProtocolError("too_many_routes", f"{len(rs)} routes (max {MAX_EXCHANGE_ROUTES})")
            for r in rs:
                if type(r) is not list or len(r) != 3:
                    raise ProtocolError("bad_field", "a route is [worker_id, pages, anchors]")
                wid, pages, anchors = r
                if type(pages) is not int or not 1 <= pages < 2**31:
                    raise ProtocolError("bad_field", "a route's pages must be an int 1..2**31-1")
                _worker_id(wid, "a route's worker_id")
                if (type(anchors) is not list or not 1 <= len(anchors) <= MAX_ROUTE_ANCHORS
                        or not all(type(k) is int and 0 <= k <= _U64 for k in anchors)):
                    raise ProtocolError("bad_field", f"a route's anchors must be 1..{MAX_ROUTE_ANCHORS} ints 0..2**64-1")
                routes.append((wid, pages, anchors))
        return PeerLoad(broker, epoch, seq, full, out, full_ms, routes, _exchange_sessions(d.get("sessions")))
    except ProtocolError as exc:
        return exc
    except Exception as exc:
        return ProtocolError("internal_decode_error", repr(exc))


def _exchange_sessions(ss: Any) -> list[tuple[int, str, int]]:
    """A PEER_LOAD's optional ``sessions``: at most MAX_EXCHANGE_SESSIONS ``[hash, worker_id, age_ms]``."""
    if ss is None:
        return []
    if type(ss) is not list:
        raise ProtocolError("bad_field", "sessions must be a list")
    if len(ss) > MAX_EXCHANGE_SESSIONS:
        raise ProtocolError("too_many_sessions", f"{len(ss)} sessions (max {MAX_EXCHANGE_SESSIONS})")
    out: list[tuple[int, str, int]] = []
    for e in ss:
        if type(e) is not list or len(e) != 3:
            raise ProtocolError("bad_field", "a session pin is [session_hash, worker_id, age_ms]")
        h, wid, age = e
        if type(h) is not int or not 0 <= h <= _U64:
            raise ProtocolError("bad_field", "a session pin's hash must be an int 0..2**64-1")
        if type(wid) is not str or not wid or len(wid) > 256 or len(wid.encode("utf-8", "surrogatepass")) > 256:
            raise ProtocolError("bad_field", "a session pin's worker_id must be a string of 1..256 bytes")
        if type(age) is not int or not 0 <= age <= MAX_SESSION_AGE_MS:
            raise ProtocolError("bad_field", f"a session pin's age_ms must be an int 0..{MAX_SESSION_AGE_MS}")
        out.append((h, wid, age))
    return out
