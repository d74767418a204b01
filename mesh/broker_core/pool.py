"""The worker pool: sessions, their states and the routable pool (pure: no I/O, no clock).

A *session* is one DEALER connection of one worker process (identity bytes chosen by the
worker: ``worker_id/epoch/connection``). A worker id has at most one live session; a READY under
a known worker id replaces the old session (restart or reconnect) and the old one's in-flight
requests are handled as lost.

Session states, and every move between them with what triggers it (:data:`SESSION_TRANSITIONS`,
``(from, to, why)`` triples checked by :meth:`WorkerPool.move`)::

    REGISTERED ---spoke (first message after READY)---> ROUTABLE
    ROUTABLE   ---ejected (outlier, or an operator)---> EJECTED ---reinstated---> ROUTABLE
    REGISTERED | ROUTABLE | EJECTED ---drained_by_worker (DISCONNECT draining)
                                     | drained_by_operator---> DRAINING
    DRAINING   ---undrained (an operator reinstates a worker the operator drained)---> ROUTABLE
                                                        (REGISTERED if it never spoke)
    any live state ---expired | disconnected | connection_lost | replaced | duplicate_ready---> GONE

Only ROUTABLE sessions get new requests (never a quarantined one: :mod:`mesh.broker_core.models`), except in panic mode (every remaining confirmed worker
is EJECTED: route to them anyway). DRAINING sessions finish what they hold.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from mesh.protocol import Ready
from mesh.routing.view import WorkerState

__all__ = ["WorkerSession", "WorkerPool", "SessionState", "SESSION_TRANSITIONS", "GONE_WHY", "OUTCOME_WINDOW",
           "IllegalTransition"]

OUTCOME_WINDOW = 32  # recent attempt outcomes kept per session (error-rate outlier detection)


class IllegalTransition(RuntimeError):
    """A state machine was asked for a transition its table does not allow: a broker bug.

    The shell's handler guard counts it (``dropped{what=handler_exception}``) and keeps serving;
    the property-based tests fail on it."""


class SessionState(enum.Enum):
    REGISTERED = "registered"  # READY accepted, not heard from since: not routable yet
    ROUTABLE = "routable"
    EJECTED = "ejected"  # outlier: no new requests until ``ejected_until_s`` (except panic mode)
    DRAINING = "draining"  # announced it is leaving: no new requests, finishes what it holds
    GONE = "gone"  # removed from the pool (expired, disconnected, replaced, connection lost)


_S = SessionState
_LIVE = (_S.REGISTERED, _S.ROUTABLE, _S.EJECTED, _S.DRAINING)
#: Why a session leaves the pool (the ``why`` of its move to GONE).
GONE_WHY = ("expired", "disconnected", "connection_lost", "replaced", "duplicate_ready")
#: Every legal move as (from, to, why): ``why`` names the trigger (see the module docstring).
SESSION_TRANSITIONS: frozenset[tuple[SessionState, SessionState, str]] = frozenset({
    (_S.REGISTERED, _S.ROUTABLE, "spoke"),
    (_S.ROUTABLE, _S.EJECTED, "ejected"), (_S.EJECTED, _S.ROUTABLE, "reinstated"),
    *((f, _S.DRAINING, why) for f in (_S.REGISTERED, _S.ROUTABLE, _S.EJECTED)
      for why in ("drained_by_worker", "drained_by_operator")),
    (_S.DRAINING, _S.ROUTABLE, "undrained"), (_S.DRAINING, _S.REGISTERED, "undrained"),
    *((f, _S.GONE, why) for f in _LIVE for why in GONE_WHY),
})


@dataclass(slots=True)
class WorkerSession:
    identity: bytes
    ready: Ready
    state: WorkerState
    expiry_s: float
    status: SessionState = SessionState.REGISTERED
    inflight: set[int] = field(default_factory=set)
    # Outlier ejection (per-worker circuit breaker): consecutive failures, current ejection.
    failures: int = 0
    ejections: int = 0
    ejected_until_s: float = 0.0
    hb_slot: int = 0  # which slice of each heartbeat interval this session's heartbeat goes out in
    last_seen_s: float = 0.0  # when the broker last read anything from this session
    key_name: str = ""  # CURVE: the allow-listed key this registration authenticated with
    last_reply_s: float = 0.0  # its last CHUNK/FINAL/ERROR for a live attempt (progress)
    # Outcome window for outlier ejection: 1 = the attempt failed on this worker, 0 = it finished.
    outcomes: deque = field(default_factory=lambda: deque(maxlen=OUTCOME_WINDOW))
    outcome_errors: int = 0  # sum of ``outcomes``
    drained_by: str = ""  # "worker" (it announced it is leaving) or "operator" (the admin API), while DRAINING
    spoke: bool = False  # it sent something after READY (confirmed), whatever its state since
    lat: dict = field(default_factory=dict)  # latency name -> its histogram in BrokerStats (by the worker's model)
    # Foreign models (mesh.broker_core.models): held apart (never routed to, its model not listed)
    # until an operator admits it; when it registered (long-registered workers pick the default model).
    quarantined: bool = False
    registered_s: float = 0.0

    @property
    def worker_id(self) -> str:
        return self.ready.worker_id

    def histogram(self, name: str, stats):
        """``name``'s latency histogram of this worker in ``stats`` (a BrokerStats; labels: its
        served model, its id), cached on the session (read ``lat.get(name)`` first: hot path)."""
        h = self.lat.get(name)
        if h is None:
            h = self.lat[name] = stats.histogram(name, self.ready.model, self.worker_id)
        return h

    @property
    def confirmed(self) -> bool:
        """It sent something after READY (only then is it routable)."""
        return self.spoke

    @property
    def draining(self) -> bool:
        return self.status is SessionState.DRAINING


class WorkerPool:
    """Sessions by identity and by worker id, their state transitions, and the cached routable pool."""

    def __init__(self) -> None:
        self.by_identity: dict[bytes, WorkerSession] = {}
        self.by_id: dict[str, WorkerSession] = {}
        self._pool: list[WorkerState] | None = None
        self._model_pools: dict[str, list[WorkerState]] = {}
        self._models: dict[str, int] | None = None
        self.version = 0  # bumps on every membership or state change

    def __len__(self) -> int:
        return len(self.by_id)

    # -- transitions -------------------------------------------------------------------
    def move(self, sess: WorkerSession, to: SessionState, why: str) -> None:
        """Move ``sess`` to ``to`` on trigger ``why``; :class:`IllegalTransition` if the table
        has no such move."""
        if (sess.status, to, why) not in SESSION_TRANSITIONS:
            raise IllegalTransition(f"worker {sess.worker_id}: {sess.status.value} -> {to.value} ({why})")
        sess.status = to
        # ``healthy`` is what the routing core reads: not ejected, not draining, not gone.
        sess.state.healthy = to in (SessionState.REGISTERED, SessionState.ROUTABLE)
        self._changed()

    def add(self, sess: WorkerSession) -> WorkerSession | None:
        """Register ``sess`` (REGISTERED); returns the session it replaced (now GONE), if any."""
        old = self.by_id.get(sess.worker_id)
        if old is not None:
            self.by_identity.pop(old.identity, None)
            self.move(old, SessionState.GONE, "replaced")
        self.by_identity[sess.identity] = sess
        self.by_id[sess.worker_id] = sess
        self._changed()
        return old

    def remove(self, sess: WorkerSession, why: str) -> None:
        """Take ``sess`` out of the pool (GONE, ``why``: one of :data:`GONE_WHY`). Idempotent."""
        if self.by_identity.get(sess.identity) is sess:
            del self.by_identity[sess.identity]
        if self.by_id.get(sess.worker_id) is sess:
            del self.by_id[sess.worker_id]
        if sess.status is not SessionState.GONE:
            self.move(sess, SessionState.GONE, why)

    def confirm(self, sess: WorkerSession) -> None:
        sess.spoke = True
        self.move(sess, SessionState.ROUTABLE, "spoke")

    def eject(self, sess: WorkerSession, until_s: float) -> None:
        sess.ejected_until_s = until_s
        self.move(sess, SessionState.EJECTED, "ejected")

    def reinstate(self, sess: WorkerSession) -> None:
        sess.ejected_until_s = 0.0
        self.move(sess, SessionState.ROUTABLE, "reinstated")

    def drain(self, sess: WorkerSession, by: str = "worker") -> None:
        sess.drained_by = by
        self.move(sess, SessionState.DRAINING, "drained_by_operator" if by == "operator" else "drained_by_worker")

    def undrain(self, sess: WorkerSession) -> None:
        """An operator puts back a worker the operator drained (a worker that is leaving stays drained)."""
        sess.drained_by = ""
        self.move(sess, SessionState.ROUTABLE if sess.spoke else SessionState.REGISTERED, "undrained")

    def admit(self, sess: WorkerSession) -> None:
        """An operator admits a quarantined session: routable like any other from now on."""
        sess.quarantined = False
        self._changed()

    def _changed(self) -> None:
        self._pool = None
        self._model_pools.clear()
        self._models = None
        self.version += 1

    # -- views -------------------------------------------------------------------------
    def states(self) -> dict[str, WorkerState]:
        return {wid: s.state for wid, s in self.by_id.items()}

    def pool(self, model: str | None = None) -> list[WorkerState]:
        """ROUTABLE worker states (all roles) -- of every model, or of the workers that serve
        ``model`` -- cached until membership changes. A session is confirmed by its first
        message after READY: a peer that registers and then stays silent (or a thousand of
        them) never receives a request."""
        if model is None:
            if self._pool is None:
                self._pool = _routable(self.by_id.values())
            return self._pool
        pool = self._model_pools.get(model)
        if pool is None:
            pool = self._model_pools[model] = _routable(s for s in self.by_id.values() if s.ready.model == model)
        return pool

    def models(self) -> dict[str, int]:
        """Model name -> registered workers serving it (routable or not; quarantined ones are not counted)."""
        if self._models is None:
            models: dict[str, int] = {}
            for s in self.by_id.values():
                if s.quarantined:
                    continue
                models[s.ready.model] = models.get(s.ready.model, 0) + 1
            self._models = models
        return self._models

    def expired(self, now_s: float) -> list[WorkerSession]:
        return [s for s in self.by_identity.values() if s.expiry_s < now_s]

    def count(self, status: SessionState) -> int:
        return sum(1 for s in self.by_id.values() if s.status is status)


def _routable(sessions) -> list[WorkerState]:
    sessions = [s for s in sessions if not s.quarantined]
    pool = [s.state for s in sessions if s.status is SessionState.ROUTABLE]
    if not pool:
        # Panic mode (as Envoy's): when every remaining worker is ejected, route to them
        # anyway; an ejected worker is better than none (its peers may have left since).
        pool = [s.state for s in sessions if s.status is SessionState.EJECTED]
    return pool
