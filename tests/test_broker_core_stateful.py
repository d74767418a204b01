"""Property-based tests of the broker core (issue 16 part 3): random interleavings in virtual time.

A hypothesis ``RuleBasedStateMachine`` plays the shell around :class:`BrokerCore`: clients submit
(streamed or not, idempotent or not, with deadlines), cancel, go away or stop reading; workers
register, heartbeat, stream chunks (in order, out of order, for superseded attempts), finish,
fail with retryable and non-retryable codes, drain, disconnect, get congested or die (every send
to a dead worker fails ``unreachable``, so its next heartbeat removes it); time advances tick by
tick, so deadlines, retry back-off, park and queue timeouts, progress timeouts, worker expiry and
the broker's own drain fire. After every core call the harness drains ``core.take()`` the way
``brokers/broker.py`` does (``when`` honoured, failed sends handed back through
``send_failed``) and records every client-bound frame and every worker-bound REQUEST.

Invariants (checked as each send is made, after each step, and at teardown once time has run
far past every deadline):

1. one terminal frame (C_FINAL or C_ERROR) per request, never two; every request gets one in the
   end unless its client was unreachable or slow (then at most one was attempted and the core
   forgot it); a refused submit gets exactly one ERROR and nothing else;
2. a client's chunks of a request arrive as seq 0, 1, 2 ...; no frame after the terminal one;
3. no REQUEST with a higher attempt once a chunk of the request was streamed, unless it continues
   the stream (issue 31, migration: at most ``max_migrations`` times, its prompt is the original
   one plus exactly the token ids streamed so far, its ``max_new_tokens`` reduced by their
   number, and its chunks go on with the next seq: no token repeated or skipped); a
   non-idempotent request is sent again only when no earlier REQUEST of it was delivered;
   attempts increase and never exceed ``max_attempts`` (plus the migrations); no REQUEST to a
   worker that announced it is draining;
4. the retry budget: ``budget.active`` is the number of requests holding it, never above what
   :class:`~mesh.retry.RetryBudget` allows at the peak in-flight count, and 0 when idle;
5. a reply (CHUNK/FINAL/ERROR) for an attempt that is not current reaches no client and is
   counted ``dropped.stale_reply``; the attempts the model believes current (delivered and not
   answered, cancelled, superseded, disconnected or removed) are exactly the core's;
6. the core never raises (IllegalTransition included) for any input sequence;
7. bookkeeping: session in-flight sets, routing ``WorkerState.inflight``, the park queue and the
   per-client quotas match the request table, and are all empty when nothing is in flight.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import mesh.broker_core.table as core_module
from brokers.main import build_broker
from mesh import protocol as P
from mesh.broker_core import TO_CLIENT, TO_WORKER, BrokerCore, RequestState, SessionState, deliver
from mesh.config import BrokerSettings, build
from mesh.errors import ErrorCode
from mesh.routing.router import Router, make_policy
from mesh.tenants import parse_keys

_REQUEST = bytes([P.Cmd.REQUEST])
_CANCEL = bytes([P.Cmd.CANCEL])
_DISCONNECT = bytes([P.Cmd.DISCONNECT])
_TERMINAL = (P.ClientFinal, P.ClientError)
T0 = 100.0
N_WORKERS = 3
N_CLIENTS = 3
USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}

BASE_SETTINGS = {
    "policy": "power_of_two", "heartbeat_ms": 500, "liveness": 3, "default_deadline_ms": 3000, "max_attempts": 3,
    "retry_base_ms": 25.0, "retry_cap_ms": 250.0, "eject_base_s": 0.5, "eject_max_s": 2.0, "park_timeout_s": 1.0,
    "queue_timeout_s": 1.0, "progress_timeout_ms": 1500, "drain_timeout_s": 3.0,
}


LATE_S = 0.0  # the harness ticks exactly at each due time (the simulator does; a real timer fires a little late)


class _HeapGuard:
    """``heapq`` for the core module, counting pushes: a core call that pushes more than
    ``left`` timer entries is livelocked (a timer re-armed for a time that is already due)."""

    heappop = staticmethod(heapq.heappop)

    def __init__(self) -> None:
        self.left = 1 << 30

    def heappush(self, heap, item) -> None:
        self.left -= 1
        if self.left < 0:
            raise AssertionError(f"livelock: a core call keeps re-arming a due timer ({item})")
        heapq.heappush(heap, item)


HEAP_GUARD = _HeapGuard()
PUSHES_PER_CALL = 20_000


@pytest.fixture(autouse=True, scope="module")
def _guard_core_timers():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core_module, "heapq", HEAP_GUARD)
        yield


class _NullLog:
    def __getattr__(self, name):
        return lambda *a, **k: None


Key = tuple[bytes, str]  # (client identity, client rid)


@dataclass
class Req:
    key: Key
    stream: bool
    idempotent: bool
    accepted: bool = False
    impaired: bool = False  # its client was unreachable or slow while it was open
    forgotten: bool = False  # dropped by the core without a terminal frame (client gone / slow)
    rid: int | None = None  # the core's rid (from its first REQUEST)
    created: list = field(default_factory=list)  # decoded client frames the core asked to send
    delivered: list = field(default_factory=list)  # ... and those that went out
    terminals_created: int = 0
    committed_attempt: int | None = None  # the attempt current when its first chunk was made
    prompt: list | str = field(default_factory=list)  # its input_ids (or text)
    migrations: int = 0  # REQUESTs that continued its stream on another worker
    requests: list = field(default_factory=list)  # Att of every REQUEST made for it

    @property
    def open(self) -> bool:
        return self.accepted and not self.terminals_created and not self.forgotten


@dataclass
class Att:
    ident: bytes
    rid: int
    attempt: int
    key: Key
    delivered: bool = False
    abandoned: bool = False  # cancelled, superseded, disconnected, its request finished
    answered: bool = False  # the worker sent FINAL or ERROR for it
    next_seq: int = 0  # the worker's own chunk counter
    sess: object = None  # the core session it was delivered to


#: Tenants of the clients C0..C2 (the shell maps a connection to its tenant): three ceilings and
#: weights, one with an in-flight limit of its own; requests ask for every band in turn.
TENANTS = parse_keys('[[tenant]]\nname = "C0"\npriority = "critical"\n[[tenant]]\nname = "C1"\nweight = 3.0\n'
                     'max_inflight = 3\n[[tenant]]\nname = "C2"\npriority = "low"\n')


def worker_ident(w: int, epoch: int, conn: int) -> bytes:
    return f"W{w}/{epoch}/{conn}".encode()


def ready(w: int, epoch: int, role: str = "mixed") -> P.Ready:
    return P.Ready(f"w{w}", "m", role, {}, 16, 256, 400_000, 1, epoch, 500)


class Shell:
    """The harness shell: drives the core, makes (or fails) its sends, keeps the model."""

    def __init__(self, **overrides) -> None:
        self.s = build(BrokerSettings, {**BASE_SETTINGS, **overrides})
        if self.s.pd:  # the bucket router, as mesh broker --pd builds it
            router = build_broker(build(BrokerSettings, {**BASE_SETTINGS, "seed": 0, **overrides})).router
        else:
            router = Router(make_policy("power_of_two", rng=random.Random(0)), None)
        self.core = BrokerCore(self.s, router, log=_NullLog())
        self.core.intake.tenants = TENANTS  # clients C0..C2 run as tenants of three bands (issue 31)
        self.now = T0
        self.core.start(T0)
        self.down: dict[tuple[int, bytes], str] = {}  # (TO_*, identity) -> why its sends fail
        self.reqs: dict[Key, Req] = {}
        self.by_rid: dict[int, Req] = {}
        self.atts: dict[tuple[bytes, int, int], Att] = {}
        self.spoke: dict[bytes, bool] = {}  # identity -> sent something since its session was registered
        self.draining: set[bytes] = set()
        self.step: list = []  # (Send, decoded) made by the current core call
        self.dup_key: Key | None = None
        self.dup_errors = 0
        self.peak_inflight = 0
        self.closed = False  # drain_over returned True
        self.rid_seq = 0

    # -- driving -----------------------------------------------------------------------
    def call(self, fn, *args, dup_key: Key | None = None) -> None:
        self.step = []
        self.dup_key, self.dup_errors = dup_key, 0
        HEAP_GUARD.left = PUSHES_PER_CALL
        fn(*args)
        self.flush()

    def flush(self) -> None:
        deliver(self.core, self._transport, lambda: self.now)

    def _transport(self, s) -> str:
        dec = self._made(s)
        why = self.down.get((s.to, s.identity))
        if why:
            self._failed(s, dec)
        else:
            self._delivered(s, dec)
        return why or ""

    def advance(self, dt: float, keepalive: set[bytes] = frozenset()) -> None:
        """Move virtual time by ``dt``, ticking at every wake-up the core asks for; the idents in
        ``keepalive`` heartbeat every 0.3 s meanwhile."""
        end = self.now + dt
        last_hb = {i: self.now for i in keepalive}
        while True:
            wake = self.core.wakeup_s()
            t = max(wake + LATE_S, self.now) if wake >= self.now else self.now
            if t > end:
                self.now = end
                return
            self.now = t
            for ident in keepalive:
                if t - last_hb[ident] >= 0.3 and (TO_WORKER, ident) not in self.down:
                    last_hb[ident] = t
                    self.worker(ident, P.encode_heartbeat())
            self.call(self.core.tick, t, True)
            if self.core.state == "draining" and not self.closed:
                self.step = []
                self.closed = self.core.drain_over(t)
                self.flush()

    def submit(self, client: bytes, stream: bool, idempotent: bool, deadline_ms: int | None, n: int = 3,
               rid: str | None = None, params: dict | None = None, **body) -> Req | None:
        """A SUBMIT (a new client rid unless ``rid`` is given: a duplicate of an open one)."""
        dup = rid is not None
        if not dup:
            self.rid_seq += 1
            rid = f"r{self.rid_seq}"
        key = (client, rid)
        b = {**P.submit_body(rid, input_ids=list(range(1, n + 1)), params={"max_new_tokens": 4, **(params or {})},
                             stream=stream, idempotent=idempotent, deadline_ms=deadline_ms,
                             priority=P.PRIORITIES[self.rid_seq % 4]), **body}
        frames = [P.CLIENT_HEADER, bytes([P.Cmd.C_SUBMIT]), P.pack(b)]
        if not dup:
            req = self.reqs[key] = Req(key, stream, idempotent, impaired=(TO_CLIENT, client) in self.down,
                                       prompt=list(range(1, n + 1)))
        self.peak_inflight = max(self.peak_inflight, len(self.core.inflight) + 1)
        self.step = []
        self.dup_key, self.dup_errors = (key if dup else None), 0
        HEAP_GUARD.left = PUSHES_PER_CALL
        self.core.client_frames([client, *frames], self.now, tenant=client.decode(errors="replace"))
        kept = any(i.client == client and i.client_rid == rid for i in self.core.inflight.values())
        if not dup:
            req.accepted = kept
        self.flush()
        if dup:
            assert self.dup_errors == 1 and len(self.step) == 1, f"duplicate submit {key}: {self.step}"
            return None
        if not req.accepted:  # refused: exactly one ERROR, nothing else
            mine = [d for s, d in self.step if s.to == TO_CLIENT and (s.identity, getattr(d, "rid", None)) == key]
            assert len(mine) == 1 and isinstance(mine[0], P.ClientError), f"refused submit {key}: {mine}"
            assert not req.requests
        return req

    def worker(self, ident: bytes, frames: list[bytes]) -> None:
        before = self.core.pool.by_identity.get(ident)
        if before is not None:  # any message from a registered session confirms it
            self.spoke[ident] = True
        self.step = []
        self.dup_key = None
        HEAP_GUARD.left = PUSHES_PER_CALL
        self.core.worker_frames([ident, *frames], self.now)
        after = self.core.pool.by_identity.get(ident)
        if after is not None and after is not before:  # a new session: not confirmed, not draining
            self.spoke[ident] = False
            self.draining.discard(ident)
        elif after is not None and not after.draining:  # a worker that drained itself and sent READY again is back
            self.draining.discard(ident)
        self.flush()

    def add_worker(self, w: int, role: str = "mixed") -> bytes:
        """Register worker ``w`` and confirm it (its first heartbeat)."""
        ident = worker_ident(w, 0, 0)
        self.worker(ident, P.encode_ready(ready(w, 0, role)))
        self.worker(ident, P.encode_heartbeat())
        return ident

    def at(self, t: float, fn, *args) -> None:
        """Call ``fn(t, *args)`` at time ``t`` (a tick, typically)."""
        self.now = t
        self.call(fn, t, *args)

    # -- what the core asked to send ---------------------------------------------------
    def _made(self, s):
        if s.to == TO_WORKER:
            cmd = s.frames[1]
            if cmd == _REQUEST:
                m = P.decode_broker_to_worker(s.frames)
                assert isinstance(m, P.Request), m
                assert (m.rid, m.attempt) == (s.ref.rid, s.attempt)
                key = (s.ref.client, s.ref.client_rid)
                req = self.reqs.get(key)
                assert req is not None and req.open, f"REQUEST for {key}, which is not open"
                if req.rid is None:
                    req.rid = m.rid
                    self.by_rid[m.rid] = req
                assert req.rid == m.rid
                if req.committed_attempt is not None:  # only a continuation of its stream (inv 3)
                    self._check_continuation(req, m, s.ref.migrations)
                assert 1 <= m.attempt <= self.s.max_attempts + req.migrations, f"{key}: attempt {m.attempt}"
                assert all(a.attempt < m.attempt for a in req.requests), f"{key}: attempt {m.attempt} not increasing"
                if not req.idempotent:
                    assert not any(a.delivered for a in req.requests), f"{key}: non-idempotent request sent twice"
                assert s.identity not in self.draining, f"{key}: REQUEST to draining worker {s.identity!r}"
                assert self.spoke.get(s.identity), f"{key}: REQUEST to unconfirmed session {s.identity!r}"
                for a in req.requests:
                    a.abandoned = True
                att = self.atts[(s.identity, m.rid, m.attempt)] = Att(s.identity, m.rid, m.attempt, key)
                req.requests.append(att)
                self.step.append((s, m))
                return m
            if cmd == _CANCEL:
                m = P.decode_broker_to_worker(s.frames)
                a = self.atts.get((s.identity, m.rid, m.attempt))
                if a is not None:
                    a.abandoned = True
            elif cmd == _DISCONNECT:
                for a in self.atts.values():
                    if a.ident == s.identity:
                        a.abandoned = True
            self.step.append((s, None))
            return None
        m = P.decode_client_reply(s.frames)
        assert isinstance(m, (P.Accepted, P.ClientChunk, P.ClientFinal, P.ClientError)), m
        key = (s.identity, m.rid)
        self.step.append((s, m))
        if key == self.dup_key and isinstance(m, P.ClientError) and m.code == "duplicate" and not self.dup_errors:
            self.dup_errors += 1
            return m
        req = self.reqs.get(key)
        assert req is not None, f"client frame for unknown request {key}: {m}"
        assert not req.terminals_created, f"{key}: {type(m).__name__} after its terminal frame {req.created[-1]} (inv 1/2)"
        assert not req.forgotten, f"{key}: {m} after the core dropped it"
        req.created.append(m)
        if isinstance(m, _TERMINAL):
            req.terminals_created += 1
            for a in req.requests:
                a.abandoned = True
        elif isinstance(m, P.ClientChunk):
            assert req.stream, f"{key}: chunk for a non-streamed request"
            if req.committed_attempt is None:
                req.committed_attempt = req.requests[-1].attempt if req.requests else 0
        elif isinstance(m, P.Accepted):
            assert req.stream, f"{key}: ACCEPTED for a non-streamed request"
            assert req.requests and req.requests[-1].attempt == m.attempt
        return m

    def _check_continuation(self, req: Req, m: P.Request, migrations: int) -> None:
        """A REQUEST after a chunk was streamed: a migration (or the same one again, to another
        worker, when its REQUEST could not be delivered), with exactly the tokens streamed so far."""
        assert req.stream and req.idempotent, f"{req.key}: attempt {m.attempt} after a chunk was streamed (inv 3)"
        assert migrations == req.migrations + 1 or (migrations == req.migrations and not req.requests[-1].delivered), \
            f"{req.key}: attempt {m.attempt}, migration {migrations} after {req.migrations} (inv 3)"
        req.migrations = migrations
        assert req.migrations <= self.s.max_migrations, f"{req.key}: migration {req.migrations} (inv 3)"
        streamed = [t for d in req.created if isinstance(d, P.ClientChunk) for t in d.data["token_ids"]]
        if isinstance(req.prompt, str):  # a text prompt continues with the text streamed
            text = "".join(d.data.get("text", "") for d in req.created if isinstance(d, P.ClientChunk))
            assert m.submit.text == req.prompt + text, f"{req.key}: continued with {m.submit.text!r} (inv 3)"
        else:
            assert m.submit.input_ids == req.prompt + streamed, f"{req.key}: continued with {m.submit.input_ids} (inv 3)"
        assert m.submit.max_new_tokens == 4 - len(streamed) > 0, f"{req.key}: max_new_tokens {m.submit.max_new_tokens}"

    def _delivered(self, s, dec) -> None:
        if s.to == TO_WORKER:
            if isinstance(dec, P.Request):
                a = self.atts[(s.identity, dec.rid, dec.attempt)]
                a.delivered = True
                a.sess = self.core.pool.by_identity.get(s.identity)
            return
        if self.dup_key is not None and s.identity == self.dup_key[0] and getattr(dec, "rid", None) == self.dup_key[1] \
                and isinstance(dec, P.ClientError) and dec.code == "duplicate":
            return
        req = self.reqs[(s.identity, dec.rid)]
        assert not any(isinstance(d, _TERMINAL) for d in req.delivered), f"{req.key}: {dec} delivered after terminal"
        if isinstance(dec, P.ClientChunk):
            seqs = [d.seq for d in req.delivered if isinstance(d, P.ClientChunk)]
            assert dec.seq == len(seqs), f"{req.key}: chunk seq {dec.seq} after {seqs} (inv 2)"
        req.delivered.append(dec)

    def _failed(self, s, dec) -> None:
        if s.to == TO_CLIENT and isinstance(dec, P.ClientChunk):
            # the core cancels every request of a client that cannot take a chunk
            for r in self.reqs.values():
                if r.key[0] == s.identity and r.open:
                    r.forgotten = True
                    for a in r.requests:
                        a.abandoned = True

    # -- views ---------------------------------------------------------------------------
    def is_current(self, ident: bytes, rid: int, attempt: int) -> bool:
        a = self.atts.get((ident, rid, attempt))
        return (a is not None and a.delivered and not a.abandoned and not a.answered
                and a.sess is not None and self.core.pool.by_identity.get(ident) is a.sess)

    def made_for(self, key: Key | None, kind) -> list:
        return [d for s, d in self.step if s.to == TO_CLIENT and isinstance(d, kind) and (s.identity, d.rid) == key]

    # -- the invariants --------------------------------------------------------------------
    def check(self) -> None:
        core = self.core
        inflight = core.inflight
        # 5. the model's current attempts are the core's
        model_cur = {k for k, a in self.atts.items() if self.is_current(*k)}
        core_cur = {(i.session.identity, i.rid, i.attempt) for i in inflight.values()
                    if i.state is RequestState.DISPATCHED and i.session is not None}
        assert model_cur == core_cur, f"current attempts: model {sorted(model_cur)} core {sorted(core_cur)}"
        # 1. the open requests are the core's
        model_open = {k for k, r in self.reqs.items() if r.open}
        core_open = {(i.client, i.client_rid) for i in inflight.values()}
        assert model_open == core_open, f"open requests: model {sorted(model_open)} core {sorted(core_open)}"
        # 4. retry budget
        b = core.budget
        holders = sum(1 for i in inflight.values() if i.holds_retry_budget)
        assert b.active == holders, f"budget.active {b.active}, {holders} requests hold it"
        assert b.active <= max(b.minimum, int(b.ratio * self.peak_inflight)), (b.active, self.peak_inflight)
        # 7. bookkeeping
        by_ident = core.pool.by_identity
        parked = {r for r, i in inflight.items() if i.state is RequestState.PARKED}
        assert set(core.parked) == parked, f"park queue {list(core.parked)} vs parked requests {sorted(parked)}"
        for rid, inf in inflight.items():
            assert inf.state is not RequestState.DONE
            if inf.session is not None:
                assert inf.state is RequestState.DISPATCHED, (rid, inf.state)
                assert by_ident.get(inf.session.identity) is inf.session, f"request {rid} on a removed session"
                assert inf.session.status is not SessionState.GONE
                assert rid in inf.session.inflight
            else:
                assert inf.state is not RequestState.DISPATCHED, f"request {rid} dispatched on no session"
        for sess in by_ident.values():
            assert sess.status is not SessionState.GONE
            for rid in sess.inflight:
                assert rid in inflight and inflight[rid].session is sess, f"{sess.worker_id} holds {rid}"
            booked = sum(1 for i in inflight.values() if i.decision is not None and i.decision.worker_id == sess.worker_id
                         and i.session is sess)
            assert sess.state.inflight == booked, f"{sess.worker_id}: WorkerState.inflight {sess.state.inflight}, {booked} booked"
        assert sum(core.client_quotas.values()) == len(inflight)
        if not inflight:
            assert not core.parked and b.active == 0 and not core.client_quotas
            for sess in by_ident.values():
                assert not sess.inflight and sess.state.inflight == 0

    def finish(self) -> None:
        """Run time far past every deadline (no keep-alive: workers expire too), then check that
        every request ended with exactly one terminal frame."""
        self.advance(self.s.default_deadline_ms / 1000.0 + self.s.drain_timeout_s + 5.0)
        self.check()
        assert not self.core.inflight, f"still in flight: {[(i.client_rid, i.state) for i in self.core.inflight.values()]}"
        for r in self.reqs.values():
            assert r.terminals_created <= 1
            if not r.accepted:
                assert r.terminals_created == 1 and len(r.created) == 1
            elif r.impaired:
                assert r.terminals_created == 1 or r.forgotten, f"{r.key}: no terminal frame, not dropped"
            else:
                assert r.terminals_created == 1, f"{r.key}: {len(r.created)} frames, no terminal one"
                assert sum(isinstance(d, _TERMINAL) for d in r.delivered) == 1, f"{r.key}: terminal not delivered"


# ------------------------------------------------------------------ the state machine

PER_WORKER_CAPS = [0, 0, 1, 2]
CONFIGS = st.fixed_dictionaries({
    "max_attempts": st.integers(1, 4),
    "retry_budget_min": st.integers(0, 3),
    "retry_budget_ratio": st.sampled_from([0.0, 0.2, 0.5]),
    "max_inflight": st.sampled_from([3, 1000, 1000]),
    "max_inflight_per_client": st.sampled_from([2, 1000, 1000]),
    "max_inflight_per_worker": st.sampled_from(PER_WORKER_CAPS),
    "park_timeout_s": st.sampled_from([0.0, 0.3, 1.0, 1.0]),
    "queue_timeout_s": st.sampled_from([0.0, 0.3, 1.0]),
    "max_parked": st.sampled_from([0, 2, 1000]),
    "park_aging_s": st.sampled_from([0.0, 0.2, 5.0]),
    "progress_timeout_ms": st.sampled_from([0, 300, 1500]),
    "eject_after_failures": st.sampled_from([1, 3, 5]),
    "default_deadline_ms": st.sampled_from([800, 3000]),
    "drain_timeout_s": st.sampled_from([0.5, 3.0]),
    "max_migrations": st.sampled_from([0, 1, 2]),
})
WORKERS = st.integers(0, N_WORKERS - 1)
CLIENTS = st.integers(0, N_CLIENTS - 1)
PICK = st.integers(0, 1 << 16)
STALE = st.sampled_from([False, False, True])
RARE = st.sampled_from([False, False, True])  # destructive rules act one time in three
RETRYABLE = ["worker_lost", "unavailable", "overloaded", "worker_error"]
FINAL_CODES = ["bad_request", "cancelled", "internal", "context_length_exceeded", "no_such_code"]


class BrokerCoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sh: Shell | None = None
        self.epoch = [0] * N_WORKERS
        self.conn = [0] * N_WORKERS
        self.client_state = ["ok"] * N_CLIENTS  # ok | slow | gone

    # -- helpers -------------------------------------------------------------------------
    def ident(self, w: int) -> bytes:
        return worker_ident(w, self.epoch[w], self.conn[w])

    def alive(self, ident: bytes) -> bool:
        return self.sh.down.get((TO_WORKER, ident)) != "unreachable"

    def client(self, c: int) -> bytes:
        return f"C{c}".encode()

    def held(self, w: int, pick: int, stale: bool) -> Att | None:
        """One request worker ``w``'s live connections hold: a current attempt, or (``stale``) a
        superseded one if it holds any (it does not know the broker gave up on it)."""
        prefix = f"W{w}/".encode()
        held = [a for k, a in sorted(self.sh.atts.items()) if k[0].startswith(prefix) and a.delivered
                and not a.answered and self.alive(a.ident)]
        want = [a for a in held if self.sh.is_current(a.ident, a.rid, a.attempt) != stale] or held
        return want[pick % len(want)] if want else None

    # -- set-up ----------------------------------------------------------------------------
    @initialize(cfg=CONFIGS, n_ready=st.sampled_from([0, 1, 2, 3, 3]))
    def setup(self, cfg, n_ready):
        self.sh = Shell(**cfg)
        for w in range(n_ready):  # registered and confirmed at start
            self.sh.worker(self.ident(w), P.encode_ready(ready(w, self.epoch[w])))
            self.sh.worker(self.ident(w), P.encode_heartbeat())

    # -- clients ---------------------------------------------------------------------------
    @rule(c=CLIENTS, stream=st.booleans(), idem=st.booleans(), deadline=st.sampled_from([None, None, 150, 600, 2000]),
          n=st.integers(1, 6))
    def submit(self, c, stream, idem, deadline, n):
        if self.client_state[c] == "gone":
            return
        self.sh.submit(self.client(c), stream, idem, deadline, n)

    @rule(pick=PICK)
    def duplicate_submit(self, pick):
        live = [k for k, r in sorted(self.sh.reqs.items()) if r.open and self.client_state[int(k[0][1:])] != "gone"]
        if live:
            client, rid = live[pick % len(live)]
            self.sh.submit(client, True, True, None, rid=rid)

    @rule(pick=PICK)
    def client_cancel(self, pick):
        keys = [k for k in sorted(self.sh.reqs) if self.client_state[int(k[0][1:])] != "gone"]
        if keys:
            client, rid = keys[pick % len(keys)]
            req = self.sh.reqs[(client, rid)]
            was_open = req.open
            self.sh.call(self.sh.core.client_frames, [client, *P.encode_cancel(rid)], self.sh.now)
            errs = self.sh.made_for((client, rid), P.ClientError)
            if was_open:
                assert [e.code for e in errs] == ["cancelled"], errs
            else:
                assert not errs

    @rule(c=CLIENTS)
    def http_client_went_away(self, c):
        if self.client_state[c] != "gone":
            self.sh.call(self.sh.core.cancel_client, self.client(c), self.sh.now)

    @rule(c=CLIENTS, state=st.sampled_from(["ok", "ok", "slow", "gone"]))
    def client_health(self, c, state):
        if self.client_state[c] == "gone":
            return
        self.client_state[c] = state
        ident = self.client(c)
        if state == "ok":
            self.sh.down.pop((TO_CLIENT, ident), None)
            return
        self.sh.down[(TO_CLIENT, ident)] = "send_hwm" if state == "slow" else "unreachable"
        for r in self.sh.reqs.values():
            if r.key[0] == ident and r.open:
                r.impaired = True

    # -- workers ---------------------------------------------------------------------------
    @rule(w=WORKERS, mode=st.sampled_from(["ready", "ready", "restart", "reconnect", "new_epoch_same_conn"]))
    def worker_ready(self, w, mode):
        """READY: on its connection (first or repeated), after a restart (new epoch, new
        connection; the old one is dead), on a second connection while the first is up, or
        with a new epoch on the same connection (a protocol violation)."""
        if mode == "restart":
            self.sh.down[(TO_WORKER, self.ident(w))] = "unreachable"
            self.epoch[w] += 1
            self.conn[w] += 1
        elif mode == "reconnect":
            self.conn[w] += 1
        elif mode == "new_epoch_same_conn":
            self.epoch[w] += 1
        elif not self.alive(self.ident(w)):  # a dead worker comes back as a restart
            self.epoch[w] += 1
            self.conn[w] += 1
        self.sh.worker(self.ident(w), P.encode_ready(ready(w, self.epoch[w])))

    @rule(w=WORKERS)
    def worker_heartbeat(self, w):
        if self.alive(self.ident(w)):
            self.sh.worker(self.ident(w), P.encode_heartbeat())

    def _reply(self, a: Att, frames: list[bytes], kind: str, seq: int = 0, code: str = "") -> None:
        sh, core = self.sh, self.sh.core
        cur = sh.is_current(a.ident, a.rid, a.attempt)
        inf = core.inflight.get(a.rid)
        # the worker's seq counts from 0 per attempt; a continued stream's client seq goes on
        expect_seq = inf.chunks_sent - inf.seq_base if inf is not None else None
        client_seq = inf.chunks_sent if inf is not None else None
        registered = a.ident in core.pool.by_identity
        stale0 = core.stats.dropped["stale_reply"]
        ooo0 = core.stats.dropped["chunk_out_of_order"]
        sh.worker(a.ident, frames)
        stale = core.stats.dropped["stale_reply"] - stale0
        req = sh.reqs.get(a.key)
        if any(isinstance(d, P.Request) and s.identity == a.ident and (d.rid, d.attempt) == (a.rid, a.attempt) for s, d in sh.step):
            return  # the reply confirmed its session, which got this very attempt first (no real worker can race so)
        if not cur:  # inv 5: a superseded attempt's reply reaches no client
            assert not sh.made_for(a.key, (P.ClientChunk, P.ClientFinal)), f"stale {kind} {a} reached the client"
            assert stale == (1 if registered else 0), f"stale {kind} {a}: stale_reply +{stale}"
            return
        assert stale == 0, f"current {kind} {a} counted stale"
        if kind == "chunk":
            chunks = sh.made_for(a.key, P.ClientChunk)
            if seq == expect_seq and req.stream:
                assert [c.seq for c in chunks] == [client_seq], f"chunk {seq} of {a}: {chunks}"
            else:
                assert not chunks
                if seq != expect_seq and req.stream:  # (a non-streamed request's chunks are not forwarded, nor checked)
                    assert core.stats.dropped["chunk_out_of_order"] == ooo0 + 1
        elif kind == "final":
            assert len(sh.made_for(a.key, P.ClientFinal)) == 1, f"final of {a} not forwarded"
        else:
            c = ErrorCode(code) if code in ErrorCode._value2member_map_ else ErrorCode.WORKER_ERROR
            errs = sh.made_for(a.key, P.ClientError)
            if c.retryable:
                now_inf = core.inflight.get(a.rid)
                assert errs or (now_inf is not None and now_inf.state in (RequestState.RETRY_WAIT, RequestState.PARKED,
                                                                          RequestState.DISPATCHED)), (a, errs)
            else:
                assert [e.code for e in errs] == [c.value], f"error {code} of {a}: {errs}"

    @rule(w=WORKERS, pick=PICK, stale=STALE, mode=st.sampled_from(["next", "next", "next", "skip", "repeat"]))
    def worker_chunk(self, w, pick, stale, mode):
        a = self.held(w, pick, stale)
        if a is None:
            return
        seq = {"next": a.next_seq, "skip": a.next_seq + 1, "repeat": max(0, a.next_seq - 1)}[mode]
        self._reply(a, P.encode_worker_chunk(a.rid, a.attempt, seq, {"token_ids": [100 * a.attempt + seq]}), "chunk", seq=seq)
        if mode == "next":
            a.next_seq += 1

    @rule(w=WORKERS, pick=PICK, stale=STALE)
    def worker_final(self, w, pick, stale):
        a = self.held(w, pick, stale)
        if a is not None:
            self._reply(a, P.encode_worker_final(a.rid, a.attempt, "stop", USAGE, {"token_ids": [1]}), "final")
            a.answered = True

    @rule(w=WORKERS, pick=PICK, stale=STALE, code=st.sampled_from(RETRYABLE + FINAL_CODES))
    def worker_error(self, w, pick, stale, code):
        a = self.held(w, pick, stale)
        if a is not None:
            self._reply(a, P.encode_worker_error(a.rid, a.attempt, code, "boom"), "error", code=code)
            a.answered = True

    @rule(w=WORKERS, pick=PICK, finish=st.sampled_from([False, False, True]))
    def worker_serves(self, w, pick, finish):
        """The common case, weighted up: a current attempt's next chunk, or its FINAL."""
        a = self.held(w, pick, False)
        if a is None:
            return
        if finish:
            self._reply(a, P.encode_worker_final(a.rid, a.attempt, "length", USAGE, {"token_ids": [2]}), "final")
            a.answered = True
        else:
            self._reply(a, P.encode_worker_chunk(a.rid, a.attempt, a.next_seq, {"token_ids": [100 * a.attempt + a.next_seq]}),
                        "chunk", seq=a.next_seq)
            a.next_seq += 1

    @rule(w=WORKERS, rid=st.integers(1, 12), attempt=st.integers(1, 5), kind=st.sampled_from(["chunk", "final", "error"]))
    def worker_bogus_reply(self, w, rid, attempt, kind):
        """A reply for any (rid, attempt): one the worker never held, or one it already answered."""
        ident = self.ident(w)
        if not self.alive(ident) or self.sh.is_current(ident, rid, attempt):
            return
        a = self.sh.atts.get((ident, rid, attempt)) or Att(ident, rid, attempt, self.sh.by_rid[rid].key if rid in self.sh.by_rid else None)
        frames = {"chunk": lambda: P.encode_worker_chunk(rid, attempt, 0, {}),
                  "final": lambda: P.encode_worker_final(rid, attempt, "stop", USAGE),
                  "error": lambda: P.encode_worker_error(rid, attempt, "unavailable", "no")}[kind]()
        self._reply(a, frames, kind, code="unavailable" if kind == "error" else "")

    @rule(w=WORKERS, draining=st.booleans(), go=RARE)
    def worker_disconnect(self, w, draining, go):
        ident = self.ident(w)
        if not go or not self.alive(ident):
            return
        self.sh.worker(ident, P.encode_disconnect(P.DRAINING if draining else "bye"))
        if draining:
            if ident in self.sh.core.pool.by_identity:
                self.sh.draining.add(ident)
        else:  # it closed its connection
            self.sh.down[(TO_WORKER, ident)] = "unreachable"

    @rule(w=WORKERS, go=RARE)
    def worker_dies(self, w, go):
        """Its connection is gone: every send to it fails unreachable (the next heartbeat removes it)."""
        if go:
            self.sh.down[(TO_WORKER, self.ident(w))] = "unreachable"

    @rule(pick=PICK, how=st.sampled_from(["worker_lost", "worker_error", "dies"]))
    def stream_loses_its_worker(self, pick, how):
        """The migration path weighted up (issue 31): a current attempt that streamed output
        loses its worker (its engine failed, or its connection is gone)."""
        sh = self.sh
        live = [a for k, a in sorted(sh.atts.items()) if sh.is_current(*k) and self.alive(a.ident) and sh.reqs[a.key].stream]
        if not live:
            return
        a = live[pick % len(live)]
        self._reply(a, P.encode_worker_chunk(a.rid, a.attempt, a.next_seq, {"token_ids": [100 * a.attempt + a.next_seq]}),
                    "chunk", seq=a.next_seq)  # (it streams first)
        a.next_seq += 1
        if not sh.is_current(a.ident, a.rid, a.attempt):  # its client could not take the chunk
            return
        if how == "dies":
            sh.down[(TO_WORKER, a.ident)] = "unreachable"
        else:
            self._reply(a, P.encode_worker_error(a.rid, a.attempt, how, "engine died mid-stream"), "error", code=how)
            a.answered = True

    @rule(w=WORKERS, on=st.booleans())
    def worker_congested(self, w, on):
        ident = self.ident(w)
        if self.alive(ident):
            if on:
                self.sh.down[(TO_WORKER, ident)] = "send_hwm"
            else:
                self.sh.down.pop((TO_WORKER, ident), None)

    # -- time and the broker -------------------------------------------------------------
    @rule(dt=st.sampled_from([0.001, 0.02, 0.1, 0.35, 0.8, 2.0]), keepalive=st.sampled_from([True, True, False]))
    def advance(self, dt, keepalive):
        live = {self.ident(w) for w in range(N_WORKERS) if self.alive(self.ident(w))} if keepalive else set()
        self.sh.advance(dt, live)

    @rule(w=WORKERS, action=st.sampled_from(["drain", "eject", "reinstate"]), go=RARE)
    def operator(self, w, action, go):
        """The admin API: drain, eject or reinstate a worker (refused, with KeyError or
        ValueError, when the worker is unknown or its state does not allow it)."""
        if not go:
            return
        sh = self.sh
        sess = sh.core.pool.by_id.get(f"w{w}")
        if action == "reinstate" and sess is not None and sess.drained_by == "operator":
            sh.draining.discard(sess.identity)  # routable again (requests may go to it in this very call)
        try:
            sh.call(sh.core.admin, action, f"w{w}", sh.now)
        except (KeyError, ValueError):
            sh.flush()
            return
        if action == "drain":
            sh.draining.add(sess.identity)

    @rule(go=RARE)
    def broker_drain(self, go):
        if go and self.sh.core.state == "serving" and self.sh.rid_seq > 4:
            self.sh.call(self.sh.core.begin_drain, self.sh.now)

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if self.sh is not None:
            self.sh.check()

    def teardown(self):
        if self.sh is not None:
            self.sh.finish()


_COMMON = dict(database=None, print_blob=True, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])

TestBrokerCore = BrokerCoreMachine.TestCase
TestBrokerCore.settings = settings(max_examples=200, stateful_step_count=50, **_COMMON)


class BrokerCoreSoak(BrokerCoreMachine):
    pass


# make soak: 5,000 examples of 100 steps (about 3 minutes on 2 cores; the default 120 s test timeout is too short)
TestBrokerCoreSoak = pytest.mark.timeout(1800)(pytest.mark.soak(BrokerCoreSoak.TestCase))
TestBrokerCoreSoak.settings = settings(max_examples=5000, stateful_step_count=100, **_COMMON)



# ------------------------------------------------------------------ plain examples (cases the machine found)

def _client_frames(sh: Shell, key: Key) -> list:
    return sh.reqs[key].delivered


def test_worker_lost_after_the_first_chunk_fails_the_request_with_worker_lost():
    sh = Shell(progress_timeout_ms=0, max_migrations=0)  # (issue 31: with migrations on, it continues: below)
    w0, w1 = sh.add_worker(0), sh.add_worker(1)
    req = sh.submit(b"C0", True, True, None)
    (att,) = req.requests
    assert att.delivered
    sh.worker(att.ident, P.encode_worker_chunk(att.rid, att.attempt, 0, {"token_ids": [7]}))
    sh.check()
    sh.down[(TO_WORKER, att.ident)] = "unreachable"  # its connection is gone
    sh.advance(0.6, keepalive={w0, w1} - {att.ident})  # its next heartbeat fails: removed
    sh.check()
    kinds = [type(d).__name__ for d in _client_frames(sh, req.key)]
    assert kinds == ["Accepted", "ClientChunk", "ClientError"]
    assert req.delivered[-1].code == "worker_lost"
    assert len(req.requests) == 1  # committed: never re-dispatched
    assert sh.core.stats.workers["connection_lost"] == 1
    sh.finish()


def _stream_then_lose(sh: Shell, params: dict | None = None, how: str = "dies", **body):
    """Two workers; a stream whose first worker sends one chunk ([7]) and is then lost (``how``:
    its connection dies, or its adapter reports that the engine failed mid-stream)."""
    w0, w1 = sh.add_worker(0), sh.add_worker(1)
    req = sh.submit(b"C0", True, True, None, params=params, **body)
    (att,) = req.requests
    sh.worker(att.ident, P.encode_worker_chunk(att.rid, att.attempt, 0, {"token_ids": [7], "text": " seven"}))
    if how == "dies":
        sh.down[(TO_WORKER, att.ident)] = "unreachable"
        sh.advance(0.6, keepalive={w0, w1} - {att.ident})  # its next heartbeat fails: removed
    else:
        sh.worker(att.ident, P.encode_worker_error(att.rid, att.attempt, how, "engine connection reset mid-stream"))
        sh.advance(0.01, keepalive={w0, w1})
    sh.check()
    return req, att, ({w0, w1} - {att.ident}).pop()


@pytest.mark.parametrize("how", ["dies", "worker_error", "unavailable", "worker_lost"])
def test_a_stream_whose_worker_is_lost_mid_stream_continues_on_another_worker(how):
    sh = Shell(progress_timeout_ms=0)
    req, first, other = _stream_then_lose(sh, how=how)
    second = req.requests[-1]
    assert len(req.requests) == 2 and second.ident == other and second.delivered
    sent = sh.atts[(second.ident, second.rid, second.attempt)]
    assert sent.attempt == 2
    m = [d for s, d in sh.step if isinstance(d, P.Request)] or None
    inf = sh.core.inflight[second.rid]
    assert inf.submit.input_ids == [1, 2, 3, 7] and inf.submit.max_new_tokens == 3  # prompt + tokens so far
    assert sh.core.stats.migrations[how if how != "dies" else "worker_lost"] == 1
    # the new worker counts its chunks from 0; the client's stream goes on at seq 1
    sh.worker(other, P.encode_worker_chunk(second.rid, 2, 0, {"token_ids": [8]}))
    sh.worker(first.ident, P.encode_worker_chunk(first.rid, 1, 1, {"token_ids": [9]}))  # the lost attempt: stale
    sh.worker(other, P.encode_worker_final(second.rid, 2, "length", {"prompt_tokens": 4, "completion_tokens": 3,
                                                                       "cached_tokens": 3}, {"token_ids": [10]}))
    frames = _client_frames(sh, req.key)
    assert [type(d).__name__ for d in frames] == ["Accepted", "ClientChunk", "Accepted", "ClientChunk", "ClientFinal"]
    assert [d.seq for d in frames if isinstance(d, P.ClientChunk)] == [0, 1]
    assert [d.data["token_ids"] for d in frames if isinstance(d, P.ClientChunk)] == [[7], [8]]
    assert frames[-1].usage == {"prompt_tokens": 3, "completion_tokens": 4, "cached_tokens": 3}  # as the client asked
    assert m is None or all(d.submit.input_ids == [1, 2, 3, 7] for d in m)
    sh.check()
    sh.finish()


def test_a_text_prompt_continues_with_the_text_streamed_so_far():
    sh = Shell(progress_timeout_ms=0)
    w0, w1 = sh.add_worker(0), sh.add_worker(1)
    frames = P.encode_submit("t1", text="hello", params={"max_new_tokens": 4}, stream=True)
    sh.reqs[(b"C0", "t1")] = req = Req((b"C0", "t1"), True, True, prompt="hello")
    sh.step = []
    sh.core.client_frames([b"C0", *frames], sh.now)
    req.accepted = True
    sh.flush()
    (att,) = req.requests
    sh.worker(att.ident, P.encode_worker_chunk(att.rid, 1, 0, {"token_ids": [7], "text": " seven"}))
    sh.worker(att.ident, P.encode_worker_error(att.rid, 1, "worker_lost", "engine died"))
    sh.advance(0.01, keepalive={w0, w1})
    inf = sh.core.inflight[att.rid]
    assert inf.submit.text == "hello seven" and inf.submit.input_ids is None and inf.submit.max_new_tokens == 3


@pytest.mark.parametrize("params, body, reason", [
    ({"json_schema": '{"type": "object"}'}, {}, "constrained"),
    ({"regex": "[a-z]+"}, {}, "constrained"),
    ({"ebnf": "root ::= 'a'"}, {}, "constrained"),
    ({"n": 2}, {}, "n"),
    ({"frequency_penalty": 0.5}, {}, "penalties"),
    ({"stop": ["seven up"]}, {}, "stop_strings"),  # the text so far (" seven") may be the start of a stop string
    ({"max_new_tokens": 1}, {}, "exhausted"),
    ({}, {"passthrough": {"path": "/v1/responses", "method": "POST", "body": b"{}"}}, "passthrough"),
])
def test_a_stream_that_cannot_be_continued_exactly_ends_with_worker_lost(params, body, reason):
    sh = Shell(progress_timeout_ms=0)
    req, _, _ = _stream_then_lose(sh, params, **body)
    assert len(req.requests) == 1
    assert isinstance(req.delivered[-1], P.ClientError) and req.delivered[-1].code == "worker_lost"
    assert f"not continued: {reason}" in req.delivered[-1].message
    assert sh.core.stats.migration_refused == {reason: 1} and not sh.core.stats.migrations
    sh.finish()


def test_stop_strings_the_stream_cannot_straddle_still_continue():
    sh = Shell(progress_timeout_ms=0)
    req, _, _ = _stream_then_lose(sh, {"stop": ["</answer>"]})
    assert len(req.requests) == 2 and sh.core.stats.migrations["worker_lost"] == 1
    sh.finish()


def test_a_lost_stream_with_no_other_worker_still_ends_with_worker_lost():
    sh = Shell(progress_timeout_ms=0, park_timeout_s=0.0)
    w0 = sh.add_worker(0)
    req = sh.submit(b"C0", True, True, None)
    (att,) = req.requests
    sh.worker(att.ident, P.encode_worker_chunk(att.rid, 1, 0, {"token_ids": [7]}))
    sh.down[(TO_WORKER, w0)] = "unreachable"
    sh.advance(2.0)
    assert req.delivered[-1].code == "worker_lost", req.delivered[-1]
    assert len(req.requests) == 1
    sh.finish()


def test_migrations_per_request_are_bounded():
    sh = Shell(progress_timeout_ms=0, max_migrations=1)
    w2 = sh.add_worker(2)
    req, _, other = _stream_then_lose(sh)
    second = req.requests[-1]
    sh.worker(other, P.encode_worker_chunk(second.rid, 2, 0, {"token_ids": [8]}))
    sh.worker(other, P.encode_worker_error(second.rid, 2, "worker_lost", "engine died again"))
    sh.check()
    assert len(req.requests) == 2  # w2 was free, but the one migration is spent
    assert req.delivered[-1].code == "worker_lost" and "not continued: limit" in req.delivered[-1].message
    assert sh.core.stats.migration_refused["limit"] == 1 and sh.core.stats.migrations["worker_lost"] == 1
    assert [d.seq for d in req.delivered if isinstance(d, P.ClientChunk)] == [0, 1]
    assert w2 not in {a.ident for a in req.requests}
    sh.finish()


def test_a_continuation_that_fails_before_its_first_chunk_is_another_migration():
    sh = Shell(progress_timeout_ms=0)
    sh.add_worker(2)
    req, _, other = _stream_then_lose(sh)
    second = req.requests[-1]
    sh.worker(other, P.encode_worker_error(second.rid, 2, "unavailable", "engine restarting"))
    sh.advance(0.01, keepalive={worker_ident(w, 0, 0) for w in range(3)})
    third = req.requests[-1]
    assert third.attempt == 3 and third.ident == worker_ident(2, 0, 0)
    assert sh.core.inflight[third.rid].submit.input_ids == [1, 2, 3, 7]  # nothing more was streamed
    sh.worker(third.ident, P.encode_worker_chunk(third.rid, 3, 0, {"token_ids": [8]}))
    sh.worker(third.ident, P.encode_worker_final(third.rid, 3, "length", USAGE))
    assert [d.seq for d in req.delivered if isinstance(d, P.ClientChunk)] == [0, 1]
    assert isinstance(req.delivered[-1], P.ClientFinal)
    sh.finish()


@pytest.mark.parametrize("chunks, reason", [
    ([{"token_ids": "many"}], "no_token_ids"),
    ([{"text": "words but no ids"}], "no_token_ids"),
    ([{"token_ids": [2**40]}], "bad_chunk"),
    ([{"token_ids": [1]}] * 6, "too_many_chunks"),  # more chunks than max_new_tokens (4): a flood, not kept
])
def test_hostile_chunks_from_a_lost_worker_end_the_stream_with_worker_lost(chunks, reason):
    sh = Shell(progress_timeout_ms=0)
    w0, w1 = sh.add_worker(0), sh.add_worker(1)
    req = sh.submit(b"C0", True, True, None)
    (att,) = req.requests
    for i, c in enumerate(chunks):
        sh.worker(att.ident, P.encode_worker_chunk(att.rid, 1, i, c))
    sh.worker(att.ident, P.encode_worker_error(att.rid, 1, "worker_lost", "engine died"))
    assert req.delivered[-1].code == "worker_lost" and f"not continued: {reason}" in req.delivered[-1].message
    assert sh.core.stats.migration_refused == {reason: 1} and len(req.requests) == 1
    sh.finish()


def test_a_retry_drops_the_first_attempts_late_replies_as_stale():
    sh = Shell(progress_timeout_ms=0)
    sh.add_worker(0)
    sh.add_worker(1)
    req = sh.submit(b"C0", True, True, None)
    (first,) = req.requests
    sh.worker(first.ident, P.encode_worker_error(first.rid, 1, "overloaded", "busy"))
    assert sh.core.inflight[first.rid].state is RequestState.RETRY_WAIT
    sh.advance(0.3, keepalive={worker_ident(0, 0, 0), worker_ident(1, 0, 0)})  # back-off over: attempt 2
    second = req.requests[-1]
    assert second.attempt == 2 and second.ident != first.ident and second.delivered
    stale0 = sh.core.stats.dropped["stale_reply"]
    n = len(req.delivered)
    sh.worker(first.ident, P.encode_worker_chunk(first.rid, 1, 0, {"token_ids": [1]}))
    sh.worker(first.ident, P.encode_worker_final(first.rid, 1, "stop", USAGE))
    assert sh.core.stats.dropped["stale_reply"] == stale0 + 2 and len(req.delivered) == n  # nothing reached the client
    sh.worker(second.ident, P.encode_worker_chunk(second.rid, 2, 0, {"token_ids": [2]}))
    sh.worker(second.ident, P.encode_worker_final(second.rid, 2, "stop", USAGE))
    kinds = [type(d).__name__ for d in req.delivered]
    assert kinds == ["Accepted", "Accepted", "ClientChunk", "ClientFinal"]
    assert req.delivered[-1].attempt == 2 and req.delivered[2].data == {"token_ids": [2]}
    sh.check()
    sh.finish()


def test_non_idempotent_request_is_not_retried_but_an_undelivered_one_moves_on():
    sh = Shell(progress_timeout_ms=0)
    w0, w1 = sh.add_worker(0), sh.add_worker(1)
    # a worker that died unnoticed: the REQUEST cannot be delivered, so it goes to the other one at once
    sh.down[(TO_WORKER, w0)] = sh.down[(TO_WORKER, w1)] = "send_hwm"
    req = sh.submit(b"C0", True, False, None)
    assert [a.delivered for a in req.requests] == [False, False]
    assert [type(d).__name__ for d in req.delivered] == ["ClientError"]  # no ACCEPTED for undelivered attempts
    assert req.delivered[0].code == "unavailable"
    del sh.down[(TO_WORKER, w1)]
    req = sh.submit(b"C0", True, False, None)
    a = req.requests[-1]
    assert a.delivered and a.ident == w1 and [x.delivered for x in req.requests] == [False, True][-len(req.requests):]
    sh.worker(a.ident, P.encode_worker_error(a.rid, a.attempt, "unavailable", "engine restarting"))
    assert req.delivered[-1].code == "unavailable" and req.requests[-1] is a  # executed once: not re-sent
    sh.check()
    sh.finish()


def test_an_out_of_order_chunk_is_dropped_and_the_stream_stays_contiguous():
    sh = Shell(progress_timeout_ms=0)
    sh.add_worker(0)
    req = sh.submit(b"C0", True, True, None)
    (a,) = req.requests
    for seq in (0, 2, 1, 1, 2):
        sh.worker(a.ident, P.encode_worker_chunk(a.rid, 1, seq, {"token_ids": [seq]}))
    assert [d.seq for d in req.delivered if isinstance(d, P.ClientChunk)] == [0, 1, 2]
    assert sh.core.stats.dropped["chunk_out_of_order"] == 2
    sh.worker(a.ident, P.encode_worker_final(a.rid, 1, "stop", USAGE))
    sh.worker(a.ident, P.encode_worker_chunk(a.rid, 1, 3, {"token_ids": [3]}))  # after FINAL: stale
    assert isinstance(req.delivered[-1], P.ClientFinal)
    sh.finish()


def test_prefill_decode_handoff_streams_from_the_decode_worker():
    sh = Shell(pd=True, progress_timeout_ms=0)
    pre, dec = sh.add_worker(0, "prefill"), sh.add_worker(1, "decode")
    req = sh.submit(b"C0", True, True, None)
    (p1,) = req.requests
    assert p1.ident == pre
    m = P.decode_broker_to_worker([s.frames for s, d in sh.step if isinstance(d, P.Request)][0])
    assert m.bootstrap["mode"] == "prefill" and m.bootstrap["decode_worker"] == "w1"
    sh.worker(pre, P.encode_worker_final(p1.rid, 1, "prefill_done", {"prompt_tokens": 3, "cached_tokens": 2}))
    d2 = req.requests[-1]
    assert (d2.ident, d2.attempt, d2.delivered) == (dec, 2, True)
    assert sh.core.pool.by_identity[pre].state.inflight == 0 and sh.core.pool.by_identity[dec].state.inflight == 1
    sh.worker(dec, P.encode_worker_chunk(d2.rid, 2, 0, {"token_ids": [5]}))
    sh.worker(pre, P.encode_worker_chunk(p1.rid, 1, 0, {"token_ids": [6]}))  # the prefill leg's attempt is over
    sh.worker(dec, P.encode_worker_final(d2.rid, 2, "stop", {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}))
    kinds = [type(d).__name__ for d in req.delivered]
    assert kinds == ["Accepted", "ClientChunk", "ClientFinal"]
    assert req.delivered[-1].usage["cached_tokens"] == 2 and req.delivered[-1].worker == "w1"
    assert sh.core.stats.dropped["stale_reply"] == 1
    assert all(s.state.inflight == 0 for s in sh.core.pool.by_identity.values())
    sh.finish()


# ------------------------------------------------------------------ bugs the machine found (mesh/broker_core/)

# (found by the state machine as a core bug, fixed: kept as a regression test)
def test_progress_check_rearmed_for_now_does_not_livelock():
    sh = Shell(progress_timeout_ms=300)
    w = sh.add_worker(0)
    a = sh.submit(b"C0", True, True, None, n=2)  # window 0.3 + 2/5000 = 0.3004 s
    b = sh.submit(b"C0", True, True, None, n=2)
    last = T0 + 1e-6
    window = 300 / 1000.0 + 2 / 5000.0
    assert last + window - last < window  # the rounding that makes it happen
    sh.now = last
    sh.worker(w, P.encode_worker_chunk(b.requests[0].rid, 1, 0, {}))  # the worker is busy: a's check re-arms
    sh.at(T0 + window, sh.core.tick, True)
    assert a.key in {(i.client, i.client_rid) for i in sh.core.inflight.values()}
    sh.at(last + window, sh.core.tick, True)  # the re-armed check, at the time it asked for


# (found by the state machine as a core bug, fixed: kept as a regression test)
@pytest.mark.parametrize("reason", ["bye", P.DRAINING])
def test_a_disconnect_as_first_message_gets_no_parked_request(reason):
    sh = Shell(max_attempts=1, park_timeout_s=1.0)
    ident = worker_ident(0, 0, 0)
    sh.worker(ident, P.encode_ready(ready(0, 0)))  # registered, not confirmed yet
    req = sh.submit(b"C0", True, True, None)
    assert sh.core.inflight[max(sh.core.inflight)].state is RequestState.PARKED
    sh.worker(ident, P.encode_disconnect(reason))
    assert not req.requests, f"REQUEST sent to a worker leaving with {reason!r}; client got {req.delivered}"


# (found by the state machine as a core bug, fixed: kept as a regression test)
@pytest.mark.parametrize("how", ["cancel_client", "client_gone", "drain"])
def test_tearing_down_a_clients_requests_does_not_unpark_them_into_a_second_finish(how):
    sh = Shell(max_inflight_per_worker=1, queue_timeout_s=0.0, progress_timeout_ms=0, drain_timeout_s=0.5)
    w = sh.add_worker(0)
    r1 = sh.submit(b"C0", True, True, None)  # on the worker, which is now at its cap
    r2 = sh.submit(b"C0", True, True, None)  # parked (its wait is over at once: queue_timeout_s=0)
    assert r1.requests and not r2.requests and sh.core.parked
    sh.worker(w, P.encode_disconnect(P.DRAINING))  # r1 finishes there; no routable worker for r2
    sh.draining.add(w)
    if how == "cancel_client":
        sh.call(sh.core.cancel_client, b"C0", sh.now)
    elif how == "client_gone":
        sh.down[(TO_CLIENT, b"C0")] = "unreachable"
        r1.impaired = r2.impaired = True
        sh.worker(w, P.encode_worker_chunk(r1.requests[0].rid, 1, 0, {}))  # the chunk cannot reach it
    else:
        sh.call(sh.core.begin_drain, sh.now)
        sh.at(sh.now + 1.0, sh.core.drain_over)
    sh.check()
    assert not sh.core.inflight
    assert r2.terminals_created + r2.forgotten == 1 and not r2.requests


def _pd_handed_off(sh: Shell, n_prefill: int = 1, stream: bool = True, deadline_ms: int | None = None):
    """A P/D shell with ``n_prefill`` prefill workers (w0..) and one decode worker: one request
    handed off to its decode leg. Returns (request, prefill attempt, decode attempt, prefill idents, decode ident)."""
    pres = [sh.add_worker(i, "prefill") for i in range(n_prefill)]
    dec = sh.add_worker(n_prefill, "decode")
    req = sh.submit(b"C0", stream, True, deadline_ms)
    (p1,) = req.requests
    sh.worker(p1.ident, P.encode_worker_final(p1.rid, 1, "prefill_done", {"prompt_tokens": 3, "cached_tokens": 0}))
    d2 = req.requests[-1]
    assert d2.ident == dec and d2.attempt == 2
    return req, p1, d2, pres, dec


def test_a_prefill_leg_failing_after_its_handoff_aborts_the_decode_leg_and_retries_the_pair():
    sh = Shell(pd=True, progress_timeout_ms=0, max_attempts=6)  # a pair takes two attempts
    req, p1, d2, pres, dec = _pd_handed_off(sh, n_prefill=2)
    sh.worker(p1.ident, P.encode_worker_error(p1.rid, 1, ErrorCode.UNAVAILABLE, "prefill engine gone"))
    cancels = [P.decode_broker_to_worker(s.frames) for s, _ in sh.step if s.to == TO_WORKER and s.frames[1] == _CANCEL]
    assert [(c.rid, c.attempt) for c in cancels] == [(d2.rid, 2)]  # the decode leg is aborted
    assert sh.core.stats.decisions["pd_prefill_failed"] == 1
    sh.advance(1.0, keepalive={*pres, dec})  # the retry's back-off
    p3 = req.requests[-1]
    assert p3.attempt == 3 and p3.ident != p1.ident and p3.ident in pres  # a new pair, on the other prefill worker
    sh.worker(p3.ident, P.encode_worker_final(p3.rid, 3, "prefill_done", {"prompt_tokens": 3, "cached_tokens": 0}))
    d4 = req.requests[-1]
    assert (d4.ident, d4.attempt) == (dec, 4)  # the decode worker was not at fault: used again
    sh.worker(dec, P.encode_worker_final(d4.rid, 4, "stop", {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}))
    assert [type(d).__name__ for d in req.delivered][-1] == "ClientFinal"
    assert all(s.state.inflight == 0 for s in sh.core.pool.by_identity.values())
    sh.check()
    sh.finish()


def test_a_prefill_leg_failing_with_no_other_prefill_worker_ends_with_one_error():
    sh = Shell(pd=True, progress_timeout_ms=0, max_attempts=6)  # a pair takes two attempts
    req, p1, d2, pres, dec = _pd_handed_off(sh)
    sh.worker(p1.ident, P.encode_worker_error(p1.rid, 1, ErrorCode.WORKER_ERROR, "bootstrap did not complete"))
    sh.advance(1.0, keepalive={*pres, dec})
    errors = [d for d in req.delivered if isinstance(d, P.ClientError)]
    assert len(errors) == 1 and errors[0].code == "worker_error" and "bootstrap" in errors[0].message, errors
    assert not sh.core.inflight
    sh.finish()


def test_a_prefill_failure_after_the_decode_leg_answered_leaves_the_decode_leg_alone():
    sh = Shell(pd=True, progress_timeout_ms=0, max_attempts=6)  # a pair takes two attempts
    req, p1, d2, pres, dec = _pd_handed_off(sh)
    sh.worker(dec, P.encode_worker_chunk(d2.rid, 2, 0, {"token_ids": [5]}))  # the KV arrived: it streams
    sh.worker(p1.ident, P.encode_worker_error(p1.rid, 1, ErrorCode.UNAVAILABLE, "prefill engine gone"))
    assert sh.core.stats.dropped["pd_prefill_failed_after_decode"] == 1
    sh.worker(dec, P.encode_worker_final(d2.rid, 2, "stop", {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}))
    assert [type(d).__name__ for d in req.delivered] == ["Accepted", "ClientChunk", "ClientFinal"]
    sh.finish()


def test_a_prefill_failure_while_a_decode_resend_waits_turns_it_into_a_pair_retry():
    sh = Shell(pd=True, progress_timeout_ms=0, max_attempts=6)  # a pair takes two attempts
    req, p1, d2, pres, dec = _pd_handed_off(sh, n_prefill=2)
    sh.worker(dec, P.encode_worker_error(d2.rid, 2, ErrorCode.WORKER_ERROR, "KV transfer failed"))  # decode re-send waits
    sh.worker(p1.ident, P.encode_worker_error(p1.rid, 1, ErrorCode.WORKER_ERROR, "prefill failed"))
    sh.advance(1.0, keepalive={*pres, dec})
    p3 = req.requests[-1]
    assert p3.attempt == 3 and p3.ident in pres and p3.ident != p1.ident  # a prefill leg, not a decode re-send
    sh.finish()


def test_a_p_d_request_ending_in_an_error_cancels_its_prefill_leg_too():
    sh = Shell(pd=True, progress_timeout_ms=0, max_attempts=6)
    req, p1, d2, pres, dec = _pd_handed_off(sh)
    sh.worker(dec, P.encode_worker_error(d2.rid, 2, ErrorCode.BAD_REQUEST, "refused"))  # not retryable: the request ends
    cancels = [(s.identity, P.decode_broker_to_worker(s.frames)) for s, _ in sh.step if s.to == TO_WORKER and s.frames[1] == _CANCEL]
    assert [(i, c.rid, c.attempt) for i, c in cancels] == [(p1.ident, p1.rid, 1)]  # the prefill leg's attempt
    assert isinstance(req.delivered[-1], P.ClientError)
    sh.finish()


def test_a_prefill_worker_lost_after_its_handoff_retries_the_pair():
    # (an SGLang prefill server and its adapter on a node that dies: no ERROR will ever come)
    sh = Shell(pd=True, progress_timeout_ms=0, max_attempts=6)
    req, p1, d2, pres, dec = _pd_handed_off(sh, n_prefill=2, deadline_ms=20_000)
    other = next(i for i in pres if i != p1.ident)
    sh.advance(5.0, keepalive={other, dec})  # p1's worker stops heartbeating: it expires
    assert p1.ident not in sh.core.pool.by_identity
    assert sh.core.stats.decisions["pd_prefill_lost"] == 1
    p3 = req.requests[-1]
    assert (p3.ident, p3.attempt) == (other, 3) and (d2.ident, d2.attempt) != (p3.ident, p3.attempt)
    assert sh.atts[(dec, d2.rid, 2)].abandoned  # the decode leg was cancelled
    sh.worker(other, P.encode_worker_final(p3.rid, 3, "prefill_done", {"prompt_tokens": 3, "cached_tokens": 0}))
    d4 = req.requests[-1]
    sh.worker(dec, P.encode_worker_final(d4.rid, 4, "stop", {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}))
    assert isinstance(req.delivered[-1], P.ClientFinal)
    sh.finish()


def test_a_prefill_worker_that_drains_away_leaves_its_decode_legs_alone():
    sh = Shell(pd=True, progress_timeout_ms=0, max_attempts=6)
    req, p1, d2, pres, dec = _pd_handed_off(sh)
    sh.worker(p1.ident, P.encode_disconnect("draining"))  # graceful: it finished its legs before leaving
    sh.worker(p1.ident, P.encode_disconnect("bye"))
    assert p1.ident not in sh.core.pool.by_identity and sh.core.stats.decisions["pd_prefill_lost"] == 0
    sh.worker(dec, P.encode_worker_final(d2.rid, 2, "stop", {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}))
    assert isinstance(req.delivered[-1], P.ClientFinal)
    sh.finish()


def test_a_worker_that_drained_itself_and_sends_ready_again_is_routable_and_the_harness_knows():
    """A repeated READY undrains a worker that drained itself (DNS discovery: its broker is back in
    the answer); requests may go to it again, and the harness's draining set follows the core."""
    sh = Shell()
    w = sh.add_worker(0)
    sh.worker(w, P.encode_disconnect(P.DRAINING))
    sh.draining.add(w)
    assert sh.core.pool.by_identity[w].draining
    sh.worker(w, P.encode_ready(ready(0, 0)))
    assert not sh.core.pool.by_identity[w].draining and w not in sh.draining
    sh.submit(b"C0", stream=False, idempotent=True, deadline_ms=None)  # the harness checks where it goes
    assert any(isinstance(d, P.Request) and s.identity == w for s, d in sh.step)
