"""The shared match walk: holder levels along a chain of content keys, in time O(prompt blocks).

Both indexes keep, per content key, a *holder* value: one object when exactly one holder owns the
key (a ``single_cls`` instance that names its holder) and a dict ``{holder: ...}`` when two or more
do (the speculative index may also keep a one-element dict). Both keep every holder's keys
*prefix-closed*: a holder of key ``k`` also holds key ``k-1`` of the same chain. So along a query
chain the holder sets are nested, and the set at depth ``d`` is the holder value of ``keys[d-1]``.
A *level* is a depth where the set shrinks (or the walk ends); holders present at level ``i`` but
not at the next deeper level matched exactly that depth.

The walk therefore needs only the holder values and their sizes, both obtained with C-level
``map`` calls; no per-holder work happens, whatever the number of holders.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from operator import neg
from typing import Any

__all__ = ["walk_levels"]


def walk_levels(
    get: Callable[[int], Any], keys: Sequence[int], single_cls: type
) -> tuple[list[int], list[Any]]:
    """Return ``(depths, holders)`` of the levels, shallowest first (both empty when nothing matches).

    ``holders[i]`` is the live holder value at ``keys[depths[i] - 1]``; sets are nested, so a holder
    belongs to levels ``0..m`` for some ``m`` and matched ``depths[m]`` blocks.
    """
    vals = list(map(get, keys))
    try:
        n = vals.index(None)
        del vals[n:]
    except ValueError:
        n = len(vals)
    if n == 0:
        return [], []
    # Multi-holder values (dicts) come first along a path, single-holder values after them (a
    # single holder's key has at most that holder below it).
    if type(vals[0]) is not dict:
        j = 0
    else:
        try:
            j = list(map(type, vals)).index(single_cls)
        except ValueError:
            j = n
    depths: list[int] = []
    holders: list[Any] = []
    if j:
        multi = vals[:j] if j < n else vals
        lens = list(map(len, multi))
        if lens[0] == lens[-1]:  # common: one shared prefix level
            depths.append(j)
            holders.append(vals[j - 1])
        else:
            # lens is non-increasing; bisect on its negation finds each shrink in O(log n).
            negs = list(map(neg, lens))
            i = 0
            while i < j:
                i = bisect_right(negs, negs[i], i, j)
                depths.append(i)
                holders.append(vals[i - 1])
    if j < n:
        depths.append(n)
        holders.append(vals[n - 1])
    return depths, holders
