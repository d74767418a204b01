"""The indexer's state record: what a checkpoint holds, as plain msgpack (no pickle).

A checkpoint of the Valkey backend (:mod:`mesh.indexer.shared`) is read by every replica that
starts, so it is a *data* format: a msgpack map of lists, ints, floats, strings and booleans,
versioned by :data:`STATE_VERSION`, decoded with type checks on every field. Nothing in it names a
class or runs code when read (a pickle did: whoever could write the checkpoint could run code in
every replica). Decoding never raises anything but :class:`~mesh.errors.CheckpointError`, and it
fills fresh objects the caller swaps in only once the whole record was read: a bad record leaves
the running state as it was.

The record holds what verdicts depend on (not counters, not latencies, not LRU order):

* ``workers``: ``[worker_id, first_seen, last_seen, block_size|None, owner, owner_seen, ranks, active]``;
* ``streams``: per stream ``[worker_id, rank, epoch, last_seq|None, max_seen, trusted, runs, tiers]``
  where ``runs`` are ``[parent engine hash|None, engine hashes, content keys]`` parents first and
  ``tiers`` ``[engine hash, medium mask]`` (masks use the bits of ``media``, the medium names in
  the order they got their bits);
* ``known``, ``asked_at``, ``ghosts``, ``ghost_streams``, ``expected``, ``uncovered``: the
  service's per-stream tables as lists.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from mesh.errors import CheckpointError

__all__ = ["STATE_VERSION", "WorkerRec", "encode_state", "decode_state"]

#: Bumped whenever the record's shape changes; a record of another version is refused (the
#: replica then rebuilds from the log). 4: msgpack record (1-3 were pickles, never read again).
STATE_VERSION = 4


@dataclass(slots=True, eq=False)
class WorkerRec:
    """What the service knows about one worker besides its index entries."""

    first_seen: float
    last_seen: float
    block_size: int | None = None  # None: neither registered nor seen storing a block
    owner: str = ""  # "" = unowned (auto-registered from events, or registered anonymously)
    owner_seen: float = 0.0  # last registration/forward of this worker by its owner
    ranks: set[int] = field(default_factory=set)  # streams admitted (counted against the bounds)
    active: bool = False  # some batch got a block into the index: not a ghost


def encode_state(parts: dict[str, Any]) -> bytes:
    """The record of an :class:`~mesh.indexer.core.IndexerCore`'s ``_STATE`` attributes."""
    index, cov = parts["index"], parts["coverage"]
    streams, media = index.export_streams()
    rec = {
        "state_version": STATE_VERSION,
        "workers": [[w, r.first_seen, r.last_seen, r.block_size, r.owner, r.owner_seen, sorted(r.ranks), r.active]
                    for w, r in parts["_w"].items()],
        "streams": streams,
        "media": media,
        "known": [list(s) for s in parts["_known"]],
        "asked_at": [[w, r, t] for (w, r), t in parts["_asked_at"].items()],
        "ghosts": [[w, t] for w, t in parts["_ghosts"].items()],
        "ghost_streams": [[w, r, t] for (w, r), t in parts["_ghost_streams"].items()],
        "expected": [[w, sorted(ranks)] for w, ranks in cov.expected.items()],
        "uncovered": [list(s) for s in cov.uncovered],
    }
    return msgpack.packb(rec, use_bin_type=True)


def decode_state(blob: bytes, fresh: dict[str, Any]) -> dict[str, Any]:
    """Fill ``fresh`` (a new core's ``_STATE`` attributes) from a record; returns the attributes
    to set. :class:`CheckpointError` for anything but a well-formed record of this version."""
    try:
        rec = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as exc:  # not msgpack at all (an old pickle, garbage)
        raise CheckpointError(f"unreadable checkpoint ({type(exc).__name__}: {str(exc)[:120]})") from None
    version = rec.get("state_version") if isinstance(rec, dict) else None
    if version != STATE_VERSION:
        raise CheckpointError(f"checkpoint version {version!r}, this indexer reads {STATE_VERSION}")
    try:
        return _fill(rec, fresh)
    except CheckpointError:
        raise
    except Exception as exc:  # a field of the wrong type or shape
        raise CheckpointError(f"malformed checkpoint record ({type(exc).__name__}: {str(exc)[:120]})") from None


def _stream(v: Any) -> tuple[str, int]:
    w, r = v
    return _str(w), _int(r)


def _str(v: Any) -> str:
    if type(v) is not str:
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _int(v: Any) -> int:
    if type(v) is not int:
        raise TypeError(f"expected an int, got {type(v).__name__}")
    return v


def _num(v: Any) -> float:
    if type(v) not in (int, float):
        raise TypeError(f"expected a number, got {type(v).__name__}")
    return float(v)


def _fill(rec: dict[str, Any], fresh: dict[str, Any]) -> dict[str, Any]:
    out = dict(fresh)
    ws: dict[str, WorkerRec] = {}
    n_streams = ranked = 0
    for w, first, last, bs, owner, owner_seen, ranks, active in rec["workers"]:
        r = WorkerRec(_num(first), _num(last), None if bs is None else _int(bs), _str(owner), _num(owner_seen),
                      {_int(x) for x in ranks}, bool(active))
        ws[_str(w)] = r
        n_streams += len(r.ranks)
        ranked += sum(1 for x in r.ranks if x)
        if r.block_size is not None:
            fresh["ingest"].add_worker(w, r.block_size)
    out["_w"], out["_n_streams"], out["_ranked_streams"] = ws, n_streams, ranked
    fresh["index"].import_streams(rec["streams"], [_str(m) for m in rec["media"]])
    out["_known"] = {_stream(s) for s in rec["known"]}
    out["_asked_at"] = {(_str(w), _int(r)): _num(t) for w, r, t in rec["asked_at"]}
    out["_ghosts"] = {_str(w): _num(t) for w, t in rec["ghosts"]}
    out["_ghost_streams"] = {(_str(w), _int(r)): _num(t) for w, r, t in rec["ghost_streams"]}
    cov = fresh["coverage"]
    for w, ranks in rec["expected"]:
        cov.expected[_str(w)] = {_int(x) for x in ranks}
    cov.n_expected = sum(len(v) for v in cov.expected.values())
    cov.uncovered = {_stream(s) for s in rec["uncovered"]}
    return out
