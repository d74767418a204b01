"""The park queue: requests waiting for a worker slot, served by priority band with aging, and
by weighted fair shares between the tenants of a band (pure: no I/O, no clock).

* **Bands** (:data:`mesh.tenants.BANDS`, 0 critical .. 3 low) with **aging**: a request of band
  ``b`` that arrived at ``t`` competes as if it had arrived at ``t + b x aging_s`` (an earliest
  virtual deadline): its effective priority rises with its wait, so a low request goes before a
  critical one that arrived more than ``3 x aging_s`` after it, and low never starves. A band is
  chosen by its oldest request; ``aging_s`` 0 makes the bands strict.
* **Fair shares**: among the tenants waiting in the chosen band, start-time
  fair queueing (SFQ): each tenant has a virtual start time, advanced by ``1 / weight`` per request
  served; the smallest goes first, and a tenant that was idle starts at most ``burst`` requests
  (:data:`BURST_REQUESTS`) ahead of the queue's virtual time: a quiet tenant's short burst goes before a backlogged
  tenant, and no tenant saves up more credit than that while idle. A tenant offering ten times its share waits behind itself
  (aging never orders tenants of one band: a flood's old backlog does not overtake a quiet tenant).
* Within a tenant and band, first come first served.

Choosing is O(waiting (band, tenant) queues): tenants come from the keys file (bounded).
"""

from __future__ import annotations

from collections.abc import Iterator

from mesh.tenants import BANDS

__all__ = ["BURST_REQUESTS", "ParkQueue"]

#: The credit an idle tenant may bank, in requests at weight 1: enough that a tenant offering less
#: than its share rides out its own bursts ahead of a flooding tenant (``mesh sim --fairness``: 8
#: left its p95 queue wait at 2x what it was without the flood, 32 at 0.6x), small enough that a
#: tenant arriving late cannot hold every slot for long.
BURST_REQUESTS = 32.0


class ParkQueue:
    """rid -> (band, tenant); per (band, tenant) an insertion-ordered queue of (rid -> parked at)."""

    def __init__(self, aging_s: float = 0.0, burst: float = BURST_REQUESTS) -> None:
        self.aging_s = aging_s  # 0: no aging (strict bands)
        self.burst = burst  # requests of credit an idle tenant may bank (served ahead of a backlogged one)
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
        if n == 0:  # becomes backlogged: at most ``burst`` requests of credit for the time it was idle
            self._start[tenant] = max(self._start.get(tenant, 0.0), self._v - self.burst / weight)
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
            del self._backlog[tenant]
            w = self._weight.pop(tenant)
            if self._start.get(tenant, 0.0) <= self._v - self.burst / w:  # it would restart there anyway
                self._start.pop(tenant, None)
        return True

    def pop(self, now: float) -> int | None:
        """The request the next free slot goes to (out of the queue), or None when empty."""
        band_key: dict[int, tuple[float, float]] = {}
        for (band, _), q in self._queues.items():  # the band first: by its oldest request, aged
            since = next(iter(q.values()))
            key = (since + band * self.aging_s, band) if self.aging_s > 0 else (band, since)
            if band not in band_key or key < band_key[band]:
                band_key[band] = key
        if not band_key:
            return None
        best_band = min(band_key, key=band_key.__getitem__)
        best = None
        for (band, tenant), q in self._queues.items():  # then the tenant: fair shares within the band
            if band == best_band:
                key2 = (self._start[tenant], next(iter(q.values())))
                if best is None or key2 < best[0]:
                    best = (key2, tenant, next(iter(q)))
        assert best is not None
        _, tenant, rid = best
        start = self._start[tenant]
        self._v = max(self._v, start)
        self._start[tenant] = start + 1.0 / self._weight[tenant]
        self.remove(rid)
        return rid

    def evictable(self, tenant: str) -> int | None:
        """The queue is full and a request of ``tenant`` wants in: the newest, lowest-band request
        of the tenant holding the most places, when that tenant holds at least two more than
        ``tenant`` (a flood gives up its own places, never a quiet tenant's); else None."""
        if not self._backlog:
            return None
        top = max(self._backlog, key=self._backlog.__getitem__)
        if top == tenant or self._backlog[top] < self._backlog.get(tenant, 0) + 2:
            return None
        band = max(b for b, t in self._queues if t == top)
        return next(reversed(self._queues[(band, top)]))

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
