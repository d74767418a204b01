"""Worker sessions as the broker sees them: identity, liveness, in-flight requests.

A *session* is one DEALER connection of one worker process (identity bytes chosen by the
worker: ``worker_id/epoch/connection``). A worker id has at most one live session; a READY under
a known worker id replaces the old session (restart or reconnect) and the old one's in-flight
requests are handled as lost. Liveness is tracked for idle and busy sessions alike.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mesh.protocol import Ready
from mesh.routing.view import WorkerState

__all__ = ["WorkerSession", "Registry", "OUTCOME_WINDOW"]

OUTCOME_WINDOW = 32  # recent attempt outcomes kept per session (error-rate outlier detection)


@dataclass(slots=True)
class WorkerSession:
    identity: bytes
    ready: Ready
    state: WorkerState
    expiry_s: float
    inflight: set[int] = field(default_factory=set)
    draining: bool = False
    # Outlier ejection (per-worker circuit breaker): consecutive failures, current ejection.
    failures: int = 0
    ejections: int = 0
    ejected_until_s: float = 0.0
    hb_slot: int = 0  # which slice of each heartbeat interval this session's heartbeat goes out in
    last_seen_s: float = 0.0  # when the broker last read anything from this session
    key_name: str = ""  # CURVE: the allow-listed key this registration authenticated with
    confirmed: bool = False  # it sent something after READY: only then is it routable
    last_reply_s: float = 0.0  # its last CHUNK/FINAL/ERROR for a live attempt (progress)
    # Outcome window for outlier ejection: 1 = the attempt failed on this worker, 0 = it finished.
    outcomes: deque = field(default_factory=lambda: deque(maxlen=OUTCOME_WINDOW))
    outcome_errors: int = 0  # sum of ``outcomes``

    @property
    def worker_id(self) -> str:
        return self.ready.worker_id


class Registry:
    """Sessions by identity and by worker id, plus the cached routable pool."""

    def __init__(self) -> None:
        self.by_identity: dict[bytes, WorkerSession] = {}
        self.by_id: dict[str, WorkerSession] = {}
        self._pool: list[WorkerState] | None = None
        self._model_pools: dict[str, list[WorkerState]] = {}
        self._models: dict[str, int] | None = None
        self.version = 0  # bumps on every membership or health change

    def __len__(self) -> int:
        return len(self.by_id)

    def add(self, sess: WorkerSession) -> WorkerSession | None:
        """Register ``sess``; returns the session it replaced (same worker id), if any."""
        old = self.by_id.get(sess.worker_id)
        if old is not None:
            self.by_identity.pop(old.identity, None)
        self.by_identity[sess.identity] = sess
        self.by_id[sess.worker_id] = sess
        self._changed()
        return old

    def remove(self, sess: WorkerSession) -> None:
        if self.by_identity.get(sess.identity) is sess:
            del self.by_identity[sess.identity]
        if self.by_id.get(sess.worker_id) is sess:
            del self.by_id[sess.worker_id]
        self._changed()

    def set_ejected(self, sess: WorkerSession, until_s: float) -> None:
        sess.ejected_until_s = until_s
        sess.state.healthy = until_s == 0.0
        self._changed()

    def set_confirmed(self, sess: WorkerSession) -> None:
        sess.confirmed = True
        self._changed()

    def set_draining(self, sess: WorkerSession) -> None:
        sess.draining = True
        sess.state.healthy = False
        self._changed()

    def _changed(self) -> None:
        self._pool = None
        self._model_pools.clear()
        self._models = None
        self.version += 1

    def states(self) -> dict[str, WorkerState]:
        return {wid: s.state for wid, s in self.by_id.items()}

    def pool(self, model: str | None = None) -> list[WorkerState]:
        """Healthy, non-draining, confirmed worker states (all roles) -- of every model, or of the
        workers that serve ``model`` -- cached until membership changes. A session is confirmed
        by its first message after READY: a peer that registers and then stays silent (or a
        thousand of them) never receives a request."""
        if model is None:
            if self._pool is None:
                self._pool = _routable(self.by_id.values())
            return self._pool
        pool = self._model_pools.get(model)
        if pool is None:
            pool = self._model_pools[model] = _routable(s for s in self.by_id.values() if s.ready.model == model)
        return pool

    def models(self) -> dict[str, int]:
        """Model name -> registered workers serving it (routable or not)."""
        if self._models is None:
            models: dict[str, int] = {}
            for s in self.by_id.values():
                models[s.ready.model] = models.get(s.ready.model, 0) + 1
            self._models = models
        return self._models

    def expired(self, now_s: float) -> list[WorkerSession]:
        return [s for s in self.by_identity.values() if s.expiry_s < now_s]


def _routable(sessions) -> list[WorkerState]:
    sessions = list(sessions)
    pool = [s.state for s in sessions if s.state.healthy and not s.draining and s.confirmed]
    if not pool:
        # Panic mode (as Envoy's): when every remaining worker is ejected, route to them
        # anyway; an ejected worker is better than none (its peers may have left since).
        pool = [s.state for s in sessions if s.ejected_until_s and not s.draining and s.confirmed]
    return pool
