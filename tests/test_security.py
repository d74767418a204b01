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
