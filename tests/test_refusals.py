"""Refusals are said on the refused side (issue 30): a worker the broker will not take logs why,
not only the broker (which logs a refusal every second): a CURVE key the broker does not allow,
a key listed for another worker id, a worker pointed at the broker's client port."""

from __future__ import annotations

from mesh.lab.procs import wait_for_log_event
from mesh.security import keygen


def _refusal(p) -> dict:
    return wait_for_log_event(p.log_path, "broker_refused_registration", 20, p.popen, start=p.log_start)


def test_curve_workers_refused_say_why(procs, tmp_path):
    keys, allowed, other = (tmp_path / d for d in ("keys", "allow", "other"))
    keygen(keys, "broker")
    allowed.mkdir()
    pub, _ = keygen(keys, "good")
    (allowed / pub.name).write_bytes(pub.read_bytes())
    keygen(other, "stranger")
    b = procs.broker("b", "--curve-secret", str(keys / "broker.key_secret"), "--curve-allow-workers", str(allowed),
                     "--heartbeat-ms", "200")
    curve = ["--curve-server-key", str(keys / "broker.key")]
    # the key is listed, for worker id "good": registering as "bad" is refused after the handshake
    mismatch = procs.workers("bad", [b.backend], "--curve-secret", str(keys / "good.key_secret"), *curve)
    # the key is not listed at all: the handshake itself is refused
    stranger = procs.workers("stranger", [b.backend], "--curve-secret", str(other / "stranger.key_secret"), *curve)
    rec = _refusal(mismatch)
    assert "may not register as 'bad'" in rec["reason"] and "--curve-allow-workers" in rec["hint"]
    rec = _refusal(stranger)
    assert "CURVE handshake refused" in rec["reason"] and "--curve-allow-workers" in rec["hint"]


def test_a_worker_on_the_client_port_is_told(procs):
    b = procs.broker("b")
    w = procs.workers("w", [b.frontend])
    rec = _refusal(w)
    assert "client port" in rec["reason"] and "--backend" in rec["hint"]
