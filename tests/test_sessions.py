"""Session affinity core (mesh.routing.sessions): the table (TTL, LRU bound, peers' shares), the
soft and hard modes, the imbalance escape, P/D (the decode worker sticks), the session key of an
HTTP request and the wire fields (SUBMIT ``session``, PEER_LOAD ``sessions``)."""

from __future__ import annotations

import random

import pytest

from mesh import protocol as P
from mesh.config import BrokerSettings
from mesh.errors import ConfigError
from mesh.routing.factory import make_router
from mesh.routing.peers import PeerPublisher
from mesh.routing.policies import PowerOfTwo, RoundRobin
from mesh.routing.sessions import (
    SessionKeyError,
    SessionRouter,
    SessionTable,
    over_imbalance_bound,
    session_hash,
    session_key,
    with_sessions,
)
from mesh.routing.view import RouteRequest, WorkerState


def _pool(n: int = 3, role: str = "mixed", prefix: str = "w") -> list[WorkerState]:
    return [WorkerState(f"{prefix}{i}", role=role) for i in range(n)]


def _req(i: int, session: str | None = "s1") -> RouteRequest:
    return RouteRequest(f"r{i}", prompt_tokens=100, session=session)


def _sr(mode: str = "soft", **kw) -> SessionRouter:
    return make_router(RoundRobin(), session_affinity=mode, session_ttl_s=kw.pop("ttl_s", 60.0),
                       session_table_size=kw.pop("size", 1000))


# --------------------------------------------------------------------------- table


def test_table_ttl_from_last_use():
    t = SessionTable(10.0, 100)
    t.pin(1, "w0", 0.0)
    assert t.get(1, 9.0) == "w0"
    t.pin(1, "w0", 9.0)  # a use restarts the TTL
    assert t.get(1, 18.0) == "w0"
    assert t.get(1, 19.5) is None
    assert t.stats["expired"] == 1 and len(t) == 0


def test_table_lru_bound_counts_evictions():
    t = SessionTable(100.0, 3)
    for h in range(3):
        t.pin(h, "w0", float(h))
    t.pin(0, "w1", 5.0)  # 0 is now the most recently used
    t.pin(99, "w2", 6.0)
    assert len(t) == 3 and t.stats["evicted"] == 1
    assert t.get(1, 7.0) is None and t.get(0, 7.0) == "w1"


def test_table_flood_of_unique_sessions_stays_bounded():
    t = SessionTable(1e9, 1000)
    for h in range(50_000):
        t.pin(h, "w0", 0.0)
    assert len(t) == 1000 and t.stats["evicted"] == 49_000


def test_table_sweep_drops_expired_within_budget():
    t = SessionTable(1.0, 100)
    for h in range(10):
        t.pin(h, "w0", 0.0)
    assert t.sweep(5.0, budget=4) == 4
    assert len(t) == 6


def test_remote_pins_newer_win_older_skipped():
    t = SessionTable(100.0, 100)
    t.pin(7, "w0", 50.0)
    assert t.apply_remote("b2", [(7, "w1", 10_000)], 55.0) == 0  # last used at 45 < 50
    assert t.get(7, 55.0) == "w0" and t.stats["remote_stale"] == 1
    assert t.apply_remote("b2", [(7, "w1", 1_000)], 55.0) == 1  # last used at 54 > 50
    assert t.get(7, 55.0) == "w1" and t.stats["remote_applied"] == 1
    assert t.apply_remote("b2", [(8, "w1", 200_000)], 55.0) == 0  # already expired


def test_remote_pins_bounded_by_peer_share():
    t = SessionTable(100.0, 1000, peers=1)  # one peer: half of the table at most
    for h in range(200):
        t.pin(h, "w0", 0.0)
    n = t.apply_remote("evil", [(1000 + i, "w9", 0) for i in range(5000)], 1.0)
    assert n == 500 and t.remote_entries("evil") == 500
    assert t.stats["remote_over_share"] == 4500
    assert all(t.get(h, 1.0) == "w0" for h in range(200))  # local pins survive the flood
    assert len(t) <= 1000


# --------------------------------------------------------------------------- routing


def test_soft_turns_stick_where_the_policy_would_rotate():
    sr = _sr()
    pool = _pool()
    first = sr.route(_req(0), pool, 0.0)
    for i in range(1, 10):
        d = sr.route(_req(i), pool, float(i))
        assert d.worker_id == first.worker_id and d.detail["session"] == "hit"
        sr.release(pool[int(d.worker_id[1:])], d)
    assert sr.stats["hit"] == 9 and sr.stats["new"] == 1
    # without a session the same router rotates (round robin)
    seen = {sr.route(_req(i, None), pool, 20.0).worker_id for i in range(3)}
    assert len(seen) == 3


def test_off_mode_is_the_plain_router():
    r = make_router(RoundRobin(), session_affinity="off")
    assert not isinstance(r, SessionRouter)
    pool = _pool()
    assert len({r.route(_req(i), pool, 0.0).worker_id for i in range(3)}) == 3


def test_soft_repins_when_worker_gone_or_excluded():
    sr = _sr()
    pool = _pool()
    wid = sr.route(_req(0), pool, 0.0).worker_id
    rest = [w for w in pool if w.worker_id != wid]
    d = sr.route(_req(1), rest, 1.0)  # the pinned worker left the pool
    assert d.worker_id != wid and sr.stats["repin_gone"] == 1
    new = d.worker_id
    assert sr.route(_req(2), pool, 2.0).worker_id == new  # the new pin holds
    d = sr.route(_req(3), pool, 3.0, exclude={new})  # tried / at its cap
    assert d.worker_id not in (None, new) and sr.stats["repin_excluded"] == 1


def test_soft_escapes_over_the_imbalance_bound():
    sr = SessionRouter(make_router(RoundRobin()), SessionTable(60.0, 100), "soft",
                       balance_abs_threshold=2, balance_rel_threshold=1.1)
    pool = _pool(2)
    wid = sr.route(_req(0), pool, 0.0).worker_id
    pinned = next(w for w in pool if w.worker_id == wid)
    pinned.inflight = 3  # 3 over the other's 0 (plus the dispatch of turn 0): over abs 2 and rel 1.1
    d = sr.route(_req(1), pool, 1.0)
    assert d.worker_id != wid and sr.stats["repin_imbalance"] == 1 and d.detail["session"] == "repin_imbalance"
    assert over_imbalance_bound(40, 5, 32, 1.1) and not over_imbalance_bound(30, 0, 32, 1.1)


def test_soft_uses_the_policys_own_bound():
    from mesh.routing.cache_policies import CacheAware

    sr = with_sessions(make_router(CacheAware(balance_abs_threshold=7, balance_rel_threshold=3.0)), "soft", 60, 100)
    assert (sr.balance_abs_threshold, sr.balance_rel_threshold) == (7, 3.0)
    sr = with_sessions(make_router(PowerOfTwo()), "soft", 60, 100)
    assert (sr.balance_abs_threshold, sr.balance_rel_threshold) == (32, 1.1)


def test_hard_never_leaves_a_live_worker_and_fails_when_it_is_gone():
    sr = SessionRouter(make_router(RoundRobin()), SessionTable(60.0, 100), "hard",
                       balance_abs_threshold=0, balance_rel_threshold=1.0)
    pool = _pool(2)
    wid = sr.route(_req(0), pool, 0.0).worker_id
    next(w for w in pool if w.worker_id == wid).inflight = 500  # far over any bound: hard stays
    assert sr.route(_req(1), pool, 1.0).worker_id == wid
    d = sr.route(_req(2), pool, 2.0, exclude={wid})
    assert d.worker_id is None and d.reason == "session_worker_busy"
    rest = [w for w in pool if w.worker_id != wid]
    d = sr.route(_req(3), rest, 3.0)
    assert d.worker_id is None and d.reason == "session_worker_gone" and "gone" in d.detail["session_error"]
    assert sr.stats["hard_gone"] == 1
    d = sr.route(_req(4), rest, 4.0)  # the pin was dropped: the next request starts a new one
    assert d.worker_id == rest[0].worker_id and d.detail["session"] == "new"


def test_pd_the_decode_worker_sticks():
    sr = make_router(PowerOfTwo(rng=random.Random(1)), pd=True, rng=random.Random(2), session_affinity="soft")
    pool = _pool(3, "prefill", "p") + _pool(4, "decode", "d")
    first = sr.route(_req(0), pool, 0.0)
    assert first.decode_worker_id is not None
    for i in range(1, 12):
        d = sr.route(_req(i), pool, float(i))
        assert d.decode_worker_id == first.decode_worker_id and d.detail["session"] == "hit"
        for w in pool:
            if w.worker_id in (d.worker_id, d.decode_worker_id):
                sr.release(w, d)


def test_sessions_are_independent_and_pins_go_to_the_listener():
    sr = _sr()
    seen = []
    sr.table.listener = lambda h, w, t: seen.append((h, w))
    pool = _pool()
    a = sr.route(_req(0, "a"), pool, 0.0).worker_id
    b = sr.route(_req(1, "b"), pool, 0.0).worker_id
    assert a != b  # round robin spread the two sessions
    assert sr.route(_req(2, "a"), pool, 1.0).worker_id == a
    assert seen == [(session_hash("a"), a), (session_hash("b"), b), (session_hash("a"), a)]


def test_a_peers_pin_is_honoured():
    r1, r2 = _sr(), _sr()
    pool1, pool2 = _pool(), _pool()
    pub = PeerPublisher("b1", 1, 0.0, 1.0)
    r1.table.listener = pub.note_session
    wid = r1.route(_req(0), pool1, 0.0).worker_id
    msg = pub.build(0.5, lambda w: None, lambda: [])
    frames = P.encode_peer_load(msg)
    m = P.decode_exchange(frames)
    assert m.sessions == [(session_hash("s1"), wid, 500)]
    r2.table.apply_remote(m.broker, m.sessions, 10.0)
    r2.route(_req(9, None), pool2, 10.0)  # move round robin on: a fresh pick would differ
    assert r2.route(_req(1), pool2, 10.0).worker_id == wid
    assert r2.stats["hit"] == 1 and r2.stats["remote_applied"] == 1


# --------------------------------------------------------------------------- keys and wire


def test_session_key_precedence_and_sources():
    body = {"prompt_cache_key": "pck", "user": "u", "session_params": {"id": "sp"}}
    assert session_key("hdr", body) == "hdr"
    assert session_key(None, body) == "pck"
    assert session_key(None, {"user": "u"}) == "u"
    assert session_key(None, {"session_params": {"id": "sp"}}) == "sp"
    assert session_key("hdr", body, ("user",)) == "u"
    assert session_key("hdr", body, ()) is None
    assert session_key(None, {}) is None


@pytest.mark.parametrize("header,body,field", [
    ("x" * 257, {}, "x-session-id"),
    ("", {}, "x-session-id"),
    (None, {"user": 5}, "user"),
    (None, {"prompt_cache_key": ["a"]}, "prompt_cache_key"),
    (None, {"session_params": {"id": {"x": 1}}}, "session_params.id"),
])
def test_session_key_hostile_inputs_name_the_field(header, body, field):
    with pytest.raises(SessionKeyError) as e:
        session_key(header, body)
    assert e.value.field == field and field in str(e.value)


def test_session_key_long_body_ids_are_digested():
    k = session_key(None, {"user": "u" * 100_000})
    assert k.startswith("sha256:") and len(k) <= P.MAX_SESSION_BYTES
    assert k == session_key(None, {"user": "u" * 100_000})


def test_submit_session_field_roundtrip_and_hostile():
    sub = P.decode_client(P.encode_submit("r1", input_ids=[1, 2], session="agent-7"))
    assert isinstance(sub, P.Submit) and sub.session == "agent-7"
    assert P.decode_client(P.encode_submit("r1", input_ids=[1, 2])).session is None
    for bad in ("x" * 257, "é" * 200, "", 5, ["a"], {"a": 1}, True):
        body = P.submit_body("r1", input_ids=[1, 2])
        body["session"] = bad
        m = P.decode_client([P.CLIENT_HEADER, bytes([P.Cmd.C_SUBMIT]), P.pack(body)])
        assert isinstance(m, P.ProtocolError) and m.reason == "bad_field" and "session" in m.detail


def test_exchange_sessions_hostile():
    base = {"broker": "b", "epoch": 1, "seq": 0, "full": False, "workers": []}

    def dec(sessions):
        return P.decode_exchange([P.EXCHANGE_HEADER, bytes([P.X_PEER_LOAD]), P.pack({**base, "sessions": sessions})])

    assert dec([[1, "w", 0]]).sessions == [(1, "w", 0)]
    too_many = dec([[i, "w", 0] for i in range(P.MAX_EXCHANGE_SESSIONS + 1)])
    assert isinstance(too_many, P.ProtocolError) and too_many.reason == "too_many_sessions"
    for bad in ("x", [[1, "w"]], [[-1, "w", 0]], [[-(2**63), "w", 0]], [[1, "", 0]], [[1, "w" * 300, 0]],
                [[1, "w", -5]], [[1, "w", 2**40]], [[1.5, "w", 0]], [[1, 7, 0]]):
        m = dec(bad)
        assert isinstance(m, P.ProtocolError) and m.reason == "bad_field", bad


def test_settings_validated_naming_the_field():
    BrokerSettings().validate()
    for kw, field in ((dict(session_affinity="sticky"), "session_affinity"), (dict(session_ttl_s=0), "session_ttl_s"),
                      (dict(session_ttl_s=float("nan")), "session_ttl_s"), (dict(session_table_size=0), "session_table_size"),
                      (dict(session_key_sources="header,cookie"), "session_key_sources"),
                      (dict(session_key_sources="user,user"), "session_key_sources")):
        with pytest.raises(ConfigError, match=field):
            BrokerSettings(**kw).validate()


# --------------------------------------------------------------------------- the broker core


class _NullLog:
    def __getattr__(self, name):
        return lambda *a, **k: None


def _core(core_cls, mode: str, n: int):
    """A broker core with round robin in session mode ``mode`` and ``n`` confirmed workers."""
    core = core_cls(BrokerSettings(policy="round_robin"), make_router(RoundRobin(), session_affinity=mode), log=_NullLog())
    core.start(0.0)
    for w in range(n):
        ident = f"W{w}".encode()
        core.worker_frames([ident, *P.encode_ready(P.Ready(f"w{w}", "m", "mixed", {}, 16, 256, 400_000, 1, 0, 500))], 0.0)
        core.worker_frames([ident, *P.encode_heartbeat()], 0.0)
    core.out.clear()
    return core


def _core_route(core, client: bytes, rid: str, now: float, session: str | None, ids: list[int]) -> str:
    """Submit through the core; answer it at once; returns the worker id that served it."""
    core.client_frames([client, *P.encode_submit(rid, input_ids=ids, params={"max_new_tokens": 1}, stream=False,
                                                 session=session)], now)
    reqs = [s for s in core.out if s.to == 0]  # TO_WORKER
    core.out.clear()
    assert len(reqs) == 1, reqs
    m = P.decode_broker_to_worker(reqs[0].frames)
    assert m.submit.session == session
    ident = reqs[0].identity
    core.worker_frames([ident, *P.encode_worker_final(m.rid, m.attempt, "length", {"completion_tokens": 1})], now)
    core.out.clear()
    return core.pool.by_identity[ident].worker_id


def test_broker_core_keeps_a_sessions_turns_on_one_worker_and_counts():
    from mesh.broker_core import BrokerCore

    core = _core(BrokerCore, "soft", 3)
    plain = {_core_route(core, b"c", f"p{i}", 0.1, None, [9, 9, i]) for i in range(3)}
    assert len(plain) == 3  # round robin: no session, every worker in turn
    served = {_core_route(core, b"c", f"s{i}", 0.2 + i, "agent", [i, i + 1, i + 2]) for i in range(6)}
    assert len(served) == 1
    flat = core.stats.flat()
    assert flat["sessions.new"] == 1 and flat["sessions.hit"] == 5


def test_broker_core_hard_mode_fails_a_turn_whose_worker_is_gone_clearly():
    from mesh.broker_core import BrokerCore

    core = _core(BrokerCore, "hard", 2)
    wid = _core_route(core, b"c", "t0", 0.1, "stateful", [1, 2, 3])
    core.worker_frames([next(i for i, s in core.pool.by_identity.items() if s.worker_id == wid),
                        *P.encode_disconnect("bye")], 0.2)
    core.out.clear()
    core.client_frames([b"c", *P.encode_submit("t1", input_ids=[4, 5, 6], stream=False, session="stateful")], 0.3)
    errs = [P.decode_client_reply(s.frames) for s in core.out if s.to == 1]
    assert len(errs) == 1 and isinstance(errs[0], P.ClientError), errs
    assert errs[0].code == "no_worker" and "gone" in errs[0].message and wid in errs[0].message
    core.out.clear()
    assert _core_route(core, b"c", "t2", 0.4, "stateful", [7, 8, 9]) != wid  # the next turn starts a new pin
    assert core.stats.flat()["sessions.hard_gone"] == 1


def test_pd_router_given_a_prefill_pin_repins_to_the_decode_worker_and_releases():
    sr = make_router(PowerOfTwo(rng=random.Random(1)), pd=True, rng=random.Random(2), session_affinity="hard")
    pool = _pool(2, "prefill", "p") + _pool(2, "decode", "d")
    sr.table.apply_remote("peer", [(session_hash("s1"), "p1", 0)], 0.0)  # a mixed-mode peer's idea of a pin
    d = sr.route(_req(0), pool, 0.0)
    assert d.decode_worker_id is not None and d.detail["session"] == "repin_refused"
    assert sr.table.get(session_hash("s1"), 0.0) == d.decode_worker_id
    assert sum(w.inflight for w in pool) == 2  # the refused attempt's bookkeeping was undone
