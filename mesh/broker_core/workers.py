"""The worker side of the broker core: READY, liveness, outlier ejection, heartbeats, drain and
the admin API (pure: no I/O, no clock).

It owns the sessions (:class:`~mesh.broker_core.pool.WorkerPool`) and knows nothing of the
requests they hold: whatever takes a session out of the pool *returns* it (or yields it), and
the facade (:class:`~mesh.broker_core.core.BrokerCore`) hands its requests to the request table.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

from mesh import protocol as P
from mesh.broker_core.counters import BrokerStats
from mesh.broker_core.models import ModelGate
from mesh.broker_core.pool import SessionState, WorkerPool, WorkerSession
from mesh.broker_core.sends import Outbox, Receipt
from mesh.config import BrokerSettings
from mesh.logs import RateLimiter
from mesh.routing.view import WorkerState
from mesh.security import key_may_claim

__all__ = ["Workers", "HB_SLICES"]

# Heartbeats to workers go out in this many slices per interval (each session in its own
# slice, assigned round-robin at registration): 1,000 workers never cost one long send burst.
HB_SLICES = 10
# Error-rate outlier ejection: a worker with at least _OUTLIER_MIN_OUTCOMES recent outcomes whose
# error rate is >= _OUTLIER_MIN_RATE and exceeds its peers' by _OUTLIER_MARGIN is ejected.
_OUTLIER_MIN_OUTCOMES = 16
_OUTLIER_MIN_RATE = 0.5
_OUTLIER_MARGIN = 0.3


class Workers:
    """Registration, liveness and ejection of worker sessions; heartbeats; operators' actions."""

    def __init__(self, settings: BrokerSettings, pool: WorkerPool, stats: BrokerStats, log: Any, limiter: RateLimiter,
                 outbox: Outbox, *, kv_sink: Any = None, worker_keys: dict[bytes, str] | None = None,
                 on_event: Callable[..., None] | None = None,
                 on_new_worker: Callable[[WorkerState], None] | None = None, models: ModelGate | None = None) -> None:
        self.s = settings
        self.pool = pool
        self.stats = stats
        self.log = log
        self._limiter = limiter
        self._out = outbox
        self.kv_sink = kv_sink
        # CURVE: z85 public key -> key name of every allow-listed worker key (mesh.security.key_may_claim).
        self.worker_keys = worker_keys
        self.on_event = on_event
        self.on_new_worker = on_new_worker
        self.models = models if models is not None else ModelGate(settings)  # foreign models: admitted or held apart
        self.next_hb_s = self.next_sweep_s = 0.0
        self._hb_slot = 0
        self._hb_slots = itertools.count()
        self._fleet_errors = 0  # sums of every session's outcome window (peer error rate)
        self._fleet_outcomes = 0

    def event(self, event: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(event, **fields)

    def start(self, now: float) -> None:
        """The heartbeat and sweep timers count from ``now``."""
        hb_s = self.s.heartbeat_ms / 1000.0
        self.next_hb_s = now + hb_s / HB_SLICES
        self.next_sweep_s = now + hb_s / 5

    def expiry_s(self, sess: WorkerSession) -> float:
        # The slower of our interval and the worker's own decides liveness (mismatch-proof), but
        # never beyond the broker's cap: a worker cannot switch its own liveness off.
        hb_ms = min(max(self.s.heartbeat_ms, sess.ready.heartbeat_ms), self.s.max_worker_heartbeat_ms)
        return hb_ms * self.s.liveness / 1000.0

    def confirm(self, sess: WorkerSession) -> None:
        """The session's first message after READY: it is routable from now on."""
        self.pool.confirm(sess)
        self.stats.workers["confirmed"] += 1

    # -- READY ----------------------------------------------------------------------------
    def refuse_ready(self, ident: bytes, r: P.Ready, why: str, message: str, now: float) -> None:
        """Refuse a registration: counted, warned (rate-limited) and answered with DISCONNECT at
        most once a second per peer, so a peer that retries at once cannot make us ping-pong."""
        self.stats.workers[f"refused_{why}"] += 1
        if self._limiter.allow(("ready_refused", why, r.worker_id), now):
            self.log.warning("worker_refused", worker_id=r.worker_id, why=why, peer=ident.hex()[:32])
        if self._limiter.allow(("ready_refused_reply", ident), now):
            self._out.to_worker(ident, P.encode_disconnect(message))

    def register(self, ident: bytes, r: P.Ready, now: float,
                 peer_key: bytes | None) -> tuple[WorkerSession | None, WorkerSession | None]:
        """A READY from an unknown peer: (its new session, the session it replaced) or
        (None, None) when it is refused. The caller hands the replaced session's requests on,
        then calls :meth:`welcome`."""
        old = self.pool.by_id.get(r.worker_id)
        if old is None and len(self.pool) >= self.s.max_workers:
            self.refuse_ready(ident, r, "max_workers", f"broker already has {self.s.max_workers} workers", now)
            return None, None
        key_name = None
        if self.worker_keys is not None:
            key_name = self.worker_keys.get(peer_key or b"")
            if key_name is None or not key_may_claim(key_name, r.worker_id):
                self.refuse_ready(ident, r, "key_mismatch", f"this CURVE key may not register as {r.worker_id!r}", now)
                return None, None
        if old is not None and old.identity != ident and not (key_name and old.key_name == key_name):
            # A live worker id is not given away: a second claimant (an impostor, or a restart
            # whose old connection is still up) waits until the old session expires (its expiry
            # carries the credit of our own stalls: a slow broker loop must not open a window).
            # A restarted worker's old connection is gone, so our next heartbeat to it fails and
            # frees the id within one heartbeat interval (see send_heartbeats).
            if old.expiry_s > now:
                self.refuse_ready(ident, r, "duplicate_id", f"worker_id {r.worker_id!r} is registered on another live connection", now)
                return None, None
        if r.heartbeat_ms > self.s.max_worker_heartbeat_ms and self._limiter.allow(("hb_capped", r.worker_id), now):
            self.log.warning("worker_heartbeat_capped", worker_id=r.worker_id, announced_ms=r.heartbeat_ms,
                             cap_ms=self.s.max_worker_heartbeat_ms)
        state = WorkerState(
            worker_id=r.worker_id, role=r.role, labels=dict(r.labels), block_size=r.block_size,
            max_running_requests=r.max_running_requests, max_total_num_tokens=r.max_total_num_tokens, dp_size=r.dp_size,
            loras=frozenset(r.loras or ()),
        )
        if self.on_new_worker is not None:
            self.on_new_worker(state)
        sess = WorkerSession(ident, r, state, expiry_s=0.0, hb_slot=next(self._hb_slots) % HB_SLICES, last_seen_s=now,
                             key_name=key_name or "")
        sess.expiry_s = now + self.expiry_s(sess)
        sess.registered_s = now
        self.hold_apart_or_admit(sess, now)
        old = self.pool.add(sess)
        if old is not None:
            self.forget_outcomes(old)
            self.stats.workers["replaced"] += 1
        return sess, old

    def hold_apart_or_admit(self, sess: WorkerSession, now: float) -> None:
        """A READY announcing a model not admitted yet, from a worker without an allow-listed key,
        is quarantined (:mod:`mesh.broker_core.models`): counted, logged, never routed to."""
        model = sess.ready.model
        if not self.models.holds_apart(model, bool(sess.key_name), now):
            self.models.admit(model, now)
            return
        sess.quarantined = True
        self.stats.workers["quarantined"] += 1
        if self._limiter.allow(("worker_quarantined", sess.worker_id), now):
            self.log.warning("worker_quarantined", worker_id=sess.worker_id, model=model[:64],
                             peer=sess.identity.hex()[:32], admitted=sorted(self.models.admitted)[:16])
        self.event("worker_quarantined", worker_id=sess.worker_id, model=model[:64])

    def welcome(self, sess: WorkerSession, old: WorkerSession | None) -> None:
        """A registration is in: the index hears of it, and so does the worker."""
        r = sess.ready
        if old is not None and self.kv_sink is not None and old.ready.epoch != r.epoch:
            self.kv_sink.on_worker_removed(r.worker_id)
        self.stats.workers["registered"] += 1
        if self.kv_sink is not None:
            self.kv_sink.on_worker_ready(r)
        self.log.info("worker_registered", worker_id=r.worker_id, role=r.role, epoch=r.epoch, block_size=r.block_size,
                      replaced=old is not None, workers=len(self.pool))
        self.event("worker_registered", worker_id=r.worker_id, role=r.role, epoch=r.epoch)
        self._out.to_worker(sess.identity, P.encode_heartbeat())  # first message tells the worker it is routable

    def update_loras(self, sess: WorkerSession, loras: list[str]) -> None:
        """A HEARTBEAT with ``loras``: the worker's engine loaded or unloaded LoRA adapters."""
        new = frozenset(loras)
        if new == sess.state.loras:
            return
        added, removed = sorted(new - sess.state.loras), sorted(sess.state.loras - new)
        sess.state.loras = new
        self.stats.workers["loras_changed"] += 1
        self.log.info("worker_loras_changed", worker_id=sess.worker_id, added=added[:16], removed=removed[:16], loras=len(new))

        # -- outlier ejection ---------------------------------------------------------------
    def note_failure(self, sess: WorkerSession, now: float) -> None:
        """Count a worker-side failure; eject the worker after ``eject_after_failures`` in a row."""
        sess.failures += 1
        if sess.failures < self.s.eject_after_failures or sess.status is not SessionState.ROUTABLE:
            return
        self.eject(sess, now, f"{sess.failures} failures in a row")

    def eject(self, sess: WorkerSession, now: float, why: str) -> None:
        """Eject ``sess`` for ``eject_base_s x n`` (capped), unless that would leave no routable
        worker or eject more than ``max_ejected_ratio`` of them (panic mode)."""
        healthy = sum(1 for s2 in self.pool.by_id.values() if s2.state.healthy and not s2.quarantined)
        ejected = self.pool.count(SessionState.EJECTED)
        if healthy <= 1 or (ejected + 1) > max(1, int(self.s.max_ejected_ratio * len(self.pool))):
            self.stats.workers["ejection_skipped"] += 1
            return
        sess.ejections += 1
        dur = min(self.s.eject_base_s * sess.ejections, self.s.eject_max_s)
        self.pool.eject(sess, now + dur)
        self.stats.workers["ejected"] += 1
        self.log.warning("worker_ejected", worker_id=sess.worker_id, failures=sess.failures, why=why, for_s=dur)
        self.event("worker_ejected", worker_id=sess.worker_id, for_s=dur)

    def note_outcome(self, sess: WorkerSession, failed: bool, now: float) -> None:
        """Record one attempt outcome; eject a worker whose recent error rate stands out from
        its peers' (Envoy-style success-rate outlier detection). Any error counts, ``bad_request``
        too: a worker that refuses everything its peers serve is broken, whatever code it uses;
        one bad client makes every worker answer alike, so no worker stands out."""
        w = sess.outcomes
        if len(w) == w.maxlen:
            old = w[0]
            sess.outcome_errors -= old
            self._fleet_errors -= old
            self._fleet_outcomes -= 1
        v = 1 if failed else 0
        w.append(v)
        sess.outcome_errors += v
        self._fleet_errors += v
        self._fleet_outcomes += 1
        if not failed or len(w) < _OUTLIER_MIN_OUTCOMES or sess.status is not SessionState.ROUTABLE:
            return
        rate = sess.outcome_errors / len(w)
        peers_n = self._fleet_outcomes - len(w)
        peer_rate = (self._fleet_errors - sess.outcome_errors) / peers_n if peers_n > 0 else 0.0
        if rate >= _OUTLIER_MIN_RATE and rate >= peer_rate + _OUTLIER_MARGIN:
            self.eject(sess, now, f"error rate {rate:.2f} vs peers {peer_rate:.2f}")

    def forget_outcomes(self, sess: WorkerSession) -> None:
        """Take a session that is going away out of the fleet's outcome sums."""
        self._fleet_errors -= sess.outcome_errors
        self._fleet_outcomes -= len(sess.outcomes)
        sess.outcomes.clear()
        sess.outcome_errors = 0

    def _reinstate(self, sess: WorkerSession) -> None:
        sess.failures = 0
        self.forget_outcomes(sess)  # a fresh window after ejection
        self.pool.reinstate(sess)

    def reinstate_due(self, now: float) -> None:
        for sess in list(self.pool.by_id.values()):
            if sess.status is SessionState.EJECTED and sess.ejected_until_s <= now:
                self._reinstate(sess)
                self.stats.workers["reinstated"] += 1
                self.log.info("worker_reinstated", worker_id=sess.worker_id)
                self.event("worker_reinstated", worker_id=sess.worker_id)

    # -- sessions going away ------------------------------------------------------------
    def disconnect(self, sess: WorkerSession, reason: str) -> bool:
        """A DISCONNECT: True when the session was removed (the caller hands its requests on)."""
        if reason == P.DRAINING:
            # Graceful drain: no new work, but its in-flight requests finish where they are.
            if sess.draining:
                sess.drained_by = "worker"  # drained by an operator before: now it is leaving, no reinstating it
            else:
                self.pool.drain(sess)
                self.stats.workers["draining"] += 1
                self.log.info("worker_draining", worker_id=sess.worker_id, inflight=len(sess.inflight))
                self.event("worker_draining", worker_id=sess.worker_id)
            return False
        self.stats.workers["disconnected"] += 1
        self.log.info("worker_disconnected", worker_id=sess.worker_id, reason=reason)
        self.event("worker_disconnected", worker_id=sess.worker_id, reason=reason)
        self.remove(sess, "disconnected")
        return True

    def connection_lost(self, sess: WorkerSession, failed: str) -> bool:
        """A heartbeat to ``sess`` failed (``failed``: why): True when its connection is gone and
        the session was removed (the caller hands its requests on)."""
        if failed != "unreachable" or self.pool.by_identity.get(sess.identity) is not sess:
            return False
        self.stats.workers["connection_lost"] += 1
        self.log.warning("worker_connection_lost", worker_id=sess.worker_id, inflight=len(sess.inflight))
        self.event("worker_connection_lost", worker_id=sess.worker_id)
        self.remove(sess, "connection_lost")
        return True

    def remove(self, sess: WorkerSession, why: str) -> None:
        """Take ``sess`` out of the pool (its requests are the caller's to hand on, then :meth:`unindex`)."""
        self.pool.remove(sess, why)
        if sess.worker_id not in self.pool.by_id:
            self.stats.forget_worker(sess.worker_id)
        self.forget_outcomes(sess)

    def unindex(self, sess: WorkerSession) -> None:
        """After a removal: the index forgets the worker, unless it registered again meanwhile."""
        if self.kv_sink is not None and sess.worker_id not in self.pool.by_id:
            self.kv_sink.on_worker_removed(sess.worker_id)

    def purge_expired(self, now: float, drained: bool) -> Iterator[WorkerSession]:
        """The liveness sweep, when due (only once ``drained``: what was queued is read before
        anyone is expired, unless a whole interval late): reinstates ejected workers whose time
        is up and yields each expired session once it is removed."""
        hb_s = self.s.heartbeat_ms / 1000.0
        if now < self.next_sweep_s or not (drained or now >= self.next_sweep_s + hb_s):
            return
        self.reinstate_due(now)
        for sess in self.pool.expired(now):
            self.stats.workers["expired"] += 1
            self.log.warning("worker_expired", worker_id=sess.worker_id, inflight=len(sess.inflight))
            self.event("worker_expired", worker_id=sess.worker_id, inflight=len(sess.inflight))
            self._out.to_worker(sess.identity, P.encode_disconnect("expired"))
            self.remove(sess, "expired")
            yield sess
        self.next_sweep_s = now + hb_s / 5

    def credit_stall(self, stall_s: float) -> None:
        """The shell's loop stalled for ``stall_s``: the broker's lateness is not the workers'
        silence, so every session's expiry moves by it."""
        for sess in self.pool.by_identity.values():
            sess.expiry_s += stall_s

    # -- heartbeats -----------------------------------------------------------------------
    def heartbeats(self, now: float) -> None:
        """The heartbeat slices due at ``now``; after a stall, every overdue slice goes out now
        (each session once per interval)."""
        if now < self.next_hb_s:
            return
        slice_s = self.s.heartbeat_ms / 1000.0 / HB_SLICES
        for _ in range(HB_SLICES):
            self.send_heartbeats()
            self.next_hb_s += slice_s
            if self.next_hb_s > now:
                break
        if self.next_hb_s <= now:
            self.next_hb_s = now + slice_s

    def send_heartbeats(self) -> None:
        """Heartbeat the sessions of the current slice (each session once per interval). A
        session whose connection is gone (ROUTER_MANDATORY: unreachable) is removed as soon as
        the send fails (:meth:`connection_lost`): its requests are retried then and its worker id
        is free for its reconnection."""
        slot = self._hb_slot
        self._hb_slot = (slot + 1) % HB_SLICES
        hb = P.encode_heartbeat()
        for sess in [s for s in self.pool.by_identity.values() if s.hb_slot == slot]:
            self._out.to_worker(sess.identity, hb, Receipt.HEARTBEAT, sess)

    # -- operators (the admin API) -------------------------------------------------------
    def admin(self, action: str, worker_id: str, now: float, for_s: float | None = None) -> WorkerSession:
        """An operator's action on one worker (see :meth:`BrokerCore.admin`); returns its session.
        Raises KeyError for an unknown worker and ValueError when its state does not allow it."""
        sess = self.pool.by_id.get(worker_id)
        if sess is None:
            raise KeyError(worker_id)
        st = sess.status
        if action == "drain":
            if st is not SessionState.DRAINING:
                self.pool.drain(sess, "operator")
                self.stats.workers["drained_by_operator"] += 1
        elif action == "eject":
            dur = self.s.eject_max_s if for_s is None else for_s
            if not (dur > 0 and dur <= 7 * 86400):
                raise ValueError("for_s must be in (0, 604800] seconds")
            if st is SessionState.EJECTED:
                sess.ejected_until_s = now + dur
            elif st is SessionState.ROUTABLE:
                self.pool.eject(sess, now + dur)
            else:
                raise ValueError(f"worker {worker_id} is {st.value}: only a routable or ejected worker can be ejected")
            self.stats.workers["ejected_by_operator"] += 1
        elif action == "reinstate":
            if st is SessionState.EJECTED:
                self._reinstate(sess)
            elif st is SessionState.DRAINING:
                if sess.drained_by != "operator":
                    raise ValueError(f"worker {worker_id} announced it is leaving: it cannot be reinstated")
                self.pool.undrain(sess)
            elif st is not SessionState.ROUTABLE:
                raise ValueError(f"worker {worker_id} is {st.value}: it becomes routable when it speaks")
            self.stats.workers["reinstated_by_operator"] += 1
        elif action == "admit":
            if not sess.quarantined:
                raise ValueError(f"worker {worker_id} is not quarantined")
            self.models.admit(sess.ready.model, now)
            self.pool.admit(sess)
            self.stats.workers["admitted_by_operator"] += 1
        else:
            raise ValueError(f"unknown action {action!r}: drain, eject, reinstate or admit")
        return sess
