"""Request deadlines on one shared timer: ``asyncio.timeout`` semantics without a timer per request.

``asyncio.timeout`` arms an event-loop timer per use (on uvloop a libuv timer handle: created,
started and stopped every time), which cost the adapter more CPU per request than decoding the
engine's answer. :class:`Deadlines` keeps the deadlines of the requests in flight in one heap
and arms a single timer for the earliest one; a request that ends early leaves its entry
behind (marked done), skipped when the timer reaches it; the heap is rebuilt when the entries of
ended requests outnumber the live ones.

``async with deadlines.bound(timeout_s):`` behaves as ``async with asyncio.timeout(timeout_s):``
(``None``: no bound): when the deadline passes, the task is cancelled and the block raises
:class:`TimeoutError` (a cancellation from elsewhere stays a cancellation). One
:class:`Deadlines` serves one event loop at a time (used from another, it starts afresh there).
"""

from __future__ import annotations

import asyncio
import heapq
from types import TracebackType

__all__ = ["Deadlines"]

_COMPACT_AT = 1024  # rebuild the heap when it holds this many entries and most are done


class _Bound:
    """One bounded block (an ``asyncio.timeout`` stand-in)."""

    __slots__ = ("owner", "timeout_s", "when", "task", "cancelling", "done", "expired")

    def __init__(self, owner: "Deadlines", timeout_s: float | None) -> None:
        self.owner = owner
        self.timeout_s = timeout_s
        self.when = 0.0
        self.task: asyncio.Task | None = None
        self.cancelling = 0
        self.done = False
        self.expired = False

    def __lt__(self, other: "_Bound") -> bool:  # heap order (ties: any)
        return self.when < other.when

    async def __aenter__(self) -> "_Bound":
        if self.timeout_s is not None:
            task = asyncio.current_task()
            if task is None:
                raise RuntimeError("Deadlines.bound() must be used inside a task")
            self.task = task
            self.cancelling = task.cancelling()
            self.owner._add(self)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.task is None:
            return None
        task, self.task = self.task, None  # the heap entry must not keep the task alive
        self.done = True
        self.owner._live -= 1
        if self.expired and task.uncancel() <= self.cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc  # no other cancel request: this one was ours
        return None


class Deadlines:
    """The deadlines of one event loop's bounded blocks (see the module docstring)."""

    def __init__(self) -> None:
        self._heap: list[_Bound] = []
        self._live = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.expired = 0  # blocks whose deadline passed (counted)

    def bound(self, timeout_s: float | None) -> _Bound:
        """``async with deadlines.bound(timeout_s):``, as ``asyncio.timeout(timeout_s)``."""
        return _Bound(self, timeout_s)

    @property
    def pending(self) -> int:
        """Blocks in flight with a deadline."""
        return self._live

    @property
    def entries(self) -> int:
        """Heap entries (in flight, plus ended ones not swept yet)."""
        return len(self._heap)

    def _add(self, b: _Bound) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # first use, or another loop (tests run one per case): start afresh
            self._loop, self._heap, self._live, self._timer = loop, [], 0, None
        b.when = loop.time() + max(0.0, b.timeout_s or 0.0)
        heap = self._heap
        if len(heap) >= _COMPACT_AT and len(heap) > 4 * (self._live + 1):
            heap[:] = [e for e in heap if not e.done]
            heapq.heapify(heap)
        heapq.heappush(heap, b)
        self._live += 1
        if self._timer is None or b.when < self._timer_at:
            self._arm(b.when)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        assert self._loop is not None
        now = self._loop.time()
        heap = self._heap
        while heap and (heap[0].done or heap[0].when <= now):
            b = heapq.heappop(heap)
            if b.done or b.task is None:
                continue
            b.expired = True
            self.expired += 1
            b.task.cancel()
        if heap:
            self._arm(heap[0].when)
