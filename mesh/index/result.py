"""Match results: per-worker matched prefix depths, computed lazily from the walk's levels.

A :class:`MatchResult` holds the levels of the event-fed index (holders are streams) and of the
speculative index (holders are worker ids), each shallowest first. Nothing per worker is computed
at match time; queries cost:

* ``get(w)`` / ``matched_blocks(w)``: O(streams of w * log levels) membership tests;
* ``top(k)``: O(k + size of the levels it opens) -- deepest first, ties by worker id;
* ``levels()`` / ``to_dict()``: O(matched holders).

Contract: the levels reference the index's live holder tables, so a result is valid only until the
next mutation of the index that produced it (store, remove, clear, eviction, speculate, expiry).
Accessors check the index's version and raise :class:`StaleMatchError` instead of answering from
changed tables; call :meth:`MatchResult.to_dict` to keep a detached copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from mesh.errors import MeshError
from mesh.index.tiers import path_tier_blocks

__all__ = ["WorkerMatch", "MatchResult", "StaleMatchError"]


class StaleMatchError(MeshError):
    """A MatchResult was read after the index it came from changed."""


class WorkerMatch(NamedTuple):
    """One worker's match: ``blocks`` matched of the query's ``query_blocks``.

    ``dp_rank`` is the rank holding the deepest event-fed match (None when the depth came from
    speculation); ``speculative`` is True when only the speculative index vouches for the depth.
    A named tuple: rankings build one per listed worker on every routing decision, and a tuple
    is several times cheaper to create than a frozen dataclass.
    """

    worker_id: str
    blocks: int
    dp_rank: int | None
    speculative: bool


#: Above this many holders, top(k) walks the id-sorted worker list instead of the level.
_BIG_LEVEL = 64


def _has_stream(h: Any, s: Any) -> bool:
    return s in h if type(h) is dict else h.stream is s


def _has_worker(h: Any, w: str) -> bool:
    return w in h if type(h) is dict else h.worker_id == w


def _deepest(depths: list[int], holders: list[Any], who: Any, has: Any) -> int:
    """Deepest level containing ``who`` (levels are nested, so membership is monotone)."""
    lo, hi = 0, len(depths)
    while lo < hi:
        mid = (lo + hi) >> 1
        if has(holders[mid], who):
            lo = mid + 1
        else:
            hi = mid
    return depths[lo - 1] if lo else 0


class MatchResult:
    """Per-worker prefix matches of one query (see module docstring for cost and validity)."""

    __slots__ = ("query_blocks", "_ed", "_eh", "_sd", "_sh", "_workers", "_guards", "_sorted_ev", "_sorted_sp",
                 "_keys", "_media")

    def __init__(
        self,
        query_blocks: int,
        event_levels: tuple[list[int], list[Any]],
        spec_levels: tuple[list[int], list[Any]],
        workers: Mapping[str, Any] | None,
        guards: tuple[Any, ...],
        sorted_event_workers: Callable[[], list[Any]] | None = None,
        sorted_spec_workers: Callable[[], list[str]] | None = None,
        *,
        keys: Sequence[int] | None = None,
        media: Any = None,
    ) -> None:
        self.query_blocks = query_blocks
        self._ed, self._eh = event_levels
        self._sd, self._sh = spec_levels
        self._workers = workers  # worker_id -> worker state with .streams {rank: stream}
        self._guards = tuple((g, g._version) for g in guards)
        # Id-sorted worker lists (cached by the index) let top(k) pick the first k members of a
        # huge tied level without scanning it.
        self._sorted_ev = sorted_event_workers
        self._sorted_sp = sorted_spec_workers
        self._keys = keys  # the query (tier_blocks walks the matched path)
        self._media = media  # the index's mesh.index.tiers.MediumBook

    # -- validity ---------------------------------------------------------------------------
    @property
    def valid(self) -> bool:
        """False once the producing index has changed (accessors would raise)."""
        return all(g._version == v for g, v in self._guards)

    def _check(self) -> None:
        for g, v in self._guards:
            if g._version != v:
                raise StaleMatchError("index changed since this match; consume results before mutating")

    # -- per worker -------------------------------------------------------------------------
    @property
    def best_blocks(self) -> int:
        """Deepest match over all workers (0 when none)."""
        self._check()
        return max(self._ed[-1] if self._ed else 0, self._sd[-1] if self._sd else 0)

    @property
    def empty(self) -> bool:
        return not self._ed and not self._sd

    def get(self, worker_id: str) -> WorkerMatch | None:
        """The worker's match, or None when it matches no block."""
        self._check()
        e_blocks, e_rank = 0, None
        if self._ed and self._workers is not None:
            w = self._workers.get(worker_id)
            if w is not None:
                for rank, s in w.streams.items():
                    d = _deepest(self._ed, self._eh, s, _has_stream)
                    if d > e_blocks or (d and d == e_blocks and rank < e_rank):
                        e_blocks, e_rank = d, rank
        s_blocks = _deepest(self._sd, self._sh, worker_id, _has_worker) if self._sd else 0
        if s_blocks > e_blocks:
            return WorkerMatch(worker_id, s_blocks, None, True)
        if e_blocks:
            return WorkerMatch(worker_id, e_blocks, e_rank, False)
        return None

    def rank_blocks(self, worker_id: str) -> dict[int, int]:
        """``{dp_rank: blocks}``: the event-fed match of each of the worker's ranks that holds
        part of the query (DP attention: every rank has its own cache; speculation has no rank)."""
        self._check()
        out: dict[int, int] = {}
        if self._ed and self._workers is not None:
            w = self._workers.get(worker_id)
            if w is not None:
                for rank, s in w.streams.items():
                    d = _deepest(self._ed, self._eh, s, _has_stream)
                    if d:
                        out[rank] = d
        return out

    def matched_blocks(self, worker_id: str) -> int:
        """Blocks of the query the worker holds as a prefix (max of event-fed and speculative)."""
        self._check()
        blocks = 0
        if self._ed and self._workers is not None:
            w = self._workers.get(worker_id)
            if w is not None:
                for s in w.streams.values():
                    d = _deepest(self._ed, self._eh, s, _has_stream)
                    if d > blocks:
                        blocks = d
        if self._sd:
            d = _deepest(self._sd, self._sh, worker_id, _has_worker)
            if d > blocks:
                blocks = d
        return blocks

    @property
    def tiered(self) -> bool:
        """Whether the index has seen a medium besides the device (else :meth:`lower_tier_blocks`
        is (0, 0) for everyone)."""
        return self._media is not None and self._media.tiered

    def tier_blocks(self, worker_id: str) -> tuple[int, int, int]:
        """The worker's matched blocks per tier level ``(device, host, store)``
        (:mod:`mesh.index.tiers`), each block at the fastest tier holding it; they sum to
        :meth:`matched_blocks`. Speculative depth beyond the events counts as device (the worker
        was just sent that prompt)."""
        host, store = self.lower_tier_blocks(worker_id)
        return self.matched_blocks(worker_id) - host - store, host, store

    def lower_tier_blocks(self, worker_id: str) -> tuple[int, int]:
        """``(host, store)``: how many of the worker's matched blocks are held only below the
        device (:meth:`tier_blocks`). O(1) while the index has seen no medium but the device,
        and for a worker with nothing off the device; else O(matched blocks)."""
        media = self._media
        if media is None or not media.tiered or not self._ed or self._workers is None or self._keys is None:
            return 0, 0
        self._check()
        w = self._workers.get(worker_id)
        if w is None:
            return 0, 0
        best = None  # (depth, -rank, stream): the deepest event-fed stream, lowest rank on ties
        for rank, s in w.streams.items():
            d = _deepest(self._ed, self._eh, s, _has_stream)
            if d and (best is None or (d, -rank) > best[:2]):
                best = (d, -rank, s)
        if best is None or not best[2].tiers:
            return 0, 0
        d, _, s = best
        key = self._keys[d - 1]
        h = self._eh[next(i for i, x in enumerate(self._ed) if x >= d)]
        run = h[s] if type(h) is dict else h
        keys = run.keys
        off = len(keys) - 1 if keys[-1] == key else keys.index(key)  # the run holds the key (holder table)
        _, host, store = path_tier_blocks(run, off, d, s.tiers, media)
        return host, store

    # -- rankings ---------------------------------------------------------------------------
    def _merged_levels(self) -> list[tuple[int, int, Any]]:
        # Deepest first; at equal depth event-fed levels (kind 0) before speculative ones so a
        # worker vouched for by both is reported as not speculative.
        lv = [(d, 0, h) for d, h in zip(self._ed, self._eh)]
        lv += [(d, 1, h) for d, h in zip(self._sd, self._sh)]
        lv.sort(key=lambda t: (-t[0], t[1]))
        return lv

    @staticmethod
    def _new_members(group: list[tuple[int, int, Any]], seen: set[str]) -> dict[str, tuple[int | None, bool]]:
        """``{worker_id: (dp_rank, speculative)}`` of the group's holders not in ``seen``."""
        cands: dict[str, tuple[int | None, bool]] = {}
        for _, kind, h in group:
            if kind == 0:
                streams = h.keys() if type(h) is dict else (h.stream,)
                for s in streams:
                    wid = s.worker_id
                    if wid in seen:
                        continue
                    prev = cands.get(wid)
                    if prev is None or (prev[0] is not None and s.rank < prev[0]):
                        cands[wid] = (s.rank, False)
            else:
                wids = h.keys() if type(h) is dict else (h.worker_id,)
                for wid in wids:
                    if wid not in seen and wid not in cands:
                        cands[wid] = (None, True)
        return cands

    def _iter_depth_groups(self) -> Iterator[tuple[int, dict[str, tuple[int | None, bool]]]]:
        """Yield ``(depth, {worker_id: (dp_rank, speculative)})`` of workers first seen at depth."""
        seen: set[str] = set()
        lv = self._merged_levels()
        i = 0
        while i < len(lv):
            depth = lv[i][0]
            j = i
            while j < len(lv) and lv[j][0] == depth:
                j += 1
            cands = self._new_members(lv[i:j], seen)
            i = j
            if cands:
                seen.update(cands)
                yield depth, cands

    def top(self, k: int) -> list[WorkerMatch]:
        """The ``k`` deepest-matching workers, deepest first, ties broken by worker id."""
        self._check()
        out: list[WorkerMatch] = []
        if k <= 0:
            return out
        seen: set[str] = set()
        lv = self._merged_levels()
        i = 0
        while i < len(lv) and len(out) < k:
            depth = lv[i][0]
            j = i
            while j < len(lv) and lv[j][0] == depth:
                j += 1
            need = k - len(out)
            group = lv[i:j]
            big = [t for t in group if type(t[2]) is dict and len(t[2]) > _BIG_LEVEL]
            if big:
                # Huge levels (a system prompt held by most of the fleet): take only the first
                # ``need`` new members of each in id order; small levels at the same depth are
                # enumerated. The union holds the true first ``need`` ids of the depth.
                cands: dict[str, tuple[int | None, bool]] = {}
                ok = True
                for _, kind, h in group:
                    if type(h) is dict and len(h) > _BIG_LEVEL:
                        picked = self._first_members(kind, h, seen, need)
                        if picked is None:
                            ok = False
                            break
                        for w, r, sp in picked:
                            prev = cands.get(w)
                            if prev is None or (prev[1] and not sp):  # event-fed beats speculative
                                cands[w] = (r, sp)
                    else:
                        for w, v in self._new_members([(depth, kind, h)], seen).items():
                            prev = cands.get(w)
                            if prev is None or (prev[1] and not v[1]):
                                cands[w] = v
                if ok:
                    ids = sorted(cands)[:need]
                    out.extend(WorkerMatch(w, depth, *cands[w]) for w in ids)
                    if len(out) >= k:
                        break
                    seen.update(cands)
                    i = j
                    continue
            cands = self._new_members(group, seen)
            # groups here hold at most a few small levels: a full sort beats a heap selection
            ids = sorted(cands)
            if len(ids) > need:
                del ids[need:]
            out.extend([WorkerMatch(w, depth, *cands[w]) for w in ids])
            seen.update(cands)
            i = j
        return out

    def _first_members(
        self, kind: int, h: dict, seen: set[str], need: int
    ) -> list[tuple[str, int | None, bool]] | None:
        """First ``need`` new members of one big level in worker-id order (None: no sorted list)."""
        picked: list[tuple[str, int | None, bool]] = []
        if kind == 0:
            if self._sorted_ev is None:
                return None
            for w in self._sorted_ev():
                if w.worker_id in seen:
                    continue
                best = None
                for rank, s in w.streams.items():
                    if s in h and (best is None or rank < best):
                        best = rank
                if best is not None:
                    picked.append((w.worker_id, best, False))
                    if len(picked) == need:
                        break
        else:
            if self._sorted_sp is None:
                return None
            for wid in self._sorted_sp():
                if wid in h and wid not in seen:
                    picked.append((wid, None, True))
                    if len(picked) == need:
                        break
        return picked

    def levels(self) -> Iterator[tuple[int, list[WorkerMatch]]]:
        """``(depth, workers matched exactly that deep)``, deepest first, workers sorted by id."""
        self._check()
        for depth, cands in self._iter_depth_groups():
            yield depth, [WorkerMatch(w, depth, *cands[w]) for w in sorted(cands)]

    def to_dict(self) -> dict[str, WorkerMatch]:
        """Detached copy: every matched worker's match (safe to keep across mutations)."""
        self._check()
        out: dict[str, WorkerMatch] = {}
        for depth, cands in self._iter_depth_groups():
            for w, (rank, spec) in cands.items():
                out[w] = WorkerMatch(w, depth, rank, spec)
        return out

    def __repr__(self) -> str:
        return (
            f"MatchResult(query_blocks={self.query_blocks}, event_levels={self._ed}, "
            f"spec_levels={self._sd})"
        )
