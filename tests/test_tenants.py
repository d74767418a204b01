"""Tenants and priorities: the keys file (hostile inputs), token buckets, the park queue (bands,
aging, fair shares) and the broker core's per-tenant quotas (issue 31, item 3). In-process, fast."""

from __future__ import annotations

import random

import pytest

from mesh import protocol as P
from mesh.broker_core import TO_CLIENT, TO_WORKER, BrokerCore
from mesh.broker_core.park import ParkQueue
from mesh.config import BrokerSettings, build
from mesh.errors import ConfigError, ErrorCode
from mesh.routing.router import Router, make_policy
from mesh.tenants import BANDS, KeyRing, Tenant, TenantLedger, TokenBucket, key_digest, parse_keys

KEYS = """
zmq_tenant = "internal"

[[tenant]]
name = "chat"
priority = "high"
weight = 2.0
max_inflight = 3
keys = ["chat-key-0123456789", "sha256:%s"]

[[tenant]]
name = "batch"
priority = "low"
tokens_per_min = 600
keys = ["batch-key-0123456789"]

[[tenant]]
name = "internal"

[[tenant]]
name = "ops"
admin = true
keys = ["ops-key-0123456789ab"]
""" % key_digest("hashed-key-0123456789").hex()


# ---------------------------------------------------------------- the keys file
def test_keys_file_maps_keys_to_tenants_and_keeps_only_digests():
    ring = parse_keys(KEYS)
    assert ring.lookup("chat-key-0123456789").name == "chat"
    assert ring.lookup("hashed-key-0123456789").name == "chat"
    assert ring.lookup("batch-key-0123456789").priority == BANDS.index("low")
    assert ring.lookup("wrong-key-0123456789") is None
    assert ring.lookup("ops-key-0123456789ab").admin and not ring.lookup("chat-key-0123456789").admin
    assert ring.zmq_tenant == "internal" and ring.get(None).name == "internal" and ring.get("nope").name == "internal"
    assert all(len(d) == 32 for d in ring.digests)  # no plain key kept
    assert b"chat-key" not in repr(ring).encode()


@pytest.mark.parametrize("text, names", [
    ('[[tenant]]\nname = "a"\nkeys = ["same-key-0123456789"]\n[[tenant]]\nname = "b"\nkeys = ["same-key-0123456789"]',
     ["tenant[1] 'b'", "keys[0]", "duplicate key", "'a'"]),
    ('[[tenant]]\nname = "a"\npriority = "urgent"', ["tenant[0] 'a'", "priority", "critical"]),
    ('[[tenant]]\nname = "a"\npriority = 0', ["tenant[0] 'a'", "priority"]),
    ('[[tenant]]\nname = "a"\nmax_inflight = -1', ["tenant[0] 'a'", "max_inflight", ">= 0"]),
    ('[[tenant]]\nname = "a"\ntokens_per_min = -5', ["tokens_per_min"]),
    ('[[tenant]]\nname = "a"\nweight = 0', ["weight"]),
    ('[[tenant]]\nname = "a"\nweight = nan', ["weight"]),
    ('[[tenant]]\nname = "a"\nadmin = "yes"', ["admin"]),
    ('[[tenant]]\nname = "a"\nkeys = "k"', ["keys"]),
    ('[[tenant]]\nname = "a"\nkeys = ["short"]', ["keys[0]", "16..512"]),
    ('[[tenant]]\nname = "a"\nkeys = ["sha256:xyz"]', ["keys[0]", "sha256"]),
    ('[[tenant]]\nname = "a b"', ["tenant[0]", "name"]),
    ('[[tenant]]\npriority = "low"', ["tenant[0]", "name"]),
    ('[[tenant]]\nname = "a"\n[[tenant]]\nname = "a"', ["tenant[1] 'a'", "name", "duplicates"]),
    ('[[tenant]]\nname = "a"\nprio = "low"', ["tenant[0] 'a'", "unknown field 'prio'"]),
    ('tenants = []', ["unknown field 'tenants'"]),
    ('zmq_tenant = "ghost"', ["zmq_tenant", "ghost"]),
    ('[tenant]\nname = "a"', ["[[tenant]]"]),
    ('[[tenant]\nname = ', ["keys file"]),  # not TOML: the parser's line and column
])
def test_keys_file_errors_name_the_entry_and_the_field(text, names):
    with pytest.raises(ConfigError) as exc:
        parse_keys(text)
    for n in names:
        assert n in str(exc.value), (n, str(exc.value))


def test_keys_file_size_and_counts_are_bounded():
    with pytest.raises(ConfigError, match="limit"):
        parse_keys("#" * (2 << 20))
    many = "".join(f'[[tenant]]\nname = "t{i}"\n' for i in range(1025))
    with pytest.raises(ConfigError, match="1025 tenants"):
        parse_keys(many)
    keys = ", ".join(f'"key-{i:020d}"' for i in range(1025))
    with pytest.raises(ConfigError, match="1025 keys"):
        parse_keys(f'[[tenant]]\nname = "a"\nkeys = [{keys}]')
    with pytest.raises(ConfigError, match="UTF-8"):
        parse_keys(b"\xff\xfe")


def test_a_flag_key_that_is_also_in_the_file_is_refused():
    ring = parse_keys(KEYS)
    with pytest.raises(ConfigError, match="also a key of tenant 'chat'"):
        ring.add_key("chat-key-0123456789", Tenant("admin", admin=True))


def test_priority_is_clamped_to_the_tenants_ceiling():
    t = Tenant("x", priority=BANDS.index("normal"))
    assert t.clamp(None) == 2 and t.clamp(0) == 2 and t.clamp(3) == 3


# ---------------------------------------------------------------- token buckets, ledger
def test_token_bucket_refills_from_the_time_handed_in():
    b = TokenBucket(600, now=0.0)  # 10 tokens a second, 600 at most
    assert b.take(600, 0.0) == 0.0
    assert b.take(100, 0.0) == pytest.approx(10.0)  # 100 tokens: 10 s away
    assert b.take(100, 10.0) == 0.0
    assert b.take(5000, 10.0) > 0  # larger than the bucket: waits for a full bucket
    assert b.take(5000, 80.0) == 0.0 and b.level < 0  # then runs, in debt


def test_ledger_counts_in_flight_per_tenant_and_says_when_to_retry():
    led, t = TenantLedger(), Tenant("a", max_inflight=2, tokens_per_min=60)
    assert led.refusal(t, 10, 0.0) is None
    led.admit("a")
    led.admit("a")
    why = led.refusal(t, 10, 0.0)
    assert why is not None and "2 requests in flight" in why[0]
    led.release("a")
    assert led.refusal(t, 60, 0.0)[1] == pytest.approx(10.0)  # 50 left; 10 more come in 10 s
    led.release("a")
    led.release("a")  # more releases than admits never go negative
    assert led.inflight == {}


# ---------------------------------------------------------------- the park queue
def test_park_queue_serves_higher_bands_first_and_fifo_within_a_tenant():
    q = ParkQueue(aging_s=0)
    for rid, band in ((1, 3), (2, 2), (3, 3), (4, 0), (5, 2)):
        q.push(rid, 0.0, band, "t")
    assert q.drain(0.0) == [4, 2, 5, 1, 3] and not q


def test_aging_lets_a_low_request_overtake_fresh_high_ones():
    q = ParkQueue(aging_s=1.0)
    q.push(1, 0.0, 3, "batch")  # low, waiting since 0
    served = []
    for i in range(10):  # a steady flood of fresh critical requests, one slot a second
        t = 0.5 + i
        q.push(100 + i, t, 0, "chat")
        served.append(q.pop(t))
    assert 1 in served  # after 3 s it competes as critical and, older, wins


def test_fair_shares_a_flooding_tenant_waits_behind_itself():
    q = ParkQueue()
    for i in range(100):
        q.push(i, 0.0, 2, "flood")
    for i in range(100, 110):
        q.push(i, 0.0, 2, "quiet")
    first20 = [q.pop(0.0) for _ in range(20)]
    assert sum(r >= 100 for r in first20) == 10  # alternating: the quiet tenant is not behind 100 of the flood


def test_weights_share_slots_in_proportion():
    q = ParkQueue()
    for i in range(600):
        q.push(i, 0.0, 2, "heavy", weight=3.0)
        q.push(1000 + i, 0.0, 2, "light", weight=1.0)
    first = [q.pop(0.0) for _ in range(600)][200:]  # (past the credit both start with)
    heavy = sum(r < 1000 for r in first)
    assert 290 <= heavy <= 310  # 3:1


def test_an_idle_tenant_banks_a_bounded_credit():
    q = ParkQueue(burst=8)
    for i in range(200):
        q.push(i, 0.0, 2, "a")
    for _ in range(100):
        q.pop(0.0)
    for i in range(1000, 1100):  # b arrives late: 8 requests of credit, then it shares (not 100 in a row)
        q.push(i, 0.0, 2, "b")
    nxt = [q.pop(0.0) for _ in range(40)]
    assert all(r >= 1000 for r in nxt[:8]) and 22 <= sum(r >= 1000 for r in nxt) <= 26


def test_park_queue_remove_and_membership():
    q = ParkQueue()
    q.push(1, 0.0, 2, "a")
    q.push(2, 0.0, 2, "a")
    assert 1 in q and len(q) == 2 and set(q) == {1, 2}
    assert q.remove(1) and not q.remove(1)
    assert q.pop(0.0) == 2 and q.pop(0.0) is None


# ---------------------------------------------------------------- the broker core
class _NullLog:
    def __getattr__(self, name):
        return lambda *a, **k: None


def _core(ring: KeyRing | None = None, **kw) -> BrokerCore:
    s = build(BrokerSettings, {"policy": "round_robin", "max_inflight_per_worker": 1, "queue_timeout_s": 60.0,
                               "default_deadline_ms": 120_000, "progress_timeout_ms": 0, "park_aging_s": 0.0, **kw})
    core = BrokerCore(s, Router(make_policy("round_robin", rng=random.Random(0)), None), log=_NullLog())
    if ring is not None:
        core.intake.tenants = ring
    core.start(0.0)
    core.worker_frames([b"W0", *P.encode_ready(P.Ready("w0", "m", "mixed", {}, 16, 256, 400_000, 1, 0, 500))], 0.0)
    core.worker_frames([b"W0", *P.encode_heartbeat()], 0.0)
    core.take()
    return core


def _local(core: BrokerCore, rid: str, tenant: str | None, priority: str | None = None, now: float = 0.0) -> None:
    body = P.submit_body(rid, input_ids=[1, 2, 3], params={"max_new_tokens": 4}, tenant=tenant, priority=priority)
    sub = P.submit_of_body(body, P.pack(body))
    core.submit(b"\x00http:" + rid.encode().ljust(16, b"_"), sub, now)


def _sent(core: BrokerCore):
    """(rids dispatched to the worker in order, client errors by rid) since the last call."""
    dispatched, errors = [], {}
    for s in core.take():
        if s.to == TO_WORKER and s.frames[1] == bytes([P.Cmd.REQUEST]):
            dispatched.append(s.ref.client_rid)
        elif s.to == TO_CLIENT:
            m = P.decode_client_reply(s.frames)
            if isinstance(m, P.ClientError):
                errors[m.rid] = (m.code, m.message)
    return dispatched, errors


def _finish(core: BrokerCore, now: float) -> None:
    """The worker finishes whatever it holds (one slot)."""
    for inf in [i for i in core.inflight.values() if i.session is not None]:
        core.worker_frames([b"W0", *P.encode_worker_final(inf.rid, inf.attempt, "stop", {"prompt_tokens": 3}, b"")], now)


def test_a_higher_band_is_served_before_a_lower_one_waiting_longer():
    core = _core(parse_keys(KEYS))
    _local(core, "busy", "internal")
    for i in range(3):
        _local(core, f"low{i}", "batch")
    _local(core, "hi", "chat")
    assert _sent(core)[0] == ["busy"]
    order = []
    for t in range(1, 6):
        _finish(core, float(t))
        order += _sent(core)[0]
    assert order == ["hi", "low0", "low1", "low2"]
    assert core.stats.tenants[("chat", "admitted")] == 1 and sum(core.stats.tenant_queue["batch"].counts) == 3


def test_a_client_cannot_raise_its_priority_above_its_tenants_ceiling():
    core = _core(parse_keys(KEYS))
    _local(core, "busy", "internal")
    _local(core, "spoof", "batch", "critical")  # batch's ceiling is low
    _local(core, "normal", "internal", "normal")
    _sent(core)
    _finish(core, 1.0)
    assert _sent(core)[0] == ["normal"]
    assert core.inflight[next(iter(core.parked))].band == BANDS.index("low")


def test_a_zeromq_clients_tenant_field_is_ignored():
    core = _core(parse_keys(KEYS))
    frames = P.encode_submit("z1", input_ids=[1, 2], params={"max_new_tokens": 4})
    core.client_frames([b"Z", *frames], 0.0)
    body = P.submit_body("z2", input_ids=[1, 2], params={"max_new_tokens": 4}, tenant="chat", priority="critical")
    core.client_frames([b"Z", P.CLIENT_HEADER, bytes([P.Cmd.C_SUBMIT]), P.pack(body)], 0.0)
    parked = [core.inflight[r] for r in core.parked]
    assert [(i.client_rid, i.tenant, i.band) for i in parked] == [("z2", "internal", BANDS.index("normal"))]
    assert core.stats.tenants[("internal", "tenant_field_ignored")] == 1


def test_quotas_count_per_tenant_over_every_connection():
    core = _core(parse_keys(KEYS), max_inflight_per_client=1000)
    for i in range(5):  # five HTTP requests (five identities) of one tenant limited to 3
        _local(core, f"c{i}", "chat")
    _, errors = _sent(core)
    assert sorted(errors) == ["c3", "c4"]
    assert all(code == ErrorCode.RATE_LIMITED.value and "retry after 1 s" in msg for code, msg in errors.values())
    assert core.stats.tenants[("chat", "rejected_429")] == 2
    _finish(core, 1.0)  # one finishes: the tenant may start one more
    _local(core, "c5", "chat", now=1.0)
    assert "c5" not in _sent(core)[1]


def test_tokens_per_minute_refuse_with_the_time_to_wait():
    core = _core(parse_keys(KEYS))  # batch: 600 tokens a minute; each request is 3 + 4 tokens
    for i in range(90):
        _local(core, f"b{i}", "batch")
    errors = _sent(core)[1]
    assert len(errors) == 90 - 600 // 7
    assert all("tokens per minute" in m and "retry after 1 s" in m for _, m in errors.values())


def test_a_tenant_flood_is_bounded_by_its_in_flight_limit():
    core = _core(parse_keys(KEYS), max_inflight_per_client=100_000)
    for i in range(2000):
        _local(core, f"f{i}", "chat")
    _sent(core)
    assert sum(1 for i in core.inflight.values() if i.tenant == "chat") == 3
    _local(core, "other", "internal")
    assert "other" not in _sent(core)[1]


def test_without_a_keys_file_everyone_is_the_default_tenant_as_before():
    core = _core()
    _local(core, "a", None, "critical")  # default tenant's ceiling is normal
    _local(core, "b", None)
    _sent(core)
    assert {(i.tenant, i.band) for i in core.inflight.values()} == {("default", 2)}


@pytest.mark.parametrize("field, value", [("tenant", 5), ("tenant", "x" * 65), ("priority", "urgent"),
                                          ("priority", 0), ("priority", ["low"])])
def test_bad_tenant_or_priority_on_the_wire_is_a_bad_request_naming_the_field(field, value):
    body = {**P.submit_body("r", input_ids=[1]), field: value}
    m = P.decode_client([P.CLIENT_HEADER, bytes([P.Cmd.C_SUBMIT]), P.pack(body)])
    assert isinstance(m, P.ProtocolError) and field in str(m)


def test_a_trusted_gateways_tenant_stamp_is_kept():
    core = _core(parse_keys(KEYS))
    object.__setattr__(core.s, "trust_client_tenant", True)  # (validated: needs --curve-allow-clients)
    core.client_frames([b"G", *P.encode_submit("g1", input_ids=[1], params={"max_new_tokens": 4})], 0.0)
    body = P.submit_body("g2", input_ids=[1, 2], params={"max_new_tokens": 4}, tenant="chat", priority="critical")
    core.client_frames([b"G", P.CLIENT_HEADER, bytes([P.Cmd.C_SUBMIT]), P.pack(body)], 0.0)
    assert [(core.inflight[r].tenant, core.inflight[r].band) for r in core.parked] == [("chat", BANDS.index("high"))]
    with pytest.raises(ConfigError, match="trust_client_tenant"):
        build(BrokerSettings, {"trust_client_tenant": True})


def test_per_tenant_metrics_are_exported():
    from brokers.stats import StatsCollector

    core = _core(parse_keys(KEYS))
    for i in range(5):
        _local(core, f"c{i}", "chat")
    _sent(core)
    _finish(core, 1.0)
    fams = {f.name: f for f in StatsCollector(core.stats, dict).collect()}
    got = {tuple(x.labels.values()): x.value for x in fams["mesh_tenant_requests"].samples}
    assert got[("chat", "admitted")] == 3 and got[("chat", "rejected_429")] == 2
    assert any(x.labels.get("tenant") == "chat" for x in fams["mesh_tenant_queue_wait_seconds"].samples)


# ---------------------------------------------------------------- the shell: --keys-file, --api-key, --admin-key-file
def test_key_ring_from_flags_keeps_the_old_single_key_and_sets_admin_apart(tmp_path):
    from brokers.keys_file import load_key_ring

    assert load_key_ring() is None  # no keys at all: no authentication, as before
    legacy = load_key_ring(api_key="only-key-0123456789")
    assert legacy.lookup("only-key-0123456789").admin  # the old --api-key still opens the admin API
    split = load_key_ring(api_key="only-key-0123456789", admin_key="admin-key-0123456789")
    assert not split.lookup("only-key-0123456789").admin and split.lookup("admin-key-0123456789").admin
    kf = tmp_path / "keys.toml"
    kf.write_text(KEYS)
    ring = load_key_ring(str(kf), "only-key-0123456789")
    assert not ring.lookup("only-key-0123456789").admin and ring.lookup("chat-key-0123456789").name == "chat"


def test_key_ring_errors_name_the_flag(tmp_path):
    from brokers.keys_file import load_key_ring, read_secret

    kf = tmp_path / "keys.toml"
    kf.write_text(KEYS)
    with pytest.raises(ConfigError, match="api_key: .*also a key of tenant 'chat'"):
        load_key_ring(str(kf), "chat-key-0123456789")
    with pytest.raises(ConfigError, match="admin_key_file"):
        load_key_ring(str(kf), None, "ops-key-0123456789ab")
    with pytest.raises(ConfigError, match="keys_file: cannot read"):
        load_key_ring(str(tmp_path / "missing.toml"))
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (3 << 20))
    with pytest.raises(ConfigError, match=r"keys_file .*big.toml: .*limit"):
        load_key_ring(str(big))
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="admin_key_file: .* is empty"):
        read_secret(str(empty), "admin_key_file")
    for field in ("keys_file", "admin_key_file"):
        with pytest.raises(ConfigError, match=field):
            build(BrokerSettings, {field: str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="park_aging_s"):
        build(BrokerSettings, {"park_aging_s": -1.0})


def test_retry_after_header_carries_the_seconds_the_refusal_names():
    from brokers.ingress.replies import mesh_error_response

    r = mesh_error_response("rate_limited", "tenant 'a' is over its 60 tokens per minute; retry after 46 s")
    assert r.status == 429 and r.headers["Retry-After"] == "46"
    assert mesh_error_response("overloaded", "broker in-flight limit reached").headers["Retry-After"] == "1"


def test_curve_keys_map_zeromq_clients_to_tenants():
    ring = parse_keys(KEYS.replace('name = "batch"\n', 'name = "batch"\ncurve_keys = ["app-1"]\n'))
    assert ring.curve_tenants({b"PUB1": "app-1", b"PUB2": "other"}) == {b"PUB1": "batch"}
    with pytest.raises(ConfigError, match="no app-1.key in --curve-allow-clients"):
        ring.curve_tenants({b"PUB2": "other"})
    for bad, msg in (('curve_keys = ["a b"]', "curve_keys\\[0\\]"), ('curve_keys = "x"', "curve_keys")):
        with pytest.raises(ConfigError, match=msg):
            parse_keys(f'[[tenant]]\nname = "t"\n{bad}')
    with pytest.raises(ConfigError, match="also a key of tenant 'a'"):
        parse_keys('[[tenant]]\nname = "a"\ncurve_keys = ["k"]\n[[tenant]]\nname = "b"\ncurve_keys = ["k"]')
    core = _core(ring)
    frames = P.encode_submit("z1", input_ids=[1, 2], params={"max_new_tokens": 4})
    core.client_frames([b"Z", *frames], 0.0, tenant="batch")  # the shell found the key's tenant
    assert next(iter(core.inflight.values())).tenant == "batch"


HOSTILE = [None, "", "x" * 64, "x" * 65, "é" * 33, "\ud800", "\x00", 0, -1, 2**70, 1.5, float("nan"), True, [], ["low"], {},
           {"a": 1}, b"low", b"\xff" * 10_000, "low" * 100_000, "critical", "LOW", " low"]


def test_the_decoder_never_raises_on_hostile_tenant_and_priority():
    ok = 0
    for tenant in HOSTILE:
        for prio in HOSTILE:
            body = {**P.submit_body("r", input_ids=[1]), "tenant": tenant, "priority": prio}
            try:
                raw = P.pack(body)
            except (ValueError, TypeError, OverflowError, UnicodeEncodeError):
                continue  # not encodable as msgpack: never reaches the broker
            m = P.decode_client([P.CLIENT_HEADER, bytes([P.Cmd.C_SUBMIT]), raw])
            assert isinstance(m, (P.Submit, P.ProtocolError)), (tenant, prio, m)
            if isinstance(m, P.Submit):
                ok += 1
                assert m.priority in (None, 0, 1, 2, 3) and (m.tenant is None or len(m.tenant.encode()) <= 64)
    assert ok >= 4


def test_a_full_park_queue_evicts_the_flooding_tenants_newest_place():
    core = _core(parse_keys(KEYS), max_parked=4, max_inflight_per_client=1000)
    _local(core, "busy", "internal")
    for i in range(4):
        _local(core, f"b{i}", "batch")  # the queue is full of batch
    _, errors = _sent(core)
    assert not errors
    _local(core, "quiet", "internal")  # another tenant still gets a place: batch's newest gives it up
    _, errors = _sent(core)
    assert list(errors) == ["b3"] and errors["b3"][0] == ErrorCode.OVERLOADED.value
    assert core.stats.dropped["park_queue_evicted"] == 1
    _local(core, "b4", "batch")  # the flooding tenant itself is refused, not given another's place
    assert list(_sent(core)[1]) == ["b4"] and core.stats.dropped["park_queue_full"] == 1
    assert sorted(core.inflight[r].client_rid for r in core.parked) == ["b0", "b1", "b2", "quiet"]


def test_parked_requests_per_tenant_and_band_are_a_gauge():
    from brokers.main import _gauges

    core = _core(parse_keys(KEYS))
    _local(core, "busy", "internal")
    for i in range(2):
        _local(core, f"low{i}", "batch")
    _local(core, "hi", "chat", "critical")

    class _B:  # the broker's face _gauges reads
        registry, broker_id, inflight_count, parked_count, exchange = core.pool, "b", 4, 3, None
        s, budget = core.s, core.budget

    _B.core, _B.router = core, core.router
    got = _gauges(_B)()["mesh_tenant_parked"]
    assert got == [({"tenant": "batch", "band": "low"}, 2.0), ({"tenant": "chat", "band": "high"}, 1.0)]
