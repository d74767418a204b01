"""The broker exchange's core: what a router tells its peers and what it makes of theirs. Pure.

Several routers in front of one fleet each see only their own dispatches between two LoadStat
snapshots, so they all pile onto the same cache holder. With the exchange every router publishes,
per worker it has work on, its **own absolute figures** -- requests in flight there, their
uncached prefill tokens, and a counter of uncached tokens it ever sent there -- and every router
adds its peers' figures to its :class:`~mesh.routing.view.WorkerState` objects. The broker
(real sockets, :mod:`brokers.peer_exchange`) and the simulator (virtual time, a delay) run these
same two classes.

Why absolute state and not events. Dynamo's ``--router-replica-sync`` sends per-request deltas
(``AddRequest`` / ``MarkPrefillCompleted`` / ``Free``, tagged with the router's id) over NATS: a
lost ``Free`` leaves phantom load until something expires it, and a restarted replica must be
told the whole state again. Here a message *replaces* what it describes, so:

* a lost message costs freshness, never correctness: the next one (a change message within
  ``interval``, or the full snapshot every ``full_interval``) carries the current values;
* a duplicated or reordered one is dropped by its sequence number (per sender epoch);
* a restarted sender has a larger ``epoch``: its old figures are dropped at once;
* a silent sender is dropped after ``stale_s`` and the receiver falls back to its own view for
  it (the broker counts the decisions made meanwhile).

Messages are of two kinds: *change* messages list the workers whose figures changed since the
last message (sent at most every ``interval_s``, only when something changed), *full* snapshots
list every worker the sender has work on (a worker it omits has none) and double as the
sender's liveness signal. The tokens-sent counter lets a receiver add a peer's *new* work to its
since-the-LoadStat correction exactly like its own (``pending_since_load_tokens``), even though
each router receives LoadStats at its own phase; requests use the absolute in-flight count.
Figures are per worker, not per DP rank (the router's correction terms are per worker too).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from mesh.index.peer_routes import route_anchors
from mesh.protocol import MAX_EXCHANGE_ROUTES, MAX_EXCHANGE_SESSIONS, MAX_EXCHANGE_WORKERS, MAX_SESSION_AGE_MS, PeerLoad
from mesh.routing.peer_guard import EPOCH_SKEW_NS, SourceBinding, epoch_step_ok
from mesh.routing.view import WorkerState

__all__ = ["PeerMerge", "PeerPublisher", "PeerChange", "apply_changes", "peer_dispatched", "router_rank",
           "set_router_rank"]

#: (worker_id, d_inflight, d_prefill_tokens, sent_tokens, live): one worker's change of the
#: peers' summed figures; see :meth:`WorkerState.apply_peer_change`.
PeerChange = tuple[str, int, int, int, bool]

MAX_PEERS = 64  # distinct peer broker ids tracked at once; stale ones are evicted first, then refused (counted)


@dataclass(slots=True)
class _Peer:
    epoch: int
    seq: int
    last_s: float  # arrival (receiver's clock) of its last accepted message
    figures: dict[str, list[int]]  # worker id -> [inflight, prefill_tokens, sent_tokens]
    stale_s: float  # its staleness bound: ours, or 3 full-snapshot periods of its own if longer
    stale: bool = False
    epoch_at_s: float = 0.0  # when its current epoch was accepted (receiver's clock)


class PeerMerge:
    """Merges peers' PEER_LOAD reports into per-worker sums and says what changed.

    :meth:`apply` and :meth:`expire` return :data:`PeerChange` lists for the caller to apply to
    its worker states (:func:`apply_changes`); :meth:`totals` gives the current sums for a
    worker that registers later. ``stats`` counts every outcome (``applied``, ``duplicate``,
    ``old_epoch``, ``restarted``, ``self``, ``too_many_peers``, ``gap_messages`` (messages a
    sequence gap shows were lost), ``expired``, ``worker_cap``, ``counter_reset``) and every
    hostile-peer drop (:mod:`mesh.routing.peer_guard`): ``own_id`` (this router's id with
    another epoch: someone else), ``id_mismatch`` / ``id_spoofed`` (a broker id bound to
    another source), ``epoch_jump`` (an epoch further ahead than the time elapsed),
    ``restart_too_soon`` (a second restart within ``min_restart_s``), ``evicted`` (a stale
    peer's entry reused). Times are the receiver's ``now_s``; no clock of the sender is trusted.

    A restart (or a peer back from stale) re-reads its figures as a *baseline*: they enter the
    live sums but not the correction since the last LoadStat, so a peer restarting on every
    message cannot add its figures to that correction again and again (it did: one such peer
    steered 97 % of the requests to one worker).
    """

    def __init__(self, self_id: str, stale_s: float, *, max_peers: int = MAX_PEERS,
                 max_workers_per_peer: int = MAX_EXCHANGE_WORKERS, forget_s: float | None = None,
                 self_epoch: int | None = None, min_restart_s: float | None = None,
                 epoch_skew_ns: int = EPOCH_SKEW_NS) -> None:
        self.self_id = self_id
        self.self_epoch = self_epoch  # None: any epoch under our own id is our own (echo)
        self.stale_s = stale_s
        self.min_restart_s = min_restart_s if min_restart_s is not None else min(1.0, stale_s / 3)
        self.epoch_skew_ns = epoch_skew_ns
        self.binding = SourceBinding()
        self.max_peers = max_peers
        self.max_workers = max_workers_per_peer
        self.forget_s = forget_s if forget_s is not None else max(30.0, 10 * stale_s)
        self._peers: dict[str, _Peer] = {}
        self._totals: dict[str, list[int]] = {}  # worker id -> [inflight, prefill_tokens] over live peers
        self.stats: Counter[str] = Counter()

    # ------------------------------------------------------------------ queries
    def totals(self, worker_id: str) -> tuple[int, int]:
        """(inflight, prefill_tokens) summed over fresh peers for ``worker_id``."""
        t = self._totals.get(worker_id)
        return (t[0], t[1]) if t is not None else (0, 0)

    def is_fresh(self, broker: str) -> bool:
        p = self._peers.get(broker)
        return p is not None and not p.stale

    def fresh_peers(self) -> list[str]:
        return [b for b, p in self._peers.items() if not p.stale]

    def stale_peers(self) -> list[str]:
        return [b for b, p in self._peers.items() if p.stale]

    def peer_info(self, now_s: float) -> dict[str, dict]:
        """Per peer: epoch, seq, age of its last message (ms), stale, workers it reports."""
        return {b: {"epoch": p.epoch, "seq": p.seq, "age_ms": round((now_s - p.last_s) * 1000, 1), "stale": p.stale,
                    "workers": sum(1 for f in p.figures.values() if f[0] or f[1])} for b, p in self._peers.items()}

    def next_expiry(self) -> float:
        """When the next fresh peer goes stale if it stays silent (inf: none)."""
        return min((p.last_s + p.stale_s for p in self._peers.values() if not p.stale), default=float("inf"))

    # ------------------------------------------------------------------ input
    def apply(self, msg: PeerLoad, now_s: float, source: str = "") -> tuple[str, list[PeerChange]]:
        """Merge one decoded message that arrived from ``source`` (a configured endpoint; ""
        unsourced). Returns (outcome, changes); outcome ``applied`` or the reason it was
        dropped (then no changes)."""
        changes: list[PeerChange] = []
        why, peer, news = self._admit(msg, now_s, source, changes)
        if peer is None:
            self.stats[why] += 1
            return why, changes
        self.binding.bind(source, msg.broker)
        # A peer configured with a longer snapshot period than ours would look stale between
        # its snapshots: its own period sets the bound then (mismatched settings never flap).
        peer.stale_s = max(self.stale_s, 3 * msg.full_ms / 1000.0)
        peer.seq = msg.seq
        peer.last_s = now_s
        peer.stale = False
        figs = peer.figures
        listed = set() if msg.full else None
        compacted = False  # at most one compaction per message: per-message work stays linear
        for wid, n, pre, sent in msg.workers:
            if listed is not None:
                listed.add(wid)
            f = figs.get(wid)
            if f is None:
                if len(figs) >= self.max_workers:
                    if not compacted:
                        compacted = True
                        self.stats["worker_compactions"] += 1
                        self._compact(figs)
                    if len(figs) >= self.max_workers:
                        self.stats["worker_cap"] += 1
                        continue
                # First sight of this (peer, worker): its counter is a baseline, not new work,
                # but the prefill the peer has outstanding there now is work on the worker that
                # no snapshot we merged counted, so when its figures are news that much counts
                # as sent (never more than the counter; a new peer's older work drains from the
                # estimate within its prefill time). Without it every peer's first dispatch to
                # every worker was invisible to the queue estimates (8 routers x 16 workers: 1
                # in 7 sends of a 900-request run).
                figs[wid] = [n, pre, sent]
                if n or pre:
                    self._add(wid, n, pre)
                    changes.append((wid, n, pre, (pre if pre < sent else sent) if news else 0, news))
                continue
            d_n, d_pre = n - f[0], pre - f[1]
            if sent >= f[2]:
                d_sent = sent - f[2]
            else:  # the sender's counter restarted (its worker session was replaced)
                self.stats["counter_reset"] += 1
                d_sent = 0
            f[0], f[1], f[2] = n, pre, sent
            if d_n or d_pre or d_sent:
                if d_n or d_pre:
                    self._add(wid, d_n, d_pre)
                changes.append((wid, d_n, d_pre, d_sent, True))
        if listed is not None:
            # a full snapshot is authoritative: workers it omits have no work from this peer
            for wid, f in figs.items():
                if wid not in listed and (f[0] or f[1]):
                    d_n, d_pre = -f[0], -f[1]
                    f[0] = f[1] = 0
                    self._add(wid, d_n, d_pre)
                    changes.append((wid, d_n, d_pre, 0, True))
        self.stats["applied"] += 1
        return "applied", changes

    def _admit(self, msg: PeerLoad, now_s: float, source: str,
               changes: list[PeerChange]) -> tuple[str, _Peer | None, bool]:
        """(drop reason, None, _) or ("", the peer's entry ready for ``msg``, whether its
        first-sighted figures are news for the correction since the LoadStat)."""
        if msg.broker == self.self_id:
            if self.self_epoch is None or msg.epoch == self.self_epoch:
                return "self", None, False
            return "own_id", None, False  # our id, another epoch: not an echo of ours
        peer = self._peers.get(msg.broker)
        why = self.binding.check(source, msg.broker, self.is_fresh)
        if why:
            return why, None, False
        if peer is None:
            if len(self._peers) >= self.max_peers and not self._evict_one():
                return "too_many_peers", None, False
            peer = self._peers[msg.broker] = _Peer(msg.epoch, -1, now_s, {}, self.stale_s, epoch_at_s=now_s)
            return "", peer, True
        if peer.stale:  # its epoch expired with it: whatever it says now starts afresh
            peer.epoch, peer.seq, peer.epoch_at_s = msg.epoch, -1, now_s
            return "", peer, False
        if msg.epoch < peer.epoch:
            return "old_epoch", None, False
        if msg.epoch > peer.epoch:
            if now_s - peer.epoch_at_s < self.min_restart_s:
                return "restart_too_soon", None, False
            if not epoch_step_ok(peer.epoch, msg.epoch, now_s - peer.epoch_at_s, self.epoch_skew_ns):
                return "epoch_jump", None, False
            self.stats["restarted"] += 1
            self._drop(peer, changes)
            peer.epoch, peer.seq, peer.epoch_at_s = msg.epoch, -1, now_s
            return "", peer, False
        if msg.seq <= peer.seq:
            return "duplicate", None, False
        if peer.seq >= 0 and msg.seq > peer.seq + 1:
            self.stats["gap_messages"] += msg.seq - peer.seq - 1
        return "", peer, True

    def _evict_one(self) -> bool:
        """Make room for a new peer by forgetting the longest-silent stale one (counted)."""
        stale = [(p.last_s, b) for b, p in self._peers.items() if p.stale]
        if not stale:
            return False
        b = min(stale)[1]
        del self._peers[b]
        self.binding.release(b)
        self.stats["evicted"] += 1
        return True

    def expire(self, now_s: float) -> list[PeerChange]:
        """Drop the figures of peers silent for more than ``stale_s`` (each counted once as
        ``expired``) and forget peers silent for ``forget_s``."""
        changes: list[PeerChange] = []
        forget = []
        for b, p in self._peers.items():
            age = now_s - p.last_s
            if not p.stale and age > p.stale_s:
                p.stale = True
                self.stats["expired"] += 1
                self._drop(p, changes)
            if p.stale and age > self.forget_s:
                forget.append(b)
        for b in forget:
            del self._peers[b]
            self.binding.release(b)
        return changes

    # ------------------------------------------------------------------ internals
    def _add(self, wid: str, d_n: int, d_pre: int) -> None:
        t = self._totals.get(wid)
        if t is None:
            t = self._totals[wid] = [0, 0]
        t[0] += d_n
        t[1] += d_pre
        if t[0] <= 0 and t[1] <= 0:
            del self._totals[wid]

    def _drop(self, p: _Peer, changes: list[PeerChange]) -> None:
        for wid, f in p.figures.items():
            if f[0] or f[1]:
                self._add(wid, -f[0], -f[1])
                changes.append((wid, -f[0], -f[1], 0, False))
        p.figures = {}

    @staticmethod
    def _compact(figs: dict[str, list[int]]) -> None:
        for wid in [w for w, f in figs.items() if not f[0] and not f[1]]:
            del figs[wid]


def apply_changes(changes: Iterable[PeerChange], lookup: Callable[[str], WorkerState | None],
                  now_s: float | None = None) -> int:
    """Apply :data:`PeerChange` items to the worker states ``lookup`` finds (unknown workers are
    skipped: :meth:`PeerMerge.totals` seeds them when they register). Returns how many applied."""
    n = 0
    for wid, d_n, d_pre, sent, live in changes:
        st = lookup(wid)
        if st is not None:
            st.apply_peer_change(d_n, d_pre, sent, live, now_s)
            n += 1
    return n


class PeerPublisher:
    """Decides what one router publishes and when.

    Set every worker state's ``exchange_dirty`` to :attr:`dirty`; the router's own
    ``record_dispatch`` / ``record_release`` then mark the worker. :meth:`next_due` says when
    the next message is due: a change message ``interval_s`` after the previous message while
    something is dirty, and a full snapshot every ``full_interval_s`` regardless (liveness).
    :meth:`build` returns the message due at ``now_s`` (or None). At most ``max_workers``
    workers per message: a change message leaves the rest dirty for the next one, a full
    snapshot lists the busiest (``stats["truncated"]`` counts the omitted)."""

    def __init__(self, broker_id: str, epoch: int, interval_s: float, full_interval_s: float,
                 max_workers: int = MAX_EXCHANGE_WORKERS, max_routes: int = MAX_EXCHANGE_ROUTES) -> None:
        self.broker_id = broker_id
        self.max_routes = max_routes
        # prompts routed since the last message (note_route): at most one message's worth is
        # kept, the oldest dropped first (counted): they are guesses with a TTL of seconds
        self.routes: deque[tuple[str, int, list[int]]] = deque()
        # session pins made or used since the last message (note_session): hash -> (worker, last use)
        self.sessions: dict[int, tuple[str, float]] = {}
        self.epoch = epoch
        self.interval_s = interval_s
        self.full_interval_s = full_interval_s
        self.max_workers = max_workers
        self.dirty: set[str] = set()
        self.seq = -1
        self._last_s = float("-inf")
        self._next_full_s = float("-inf")  # the first message is a full snapshot
        self._sent: dict[str, int] = {}  # last published sent_tokens per worker (for workers gone since)
        self.stats: Counter[str] = Counter()

    def note_route(self, worker_id: str, keys) -> None:
        """This router routed a prompt with content keys ``keys`` to ``worker_id``: tell the
        peers with the next message (see :mod:`mesh.index.peer_routes`)."""
        if not keys:
            return
        routes = self.routes
        if len(routes) >= self.max_routes:
            routes.popleft()
            self.stats["routes_dropped"] += 1
        routes.append((worker_id, len(keys), route_anchors(keys)))

    def note_session(self, h: int, worker_id: str, last_s: float) -> None:
        """This router pinned (or used the pin of) session hash ``h`` to ``worker_id`` at
        ``last_s``: tell the peers with the next message (:mod:`mesh.routing.sessions`). At most
        one message's worth is kept, the oldest dropped first (counted ``sessions_dropped``)."""
        s = self.sessions
        s.pop(h, None)
        if len(s) >= MAX_EXCHANGE_SESSIONS:
            del s[next(iter(s))]
            self.stats["sessions_dropped"] += 1
        s[h] = (worker_id, last_s)

    def next_due(self) -> float:
        if self.dirty or self.routes or self.sessions:
            return min(self._next_full_s, self._last_s + self.interval_s)
        return self._next_full_s

    def build(self, now_s: float, lookup: Callable[[str], WorkerState | None],
              states: Callable[[], Iterable[WorkerState]]) -> PeerLoad | None:
        """The message due at ``now_s``, or None. ``lookup(worker_id)`` and ``states()`` read
        the router's own worker states (a worker no longer registered reads as idle)."""
        if now_s >= self._next_full_s:
            entries = []
            for st in states():
                if st.inflight or st.outstanding_prefill_tokens:
                    entries.append((st.worker_id, st.inflight, st.outstanding_prefill_tokens, st.sent_tokens))
            if len(entries) > self.max_workers:
                self.stats["truncated"] += len(entries) - self.max_workers
                entries.sort(key=lambda e: (-e[1], -e[2]))
                del entries[self.max_workers:]
            self.dirty.clear()
            full = True
            self._next_full_s = now_s + self.full_interval_s
        elif (self.dirty or self.routes or self.sessions) and now_s >= self._last_s + self.interval_s:
            entries = []
            dirty = self.dirty
            while dirty and len(entries) < self.max_workers:
                wid = dirty.pop()
                st = lookup(wid)
                if st is None:
                    entries.append((wid, 0, 0, self._sent.get(wid, 0)))
                else:
                    entries.append((wid, st.inflight, st.outstanding_prefill_tokens, st.sent_tokens))
            full = False
        else:
            return None
        for e in entries:
            self._sent[e[0]] = e[3]
        if len(self._sent) > 4 * self.max_workers:  # bounded: forget idle workers' counters
            keep = {e[0] for e in entries}
            self._sent = {w: s for w, s in self._sent.items() if w in keep}
        self.seq += 1
        self._last_s = now_s
        self.stats["sent_full" if full else "sent_changes"] += 1
        routes = list(self.routes)
        self.routes.clear()
        self.stats["routes_sent"] += len(routes)
        sessions = [(h, w, min(MAX_SESSION_AGE_MS, max(0, round((now_s - t) * 1000)))) for h, (w, t) in self.sessions.items()]
        self.sessions.clear()
        self.stats["sessions_sent"] += len(sessions)
        return PeerLoad(self.broker_id, self.epoch, self.seq, full, entries, max(1, min(600_000, round(self.full_interval_s * 1000))),
                        routes, sessions)


def router_rank(self_id: str, peer_ids: Iterable[str]) -> int:
    """This router's rank among itself and its fresh peers, by id: distinct for every router
    that sees the same peer set, 0 for a router alone (cache_aware parts near-ties by it)."""
    return sorted({self_id, *peer_ids}).index(self_id)


def _policy_of(router: Any) -> Any:
    """The policy of ``router`` (a session or bucket router wraps the plain one), or None."""
    for _ in range(4):
        pol = getattr(router, "policy", None)
        if pol is not None:
            return pol
        router = getattr(router, "inner", None)
        if router is None:
            return None
    return None


def set_router_rank(router: Any, rank: int, peer_dispatch_s: float | None = None) -> bool:
    """Tell ``router``'s policy its rank (a session or bucket router wraps the plain one; a
    policy without ranks ignores it) and, with ``peer_dispatch_s``, that an exchange message
    showing a peer's new dispatch arrived then (cache_aware parts near-ties only while
    decisions are that young). True when a policy took the rank."""
    pol = _policy_of(router)
    setter = getattr(pol, "set_router_rank", None)
    if setter is None:
        return False
    setter(rank)
    if peer_dispatch_s is not None:
        pol.note_peer_dispatch(peer_dispatch_s)
    return True


def peer_dispatched(changes: Iterable[PeerChange]) -> bool:
    """Whether merged changes show a peer's new dispatch (more requests in flight, or its
    sent-tokens counter grew), not only releases or a dropped peer."""
    return any(c[4] and (c[1] > 0 or c[3] > 0) for c in changes)
