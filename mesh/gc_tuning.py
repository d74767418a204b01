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

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def freeze_startup_heap() -> int:
    """Collect, then freeze the surviving heap; returns how many objects were frozen.

    Call once, after start-up allocations (imports, sockets, settings) and before serving.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def bound_malloc_retention(mmap_threshold_bytes: int = 1 << 20, trim_threshold_bytes: int = 64 << 20, arena_max: int = 0) -> bool:
    """Keep glibc from holding on to freed memory after bursts of large messages.

    libzmq's I/O threads queue inbound frames in per-thread malloc arenas; after a flood of
    4 MB frames is read and freed, glibc keeps those arenas' pages (a fuzz run left 150-350 MB
    of free but retained memory in a broker whose live heap was 30 MB): its dynamic mmap
    threshold had grown to the frames' size. With a fixed ``mmap_threshold_bytes`` frames above
    it are mmap'd and returned to the OS when freed; the heap is trimmed once
    ``trim_threshold_bytes`` are free at its top; ``arena_max`` (0 = glibc's default) caps the
    arenas, which cost half the broker's throughput at 2. Call before any thread starts.
    Returns False where glibc's ``mallopt`` is not available (other libcs: no-op).
    """
    import ctypes
    import ctypes.util
    import os

    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")):
        return False  # the operator (or a test measuring live memory) chose the allocator's settings
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # A fixed mmap threshold also freezes the trim threshold at its 128 KiB default, and
    # trimming the heap that often halved the broker's throughput: keep trimming for real excess.
    ok = bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_bytes))) and bool(mallopt(_M_TRIM_THRESHOLD, int(trim_threshold_bytes)))
    if arena_max:
        ok = bool(mallopt(_M_ARENA_MAX, int(arena_max))) and ok
    return ok
