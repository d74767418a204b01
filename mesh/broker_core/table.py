"""The request table: accepted requests, their timers and their one terminal reply (pure: no I/O,
no clock).

It parks requests (one bounded FIFO queue, timed), schedules retries (back-off, retry budget),
enforces deadlines, watches that a dispatched attempt hears from its worker (progress), undoes
the routing bookkeeping of an attempt that ends, and finishes each request exactly once. It
reads the worker pool and tells :class:`~mesh.broker_core.workers.Workers` how attempts went
(outlier ejection); it never registers or removes a session: a removed session's requests are
handed to :meth:`RequestTable.orphan`. Routing an attempt is the facade's
(:meth:`BrokerCore._dispatch`), handed in as ``dispatch``: a parked or retried request is routed
through it, and so is the parked one served next when a finished request frees a worker slot.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
from typing import Any, Callable

from mesh import protocol as P
from mesh.broker_core import migrate
from mesh.broker_core.counters import BrokerStats
from mesh.broker_core.intake import Intake
from mesh.broker_core.park import ParkQueue
from mesh.broker_core.pool import WorkerPool, WorkerSession
from mesh.broker_core.requests import Inflight, RequestState, move
from mesh.broker_core.sends import Outbox, Receipt, Send
from mesh.broker_core.workers import Workers
from mesh.config import BrokerSettings
from mesh.errors import ErrorCode
from mesh.logs import RateLimiter
from mesh.retry import RetryBudget, RetryPolicy
from mesh.routing.view import Decision

__all__ = ["RequestTable"]

_R = RequestState
_SLOW_PREFILL_TOKENS_PER_S = 5000.0  # a pessimistic prefill rate for the progress window


class RequestTable:
    """Requests by rid and by (client, client rid); park queue, retry, deadline and progress timers."""

    def __init__(self, settings: BrokerSettings, router: Any, pool: WorkerPool, workers: Workers, intake: Intake,
                 stats: BrokerStats, log: Any, limiter: RateLimiter, outbox: Outbox,
                 dispatch: Callable[[Inflight, float], None]) -> None:
        self.s = settings
        self.router = router
        self.pool = pool
        self.workers = workers
        self.intake = intake
        self.stats = stats
        self.log = log
        self._limiter = limiter
        self._out = outbox
        self._dispatch = dispatch
        self.retry = RetryPolicy(settings.max_attempts, settings.retry_base_ms, settings.retry_cap_ms)
        self.budget = RetryBudget(settings.retry_budget_ratio, settings.retry_budget_min)
        self.now = 0.0  # the time of the input being handled (set by the facade)
        # every request that ends: (request, outcome "ok" or an error code, usage, now) -- the decision recorder
        self.on_done: Callable[[Inflight, str, dict | None, float], None] | None = None
        self.inflight: dict[int, Inflight] = {}
        self.by_client: dict[tuple[bytes, str], int] = {}
        self._rid_seq = itertools.count(1)
        self.deadlines: list[tuple[float, int]] = []
        self.parked = ParkQueue(settings.park_aging_s)  # requests waiting for a worker (bands, fair shares)
        self._park_timers: list[tuple[float, int]] = []
        self._retries: list[tuple[float, int]] = []
        self._progress: list[tuple[float, int, int]] = []  # (due_s, rid, attempt): no-progress checks
        self._bulk = False  # finishing several requests in one loop (see bulk_teardown)

    def add(self, ident: bytes, sub: P.Submit, now: float, quota: bytes) -> Inflight:
        """Accept a SUBMIT (the caller checked it may run): in the table, its deadline armed."""
        budget_ms = sub.deadline_ms or self.s.default_deadline_ms
        rid = next(self._rid_seq)
        inf = Inflight(rid, ident, sub.rid, sub, now + budget_ms / 1000.0)
        inf.accepted_s = now
        self.inflight[rid] = inf
        self.by_client[(ident, sub.rid)] = rid
        inf.quota = quota
        if sub.stream:  # only a stream commits output before its end (a migration's precondition)
            inf.unmigratable = migrate.refusal(sub) or "" if self.s.max_migrations else "disabled"
            if not inf.unmigratable:
                inf.streamed = []
        self.intake.admit(quota)
        heapq.heappush(self.deadlines, (inf.deadline_s, rid))
        return inf

    def cancel(self, ident: bytes, client_rid: str) -> None:
        rid = self.by_client.get((ident, client_rid))
        if rid is None:
            self.stats.dropped["cancel_unknown"] += 1
            return
        self.finish_error(self.inflight[rid], ErrorCode.CANCELLED, "cancelled by client", cancel_worker=True)

    def prepare_route(self, inf: Inflight) -> bool:
        """Check the request can run at all, then build its routing view (once); False: it was
        refused and is finished. While no worker has registered there is no capacity to check
        against: the check is repeated at every dispatch until one has (a prompt parked at
        startup, or while the fleet was gone, is refused when workers come, not sent to one)."""
        refusal = self.intake.context_refusal(inf.submit, inf.model)
        if refusal is not None:
            self.finish_error(inf, *refusal)
            return False
        inf.capacity_checked = self.intake.fleet_capacity(inf.model) > 0
        if inf.route_req is None:
            inf.route_req = self.intake.route_request(inf, self.router.policy.needs_match)
        return True

    @contextlib.contextmanager
    def bulk_teardown(self):
        """While several requests are finished in one loop, a freed worker slot unparks nobody
        (it could dispatch, or finish, a request later in that very loop); what is still parked
        afterwards is dispatched once, at the end."""
        self._bulk = True
        try:
            yield
        finally:
            self._bulk = False
        if self.parked and self.s.max_inflight_per_worker:
            self.unpark(self.now)

    # ------------------------------------------------------------------ progress
    def _progress_window_s(self, inf: Inflight) -> float:
        """How long an attempt may go without a word: ``progress_timeout_ms`` plus its prompt at
        a slow prefill rate (a 400k-token prompt may legitimately take a minute to first token)."""
        req = inf.route_req
        n = req.prompt_tokens if req is not None else 0
        return self.s.progress_timeout_ms / 1000.0 + n / _SLOW_PREFILL_TOKENS_PER_S

    def watch_progress(self, inf: Inflight, now: float) -> None:
        """A dispatched attempt must hear from its worker within its progress window."""
        inf.replied = False
        inf.sent_s = now
        if self.s.progress_timeout_ms:
            heapq.heappush(self._progress, (now + self._progress_window_s(inf), inf.rid, inf.attempt))

    def _check_progress(self, now: float) -> None:
        """Attempts that heard nothing in their window, from a worker that answered *nothing at
        all* meanwhile: it holds requests it does not serve (heartbeats prove its loop, not its
        engine). A busy worker that keeps answering other requests is only slow: the check is
        re-armed. A failed check counts against the worker, and the attempt is retried elsewhere
        while nothing was streamed."""
        rearm = []  # pushed after the sweep: a re-arm that rounds to <= now must not be popped again (livelock)
        while self._progress and self._progress[0][0] <= now:
            _, rid, attempt = heapq.heappop(self._progress)
            inf = self.inflight.get(rid)
            if inf is None or inf.attempt != attempt or inf.session is None or inf.replied:
                continue
            sess = inf.session
            window_s = self._progress_window_s(inf)
            if now - sess.last_reply_s < window_s:
                rearm.append((max(sess.last_reply_s + window_s, now + 1e-6), rid, attempt))
                continue
            self.stats.workers["no_progress"] += 1
            if self._limiter.allow(("no_progress", sess.worker_id), now):
                self.log.warning("worker_no_progress", worker_id=sess.worker_id, request_id=inf.client_rid,
                                 attempt=attempt, timeout_ms=self.s.progress_timeout_ms)
            self._out.to_worker(sess.identity, P.encode_worker_cancel(inf.rid, inf.attempt))
            self.workers.note_outcome(sess, True, now)
            self.workers.note_failure(sess, now)
            self.retry_or_fail(inf, ErrorCode.WORKER_ERROR,
                               f"worker {sess.worker_id} sent nothing for {self.s.progress_timeout_ms} ms", now)
        for e in rearm:
            heapq.heappush(self._progress, e)

    # ------------------------------------------------------------------ routing bookkeeping
    def _release(self, inf: Inflight, sess: WorkerSession | None) -> None:
        """Undo the routing bookkeeping of the current leg (both sides while the prefill leg runs)."""
        d = inf.decision
        if d is None:
            return
        inf.decision = None
        if inf.phase == "decode":
            ds = self.pool.by_id.get(d.decode_worker_id or "")
            if ds is not None:
                self.router.release(ds.state, d)
            return
        if sess is not None:
            self.router.release(sess.state, d)
        if inf.phase == "prefill" and d.decode_worker_id:
            ds = self.pool.by_id.get(d.decode_worker_id)
            if ds is not None:
                self.router.release(ds.state, d)

    def release_decision(self, d: Decision) -> None:
        """Undo a decision that will not be used (both sides)."""
        for wid in (d.worker_id, d.decode_worker_id):
            s = self.pool.by_id.get(wid or "")
            if s is not None:
                self.router.release(s.state, d)

    def detach(self, inf: Inflight) -> None:
        sess = inf.session
        if sess is not None:
            sess.inflight.discard(inf.rid)
            self._release(inf, sess)
            inf.session = None
        elif inf.decision is not None:
            self._release(inf, None)

    # ------------------------------------------------------------------ park
    def park_or_overload(self, inf: Inflight, now: float) -> None:
        """Every worker this request may use is at its in-flight cap: queue it, or refuse 429."""
        if not self.park(inf, now, saturated=True):
            self.finish_error(inf, ErrorCode.OVERLOADED, "every worker is at capacity and the wait queue is full or timed out")

    def park(self, inf: Inflight, now: float, *, saturated: bool = False) -> bool:
        """Hold a request while no worker is routable (``park_timeout_s``) or every worker is at
        its in-flight cap (``queue_timeout_s``), in one bounded queue served by priority band
        with aging and fair shares between tenants (:class:`~mesh.broker_core.park.ParkQueue`).

        Returns False when it cannot wait (queue full, or its wait is over)."""
        if inf.parked_until_s is None:
            if len(self.parked) >= self.s.max_parked:
                victim = self.inflight.get(self.parked.evictable(inf.tenant))  # type: ignore[arg-type]
                if victim is None:
                    self.stats.dropped["park_queue_full"] += 1
                    return False
                self.stats.dropped["park_queue_evicted"] += 1  # a flooding tenant gives up its newest place
                self.finish_error(victim, ErrorCode.OVERLOADED, "the wait queue is full and this tenant holds the most of it")
            wait_s = self.s.queue_timeout_s if saturated else self.s.park_timeout_s
            inf.parked_until_s = min(inf.deadline_s, now + wait_s)
        elif now >= inf.parked_until_s:
            return False
        move(inf, _R.PARKED, "saturated" if saturated else "no_worker")
        if inf.parked_s is None:
            inf.parked_s = now
        self.parked.push(inf.rid, now, inf.band, inf.tenant, inf.weight, inf.parked_s)
        heapq.heappush(self._park_timers, (inf.parked_until_s, inf.rid))
        self.stats.requests_parked += 1
        return True

    def _unpark_one(self, now: float) -> None:
        """A worker slot freed: give it to the request the park queue serves next."""
        while self.parked:
            rid = self.parked.pop(now)
            inf = self.inflight.get(rid)  # type: ignore[arg-type]
            if inf is not None:
                self._dispatch(inf, now)
                return

    def unpark(self, now: float, *, expired_only: bool = False) -> None:
        """Re-dispatch parked requests (a worker became routable) or fail the expired ones."""
        if expired_only:
            while self._park_timers and self._park_timers[0][0] <= now:
                _, rid = heapq.heappop(self._park_timers)
                if self.parked.remove(rid):  # still parked
                    inf = self.inflight.get(rid)
                    if inf is not None:
                        self._dispatch(inf, now)
            return
        for rid in self.parked.drain(now):
            inf = self.inflight.get(rid)
            if inf is not None:
                self._dispatch(inf, now)

    # ------------------------------------------------------------------ retry
    def retry_or_fail(self, inf: Inflight, code: ErrorCode, message: str, now: float, *, budgeted: bool = True) -> None:
        """A dispatched attempt failed without output. Re-dispatch after a back-off, or fail.

        A failed prefill leg is retried whole; a failed decode leg only re-sends the decode.
        ``budgeted=False`` for requests displaced by a worker that announced it was leaving
        (graceful drain) or was lost: a planned move, or one each request takes at most
        ``max_attempts`` times, so it does not draw on the retry budget that protects against
        retry storms (attempts and the deadline still bound it)."""
        self.detach(inf)
        if inf.phase == "prefill":
            inf.phase = "mixed"
        inf.fail_cause = code.value
        inf.fail_message = message[:400]
        if inf.committed:  # it streamed output: continue it on another worker, or end it
            self.migrate_or_fail(inf, code, message, now)
            return
        remaining = inf.deadline_s - now
        if not inf.submit.idempotent or not self.retry.should_retry(inf.attempt - inf.migrations, remaining):
            self.finish_error(inf, code, message)
            return
        if budgeted and not inf.holds_retry_budget:
            if not self.budget.try_acquire(len(self.inflight)):
                self.stats.dropped["retry_budget_exhausted"] += 1
                self.finish_error(inf, code if code is ErrorCode.WORKER_LOST else ErrorCode.UNAVAILABLE, f"{message} (retry budget exhausted)")
                return
            inf.holds_retry_budget = True
        self.stats.retries[code.value] += 1
        delay = self.retry.delay_s(inf.attempt)
        move(inf, _R.RETRY_WAIT, "attempt_failed")
        heapq.heappush(self._retries, (now + delay, inf.rid))
        self.log.info("retry_scheduled", request_id=inf.client_rid, attempt=inf.attempt, cause=code.value, delay_ms=round(delay * 1000, 2))

    def migrate_or_fail(self, inf: Inflight, code: ErrorCode, message: str, now: float) -> None:
        """``inf`` streamed output, then its attempt failed with ``code`` (its worker was lost or
        its engine failed mid-stream; the caller detached it): continue it on another worker with
        the prompt plus the tokens streamed so far (:mod:`mesh.broker_core.migrate`; at most
        ``max_migrations`` times, counted ``migrations``) or end it with ``code`` (counted
        ``migration_refused`` by reason)."""
        inf.fail_cause, inf.fail_message = code.value, message[:400]  # (what it ends with if no other worker takes it)
        why = inf.unmigratable or ("limit" if inf.migrations >= self.s.max_migrations else "")
        if not why and now >= inf.deadline_s:
            why = "deadline"
        cont = why or migrate.continuation(inf.submit, inf.streamed or [])
        if isinstance(cont, str):
            self.stats.migration_refused[cont] += 1
            self.finish_error(inf, code, f"{message} (not continued: {cont})")
            return
        if inf.phase == "decode" and (ps := self.pool.by_id.get(inf.prefill_worker)) is not None:
            self._out.to_worker(ps.identity, P.encode_worker_cancel(inf.rid, inf.prefill_attempt))
        inf.phase = "mixed"  # a P/D request continues as a new pair
        inf.prefill_worker, inf.prefill_attempt, inf.prefill_usage, inf.prefill_bootstrap = "", 0, None, {}
        inf.submit, produced = cont
        inf.produced += produced
        inf.migrations += 1
        inf.seq_base = inf.chunks_sent
        inf.streamed = []
        self.stats.migrations[code.value] += 1
        self.log.info("request_migrated", request_id=inf.client_rid, cause=code.value, migration=inf.migrations,
                      produced_tokens=inf.produced, remaining_tokens=inf.submit.max_new_tokens, message=message[:200])
        move(inf, _R.RETRY_WAIT, "migrate")
        heapq.heappush(self._retries, (now, inf.rid))

    def abort_pair(self, inf: Inflight, code: ErrorCode, message: str, now: float, *, budgeted: bool = True) -> None:
        """P/D: ``inf``'s prefill leg failed or was lost after its handoff, so its decode leg waits
        for KV that will not come. Abort the decode leg and retry the pair (a new prefill, a new
        decode) within the request's attempts, budget and deadline, or end it with one error. A
        decode leg that already answered had its KV: it goes on (counted)."""
        if inf.state is _R.DISPATCHED and (inf.replied or inf.committed):
            self.stats.dropped["pd_prefill_failed_after_decode"] += 1
            return
        self.log.warning("pd_prefill_leg_failed", request_id=inf.client_rid, prefill_worker=inf.prefill_worker,
                         attempt=inf.prefill_attempt, code=code.value, message=message[:200])
        dsess = inf.session
        if dsess is not None:  # the decode leg in flight: abort it (it was not at fault)
            self._out.to_worker(dsess.identity, P.encode_worker_cancel(inf.rid, inf.attempt))
        # the pair's retry excludes the prefill workers tried, not the decode ones (as a decode
        # re-send, a decode worker may serve again; the router picks it by load)
        inf.tried -= {w for w in inf.tried if (ds := self.pool.by_id.get(w)) is not None and ds.ready.role == "decode"}
        self.detach(inf)
        inf.phase = "mixed"  # the retry routes a new pair
        inf.prefill_worker, inf.prefill_attempt, inf.prefill_usage, inf.prefill_bootstrap = "", 0, None, {}
        if inf.state is _R.RETRY_WAIT:  # a decode re-send was waiting: it becomes the pair's retry
            return
        if not code.retryable:
            self.finish_error(inf, code, message)
            return
        self.retry_or_fail(inf, code, message, now, budgeted=budgeted)

    def _run_due_retries(self, now: float) -> None:
        while self._retries and self._retries[0][0] <= now:
            _, rid = heapq.heappop(self._retries)
            inf = self.inflight.get(rid)
            if inf is None or inf.state is not _R.RETRY_WAIT:
                continue
            self._dispatch(inf, now)

    # ------------------------------------------------------------------ terminal frames
    def forget(self, inf: Inflight, why: str, usage: dict | None = None, outcome: str = "") -> None:
        """``inf`` is DONE (``why``: answered, failed or client_gone): out of the table.
        ``usage``: the FINAL's token counts; ``outcome``: the error code it failed with."""
        if self.on_done is not None:
            self.on_done(inf, "ok" if why == "answered" else (outcome or why), usage, self.now)
        self.parked.remove(inf.rid)
        freed = inf.session is not None
        self.detach(inf)
        move(inf, _R.DONE, why)
        if freed and self.parked and self.s.max_inflight_per_worker and not self._bulk:
            self._unpark_one(self.now)
        self.inflight.pop(inf.rid, None)
        if self.by_client.pop((inf.client, inf.client_rid), None) is not None:
            self.intake.release(inf.quota)
            if inf.tenant:
                self.intake.ledger.release(inf.tenant)
        if inf.holds_retry_budget:
            self.budget.release()
            inf.holds_retry_budget = False

    def finish_error(self, inf: Inflight, code: ErrorCode, message: str, *, cancel_worker: bool = False) -> None:
        if cancel_worker and inf.session is not None:
            self._out.to_worker(inf.session.identity, P.encode_worker_cancel(inf.rid, inf.attempt))
        if inf.phase == "decode" and (ps := self.pool.by_id.get(inf.prefill_worker)) is not None:
            # P/D: the prefill leg may still run (an SGLang prefill waits for a decode server to pull its KV)
            self._out.to_worker(ps.identity, P.encode_worker_cancel(inf.rid, inf.prefill_attempt))
        self.forget(inf, "failed", outcome=code.value)
        self.stats.requests[code.value] += 1
        self._out.to_client(inf.client, P.encode_client_error(inf.client_rid, code, message))
        self.log.info("request_failed", request_id=inf.client_rid, code=code.value, attempts=inf.attempt, message=message[:200])

    def fail_all(self, code: ErrorCode, message: str, client: bytes | None = None) -> None:
        """Finish every request (of ``client``) with ``code``, cancelling its worker's attempt."""
        with self.bulk_teardown():
            for inf in [i for i in self.inflight.values() if client is None or i.client == client]:
                if inf.state is not _R.DONE:
                    self.finish_error(inf, code, message, cancel_worker=True)

    def _expire_deadlines(self, now: float) -> None:
        while self.deadlines and self.deadlines[0][0] <= now:
            _, rid = heapq.heappop(self.deadlines)
            inf = self.inflight.get(rid)
            if inf is None:
                continue
            if inf.state is _R.PARKED:  # it never reached a worker: say why
                if self.pool.pool(inf.model):
                    self.finish_error(inf, ErrorCode.OVERLOADED, "every worker stayed at capacity until the deadline")
                else:
                    self.finish_error(inf, ErrorCode.NO_WORKER, "no routable worker before the deadline")
            else:
                sess = inf.session
                if sess is not None and not inf.replied:  # it held the request and said nothing
                    self.workers.note_outcome(sess, True, now)
                    self.workers.note_failure(sess, now)
                self.finish_error(inf, ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded", cancel_worker=True)

    def orphan(self, sess: WorkerSession, now: float, why: str) -> None:
        """Requests on a lost session: retry those with nothing streamed, continue the others on
        another worker (:meth:`migrate_or_fail`) or fail them."""
        for rid in list(sess.inflight):
            inf = self.inflight.get(rid)
            if inf is None:
                continue
            if inf.committed:
                self.detach(inf)
                self.migrate_or_fail(inf, ErrorCode.WORKER_LOST, f"worker {sess.worker_id} lost mid-stream ({why})", now)
            else:
                # Not budgeted: a lost worker's requests are each retried at most max_attempts
                # times anyway, and the budget (sized for retry storms) would fail the requests a
                # third of the fleet held when one of three workers stalls (issue 12, item 9).
                self.retry_or_fail(inf, ErrorCode.WORKER_LOST, f"worker {sess.worker_id} lost ({why})", now, budgeted=False)
        sess.inflight.clear()
        if sess.drained_by != "worker":  # P/D: legs it prefilled whose decode leg may wait for its KV
            # (a prefill worker that announced its leave finished its legs first)
            for inf in [i for i in self.inflight.values() if i.phase == "decode" and i.prefill_worker == sess.worker_id]:
                self.stats.decisions["pd_prefill_lost"] += 1
                self.abort_pair(inf, ErrorCode.WORKER_LOST, f"prefill worker {sess.worker_id} lost ({why}) before its "
                                f"decode leg had the KV", now, budgeted=False)

    def _client_gone(self, inf: Inflight, why: str = "unreachable") -> None:
        """The client's connection is gone, or it stopped reading (its pipe is at the send HWM):
        cancel all of its requests (nobody reads them) and count them ``client_gone`` or
        ``client_slow``, never ``ok``."""
        client = inf.client
        outcome = "client_slow" if why == "send_hwm" else "client_gone"
        self.log.warning(outcome, client=client.hex()[:32], request_id=inf.client_rid)
        with self.bulk_teardown():
            for other in [i for i in self.inflight.values() if i.client == client]:
                if other.state is _R.DONE:
                    continue
                if other.session is not None:
                    self._out.to_worker(other.session.identity, P.encode_worker_cancel(other.rid, other.attempt))
                self.forget(other, "client_gone")
                self.stats.requests[outcome] += 1

    def send_failed(self, send: Send, now: float) -> None:
        """A send about a request failed (its receipt: DISPATCH, DECODE, CHUNK or FINAL)."""
        r = send.receipt
        if r is Receipt.DISPATCH:
            inf, sess = send.ref, self.pool.by_identity.get(send.identity)
            if inf.state is not _R.DISPATCHED or inf.attempt != send.attempt or inf.session is None or inf.session is not sess:
                return
            # Unreachable or full worker: it is failing; try another one right away.
            self.detach(inf)
            self.stats.retries["send_failed"] += 1
            if inf.attempt - inf.migrations >= self.s.max_attempts:
                self.finish_error(inf, ErrorCode.UNAVAILABLE, "could not deliver the request to any worker")
            else:
                self._dispatch(inf, now)
        elif r is Receipt.DECODE:
            inf = send.ref
            if inf.state is _R.DISPATCHED and inf.attempt == send.attempt:
                self.retry_or_fail(inf, ErrorCode.UNAVAILABLE, f"could not reach decode worker {inf.session.worker_id if inf.session else '?'}", now)
        elif r is Receipt.CHUNK:
            inf = send.ref
            if inf.state is not _R.DONE:
                self._client_gone(inf, send.failed)
        elif r is Receipt.FINAL:
            # finished, but the client is gone or not reading: never counted ok
            slow = send.failed == "send_hwm"
            self.stats.requests["ok"] -= 1
            self.stats.requests["client_slow" if slow else "client_gone"] += 1
            inf = send.ref
            if self._limiter.allow(("final_undelivered", inf.client), now):
                self.log.warning("client_slow" if slow else "client_gone", client=inf.client.hex()[:32], request_id=inf.client_rid)

    # ------------------------------------------------------------------ timers
    def tick(self, now: float) -> None:
        """Deadlines, retries, parked requests' waits and progress checks due at ``now``."""
        if self.deadlines and self.deadlines[0][0] <= now:
            self._expire_deadlines(now)
        if self._retries and self._retries[0][0] <= now:
            self._run_due_retries(now)
        if self._park_timers and self._park_timers[0][0] <= now:
            self.unpark(now, expired_only=True)
        if self._progress and self._progress[0][0] <= now:
            self._check_progress(now)

    def wakeup_s(self, wake: float) -> float:
        """The earlier of ``wake`` and this table's next timer."""
        # Finished requests leave their deadline in the heap (lazy deletion); drop those from
        # the top first, or under sustained load the timer would fire once per finished request.
        dl, inflight = self.deadlines, self.inflight
        while dl and dl[0][1] not in inflight:
            heapq.heappop(dl)
        if dl:
            wake = min(wake, dl[0][0])
        if self._retries:
            wake = min(wake, self._retries[0][0])
        if self._park_timers:
            wake = min(wake, self._park_timers[0][0])
        pg = self._progress
        while pg and pg[0][1] not in inflight:
            heapq.heappop(pg)
        if pg:
            wake = min(wake, pg[0][0])
        return wake
