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

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect, then freeze the surviving heap; returns how many objects were frozen.

    Call once, after start-up allocations (imports, sockets, settings) and before serving.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
