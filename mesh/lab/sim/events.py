"""The simulator's clock and event queue: a binary heap of ``(time_s, seq, kind, a, b)``.

``seq`` is a global insertion counter, so events at the same virtual time run in the order they
were scheduled (FIFO) and every run is deterministic. Time only moves when an event is popped;
nothing here reads the wall clock.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import Any

__all__ = ["EventQueue"]


class EventQueue:
    __slots__ = ("_heap", "_seq", "now", "popped")

    def __init__(self, start_s: float = 0.0) -> None:
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self.now = start_s  # events before it are refused (a fleet may register before the stream's t=0)
        self.popped = 0

    def push(self, t: float, kind: int, a: Any = None, b: Any = None) -> None:
        if t < self.now:
            raise ValueError(f"event at {t} is in the past (now {self.now})")
        self._seq += 1
        heappush(self._heap, (t, self._seq, kind, a, b))

    def pop(self) -> tuple[float, int, int, Any, Any]:
        ev = heappop(self._heap)
        self.now = ev[0]
        self.popped += 1
        return ev

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
