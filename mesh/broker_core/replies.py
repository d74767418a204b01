"""What workers answer to an attempt, and the two legs of a P/D request (pure: no I/O, no clock).

The attempt fence (a reply counts only for its request's current attempt on that very session),
streamed chunks in ``seq`` order, the FINAL (the request's one terminal reply of success),
worker ERRORs (retry or fail), and prefill/decode disaggregation: the prefill leg's FINAL
``prefill_done`` hands the request to its decode worker (:meth:`Replies.send_decode`); an ERROR
the prefill worker sends later for that leg (an SGLang prefill server keeps its request until the
decode server pulled the KV: it can still fail) aborts the decode leg and retries the pair
(:meth:`Replies.prefill_leg_failed`). Part of the
request table's side: it finishes and retries requests through
:class:`~mesh.broker_core.table.RequestTable`.
"""

from __future__ import annotations

from typing import Any

from mesh import protocol as P
from mesh.broker_core import migrate
from mesh.broker_core.counters import BrokerStats
from mesh.broker_core.pool import WorkerPool, WorkerSession
from mesh.broker_core.requests import Inflight, RequestState, move
from mesh.broker_core.sends import Outbox, Receipt
from mesh.broker_core.status import Status
from mesh.broker_core.table import RequestTable
from mesh.broker_core.workers import Workers
from mesh.errors import ErrorCode, ProtocolError
from mesh.logs import RateLimiter

__all__ = ["Replies"]


class Replies:
    """CHUNK, FINAL and ERROR from workers; the P/D handoff and the decode leg."""

    def __init__(self, router: Any, pool: WorkerPool, table: RequestTable, workers: Workers, status: Status,
                 stats: BrokerStats, log: Any, limiter: RateLimiter, outbox: Outbox) -> None:
        self.router = router
        self.pool = pool
        self.table = table
        self.workers = workers
        self.status = status
        self.stats = stats
        self.log = log
        self._limiter = limiter
        self._out = outbox

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
        inf = self.table.inflight.get(m.rid)
        if inf is None or inf.session is not sess or inf.attempt != m.attempt:
            self.stats.dropped["stale_reply"] += 1
            return None
        sess.last_reply_s = now
        if not inf.replied:
            self._first_reply(inf, sess, now)
        return inf

    def chunk(self, sess: WorkerSession, m: P.WorkerChunk, now: float) -> None:
        inf = self._current(sess, m, now)
        if inf is None:
            return
        if not inf.submit.stream:
            if not inf.first_token_s:  # (its chunks are not forwarded: the worker's FINAL carries everything)
                inf.first_token_s = now
                (sess.lat.get("ttft") or sess.histogram("ttft", self.stats)).observe(now - inf.accepted_s)
            return
        if m.seq != inf.chunks_sent - inf.seq_base:  # (a continued stream's attempt counts from 0 again)
            self.stats.dropped["chunk_out_of_order"] += 1
            if self._limiter.allow(("chunk_seq", sess.worker_id), now):
                self.log.warning("chunk_out_of_order", request_id=inf.client_rid, worker_id=sess.worker_id,
                                 expected=inf.chunks_sent - inf.seq_base, got=m.seq)
            return
        if not inf.first_token_s:
            inf.first_token_s = now
            (sess.lat.get("ttft") or sess.histogram("ttft", self.stats)).observe(now - inf.accepted_s)
        else:
            (sess.lat.get("inter_token") or sess.histogram("inter_token", self.stats)).observe(now - inf.last_chunk_s)
        inf.last_chunk_s = now
        if inf.streamed is not None:  # kept to continue it elsewhere if its worker is lost
            if len(inf.streamed) > inf.submit.max_new_tokens:  # more chunks than tokens: a worker flooding it
                inf.streamed, inf.unmigratable = None, "too_many_chunks"
            else:
                inf.streamed.append(m.data)
        seq = inf.chunks_sent
        inf.chunks_sent += 1
        self._out.to_client(inf.client, P.encode_client_chunk(inf.client_rid, seq, m.data), Receipt.CHUNK, inf)

    def final(self, sess: WorkerSession, m: P.WorkerFinal, now: float) -> None:
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
        if inf.produced:  # a continued stream: its earlier tokens were sent to this worker as prompt
            m.usage = migrate.continued_usage(m.usage, inf.produced)
        self.table.forget(inf, "answered", m.usage)
        sess.failures = 0
        self.workers.note_outcome(sess, False, now)
        u = m.usage
        pt, ct = u.get("prompt_tokens"), u.get("cached_tokens")
        if type(pt) is int and type(ct) is int:
            self.stats.prompt_tokens += pt
            self.stats.cached_tokens += ct
            self.status.count_tokens(sess.worker_id, pt, ct)
        # counted ok now; a failed send (send_failed, Receipt.FINAL) moves it to client_slow/client_gone
        self.stats.requests["ok"] += 1
        if not inf.first_token_s:  # no chunk came first (max_new_tokens 0, or a worker that only answers FINAL)
            (sess.lat.get("ttft") or sess.histogram("ttft", self.stats)).observe(now - inf.accepted_s)
        (sess.lat.get("e2e") or sess.histogram("e2e", self.stats)).observe(now - inf.accepted_s)
        self._out.to_client(inf.client, P.encode_client_final(inf.client_rid, m.finish_reason, u, sess.worker_id, m.attempt, m.data, inf.reason),
                            Receipt.FINAL, inf)

    def error(self, sess: WorkerSession, m: P.WorkerError, now: float) -> None:
        inf = self.table.inflight.get(m.rid)
        if (inf is not None and inf.phase == "decode" and inf.prefill_attempt == m.attempt
                and inf.prefill_worker == sess.worker_id and inf.session is not sess):
            self.prefill_leg_failed(inf, sess, m, now)
            return
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
            self.workers.note_outcome(sess, True, now)
        if code in (ErrorCode.WORKER_ERROR, ErrorCode.INTERNAL) or (code is ErrorCode.UNAVAILABLE and not sess.draining):
            self.workers.note_failure(sess, now)
        if code.retryable:
            # a draining worker refusing work the broker sent before it saw DRAINING: a planned move
            self.table.retry_or_fail(inf, code, f"worker {sess.worker_id}: {m.message}", now,
                                     budgeted=not (sess.draining and code is ErrorCode.UNAVAILABLE))
        else:
            self.table.finish_error(inf, code, m.message)

    # ------------------------------------------------------------------ P/D legs
    def _handoff(self, inf: Inflight, sess: WorkerSession, m: P.WorkerFinal, now: float) -> None:
        """The prefill leg is done: release it and send the decode leg."""
        d = inf.decision
        sess.inflight.discard(inf.rid)
        inf.session = None
        if d is not None:
            self.router.release(sess.state, d)  # prefill side only; the decode side stays booked
        inf.prefill_worker = sess.worker_id
        inf.prefill_attempt = m.attempt
        inf.prefill_usage = m.usage
        try:  # a real SGLang prefill server names its bootstrap endpoint for the decode server
            data = P.unpack(m.data) if m.data else {}
        except ProtocolError:
            data = {}
        # (SGLang names its bootstrap endpoint; vLLM's prefill engine answers kv_transfer_params)
        inf.prefill_bootstrap = {k: data[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "kv_transfer_params")
                                 if isinstance(data, dict) and k in data}
        inf.phase = "decode"
        self.stats.decisions["pd_handoff"] += 1
        self.send_decode(inf, now)

    def prefill_leg_failed(self, inf: Inflight, sess: WorkerSession, m: P.WorkerError, now: float) -> None:
        """The prefill leg failed after its handoff (its engine request ended in an error, or its
        KV bootstrap never completed): the decode leg waits for KV that will not come
        (:meth:`RequestTable.abort_pair`)."""
        self.stats.decisions["pd_prefill_failed"] += 1
        sess.last_reply_s = now
        try:
            code = ErrorCode(m.code)
        except ValueError:
            code = ErrorCode.WORKER_ERROR
        if code is not ErrorCode.CANCELLED:
            self.workers.note_outcome(sess, True, now)
            self.workers.note_failure(sess, now)
        self.table.abort_pair(inf, code, f"prefill worker {sess.worker_id}: {m.message}", now)

    def send_decode(self, inf: Inflight, now: float) -> None:
        """Send the decode leg (to the decode worker chosen with the prefill, or another one)."""
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
                    self.table.release_decision(nd)
                nd = self.router.route(inf.route_req, pool, now)
            if nd.worker_id is None or nd.decode_worker_id is None:
                if nd.worker_id is not None:
                    self.table.release_decision(nd)
                self.table.finish_error(inf, ErrorCode.NO_WORKER, "no decode worker for the handoff")
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
        move(inf, RequestState.DISPATCHED, "decode_leg")
        inf.session = dsess
        dsess.inflight.add(inf.rid)
        self.table.watch_progress(inf, now)
        self._out.to_worker(dsess.identity, P.encode_request(inf.rid, inf.attempt, remaining_ms, inf.client_rid, inf.submit.raw, bootstrap),
                            Receipt.DECODE, inf, inf.attempt)
