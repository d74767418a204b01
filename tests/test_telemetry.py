"""Telemetry stream: snapshots and lifecycle events from a real broker; mesh top renders them."""

from __future__ import annotations

import signal

import zmq
from rich.console import Console

from mesh.protocol import unpack
from mesh.top import render
from mesh.lab.up import wait_for_workers
from tests.conftest import run


def test_telemetry_snapshots_and_events(procs):
    b = procs.broker("b", "--telemetry", "tcp://127.0.0.1:*", "--heartbeat-ms", "200")
    from mesh.lab.procs import wait_for_log_event

    tel = wait_for_log_event(b.log_path, "broker_listening", 10)["telemetry"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"mesh.")
    sub.connect(tel)
    try:
        w = procs.workers("w", [b.backend], count=2)
        run(wait_for_workers(b.frontend, 2))
        events, snaps = [], []
        w.signal(signal.SIGKILL)
        lost = ("worker_expired", "worker_connection_lost")  # silence, or a heartbeat that found no connection
        while len(snaps) < 1 or sum(1 for e in events if e["event"] in lost) < 2:
            assert sub.poll(5000), "no telemetry within 5 s"
            topic, body = sub.recv_multipart()
            (snaps if topic == b"mesh.snapshot" else events).append(unpack(body))
        kinds = [e["event"] for e in events]
        assert any(k in lost for k in kinds)
        snap = snaps[-1]
        assert snap["broker_id"] == "b" and "workers" in snap and "decisions" in snap
        text = Console(record=True, width=200)
        text.print(render({"b": snap}, {"b": 1.0}, [str(k) for k in kinds]))
        assert "mesh top" in text.export_text()
    finally:
        sub.close()
        ctx.term()
