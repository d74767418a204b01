"""The broker's peer exchange: a PUB of this broker's own in-flight figures, a SUB of its peers'.

Several brokers route to the same workers; each knows only its own dispatches between two
LoadStat snapshots. With ``--exchange tcp://HOST:PORT --peer tcp://OTHER:PORT ...`` every broker
publishes, per worker it has work on, its requests in flight, their uncached prefill tokens and
a counter of the uncached tokens it sent there (:data:`mesh.protocol.X_PEER_LOAD`), and adds its
peers' figures to its worker states. Unless ``--no-exchange-routes``, the same messages also carry
the prompts it routed since the last one, as a few content keys each
(:mod:`mesh.index.peer_routes`): a peer's provider counts them as speculative matches for one
TTL, so a follow-up that reaches another broker while the first prefill still runs finds the
worker that is computing its prefix (docs/routing.md). What to send, when, and what a
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
  subscribe (ZAP domain ``peers``), and each SUB is a CURVE client that accepts only a publisher
  proving it holds the same secret. With ``--peer-curve-keys`` (one public key file per
  ``--peer``, in order) and ``--exchange-curve-secret`` each broker has an exchange key of its
  own: the PUB admits exactly the listed keys and the SUB of each ``--peer`` accepts only that
  peer's key, so a broker id is bound to a key. A stranger can neither read the figures nor feed
  any, and its failed handshake is counted (``frames_rejected{path="exchange",reason="auth_failed"}``).
  Without CURVE the exchange is plaintext like the rest: keep it on the brokers' private network
  (``exchange_plaintext`` is logged at startup when an endpoint is not loopback).
* **Hostile peers** (issue 32; the rules are the pure :mod:`mesh.routing.peer_guard`). Every
  ``--peer`` is read through a SUB socket of its own, so each message has a known source before
  it is decoded: a per-source budget of messages and bytes per second drops a flood undecoded
  (``dropped_rate`` / ``dropped_bytes``); a broker id is bound to the source it arrived from
  (``id_mismatch``, ``id_spoofed``); this broker's own id with another epoch is refused
  (``own_id``); epochs move forward by bounded steps at most once per ``min_restart_s`` and expire
  with staleness (``epoch_jump``, ``restart_too_soon``); :attr:`degraded` is true while any
  configured peer has no fresh broker behind it, however many others speak. Subscribers are
  admitted at the handshake only (ZAP domain ``peers``): the listed keys under CURVE, the
  ``--peer`` hosts' addresses in plaintext (libzmq keeps every subscriber's filters in a trie:
  a stranger's 50 MB of subscriptions grew a broker to 2.41 GB). Values are
  bounded at decode either way (at most 2**20 requests per worker and message); a key holder is
  trusted to report honestly within those bounds.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import time
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Iterable

import zmq

from mesh import protocol as P
from mesh.errors import ProtocolError
from mesh.routing.peer_guard import RateBudget
from mesh.routing.peers import PeerChange, PeerMerge, PeerPublisher, peer_dispatched, router_rank
from mesh.routing.view import WorkerState
from mesh.sockets import EXCHANGE_PUB, EXCHANGE_SUB, CurveKeys, make_socket, send_frames

__all__ = ["PeerExchange", "is_loopback", "peer_addresses", "DEFAULT_MSGS_PER_S", "DEFAULT_BYTES_PER_S"]

FULL_SNAPSHOT_MAX_S = 1.0
# Each peer's budget (--exchange-peer-msgs-per-s / --exchange-peer-bytes-per-s): a busy broker
# sends one change message per pump that changed its figures (hundreds a second) and a full
# snapshot of at most MAX_EXCHANGE_BYTES a second; 20 maximum-size messages a second (1.16 MB
# each) from one peer pushed median request latency from 0.2-0.6 s to 5.8-7.9 s.
DEFAULT_MSGS_PER_S = 2000.0
DEFAULT_BYTES_PER_S = 4 * 1024 * 1024


class PeerExchange:
    """The exchange sockets of one broker (see the module docstring).

    ``ctx`` is a synchronous context (the broker's, shadowed); ``stats`` the counter the
    exchange counts into; ``on_reject(err)`` is told about every rejected message (the broker
    counts and logs it like its other decode failures); ``curve`` the broker's own server keys
    (the brokers' shared pair, or its own exchange pair with ``peer_keys``) to encrypt and
    authenticate the sockets with; ``peer_keys`` one public key per ``peers`` entry (the SUB of
    that peer accepts only it); ``on_routes(routes, now_s, source)`` takes the prompts a peer routed (its
    provider's :meth:`add_peer_routes`); ``max_msgs_per_s`` / ``max_bytes_per_s`` each peer's
    budget."""

    def __init__(self, ctx: zmq.Context, broker_id: str, bind: str, peers: Iterable[str], *, interval_ms: float,
                 stale_ms: float, stats: Counter | None = None, log: Any = None,
                 on_reject: Callable[[ProtocolError], None] | None = None, epoch: int | None = None,
                 curve: CurveKeys | None = None,
                 on_routes: Callable[[list[tuple[str, int, list[int]]], float, str], None] | None = None,
                 peer_keys: Iterable[bytes] | None = None, max_msgs_per_s: float = DEFAULT_MSGS_PER_S,
                 max_bytes_per_s: float = DEFAULT_BYTES_PER_S) -> None:
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
        # told this broker's rank among the fresh ones (and when a peer's new dispatch was heard)
        self.on_rank: Callable[..., Any] | None = None
        # ZAP domain "peers" either way: under CURVE it admits the listed keys; in plaintext the
        # broker's authenticator admits only its --peer hosts' addresses (brokers.main), so a
        # stranger's subscriptions never reach libzmq's filter trie.
        pub_spec = EXCHANGE_PUB.with_curve(curve, b"peers") if curve is not None else replace(EXCHANGE_PUB, zap_domain=b"peers")
        self.pub = make_socket(ctx, pub_spec, bind=bind)
        self.subs: dict[str, zmq.Socket] = {}  # peer endpoint -> its own SUB
        try:
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            # A shared --peer list may name this broker too: never subscribe to ourselves.
            listed = list(dict.fromkeys(peers))
            keys = dict(zip(listed, peer_keys)) if peer_keys is not None else {}
            self.peers = [p for p in listed if p not in (bind, self.endpoint)]
            for ep in self.peers:
                spec = EXCHANGE_SUB
                if curve is not None:
                    spec = EXCHANGE_SUB.with_curve(CurveKeys(curve.public_key, curve.secret_key, server=False,
                                                             server_key=keys.get(ep, curve.public_key)))
                sub = self.subs[ep] = make_socket(ctx, spec, connect=ep)
                sub.setsockopt(zmq.SUBSCRIBE, P.EXCHANGE_HEADER)
        except BaseException:
            self.close()
            raise
        stale_s = stale_ms / 1000.0
        self.publisher = PeerPublisher(broker_id, self.epoch, interval_ms / 1000.0, min(FULL_SNAPSHOT_MAX_S, stale_s / 3))
        self.merge = PeerMerge(broker_id, stale_s, self_epoch=self.epoch)
        self.publisher.stats = self.merge.stats = self.stats  # one counter, disjoint keys
        self.budgets = {ep: RateBudget(max_msgs_per_s, max_bytes_per_s, P.MAX_EXCHANGE_BYTES) for ep in self.peers}
        self._self_sources: set[str] = set()  # --peer endpoints that turned out to be this broker
        self._logged_s: dict[tuple[str, str], float] = {}
        self._update()
        if curve is None and log is not None:
            wide = [ep for ep in [self.endpoint, *self.peers] if not is_loopback(ep)]
            if wide:
                log.warning("exchange_plaintext", endpoints=wide,
                            note="the peer exchange is unauthenticated beyond loopback: any host that reaches these "
                                 "endpoints can read or feed routing figures; set --curve-secret (and --peer-curve-keys)")

    @property
    def expected(self) -> int:
        return len(self.peers) - len(self._self_sources)

    def inputs(self) -> list[tuple[zmq.Socket, Callable[[list[bytes], float], list[PeerChange]]]]:
        """Every socket the owner's pump reads, with its handler (returns the changes to apply)."""
        return [(sub, functools.partial(self.receive, source=ep)) for ep, sub in self.subs.items()]

    def sockets(self) -> list[zmq.Socket]:
        return [self.pub, *self.subs.values()]

    # ------------------------------------------------------------------ input
    def receive(self, frames: list[bytes], now_s: float, source: str = "") -> list[PeerChange]:
        """One message read from the SUB of ``source``: budgeted, decoded, merged; returns the
        changes to apply."""
        self.stats["received"] += 1
        budget = self.budgets.get(source)
        if budget is not None:
            over = budget.take(sum(map(len, frames)), now_s)
            if over:
                self.stats[f"dropped_{over}"] += 1
                self._warn("exchange_peer_over_budget", source, now_s, peer=source, budget=over)
                return []
        m = P.decode_exchange(frames)
        if isinstance(m, ProtocolError):
            self.stats[f"rejected_{m.reason}"] += 1
            if self.on_reject is not None:
                self.on_reject(m)
            return []
        was_fresh = self.merge.is_fresh(m.broker)
        outcome, changes = self.merge.apply(m, now_s, source)
        if outcome == "applied" and m.routes and self.on_routes is not None:
            self.on_routes(m.routes, now_s, source)  # by the configured peer it came from, not its claim
            self.stats["routes_received"] += len(m.routes)
        if outcome == "applied" and m.sessions and self.on_sessions is not None:
            self.on_sessions(m.broker, m.sessions, now_s)
            self.stats["sessions_received"] += len(m.sessions)
        if outcome == "self" and source and source not in self._self_sources:
            # one --peer endpoint is another address of this broker: it is not a peer to wait for
            self._self_sources.add(source)
        elif outcome in _HOSTILE:
            self._warn("exchange_peer_refused", source, now_s, peer=source, claimed=m.broker[:64], reason=outcome)
        if outcome == "applied" and not was_fresh and self.log is not None:
            self.log.info("exchange_peer_fresh", peer=m.broker, epoch=m.epoch, workers=len(m.workers), source=source)
        # a peer's new dispatch: the policy parts near-ties for a moment (mesh.routing.peers.set_router_rank)
        self._update(now_s if outcome == "applied" and peer_dispatched(changes) else None)
        return changes

    def _warn(self, event: str, key: str, now_s: float, **fields: Any) -> None:
        """A structlog warning, at most one per event and source every 10 s (floods are counted)."""
        if self.log is None or now_s - self._logged_s.get((event, key), -1e9) < 10.0:
            return
        if len(self._logged_s) > 4096:
            self._logged_s.clear()
        self._logged_s[(event, key)] = now_s
        self.log.warning(event, **fields)

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
    def _update(self, peer_dispatch_s: float | None = None) -> None:
        """Fresh configured peers: a source counts when the broker bound to it is fresh, so
        strangers' ids (however many) never stand in for a configured peer that is missing.
        ``on_rank`` gets this broker's rank and, when a message showing a peer's new dispatch
        just arrived, its arrival time (``peer_dispatch_s``)."""
        bound = self.merge.binding.id_of
        self._fresh = sum(1 for ep in self.peers if ep not in self._self_sources and self.merge.is_fresh(bound.get(ep, "")))
        self.degraded = self._fresh < self.expected
        if self.on_rank is not None:  # this broker's rank among the fresh brokers parts near-ties (cache_aware)
            rank = router_rank(self.merge.self_id, self.merge.fresh_peers())
            if peer_dispatch_s is None:
                self.on_rank(rank)
            else:
                self.on_rank(rank, peer_dispatch_s)

    def peer_counts(self) -> dict[str, int]:
        """fresh / stale / expected peers (gauge ``mesh_exchange_peers``)."""
        fresh = self._fresh
        return {"fresh": fresh, "stale": max(len(self.merge.stale_peers()), self.expected - fresh), "expected": self.expected}

    def status(self, now_s: float) -> dict[str, Any]:
        """For STATUS: endpoint, epoch, peer counts, degraded, and each peer's last message."""
        return {"endpoint": self.endpoint, "epoch": self.epoch, "peers": self.peers, **self.peer_counts(),
                "degraded": self.degraded, "seq": self.publisher.seq, "by_peer": self.merge.peer_info(now_s)}

    def close(self) -> None:
        """Close every socket (idempotent; linger 0: figures are worthless once stale)."""
        for s in self.sockets():
            if not s.closed:
                s.close(linger=0)


#: merge outcomes that mean someone else speaks, or tries to, for a peer (logged, rate-limited)
_HOSTILE = frozenset({"own_id", "id_mismatch", "id_spoofed", "epoch_jump", "restart_too_soon", "too_many_peers"})


def peer_addresses(peers: Iterable[str]) -> list[str] | None:
    """The IP addresses of the ``--peer`` hosts (tcp endpoints; names resolved now), loopback
    included: the plaintext exchange PUB admits subscribers from these addresses only. None when
    a host does not resolve yet (a peer container not started): no list rather than a lockout."""
    out = {"127.0.0.1", "::1"}
    for ep in peers:
        if not ep.startswith("tcp://"):
            continue
        host = ep[6:].rsplit(":", 1)[0].strip("[]")
        try:
            out.update(str(ai[4][0]) for ai in socket.getaddrinfo(host, None))
        except OSError:
            return None
    return sorted(out)


def is_loopback(endpoint: str) -> bool:
    """True for ipc/inproc endpoints and tcp on a loopback host."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[6:].rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "::1"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
