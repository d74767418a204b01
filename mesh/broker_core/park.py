"""The park queue: requests waiting for a worker slot, served by priority band with aging, and
by weighted fair shares between the tenants of a band (pure: no I/O, no clock).

* **Bands** (:data:`mesh.tenants.BANDS`, 0 critical .. 3 low): a slot goes to the waiting request
  of the best *effective* band. A request's effective band rises by one for every ``aging_s`` it
  has waited (down to 0), so a low request is served at last even under a steady flood of higher
  ones: after ``3 x aging_s`` it competes as critical, then by age.
* **Fair shares**: among the tenants whose oldest request has the best effective band, start-time
  fair queueing (SFQ): each tenant has a virtual start time, advanced by ``1 / weight`` per request
  served; the smallest goes first, and a tenant that was idle starts at the queue's virtual time
  (no credit saved up while idle). A tenant offering ten times its share waits behind itself.
* Within a tenant and band, first come first served.

Choosing is O(waiting (band, tenant) queues): tenants come from the keys file (bounded).
"""

from __future__ import annotations

from collections.abc import Iterator

from mesh.tenants import BANDS

__all__ = ["ParkQueue"]


class ParkQueue:
    """rid -> (band, tenant); per (band, tenant) an insertion-ordered queue of (rid -> parked at)."""

    def __init__(self, aging_s: float = 0.0) -> None:
        self.aging_s = aging_s  # 0: no aging (strict bands)
        self._where: dict[int, tuple[int, str]] = {}
        self._queues: dict[tuple[int, str], dict[int, float]] = {}
        self._backlog: dict[str, int] = {}  # tenant -> its waiting requests
        self._start: dict[str, float] = {}  # tenant -> virtual start time of its next request
        self._weight: dict[str, float] = {}
        self._v = 0.0  # the queue's virtual time: the start time of the last request served

    def __len__(self) -> int:
        return len(self._where)

    def __bool__(self) -> bool:
        return bool(self._where)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._where))

    def __contains__(self, rid: object) -> bool:
        return rid in self._where

    def push(self, rid: int, now: float, band: int = 2, tenant: str = "", weight: float = 1.0, since_s: float | None = None) -> None:
        """Park ``rid`` (``since_s``: when it first waited, for aging; default ``now``)."""
        if rid in self._where:
            return
        self._where[rid] = (band, tenant)
        self._queues.setdefault((band, tenant), {})[rid] = now if since_s is None else since_s
        n = self._backlog.get(tenant, 0)
        if n == 0:  # becomes backlogged: no credit for the time it was idle
            self._start[tenant] = max(self._start.get(tenant, 0.0), self._v)
        self._backlog[tenant] = n + 1
        self._weight[tenant] = weight

    def remove(self, rid: int) -> bool:
        """Take ``rid`` out (served elsewhere, expired or finished); False if it was not parked."""
        where = self._where.pop(rid, None)
        if where is None:
            return False
        q = self._queues[where]
        del q[rid]
        if not q:
            del self._queues[where]
        tenant = where[1]
        n = self._backlog[tenant] - 1
        if n:
            self._backlog[tenant] = n
        else:
            del self._backlog[tenant], self._weight[tenant]
            if self._start.get(tenant, 0.0) <= self._v:  # it would restart at the virtual time anyway
                self._start.pop(tenant, None)
        return True

    def effective_band(self, band: int, since_s: float, now: float) -> int:
        if self.aging_s <= 0:
            return band
        return max(0, band - int(max(0.0, now - since_s) / self.aging_s))

    def pop(self, now: float) -> int | None:
        """The request the next free slot goes to (out of the queue), or None when empty."""
        best = None
        for (band, tenant), q in self._queues.items():
            since = next(iter(q.values()))
            key = (self.effective_band(band, since, now), self._start[tenant], since)
            if best is None or key < best[0]:
                best = (key, tenant, next(iter(q)))
        if best is None:
            return None
        _, tenant, rid = best
        start = self._start[tenant]
        self._v = max(self._v, start)
        self._start[tenant] = start + 1.0 / self._weight[tenant]
        self.remove(rid)
        return rid

    def drain(self, now: float) -> list[int]:
        """Every parked request, in the order they would be served; the queue is left empty."""
        out = []
        while self._where:
            rid = self.pop(now)
            assert rid is not None
            out.append(rid)
        return out

    def clear(self) -> None:
        for rid in list(self._where):
            self.remove(rid)

    def waiting(self) -> dict[tuple[str, str], int]:
        """(tenant, band name) -> requests waiting (gauges)."""
        return {(t, BANDS[b]): len(q) for (b, t), q in self._queues.items()}
