"""The shared match walk: holder levels along a chain of content keys, in O(levels x log(prompt)).

Both indexes keep, per content key, a *holder* value: one object when exactly one holder owns the
key (an object that names its holder) and a dict ``{holder: ...}`` when two or more
do (the speculative index may also keep a one-element dict). Both keep every holder's keys
*prefix-closed*: a holder of key ``k`` also holds key ``k-1`` of the same chain. So along a query
chain the holder sets are nested, and the set at depth ``d`` is the holder value of ``keys[d-1]``.
A *level* is a depth where the set shrinks (or the walk ends); holders present at level ``i`` but
not at the next deeper level matched exactly that depth.

Nesting makes everything the walk needs monotone along the chain: a key is held at all only up to
some depth ``n``, and the holder-set size never grows. Equal sizes of nested sets mean equal
sets, so every level boundary is found by a binary search on the size. An 8k-token prompt (512
keys) with two levels costs about 30 dict lookups instead of 512, and no per-holder work happens,
whatever the number of holders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["walk_levels"]


def walk_levels(get: Callable[[int], Any], keys: Sequence[int]) -> tuple[list[int], list[Any]]:
    """Return ``(depths, holders)`` of the levels, shallowest first (both empty when nothing matches).

    ``holders[i]`` is the live holder value at ``keys[depths[i] - 1]``; sets are nested, so a holder
    belongs to levels ``0..m`` for some ``m`` and matched ``depths[m]`` blocks.
    """
    total = len(keys)
    if not total:
        return [], []
    first = get(keys[0])
    if first is None:
        return [], []
    # n = number of held keys: keys[:n] are held, keys[n:] are not (presence is monotone).
    last = get(keys[total - 1])
    if last is not None:
        n = total
    else:
        lo, hi = 1, total - 1  # keys[lo-1] held, keys[hi] not held
        while lo < hi:
            mid = (lo + hi) >> 1
            if get(keys[mid]) is None:
                hi = mid
            else:
                lo = mid + 1
        n = lo
        last = get(keys[n - 1])
    depths: list[int] = []
    holders: list[Any] = []
    i, v = 0, first
    while True:
        size = len(v) if type(v) is dict else 1
        end_size = len(last) if type(last) is dict else 1
        if size == end_size:  # the set no longer shrinks: one level down to depth n
            depths.append(n)
            holders.append(last)
            return depths, holders
        # Deepest j >= i whose set still has ``size`` holders; keys[n-1] has fewer.
        lo, hi = i + 1, n - 1
        while lo < hi:
            mid = (lo + hi) >> 1
            m = get(keys[mid])
            if (len(m) if type(m) is dict else 1) == size:
                lo = mid + 1
            else:
                hi = mid
        depths.append(lo)
        holders.append(get(keys[lo - 1]))
        i = lo
        v = get(keys[i])
