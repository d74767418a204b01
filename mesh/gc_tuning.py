"""Garbage-collector settings for long-running serving processes (broker, workers, indexer).

The hot paths allocate only short-lived, acyclic objects (frames, decoded messages, decisions),
which reference counting frees at once; the cyclic collector finds nothing there. What it does
do is walk every tracked object in a full (generation 2) collection: with the tens of thousands
of objects a process holds after imports and start-up, that is a stall of 10-20 ms on a busy
2-core machine, visible as a burst of slow requests in ``mesh bench broker``.

:func:`freeze_startup_heap` collects once and then moves everything that survived start-up into
the permanent generation (:func:`gc.freeze`), so later collections scan only what was allocated
while serving. Collection stays enabled: cycles created while serving (exception tracebacks,
asyncio internals) are still reclaimed.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap", "bound_malloc_retention"]

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameters (malloc.h)
_M_ARENA_MAX = -8


def freeze_startup_heap() -> int:
    """Collect, then freeze the surviving heap; returns how many objects were frozen.

    Call once, after start-up allocations (imports, sockets, settings) and before serving.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def bound_malloc_retention(mmap_threshold_bytes: int = 128 * 1024, arena_max: int = 2) -> bool:
    """Keep glibc from holding on to freed memory after bursts of large messages.

    libzmq's I/O threads queue inbound frames in per-thread malloc arenas; after a flood of
    4 MB frames is read and freed, glibc keeps those arenas' pages (a fuzz run left 150-350 MB
    of free but retained memory in a broker whose live heap was 30 MB). Allocations above
    ``mmap_threshold_bytes`` then go to mmap and are returned to the OS when freed, and at most
    ``arena_max`` arenas exist. Call before any thread starts (before the ZeroMQ context).
    Returns False where glibc's ``mallopt`` is not available (other libcs: no-op).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_bytes))) and bool(mallopt(_M_ARENA_MAX, int(arena_max)))
