"""Recorded routing decisions (``mesh broker --record-decisions FILE``): the pure side.

:class:`DecisionRecorder` turns the broker core's routed requests into JSON lines an operator
replays with ``mesh sim --trace FILE`` (:mod:`mesh.lab.sim.recorded`). It does no I/O and reads
no clock: the core calls :meth:`~DecisionRecorder.decided` when a request's first attempt is
routed and :meth:`~DecisionRecorder.finished` when it ends, with ``now``; the lines it makes land
in :attr:`DecisionRecorder.out` (``bytes`` lines; :data:`ROTATE` marks "close this file, start
the next"), which the shell (``brokers/decision_log.py``) appends to disk off the event loop.

The file (format ``mesh-decisions`` version 1, documented in docs/simulator.md):

* line 1, the header: ``format``, ``version``, ``broker_id``, ``policy``, ``block_size``,
  ``fleet`` (``[{"id", "role"}]`` in the pool's order), ``file_index`` (files since the broker
  started), ``started_unix_s`` (when the shell knows it);
* a ``{"fleet": [...], "timestamp": ms}`` line whenever a decision names a worker the file has
  not listed yet;
* one record per routed request, when it ends (so in completion order), with the Mooncake
  trace's fields -- ``timestamp`` (arrival, ms since the file's start, float), ``input_length``,
  ``output_length`` (completion tokens; 0 when it failed), ``hash_ids`` (one int per
  ``block_size`` block of the prompt) -- plus ``block_size``, ``max_tokens``, ``session`` (a
  per-file pseudonym, only with session affinity on), the decision of its first attempt
  (``worker``, ``reason``, ``policy``, ``matched_blocks``, ``predicted_ttft_ms``,
  ``decode_worker`` for P/D), ``attempts``, ``outcome`` (``ok`` or the error code),
  ``ttft_ms``, ``e2e_ms`` (arrival to the last token, ``ok`` requests) and ``cached_tokens`` as
  observed.

Privacy: no text and no token ids. A full block's content key (the router's chained hash) becomes
a small int in first-seen order of the file, as Mooncake's traces number their blocks; a partial
last block (and blocks past the keys the broker hashed) gets a fresh id never used again. The map
is bounded (``max_ids``; reaching it starts a new file) and reset with every file, so two files
share no ids and cannot be joined on them. What the file does reveal: prompt and output lengths,
timing, which requests share which prefixes (reuse structure), worker names and the decisions.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Callable, Sequence

from mesh.broker_core.requests import Inflight
from mesh.routing.providers import request_keys
from mesh.routing.view import Decision

__all__ = ["DecisionRecorder", "FORMAT", "VERSION", "ROTATE"]

FORMAT = "mesh-decisions"
VERSION = 1
#: In :attr:`DecisionRecorder.out`: close the current file and start the next (the next line is its header).
ROTATE = None
_DEFAULT_BLOCK = 16


class DecisionRecorder:
    """Builds the recording's lines (see the module docstring). ``fleet()`` lists the pool's
    ``(worker_id, role)`` pairs; ``max_bytes`` bounds one file (a line that would cross it starts
    the next file; a single larger line still gets a file of its own); ``max_ids`` bounds the
    per-file id map; ``sessions``: record a per-file pseudonym of each request's session;
    ``wall_s``: the wall clock for the header's ``started_unix_s`` (the shell's; none in the simulator)."""

    def __init__(self, *, broker_id: str, policy: str, fleet: Callable[[], Sequence[tuple[str, str]]],
                 block_size: Callable[[], int | None] | None = None, max_bytes: int = 1 << 30,
                 max_ids: int = 1 << 20, sessions: bool = False, wall_s: Callable[[], float | None] | None = None,
                 origin_s: float | None = None) -> None:
        self.broker_id = broker_id
        self.policy = policy
        self.fleet = fleet
        self.block_size = block_size or (lambda: None)
        self.max_bytes = max_bytes
        self.max_ids = max_ids
        self.sessions = sessions
        self.wall_s = wall_s or (lambda: None)
        self.origin_s = origin_s  # the first file's time origin (default: the core's start)
        self.out: list[bytes | None] = []
        self.stats: Counter[str] = Counter()  # records, files, fleet_lines, ids_unmapped
        self.start_s = 0.0
        self.file_index = -1
        self._bytes = 0
        self._in_file = 0
        self._ids: dict[int, int] = {}
        self._next_id = 0
        self._sess: dict[str, int] = {}
        self._next_sess = 0
        self._known: set[str] = set()
        self._pending: dict[int, dict[str, Any]] = {}  # rid -> its first decision (bounded by in-flight)

    # ------------------------------------------------------------------ files
    def start(self, now: float) -> None:
        """Open the first file at ``now`` (the core's start; ``origin_s`` when given: the
        simulator records on its own virtual clock, so a replay's clock is the recording's)."""
        self._new_file(now if self.origin_s is None else self.origin_s)

    def _new_file(self, now: float) -> None:
        if self.file_index >= 0:
            self.out.append(ROTATE)
        self.file_index += 1
        self.stats["files"] += 1
        self.start_s = now
        self._bytes = 0
        self._in_file = 0  # records in the current file
        self._ids = {}
        self._next_id = 0
        self._sess = {}
        self._next_sess = 0
        fleet = list(self.fleet())
        self._known = {w for w, _ in fleet}
        wall = self.wall_s()
        self._emit({"format": FORMAT, "version": VERSION, "broker_id": self.broker_id, "policy": self.policy,
                    "block_size": self.block_size() or _DEFAULT_BLOCK, "fleet": [{"id": w, "role": r} for w, r in fleet],
                    "file_index": self.file_index, "started_unix_s": None if wall is None else round(wall, 3)})

    def _emit(self, obj: dict[str, Any]) -> None:
        line = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        self._bytes += len(line)
        self.out.append(line)

    # ------------------------------------------------------------------ the core's hooks
    def decided(self, inf: Inflight, decision: Decision, now: float) -> None:
        """Attempt ``inf.attempt`` of ``inf`` was routed by ``decision``: the first one is kept."""
        rec = self._pending.get(inf.rid)
        if rec is not None:
            rec["attempts"] = inf.attempt
            return
        d = decision.detail
        pred = d.get("predicted_ttft_ms")
        self._pending[inf.rid] = {
            "worker": decision.worker_id, "reason": decision.reason, "policy": d.get("policy") or self.policy,
            "matched_blocks": decision.matched_blocks,
            "predicted_ttft_ms": round(float(pred), 3) if isinstance(pred, (int, float)) else None,
            "decode_worker": decision.decode_worker_id, "attempts": inf.attempt,
        }

    def finished(self, inf: Inflight, outcome: str, usage: dict | None, now: float) -> None:
        """``inf`` ended (``outcome``: ``ok`` or an error code): its record, if it was routed."""
        dec = self._pending.pop(inf.rid, None)
        if dec is None:
            return  # refused before any worker was chosen: nothing reached the fleet
        req = inf.route_req
        bs = (req.block_size if req is not None and req.keys is not None else None) or self.block_size() or _DEFAULT_BLOCK
        keys = request_keys(req, bs) if req is not None else None
        n = req.prompt_tokens if req is not None else inf.submit.prompt_len
        if self._in_file and len(self._ids) + min(-(-n // bs), len(keys or ())) > self.max_ids:
            self._new_file(now)  # the id map would overflow: a new file, a new map
        line = self._record(inf, dec, outcome, usage, now, keys, n, bs)
        if self._in_file and self._bytes + len(line) > self.max_bytes:
            self._new_file(now)
            line = self._record(inf, dec, outcome, usage, now, keys, n, bs)  # the new file's ids and clock
        if dec["worker"] not in self._known or (dec["decode_worker"] and dec["decode_worker"] not in self._known):
            self._fleet_line(now)
        self._bytes += len(line)
        self.out.append(line)
        self._in_file += 1
        self.stats["records"] += 1

    def _record(self, inf: Inflight, dec: dict[str, Any], outcome: str, usage: dict | None, now: float,
                keys: Sequence[int] | None, n: int, bs: int) -> bytes:
        usage = usage if isinstance(usage, dict) else {}
        out_n = usage.get("completion_tokens") if outcome == "ok" else 0
        cached = usage.get("cached_tokens")
        first = inf.first_token_s or (now if outcome == "ok" else 0.0)
        rec: dict[str, Any] = {
            "timestamp": (inf.accepted_s - self.start_s) * 1000.0,
            "input_length": n,
            "output_length": out_n if type(out_n) is int and out_n >= 0 else 0,
            "hash_ids": self._hash_ids(keys, n, bs),
            "block_size": bs,
            "max_tokens": inf.submit.max_new_tokens,
        }
        if self.sessions and inf.submit.session:
            rec["session"] = self._pseudonym(inf.submit.session)
        rec.update((k, v) for k, v in dec.items() if v is not None or k == "predicted_ttft_ms")
        rec["outcome"] = outcome
        rec["ttft_ms"] = round((first - inf.accepted_s) * 1000.0, 3) if first else None
        rec["e2e_ms"] = round((now - inf.accepted_s) * 1000.0, 3) if outcome == "ok" else None
        rec["cached_tokens"] = cached if type(cached) is int else None
        return (json.dumps(rec, separators=(",", ":")) + "\n").encode()

    # ------------------------------------------------------------------ helpers
    def _fleet_line(self, now: float) -> None:
        fleet = list(self.fleet())
        self._known.update(w for w, _ in fleet)
        self.stats["fleet_lines"] += 1
        self._emit({"fleet": [{"id": w, "role": r} for w, r in fleet], "timestamp": (now - self.start_s) * 1000.0})

    def _hash_ids(self, keys: Sequence[int] | None, n: int, bs: int) -> list[int]:
        """One id per block of the prompt: full blocks by content (first-seen order in this
        file), the partial last block and blocks past the hashed keys fresh (never reused)."""
        blocks = -(-n // bs)
        full = min(n // bs, len(keys) if keys is not None else 0)
        ids = self._ids
        out = []
        for k in keys[:full] if keys is not None else ():
            i = ids.get(k)
            if i is None:
                if len(ids) < self.max_ids:
                    i = ids[k] = self._next_id
                else:  # the map is full (the next record starts a new file): an unmapped id
                    i = self._next_id
                    self.stats["ids_unmapped"] += 1
                self._next_id += 1
            out.append(i)
        for _ in range(blocks - len(out)):
            out.append(self._next_id)
            self._next_id += 1
        return out

    def _pseudonym(self, session: str) -> int:
        p = self._sess.get(session)
        if p is None:  # (past max_ids sessions: numbered, not kept)
            p = self._next_sess
            self._next_sess += 1
            if len(self._sess) < self.max_ids:
                self._sess[session] = p
        return p
