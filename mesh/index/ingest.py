"""KV ingest: the rules that turn a worker's KV event batches into prefix-index operations.

One implementation shared by the routers' event-fed provider
(:class:`mesh.routing.providers.LocalIndexProvider`) and the indexer service
(:class:`mesh.indexer.core.IndexerCore`):

* **sequencing** per ``(worker_id, dp_rank)`` stream (epochs, duplicates, gaps:
  :mod:`mesh.index.sequence`, through :meth:`PrefixIndex.begin_batch`);
* **resync**: a gap marks the stream untrusted and asks for a resync (once per
  ``resync_retry_s`` while one is pending; live batches keep applying meanwhile, so the index
  under-reports but never over-reports); a resync snapshot (a batch that starts with
  AllBlocksCleared) re-trusts it;
* **block size**: the fleet's block size is the one most registered workers have
  (:class:`BlockSizeVote`); a ``BlockStored`` of another size than its worker's is skipped and
  counted (``wrong_block_size``);
* **content keys**: stores are keyed from their token ids by the index's ``key_fn``; a namespaced
  root store (a root ``BlockStored`` naming a ``lora_name`` / ``cache_salt``) chains from its
  namespace's root key (:mod:`mesh.namespaces`);
* **tiers**: stores and removals carry the engine's ``medium`` (SGLang HiCache, vLLM offloading):
  the index keeps ownership per medium, so a removal from the GPU of a block the engine keeps in
  host memory is a demotion, not a removal (:mod:`mesh.index.tiers`);
* **slices by blocks**: a large batch is applied in slices of at most N blocks
  (:meth:`KvIngest.batch_slices`; an event longer than N is cut, parents chained), so the cost of
  one slice is bounded whatever the batch's shape (issue 32: slicing by events let a few huge
  events through in one go).

Pure code: no I/O, no clock (``now_s`` is passed in).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Generator, Sequence

from mesh import kv_events as KV
from mesh.protocol import kv_block_count
from mesh.hashing import ROOT_KEY
from mesh.index.ops import Clear, Remove, Store
from mesh.index.prefix import PrefixIndex
from mesh.index.sequence import Verdict
from mesh.namespaces import event_root_key

__all__ = ["BlockSizeVote", "CountingBlockSizeVote", "KvIngest"]


class BlockSizeVote:
    """The fleet's block size: the most common one among registered workers."""

    def __init__(self, default: int) -> None:
        self.default = default
        self.by_worker: dict[str, int] = {}
        self._value: int | None = None  # cached: read on every request, changed on membership

    def set(self, worker_id: str, bs: int) -> None:
        if self.by_worker.get(worker_id) != bs:
            self.by_worker[worker_id] = bs
            self._value = None

    def drop(self, worker_id: str) -> None:
        if self.by_worker.pop(worker_id, None) is not None:
            self._value = None

    @property
    def value(self) -> int:
        if self._value is None:
            self._value = Counter(self.by_worker.values()).most_common(1)[0][0] if self.by_worker else self.default
        return self._value


class CountingBlockSizeVote(BlockSizeVote):
    """The fleet's block size, kept with O(1) updates (the indexer's).

    The stock vote recounts every worker after each membership change, on the next batch: with
    tens of thousands of registered (ghost) workers every new worker cost a full recount.
    """

    def __init__(self, default: int) -> None:
        super().__init__(default)
        self.sizes: Counter[int] = Counter()

    def set(self, worker_id: str, bs: int) -> None:
        old = self.by_worker.get(worker_id)
        if old == bs:
            return
        if old is not None:
            self._dec(old)
        self.by_worker[worker_id] = bs
        self.sizes[bs] += 1
        self._value = None

    def drop(self, worker_id: str) -> None:
        old = self.by_worker.pop(worker_id, None)
        if old is not None:
            self._dec(old)
            self._value = None

    def _dec(self, bs: int) -> None:
        n = self.sizes[bs] - 1
        if n:
            self.sizes[bs] = n
        else:
            del self.sizes[bs]

    @property
    def value(self) -> int:
        if self._value is None:  # O(distinct block sizes)
            self._value = max(self.sizes.items(), key=lambda kv: kv[1])[0] if self.sizes else self.default
        return self._value


class KvIngest:
    """KV event batches of every worker's streams -> one :class:`PrefixIndex` (rules above).

    ``counters``: ``batches``, ``resyncs_applied``, ``gaps``, the non-apply verdicts,
    ``wrong_block_size``, ``unmatched_blocks`` and ``skipped_<reason>`` of :meth:`decode`.
    """

    def __init__(self, index: PrefixIndex, *, block_size: int = 16, vote: BlockSizeVote | None = None,
                 resync_retry_s: float = 5.0) -> None:
        self.index = index
        self.vote = vote if vote is not None else BlockSizeVote(block_size)
        self.counters: Counter[str] = Counter()
        self.resync_retry_s = resync_retry_s
        self._resync_pending: dict[tuple[str, int], float] = {}

    @property
    def block_size(self) -> int:
        """The fleet's block size (the vote's)."""
        return self.vote.value

    def worker_block_size(self, worker_id: str) -> int | None:
        """The block size ``worker_id`` registered with (None: not registered)."""
        return self.vote.by_worker.get(worker_id)

    def add_worker(self, worker_id: str, block_size: int) -> None:
        self.vote.set(worker_id, block_size)

    def remove_worker(self, worker_id: str) -> None:
        self.vote.drop(worker_id)
        self.index.remove_worker(worker_id)

    def apply_events(self, worker_id: str, dp_rank: int, epoch: int, seq: int, events: Sequence[KV.KvEvent], now_s: float) -> str | None:
        """Apply one ordered batch of a (worker, rank) stream. Returns a resync reason or None.

        Duplicates and stale epochs are ignored; a gap marks the stream untrusted and asks for a
        resync (once per ``resync_retry_s`` while one is pending; live batches keep applying
        meanwhile, so the index under-reports but never over-reports); a resync snapshot (a
        batch that starts with AllBlocksCleared) re-trusts it.
        """
        return self.apply_batch(worker_id, dp_rank, epoch, seq, events, now_s)[0]

    def apply_batch(self, worker_id: str, dp_rank: int, epoch: int, seq: int, events: Sequence[KV.KvEvent],
                    now_s: float) -> tuple[str | None, bool]:
        """:meth:`apply_events`, also saying whether the batch was applied (not a duplicate)."""
        stream = (worker_id, dp_rank)
        bs = self.vote.by_worker.get(worker_id, self.block_size)
        self.counters["batches"] += 1
        if events and type(events[0]) is KV.AllBlocksCleared and not self.index.is_trusted(stream):
            self.index.reset_stream(stream, epoch, seq)
            self._resync_pending.pop(stream, None)
            self.counters["resyncs_applied"] += 1
            self.apply(stream, events[1:], bs)
            return None, True
        v = self.index.begin_batch(stream, epoch, seq)
        if v.apply:  # begin_batch already advanced the stream: the batch must be applied
            self.apply(stream, events, bs)
        else:
            self.counters[str(v.verdict.value)] += 1
        if v.verdict is Verdict.GAP:
            self.counters["gaps"] += 1
        if not self.index.is_trusted(stream):
            last = self._resync_pending.get(stream)
            if last is None or now_s - last >= self.resync_retry_s:
                self._resync_pending[stream] = now_s
                return "gap", v.apply
        return None, v.apply

    def apply(self, stream, events: Sequence[KV.KvEvent], bs: int) -> None:
        """Apply events of an admitted batch (no sequencing: :meth:`apply_batch` decided), e.g.
        the later slices of a big batch."""
        ops: list[Any] = []
        for ev in events:
            t = type(ev)
            if t is KV.BlockStored:
                if ev.block_size != bs:
                    self.counters["wrong_block_size"] += 1
                    continue
                if ev.unmatched_blocks:
                    self.counters["unmatched_blocks"] += ev.unmatched_blocks
                root = ROOT_KEY
                if ev.parent_block_hash is None and (ev.lora_name is not None or ev.cache_salt is not None):
                    root = event_root_key(ev.lora_name, ev.cache_salt)  # a namespaced root store
                ops.append(Store(ev.block_hashes, ev.parent_block_hash, token_ids=ev.token_ids, block_size=bs, root_key=root,
                                 medium=ev.medium))
            elif t is KV.BlockRemoved:
                ops.append(Remove(ev.block_hashes, ev.medium))
            elif t is KV.AllBlocksCleared:
                ops.append(Clear())
        if ops:
            self.index.apply(stream, ops)

    def batch_slices(self, worker_id: str, dp_rank: int, epoch: int, seq: int, raw: list, now_s: float,
                     step_blocks: int) -> Generator[int, None, str | None]:
        """:meth:`apply_batch` for a wire batch ``raw``, in slices of at most ``step_blocks``
        blocks: a generator whose every step applies one slice and yields its blocks; it
        returns the resync reason (or None). The first slice decides, as for a whole batch,
        whether the batch is applied (sequence check); matches in between see a partly applied
        batch, which only under-reports. A worker that left meanwhile ends it (its entries are
        gone: they are not re-added)."""
        stream = (worker_id, dp_rank)
        why, first = None, True
        for piece in self._pieces(raw, step_blocks):
            if first:
                if self.worker_block_size(worker_id) is None:
                    break  # it left while the batch waited: no stream for a worker that is gone
                first = False
                why, applied = self.apply_batch(worker_id, dp_rank, epoch, seq, piece, now_s)
                if not applied:
                    break
            else:
                bs = self.worker_block_size(worker_id)
                if bs is None:
                    break
                self.apply(stream, piece, bs)
            yield KV.event_blocks(piece)
        return why

    def _pieces(self, raw: list, step_blocks: int):
        """Decoded events of ``raw`` in lists of at most ``step_blocks`` blocks (at least one
        list: an empty batch is still sequenced). Each group of wire events is decoded only
        when its turn comes."""
        if not raw:
            yield []
            return
        group: list = []
        n = 0
        for ev in raw:
            k = kv_block_count([ev])
            if group and n + k > step_blocks:
                yield from KV.split_events(self.decode(group), 1 << 62, 1 << 62, max_blocks=step_blocks)
                group, n = [], 0
            group.append(ev)
            n += k
        yield from KV.split_events(self.decode(group), 1 << 62, 1 << 62, max_blocks=step_blocks) or [[]]

    def decode(self, raw: list) -> list[KV.KvEvent]:
        """Wire events -> events (tolerantly: what cannot be decoded is counted as ``skipped_<reason>``)."""
        events, skipped = KV.decode_events(raw)
        for reason, n in skipped.items():
            self.counters[f"skipped_{reason}"] += n
        return events

    def stats(self) -> dict[str, Any]:
        """The index's stats and the ingest counters as ``provider_<name>`` (the names brokers and
        the indexer report)."""
        return {**self.index.stats(), **{f"provider_{k}": v for k, v in self.counters.items()}}
