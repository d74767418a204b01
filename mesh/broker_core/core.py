"""The broker's lifecycle as a sans-I/O state machine: the request table and the worker pool.

:class:`BrokerCore` takes decoded messages (or frames, decoded here by the pure decoders of
:mod:`mesh.protocol`) and timer ticks, each with the time ``now`` (monotonic seconds) it happens
at, and answers with the sends to make, appended to :attr:`BrokerCore.out` (see
:mod:`mesh.broker_core.sends`). It never reads a clock, never touches a socket and never
sleeps, so the same code runs in the broker process (``brokers/broker.py``: sockets, timers,
HTTP), in the simulator's virtual time (``mesh sim --faults``) and under the property-based
tests. Like h11's ``Connection`` or vLLM's ``EngineCore``: the shell pumps bytes, the core
decides.

Contracts it keeps (tested in tests/test_broker_core_stateful.py):

* **Exactly one terminal frame** (FINAL or ERROR) per accepted request.
* A request is re-dispatched (new attempt, another worker) only while nothing was streamed to
  its client, it is idempotent, attempts remain, the retry budget allows it and the deadline
  has not passed. Replies of a superseded attempt are dropped (``dropped{what=stale_reply}``).
* Chunks reach the client contiguously (``seq`` 0, 1, 2 ...); an out-of-order chunk is dropped.
* Requests and sessions move only along their transition tables, ``(from, to, why)`` triples
  (:data:`~mesh.broker_core.requests.REQUEST_TRANSITIONS`,
  :data:`~mesh.broker_core.pool.SESSION_TRANSITIONS`).

The only clocks it may be given are measurement seams: ``perf`` times routing decisions for the
``decision_latency`` histogram and the KV backlog's work budget is a caller-supplied clock.

:class:`BrokerCore` is a facade over collaborators, with arrows pointing one way (down this list):

* :class:`~mesh.broker_core.replies.Replies`: workers' CHUNK / FINAL / ERROR, the P/D legs;
* :class:`~mesh.broker_core.table.RequestTable`: park, retry, deadlines, progress, the one
  terminal reply;
* :class:`~mesh.broker_core.workers.Workers`: READY, liveness, ejection, heartbeats, drain and
  admin; it *returns* the sessions it removes, and the facade hands their requests to the table;
* :class:`~mesh.broker_core.status.Status`: STATUS, the model catalog, per-worker views;
* :class:`~mesh.broker_core.intake.Intake`: quotas, model aliases, capacity and context refusals;
* :class:`~mesh.broker_core.kv_backlog.KvBacklog`: KV events to the index, large ones in slices.

The facade keeps the inputs, routing an attempt (:meth:`BrokerCore._dispatch`) and the timers.
"""

from __future__ import annotations

from typing import Any, Callable

from mesh import protocol as P
from mesh.broker_core.counters import BrokerStats
from mesh.broker_core.intake import Intake
from mesh.broker_core.kv_backlog import KvBacklog
from mesh.broker_core.pool import SessionState, WorkerPool, WorkerSession
from mesh.broker_core.recorder import DecisionRecorder
from mesh.broker_core.replies import Replies
from mesh.broker_core.requests import Inflight, RequestState, move
from mesh.broker_core.sends import Outbox, Receipt, Send
from mesh.broker_core.status import Status
from mesh.broker_core.table import RequestTable
from mesh.broker_core.workers import Workers
from mesh.config import BrokerSettings
from mesh.errors import ErrorCode, ProtocolError
from mesh.logs import RateLimiter, get_logger
from mesh.routing.view import WorkerState

__all__ = ["BrokerCore"]

_R = RequestState
_KV_EVENTS_CMD = bytes([P.Cmd.KV_EVENTS])


class BrokerCore:
    """Request table + worker pool. Feed it inputs with ``now``; send what lands in :attr:`out`.

    Inputs: :meth:`client_frames`, :meth:`submit`, :meth:`cancel_client`, :meth:`worker_frames`,
    :meth:`matched`, :meth:`resync`, :meth:`tick`, :meth:`send_failed`, :meth:`begin_drain`,
    :meth:`fail_all`. Outputs: :attr:`out` (sends), :attr:`prefetch` (requests whose async prefix
    match the shell must run, then call :meth:`matched`). Seams (all optional): ``perf`` (a
    clock for the decision-latency histogram only; without it decisions take no time), ``on_event`` (telemetry events),
    ``on_new_worker`` (a new session's routing state, e.g. to join the peer exchange),
    ``view_degraded`` (True while peers' figures are stale), ``status_extra`` (more STATUS fields),
    ``recorder`` (``--record-decisions``: :class:`~mesh.broker_core.recorder.DecisionRecorder`).
    Views: :attr:`status` (STATUS, the model catalog, per-worker entries), :attr:`pool`.
    """

    def __init__(
        self,
        settings: BrokerSettings,
        router: Any,
        *,
        broker_id: str = "broker",
        stats: BrokerStats | None = None,
        log: Any = None,
        kv_sink: Any = None,
        worker_keys: dict[bytes, str] | None = None,
        perf: Callable[[], float] | None = None,
        on_event: Callable[..., None] | None = None,
        on_new_worker: Callable[[WorkerState], None] | None = None,
        view_degraded: Callable[[], bool] | None = None,
        status_extra: Callable[[float], dict] | None = None,
        status_full: Callable[[bytes], bool] | None = None,
        recorder: DecisionRecorder | None = None,
    ) -> None:
        self.s = settings
        self.router = router
        self.broker_id = broker_id
        self.stats = stats if stats is not None else BrokerStats()
        self.log = log if log is not None else get_logger(service="broker", broker_id=broker_id)
        self.kv_sink = kv_sink
        self.perf = perf if perf is not None else _no_clock  # the shell hands it time.perf_counter
        self.view_degraded = view_degraded
        self.async_provider = bool(getattr(router.provider, "is_async", False))
        sessions = getattr(router, "session_table", None)
        if sessions is not None:  # session affinity counts into the broker's counters (mesh_sessions)
            sessions.stats = self.stats.sessions
        self._limiter = RateLimiter(1.0)
        outbox = Outbox()
        self.out: list[Send] = outbox.sends  # drained in place by the shell (see sends.deliver)
        self.prefetch: list[Inflight] = []
        self.state = "init"  # init -> serving -> draining -> closed (the shell closes)
        self.drain_deadline_s = float("inf")
        self.started_s = 0.0
        self.loop_lag_s = 0.0  # set by the shell: its loop's lag average (load shedding)
        # the collaborators, each pointing only at those made before it (and the table back at
        # _dispatch: a parked or retried request, or one a freed slot unparks, is routed here)
        self.pool = WorkerPool()
        common = (self.stats, self.log, self._limiter, outbox)  # counters, log, rate limiter, sends
        self.intake = Intake(settings, self.pool, self.stats)
        self.status = Status(settings, self.pool, self.intake, self.stats, router, broker_id, status_extra,
                             full_allowed=status_full)
        self.kv = KvBacklog(kv_sink, self.pool, *common)
        self.workers = Workers(settings, self.pool, *common, kv_sink=kv_sink, worker_keys=worker_keys, on_event=on_event,
                               on_new_worker=on_new_worker, models=self.intake.models)
        self.table = RequestTable(settings, router, self.pool, self.workers, self.intake, *common, dispatch=self._dispatch)
        self.replies = Replies(router, self.pool, self.table, self.workers, self.status, *common)
        self._out = outbox
        self.recorder = recorder  # --record-decisions: the first decision and the outcome of every routed request
        if recorder is not None:
            self.table.on_done = recorder.finished
        self.kv_backlog = self.kv.queue  # truthy while KV batches wait for run_kv_backlog
        self.inflight = self.table.inflight  # rid -> request (the same dict, read-only outside)
        self.parked = self.table.parked
        self.budget = self.table.budget

    # ------------------------------------------------------------------ lifecycle
    def start(self, now: float) -> None:
        """Start serving at ``now``: the heartbeat and sweep timers count from here."""
        self.table.now = self.started_s = now
        self.workers.start(now)
        self.state = "serving"
        if self.recorder is not None and self.recorder.file_index < 0:  # (the shell may have opened it already)
            self.recorder.start(now)

    def begin_drain(self, now: float) -> None:
        """Stop accepting requests; in-flight ones get ``drain_timeout_s`` to finish (idempotent)."""
        if self.state == "serving":
            self.state = "draining"
            self.drain_deadline_s = now + self.s.drain_timeout_s
            self.log.info("broker_draining", inflight=len(self.inflight))

    def drain_over(self, now: float) -> bool:
        """Draining and nothing is left (or the drain timed out): fail the rest; the shell stops."""
        if self.state != "draining" or (self.inflight and now < self.drain_deadline_s):
            return False
        self.fail_all(ErrorCode.UNAVAILABLE, "broker shut down before the request finished", now)
        return True

    def fail_all(self, code: ErrorCode, message: str, now: float) -> None:
        self.table.now = now
        self.table.fail_all(code, message)

    def take(self) -> list[Send]:
        """The sends appended since the last take (the shell sends them in order)."""
        out = self.out[:]
        self.out.clear()
        return out

    def send_failed(self, send: Send, now: float) -> None:
        """The shell could not make ``send`` (``send.failed`` says why): act on what it meant."""
        self.table.now = now
        if send.receipt is Receipt.HEARTBEAT:
            if self.workers.connection_lost(send.ref, send.failed):
                self._lost(send.ref, now, "connection_lost")
        elif send.receipt:
            self.table.send_failed(send, now)

    def _reject(self, path: str, err: ProtocolError, peer: bytes) -> None:
        self.stats.frames_rejected[(path, err.reason)] += 1
        if self._limiter.allow((path, err.reason, peer), self.table.now):
            self.log.warning("frame_rejected", path=path, reason=err.reason, detail=err.detail[:200], peer=peer.hex()[:32])

    # ------------------------------------------------------------------ client path
    def client_frames(self, frames: list[bytes], now: float, quota_key: bytes | None = None, *, local: bool = False,
                      tenant: str | None = None) -> None:
        """``[identity, *message frames]`` from a client (decoded here; never raises on bad input).
        ``tenant``: the one its connection's CURVE key maps to (None: the ZeroMQ clients' tenant).

        ``local``: an in-process (HTTP) client, whose identities start with a zero byte and are
        longer than 5 bytes. From a socket such an identity is refused and counted, never
        answered: a remote peer may set that ROUTING_ID (libzmq does not forbid it), and replies
        to it would reach a local client."""
        self.table.now = now
        if len(frames) < 2:
            self.stats.frames_rejected[("client", "bad_frame_count")] += 1
            return
        ident = frames[0]
        if not local and ident[:1] == b"\x00" and len(ident) > 5:
            self.stats.frames_rejected[("client", "reserved_identity")] += 1
            if self._limiter.allow(("client", "reserved_identity"), now):
                self.log.warning("frame_rejected", path="client", reason="reserved_identity", peer=ident.hex()[:32])
            return
        msg = P.decode_client(frames[1:])
        if isinstance(msg, P.Submit):
            if not local and not (self.s.trust_client_tenant and msg.tenant is not None):
                # a ZeroMQ client runs as its key's tenant, else the ZeroMQ clients' (a trusted gateway's stamp is kept)
                if msg.tenant is not None and msg.tenant != tenant:
                    self.stats.tenants[(tenant or self.intake.tenants.zmq_tenant, "tenant_field_ignored")] += 1
                msg.tenant = tenant
            self.submit(ident, msg, now, quota_key)
        elif isinstance(msg, P.Cancel):
            self.table.cancel(ident, msg.rid)
        elif isinstance(msg, P.StatusQuery):  # bounded, rate-limited per identity (Status.answer)
            self._out.to_client(ident, self.status.answer(ident, msg, now, lambda: self.status.broker(
                now, self.state, len(self.inflight), self.started_s, self.loop_lag_s)))
        else:
            self._reject("client", msg, ident)
            # Answer when the sender can be identified: a client path header means a client.
            rid = _salvage_rid(frames[1:])
            if frames[1] == P.CLIENT_HEADER:
                self.stats.requests[ErrorCode.BAD_REQUEST.value] += 1
                self._out.to_client(ident, P.encode_client_error(rid, ErrorCode.BAD_REQUEST, str(msg)))
            elif frames[1] == P.WORKER_HEADER and self._limiter.allow(("worker_on_client_port", ident), now):
                # a worker pointed at the client port: tell it (in its own protocol), at most once a second
                self._out.to_client(ident, P.encode_disconnect(WRONG_PORT_FOR_WORKERS))

    def submit(self, ident: bytes, sub: P.Submit, now: float, quota_key: bytes | None = None) -> None:
        """A decoded SUBMIT from client ``ident``; ``quota_key`` is who it counts against for
        ``max_inflight_per_client`` (default: the client itself)."""
        self.table.now = now
        if (ident, sub.rid) in self.table.by_client:
            refusal: tuple[ErrorCode, str] | None = (ErrorCode.DUPLICATE, "a request with this rid is in flight")
        elif self.state != "serving":
            refusal = (ErrorCode.UNAVAILABLE, "broker is draining")
        elif len(self.inflight) >= self.s.max_inflight:
            refusal = (ErrorCode.OVERLOADED, "broker in-flight limit reached")
        else:
            refusal = self.intake.refusal(quota_key if quota_key is not None else ident, sub, self.loop_lag_s)
        tenant = self.intake.tenant_of(sub)
        if refusal is None:
            refusal = self.intake.tenant_refusal(tenant, sub, now)
        if refusal is not None:
            code, message = refusal
            self.stats.requests[code.value] += 1
            self._out.to_client(ident, P.encode_client_error(sub.rid, code, message))
            return
        inf = self.table.add(ident, sub, now, quota_key if quota_key is not None else ident)
        inf.tenant, inf.band, inf.weight = tenant.name, sub.priority, tenant.weight
        self.intake.ledger.admit(tenant.name)
        if self.async_provider:
            if self.table.prepare_route(inf):
                move(inf, _R.PREFETCHING, "prefix_match")
                self.prefetch.append(inf)
            return
        self._dispatch(inf, now)

    def matched(self, rid: int, now: float) -> None:
        """The async prefix match of request ``rid`` is in (or failed): route it now."""
        self.table.now = now
        inf = self.inflight.get(rid)
        if inf is not None and inf.state is _R.PREFETCHING:
            self._dispatch(inf, now)

    def cancel_client(self, ident: bytes, now: float) -> None:
        """An in-process (HTTP) client went away: cancel every request it has in flight."""
        self.table.now = now
        self.table.fail_all(ErrorCode.CANCELLED, "HTTP client went away", ident)

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self, inf: Inflight, now: float) -> None:
        """Route and send one attempt; on failure to find a worker, park, retry or fail.

        Prefill/decode mode: the first leg goes to the prefill worker (bootstrap mode
        ``prefill``); its FINAL ``prefill_done`` hands the request to the decode worker chosen
        with it (:meth:`Replies.send_decode`). A decode leg that fails before any chunk is re-sent
        to another decode worker; the prefill leg is retried whole. A REQUEST the shell cannot
        deliver comes back through :meth:`send_failed` and is routed again, to another worker.
        """
        if inf.phase == "decode":
            self.replies.send_decode(inf, now)
            return
        table = self.table
        model, refusal = self.intake.model_for(inf.submit, now)
        if refusal is not None:
            table.finish_error(inf, *refusal)
            return
        inf.model = model
        pool = self.pool.pool(model)
        cap = self.s.max_inflight_per_worker
        # Workers at their in-flight cap are not candidates (the policy would happily pick a
        # cache holder that is full); when every worker is, wait in the bounded queue.
        full = {w.worker_id for w in pool if w.inflight >= cap} if cap else set()
        if full and len(full) == len(pool):
            table.park_or_overload(inf, now)
            return
        if not inf.capacity_checked and not table.prepare_route(inf):
            return
        req = inf.route_req
        t0 = self.perf()
        exclude = inf.tried | full if full else inf.tried
        lora = self.intake.lora_of(inf.submit, model)
        if lora is not None:
            exclude = self.intake.lora_exclusions(lora, pool, exclude)
        decision = self.router.route(req, pool, now, exclude=exclude)
        self.stats.decision_latency.observe(self.perf() - t0)
        if decision.worker_id is None:
            if decision.reason == "bad_slo":
                table.finish_error(inf, ErrorCode.BAD_REQUEST, "invalid SLO")
                return
            if full - inf.tried:
                table.park_or_overload(inf, now)  # an untried worker is only full: wait for its slot
                return
            if not pool and table.park(inf, now):
                return  # no worker yet (startup, restart, fleet loss): wait briefly for one
            if inf.tried:
                code = ErrorCode(inf.fail_cause) if inf.fail_cause else ErrorCode.UNAVAILABLE
                table.finish_error(inf, code, f"no other worker after {inf.attempt} attempt(s); last: {inf.fail_cause or 'failed'}"
                                   + (f": {inf.fail_message}" if inf.fail_message else ""))
            else:
                table.finish_error(inf, ErrorCode.NO_WORKER, "no routable worker" if not pool
                                   else decision.detail.get("session_error", decision.reason))
            return
        self.stats.decisions[decision.reason] += 1
        if lora is not None:
            self.intake.count_lora(lora, decision.worker_id)
        if self.view_degraded is not None and self.view_degraded():
            self.stats.exchange["decisions_peer_stale"] += 1  # routed on this broker's own view
        dr = decision.detail.get("decode_reason")
        if dr:
            self.stats.decisions[f"decode_{dr}"] += 1
        if decision.dp_rank is not None:  # DP attention: why this rank (mesh.routing.ranks)
            self.stats.decisions[f"dp_rank_{decision.detail.get('rank_reason', 'unknown')}"] += 1
        if decision.degraded:
            self.stats.degraded_decisions += 1
        sess = self.pool.by_id[decision.worker_id]
        inf.attempt += 1
        inf.tried.add(sess.worker_id)
        bootstrap = None
        if decision.decode_worker_id is not None:
            inf.phase = "prefill"
            inf.room = int(decision.detail.get("bootstrap_room") or inf.rid)
            bootstrap = {"mode": "prefill", "room": inf.room, "decode_worker": decision.decode_worker_id}
        remaining_ms = max(1, int((inf.deadline_s - now) * 1000))
        frames = P.encode_request(inf.rid, inf.attempt, remaining_ms, inf.client_rid, inf.submit.raw, bootstrap,
                                  lora=lora, dp_rank=decision.dp_rank)
        inf.decision = decision
        if self.recorder is not None:
            self.recorder.decided(inf, decision, now)
        move(inf, _R.DISPATCHED, "routed")
        inf.session = sess
        inf.reason = decision.reason
        sess.inflight.add(inf.rid)
        table.watch_progress(inf, now)
        if inf.attempt == 1:
            (sess.lat.get("queue") or sess.histogram("queue", self.stats)).observe(now - inf.accepted_s)
            self.stats.tenant_queue_wait(inf.tenant, now - inf.accepted_s)
        sent = self._out.to_worker(sess.identity, frames, Receipt.DISPATCH, inf, inf.attempt)
        if inf.submit.stream:
            self._out.to_client(inf.client, P.encode_accepted(inf.client_rid, sess.worker_id, decision.reason, inf.attempt), when=sent)

    # ------------------------------------------------------------------ worker path
    def worker_frames(self, frames: list[bytes], now: float, peer_key: bytes | None = None) -> None:
        """``[identity, *message frames]`` from a worker (decoded here; never raises on bad
        input). ``peer_key`` is the CURVE public key its connection authenticated with."""
        self.table.now = now
        if len(frames) < 2:
            self.stats.frames_rejected[("worker", "bad_frame_count")] += 1
            return
        ident = frames[0]
        if len(frames) == 4 and frames[2] == _KV_EVENTS_CMD:  # KV work is budgeted before it is decoded
            sess = self.pool.by_identity.get(ident)
            if sess is None:
                self._unregistered(ident, now)
                return
            self._alive(sess, now)  # any inbound message is liveness, a refused batch too
            if not self.kv.admit(sess, now):
                return
        msg = P.decode_worker(frames[1:])
        if isinstance(msg, ProtocolError):
            self._reject("worker", msg, ident)
            return
        self.worker_message(ident, msg, now, peer_key)

    def _alive(self, sess: WorkerSession, now: float) -> None:
        sess.expiry_s = now + self.workers.expiry_s(sess)
        sess.last_seen_s = now

    def _unregistered(self, ident: bytes, now: float) -> None:
        """Unknown peer (e.g. we restarted and its TCP connection came back): ask it to re-register."""
        self.stats.frames_rejected[("worker", "unregistered_peer")] += 1
        if self._limiter.allow(("unregistered_reply", ident), now):  # at most once a second per peer
            self._out.to_worker(ident, P.encode_disconnect("not registered; send READY"))

    def worker_message(self, ident: bytes, msg: Any, now: float, peer_key: bytes | None = None) -> None:
        """A decoded worker message (the simulator's workers hand these over without encoding)."""
        self.table.now = now
        sess = self.pool.by_identity.get(ident)
        if sess is None:
            if isinstance(msg, P.Ready):
                self._on_ready(ident, msg, now, peer_key)
            elif not isinstance(msg, P.Disconnect):
                self._unregistered(ident, now)
            return
        self._alive(sess, now)
        t = type(msg)
        if sess.status is SessionState.REGISTERED and t is not P.Disconnect:
            self.workers.confirm(sess)  # (a first message that says goodbye confirms nothing)
            if self.parked:
                self.table.unpark(now)
        if t is P.WorkerFinal:
            self.replies.final(sess, msg, now)
        elif t is P.WorkerChunk:
            self.replies.chunk(sess, msg, now)
        elif t is P.Heartbeat:
            if msg.load:
                sess.state.update_load(msg.load, now)
            if msg.loras is not None:
                self.workers.update_loras(sess, msg.loras)
        elif t is P.KvEventsMsg:
            self.kv.on_kv_events(sess, msg, now)
        elif t is P.WorkerError:
            self.replies.error(sess, msg, now)
        elif t is P.Disconnect:
            if self.workers.disconnect(sess, msg.reason):
                self._lost(sess, now, "disconnected")
        elif t is P.Ready:
            if msg.worker_id == sess.worker_id and msg.epoch == sess.ready.epoch:
                # The same registration again (a worker that missed our first heartbeat, or one
                # that re-sent READY after a stall): acknowledge it, keep its requests and index.
                self.stats.workers["ready_repeated"] += 1
                if sess.draining and sess.drained_by == "worker":  # it drained itself and is back (DNS: issue 32)
                    self.pool.undrain(sess)
                    self.stats.workers["undrained_by_worker"] += 1
                self._out.to_worker(ident, P.encode_heartbeat())
                return
            # A different identity on a live session is a protocol violation: make it start over.
            self.stats.frames_rejected[("worker", "duplicate_ready")] += 1
            self._out.to_worker(ident, P.encode_disconnect("duplicate READY"))
            self.workers.remove(sess, "duplicate_ready")
            self._lost(sess, now, "duplicate_ready")

    def _on_ready(self, ident: bytes, r: P.Ready, now: float, peer_key: bytes | None) -> None:
        sess, old = self.workers.register(ident, r, now, peer_key)
        if sess is None:
            return
        if old is not None:
            self.table.orphan(old, now, "worker_replaced")
        self.workers.welcome(sess, old)
        if self.parked:
            self.table.unpark(now)

    def _lost(self, sess: WorkerSession, now: float, why: str) -> None:
        """``sess`` was taken out of the pool: its requests are retried or failed, then the index forgets it."""
        self.table.orphan(sess, now, why)
        self.workers.unindex(sess)

    def admin(self, action: str, worker_id: str, now: float, *, for_s: float | None = None) -> dict:
        """An operator's action on one worker: ``drain`` (no new requests; what it holds
        finishes), ``eject`` (no new requests for ``for_s``, default ``eject_max_s``, then it is
        reinstated; in-flight requests finish), ``reinstate`` (routable again: an ejected worker,
        or one an operator drained), ``admit`` (a quarantined worker and its model:
        :mod:`mesh.broker_core.models`). Returns the worker's status entry. Raises KeyError for an
        unknown worker and ValueError when its state does not allow the action (a worker that
        announced it is leaving cannot be reinstated; an unconfirmed one cannot be ejected)."""
        self.table.now = now
        sess = self.workers.admin(action, worker_id, now, for_s)
        if action in ("reinstate", "admit") and self.parked:
            self.table.unpark(now)
        self.log.info("worker_admin", worker_id=worker_id, action=action, state=sess.status.value)
        self.workers.event("worker_admin", worker_id=worker_id, action=action, state=sess.status.value)
        return self.status.worker_status(sess, now)

    def resync(self, worker_id: str, dp_rank: int, why: str, now: float) -> None:
        """The shared indexer asks for a worker's full KV state again."""
        self.table.now = now
        sess = self.pool.by_id.get(worker_id)
        if sess is not None:
            self.kv.resync(sess.identity, dp_rank, why)

    def run_kv_backlog(self, clock: Callable[[], float], budget_s: float) -> None:
        """Apply queued KV batches until ``clock()`` has advanced ``budget_s`` (see :meth:`KvBacklog.run`)."""
        self.kv.run(clock, budget_s)

    def credit_stall(self, stall_s: float) -> None:
        """The shell's loop stalled for ``stall_s``: every session's expiry moves by it."""
        self.workers.credit_stall(stall_s)

    # ------------------------------------------------------------------ timers
    def tick(self, now: float, drained: bool = True) -> None:
        """Run whatever is due at ``now``: heartbeats, expiry (only once ``drained``: what was
        queued is read before anyone is expired, unless a whole interval late), deadlines,
        retries, parked requests' waits and progress checks."""
        self.table.now = now
        self.workers.heartbeats(now)
        for sess in self.workers.purge_expired(now, drained):
            self._lost(sess, now, "expired")
        self.table.tick(now)

    def wakeup_s(self) -> float:
        """When :meth:`tick` next has something to do (monotonic seconds; inf: nothing)."""
        return self.table.wakeup_s(min(self.workers.next_hb_s, self.workers.next_sweep_s))

    @property
    def client_quotas(self) -> dict[bytes, int]:
        """Quota key -> requests it has in flight (``max_inflight_per_client``); a copy."""
        return dict(self.intake.quotas)

    @property
    def pending_deadlines(self) -> int:
        """Deadline entries in the timer heap (finished requests' entries are dropped lazily)."""
        return len(self.table.deadlines)


def _no_clock() -> float:
    return 0.0


#: The DISCONNECT a worker gets when it registers on a client port (logged on its side).
WRONG_PORT_FOR_WORKERS = "this is a broker's client port: point workers at its worker endpoint (the broker's --backend)"


def _salvage_rid(frames: list[bytes]) -> str | None:
    """Best effort: the rid of a rejected SUBMIT, so the error can name it."""
    if len(frames) < 3:
        return None
    try:
        d = P.unpack(frames[2])
    except ProtocolError:
        return None
    rid = d.get("rid") if isinstance(d, dict) else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= P.MAX_RID_BYTES else None
