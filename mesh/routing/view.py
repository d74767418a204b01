"""The router's picture of the fleet and of one request. Pure data; no I/O, no clock.

The broker (real time), the simulator (virtual time) and the tests build these objects and pass
``now_s`` explicitly, so the same routing code runs in all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from mesh.load import LoadStat, PrefillRateEstimate

__all__ = ["WorkerState", "RouteRequest", "Decision", "AggregatedLoad"]


@dataclass(slots=True)
class AggregatedLoad:
    """A worker's load summed over its DP ranks (only built when every rank is fresh)."""

    running: int
    waiting: int
    used_tokens: int
    max_tokens: int
    waiting_uncached_tokens: int
    total_tokens: int
    max_running: int

    @property
    def kv_usage(self) -> float:
        return self.used_tokens / self.max_tokens if self.max_tokens > 0 else 0.0


IN_PROGRESS_MAX_TOKENS = 16_384  # the prefill a LoadStat can miss per DP rank: one chunk (SGLang 8k-16k)
DRAIN_FALLBACK_TOKENS_PER_S = 25_000.0  # the fluid queue's drain before a worker's rate is measured
LOAD_STRIKES = 3  # consecutive implausible LoadStats before a worker's telemetry is ignored
LOAD_DISTRUST_S = 30.0  # how long it is then ignored


@dataclass(slots=True)
class WorkerState:
    """What a router knows about one worker.

    ``inflight`` is this router's own count of dispatched, unfinished requests (always live).
    ``load`` holds the latest LoadStat per DP rank and ``load_at_s`` when it arrived;
    ``inflight - inflight_at_load`` is the change in requests on the worker since that snapshot
    and ``pending_since_load_tokens`` the uncached tokens sent there since, so the snapshot can
    be corrected (see :meth:`pressure`).

    **Peers** (the broker exchange, :mod:`mesh.routing.peers`): other routers' figures arrive
    through :meth:`apply_peer_change`. ``peer_inflight`` / ``peer_prefill_tokens`` are the sums
    over fresh peers; their *changes* are folded into the two correction terms above
    (``inflight_at_load`` moves down by what peers added, ``pending_since_load_tokens`` grows by
    what they sent), so the correction reads "LoadStat + everyone's changes since" and a
    LoadStat (which already counts every router's work) resets it without double counting.
    Every reader of the correction terms (pressure, cache_aware's queue, admission) thus sees
    the fleet's work with no change of its own. Without fresh telemetry the fallback is the sum
    of this router's and its peers' live figures.
    """

    worker_id: str
    role: str = "mixed"
    labels: dict[str, str] = field(default_factory=dict)
    block_size: int = 16
    max_running_requests: int = 256
    max_total_num_tokens: int = 400_000
    dp_size: int = 1
    healthy: bool = True
    inflight: int = 0
    load: list[LoadStat | None] = field(default_factory=list)
    load_at_s: list[float] = field(default_factory=list)
    inflight_at_load: int = 0
    outstanding_prefill_tokens: int = 0  # uncached tokens of this router's unfinished requests
    pending_since_load_tokens: int = 0  # uncached tokens this router sent since the last LoadStat
    # The worker's prefill queue as a fluid (uncached tokens at ``queue_at_s``): the last
    # LoadStat's waiting tokens, then every send this router makes or hears of added at its time
    # and drained at the worker's rate in between (see :meth:`queued_tokens`).
    queue_tokens: float = 0.0
    queue_at_s: float = 0.0
    prefill_tokens_per_s: float | None = None
    peer_inflight: int = 0  # requests fresh peer routers have in flight here (exchange)
    peer_prefill_tokens: int = 0  # ... and their uncached prefill tokens
    sent_tokens: int = 0  # uncached tokens this router ever dispatched here (grows only; published to peers)
    peer_sent_tokens: int = 0  # ... and fresh peers ever reported sending here (grows only)
    # The exchange's dirty set (worker ids whose own figures changed since the last publish):
    # record_dispatch/record_release add this worker's id when it is set.
    exchange_dirty: set | None = None
    loras: frozenset[str] = frozenset()  # LoRA adapters loaded on the worker's engine (READY / HEARTBEAT)
    _rate_est: list[PrefillRateEstimate] = field(default_factory=list)  # per rank (prefill_tokens_per_s)
    # fresh_load() is read for every candidate of every decision: the sum over ranks is cached
    # until the next LoadStat, with the time of its oldest rank for the freshness check.
    _agg: AggregatedLoad | None = None
    _agg_oldest_s: float = 0.0
    # A worker whose LoadStat claims far fewer requests than this router alone has on it is lying
    # or broken: after LOAD_STRIKES such reports in a row its telemetry is ignored (router-local
    # estimates instead) for LOAD_DISTRUST_S; ``load_distrusted`` counts how often.
    load_strikes: int = 0
    load_distrust_until_s: float = 0.0
    load_distrusted: int = 0
    first_reply_ms: float = 0.0  # EWMA of dispatch -> first reply seen by this router (outcomes)
    # DP attention (dp_size > 1, mesh.routing.ranks): this router's unfinished requests per rank
    # and their count when that rank's last LoadStat arrived (the per-rank twin of inflight /
    # inflight_at_load); empty until a request is routed to a rank.
    rank_inflight: list[int] = field(default_factory=list)
    rank_inflight_at_load: list[int] = field(default_factory=list)

    def distrusted(self, now_s: float) -> bool:
        """True while this worker's telemetry is ignored (see ``load_strikes``)."""
        return now_s < self.load_distrust_until_s

    def record_first_reply(self, ms: float) -> None:
        """An attempt sent here got its first reply after ``ms``: what this worker really does,
        whatever its LoadStat says (policies use it where the telemetry is distrusted)."""
        self.first_reply_ms = ms if self.first_reply_ms == 0.0 else 0.8 * self.first_reply_ms + 0.2 * ms

    def update_load(self, stats: Sequence[LoadStat], now_s: float) -> None:
        """Record a heartbeat's LoadStats (one per rank, rank taken from ``attn_dp_rank``)."""
        n = max(self.dp_size, 1)
        if len(self.load) != n:
            self.load = [None] * n
            self.load_at_s = [0.0] * n
            self._rate_est = [PrefillRateEstimate() for _ in range(n)]
        for ls in stats:
            r = ls.attn_dp_rank if 0 <= ls.attn_dp_rank < n else 0
            prev = self.load[r]
            self.load[r] = ls
            self.load_at_s[r] = now_s
            self._rate_est[r].update(prev, ls)
            if r < len(self.rank_inflight):
                self.rank_inflight_at_load[r] = self.rank_inflight[r]
        # the pooled rates of the ranks that have one (mesh.load.PrefillRateEstimate)
        rate = sum(e.rate_tokens_per_s or 0.0 for e in self._rate_est)
        if rate > 0:
            self.prefill_tokens_per_s = rate
        self.inflight_at_load = self.inflight
        self._agg = agg = self._aggregate()
        # The fluid restarts from the snapshot's waiting tokens. A snapshot counts no prefill the
        # engine is computing right now (admitted into its running batch), so what is left of the
        # work sent since the previous snapshot stays when that is more: without it a worker
        # halfway through a 170 ms prefill looked idle to every router the moment its LoadStat
        # arrived. Only work sent since then, of requests still unfinished, carries over (a
        # lying snapshot's queue does not, nor a request that already answered in full).
        # An engine computes at most one prefill chunk per DP rank at a time (the rest of a
        # chunked prompt is in the snapshot's waiting tokens), so no more than that carries
        # over: a peer's forged figures cannot keep a worker looking busy past the snapshot.
        fluid = self.queued_tokens(now_s, self.prefill_tokens_per_s or DRAIN_FALLBACK_TOKENS_PER_S)
        carried = min(fluid, float(self.pending_since_load_tokens), float(self.fleet_prefill_tokens),
                      float(IN_PROGRESS_MAX_TOKENS * (self.dp_size if self.dp_size > 1 else 1)))
        snap = float(agg.waiting_uncached_tokens) if agg is not None else 0.0
        self.queue_tokens = snap if snap > carried else carried
        self.queue_at_s = now_s
        self.pending_since_load_tokens = 0
        if agg is not None:
            # Honest telemetry counts at least this router's requests (all routers' in fact),
            # give or take the few in transit: half of ours, minus slack, cannot be honest.
            if self.inflight >= 4 and 2 * (agg.running + agg.waiting) + 2 < self.inflight:
                self.load_strikes += 1
                if self.load_strikes >= LOAD_STRIKES:
                    self.load_strikes = 0
                    self.load_distrust_until_s = now_s + LOAD_DISTRUST_S
                    self.load_distrusted += 1
            else:
                self.load_strikes = 0
        if now_s < self.load_distrust_until_s:
            self.prefill_tokens_per_s = None  # its counters are no more credible than its queue

    def _enqueue(self, tokens: int, now_s: float | None) -> None:
        if now_s is not None and now_s > self.queue_at_s:
            self.queue_tokens = self.queued_tokens(now_s, self.prefill_tokens_per_s or DRAIN_FALLBACK_TOKENS_PER_S)
            self.queue_at_s = now_s
        self.queue_tokens += tokens

    def queued_tokens(self, now_s: float, rate_tokens_per_s: float) -> float:
        """Uncached prefill tokens queued here at ``now_s`` (a fluid estimate): the fluid at
        ``queue_at_s`` drained at ``rate_tokens_per_s`` since. Sends are added at their own time,
        so capacity the worker had while idle is never spent on work that arrived later."""
        q = self.queue_tokens
        if now_s > self.queue_at_s:
            q -= rate_tokens_per_s * (now_s - self.queue_at_s)
        return q if q > 0.0 else 0.0

    def record_dispatch(self, uncached_tokens: int, now_s: float | None = None) -> None:
        """This router sent a request here (keeps the live corrections to stale telemetry)."""
        self.inflight += 1
        self.outstanding_prefill_tokens += uncached_tokens
        self.pending_since_load_tokens += uncached_tokens
        self._enqueue(uncached_tokens, now_s)
        self.sent_tokens += uncached_tokens
        if self.exchange_dirty is not None:
            self.exchange_dirty.add(self.worker_id)

    def record_release(self, uncached_tokens: int, dp_rank: int | None = None) -> None:
        """A request dispatched here (to ``dp_rank``, when one was chosen) finished, failed or
        moved elsewhere."""
        self.inflight = max(0, self.inflight - 1)
        if dp_rank is not None and dp_rank < len(self.rank_inflight):
            self.rank_inflight[dp_rank] = max(0, self.rank_inflight[dp_rank] - 1)
        self.outstanding_prefill_tokens = max(0, self.outstanding_prefill_tokens - uncached_tokens)
        if self.exchange_dirty is not None:
            self.exchange_dirty.add(self.worker_id)

    def record_rank_dispatch(self, dp_rank: int) -> None:
        """The request just recorded by :meth:`record_dispatch` goes to DP rank ``dp_rank``."""
        n = max(self.dp_size, dp_rank + 1)
        if len(self.rank_inflight) < n:
            grow = n - len(self.rank_inflight)
            self.rank_inflight.extend([0] * grow)
            self.rank_inflight_at_load.extend([0] * grow)
        self.rank_inflight[dp_rank] += 1

    def rank_pressure(self, dp_rank: int, now_s: float, freshness_s: float) -> float:
        """Requests on one DP rank right now (estimate), as :meth:`pressure` for the worker: the
        rank's fresh LoadStat (running + waiting) corrected by what this router sent there or
        saw finish since; without one, this router's own requests on that rank."""
        mine = self.rank_inflight[dp_rank] if dp_rank < len(self.rank_inflight) else 0
        ls = self.load[dp_rank] if dp_rank < len(self.load) else None
        if ls is None or now_s - self.load_at_s[dp_rank] > freshness_s or now_s < self.load_distrust_until_s:
            return float(mine)
        since = mine - (self.rank_inflight_at_load[dp_rank] if dp_rank < len(self.rank_inflight_at_load) else 0)
        return max(0.0, float(ls.num_running_reqs + ls.num_waiting_reqs + since))

    def apply_peer_change(self, d_inflight: int, d_prefill_tokens: int, sent_tokens: int, live: bool = True,
                          now_s: float | None = None) -> None:
        """Peers' figures here changed by ``d_inflight`` requests and ``d_prefill_tokens``
        uncached tokens, and they sent ``sent_tokens`` more uncached tokens.

        ``live`` False: a peer's figures were *dropped* (it went stale or restarted). They leave
        the live sums, but what it changed since the last LoadStat stays in the correction until
        the next LoadStat replaces it: the work is still on the worker, only no longer tracked.
        """
        pi = self.peer_inflight + d_inflight
        self.peer_inflight = pi if pi > 0 else 0
        pp = self.peer_prefill_tokens + d_prefill_tokens
        self.peer_prefill_tokens = pp if pp > 0 else 0
        if live:
            self.inflight_at_load -= d_inflight
            self.pending_since_load_tokens += sent_tokens
            self.peer_sent_tokens += sent_tokens
            if sent_tokens:
                self._enqueue(sent_tokens, now_s)

    @property
    def fleet_sent_tokens(self) -> int:
        """Uncached tokens this router and its peers ever sent here, as far as it has heard: the
        prefill work the fleet's routers have placed on this worker, a proxy for how much of the
        cache it holds (the miss rule's last tie-break)."""
        return self.sent_tokens + self.peer_sent_tokens

    @property
    def fleet_prefill_tokens(self) -> int:
        """Uncached prefill tokens of this router's and its fresh peers' unfinished requests here."""
        return self.outstanding_prefill_tokens + self.peer_prefill_tokens

    def fresh_load(self, now_s: float, freshness_s: float) -> AggregatedLoad | None:
        """Summed load if *every* rank reported a complete, capacity-valid LoadStat recently.

        A partly silent worker yields None (never a sum over only its fresh ranks).
        """
        agg = self._agg
        if agg is None or now_s - self._agg_oldest_s > freshness_s or now_s < self.load_distrust_until_s:
            return None
        return agg

    def _aggregate(self) -> AggregatedLoad | None:
        if not self.load:
            return None
        running = waiting = used = mx = wu = total = mr = 0
        oldest = float("inf")
        for ls, at in zip(self.load, self.load_at_s):
            if ls is None or not ls.extended or not ls.capacity_valid:
                return None
            oldest = min(oldest, at)
            running += ls.num_running_reqs
            waiting += ls.num_waiting_reqs
            used += ls.num_tokens
            mx += ls.max_total_num_tokens
            wu += ls.num_waiting_uncached_tokens
            total += ls.num_total_tokens
            mr += ls.max_running_requests
        self._agg_oldest_s = oldest
        return AggregatedLoad(running, waiting, used, mx, wu, total, mr)

    def pressure(self, now_s: float, freshness_s: float) -> float:
        """Load score used by load-based policies: requests on the worker right now (estimate).

        Fresh telemetry: running + waiting from the snapshot, corrected by what this router and
        its peers dispatched or finished since (``inflight - inflight_at_load``). Otherwise the
        in-flight count of this router and its fresh peers.
        """
        agg = self.fresh_load(now_s, freshness_s)
        if agg is None:
            return float(self.inflight + self.peer_inflight)
        return max(0.0, float(agg.running + agg.waiting + self.inflight - self.inflight_at_load))


@dataclass(slots=True)
class RouteRequest:
    """The routing-relevant part of one request.

    ``keys`` are the prompt's content keys at ``block_size`` (None when the request was not
    hashed, e.g. text-only with a load-only policy). ``tokens`` may carry the token ids for
    providers that need them.
    """

    request_id: str
    prompt_tokens: int
    max_new_tokens: int = 128
    block_size: int = 16
    keys: Sequence[int] | None = None
    ttft_slo_ms: int | None = None
    tps_slo: float | None = None
    tokens: Sequence[int] | None = None
    packed: Any = None  # tokens as array('I') or little-endian uint32 bytes, when the caller has them
    extra: dict[str, Any] = field(default_factory=dict)
    namespace: str | None = None  # cache namespace (mesh.namespaces): blocks of other namespaces never match
    session: str | None = None  # session key: its turns stick to one worker (mesh.routing.sessions)


@dataclass(slots=True)
class Decision:
    """The outcome of routing one request. ``worker_id`` None means no worker could be chosen."""

    worker_id: str | None
    reason: str
    matched_blocks: int = 0
    degraded: bool = False
    decode_worker_id: str | None = None
    uncached_tokens: int = 0
    detail: dict[str, Any] = field(default_factory=dict)
    dp_rank: int | None = None  # the DP rank of worker_id chosen for it (dp_size > 1; mesh.routing.ranks)
