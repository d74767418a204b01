"""CURVE allow-lists: listed workers and clients get in; an unlisted worker cannot register and an
unlisted client cannot submit (their handshakes are rejected and counted)."""

from __future__ import annotations


import pytest

from mesh.client import Client
from mesh.errors import RequestError
from mesh.security import client_keys, keygen
from tests.conftest import run, until


def test_curve_allow_lists(procs, tmp_path):
    keys, allowed_w, allowed_c, other = (tmp_path / d for d in ("keys", "allow-w", "allow-c", "other"))
    keygen(keys, "broker")
    for name, d in (("good", allowed_w), ("app", allowed_c)):
        pub, _ = keygen(keys, name)
        d.mkdir(exist_ok=True)
        (d / pub.name).write_bytes(pub.read_bytes())
    keygen(other, "evil-worker")
    keygen(other, "evil-app")
    b = procs.broker("b", "--curve-secret", str(keys / "broker.key_secret"), "--curve-allow-workers", str(allowed_w),
                     "--curve-allow-clients", str(allowed_c), "--heartbeat-ms", "200")
    procs.workers("good", [b.backend], "--curve-secret", str(keys / "good.key_secret"),
                  "--curve-server-key", str(keys / "broker.key"), count=1)
    procs.workers("evil", [b.backend], "--curve-secret", str(other / "evil-worker.key_secret"),
                  "--curve-server-key", str(keys / "broker.key"), count=1)
    good = client_keys(keys / "app.key_secret", keys / "broker.key")
    evil = client_keys(other / "evil-app.key_secret", keys / "broker.key")

    async def body():
        async with Client(b.frontend, curve=good) as c:
            async def settled():  # the readiness signals: good registered, evil's handshake rejected
                st = await c.status()
                ids = {w["worker_id"] for w in st.workers}
                return ids if "good" in ids and st.counters.get("frames_rejected.worker.auth_failed", 0) >= 1 else None

            ids = await until(settled, 20, "good registered and evil's handshake rejected", step_s=0.05)
            assert ids == {"good"}  # the unlisted worker never registered
            for _ in range(5):
                assert (await c.generate(input_ids=[1, 2, 3], max_new_tokens=2, deadline_ms=5000)).worker == "good"
        async with Client(b.frontend, curve=evil) as c:
            with pytest.raises(RequestError) as ei:
                await c.generate(input_ids=[1, 2, 3], max_new_tokens=2, deadline_ms=1000)
            assert ei.value.code.value == "deadline_exceeded"  # nothing reached the broker
        async with Client(b.frontend, curve=good) as c:
            st = await c.status()
            assert st.counters.get("frames_rejected.client.auth_failed", 0) >= 1
            assert st.counters.get("requests.ok") == 5

    run(body(), timeout_s=60)


@pytest.mark.parametrize("listed", ["workers", "clients"])
def test_one_allow_list_guards_its_own_side_only(procs, tmp_path, listed):
    """With only one of the two allow-lists, that side checks keys and the other admits any key.

    Before: pyzmq's Authenticator keeps one allow-any switch for every ZAP domain, so the last
    domain configured decided both sides. ``--curve-allow-workers`` alone let any worker key
    through the handshake (only the registration check still refused it), and
    ``--curve-allow-clients`` alone refused every worker ("Unknown domain"): a fleet with no
    workers."""
    keys, allow, other = (tmp_path / d for d in ("keys", "allow", "other"))
    keygen(keys, "broker")
    allow.mkdir()
    pub, _ = keygen(keys, "w")  # the listed key: worker w's or a client's, by ``listed``
    (allow / pub.name).write_bytes(pub.read_bytes())
    keygen(other, "stranger")  # unlisted
    b = procs.broker("b", "--curve-secret", str(keys / "broker.key_secret"), f"--curve-allow-{listed}", str(allow),
                     "--heartbeat-ms", "200")
    worker_key = keys / "w.key_secret" if listed == "workers" else other / "stranger.key_secret"
    procs.workers("w", [b.backend], "--curve-secret", str(worker_key), "--curve-server-key", str(keys / "broker.key"), count=1)
    if listed == "workers":  # an unlisted worker must fail the handshake itself
        procs.workers("evil", [b.backend], "--curve-secret", str(other / "stranger.key_secret"),
                      "--curve-server-key", str(keys / "broker.key"), count=1)
    client_secret = keys / "w.key_secret" if listed == "clients" else other / "stranger.key_secret"
    client = client_keys(client_secret, keys / "broker.key")

    async def body():
        async with Client(b.frontend, curve=client) as c:
            async def settled():
                st = await c.status()
                ids = {w["worker_id"] for w in st.workers}
                rejected = st.counters.get("frames_rejected.worker.auth_failed", 0)
                return (ids, rejected) if "w" in ids and (listed == "clients" or rejected >= 1) else None

            ids, _ = await until(settled, 20, "the worker registered (and the unlisted one was rejected)", step_s=0.05)
            assert ids == {"w"}
            assert (await c.generate(input_ids=[1, 2, 3], max_new_tokens=2, deadline_ms=5000)).worker == "w"
        if listed == "clients":  # and an unlisted client still cannot submit
            stranger = client_keys(other / "stranger.key_secret", keys / "broker.key")
            async with Client(b.frontend, curve=stranger) as c:
                with pytest.raises(RequestError) as ei:
                    await c.generate(input_ids=[1, 2, 3], max_new_tokens=2, deadline_ms=1000)
                assert ei.value.code.value == "deadline_exceeded"

    run(body(), timeout_s=60)


def test_a_clients_curve_key_names_its_tenant(procs, tmp_path):
    """The keys file's curve_keys: a listed ZeroMQ client runs as its key's tenant, another as zmq_tenant;
    neither can pick its tenant with the SUBMIT's own field."""
    keys, allowed_c = tmp_path / "keys", tmp_path / "allow-c"
    keygen(keys, "broker")
    allowed_c.mkdir()
    for name in ("app", "other"):
        pub, _ = keygen(keys, name)
        (allowed_c / pub.name).write_bytes(pub.read_bytes())
    kf = tmp_path / "keys.toml"
    kf.write_text('[[tenant]]\nname = "chat"\npriority = "high"\ncurve_keys = ["app"]\n')
    b = procs.broker("b", "--curve-secret", str(keys / "broker.key_secret"), "--curve-allow-clients", str(allowed_c),
                     "--keys-file", str(kf), "--heartbeat-ms", "200")
    procs.workers("w", [b.backend], "--curve-secret", str(keys / "app.key_secret"),
                  "--curve-server-key", str(keys / "broker.key"), count=1)

    async def body():
        async with Client(b.frontend, curve=client_keys(keys / "app.key_secret", keys / "broker.key")) as c:
            await until(lambda: _routable(c), 20, "the worker registered", step_s=0.05)
            for _ in range(3):
                await c.generate(input_ids=[1, 2, 3], max_new_tokens=1, deadline_ms=5000)
        async with Client(b.frontend, curve=client_keys(keys / "other.key_secret", keys / "broker.key")) as c:
            await c.generate(input_ids=[1, 2, 3], max_new_tokens=1, deadline_ms=5000)
            counters = (await c.status()).counters
        assert counters.get("tenants.chat.admitted") == 3 and counters.get("tenants.default.admitted") == 1, counters

    run(body(), timeout_s=60)


async def _routable(c):
    return any(w.get("state") == "routable" for w in (await c.status()).workers) or None
