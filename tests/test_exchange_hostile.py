"""Issue 32: the peer exchange against hostile peers.

Each attack from the issue, first on the pure core (:mod:`mesh.routing.peers`,
:mod:`mesh.routing.peer_guard`) with explicit times, then against the real sockets of
:class:`brokers.peer_exchange.PeerExchange` with the attacker as a raw ZeroMQ socket: a peer that
restarts on every message, a spoofed broker id with epoch 2**63-1, this broker's own id from
outside, 64 fake ids filling the peer table, a flood of maximum-size messages, a stranger's
long subscriptions, worker ids counted in characters vs bytes, CURVE keys per broker. Outcomes
and counts only, no timing assertions (the latency and RSS figures are measured by the script
in the module's last test docstring and reported in docs/security.md).
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import zmq

from brokers.peer_exchange import PeerExchange, is_loopback
from mesh import protocol as P
from mesh.config import BrokerSettings, WorkerSettings
from mesh.errors import ConfigError, ProtocolError
from mesh.load import LoadStat
from mesh.routing.peer_guard import RateBudget, SourceBinding, epoch_step_ok
from mesh.routing.peers import PeerMerge, apply_changes
from mesh.routing.view import WorkerState

FRESH_S = 5.0


def msg(seq, workers, *, broker="b1", epoch=1, full=False, full_ms=200):
    return P.PeerLoad(broker, epoch, seq, full, list(workers), full_ms)


def load(running):
    return LoadStat(num_running_reqs=running, num_waiting_reqs=0, num_tokens=0, max_total_num_tokens=100_000,
                    num_waiting_uncached_tokens=0, num_total_tokens=0, max_running_requests=64)


# --------------------------------------------------------------------------- steering


def route_with_a_restarting_liar(merge: PeerMerge, n_workers=4, n_requests=300, rate_per_s=100.0,
                                 liar_per_s=100.0, hold_s=1.0, heartbeat_s=0.2) -> Counter:
    """A least-pressure router over ``n_workers`` while a peer claims 100 requests on every
    worker but w0 in each message, presenting a new epoch (k+1) every message. The workers'
    LoadStats report what this router really has there. Returns requests per worker."""
    ws = {f"w{i}": WorkerState(f"w{i}") for i in range(n_workers)}
    active: list[tuple[float, str]] = []
    got: Counter = Counter()
    t, epoch, seq = 0.0, 1_000, 0
    next_req, next_lie, next_hb = 0.0, 0.0, 0.0
    while sum(got.values()) < n_requests:
        t = min(next_req, next_lie, next_hb)
        for done in [a for a in active if a[0] <= t]:
            active.remove(done)
            ws[done[1]].record_release(0)
        if t == next_hb:
            for wid, st in ws.items():
                st.update_load([load(sum(1 for a in active if a[1] == wid))], t)
            next_hb += heartbeat_s
        if t == next_lie:
            epoch += 1
            _, ch = merge.apply(msg(seq, [(f"w{i}", 100, 0, 0) for i in range(1, n_workers)], broker="liar", epoch=epoch), t, "tcp://liar:1")
            apply_changes(ch, ws.get)
            next_lie += 1.0 / liar_per_s
        if t == next_req:
            best = min(ws.values(), key=lambda st: (st.pressure(t, FRESH_S), st.worker_id))
            best.record_dispatch(0)
            active.append((t + hold_s, best.worker_id))
            got[best.worker_id] += 1
            next_req += 1.0 / rate_per_s
        apply_changes(merge.expire(t), ws.get)
    return got


def test_a_peer_restarting_on_every_message_cannot_steer_beyond_1_3x_the_fair_share():
    """Issue 32: 276 of 285 requests (97 %) went to one worker. Each restart re-added the
    liar's figures to the correction since the LoadStat; a restart is now read as a baseline
    and accepted at most once per ``min_restart_s``."""
    merge = PeerMerge("me", stale_s=3.0)
    got = route_with_a_restarting_liar(merge)
    fair = sum(got.values()) / 4
    assert max(got.values()) <= 1.3 * fair, got
    assert merge.stats["restart_too_soon"] > 250 and merge.stats["restarted"] <= 3


def test_restarts_move_epochs_forward_by_bounded_steps_only():
    m = PeerMerge("me", stale_s=3.0)
    assert m.apply(msg(0, [], epoch=10**18), 0.0)[0] == "applied"
    # one second later a restart may be ~1 s (plus the skew allowance) ahead, not to 2**63-1
    assert m.apply(msg(0, [], epoch=2**63 - 1), 1.5)[0] == "epoch_jump"
    assert m.apply(msg(0, [], epoch=10**18 + 2 * 10**9), 1.6)[0] == "applied"
    assert m.apply(msg(0, [], epoch=10**18 + 3 * 10**9), 1.7)[0] == "restart_too_soon"
    assert epoch_step_ok(0, 10**9, 1.0, skew_ns=0) and not epoch_step_ok(0, 10**9 + 1, 1.0, skew_ns=0)


def test_a_spoofed_epoch_locks_the_real_peer_out_for_one_staleness_bound_at_most():
    """Issue 32: a spoofer with the real peer's id and epoch 2**63-1 for 4.5 s kept it stale
    49 s after leaving. From another source it is refused outright; unsourced (or from the
    same source) its epoch expires with its staleness."""
    m = PeerMerge("me", stale_s=3.0)
    assert m.apply(msg(0, [("w0", 1, 0, 0)], broker="real", epoch=5), 0.0, "tcp://real:1")[0] == "applied"
    assert m.apply(msg(0, [("w0", 99, 0, 0)], broker="real", epoch=2**63 - 1), 0.1, "tcp://evil:1")[0] == "id_spoofed"
    assert m.apply(msg(1, [("w0", 1, 0, 0)], broker="real", epoch=5), 0.2, "tcp://real:1")[0] == "applied"
    assert m.totals("w0") == (1, 0)
    # the unsourced case: the spoofer came first and talked for 4.5 s
    m = PeerMerge("me", stale_s=3.0)
    for i in range(45):
        m.apply(msg(i, [("w0", 50, 0, 0)], broker="real", epoch=2**63 - 1), i * 0.1)
    assert m.apply(msg(0, [], broker="real", epoch=5), 4.6)[0] == "old_epoch"
    m.expire(4.4 + 3.0 + 0.01)  # one staleness bound after the spoofer left
    assert m.apply(msg(1, [("w0", 1, 0, 0)], broker="real", epoch=5), 7.5)[0] == "applied"
    assert m.totals("w0") == (1, 0)


def test_this_brokers_own_id_from_outside_is_refused_not_counted_as_itself():
    m = PeerMerge("me", stale_s=3.0, self_epoch=42)
    assert m.apply(msg(0, [("w0", 9, 0, 0)], broker="me", epoch=42), 0.0)[0] == "self"  # our own echo
    assert m.apply(msg(0, [("w0", 9, 0, 0)], broker="me", epoch=43), 0.0)[0] == "own_id"
    assert m.stats["own_id"] == 1 and m.totals("w0") == (0, 0)


# --------------------------------------------------------------------------- the peer table


def test_fake_ids_from_one_source_cannot_fill_the_table_and_stale_entries_are_evicted():
    """Issue 32: 64 fake broker ids filled the table before the real peer started, which was
    then refused (``too_many_peers``) for good."""
    m = PeerMerge("me", stale_s=3.0, max_peers=64)
    outcomes = Counter(m.apply(msg(0, [], broker=f"fake{i}"), 0.0, "tcp://evil:1")[0] for i in range(64))
    assert outcomes == Counter(applied=1, id_mismatch=63)
    assert m.apply(msg(0, [("w0", 1, 0, 0)], broker="real"), 0.1, "tcp://real:1")[0] == "applied"
    # unsourced (the simulator): the table fills, and stale entries make room
    m = PeerMerge("me", stale_s=3.0, max_peers=64)
    for i in range(64):
        m.apply(msg(0, [], broker=f"fake{i}"), 0.0)
    assert m.apply(msg(0, [], broker="real"), 0.1)[0] == "too_many_peers"
    m.expire(3.5)
    assert m.apply(msg(0, [], broker="real"), 3.6)[0] == "applied" and m.stats["evicted"] == 1


def test_a_source_may_speak_for_a_new_id_once_its_old_one_is_stale():
    b = SourceBinding()
    fresh = {"a"}
    b.bind("s1", "a")
    assert b.check("s1", "b", fresh.__contains__) == "id_mismatch"
    assert b.check("s2", "a", fresh.__contains__) == "id_spoofed"
    fresh.clear()  # "a" went stale: a restart under a new id (or behind a new address) is taken
    assert b.check("s1", "b", fresh.__contains__) == "" and b.check("s2", "a", fresh.__contains__) == ""


def test_one_compaction_per_message_bounds_the_work_of_a_full_worker_table():
    """Issue 32: 4,096 new workers per message into a full per-peer table compacted it once
    per worker (16M steps a message)."""
    m = PeerMerge("me", stale_s=3.0)
    m.apply(msg(0, [(f"a{i}", 1, 0, 0) for i in range(P.MAX_EXCHANGE_WORKERS)]), 0.0)
    m.apply(msg(1, [(f"b{i}", 1, 0, 0) for i in range(P.MAX_EXCHANGE_WORKERS)]), 0.1)
    assert m.stats["worker_compactions"] == 1 and m.stats["worker_cap"] == P.MAX_EXCHANGE_WORKERS


def test_rate_budget_counts_messages_and_bytes():
    b = RateBudget(msgs_per_s=10, bytes_per_s=1000, max_msg_bytes=500)
    assert [b.take(100, 0.0) for _ in range(11)].count("rate") == 1
    b = RateBudget(msgs_per_s=100, bytes_per_s=1000, max_msg_bytes=500)
    assert [b.take(400, 0.0) for _ in range(3)] == ["", "", "bytes"]
    assert b.take(400, 0.5) == ""  # refilled by half a second's worth


# --------------------------------------------------------------------------- real sockets


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


class Log:
    def __init__(self):
        self.events: list[tuple[str, str, dict]] = []

    def warning(self, event, **kw):
        self.events.append(("warning", event, kw))

    def info(self, event, **kw):
        self.events.append(("info", event, kw))

    def names(self):
        return [e[1] for e in self.events]


def hostile_pub(ctx) -> tuple[zmq.Socket, str]:
    s = ctx.socket(zmq.PUB)
    s.setsockopt(zmq.LINGER, 0)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    return s, f"tcp://127.0.0.1:{port}"


def pump(x: PeerExchange, until, timeout_s=5.0) -> None:
    """Read every exchange socket like the broker's pump until ``until()`` holds."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for sock, handler in x.inputs():
            while sock.poll(0):
                handler(sock.recv_multipart(), time.monotonic())
        if until():
            return
        time.sleep(0.005)
    raise AssertionError(f"timed out: {dict(x.stats)}")


def publish_until(pub, frames, x, until, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        pub.send_multipart(frames)
        pump(x, lambda: True, 0.05)
        if until():
            return
    raise AssertionError(f"timed out: {dict(x.stats)}")


def test_a_hostile_peer_with_many_ids_and_a_spoofed_own_id_leaves_the_broker_degraded(ctx):
    """Issue 32: fake ids from a hostile --peer made the broker report ``degraded: False``
    while the real peer was missing, and this broker's own id was counted as itself."""
    evil, evil_ep = hostile_pub(ctx)
    _, real_ep = hostile_pub(ctx)  # configured, never speaks
    log = Log()
    x = PeerExchange(ctx, "me", "tcp://127.0.0.1:*", [evil_ep, real_ep], interval_ms=0, stale_ms=3000, log=log, epoch=7)
    try:
        for i in range(64):
            publish_until(evil, P.encode_peer_load(msg(0, [], broker=f"fake{i}")), x, lambda: x.stats["received"] > i)
        publish_until(evil, P.encode_peer_load(msg(0, [], broker="me", epoch=8)), x, lambda: x.stats["own_id"] > 0)
        assert x.degraded and x.peer_counts() == {"fresh": 1, "stale": 1, "expected": 2}
        assert x.stats["id_mismatch"] >= 63 and x.stats["too_many_peers"] == 0
        assert "exchange_peer_refused" in log.names()
    finally:
        x.close()
        evil.close()


def test_a_flood_of_maximum_size_messages_is_dropped_undecoded_and_counted(ctx):
    """Issue 32: 20 valid 4,096-worker messages (1.16 MB) a second from one peer pushed median
    latency from 0.2-0.6 s to 5.8-7.9 s. Over its byte budget they are dropped before decoding."""
    evil, evil_ep = hostile_pub(ctx)
    x = PeerExchange(ctx, "me", "tcp://127.0.0.1:*", [evil_ep], interval_ms=0, stale_ms=3000,
                     max_bytes_per_s=2 * 1024 * 1024)
    big = [(f"worker-{i:04d}-" + "x" * 240, 1, 100, 1000) for i in range(P.MAX_EXCHANGE_WORKERS)]
    (sub, receive), = x.inputs()
    try:
        # one second's flood, all read at the same instant (the receiver's clock is the test's)
        for seq in range(20):
            frames = P.encode_peer_load(msg(seq, big, full=True))
            while not sub.poll(20):
                evil.send_multipart(frames)
            receive(sub.recv_multipart(), 0.0)
            while sub.poll(0):  # resends of the same message (the slow joiner) are charged too
                receive(sub.recv_multipart(), 0.0)
        assert x.stats["applied"] == 1 and x.stats["dropped_bytes"] == x.stats["received"] - 1 >= 19
    finally:
        x.close()
        evil.close()


def test_a_strangers_subscriptions_are_refused_at_the_handshake_in_plaintext(ctx):
    """Issue 32: 2,800 long unique subscriptions (50 MB) to the plaintext PUB grew the broker
    to 2.41 GB (libzmq's filter trie). The PUB's ZAP domain admits only the --peer hosts'
    addresses (brokers.main starts the authenticator): a stranger from another address never
    gets a subscription in, and a peer still gets the figures."""
    from zmq.auth.thread import ThreadAuthenticator

    from brokers.peer_exchange import peer_addresses

    auth = ThreadAuthenticator(ctx)
    auth.start()
    allowed = peer_addresses(["tcp://127.0.0.1:5999"])
    assert "127.0.0.1" in allowed and "127.0.0.2" not in allowed
    assert peer_addresses(["tcp://no-such-host.invalid:5"]) is None  # no list rather than a lockout
    auth.allow(*allowed)
    x = PeerExchange(ctx, "me", "tcp://127.0.0.1:*", [], interval_ms=0, stale_ms=3000, epoch=1)
    port = x.endpoint.rsplit(":", 1)[1]
    mon = x.pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    stranger = ctx.socket(zmq.XSUB)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(f"tcp://127.0.0.2:0;127.0.0.1:{port}")  # from another address
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, P.EXCHANGE_HEADER)
    sub.connect(x.endpoint)
    try:
        stranger.send(b"\x01" + P.EXCHANGE_HEADER)
        assert mon.poll(5000)  # the stranger's handshake failed
        got = None
        end = time.monotonic() + 5.0
        while got is None and time.monotonic() < end:
            x.publisher._next_full_s = 0.0  # a snapshot is due now
            x.tick(time.monotonic(), lambda w: None, lambda: [])
            if sub.poll(50):
                got = P.decode_exchange(sub.recv_multipart())
        assert isinstance(got, P.PeerLoad) and got.broker == "me"
        assert not stranger.poll(100)
    finally:
        x.pub.disable_monitor()
        mon.close()
        stranger.close()
        sub.close()
        x.close()
        auth.stop()


def test_the_exchange_warns_when_plaintext_reaches_beyond_loopback(ctx):
    log = Log()
    x = PeerExchange(ctx, "me", "tcp://127.0.0.1:*", ["tcp://10.255.255.1:5999"], interval_ms=0, stale_ms=3000, log=log)
    x.close()
    assert "exchange_plaintext" in log.names()
    log = Log()
    PeerExchange(ctx, "me", "tcp://127.0.0.1:*", ["tcp://localhost:5999"], interval_ms=0, stale_ms=3000, log=log).close()
    assert "exchange_plaintext" not in log.names()
    assert is_loopback("ipc:///tmp/x") and is_loopback("tcp://[::1]:5") and not is_loopback("tcp://0.0.0.0:5")


def test_per_broker_curve_keys_admit_listed_peers_only(ctx, tmp_path):
    """--peer-curve-keys: each broker its own exchange key; the PUB admits only the listed keys
    and each SUB accepts only its peer's key (a broker id is bound to a key)."""
    from zmq.auth.thread import ThreadAuthenticator

    from mesh.security import configure_allow_lists, exchange_keys, keygen, server_keys

    for name in ("a", "b", "evil"):
        keygen(tmp_path, name)
    ka, kb, ke = (server_keys(tmp_path / f"{n}.key_secret") for n in ("a", "b", "evil"))
    auth = ThreadAuthenticator(ctx)
    auth.start()
    try:
        xa_curve, a_peers = exchange_keys(ka, "", (str(tmp_path / "b.key"),))
        configure_allow_lists(auth, {"peers": frozenset(a_peers)})
        xa = PeerExchange(ctx, "a", "tcp://127.0.0.1:*", [], interval_ms=0, stale_ms=3000, curve=xa_curve, epoch=1)
        xb = PeerExchange(ctx, "b", "tcp://127.0.0.1:*", [xa.endpoint], interval_ms=0, stale_ms=3000, curve=kb,
                          peer_keys=[ka.public_key], epoch=1)
        xe = PeerExchange(ctx, "evil", "tcp://127.0.0.1:*", [xa.endpoint], interval_ms=0, stale_ms=3000, curve=ke,
                          peer_keys=[ka.public_key], epoch=1)
        try:
            def spin():
                pump(xa, lambda: True, 0.01)
                xa.publisher._next_full_s = 0.0
                xa.tick(time.monotonic(), lambda w: None, lambda: [])
                pump(xe, lambda: True, 0.01)
                return xb.stats["applied"] > 0
            pump(xb, spin, 10.0)
            assert xb.merge.fresh_peers() == ["a"] and not xb.degraded
            assert xe.stats["applied"] == 0  # evil's key is not on a's list: no figures for it
        finally:
            for x in (xa, xb, xe):
                x.close()
    finally:
        auth.stop()


# --------------------------------------------------------------------------- identifiers and flags


@pytest.mark.parametrize("wid, ok", [("w" * 256, True), ("é" * 128, True), ("é" * 129, False), ("w" * 512, False),
                                     ("", False)])
def test_ready_and_the_exchange_count_worker_ids_in_the_same_bytes(wid, ok):
    """Issue 32: a 512-byte worker id accepted by READY (characters) was refused by the
    exchange decoder (bytes): the peers lost that worker's figures while both said healthy."""
    ready = P.Ready(worker_id=wid, model="m", role="mixed", labels={}, block_size=16, max_running_requests=8,
                    max_total_num_tokens=1000, dp_size=1, epoch=1, heartbeat_ms=200)
    r = P.decode_worker(P.encode_ready(ready))
    x = P.decode_exchange(P.encode_peer_load(msg(0, [(wid, 1, 0, 0)])))
    assert isinstance(r, ProtocolError) == isinstance(x, ProtocolError) == (not ok)
    if ok:
        assert len(wid.encode()) <= P.MAX_WORKER_ID_BYTES


def test_worker_id_flag_is_measured_in_bytes():
    WorkerSettings(worker_id="é" * 128).validate()
    with pytest.raises(ConfigError, match="worker_id"):
        WorkerSettings(worker_id="é" * 129).validate()


@pytest.mark.parametrize("kw, field", [
    ({"exchange_peer_msgs_per_sec": 0.0}, "exchange_peer_msgs_per_sec"),
    ({"exchange_peer_bytes_per_sec": float("nan")}, "exchange_peer_bytes_per_sec"),
    ({"peer_curve_keys": ("a.key",)}, "peer_curve_keys"),  # two peers, one key
    ({"curve_secret": "", "peer_curve_keys": ("a.key", "b.key")}, "peer_curve_keys"),  # no CURVE
])
def test_exchange_flags_are_validated_naming_the_field(kw, field):
    base = dict(exchange="tcp://127.0.0.1:*", peer=("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"))
    with pytest.raises(ConfigError, match=field):
        BrokerSettings(**{**base, **kw}).validate()
