"""Accepted requests and their state machine (pure: no I/O, no clock).

Request states and the only transitions between them (:data:`REQUEST_TRANSITIONS`)::

    NEW ---------> PREFETCHING (async prefix match) --matched--> DISPATCHED | PARKED | DONE
    NEW ---------> DISPATCHED (an attempt is out on a worker; phase mixed, prefill or decode)
    NEW ---------> PARKED (no routable worker, or all at their in-flight cap) --> DISPATCHED
    DISPATCHED --failed, nothing streamed--> RETRY_WAIT --back-off over--> DISPATCHED | PARKED
    DISPATCHED --prefill done (P/D handoff) or send failed--> DISPATCHED (next leg / attempt)
    any state --terminal frame (FINAL or ERROR) sent--> DONE

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
REQUEST_TRANSITIONS: frozenset[tuple[RequestState, RequestState]] = frozenset({
    (_R.NEW, _R.PREFETCHING), (_R.NEW, _R.DISPATCHED), (_R.NEW, _R.PARKED), (_R.NEW, _R.DONE),
    (_R.PREFETCHING, _R.DISPATCHED), (_R.PREFETCHING, _R.PARKED), (_R.PREFETCHING, _R.DONE),
    (_R.PARKED, _R.DISPATCHED), (_R.PARKED, _R.PARKED), (_R.PARKED, _R.DONE),
    (_R.DISPATCHED, _R.DISPATCHED), (_R.DISPATCHED, _R.RETRY_WAIT), (_R.DISPATCHED, _R.PARKED), (_R.DISPATCHED, _R.DONE),
    (_R.RETRY_WAIT, _R.DISPATCHED), (_R.RETRY_WAIT, _R.PARKED), (_R.RETRY_WAIT, _R.DONE),
})


# The table per source state, on the member itself: a move is one attribute read and an identity
# scan of a short tuple (hashing Enum members costs a Python call each; this runs per request).
for _s in RequestState:
    _s.allowed = tuple(t for (f, t) in REQUEST_TRANSITIONS if f is _s)  # type: ignore[attr-defined]


def move(inf: "Inflight", to: RequestState) -> None:
    """Move ``inf`` to state ``to``; :class:`IllegalTransition` if the table does not allow it."""
    if to not in inf.state.allowed:  # type: ignore[attr-defined]
        raise IllegalTransition(f"request {inf.client_rid!r}: {inf.state.value} -> {to.value}")
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
    chunks_sent: int = 0
    tried: set[str] = field(default_factory=set)
    parked_until_s: float | None = None  # set the first time it parks: how long it may wait in all
    phase: str = "mixed"  # mixed | prefill | decode (prefill/decode disaggregation)
    room: int = 0  # PD bootstrap room linking the two legs
    prefill_worker: str = ""
    prefill_usage: dict | None = None
    prefill_bootstrap: dict = field(default_factory=dict)
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

    @property
    def committed(self) -> bool:
        """True once anything was streamed to the client: no re-dispatch after that."""
        return self.chunks_sent > 0
