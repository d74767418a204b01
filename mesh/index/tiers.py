"""KV cache tiers: where an engine says a block lives (its ``medium``), as the index keeps it.

Engines with a tiered KV cache publish a ``medium`` on every ``BlockStored`` / ``BlockRemoved``
(the spellings of their own code):

* SGLang (``sglang.srt.disaggregation.kv_events.StorageMedium``): ``GPU`` (L1, device HBM),
  ``CPU_PINNED`` (L2, HiCache host memory), ``DISK`` (L3), ``EXTERNAL`` (L4, a shared or remote
  pool such as Mooncake). A demotion is a ``BlockStored`` on ``CPU_PINNED`` (the host backup)
  followed by a ``BlockRemoved`` on ``GPU``; the host copy's eviction is a ``BlockRemoved`` on
  ``CPU_PINNED``.
* vLLM (``vllm.distributed.kv_events``: ``MEDIUM_GPU`` / ``MEDIUM_CPU`` / ``MEDIUM_STORAGE``):
  ``GPU``, ``CPU`` (the offloading connector's host tier), ``STORAGE`` (file system / object
  store tiers). Some connectors spell it in lower case (``cpu``).

The index keeps ownership **per medium** (one bit per medium name a worker used): a store adds its
medium to the block, a removal takes it away, and only the removal of a block's last medium
removes the block (:meth:`mesh.index.PrefixIndex.remove`). A missing medium is the device tier
(older engines publish none), and a removal without a medium removes the block from every tier.

Each medium falls into one of three *tier levels* that routing weighs (``cache_aware``'s
``tier_weights``, Dynamo's 1 / 0.75 / 0.25): :data:`DEVICE`, :data:`HOST`, :data:`STORE`.
Unknown spellings count as :data:`STORE` (the cautious guess: a hit there is worth least).

Pure code: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["DEVICE", "HOST", "STORE", "LEVELS", "DEVICE_BIT", "tier_level", "MediumBook", "path_tier_blocks",
           "mark_medium", "drop_medium"]

DEVICE, HOST, STORE = 0, 1, 2
#: Level names, index = level (metrics, docs).
LEVELS = ("device", "host", "store")
#: The device medium's bit: a block held only on the device has no entry in a stream's tier map.
DEVICE_BIT = 1

_DEVICE_NAMES = frozenset({"GPU", "HBM", "DEVICE", "CUDA", "NPU", "XPU"})
_HOST_NAMES = frozenset({"CPU", "CPU_PINNED", "HOST", "DRAM", "CPU_TIER", "PINNED"})
#: At most this many distinct medium names get their own bit; later ones share one store bit
#: (a worker cannot grow the table without bound by inventing names).
MAX_MEDIUMS = 16


def tier_level(medium: str | None) -> int:
    """The tier level of a medium name (None: the device)."""
    if medium is None:
        return DEVICE
    m = medium.upper()
    if m in _DEVICE_NAMES:
        return DEVICE
    if m in _HOST_NAMES:
        return HOST
    return STORE


class MediumBook:
    """Medium name -> ownership bit, bit -> tier level (one per index)."""

    __slots__ = ("_bits", "_level_of_bit", "_overflow_bit")

    def __init__(self) -> None:
        self._bits: dict[str, int] = {}
        self._level_of_bit: dict[int, int] = {DEVICE_BIT: DEVICE}
        self._overflow_bit = 0

    def bit(self, medium: str | None) -> int:
        """The ownership bit of ``medium`` (every device spelling shares :data:`DEVICE_BIT`)."""
        if medium is None:
            return DEVICE_BIT
        b = self._bits.get(medium)
        if b is not None:
            return b
        level = tier_level(medium)
        if level == DEVICE:
            b = DEVICE_BIT
        elif len(self._level_of_bit) >= MAX_MEDIUMS:
            if not self._overflow_bit:
                self._overflow_bit = 1 << MAX_MEDIUMS
                self._level_of_bit[self._overflow_bit] = STORE
            return self._overflow_bit  # not remembered: a peer's endless new names cost no memory
        else:
            b = 1 << len(self._level_of_bit)
            self._level_of_bit[b] = level
        self._bits[medium] = b
        return b

    @property
    def tiered(self) -> bool:
        """Whether any medium but the device was seen (else every block is on the device)."""
        return len(self._level_of_bit) > 1

    def best_level(self, mask: int) -> int:
        """The fastest tier level among the mediums of ``mask`` (non-zero)."""
        if mask & DEVICE_BIT:
            return DEVICE
        best = STORE
        for b, level in self._level_of_bit.items():
            if mask & b and level < best:
                best = level
        return best

    def mediums(self) -> dict[str, int]:
        """Medium name -> tier level of every medium seen (stats)."""
        return {m: self._level_of_bit[b] for m, b in self._bits.items()}


def path_tier_blocks(run: Any, off: int, depth: int, tiers: Mapping[int, int], book: MediumBook) -> tuple[int, int, int]:
    """Blocks per tier level (device, host, store) on the path of ``depth`` blocks that ends at
    position ``off`` of ``run`` (a :class:`mesh.index.prefix` run: ``ehs``, ``parent``, ``poff``),
    each block counted at the fastest tier holding it. ``tiers``: the stream's engine hash ->
    medium mask of blocks not held on the device alone. O(depth)."""
    counts = [0, 0, 0]
    left = depth
    r, end = run, off + 1
    while r is not None and left > 0:
        ehs = r.ehs
        start = end - left if end - left > 0 else 0
        for i in range(start, end):
            m = tiers.get(ehs[i])
            counts[DEVICE if m is None else book.best_level(m)] += 1
        left -= end - start
        end = r.poff + 1
        r = r.parent
    counts[DEVICE] += left  # not expected (the path is depth blocks long): count as device
    return counts[0], counts[1], counts[2]


# ---------------------------------------------------------------------- one stream's medium masks
# ``tiers``: engine hash -> medium mask of the stream's blocks not held on the device alone;
# ``held``: the stream's held engine hashes (its ehmap).


def mark_medium(tiers: dict[int, int], held: Mapping[int, Any], ehs: Sequence[int], bit: int,
                prev: Mapping[int, int]) -> int:
    """Record that ``ehs`` (just stored) are held on medium ``bit`` besides the masks ``prev``
    they had before the store (absent: new blocks). Returns how many held blocks gained a medium."""
    gained = 0
    for e in ehs:
        if e not in held:
            continue
        p = prev.get(e)
        m = bit if p is None else p | bit
        if p is not None and m != p:
            gained += 1
        if m == DEVICE_BIT:
            tiers.pop(e, None)
        else:
            tiers[e] = m
    return gained


def drop_medium(tiers: dict[int, int], held: Mapping[int, Any], ehs: Iterable[int], bit: int
                ) -> tuple[list[int], int, int]:
    """Take medium ``bit`` off the held blocks ``ehs``. Returns (the hashes to remove outright:
    their last medium went, or they are unknown; demotions: blocks left on another medium;
    misses: blocks not on that medium, left alone)."""
    gone: list[int] = []
    demoted = missed = 0
    for e in ehs:
        if e not in held:
            gone.append(e)
            continue
        m = tiers.get(e, DEVICE_BIT)
        if not m & bit:
            missed += 1
            continue
        m &= ~bit
        if not m:
            gone.append(e)
            continue
        demoted += 1
        if m == DEVICE_BIT:
            del tiers[e]
        else:
            tiers[e] = m
    return gone, demoted, missed
