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
* Requests and sessions move only along their transition tables
  (:data:`~mesh.broker_core.requests.REQUEST_TRANSITIONS`,
  :data:`~mesh.broker_core.pool.SESSION_TRANSITIONS`).

The only clocks it may be given are measurement seams: ``perf`` times routing decisions for the
``decision_latency`` histogram and the KV backlog's work budget is a caller-supplied clock.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import time
from collections import Counter, deque
from typing import Any, Callable

from mesh import protocol as P
from mesh.broker_core.counters import BrokerStats
from mesh.broker_core.pool import SessionState, WorkerPool, WorkerSession
from mesh.broker_core.requests import Inflight, RequestState, move
from mesh.broker_core.sends import TO_CLIENT, TO_WORKER, Receipt, Send
from mesh.config import BrokerSettings
from mesh.errors import ErrorCode, ProtocolError
from mesh.hashing import text_to_tokens
from mesh.logs import RateLimiter, get_logger
from mesh.namespaces import request_namespace
from mesh.retry import RetryBudget, RetryPolicy
from mesh.routing.view import Decision, RouteRequest, WorkerState
from mesh.security import key_may_claim

__all__ = ["BrokerCore", "HB_SLICES"]

_R = RequestState
# Heartbeats to workers go out in this many slices per interval (each session in its own
# slice, assigned round-robin at registration): 1,000 workers never cost one long send burst.
HB_SLICES = 10
# Error-rate outlier ejection: a worker with at least _OUTLIER_MIN_OUTCOMES recent outcomes whose
# error rate is >= _OUTLIER_MIN_RATE and exceeds its peers' by _OUTLIER_MARGIN is ejected.
_OUTLIER_MIN_OUTCOMES = 16
_OUTLIER_MIN_RATE = 0.5
_OUTLIER_MARGIN = 0.3
_MAX_KEY_TOKENS = 1 << 20  # prompt tokens hashed for routing while no worker has registered
# KV_EVENTS larger than this many events are applied in slices (a 4 MB batch is ~0.3 s of index
# work); while any is queued, later batches queue behind it (order per stream).
KV_SLICE_EVENTS = 1024
_KV_BACKLOG_MAX_EVENTS = 200_000  # queued events at most (all workers); beyond, batches are dropped
_KV_BACKLOG_MAX_WORKER_EVENTS = 40_000  # ... and per worker (one flooding worker cannot fill it)
_SLOW_PREFILL_TOKENS_PER_S = 5000.0  # a pessimistic prefill rate for the progress window
_STATUS_CACHE_S = 0.1  # STATUS worker lists of large fleets are rebuilt at most this often
_STATUS_CACHE_MIN_WORKERS = 256  # smaller fleets always get a fresh list


class BrokerCore:
    """Request table + worker pool. Feed it inputs with ``now``; send what lands in :attr:`out`.

    Inputs: :meth:`client_frames`, :meth:`submit`, :meth:`cancel_client`, :meth:`worker_frames`,
    :meth:`matched`, :meth:`resync`, :meth:`tick`, :meth:`send_failed`, :meth:`begin_drain`,
    :meth:`fail_all`. Outputs: :attr:`out` (sends), :attr:`prefetch` (requests whose async prefix
    match the shell must run, then call :meth:`matched`). Seams (all optional): ``perf`` (a
    clock for the decision-latency histogram only), ``on_event`` (telemetry events),
    ``on_new_worker`` (a new session's routing state, e.g. to join the peer exchange),
    ``view_degraded`` (True while peers' figures are stale), ``status_extra`` (more STATUS fields).
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
        perf: Callable[[], float] = time.perf_counter,
        on_event: Callable[..., None] | None = None,
        on_new_worker: Callable[[WorkerState], None] | None = None,
        view_degraded: Callable[[], bool] | None = None,
        status_extra: Callable[[float], dict] | None = None,
    ) -> None:
        self.s = settings
        self.router = router
        self.broker_id = broker_id
        self.stats = stats if stats is not None else BrokerStats()
        self.log = log if log is not None else get_logger(service="broker", broker_id=broker_id)
        self.kv_sink = kv_sink
        # CURVE: z85 public key -> key name of every allow-listed worker key (mesh.security.key_may_claim).
        self.worker_keys = worker_keys
        self.perf = perf
        self.on_event = on_event
        self.on_new_worker = on_new_worker
        self.view_degraded = view_degraded
        self.status_extra = status_extra
        self.pool = WorkerPool()
        self.retry = RetryPolicy(settings.max_attempts, settings.retry_base_ms, settings.retry_cap_ms)
        self.budget = RetryBudget(settings.retry_budget_ratio, settings.retry_budget_min)
        self.async_provider = bool(getattr(router.provider, "is_async", False))
        self.out: list[Send] = []
        self.prefetch: list[Inflight] = []
        self.now = 0.0  # the time of the input being handled
        self.state = "init"  # init -> serving -> draining -> closed (the shell closes)
        self.drain_deadline_s = float("inf")
        self.started_s = 0.0
        self.loop_lag_s = 0.0  # set by the shell: its loop's lag average (load shedding)
        self.inflight: dict[int, Inflight] = {}
        self._by_client: dict[tuple[bytes, str], int] = {}
        self._rid_seq = itertools.count(1)
        self._deadlines: list[tuple[float, int]] = []
        self.parked: dict[int, None] = {}  # requests waiting for a routable worker (insertion order)
        self._park_timers: list[tuple[float, int]] = []
        self._retries: list[tuple[float, int]] = []
        self._progress: list[tuple[float, int, int]] = []  # (due_s, rid, attempt): no-progress checks
        self._limiter = RateLimiter(1.0)
        self._next_hb = self._next_sweep = 0.0
        self._hb_slot = 0
        self._hb_slots = itertools.count()
        self._client_inflight: Counter[bytes] = Counter()  # quota key -> its requests in flight
        self._worker_tokens: dict[str, list[int]] = {}  # worker_id -> [requests, prompt tokens, cached tokens]
        self._fleet_errors = 0  # sums of every session's outcome window (peer error rate)
        self._fleet_outcomes = 0
        self._cap_version = -1  # pool version the fleet capacity was computed at
        self._cap_tokens: dict[str | None, int] = {}  # model (None: all) -> largest KV capacity
        self._aliases = settings.aliases()  # --model-alias: name -> served model
        self._status_cache: tuple[float, list[dict]] | None = None
        self._bulk = False  # finishing several requests in one loop (see _bulk_teardown)
        self.kv_backlog: deque[tuple[str, bytes, int, Any]] = deque()  # (worker_id, identity, events, slice generator)
        self._kv_backlog_events: Counter[str] = Counter()  # queued events per worker

    # ------------------------------------------------------------------ lifecycle
    def start(self, now: float) -> None:
        """Start serving at ``now``: the heartbeat and sweep timers count from here."""
        self.now = self.started_s = now
        hb_s = self.s.heartbeat_ms / 1000.0
        self._next_hb = now + hb_s / HB_SLICES
        self._next_sweep = now + hb_s / 5
        self.state = "serving"

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
        self.now = now
        with self._bulk_teardown():
            for inf in list(self.inflight.values()):
                if inf.state is not _R.DONE:
                    self._finish_error(inf, code, message, cancel_worker=True)

    @contextlib.contextmanager
    def _bulk_teardown(self):
        """While several requests are finished in one loop, a freed worker slot unparks nobody
        (it could dispatch, or finish, a request later in that very loop); what is still parked
        afterwards is dispatched once, at the end."""
        self._bulk = True
        try:
            yield
        finally:
            self._bulk = False
        if self.parked and self.s.max_inflight_per_worker:
            self._unpark(self.now)

    def take(self) -> list[Send]:
        """The sends appended since the last take (the shell sends them in order)."""
        out, self.out = self.out, []
        return out

    # ------------------------------------------------------------------ sends
    def _to_worker(self, identity: bytes, frames: list[bytes], receipt: Receipt = Receipt.NONE, ref: Any = None,
                   attempt: int = 0) -> Send:
        s = Send(TO_WORKER, identity, frames, receipt, ref, attempt)
        self.out.append(s)
        return s

    def _to_client(self, identity: bytes, frames: list[bytes], receipt: Receipt = Receipt.NONE, ref: Any = None,
                   when: Send | None = None) -> Send:
        s = Send(TO_CLIENT, identity, frames, receipt, ref, 0, when)
        self.out.append(s)
        return s

    def send_failed(self, send: Send, now: float) -> None:
        """The shell could not make ``send`` (``send.failed`` says why): act on what it meant."""
        self.now = now
        r = send.receipt
        if r is Receipt.DISPATCH:
            inf, sess = send.ref, self.pool.by_identity.get(send.identity)
            if inf.state is not _R.DISPATCHED or inf.attempt != send.attempt or inf.session is None or inf.session is not sess:
                return
            # Unreachable or full worker: it is failing; try another one right away.
            self._detach(inf)
            self.stats.retries["send_failed"] += 1
            if inf.attempt >= self.s.max_attempts:
                self._finish_error(inf, ErrorCode.UNAVAILABLE, "could not deliver the request to any worker")
            else:
                self._dispatch(inf, now)
        elif r is Receipt.DECODE:
            inf = send.ref
            if inf.state is _R.DISPATCHED and inf.attempt == send.attempt:
                self._retry_or_fail(inf, ErrorCode.UNAVAILABLE, f"could not reach decode worker {inf.session.worker_id if inf.session else '?'}", now)
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
        elif r is Receipt.HEARTBEAT:
            sess = send.ref
            if send.failed == "unreachable" and self.pool.by_identity.get(sess.identity) is sess:
                self.stats.workers["connection_lost"] += 1
                self.log.warning("worker_connection_lost", worker_id=sess.worker_id, inflight=len(sess.inflight))
                self._event("worker_connection_lost", worker_id=sess.worker_id)
                self._remove_session(sess, now, "connection_lost")

    def _reject(self, path: str, err: ProtocolError, peer: bytes) -> None:
        self.stats.frames_rejected[(path, err.reason)] += 1
        if self._limiter.allow((path, err.reason, peer), self.now):
            self.log.warning("frame_rejected", path=path, reason=err.reason, detail=err.detail[:200], peer=peer.hex()[:32])

    def _event(self, event: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(event, **fields)

    # ------------------------------------------------------------------ client path
    def client_frames(self, frames: list[bytes], now: float, quota_key: bytes | None = None, *, local: bool = False) -> None:
        """``[identity, *message frames]`` from a client (decoded here; never raises on bad input).

        ``local``: an in-process (HTTP) client, whose identities start with a zero byte and are
        longer than 5 bytes. From a socket such an identity is refused and counted, never
        answered: a remote peer may set that ROUTING_ID (libzmq does not forbid it), and replies
        to it would reach a local client."""
        self.now = now
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
            self.submit(ident, msg, now, quota_key)
        elif isinstance(msg, P.Cancel):
            self._on_client_cancel(ident, msg.rid)
        elif isinstance(msg, P.StatusQuery):
            self._to_client(ident, self.status_reply(now))
        else:
            self._reject("client", msg, ident)
            # Answer when the sender can be identified: a client path header means a client.
            rid = _salvage_rid(frames[1:])
            if frames[1] == P.CLIENT_HEADER:
                self.stats.requests[ErrorCode.BAD_REQUEST.value] += 1
                self._to_client(ident, P.encode_client_error(rid, ErrorCode.BAD_REQUEST, str(msg)))

    def submit(self, ident: bytes, sub: P.Submit, now: float, quota_key: bytes | None = None) -> None:
        """A decoded SUBMIT from client ``ident``; ``quota_key`` is who it counts against for
        ``max_inflight_per_client`` (default: the client itself)."""
        self.now = now
        key = (ident, sub.rid)
        if key in self._by_client:
            self.stats.requests[ErrorCode.DUPLICATE.value] += 1
            self._to_client(ident, P.encode_client_error(sub.rid, ErrorCode.DUPLICATE, "a request with this rid is in flight"))
            return
        if self.state != "serving":
            self.stats.requests[ErrorCode.UNAVAILABLE.value] += 1
            self._to_client(ident, P.encode_client_error(sub.rid, ErrorCode.UNAVAILABLE, "broker is draining"))
            return
        if len(self.inflight) >= self.s.max_inflight:
            self.stats.requests[ErrorCode.OVERLOADED.value] += 1
            self._to_client(ident, P.encode_client_error(sub.rid, ErrorCode.OVERLOADED, "broker in-flight limit reached"))
            return
        quota = quota_key if quota_key is not None else ident
        refusal = self._refusal(quota, sub)
        if refusal is not None:
            code, message = refusal
            self.stats.requests[code.value] += 1
            self._to_client(ident, P.encode_client_error(sub.rid, code, message))
            return
        budget_ms = sub.deadline_ms or self.s.default_deadline_ms
        rid = next(self._rid_seq)
        inf = Inflight(rid, ident, sub.rid, sub, now + budget_ms / 1000.0)
        inf.accepted_s = now
        self.inflight[rid] = inf
        self._by_client[key] = rid
        inf.quota = quota
        self._client_inflight[quota] += 1
        heapq.heappush(self._deadlines, (inf.deadline_s, rid))
        if self.async_provider:
            if self._prepare_route(inf):
                move(inf, _R.PREFETCHING)
                self.prefetch.append(inf)
            return
        self._dispatch(inf, now)

    def matched(self, rid: int, now: float) -> None:
        """The async prefix match of request ``rid`` is in (or failed): route it now."""
        self.now = now
        inf = self.inflight.get(rid)
        if inf is not None and inf.state is _R.PREFETCHING:
            self._dispatch(inf, now)

    def cancel_client(self, ident: bytes, now: float) -> None:
        """An in-process (HTTP) client went away: cancel every request it has in flight."""
        self.now = now
        with self._bulk_teardown():
            for inf in [i for i in self.inflight.values() if i.client == ident]:
                if inf.state is not _R.DONE:
                    self._finish_error(inf, ErrorCode.CANCELLED, "HTTP client went away", cancel_worker=True)

    def _prepare_route(self, inf: Inflight) -> bool:
        """Build the request's routing view once, after checking it can run at all (workers
        may have registered since the submit); False: it was refused and is finished."""
        refusal = self._context_refusal(inf.submit, inf.model)
        if refusal is not None:
            self._finish_error(inf, *refusal)
            return False
        inf.route_req = self._route_request(inf)
        return True

    def _refusal(self, quota: bytes, sub: P.Submit) -> tuple[ErrorCode, str] | None:
        """Why a new SUBMIT is refused before any work is done on it (None: accept it).
        Checked in order of cost; nothing here looks at the prompt."""
        if len(sub.raw) > P.MAX_FRAME_BYTES:  # an in-process client: workers could not take the frame
            return ErrorCode.TOO_LARGE, f"request body of {len(sub.raw)} bytes exceeds the {P.MAX_FRAME_BYTES}-byte frame limit"
        if self._client_inflight[quota] >= self.s.max_inflight_per_client:
            return ErrorCode.RATE_LIMITED, f"this client already has {self.s.max_inflight_per_client} requests in flight"
        if self.loop_lag_s * 1000.0 > self.s.overload_lag_ms:
            self.stats.loop["shed"] += 1
            return ErrorCode.OVERLOADED, f"broker overloaded (event loop lag {self.loop_lag_s * 1000:.0f} ms)"
        return None  # the prompt's length is checked where it is routed (_prepare_route)

    def fleet_capacity(self, model: str | None = None) -> int:
        """The most KV tokens any registered worker (of ``model``) can hold (0 while none is registered)."""
        if self._cap_version != self.pool.version:
            self._cap_version = self.pool.version
            self._cap_tokens.clear()
        cap = self._cap_tokens.get(model)
        if cap is None:
            cap = self._cap_tokens[model] = max((s.ready.max_total_num_tokens for s in self.pool.by_id.values()
                                                 if model is None or s.ready.model == model), default=0)
        return cap

    def _model_for(self, sub: P.Submit) -> tuple[str | None, tuple[ErrorCode, str] | None]:
        """The model a request is routed to (None: any worker) and why it is refused, if it is.

        A name is a model some registered worker serves (READY ``model``; adapters read it from
        the engine) or an alias of one (``--model-alias``). No name, or ``--model-name`` (the id
        the HTTP ingress reports, default ``mesh``), means the fleet's only model: with several
        it is a 400. An unknown name is a 404 ``model_not_found``, except while no worker is
        registered at all (startup): then it waits, parked, for workers to say what they serve."""
        name = sub.model
        known = self.pool.models()
        if name is not None:
            name = self._aliases.get(name, name)
            if name in known:
                return name, None
        if name is None or name == self.s.model_name:
            # The models with routable workers decide: a registered peer that serves nothing (or
            # a model whose workers are all down) does not make unnamed requests ambiguous.
            served = [m for m in known if self.pool.pool(m)]
            if len(served) > 1:
                return None, (ErrorCode.BAD_REQUEST, f"model is required: this fleet serves {', '.join(sorted(served))}")
            return (served[0] if served else None), None
        if not known:
            return name, None
        listed = sorted(set(known) | set(self._aliases))
        return None, (ErrorCode.MODEL_NOT_FOUND, f"model {name!r} is not served here; models: {', '.join(listed)}")

    def _context_refusal(self, sub: P.Submit, model: str | None = None) -> tuple[ErrorCode, str] | None:
        """A prompt longer than every worker's KV capacity can never run: refuse it before it is
        hashed. Text is counted conservatively (no real tokenizer packs 32 characters per
        token on average), so a text prompt that could fit is never refused."""
        cap = self.fleet_capacity(model)
        if not cap:
            return None  # no worker yet: checked again at dispatch
        n = len(sub.input_ids) if sub.input_ids is not None else len(sub.text or "") // 32
        if n > cap:
            return (ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                    f"prompt of {n}{'+' if sub.input_ids is None else ''} tokens exceeds the largest worker's capacity of {cap} tokens")
        return None

    def _on_client_cancel(self, ident: bytes, client_rid: str) -> None:
        rid = self._by_client.get((ident, client_rid))
        if rid is None:
            self.stats.dropped["cancel_unknown"] += 1
            return
        self._finish_error(self.inflight[rid], ErrorCode.CANCELLED, "cancelled by client", cancel_worker=True)

    # ------------------------------------------------------------------ dispatch
    def _route_request(self, inf: Inflight) -> RouteRequest:
        sub = inf.submit
        tokens = sub.input_ids
        packed = sub.packed
        # Only a prefix that some worker could hold can match: keys beyond the fleet's capacity
        # are never hashed (a 4M-token prompt once blocked the loop for 0.9 s hashing in full).
        cap = self.fleet_capacity(inf.model) or _MAX_KEY_TOKENS
        if tokens is None and self.router.policy.needs_match:
            tokens = text_to_tokens((sub.text or "")[:cap])[:cap]  # text prompts route by a byte-level key
            n_prompt = sub.prompt_len
        else:
            n_prompt = len(tokens) if tokens is not None else sub.prompt_len
            if tokens is not None and len(tokens) > cap:
                tokens = tokens[:cap]
                packed = packed[:cap] if packed is not None else None
        return RouteRequest(
            request_id=inf.client_rid,
            prompt_tokens=n_prompt,
            max_new_tokens=sub.max_new_tokens,
            tokens=tokens,
            packed=packed,
            ttft_slo_ms=sub.ttft_slo_ms,
            tps_slo=sub.tps_slo,
            namespace=request_namespace(sub.params),
        )

    def _dispatch(self, inf: Inflight, now: float) -> None:
        """Route and send one attempt; on failure to find a worker, park, retry or fail.

        Prefill/decode mode: the first leg goes to the prefill worker (bootstrap mode
        ``prefill``); its FINAL ``prefill_done`` hands the request to the decode worker chosen
        with it (:meth:`_send_decode`). A decode leg that fails before any chunk is re-sent to
        another decode worker; the prefill leg is retried whole. A REQUEST the shell cannot
        deliver comes back through :meth:`send_failed` and is routed again, to another worker.
        """
        if inf.phase == "decode":
            self._send_decode(inf, now)
            return
        model, refusal = self._model_for(inf.submit)
        if refusal is not None:
            self._finish_error(inf, *refusal)
            return
        inf.model = model
        pool = self.pool.pool(model)
        cap = self.s.max_inflight_per_worker
        # Workers at their in-flight cap are not candidates (the policy would happily pick a
        # cache holder that is full); when every worker is, wait in the bounded queue.
        full = {w.worker_id for w in pool if w.inflight >= cap} if cap else set()
        if full and len(full) == len(pool):
            self._park_or_overload(inf, now)
            return
        if inf.route_req is None and not self._prepare_route(inf):
            return
        req = inf.route_req
        t0 = self.perf()
        decision = self.router.route(req, pool, now, exclude=inf.tried | full if full else inf.tried)
        self.stats.decision_latency.observe(self.perf() - t0)
        if decision.worker_id is None:
            if decision.reason == "bad_slo":
                self._finish_error(inf, ErrorCode.BAD_REQUEST, "invalid SLO")
                return
            if full - inf.tried:
                self._park_or_overload(inf, now)  # an untried worker is only full: wait for its slot
                return
            if not pool and self._park(inf, now):
                return  # no worker yet (startup, restart, fleet loss): wait briefly for one
            if inf.tried:
                code = ErrorCode(inf.fail_cause) if inf.fail_cause else ErrorCode.UNAVAILABLE
                self._finish_error(inf, code, f"no other worker after {inf.attempt} attempt(s); last: {inf.fail_cause or 'failed'}"
                                   + (f": {inf.fail_message}" if inf.fail_message else ""))
            else:
                self._finish_error(inf, ErrorCode.NO_WORKER, "no routable worker" if not pool else decision.reason)
            return
        self.stats.decisions[decision.reason] += 1
        if self.view_degraded is not None and self.view_degraded():
            self.stats.exchange["decisions_peer_stale"] += 1  # routed on this broker's own view
        dr = decision.detail.get("decode_reason")
        if dr:
            self.stats.decisions[f"decode_{dr}"] += 1
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
        frames = P.encode_request(inf.rid, inf.attempt, remaining_ms, inf.client_rid, inf.submit.raw, bootstrap)
        inf.decision = decision
        move(inf, _R.DISPATCHED)
        inf.session = sess
        inf.reason = decision.reason
        sess.inflight.add(inf.rid)
        self._watch_progress(inf, now)
        if inf.attempt == 1:
            (sess.lat.get("queue") or self._lat(sess, "queue")).observe(now - inf.accepted_s)
        sent = self._to_worker(sess.identity, frames, Receipt.DISPATCH, inf, inf.attempt)
        if inf.submit.stream:
            self._to_client(inf.client, P.encode_accepted(inf.client_rid, sess.worker_id, decision.reason, inf.attempt), when=sent)

    def _progress_window_s(self, inf: Inflight) -> float:
        """How long an attempt may go without a word: ``progress_timeout_ms`` plus its prompt at
        a slow prefill rate (a 400k-token prompt may legitimately take a minute to first token)."""
        req = inf.route_req
        n = req.prompt_tokens if req is not None else 0
        return self.s.progress_timeout_ms / 1000.0 + n / _SLOW_PREFILL_TOKENS_PER_S

    def _watch_progress(self, inf: Inflight, now: float) -> None:
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
            self._to_worker(sess.identity, P.encode_worker_cancel(inf.rid, inf.attempt))
            self._note_outcome(sess, True, now)
            self._note_failure(sess, now)
            self._retry_or_fail(inf, ErrorCode.WORKER_ERROR,
                                f"worker {sess.worker_id} sent nothing for {self.s.progress_timeout_ms} ms", now)
        for e in rearm:
            heapq.heappush(self._progress, e)

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

    def _release_decision(self, d: Decision) -> None:
        """Undo a decision that will not be used (both sides)."""
        for wid in (d.worker_id, d.decode_worker_id):
            s = self.pool.by_id.get(wid or "")
            if s is not None:
                self.router.release(s.state, d)

    def _handoff(self, inf: Inflight, sess: WorkerSession, m: P.WorkerFinal, now: float) -> None:
        """The prefill leg is done: release it and send the decode leg."""
        d = inf.decision
        sess.inflight.discard(inf.rid)
        inf.session = None
        if d is not None:
            self.router.release(sess.state, d)  # prefill side only; the decode side stays booked
        inf.prefill_worker = sess.worker_id
        inf.prefill_usage = m.usage
        try:  # a real SGLang prefill server names its bootstrap endpoint for the decode server
            data = P.unpack(m.data) if m.data else {}
        except ProtocolError:
            data = {}
        inf.prefill_bootstrap = {k: data[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")
                                 if isinstance(data, dict) and k in data}
        inf.phase = "decode"
        self.stats.decisions["pd_handoff"] += 1
        self._send_decode(inf, now)

    def _send_decode(self, inf: Inflight, now: float) -> None:
        d = inf.decision
        dsess = self.pool.by_id.get(d.decode_worker_id or "") if d is not None else None
        if dsess is None or dsess.draining or dsess.worker_id in inf.tried:
            # The decode worker chosen with the prefill is gone or failed: pick another one.
            if d is not None and dsess is not None:
                self.router.release(dsess.state, d)
            inf.decision = None
            pool = self.pool.pool(inf.model)
            # prefer a decode worker not tried yet; a transient failure may retry the same one
            tried_decode = {w for w in inf.tried if (s := self.pool.by_id.get(w)) is not None and s.ready.role == "decode"}
            nd = self.router.route(inf.route_req, pool, now, exclude=tried_decode)
            if (nd.worker_id is None or nd.decode_worker_id is None) and tried_decode:
                if nd.worker_id is not None:
                    self._release_decision(nd)
                nd = self.router.route(inf.route_req, pool, now)
            if nd.worker_id is None or nd.decode_worker_id is None:
                if nd.worker_id is not None:
                    self._release_decision(nd)
                self._finish_error(inf, ErrorCode.NO_WORKER, "no decode worker for the handoff")
                return
            ps = self.pool.by_id.get(nd.worker_id)
            if ps is not None:
                self.router.release(ps.state, nd)  # only the decode side of this decision is used
            inf.decision = nd
            dsess = self.pool.by_id[nd.decode_worker_id]  # type: ignore[index]
            self.stats.decisions["decode_reselected"] += 1
        inf.attempt += 1
        inf.tried.add(dsess.worker_id)
        remaining_ms = max(1, int((inf.deadline_s - now) * 1000))
        bootstrap = {"mode": "decode", "room": inf.room, "prefill_worker": inf.prefill_worker,
                     "prompt_tokens": int((inf.prefill_usage or {}).get("prompt_tokens", 0)),
                     "cached_tokens": int((inf.prefill_usage or {}).get("cached_tokens", 0)),
                     **inf.prefill_bootstrap}
        move(inf, _R.DISPATCHED)
        inf.session = dsess
        dsess.inflight.add(inf.rid)
        self._watch_progress(inf, now)
        self._to_worker(dsess.identity, P.encode_request(inf.rid, inf.attempt, remaining_ms, inf.client_rid, inf.submit.raw, bootstrap),
                        Receipt.DECODE, inf, inf.attempt)

    def _park_or_overload(self, inf: Inflight, now: float) -> None:
        """Every worker this request may use is at its in-flight cap: queue it, or refuse 429."""
        if not self._park(inf, now, saturated=True):
            self._finish_error(inf, ErrorCode.OVERLOADED, "every worker is at capacity and the wait queue is full or timed out")

    def _park(self, inf: Inflight, now: float, *, saturated: bool = False) -> bool:
        """Hold a request while no worker is routable (``park_timeout_s``) or every worker is at
        its in-flight cap (``queue_timeout_s``), in one bounded FIFO queue.

        Returns False when it cannot wait (queue full, or its wait is over)."""
        if inf.parked_until_s is None:
            if len(self.parked) >= self.s.max_parked:
                self.stats.dropped["park_queue_full"] += 1
                return False
            wait_s = self.s.queue_timeout_s if saturated else self.s.park_timeout_s
            inf.parked_until_s = min(inf.deadline_s, now + wait_s)
        elif now >= inf.parked_until_s:
            return False
        move(inf, _R.PARKED)
        self.parked[inf.rid] = None
        heapq.heappush(self._park_timers, (inf.parked_until_s, inf.rid))
        self.stats.requests_parked += 1
        return True

    def _unpark_one(self, now: float) -> None:
        """A worker slot freed: give it to the oldest waiting request (FIFO)."""
        while self.parked:
            rid = next(iter(self.parked))
            del self.parked[rid]
            inf = self.inflight.get(rid)
            if inf is not None:
                self._dispatch(inf, now)
                return

    def _unpark(self, now: float, *, expired_only: bool = False) -> None:
        """Re-dispatch parked requests (a worker became routable) or fail the expired ones."""
        if expired_only:
            while self._park_timers and self._park_timers[0][0] <= now:
                _, rid = heapq.heappop(self._park_timers)
                if self.parked.pop(rid, 0) is None:  # still parked
                    inf = self.inflight.get(rid)
                    if inf is not None:
                        self._dispatch(inf, now)
            return
        parked, self.parked = self.parked, {}
        for rid in parked:
            inf = self.inflight.get(rid)
            if inf is not None:
                self._dispatch(inf, now)

    def _detach(self, inf: Inflight) -> None:
        sess = inf.session
        if sess is not None:
            sess.inflight.discard(inf.rid)
            self._release(inf, sess)
            inf.session = None
        elif inf.decision is not None:
            self._release(inf, None)

    def _retry_or_fail(self, inf: Inflight, code: ErrorCode, message: str, now: float, *, budgeted: bool = True) -> None:
        """A dispatched attempt failed without output. Re-dispatch after a back-off, or fail.

        A failed prefill leg is retried whole; a failed decode leg only re-sends the decode.
        ``budgeted=False`` for requests displaced by a worker that announced it was leaving
        (graceful drain) or was lost: a planned move, or one each request takes at most
        ``max_attempts`` times, so it does not draw on the retry budget that protects against
        retry storms (attempts and the deadline still bound it)."""
        self._detach(inf)
        if inf.phase == "prefill":
            inf.phase = "mixed"
        inf.fail_cause = code.value
        inf.fail_message = message[:400]
        remaining = inf.deadline_s - now
        if inf.committed or not inf.submit.idempotent or not self.retry.should_retry(inf.attempt, remaining):
            self._finish_error(inf, code, message)
            return
        if budgeted and not inf.holds_retry_budget:
            if not self.budget.try_acquire(len(self.inflight)):
                self.stats.dropped["retry_budget_exhausted"] += 1
                self._finish_error(inf, code if code is ErrorCode.WORKER_LOST else ErrorCode.UNAVAILABLE, f"{message} (retry budget exhausted)")
                return
            inf.holds_retry_budget = True
        self.stats.retries[code.value] += 1
        delay = self.retry.delay_s(inf.attempt)
        move(inf, _R.RETRY_WAIT)
        heapq.heappush(self._retries, (now + delay, inf.rid))
        self.log.info("retry_scheduled", request_id=inf.client_rid, attempt=inf.attempt, cause=code.value, delay_ms=round(delay * 1000, 2))

    def _run_due_retries(self, now: float) -> None:
        while self._retries and self._retries[0][0] <= now:
            _, rid = heapq.heappop(self._retries)
            inf = self.inflight.get(rid)
            if inf is None or inf.state is not _R.RETRY_WAIT:
                continue
            self._dispatch(inf, now)

    # ------------------------------------------------------------------ terminal frames
    def _forget(self, inf: Inflight) -> None:
        self.parked.pop(inf.rid, None)
        freed = inf.session is not None
        self._detach(inf)
        move(inf, _R.DONE)
        if freed and self.parked and self.s.max_inflight_per_worker and not self._bulk:
            self._unpark_one(self.now)
        self.inflight.pop(inf.rid, None)
        if self._by_client.pop((inf.client, inf.client_rid), None) is not None:
            qk = inf.quota
            n = self._client_inflight[qk] - 1
            if n > 0:
                self._client_inflight[qk] = n
            else:
                self._client_inflight.pop(qk, None)
        if inf.holds_retry_budget:
            self.budget.release()
            inf.holds_retry_budget = False

    def _finish_error(self, inf: Inflight, code: ErrorCode, message: str, *, cancel_worker: bool = False) -> None:
        if cancel_worker and inf.session is not None:
            self._to_worker(inf.session.identity, P.encode_worker_cancel(inf.rid, inf.attempt))
        self._forget(inf)
        self.stats.requests[code.value] += 1
        self._to_client(inf.client, P.encode_client_error(inf.client_rid, code, message))
        self.log.info("request_failed", request_id=inf.client_rid, code=code.value, attempts=inf.attempt, message=message[:200])

    def _expire_deadlines(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            inf = self.inflight.get(rid)
            if inf is None:
                continue
            if inf.state is _R.PARKED:  # it never reached a worker: say why
                if self.pool.pool(inf.model):
                    self._finish_error(inf, ErrorCode.OVERLOADED, "every worker stayed at capacity until the deadline")
                else:
                    self._finish_error(inf, ErrorCode.NO_WORKER, "no routable worker before the deadline")
            else:
                sess = inf.session
                if sess is not None and not inf.replied:  # it held the request and said nothing
                    self._note_outcome(sess, True, now)
                    self._note_failure(sess, now)
                self._finish_error(inf, ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded", cancel_worker=True)

    # ------------------------------------------------------------------ worker path
    def worker_frames(self, frames: list[bytes], now: float, peer_key: bytes | None = None) -> None:
        """``[identity, *message frames]`` from a worker (decoded here; never raises on bad
        input). ``peer_key`` is the CURVE public key its connection authenticated with."""
        self.now = now
        if len(frames) < 2:
            self.stats.frames_rejected[("worker", "bad_frame_count")] += 1
            return
        ident = frames[0]
        msg = P.decode_worker(frames[1:])
        if isinstance(msg, ProtocolError):
            self._reject("worker", msg, ident)
            return
        self.worker_message(ident, msg, now, peer_key)

    def worker_message(self, ident: bytes, msg: Any, now: float, peer_key: bytes | None = None) -> None:
        """A decoded worker message (the simulator's workers hand these over without encoding)."""
        self.now = now
        sess = self.pool.by_identity.get(ident)
        if sess is None:
            if isinstance(msg, P.Ready):
                self._on_ready(ident, msg, now, peer_key)
            elif not isinstance(msg, P.Disconnect):
                # Unknown peer (e.g. we restarted and its TCP connection came back): ask it to re-register.
                self.stats.frames_rejected[("worker", "unregistered_peer")] += 1
                if self._limiter.allow(("unregistered_reply", ident), now):  # at most once a second per peer
                    self._to_worker(ident, P.encode_disconnect("not registered; send READY"))
            return
        sess.expiry_s = now + self._expiry_s(sess)
        sess.last_seen_s = now
        t = type(msg)
        if sess.status is SessionState.REGISTERED and t is not P.Disconnect:
            self._confirm(sess, now)  # (a first message that says goodbye confirms nothing)
        if t is P.WorkerFinal:
            self._on_worker_final(sess, msg, now)
        elif t is P.WorkerChunk:
            self._on_worker_chunk(sess, msg, now)
        elif t is P.Heartbeat:
            if msg.load:
                sess.state.update_load(msg.load, now)
        elif t is P.KvEventsMsg:
            self._on_kv_events(sess, msg, now)
        elif t is P.WorkerError:
            self._on_worker_error(sess, msg, now)
        elif t is P.Disconnect:
            self._on_worker_disconnect(sess, msg.reason, now)
        elif t is P.Ready:
            if msg.worker_id == sess.worker_id and msg.epoch == sess.ready.epoch:
                # The same registration again (a worker that missed our first heartbeat, or one
                # that re-sent READY after a stall): acknowledge it, keep its requests and index.
                self.stats.workers["ready_repeated"] += 1
                self._to_worker(ident, P.encode_heartbeat())
                return
            # A different identity on a live session is a protocol violation: make it start over.
            self.stats.frames_rejected[("worker", "duplicate_ready")] += 1
            self._to_worker(ident, P.encode_disconnect("duplicate READY"))
            self._remove_session(sess, now, "duplicate_ready")

    def _expiry_s(self, sess: WorkerSession) -> float:
        # The slower of our interval and the worker's own decides liveness (mismatch-proof), but
        # never beyond the broker's cap: a worker cannot switch its own liveness off.
        hb_ms = min(max(self.s.heartbeat_ms, sess.ready.heartbeat_ms), self.s.max_worker_heartbeat_ms)
        return hb_ms * self.s.liveness / 1000.0

    def _confirm(self, sess: WorkerSession, now: float) -> None:
        """The session's first message after READY: it is routable from now on."""
        self.pool.confirm(sess)
        self.stats.workers["confirmed"] += 1
        if self.parked:
            self._unpark(now)

    def _refuse_ready(self, ident: bytes, r: P.Ready, why: str, message: str, now: float) -> None:
        """Refuse a registration: counted, warned (rate-limited) and answered with DISCONNECT at
        most once a second per peer, so a peer that retries at once cannot make us ping-pong."""
        self.stats.workers[f"refused_{why}"] += 1
        if self._limiter.allow(("ready_refused", why, r.worker_id), now):
            self.log.warning("worker_refused", worker_id=r.worker_id, why=why, peer=ident.hex()[:32])
        if self._limiter.allow(("ready_refused_reply", ident), now):
            self._to_worker(ident, P.encode_disconnect(message))

    def _on_ready(self, ident: bytes, r: P.Ready, now: float, peer_key: bytes | None) -> None:
        old = self.pool.by_id.get(r.worker_id)
        if old is None and len(self.pool) >= self.s.max_workers:
            self._refuse_ready(ident, r, "max_workers", f"broker already has {self.s.max_workers} workers", now)
            return
        key_name = None
        if self.worker_keys is not None:
            key_name = self.worker_keys.get(peer_key or b"")
            if key_name is None or not key_may_claim(key_name, r.worker_id):
                self._refuse_ready(ident, r, "key_mismatch", f"this CURVE key may not register as {r.worker_id!r}", now)
                return
        if old is not None and old.identity != ident and not (key_name and old.key_name == key_name):
            # A live worker id is not given away: a second claimant (an impostor, or a restart
            # whose old connection is still up) waits until the old session expires (its expiry
            # carries the credit of our own stalls: a slow broker loop must not open a window).
            # A restarted worker's old connection is gone, so our next heartbeat to it fails and
            # frees the id within one heartbeat interval (see _send_heartbeats).
            if old.expiry_s > now:
                self._refuse_ready(ident, r, "duplicate_id", f"worker_id {r.worker_id!r} is registered on another live connection", now)
                return
        if r.heartbeat_ms > self.s.max_worker_heartbeat_ms and self._limiter.allow(("hb_capped", r.worker_id), now):
            self.log.warning("worker_heartbeat_capped", worker_id=r.worker_id, announced_ms=r.heartbeat_ms,
                             cap_ms=self.s.max_worker_heartbeat_ms)
        state = WorkerState(
            worker_id=r.worker_id, role=r.role, labels=dict(r.labels), block_size=r.block_size,
            max_running_requests=r.max_running_requests, max_total_num_tokens=r.max_total_num_tokens, dp_size=r.dp_size,
        )
        if self.on_new_worker is not None:
            self.on_new_worker(state)
        sess = WorkerSession(ident, r, state, expiry_s=0.0, hb_slot=next(self._hb_slots) % HB_SLICES, last_seen_s=now,
                             key_name=key_name or "")
        sess.expiry_s = now + self._expiry_s(sess)
        old = self.pool.add(sess)
        if old is not None:
            self._forget_outcomes(old)
            self.stats.workers["replaced"] += 1
            self._orphan_requests(old, now, "worker_replaced")
            if self.kv_sink is not None and old.ready.epoch != r.epoch:
                self.kv_sink.on_worker_removed(r.worker_id)
        self.stats.workers["registered"] += 1
        if self.kv_sink is not None:
            self.kv_sink.on_worker_ready(r)
        self.log.info("worker_registered", worker_id=r.worker_id, role=r.role, epoch=r.epoch, block_size=r.block_size,
                      replaced=old is not None, workers=len(self.pool))
        self._event("worker_registered", worker_id=r.worker_id, role=r.role, epoch=r.epoch)
        self._to_worker(ident, P.encode_heartbeat())  # first message tells the worker it is routable
        if self.parked:
            self._unpark(now)

    def _lat(self, sess: WorkerSession, name: str):
        """``name``'s latency histogram of this worker (labels: its served model, its id)."""
        h = sess.lat.get(name)
        if h is None:
            h = sess.lat[name] = self.stats.histogram(name, sess.ready.model, sess.worker_id)
        return h

    def _first_reply(self, inf: Inflight, sess: WorkerSession, now: float) -> None:
        """The current attempt's first reply: the worker's outcome figure, and the routing
        policy learns from its prediction (cache_aware's calibration; prefill/mixed legs only,
        the decode leg of a P/D request was not predicted)."""
        inf.replied = True
        ms = (now - inf.sent_s) * 1000.0
        sess.state.record_first_reply(ms)
        if inf.phase != "decode" and inf.decision is not None:
            self.router.observe(inf.decision, ms)

    def _current(self, sess: WorkerSession, m, now: float) -> Inflight | None:
        """The attempt fence: the request a worker's CHUNK/FINAL is for, if it is that request's
        current attempt on this very session (else counted ``stale_reply``, None); records the
        reply (progress, and the first reply's latency)."""
        inf = self.inflight.get(m.rid)
        if inf is None or inf.session is not sess or inf.attempt != m.attempt:
            self.stats.dropped["stale_reply"] += 1
            return None
        sess.last_reply_s = now
        if not inf.replied:
            self._first_reply(inf, sess, now)
        return inf

    def _on_worker_chunk(self, sess: WorkerSession, m: P.WorkerChunk, now: float) -> None:
        inf = self._current(sess, m, now)
        if inf is None:
            return
        if not inf.submit.stream:
            if not inf.first_token_s:  # (its chunks are not forwarded: the worker's FINAL carries everything)
                inf.first_token_s = now
                (sess.lat.get("ttft") or self._lat(sess, "ttft")).observe(now - inf.accepted_s)
            return
        if m.seq != inf.chunks_sent:
            self.stats.dropped["chunk_out_of_order"] += 1
            if self._limiter.allow(("chunk_seq", sess.worker_id), now):
                self.log.warning("chunk_out_of_order", request_id=inf.client_rid, worker_id=sess.worker_id, expected=inf.chunks_sent, got=m.seq)
            return
        if not inf.first_token_s:
            inf.first_token_s = now
            (sess.lat.get("ttft") or self._lat(sess, "ttft")).observe(now - inf.accepted_s)
        else:
            (sess.lat.get("inter_token") or self._lat(sess, "inter_token")).observe(now - inf.last_chunk_s)
        inf.last_chunk_s = now
        inf.chunks_sent += 1
        self._to_client(inf.client, P.encode_client_chunk(inf.client_rid, m.seq, m.data), Receipt.CHUNK, inf)

    def _on_worker_final(self, sess: WorkerSession, m: P.WorkerFinal, now: float) -> None:
        inf = self._current(sess, m, now)
        if inf is None:
            return
        if inf.phase == "prefill":
            if m.finish_reason == "prefill_done":
                self._handoff(inf, sess, m, now)
                return
        elif inf.phase == "decode" and inf.prefill_usage:
            # the client sees the prompt accounting of the prefill leg (where the cache hit was)
            m.usage = {**m.usage, "prompt_tokens": inf.prefill_usage.get("prompt_tokens", m.usage.get("prompt_tokens")),
                       "cached_tokens": inf.prefill_usage.get("cached_tokens", 0)}
        self._forget(inf)
        sess.failures = 0
        self._note_outcome(sess, False, now)
        u = m.usage
        pt, ct = u.get("prompt_tokens"), u.get("cached_tokens")
        if type(pt) is int and type(ct) is int:
            self.stats.prompt_tokens += pt
            self.stats.cached_tokens += ct
            wt = self._worker_tokens.get(sess.worker_id)
            if wt is None:
                wt = self._worker_tokens[sess.worker_id] = [0, 0, 0]
            wt[0] += 1
            wt[1] += pt
            wt[2] += ct
        # counted ok now; a failed send (send_failed, Receipt.FINAL) moves it to client_slow/client_gone
        self.stats.requests["ok"] += 1
        if not inf.first_token_s:  # no chunk came first (max_new_tokens 0, or a worker that only answers FINAL)
            (sess.lat.get("ttft") or self._lat(sess, "ttft")).observe(now - inf.accepted_s)
        (sess.lat.get("e2e") or self._lat(sess, "e2e")).observe(now - inf.accepted_s)
        self._to_client(inf.client, P.encode_client_final(inf.client_rid, m.finish_reason, u, sess.worker_id, m.attempt, m.data, inf.reason),
                        Receipt.FINAL, inf)

    def _on_worker_error(self, sess: WorkerSession, m: P.WorkerError, now: float) -> None:
        inf = self.inflight.get(m.rid)
        if inf is None or inf.session is not sess or inf.attempt != m.attempt:
            self.stats.dropped["stale_reply"] += 1
            return
        inf.replied = True
        sess.last_reply_s = now
        if m.malformed:
            self.stats.frames_rejected[("worker", "bad_payload")] += 1
            if self._limiter.allow(("bad_payload", sess.worker_id), now):
                self.log.warning("frame_rejected", path="worker", reason="bad_payload", worker_id=sess.worker_id, detail=m.message[:200])
        try:
            code = ErrorCode(m.code)
        except ValueError:
            code = ErrorCode.WORKER_ERROR
        if code is not ErrorCode.CANCELLED and not (sess.draining and code is ErrorCode.UNAVAILABLE):
            self._note_outcome(sess, True, now)
        if code in (ErrorCode.WORKER_ERROR, ErrorCode.INTERNAL) or (code is ErrorCode.UNAVAILABLE and not sess.draining):
            self._note_failure(sess, now)
        if code.retryable:
            # a draining worker refusing work the broker sent before it saw DRAINING: a planned move
            self._retry_or_fail(inf, code, f"worker {sess.worker_id}: {m.message}", now,
                                budgeted=not (sess.draining and code is ErrorCode.UNAVAILABLE))
        else:
            self._finish_error(inf, code, m.message)

    # -- outlier ejection ---------------------------------------------------------------
    def _note_failure(self, sess: WorkerSession, now: float) -> None:
        """Count a worker-side failure; eject the worker after ``eject_after_failures`` in a row."""
        sess.failures += 1
        if sess.failures < self.s.eject_after_failures or sess.status is not SessionState.ROUTABLE:
            return
        self._eject(sess, now, f"{sess.failures} failures in a row")

    def _eject(self, sess: WorkerSession, now: float, why: str) -> None:
        """Eject ``sess`` for ``eject_base_s x n`` (capped), unless that would leave no routable
        worker or eject more than ``max_ejected_ratio`` of them (panic mode)."""
        healthy = sum(1 for s2 in self.pool.by_id.values() if s2.state.healthy)
        ejected = self.pool.count(SessionState.EJECTED)
        if healthy <= 1 or (ejected + 1) > max(1, int(self.s.max_ejected_ratio * len(self.pool))):
            self.stats.workers["ejection_skipped"] += 1
            return
        sess.ejections += 1
        dur = min(self.s.eject_base_s * sess.ejections, self.s.eject_max_s)
        self.pool.eject(sess, now + dur)
        self.stats.workers["ejected"] += 1
        self.log.warning("worker_ejected", worker_id=sess.worker_id, failures=sess.failures, why=why, for_s=dur)
        self._event("worker_ejected", worker_id=sess.worker_id, for_s=dur)

    def _note_outcome(self, sess: WorkerSession, failed: bool, now: float) -> None:
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
            self._eject(sess, now, f"error rate {rate:.2f} vs peers {peer_rate:.2f}")

    def _forget_outcomes(self, sess: WorkerSession) -> None:
        """Take a session that is going away out of the fleet's outcome sums."""
        self._fleet_errors -= sess.outcome_errors
        self._fleet_outcomes -= len(sess.outcomes)
        sess.outcomes.clear()
        sess.outcome_errors = 0

    def _reinstate_due(self, now: float) -> None:
        for sess in list(self.pool.by_id.values()):
            if sess.status is SessionState.EJECTED and sess.ejected_until_s <= now:
                sess.failures = 0
                self._forget_outcomes(sess)  # a fresh window after ejection
                self.pool.reinstate(sess)
                self.stats.workers["reinstated"] += 1
                self.log.info("worker_reinstated", worker_id=sess.worker_id)
                self._event("worker_reinstated", worker_id=sess.worker_id)

    def _on_worker_disconnect(self, sess: WorkerSession, reason: str, now: float) -> None:
        if reason == P.DRAINING:
            # Graceful drain: no new work, but its in-flight requests finish where they are.
            if sess.draining:
                sess.drained_by = "worker"  # drained by an operator before: now it is leaving, no reinstating it
            else:
                self.pool.drain(sess)
                self.stats.workers["draining"] += 1
                self.log.info("worker_draining", worker_id=sess.worker_id, inflight=len(sess.inflight))
                self._event("worker_draining", worker_id=sess.worker_id)
            return
        self.stats.workers["disconnected"] += 1
        self.log.info("worker_disconnected", worker_id=sess.worker_id, reason=reason)
        self._event("worker_disconnected", worker_id=sess.worker_id, reason=reason)
        self._remove_session(sess, now, "disconnected")

    # -- operators (the admin API) -------------------------------------------------------
    def admin(self, action: str, worker_id: str, now: float, *, for_s: float | None = None) -> dict:
        """An operator's action on one worker: ``drain`` (no new requests; what it holds
        finishes), ``eject`` (no new requests for ``for_s``, default ``eject_max_s``, then it is
        reinstated; in-flight requests finish), ``reinstate`` (routable again: an ejected worker,
        or one an operator drained). Returns the worker's status entry. Raises KeyError for an
        unknown worker and ValueError when its state does not allow the action (a worker that
        announced it is leaving cannot be reinstated; an unconfirmed one cannot be ejected)."""
        self.now = now
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
                sess.failures = 0
                self._forget_outcomes(sess)
                self.pool.reinstate(sess)
            elif st is SessionState.DRAINING:
                if sess.drained_by != "operator":
                    raise ValueError(f"worker {worker_id} announced it is leaving: it cannot be reinstated")
                self.pool.undrain(sess)
            elif st is not SessionState.ROUTABLE:
                raise ValueError(f"worker {worker_id} is {st.value}: it becomes routable when it speaks")
            self.stats.workers["reinstated_by_operator"] += 1
            if self.parked:
                self._unpark(now)
        else:
            raise ValueError(f"unknown action {action!r}: drain, eject or reinstate")
        self.log.info("worker_admin", worker_id=worker_id, action=action, state=sess.status.value)
        self._event("worker_admin", worker_id=worker_id, action=action, state=sess.status.value)
        return self.worker_status(sess, now)

    # -- KV events ----------------------------------------------------------------------
    def _on_kv_events(self, sess: WorkerSession, m: P.KvEventsMsg, now: float) -> None:
        self.stats.kv["batches"] += 1
        if self.kv_sink is None:
            return
        slices = getattr(self.kv_sink, "kv_slices", None)
        if slices is None or (not self.kv_backlog and len(m.events) <= KV_SLICE_EVENTS):
            for dp_rank, why in self.kv_sink.on_kv_events(sess.worker_id, m, now):
                self.stats.kv["resync_requested"] += 1
                self._to_worker(sess.identity, P.encode_resync(dp_rank, why))
            return
        # Large (or behind a large one): applied in slices by run_kv_backlog, bounded in memory.
        # A dropped batch leaves a sequence gap, which the index turns into a resync request.
        n = len(m.events)
        queued = sum(self._kv_backlog_events.values())
        if queued + n > _KV_BACKLOG_MAX_EVENTS or self._kv_backlog_events[sess.worker_id] + n > _KV_BACKLOG_MAX_WORKER_EVENTS:
            self.stats.kv["backlog_dropped"] += 1
            if self._limiter.allow(("kv_backlog_full", sess.worker_id), now):
                self.log.warning("kv_batch_dropped", worker_id=sess.worker_id, events=n, queued=queued)
            return
        self.stats.kv["backlog_queued"] += 1
        self._kv_backlog_events[sess.worker_id] += n
        self.kv_backlog.append((sess.worker_id, sess.identity, n, slices(sess.worker_id, m, now, KV_SLICE_EVENTS)))

    def run_kv_backlog(self, clock: Callable[[], float], budget_s: float) -> None:
        """Apply queued KV batches slice by slice until ``clock()`` has advanced ``budget_s``
        (the shell's work budget per pump: the only clock this core is handed)."""
        end = clock() + budget_s
        bl = self.kv_backlog
        while bl and clock() < end:
            wid, ident, n, gen = bl[0]
            try:
                next(gen)
                continue
            except StopIteration as done:
                resyncs = done.value or []
            except Exception as exc:  # the index must never take the loop down
                resyncs = []
                self.stats.dropped["handler_exception"] += 1
                self.log.exception("kv_apply_failed", worker_id=wid, error=repr(exc))
            bl.popleft()
            left = self._kv_backlog_events[wid] - n
            if left > 0:
                self._kv_backlog_events[wid] = left
            else:
                del self._kv_backlog_events[wid]
            if self.pool.by_identity.get(ident) is not None:
                for dp_rank, why in resyncs:
                    self.stats.kv["resync_requested"] += 1
                    self._to_worker(ident, P.encode_resync(dp_rank, why))

    def resync(self, worker_id: str, dp_rank: int, why: str, now: float) -> None:
        """The shared indexer asks for a worker's full KV state again."""
        self.now = now
        sess = self.pool.by_id.get(worker_id)
        if sess is not None:
            self.stats.kv["resync_requested"] += 1
            self._to_worker(sess.identity, P.encode_resync(dp_rank, why))

    # -- sessions going away ------------------------------------------------------------
    def _remove_session(self, sess: WorkerSession, now: float, why: str) -> None:
        self.pool.remove(sess)
        if sess.worker_id not in self.pool.by_id:
            self.stats.forget_worker(sess.worker_id)
        self._forget_outcomes(sess)
        self._orphan_requests(sess, now, why)
        if self.kv_sink is not None and sess.worker_id not in self.pool.by_id:
            self.kv_sink.on_worker_removed(sess.worker_id)

    def _orphan_requests(self, sess: WorkerSession, now: float, why: str) -> None:
        """Requests on a lost session: retry those with nothing streamed, fail the others."""
        for rid in list(sess.inflight):
            inf = self.inflight.get(rid)
            if inf is None:
                continue
            if inf.committed:
                self._detach(inf)
                self._finish_error(inf, ErrorCode.WORKER_LOST, f"worker {sess.worker_id} lost mid-stream ({why})")
            else:
                # Not budgeted: a lost worker's requests are each retried at most max_attempts
                # times anyway, and the budget (sized for retry storms) would fail the requests a
                # third of the fleet held when one of three workers stalls (issue 12, item 9).
                self._retry_or_fail(inf, ErrorCode.WORKER_LOST, f"worker {sess.worker_id} lost ({why})", now, budgeted=False)
        sess.inflight.clear()

    def _purge_expired(self, now: float) -> None:
        self._reinstate_due(now)
        for sess in self.pool.expired(now):
            self.stats.workers["expired"] += 1
            self.log.warning("worker_expired", worker_id=sess.worker_id, inflight=len(sess.inflight))
            self._event("worker_expired", worker_id=sess.worker_id, inflight=len(sess.inflight))
            self._to_worker(sess.identity, P.encode_disconnect("expired"))
            self._remove_session(sess, now, "expired")

    def _send_heartbeats(self) -> None:
        """Heartbeat the sessions of the current slice (each session once per interval). A
        session whose connection is gone (ROUTER_MANDATORY: unreachable) is removed as soon as
        the send fails (:meth:`send_failed`): its requests are retried then and its worker id
        is free for its reconnection."""
        slot = self._hb_slot
        self._hb_slot = (slot + 1) % HB_SLICES
        hb = P.encode_heartbeat()
        for sess in [s for s in self.pool.by_identity.values() if s.hb_slot == slot]:
            self._to_worker(sess.identity, hb, Receipt.HEARTBEAT, sess)

    def _client_gone(self, inf: Inflight, why: str = "unreachable") -> None:
        """The client's connection is gone, or it stopped reading (its pipe is at the send HWM):
        cancel all of its requests (nobody reads them) and count them ``client_gone`` or
        ``client_slow``, never ``ok``."""
        client = inf.client
        outcome = "client_slow" if why == "send_hwm" else "client_gone"
        self.log.warning(outcome, client=client.hex()[:32], request_id=inf.client_rid)
        with self._bulk_teardown():
            for other in [i for i in self.inflight.values() if i.client == client]:
                if other.state is _R.DONE:
                    continue
                if other.session is not None:
                    self._to_worker(other.session.identity, P.encode_worker_cancel(other.rid, other.attempt))
                self._forget(other)
                self.stats.requests[outcome] += 1

    # ------------------------------------------------------------------ timers
    def credit_stall(self, stall_s: float) -> None:
        """The shell's loop stalled for ``stall_s``: the broker's lateness is not the workers'
        silence, so every session's expiry moves by it."""
        for sess in self.pool.by_identity.values():
            sess.expiry_s += stall_s

    def tick(self, now: float, drained: bool = True) -> None:
        """Run whatever is due at ``now``: heartbeats, expiry (only once ``drained``: what was
        queued is read before anyone is expired, unless a whole interval late), deadlines,
        retries, parked requests' waits and progress checks."""
        self.now = now
        hb_s = self.s.heartbeat_ms / 1000.0
        if now >= self._next_hb:
            # After a stall, every overdue slice goes out now (each session once per interval).
            slice_s = hb_s / HB_SLICES
            for _ in range(HB_SLICES):
                self._send_heartbeats()
                self._next_hb += slice_s
                if self._next_hb > now:
                    break
            if self._next_hb <= now:
                self._next_hb = now + slice_s
        if now >= self._next_sweep and (drained or now >= self._next_sweep + hb_s):
            self._purge_expired(now)
            self._next_sweep = now + hb_s / 5
        if self._deadlines and self._deadlines[0][0] <= now:
            self._expire_deadlines(now)
        if self._retries and self._retries[0][0] <= now:
            self._run_due_retries(now)
        if self._park_timers and self._park_timers[0][0] <= now:
            self._unpark(now, expired_only=True)
        if self._progress and self._progress[0][0] <= now:
            self._check_progress(now)

    def wakeup_s(self) -> float:
        """When :meth:`tick` next has something to do (monotonic seconds; inf: nothing)."""
        wake = min(self._next_hb, self._next_sweep)
        # Finished requests leave their deadline in the heap (lazy deletion); drop those from
        # the top first, or under sustained load the timer would fire once per finished request.
        dl, inflight = self._deadlines, self.inflight
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

    @property
    def client_quotas(self) -> dict[bytes, int]:
        """Quota key -> requests it has in flight (``max_inflight_per_client``); a copy."""
        return dict(self._client_inflight)

    @property
    def pending_deadlines(self) -> int:
        """Deadline entries in the timer heap (finished requests' entries are dropped lazily)."""
        return len(self._deadlines)

    # ------------------------------------------------------------------ status
    def status_reply(self, now: float) -> list[bytes]:
        """The STATUS reply, bounded to ``MAX_STATUS_WORKERS`` workers. For large fleets the
        worker list (O(workers) to build) is reused for ``_STATUS_CACHE_S``, so a flood of
        queries costs one build per interval; broker state and counters are always current."""
        c = self._status_cache
        if c is None or now - c[0] >= _STATUS_CACHE_S or len(self.pool) <= _STATUS_CACHE_MIN_WORKERS:
            workers = self.status_workers(now)[:P.MAX_STATUS_WORKERS]
            c = self._status_cache = (now, workers)
        broker = self.status_broker(now)
        if len(self.pool) > len(c[1]):
            broker["workers_truncated"] = True
        return P.encode_status_reply(broker, c[1], self.stats.flat())

    def status_broker(self, now: float) -> dict:
        out = {"id": self.broker_id, "state": self.state, "inflight": len(self.inflight),
               "uptime_s": round(now - self.started_s, 3), "policy": self.router.policy.name,
               "loop_lag_ms": round(self.loop_lag_s * 1000, 2), "workers_total": len(self.pool),
               "provider": getattr(self.router.provider, "name", "none"), "models": self.served_models(),
               "model_name": self.s.model_name, "aliases": self._aliases}
        if self.status_extra is not None:
            out.update(self.status_extra(now))
        return out

    def model_catalog(self) -> tuple[dict[str, int], dict[str, str], str]:
        """What the HTTP ingress lists and resolves: served models (routable workers each), the
        aliases and the fleet's name (``--model-name``)."""
        return self.served_models(), self._aliases, self.s.model_name

    def served_models(self) -> dict[str, int]:
        """Model name -> routable workers serving it (models whose workers are all down are absent)."""
        return {m: n for m in self.pool.models() if (n := len(self.pool.pool(m)))}

    def status_workers(self, now: float) -> list[dict]:
        """One entry per registered worker (STATUS, telemetry, the admin API)."""
        return [self.worker_status(sess, now) for sess in self.pool.by_id.values()]

    def worker_status(self, sess: WorkerSession, now: float) -> dict:
        st = sess.state
        agg = st.fresh_load(now, self.s.load_freshness_s)
        return {
            "worker_id": st.worker_id, "model": sess.ready.model, "role": st.role, "labels": st.labels,
            "healthy": st.healthy and sess.confirmed, "state": sess.status.value,
            "inflight": st.inflight, "peer_inflight": st.peer_inflight, "peer_prefill_tokens": st.peer_prefill_tokens,
            "epoch": sess.ready.epoch, "load_distrusted": st.load_distrusted,
            "ejected_for_s": round(max(0.0, sess.ejected_until_s - now), 3) if sess.status is SessionState.EJECTED else 0.0,
            "kv_capacity_tokens": sess.ready.max_total_num_tokens,
            "load": None if agg is None else {"running": agg.running, "waiting": agg.waiting, "kv_usage": round(agg.kv_usage, 4),
                                              "kv_used_tokens": agg.used_tokens},
        }

    def worker_tokens(self, worker_id: str) -> tuple[int, int, int]:
        """(requests finished, prompt tokens, cached tokens) of one worker, for telemetry."""
        wt = self._worker_tokens.get(worker_id)
        return (wt[0], wt[1], wt[2]) if wt else (0, 0, 0)


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
