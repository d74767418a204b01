"""The broker's telemetry stream: a ZeroMQ PUB of fleet snapshots and lifecycle events.

Frame layout (documented with the rest of the wire contract in :mod:`mesh.protocol`)::

    frame 0: topic  b"mesh.snapshot" | b"mesh.event"
    frame 1: msgpack map

``mesh.snapshot`` (every ``interval_s``): ``broker_id``, ``ts`` (wall clock, for display only),
``state``, ``inflight``, ``workers`` (list of maps: worker_id, role, labels, healthy, inflight,
running, waiting, kv_usage, requests, hit_rate), ``requests`` and ``decisions`` (cumulative
counters by outcome / reason), ``degraded_decisions``, ``text_unmatched`` (text requests the HTTP
ingress sent without their model's tokenizer, by model), ``regret`` (with cache_aware and
``--regret-audit on``: :meth:`mesh.routing.regret.RegretAudit.snapshot`).
``mesh.event``: ``broker_id``, ``ts``, ``event`` (worker_registered, worker_expired,
worker_disconnected, worker_draining, ...) and its fields.

The PUB socket is owned by the broker loop (it publishes from its timer and handlers); a slow
subscriber loses messages at the HWM instead of slowing the broker.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from mesh.protocol import pack
from mesh.sockets import TELEMETRY_PUB, make_socket, send_frames

__all__ = ["TelemetryPublisher", "SNAPSHOT_TOPIC", "EVENT_TOPIC"]

SNAPSHOT_TOPIC = b"mesh.snapshot"
EVENT_TOPIC = b"mesh.event"


class TelemetryPublisher:
    def __init__(self, ctx: zmq.Context, endpoint: str, broker_id: str, interval_s: float = 1.0) -> None:
        self.sock = make_socket(ctx, TELEMETRY_PUB, bind=endpoint)
        self._sync = zmq.Socket.shadow(self.sock.underlying)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.broker_id = broker_id
        self.interval_s = interval_s
        self.dropped = 0

    def _send(self, topic: bytes, body: dict[str, Any]) -> None:
        try:
            send_frames(self._sync, [topic, pack(body)])
        except zmq.Again:
            self.dropped += 1

    def event(self, event: str, **fields: Any) -> None:
        self._send(EVENT_TOPIC, {"broker_id": self.broker_id, "ts": time.time(), "event": event, **fields})

    def snapshot(self, body: dict[str, Any]) -> None:
        self._send(SNAPSHOT_TOPIC, {"broker_id": self.broker_id, "ts": time.time(), **body})

    def close(self) -> None:
        self.sock.close(linger=0)
