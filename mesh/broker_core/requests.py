"""Accepted requests and their state machine (pure: no I/O, no clock).

Request states, and every move between them with what triggers it (:data:`REQUEST_TRANSITIONS`,
``(from, to, why)`` triples checked by :func:`move`)::

    NEW ---prefix_match---> PREFETCHING (async prefix match) ---routed---> DISPATCHED
    NEW | PREFETCHING | PARKED | RETRY_WAIT ---routed---> DISPATCHED (an attempt is out on a worker)
    DISPATCHED ---routed---> DISPATCHED (its REQUEST could not be sent: another worker)
    DISPATCHED | RETRY_WAIT ---decode_leg---> DISPATCHED (P/D: prefill done, or the decode leg again)
    any live state ---no_worker | saturated---> PARKED (no routable worker / all at their cap)
    DISPATCHED ---attempt_failed---> RETRY_WAIT (nothing streamed; the back-off runs)
    DISPATCHED ---migrate---> RETRY_WAIT (its worker was lost mid-stream: it continues on another,
        :mod:`mesh.broker_core.migrate`)
    DISPATCHED ---answered---> DONE (its FINAL)
    any live state ---failed | client_gone---> DONE (its ERROR, or nobody reads it any more)

``DONE`` is final: a request sends exactly one terminal frame, and replies of any attempt but the
current one (``attempt``, on ``session``) are dropped as stale.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mesh import protocol as P
from mesh.broker_core.pool import IllegalTransition, WorkerSession
from mesh.routing.view import Decision, RouteRequest

__all__ = ["Inflight", "RequestState", "REQUEST_TRANSITIONS", "move"]


class RequestState(enum.Enum):
    NEW = "new"
    PREFETCHING = "prefetching"  # waiting for the shared indexer's match before routing
    PARKED = "parked"  # waiting for a routable worker or a free slot (bounded FIFO, timed)
    DISPATCHED = "dispatched"  # an attempt is out on ``session``
    RETRY_WAIT = "retry_wait"  # the last attempt failed without output; the next is on a timer
    DONE = "done"  # its terminal frame was sent (or its client is gone)


_R = RequestState
_LIVE = (_R.NEW, _R.PREFETCHING, _R.PARKED, _R.DISPATCHED, _R.RETRY_WAIT)
#: Every legal move as (from, to, why): ``why`` names the trigger (see the module docstring).
REQUEST_TRANSITIONS: frozenset[tuple[RequestState, RequestState, str]] = frozenset({
    (_R.NEW, _R.PREFETCHING, "prefix_match"),
    *((f, _R.DISPATCHED, "routed") for f in _LIVE),
    (_R.DISPATCHED, _R.DISPATCHED, "decode_leg"), (_R.RETRY_WAIT, _R.DISPATCHED, "decode_leg"),
    *((f, _R.PARKED, why) for f in _LIVE for why in ("no_worker", "saturated")),
    (_R.DISPATCHED, _R.RETRY_WAIT, "attempt_failed"),
    (_R.DISPATCHED, _R.RETRY_WAIT, "migrate"),
    (_R.DISPATCHED, _R.DONE, "answered"),
    *((f, _R.DONE, why) for f in _LIVE for why in ("failed", "client_gone")),
})


# The table per source state, on the member itself: trigger -> the states it may lead to. A move
# is one attribute read, a dict lookup by a string and an identity scan of a short tuple (hashing
# Enum members costs a Python call each; this runs per request).
for _s in RequestState:
    _s.allowed = {w: tuple(t for (f, t, w2) in REQUEST_TRANSITIONS if f is _s and w2 == w)  # type: ignore[attr-defined]
                  for (f, _, w) in REQUEST_TRANSITIONS if f is _s}


def move(inf: "Inflight", to: RequestState, why: str) -> None:
    """Move ``inf`` to state ``to`` on trigger ``why``; :class:`IllegalTransition` if the table
    has no such move."""
    if to not in inf.state.allowed.get(why, ()):  # type: ignore[attr-defined]
        raise IllegalTransition(f"request {inf.client_rid!r}: {inf.state.value} -> {to.value} ({why})")
    inf.state = to


@dataclass(slots=True)
class Inflight:
    """One accepted client request, owned by the broker core until its terminal frame is sent."""

    rid: int
    client: bytes
    client_rid: str
    submit: P.Submit
    deadline_s: float
    state: RequestState = RequestState.NEW
    attempt: int = 0
    session: WorkerSession | None = None
    decision: Decision | None = None
    route_req: RouteRequest | None = None
    capacity_checked: bool = False  # its length was checked against a registered worker's KV capacity
    chunks_sent: int = 0
    tried: set[str] = field(default_factory=set)
    parked_until_s: float | None = None  # set the first time it parks: how long it may wait in all
    phase: str = "mixed"  # mixed | prefill | decode (prefill/decode disaggregation)
    room: int = 0  # PD bootstrap room linking the two legs
    prefill_worker: str = ""
    prefill_usage: dict | None = None
    prefill_bootstrap: dict = field(default_factory=dict)
    prefill_attempt: int = 0  # the attempt number of the prefill leg whose FINAL handed it to decode
    holds_retry_budget: bool = False
    reason: str = ""  # routing decision reason of the current attempt
    fail_cause: str = ""  # error code of the last failed attempt
    fail_message: str = ""  # and its message (what the engine said), for the client's error
    replied: bool = False  # the current attempt's worker sent something for it (progress)
    sent_s: float = 0.0  # when the current attempt was sent (first-reply latency per worker)
    quota: bytes = b""  # whose in-flight quota it counts against (the client; an HTTP request's peer)
    model: str | None = None  # the served model it is routed to (None: any worker)
    accepted_s: float = 0.0  # when the SUBMIT was accepted (latency histograms)
    first_token_s: float = 0.0  # when its first output arrived (0: not yet)
    last_chunk_s: float = 0.0  # when its last streamed chunk arrived
    # migration (mesh.broker_core.migrate): why it cannot be continued on another worker ("" : it
    # can), the CHUNK payloads streamed by the current attempt (kept only when it can), how often
    # it was continued, the client seq its current attempt's seq 0 maps to, and the tokens streamed
    # before the current attempt (sent to it as prompt)
    unmigratable: str = ""
    streamed: list | None = None
    migrations: int = 0
    seq_base: int = 0
    produced: int = 0
    tenant: str = ""  # whose request it is (mesh.tenants; quotas, fair shares, metrics)
    band: int = 2  # its priority band (0 critical .. 3 low), clamped to its tenant's ceiling
    weight: float = 1.0  # its tenant's share within the band
    parked_s: float | None = None  # when it first waited in the park queue (aging)

    @property
    def committed(self) -> bool:
        """True once anything was streamed to the client: no re-dispatch after that."""
        return self.chunks_sent > 0
