"""Speculative (insert-on-route) prefix index, also usable alone as the ``approx`` provider.

The router calls :meth:`ApproxIndex.insert` when it sends a prompt's keys to a worker: the worker
will hold that prefix as soon as it prefills it, long before its KV events say so. Entries expire
after a TTL. :class:`mesh.index.PrefixIndex` keeps one of these *beside* its event-fed tables (never
inside them, so a wrong guess cannot pollute the exact index) and closes a speculation once the real
Store of its last block arrives. With no events at all it is SGLang SMG's / Dynamo's approximate
tree: learned only from routing decisions, with a TTL and its own entry budget.

Model (what :meth:`match` is exact against): a *record* = (worker, key chain ``keys[0..n)``,
expiry). A worker holds key ``k`` while some live record of that worker contains it; a record is
live until ``now_s >= expires_s``, until it is closed, or until the budget evicts it. Inserting the
same chain (same last key) for the same worker again refreshes that record instead of adding one.

Representation: per key, the holder value is the record itself when a single record covers it,
else ``{worker_id: number of live records of that worker covering the key}``. Records are whole
prefix chains, so every worker's holdings stay prefix-closed and the shared walk
(:mod:`mesh.index.walk`) applies. Expiry is driven by the ``now_s`` passed in (no clock reads):
records are purged eagerly in expiry order before each insert/match, so tables only ever contain
live entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heappop, heappush
from itertools import repeat
from typing import Any

from mesh.index.result import MatchResult
from mesh.index.walk import walk_levels

__all__ = ["ApproxIndex", "SpeculativeIndex", "Record"]


@dataclass(slots=True, eq=False)
class Record:
    """One speculation: ``worker_id`` will hold ``keys`` until ``expires_s``."""

    worker_id: str
    keys: tuple[int, ...]
    expires_s: float
    alive: bool = True


class ApproxIndex:
    """TTL-bounded prefix index fed by routing decisions (see module docstring).

    ``max_entries`` bounds the distinct (key, worker) holdings; when exceeded the oldest-inserted
    records are evicted first (insertion order ~ last use, since a repeat refreshes a record).
    """

    def __init__(self, max_entries: int | None = 1_000_000, default_ttl_s: float = 5.0) -> None:
        if max_entries is not None and max_entries < 1:
            raise ValueError("max_entries must be >= 1 or None")
        if default_ttl_s <= 0:
            raise ValueError("default_ttl_s must be > 0")
        self.max_entries = max_entries
        self.default_ttl_s = default_ttl_s
        self._holders: dict[int, Record | dict[str, int]] = {}
        # Live records in insertion/refresh order (OrderedDict: O(1) pop from the front, where a
        # plain dict would rescan deleted slots).
        self._records: OrderedDict[Record, None] = OrderedDict()
        self._heap: list[tuple[float, int, Record]] = []  # (expires_s, tie, record); stale allowed
        self._tie = 0
        self._tails: dict[str, dict[int, Record]] = {}  # worker -> last key -> its live record
        self._sorted_ids: list[str] | None = None  # sorted(self._tails), rebuilt after changes
        self.entries = 0
        self._version = 0
        self.inserts = 0
        self.refreshes = 0
        self.expired = 0
        self.closed = 0
        self.evicted_entries = 0

    # -- mutation ---------------------------------------------------------------------------
    def insert(self, worker_id: str, keys: Sequence[int], now_s: float, ttl_s: float | None = None) -> bool:
        """Record that ``worker_id`` will hold the chain ``keys`` until ``now_s + ttl_s``.

        Returns True when a record was added or refreshed (False for an empty chain).
        """
        self.expire(now_s)
        if not keys:
            return False
        exp = now_s + (self.default_ttl_s if ttl_s is None else ttl_s)
        tails = self._tails.get(worker_id)
        if tails is None:
            tails = self._tails[worker_id] = {}
            self._sorted_ids = None
        last = keys[-1]
        rec = tails.get(last)
        self._version += 1
        if rec is not None:  # same worker, same chain: refresh in place
            if exp > rec.expires_s:
                rec.expires_s = exp
                self._push(rec)
            self._records.move_to_end(rec)
            self.refreshes += 1
            return True
        rec = Record(worker_id, tuple(keys), exp)
        tails[last] = rec
        self._records[rec] = None
        self._push(rec)
        self._hold(rec)
        self.inserts += 1
        self._enforce_budget()
        return True

    def expire(self, now_s: float) -> int:
        """Drop every record with ``expires_s <= now_s``; returns how many."""
        heap = self._heap
        n = 0
        while heap and heap[0][0] <= now_s:
            exp, _, rec = heappop(heap)
            if rec.alive and rec.expires_s == exp:  # else stale: refreshed or already gone
                self._drop(rec)
                n += 1
        self.expired += n
        return n

    def close(self, worker_id: str, stored_keys: Sequence[int]) -> int:
        """Close the worker's records whose last key is among ``stored_keys`` (now really stored)."""
        tails = self._tails.get(worker_id)
        if not tails:
            return 0
        hit = tails.keys() & stored_keys
        for k in hit:
            self._drop(tails[k])
        self.closed += len(hit)
        return len(hit)

    def remove_worker(self, worker_id: str) -> int:
        """Forget every speculation about ``worker_id``; returns records dropped."""
        tails = self._tails.pop(worker_id, None)
        if tails is None:
            return 0
        self._sorted_ids = None
        recs = list(tails.values())
        for rec in recs:
            self._drop(rec)
        return len(recs)

    # -- queries ----------------------------------------------------------------------------
    def levels(self, keys: Sequence[int], now_s: float) -> tuple[list[int], list[Any]]:
        """Expire, then walk ``keys``: the raw levels used by :class:`MatchResult`."""
        self.expire(now_s)
        if not self._holders:
            return [], []
        return walk_levels(self._holders.get, keys)

    def match(self, keys: Sequence[int], now_s: float) -> MatchResult:
        """Per-worker speculative prefix depth of ``keys`` (every match is flagged speculative)."""
        lv = self.levels(keys, now_s)
        return MatchResult(len(keys), ([], []), lv, None, (self,), None, self.sorted_worker_ids)

    def sorted_worker_ids(self) -> list[str]:
        """Workers with speculation state, sorted by id (cached; used by MatchResult.top)."""
        if self._sorted_ids is None:
            self._sorted_ids = sorted(self._tails)
        return self._sorted_ids

    def holds(self, worker_id: str, key: int) -> bool:
        v = self._holders.get(key)
        if v is None:
            return False
        return worker_id in v if type(v) is dict else v.worker_id == worker_id

    @property
    def records(self) -> int:
        return len(self._records)

    def stats(self) -> dict[str, int]:
        return {
            "records": len(self._records),
            "entries": self.entries,
            "unique_blocks": len(self._holders),
            "workers": len(self._tails),
            "inserts": self.inserts,
            "refreshes": self.refreshes,
            "expired": self.expired,
            "closed": self.closed,
            "evicted_entries": self.evicted_entries,
        }

    # -- internals --------------------------------------------------------------------------
    def _push(self, rec: Record) -> None:
        self._tie += 1
        heappush(self._heap, (rec.expires_s, self._tie, rec))
        # Refreshes leave stale heap items behind; rebuild when they dominate so the heap stays
        # O(live records) however often the same prompts are re-routed.
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._records):
            self._heap = [(r.expires_s, i, r) for i, r in enumerate(self._records)]
            self._heap.sort(key=lambda t: (t[0], t[1]))
            self._tie = len(self._heap)

    def _hold(self, rec: Record) -> None:
        h = self._holders
        keys = rec.keys
        w = rec.worker_id
        common = h.keys() & keys
        if not common:
            h.update(zip(keys, repeat(rec)))
            self.entries += len(keys)
            return
        added = 0
        for k in keys:
            if k not in common:
                h[k] = rec
                added += 1
                continue
            v = h[k]
            if type(v) is dict:
                c = v.get(w)
                if c:
                    v[w] = c + 1
                else:
                    v[w] = 1
                    added += 1
            elif v.worker_id == w:
                h[k] = {w: 2}
            else:
                h[k] = {v.worker_id: 1, w: 1}
                added += 1
        self.entries += added

    def _drop(self, rec: Record) -> None:
        """Remove a live record: its coverage, its tail registration, its FIFO slot."""
        rec.alive = False
        self._version += 1
        del self._records[rec]
        tails = self._tails.get(rec.worker_id)  # None while remove_worker drops its records
        if tails is not None and tails.get(rec.keys[-1]) is rec:
            del tails[rec.keys[-1]]
        h = self._holders
        w = rec.worker_id
        removed = 0
        for k in rec.keys:
            v = h.get(k)
            if v is rec:
                del h[k]
                removed += 1
            elif type(v) is dict:
                c = v.get(w, 0)
                if c > 1:
                    v[w] = c - 1
                elif c == 1:
                    del v[w]
                    removed += 1
                    if not v:
                        del h[k]
        self.entries -= removed

    def _enforce_budget(self) -> None:
        if self.max_entries is None:
            return
        while self.entries > self.max_entries and self._records:
            rec = next(iter(self._records))
            before = self.entries
            self._drop(rec)
            self.evicted_entries += before - self.entries


#: The same structure under the name used when it sits beside the event-fed index.
SpeculativeIndex = ApproxIndex
