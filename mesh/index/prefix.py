"""The exact, event-fed prefix index: which worker holds which prefix of a prompt.

Used unchanged by the broker (local provider), the gRPC indexer service and the simulator. Pure:
no sockets, no event loop, no clock reads (time comes in as ``now_s`` and is only used by the
speculative side).

Semantics (what ``match`` is exact against; ``tests/test_index_model.py`` holds the brute force):

* A *stream* ``(worker_id, dp_rank)`` holds a set of engine blocks, each with a content key.
* ``store(stream, parent_eh, ehs, keys)``: if ``parent_eh`` is None or held by the stream, every
  block of ``ehs`` not yet held is added (an already-held engine hash is kept as is and the chain
  continues below it). If the parent is not held the whole store is an *orphan*: counted, ignored.
* ``remove(stream, ehs)``: each held block is dropped together with every block stored below it in
  that stream (the engine can no longer reach them through the prefix). Unknown hashes are counted.
* ``clear(stream)``: the stream holds nothing.
* Tiers (:mod:`mesh.index.tiers`): a block is held on a set of mediums (the engine's ``medium``;
  None = the device). A store adds its medium to the blocks (held ones included); a removal
  *with* a medium takes only that medium away and removes (as above) only the blocks it leaves on
  no medium; a removal without a medium removes the blocks outright. Blocks held on the device
  alone cost nothing extra (``_Stream.tiers`` lists only the others).
* A worker holds content key ``k`` if any of its streams holds a block with key ``k``;
  ``match(keys)`` gives each worker the largest ``n`` with ``keys[0..n)`` all held.

``keys`` must be a chain of content keys (key ``i`` chained from key ``i-1``, as
``mesh.hashing.content_keys`` makes them); stores must be chained the same way (resolve the parent
key with :meth:`PrefixIndex.resolve_parent_key`). Cache namespaces (LoRA adapters, cache salts)
are chains with another root key (``mesh.namespaces``): the index needs nothing else to keep them
apart, since no key of one namespace's chain appears in another's. Under those rules every worker's holdings are
prefix-closed, so holder sets along a query are nested and the match walk is O(prompt blocks)
whatever the number of workers (:mod:`mesh.index.walk`).

Representation (memory matters: one entry per (block, stream)):

* ``_holders``: content key -> the single holding *run* when one stream holds it, else
  ``{stream: run}``. No per-block objects: the run object is shared by all its blocks.
* A *run* is a contiguous chain of one stream's blocks (two parallel lists: engine hashes and
  content keys) hanging below the last block of its parent run (a radix tree of runs). A store
  whose parent is the last block of a branch-free run extends it, so a request's successive
  stores form one run; a store branching from the middle of a run first splits it there.
* Per stream, ``ehmap``: engine hash -> run (position found by ``list.index`` in C; stores and
  removals mostly touch a run's end). Removal truncates a run and drops the branch runs below
  the cut, which is the cascade.
* Aliases (two engine blocks of one stream with the same content key: a cache namespace the
  events do not name, e.g. SGLang's ``extra_key`` or LoRA before SGLang 0.5.22) are rare; they are tracked per stream so the key stays held until the last goes.

Budget: ``max_entries`` bounds (block, stream) entries. Runs sit in an LRU order refreshed by
stores, by ``match`` (the deepest holders, at most ``match_touch_limit`` of them) and by
``touch``/``speculate`` (the routed worker); touching a run also refreshes its ancestors, so the
least recently used run is always a leaf and eviction trims it from its tail.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat
from typing import Any

from mesh.index.ops import ROOT_KEY, Clear, IndexOp, Remove, Store, Stream
from mesh.index.result import MatchResult
from mesh.index.sequence import BatchVerdict, SeqState, Verdict, check
from mesh.index.speculative import ApproxIndex
from mesh.index.tiers import DEVICE_BIT, MediumBook, drop_medium, mark_medium
from mesh.index.walk import walk_levels

__all__ = ["PrefixIndex", "KeyFn"]

#: ``key_fn(token_ids, block_size, parent_key) -> content keys`` (``mesh.hashing.content_keys``).
KeyFn = Callable[[Sequence[int], int, int], list[int]]

# Rough CPython costs used by the stats() estimate (bytes; measured in mesh.lab.bench.index_bench).
_INT_BYTES = 36  # a u64 int object
_LIST_SLOT = 8


@dataclass(slots=True, eq=False)
class _Worker:
    worker_id: str
    streams: dict[int, _Stream] = field(default_factory=dict)  # rank -> stream


@dataclass(slots=True, eq=False)
class _Stream:
    worker: _Worker
    rank: int
    worker_id: str  # == worker.worker_id, kept flat because rankings read it per holder
    ehmap: dict[int, _Run] = field(default_factory=dict)
    runs: dict[_Run, None] = field(default_factory=dict)  # ordered set of this stream's runs
    alias: dict[int, list[_Run]] = field(default_factory=dict)  # key -> extra runs holding it
    seq: SeqState = field(default_factory=SeqState)
    # engine hash -> medium mask (mesh.index.tiers) of the blocks not held on the device alone
    tiers: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Run:
    stream: _Stream
    ehs: list[int]
    keys: list[int]
    parent: _Run | None
    poff: int  # offset of the parent block in ``parent`` (-1 at the root)
    branches: list[_Run] | None = None
    alive: bool = True


@dataclass(slots=True)
class _Counters:
    stores: int = 0
    removes: int = 0
    clears: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0  # explicit removals and their cascades (not clears, not evictions)
    blocks_cleared: int = 0
    orphans: int = 0
    orphan_blocks: int = 0
    unknown_removes: int = 0
    evictions: int = 0  # entries evicted by the budget
    matches: int = 0
    batches_applied: int = 0
    duplicates: int = 0
    gaps: int = 0  # GAP verdicts
    gap_episodes: int = 0  # trusted -> untrusted transitions
    missed_batches: int = 0  # batches missing at the start of each episode
    new_epochs: int = 0
    stale_epochs: int = 0
    resets: int = 0
    demotions: int = 0  # a block removed from one medium while another still holds it
    tier_stores: int = 0  # a held block stored on one more medium
    tier_misses: int = 0  # a removal from a medium the block was not on (ignored)


class PrefixIndex:
    """Exact event-fed prefix index with speculative side index (see module docstring).

    ``max_entries`` (None = unbounded) caps (block, stream) entries; ``key_fn`` is needed only by
    :meth:`apply` for stores given as token ids; ``spec_max_entries``/``spec_ttl_s`` configure the
    speculative side index; ``match_touch_limit`` caps how many deepest holders a match refreshes.
    """

    def __init__(
        self,
        max_entries: int | None = None,
        *,
        key_fn: KeyFn | None = None,
        spec_max_entries: int | None = 1_000_000,
        spec_ttl_s: float = 5.0,
        match_touch_limit: int = 8,
    ) -> None:
        self.set_max_entries(max_entries)
        self.key_fn = key_fn
        self.match_touch_limit = match_touch_limit
        self._holders: dict[int, _Run | dict[_Stream, _Run]] = {}
        self._workers: dict[str, _Worker] = {}
        self._streams: dict[Stream, _Stream] = {}
        self._lru: OrderedDict[_Run, None] = OrderedDict()
        self._sorted_workers: list[_Worker] | None = None  # id order, rebuilt after membership changes
        self.entries = 0
        self._version = 0
        self.c = _Counters()
        self.spec = ApproxIndex(max_entries=spec_max_entries, default_ttl_s=spec_ttl_s)
        self.media = MediumBook()

    def set_max_entries(self, max_entries: int | None) -> None:
        """The entry budget (None = unbounded); a smaller one takes effect at the next store."""
        if max_entries is not None and max_entries < 1:
            raise ValueError("max_entries must be >= 1 or None")
        self.max_entries = max_entries
        # Evict a little below the cap so a full index does not evict on every store.
        self._evict_to = None if max_entries is None else max_entries - max_entries // 64

    # ------------------------------------------------------------------ streams and workers
    def _stream(self, stream: Stream) -> _Stream:
        s = self._streams.get(stream)
        if s is None:
            wid, rank = stream
            w = self._workers.get(wid)
            if w is None:
                w = self._workers[wid] = _Worker(wid)
                self._sorted_workers = None
            s = w.streams[rank] = _Stream(w, rank, w.worker_id)
            self._streams[stream] = s
        return s

    def remove_worker(self, worker_id: str) -> int:
        """Forget the worker entirely (every rank, its sequencing state, its speculations).

        Returns the number of event-fed entries dropped.
        """
        w = self._workers.pop(worker_id, None)
        n = 0
        if w is not None:
            self._sorted_workers = None
            for rank, s in w.streams.items():
                n += self._clear_stream(s)
                del self._streams[(worker_id, rank)]
            self._version += 1
        self.spec.remove_worker(worker_id)
        return n

    def workers(self) -> list[str]:
        return sorted(self._workers)

    def worker_entries(self, worker_id: str) -> int:
        """Blocks held by the worker over all ranks (its "tree size")."""
        w = self._workers.get(worker_id)
        return sum(len(s.ehmap) for s in w.streams.values()) if w else 0

    # ------------------------------------------------------------------ sequencing
    def begin_batch(self, stream: Stream, epoch: int, seq: int) -> BatchVerdict:
        """Classify one event batch of ``stream`` (see :mod:`mesh.index.sequence`).

        On NEW_EPOCH the stream's blocks are dropped here; the caller then applies the batch.
        """
        s = self._stream(stream)
        was_trusted = s.seq.trusted
        v = check(s.seq, epoch, seq)
        c = self.c
        verdict = v.verdict
        if verdict is Verdict.APPLY:
            c.batches_applied += 1
        elif verdict is Verdict.DUPLICATE:
            c.duplicates += 1
        elif verdict is Verdict.GAP:
            c.gaps += 1
            if was_trusted:
                c.gap_episodes += 1
                c.missed_batches += v.missed
        elif verdict is Verdict.NEW_EPOCH:
            c.new_epochs += 1
            c.batches_applied += 1
            self.clear(stream)
        else:
            c.stale_epochs += 1
        return v

    def reset_stream(self, stream: Stream, epoch: int, seq: int | None) -> int:
        """Resynchronise: drop the stream's blocks and trust it as of batch ``seq`` (inclusive).

        The caller then stores the snapshot's blocks; the next live batch ``seq + 1`` is APPLY.
        Returns the number of entries dropped.
        """
        n = self.clear(stream)
        self._stream(stream).seq.reset(epoch, seq)
        self.c.resets += 1
        return n

    def is_trusted(self, stream: Stream) -> bool:
        s = self._streams.get(stream)
        return True if s is None else s.seq.trusted

    def untrusted_streams(self) -> list[Stream]:
        return sorted((k for k, s in self._streams.items() if not s.seq.trusted))

    # ------------------------------------------------------------------ mutation
    def resolve_parent_key(self, stream: Stream, parent_engine_hash: int | None, root_key: int = ROOT_KEY) -> int | None:
        """Content key to chain a Store's keys from: ``root_key`` (its namespace's root, ROOT_KEY
        for plain) for a root store, the parent's key below a parent, None for an orphan.

        O(1) when the parent is the end of a run (the usual case), else one C-level list scan.
        """
        if parent_engine_hash is None:
            return root_key
        s = self._streams.get(stream)
        if s is None:
            return None
        run = s.ehmap.get(parent_engine_hash)
        if run is None:
            return None
        ehs = run.ehs
        if ehs[-1] == parent_engine_hash:
            return run.keys[-1]
        return run.keys[ehs.index(parent_engine_hash)]

    def store(
        self,
        stream: Stream,
        parent_engine_hash: int | None,
        engine_hashes: Sequence[int],
        content_keys: Sequence[int],
        medium: str | None = None,
    ) -> int:
        """Store a chain of blocks; returns how many became new entries (0 for an orphan).

        ``content_keys`` must be chained from ``resolve_parent_key(stream, parent_engine_hash)``.
        ``medium``: where the engine stored them (:mod:`mesh.index.tiers`; None = the device); a
        block already held gains that medium.
        """
        n = len(engine_hashes)
        if len(content_keys) != n:
            raise ValueError(f"{n} engine hashes but {len(content_keys)} content keys")
        c = self.c
        if parent_engine_hash is None:
            s = self._stream(stream)
            prun, poff = None, -1
        else:
            s = self._streams.get(stream)
            prun = s.ehmap.get(parent_engine_hash) if s is not None else None
            if prun is None:
                c.orphans += 1
                c.orphan_blocks += n
                return 0
            ehs = prun.ehs
            poff = len(ehs) - 1 if ehs[-1] == parent_engine_hash else ehs.index(parent_engine_hash)
        c.stores += 1
        if n == 0:
            return 0
        self._version += 1
        ehmap = s.ehmap
        bit = DEVICE_BIT if medium is None else self.media.bit(medium)
        tiered = bit != DEVICE_BIT or bool(s.tiers)
        prev = {e: s.tiers.get(e, DEVICE_BIT) for e in engine_hashes if e in ehmap} if tiered else None
        uniq = set(engine_hashes)
        if len(uniq) == n and ehmap.keys().isdisjoint(uniq):
            self._attach(s, prun, poff, engine_hashes, content_keys)
            added = n
        else:
            added = self._store_slow(s, prun, poff, engine_hashes, content_keys)
        c.blocks_stored += added
        if prev is not None:
            c.tier_stores += mark_medium(s.tiers, s.ehmap, engine_hashes, bit, prev)
        if self.spec._tails:
            self.spec.close(s.worker.worker_id, content_keys)
        if self.max_entries is not None and self.entries > self.max_entries:
            self._evict()
        return added

    def _store_slow(
        self, s: _Stream, prun: _Run | None, poff: int, ehs: Sequence[int], keys: Sequence[int]
    ) -> int:
        # Some blocks are already held (re-store) or repeat within the event: keep held blocks as
        # they are, continue the chain below them, attach maximal runs of new blocks.
        ehmap = s.ehmap
        n = len(ehs)
        added = 0
        i = 0
        while i < n:
            run = ehmap.get(ehs[i])
            if run is not None:
                prun = run
                e = ehs[i]
                poff = len(run.ehs) - 1 if run.ehs[-1] == e else run.ehs.index(e)
                i += 1
                continue
            j = i + 1
            seg = {ehs[i]}
            while j < n and ehs[j] not in ehmap and ehs[j] not in seg:
                seg.add(ehs[j])
                j += 1
            prun = self._attach(s, prun, poff, ehs[i:j], keys[i:j])
            poff = len(prun.ehs) - 1
            added += j - i
            i = j
        return added

    def _attach(
        self, s: _Stream, prun: _Run | None, poff: int, ehs: Sequence[int], keys: Sequence[int]
    ) -> _Run:
        """Add new blocks below position (prun, poff); returns the run now holding them."""
        if prun is not None and poff < len(prun.ehs) - 1:
            self._split(prun, poff + 1)  # branches only ever hang below a run's last block
        if prun is not None and prun.branches is None:
            run = prun  # continuation of a run: extend it in place
            run.ehs.extend(ehs)
            run.keys.extend(keys)
        else:
            run = _Run(s, list(ehs), list(keys), prun, poff)
            if prun is not None:
                if prun.branches is None:
                    prun.branches = [run]
                else:
                    prun.branches.append(run)
            s.runs[run] = None
            self._lru[run] = None
        s.ehmap.update(zip(ehs, repeat(run)))
        self._hold(s, run, keys)
        self.entries += len(ehs)
        self._touch(run)
        return run

    def _split(self, run: _Run, at: int) -> _Run:
        """Move blocks ``at..`` of ``run`` (and its branches) into a new child run; returns it.

        Keeps the radix shape (children only below a run's last block), so refreshing a branch
        refreshes exactly its prefix, not an unrelated continuation of the parent run. O(moved).
        """
        s = run.stream
        tail = _Run(s, run.ehs[at:], run.keys[at:], run, at - 1, run.branches)
        for b in run.branches or ():
            b.parent = tail
            b.poff -= at
        run.branches = [tail]
        del run.ehs[at:]
        del run.keys[at:]
        s.ehmap.update(zip(tail.ehs, repeat(tail)))
        h = self._holders
        alias = s.alias
        for k in tail.keys:
            v = h[k]
            if v is run:
                h[k] = tail
            elif type(v) is dict and v.get(s) is run:
                v[s] = tail
            if alias:
                lst = alias.get(k)
                if lst:
                    alias[k] = [tail if r is run else r for r in lst]
        s.runs[tail] = None
        # The tail was as recent as ``run``; it must sit before it (children before parents).
        self._lru[tail] = None
        self._touch(run)
        return tail

    def _hold(self, s: _Stream, run: _Run, keys: Sequence[int]) -> None:
        h = self._holders
        common = h.keys() & keys
        if not common:  # fast path: all new content (unique tails)
            h.update(zip(keys, repeat(run)))
            return
        for k in keys:
            if k not in common:
                h[k] = run
                continue
            v = h[k]
            if type(v) is dict:
                if s in v:
                    s.alias.setdefault(k, []).append(run)
                else:
                    v[s] = run
            elif v.stream is s:
                s.alias.setdefault(k, []).append(run)
            else:
                h[k] = {v.stream: v, s: run}

    def _unhold(self, s: _Stream, run: _Run, keys: Iterable[int]) -> None:
        h = self._holders
        alias = s.alias
        for k in keys:
            v = h[k]
            if alias and k in alias:
                self._unalias(s, run, k, v)
            elif v is run:
                del h[k]
            else:
                del v[s]
                if len(v) == 1:
                    for only in v.values():
                        h[k] = only

    def _unalias(self, s: _Stream, run: _Run, k: int, v: Any) -> None:
        lst = s.alias[k]
        if type(v) is dict:
            if v[s] is run:
                v[s] = lst.pop()
            else:
                lst.remove(run)
        elif v is run:
            self._holders[k] = lst.pop()
        else:
            lst.remove(run)
        if not lst:
            del s.alias[k]

    def _truncate(self, run: _Run, cut: int) -> int:
        """Drop blocks ``cut..`` of ``run`` and every branch below them; returns entries dropped."""
        n = 0
        if run.branches:
            keep: list[_Run] = []
            doomed: list[_Run] = []
            for b in run.branches:
                (doomed if b.poff >= cut else keep).append(b)
            run.branches = keep or None
            # Iterative, not recursive: branch depth is unbounded (one level per branching store).
            while doomed:
                b = doomed.pop()
                if b.branches:
                    doomed.extend(b.branches)
                n += self._drop_blocks(b, 0)
                self._forget_run(b)
        n += self._drop_blocks(run, cut)
        if cut == 0:
            self._forget_run(run)
            p = run.parent
            if p is not None and p.branches:
                p.branches.remove(run)
                if not p.branches:
                    p.branches = None
        return n

    def _drop_blocks(self, run: _Run, cut: int) -> int:
        """Remove blocks ``cut..`` of ``run`` from the tables (branches are the caller's business)."""
        ehs, keys = run.ehs, run.keys
        gone_ehs = ehs if cut == 0 else ehs[cut:]
        gone_keys = keys if cut == 0 else keys[cut:]
        s = run.stream
        ehmap = s.ehmap
        for e in gone_ehs:
            del ehmap[e]
        if s.tiers:
            tiers = s.tiers
            for e in gone_ehs:
                tiers.pop(e, None)
        self._unhold(s, run, gone_keys)
        n = len(gone_ehs)
        self.entries -= n
        if cut == 0:
            run.ehs = []
            run.keys = []
        else:
            del ehs[cut:]
            del keys[cut:]
        return n

    def _forget_run(self, run: _Run) -> None:
        run.alive = False
        run.branches = None
        del run.stream.runs[run]
        del self._lru[run]

    def remove(self, stream: Stream, engine_hashes: Iterable[int], medium: str | None = None) -> int:
        """Remove blocks (and everything below them in the stream); returns entries dropped.

        With ``medium`` only that medium's ownership goes: a block still held on another medium
        stays (a demotion, :mod:`mesh.index.tiers`), a block whose last medium went is removed."""
        c = self.c
        c.removes += 1
        s = self._streams.get(stream)
        if s is None:
            c.unknown_removes += sum(1 for _ in engine_hashes)
            return 0
        if medium is not None:
            bit = self.media.bit(medium)
            if bit != DEVICE_BIT or s.tiers:
                engine_hashes, demoted, missed = drop_medium(s.tiers, s.ehmap, engine_hashes, bit)
                c.demotions += demoted
                c.tier_misses += missed
                if demoted:
                    self._version += 1  # the tiers a match reports changed
        get = s.ehmap.get
        groups: dict[_Run, list[int]] = {}
        unknown = 0
        for e in engine_hashes:
            r = get(e)
            if r is None:
                unknown += 1
            else:
                g = groups.get(r)
                if g is None:
                    groups[r] = [e]
                else:
                    g.append(e)
        c.unknown_removes += unknown
        if not groups:
            return 0
        self._version += 1
        n = 0
        for r, g in groups.items():
            if r.alive:  # an earlier group's cascade may have dropped it already
                n += self._truncate(r, self._min_offset(r, g))
        c.blocks_removed += n
        return n

    @staticmethod
    def _min_offset(run: _Run, ehs_in_run: list[int]) -> int:
        ehs = run.ehs
        first = ehs_in_run[0]
        i0 = len(ehs) - 1 if ehs[-1] == first else ehs.index(first)
        if len(ehs_in_run) == 1:
            return i0
        # Engines list removals in prompt order, so the first one is usually the shallowest;
        # anything not in the tail after it needs its own lookup.
        want = set(ehs_in_run)
        for i, h in enumerate(ehs):
            if h in want:
                return min(i, i0)
        return i0

    def clear(self, stream: Stream) -> int:
        """Drop every block of ``stream``; returns entries dropped."""
        self.c.clears += 1
        s = self._streams.get(stream)
        if s is None or not s.ehmap:
            return 0
        self._version += 1
        n = self._clear_stream(s)
        self.c.blocks_cleared += n
        return n

    def _clear_stream(self, s: _Stream) -> int:
        h = self._holders
        lru = self._lru
        n = 0
        for run in s.runs:
            for k in run.keys:
                v = h.get(k)
                if v is None:
                    continue  # an alias of this stream already removed it
                if type(v) is dict:
                    if v.pop(s, None) is not None and len(v) == 1:
                        for only in v.values():
                            h[k] = only
                elif v.stream is s:
                    del h[k]
            n += len(run.keys)
            run.alive = False
            del lru[run]
        s.ehmap = {}
        s.runs = {}
        s.alias = {}
        s.tiers = {}
        self.entries -= n
        return n

    def apply(self, stream: Stream, ops: Iterable[IndexOp]) -> int:
        """Apply converted ops in order; returns entries added minus entries dropped."""
        delta = 0
        for op in ops:
            t = type(op)
            if t is Store:
                keys = op.content_keys
                if keys is None:
                    if self.key_fn is None or op.token_ids is None or op.block_size <= 0:
                        raise ValueError("Store without content_keys needs token_ids, block_size and key_fn")
                    pk = self.resolve_parent_key(stream, op.parent_engine_hash, op.root_key)
                    if pk is None:
                        self.c.orphans += 1
                        self.c.orphan_blocks += len(op.engine_hashes)
                        continue
                    if len(op.token_ids) != len(op.engine_hashes) * op.block_size:
                        raise ValueError("token_ids must hold block_size tokens per engine hash")
                    keys = self.key_fn(op.token_ids, op.block_size, pk)
                delta += self.store(stream, op.parent_engine_hash, op.engine_hashes, keys, op.medium)
            elif t is Remove:
                delta -= self.remove(stream, op.engine_hashes, op.medium)
            elif t is Clear:
                delta -= self.clear(stream)
            else:
                raise TypeError(f"not an index op: {op!r}")
        return delta

    # ------------------------------------------------------------------ LRU budget
    def _touch(self, run: _Run) -> None:
        # Refresh the run and then its ancestors, so a parent always sits after its children:
        # the front of the LRU order is then a leaf run.
        mte = self._lru.move_to_end
        r: _Run | None = run
        while r is not None:
            mte(r)
            r = r.parent

    def _evict(self) -> None:
        target = self._evict_to
        lru = self._lru
        n = 0
        while self.entries > target and lru:
            run = next(iter(lru))
            excess = self.entries - target
            cut = 0 if run.branches else max(0, len(run.keys) - excess)
            n += self._truncate(run, cut)
        self.c.evictions += n
        self._version += 1

    def touch(self, worker_id: str, keys: Sequence[int]) -> int:
        """Refresh the LRU position of the worker's blocks matching ``keys``; returns the depth."""
        w = self._workers.get(worker_id)
        if w is None or not keys:
            return 0
        h = self._holders
        streams = list(w.streams.values())

        def runs_at(k: int) -> list[_Run]:
            v = h.get(k)
            if v is None:
                return []
            if type(v) is dict:
                return [v[s] for s in streams if s in v]
            return [v] if v.stream.worker is w else []

        # Holdings are prefix-closed: binary search the deepest held key.
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi) >> 1
            if runs_at(keys[mid]):
                lo = mid + 1
            else:
                hi = mid
        if lo:
            for r in runs_at(keys[lo - 1]):
                self._touch(r)
        return lo

    # ------------------------------------------------------------------ queries
    def match(self, keys: Sequence[int], now_s: float | None = None, *, touch: bool = True) -> MatchResult:
        """Per-worker prefix match of the chain ``keys`` (O(len(keys)), not O(workers)).

        With ``now_s`` the speculative side index is consulted too (expired entries purged first)
        and each worker gets max(event depth, speculative depth). With ``touch`` the deepest
        holders' runs are refreshed in the LRU order (at most ``match_touch_limit``); that does
        not invalidate results. Read the result before the next mutation (see MatchResult).
        """
        self.c.matches += 1
        ev = walk_levels(self._holders.get, keys)
        if now_s is not None and self.spec._records:
            sp = self.spec.levels(keys, now_s)
        else:
            sp = ([], [])
        if touch and ev[0]:
            deepest = ev[1][-1]
            if type(deepest) is dict:
                for r in islice(deepest.values(), self.match_touch_limit):
                    self._touch(r)
            else:
                self._touch(deepest)
        return MatchResult(
            len(keys), ev, sp, self._workers, (self, self.spec), self._workers_by_id, self.spec.sorted_worker_ids,
            keys=keys, media=self.media,
        )

    def _workers_by_id(self) -> list[_Worker]:
        if self._sorted_workers is None:
            self._sorted_workers = sorted(self._workers.values(), key=lambda w: w.worker_id)
        return self._sorted_workers

    def holds(self, worker_id: str, key: int) -> bool:
        """True when the worker (any rank) holds content key ``key`` from events."""
        v = self._holders.get(key)
        if v is None:
            return False
        if type(v) is dict:
            return any(s.worker.worker_id == worker_id for s in v)
        return v.stream.worker.worker_id == worker_id

    def speculate(self, worker_id: str, keys: Sequence[int], now_s: float, ttl_s: float | None = None) -> bool:
        """Insert-on-route: ``worker_id`` was just sent ``keys``. Also refreshes its event blocks.

        Skipped (False) when events already show the worker holding the whole chain.
        """
        if not keys:
            return False
        if self.holds(worker_id, keys[-1]):  # prefix-closed: the whole chain is held
            self.touch(worker_id, keys)
            return False
        self.touch(worker_id, keys)
        return self.spec.insert(worker_id, keys, now_s, ttl_s)

    def stats(self) -> dict[str, Any]:
        """Counters and sizes (O(workers + streams))."""
        c = self.c
        unique = len(self._holders)
        out: dict[str, Any] = {
            "workers": len(self._workers),
            "streams": len(self._streams),
            "untrusted_streams": sum(1 for s in self._streams.values() if not s.seq.trusted),
            "entries": self.entries,
            "unique_blocks": unique,
            "runs": len(self._lru),
            "max_entries": self.max_entries,
            "bytes_estimate": self._bytes_estimate(),
            "tiered_entries": sum(len(s.tiers) for s in self._streams.values()),  # held off the device too/only
        }
        out.update({f: getattr(c, f) for f in c.__slots__})
        out["events_applied"] = c.stores + c.removes + c.clears
        out["spec"] = self.spec.stats()
        return out

    def _bytes_estimate(self) -> int:
        # sys.getsizeof of the big tables plus per-entry object costs; the benchmark measures the
        # real figure with tracemalloc (this only has to track it, cheaply).
        b = sys.getsizeof(self._holders) + len(self._holders) * _INT_BYTES
        for s in self._streams.values():
            b += sys.getsizeof(s.ehmap)
        b += self.entries * (_INT_BYTES + 2 * _LIST_SLOT)
        b += max(0, self.entries - len(self._holders)) * 40  # shared keys: {stream: run} members
        b += len(self._lru) * 400  # run objects, their lists and bookkeeping
        return b
