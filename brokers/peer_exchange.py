"""The broker's peer exchange: a PUB of this broker's own in-flight figures, a SUB of its peers'.

Several brokers route to the same workers; each knows only its own dispatches between two
LoadStat snapshots. With ``--exchange tcp://HOST:PORT --peer tcp://OTHER:PORT ...`` every broker
publishes, per worker it has work on, its requests in flight, their uncached prefill tokens and
a counter of the uncached tokens it sent there (:data:`mesh.protocol.X_PEER_LOAD`), and adds its
peers' figures to its worker states. With ``--exchange-routes`` the same messages also carry
the prompts it routed since the last one, as a few content keys each
(:mod:`mesh.index.peer_routes`): a peer's provider counts them as speculative matches for one
TTL, so a follow-up that reaches another broker while the first prefill still runs finds the
worker that is computing its prefix (off by default: docs/routing.md). What to send, when, and what a
peer's message means live in the pure :mod:`mesh.routing.peers` (the simulator runs the same
objects); this module only owns the two sockets.

* **Timing.** A change message at the end of every pump that changed this broker's figures
  (``--exchange-interval-ms 0``, the default: under load one pump handles many dispatches, so
  the pump's own batching bounds the message rate), or at most every ``--exchange-interval-ms``
  when set; a full snapshot every min(1 s, stale / 3) regardless: it bounds how long a lost
  message matters and is the peers' liveness signal. Why 0: peers that learn of a dispatch
  milliseconds late pick the same idle worker meanwhile; ``mesh bench exchange`` measures
  the dispatch-to-peer delay of both settings side by side on real brokers.
* **Fire-and-forget, bounded, counted.** Sends never block (PUB: a slow peer loses messages at
  the HWM, the receiver counts them from sequence gaps as ``gap_messages``); a message lists at
  most :data:`~mesh.protocol.MAX_EXCHANGE_WORKERS` workers; every input passes
  :func:`~mesh.protocol.decode_exchange` and a bad one is counted (``rejected_<reason>``) and
  dropped. Counters live in ``BrokerStats.exchange`` (``mesh_exchange{what}`` in /metrics).
* **Falling back.** A peer silent for ``--exchange-stale-ms`` (3000) is dropped: its figures
  leave every worker state and this broker routes on its own view for it. :attr:`degraded` is
  true while fewer peers are fresh than configured; the broker counts each decision made then
  (``decisions_peer_stale``) and the gauge ``mesh_exchange_peers{state}`` shows fresh, stale
  and expected peers.
* **One owner.** The broker's pump owns both sockets (their FDs are watched with the others);
  :meth:`receive` and :meth:`tick` are called from it and return the changes to apply.
* **Security.** A broker with ``--curve-secret`` encrypts the exchange both ways with the
  brokers' key pair, which every broker of a fleet holds (workers and clients already name one
  ``--curve-server-key`` for all of them): the PUB is a CURVE server that lets only that key
  subscribe (ZAP domain ``peers``), and the SUB is a CURVE client that accepts only a publisher
  proving it holds the same secret. A stranger can neither read the figures nor feed any, and
  its failed handshake is counted (``frames_rejected{path="exchange",reason="auth_failed"}``).
  Without CURVE the exchange is plaintext like the rest: keep it on the brokers' private
  network. Values are bounded at decode either way (at most 2**20 requests per worker and
  message); a key holder is trusted to report honestly.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Iterable

import zmq

from mesh import protocol as P
from mesh.errors import ProtocolError
from mesh.routing.peers import PeerChange, PeerMerge, PeerPublisher
from mesh.routing.view import WorkerState
from mesh.sockets import EXCHANGE_PUB, EXCHANGE_SUB, CurveKeys, make_socket, send_frames

__all__ = ["PeerExchange"]

FULL_SNAPSHOT_MAX_S = 1.0


class PeerExchange:
    """The two exchange sockets of one broker (see the module docstring).

    ``ctx`` is a synchronous context (the broker's, shadowed); ``stats`` the counter the
    exchange counts into; ``on_reject(err)`` is told about every rejected message (the broker
    counts and logs it like its other decode failures); ``curve`` the broker's own server keys
    (the brokers' shared pair) to encrypt and authenticate both sockets with; ``on_routes(routes,
    now_s)`` takes the prompts a peer routed (its provider's :meth:`add_peer_routes`)."""

    def __init__(self, ctx: zmq.Context, broker_id: str, bind: str, peers: Iterable[str], *, interval_ms: float,
                 stale_ms: float, stats: Counter | None = None, log: Any = None,
                 on_reject: Callable[[ProtocolError], None] | None = None, epoch: int | None = None,
                 curve: CurveKeys | None = None,
                 on_routes: Callable[[list[tuple[str, int, list[int]]], float], None] | None = None) -> None:
        self.broker_id = broker_id
        # The boot epoch orders this process's incarnations for the peers (wall-clock ns: a
        # restart is larger; a clock that jumps back costs at most one staleness bound, after
        # which peers forget the old epoch's figures and accept the new one).
        self.epoch = epoch if epoch is not None else time.time_ns()
        self.stats: Counter = stats if stats is not None else Counter()
        self.log = log
        self.on_reject = on_reject
        self.on_routes = on_routes  # peers' routed prompts go to the provider (mesh.index.peer_routes)
        # peers' session pins go to the session table (mesh.routing.sessions): (peer, pins, now_s)
        self.on_sessions: Callable[[str, list[tuple[int, str, int]], float], int] | None = None
        pub_spec, sub_spec = EXCHANGE_PUB, EXCHANGE_SUB
        if curve is not None:
            pub_spec = EXCHANGE_PUB.with_curve(curve, b"peers")
            sub_spec = EXCHANGE_SUB.with_curve(CurveKeys(curve.public_key, curve.secret_key, server=False,
                                                         server_key=curve.public_key))
        self.pub = make_socket(ctx, pub_spec, bind=bind)
        try:
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            # A shared --peer list may name this broker too: never subscribe to ourselves.
            self.peers = [p for p in dict.fromkeys(peers) if p not in (bind, self.endpoint)]
            self.sub = make_socket(ctx, sub_spec, connect=self.peers or None)
        except BaseException:
            self.pub.close(linger=0)
            raise
        self.sub.setsockopt(zmq.SUBSCRIBE, P.EXCHANGE_HEADER)
        self.expected = len(self.peers)
        stale_s = stale_ms / 1000.0
        self.publisher = PeerPublisher(broker_id, self.epoch, interval_ms / 1000.0, min(FULL_SNAPSHOT_MAX_S, stale_s / 3))
        self.merge = PeerMerge(broker_id, stale_s)
        self.publisher.stats = self.merge.stats = self.stats  # one counter, disjoint keys
        self._self_seen = False
        self._fresh = 0
        self.degraded = self.expected > 0  # until every configured peer has spoken

    # ------------------------------------------------------------------ input
    def receive(self, frames: list[bytes], now_s: float) -> list[PeerChange]:
        """One message read from the SUB: decoded, merged; returns the changes to apply."""
        self.stats["received"] += 1
        m = P.decode_exchange(frames)
        if isinstance(m, ProtocolError):
            self.stats[f"rejected_{m.reason}"] += 1
            if self.on_reject is not None:
                self.on_reject(m)
            return []
        was_fresh = m.broker in self._fresh_set()
        outcome, changes = self.merge.apply(m, now_s)
        if outcome == "applied" and m.routes and self.on_routes is not None:
            self.on_routes(m.routes, now_s)
            self.stats["routes_received"] += len(m.routes)
        if outcome == "applied" and m.sessions and self.on_sessions is not None:
            self.on_sessions(m.broker, m.sessions, now_s)
            self.stats["sessions_received"] += len(m.sessions)
        if outcome == "self" and not self._self_seen:
            # one --peer endpoint is another address of this broker: it is not a peer to wait for
            self._self_seen = True
            self.expected = max(0, self.expected - 1)
        if outcome == "applied" and not was_fresh and self.log is not None:
            self.log.info("exchange_peer_fresh", peer=m.broker, epoch=m.epoch, workers=len(m.workers))
        self._update()
        return changes

    # ------------------------------------------------------------------ timers
    def next_due(self) -> float:
        """When :meth:`tick` has work next (monotonic seconds)."""
        return min(self.publisher.next_due(), self.merge.next_expiry())

    def tick(self, now_s: float, lookup: Callable[[str], WorkerState | None],
             states: Callable[[], Iterable[WorkerState]]) -> list[PeerChange]:
        """Expire silent peers and publish what is due; returns the changes to apply."""
        changes: list[PeerChange] = []
        if now_s >= self.merge.next_expiry():
            before = set(self.merge.fresh_peers())
            changes = self.merge.expire(now_s)
            gone = before - set(self.merge.fresh_peers())
            if gone and self.log is not None:
                self.log.warning("exchange_peer_stale", peers=sorted(gone), stale_ms=round(self.merge.stale_s * 1000),
                                 note="routing on this broker's own view for these peers' work")
            self._update()
        if now_s >= self.publisher.next_due():
            msg = self.publisher.build(now_s, lookup, states)
            if msg is not None:
                try:
                    send_frames(self.pub, P.encode_peer_load(msg))
                    self.stats["sent"] += 1
                except zmq.Again:  # PUB drops instead; kept for completeness
                    self.stats["send_failed"] += 1
        return changes

    # ------------------------------------------------------------------ views
    def _fresh_set(self) -> set[str]:
        return set(self.merge.fresh_peers())

    def _update(self) -> None:
        self._fresh = len(self.merge.fresh_peers())
        self.degraded = self._fresh < self.expected

    def peer_counts(self) -> dict[str, int]:
        """fresh / stale / expected peers (gauge ``mesh_exchange_peers``)."""
        fresh = self._fresh
        return {"fresh": fresh, "stale": max(len(self.merge.stale_peers()), self.expected - fresh), "expected": self.expected}

    def status(self, now_s: float) -> dict[str, Any]:
        """For STATUS: endpoint, epoch, peer counts, degraded, and each peer's last message."""
        return {"endpoint": self.endpoint, "epoch": self.epoch, "peers": self.peers, **self.peer_counts(),
                "degraded": self.degraded, "seq": self.publisher.seq, "by_peer": self.merge.peer_info(now_s)}

    def close(self) -> None:
        """Close both sockets (idempotent; linger 0: figures are worthless once stale)."""
        for s in (self.pub, self.sub):
            if not s.closed:
                s.close(linger=0)
