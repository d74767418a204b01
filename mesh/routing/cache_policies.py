"""Cache-aware policies. Pure: no I/O, no clock reads.

``cache_aware_greedy`` — SGLang's threshold policy (the removed ``cache_aware_zmq``), kept as the
reference to beat:

1. imbalance fast path: if ``max_load - min_load > balance_abs_threshold`` and
   ``max_load > min_load * balance_rel_threshold``, take the least loaded worker;
2. otherwise, if the best match rate exceeds ``cache_threshold``, take the least loaded worker
   among those whose own match rate exceeds it;
3. otherwise the least loaded worker. Defaults 0.5 / 32 / 1.1 (SGLang's Rust defaults).

``cache_aware`` — mesh's policy: **load first, then cache**, with a calibrated cost model beside it; each
step used only as far as the quality matrix (docs/routing.md) showed it pays:

1. SGLang's imbalance bound, **applied per holder**: a worker whose pressure exceeds the least
   loaded one's by more than ``balance_abs_threshold`` (32) requests and
   ``balance_rel_threshold`` (1.1x) is no holder to stick to; a request left with no holder
   goes to the least loaded worker. SGLang (and greedy, ``imbalance_scope="fleet"``) sends
   *every* request there while any worker is over the bound, also those whose holder is fine:
   they are recomputed on one worker in a burst (zipf: six full prefills on one worker within
   40 ms, TTFT 386-734 ms, and the hits queued behind them), and the cache's hit rate drops;
2. otherwise **affinity** (``affinity_threshold``, 0.5): the holders of at least that share of the
   prompt whose KV can take it (fresh telemetry), whose telemetry is not distrusted and that
   are not over the imbalance bound;
3. among holders the least loaded by request pressure, rounded, and among equally loaded ones
   the lowest worker id, as greedy does (a stable choice keeps a burst of one new prefix on one
   worker until its KV events arrive). When nobody holds enough (a **miss**, and no imbalance
   to correct), among the workers within ``miss_load_band`` (1) request of the least loaded the
   shortest estimated prefill queue first (``miss_queue_ms``: queues within the same 5 ms of
   prefill count as equal), then the least loaded, then the worker the routers have sent the
   least prefill work so far (``miss_order="sent"``: this router's and, through the exchange,
   its peers'; ``"id"``: the lowest id, greedy's order): a miss waits for the prefill queued
   ahead of it, not for the requests decoding beside it, and the request count cannot tell a
   worker that just took a prompt from one with a long decode. The last tie-break spreads new
   prefixes over an idle fleet, where the lowest id stacked them on the first engines. The
   band keeps the request balance that decides near saturation (quality matrix, docs/routing.md:
   unbounded, the queue-first rule won low_reuse at load 0.5-0.8 by 12-27 % and lost it at
   load 1.0 by 15-19 %). With ``cost_ties="auto"`` the **cost model** breaks those ties
   instead while its online calibration trusts it, with ``"always"`` unconditionally.
   **Stall escape** (``stall_escape_ms`` 200, ``stall_queue_ms`` 1000): a holder with at least
   1 s of prefill queued, where this request would wait 200 ms longer than recomputing the
   whole prompt on the miss rule's worker, is left (a 100k-token prompt ahead of a session's
   follow-up blocks its holder for seconds; with several routers a follow-up often reaches a
   router that did not place the turn before it). The floor keeps short-prompt workloads on
   their holders: with a bare 100 ms margin zipf's hits left holders 150-300 ms deep and their
   2k-token prefixes were recomputed into an overloaded fleet (up to 2.0x greedy's p95). It
   reads queues in ms of the worker's pooled prefill rate
   (:class:`mesh.load.PrefillRateEstimate`); with SGLang's two-sample rate a one-page interval
   made a queue look 25x longer, and every margin tried lost shared_prefix (docs/routing.md).
   **Thresholds are prefill work**: ``miss_queue_ms``, ``stall_queue_ms`` and ``stall_escape_ms``
   are ms on the reference engine (``cost.prefill_tokens_per_s``, the 8B/H100 figure the
   defaults were chosen on), i.e. 125, 25,000 and 5,000 tokens of prefill; a worker measured at
   rate r applies them as ``ms x reference / r`` of its own ms (a 70B-class engine stretches
   every queue and prefill they are compared with, a small fast one shrinks them).
4. **Several routers part near-ties while their decisions can collide** (``rank_ties``, default
   ``"misses"``; ``rank_window_prefills``, :data:`RANK_WINDOW_PREFILLS`, or a fixed
   ``rank_window_ms``; :class:`CollisionWindow`): with the exchange every router sees one merged
   view, so a burst reaching several routers within the exchange's delay sends all their misses
   to the same least-sent worker. Router k (``router_rank``: its rank by id among itself and its
   fresh peers, set by the exchange's shell) takes the k-th member of the best tie class instead
   (:func:`part_ties`; on a miss the class reaches workers whose prefill queue is at most
   ``rank_reach`` (:data:`RANK_REACH`, 0.03) of the request's own prompt longer than the shortest,
   and router k reaches past the load band as far as it needs a member of
   its own, at most k requests: the best class alone often has one member on a busy fleet), but only
   while another decision was made within the window before this one: its own previous one, or
   a peer's dispatch heard through the exchange (:meth:`CacheAware.note_peer_dispatch`, the
   arrival time on this router's clock). The window is ``rank_window_prefills`` prefills of a
   typical request at the workers' measured rate, at most 1 s; the default (100) makes it the
   cap, so a router parts whenever the fleet is busy: a burst's first requests reach routers
   that were all quiet a moment before. A router alone after a second of quiet, and rank 0
   always, takes the best choice. ``"all"`` /
   ``"holders"`` also part equally loaded holders (which gained nothing), ``"off"`` never parts.

**Tiered caches** (SGLang HiCache, vLLM offloading; :mod:`mesh.index.tiers`): a matched token held
only in an engine's host memory counts ``tier_weights[1]`` (0.75) of a device hit, one only on
disk or a shared store ``tier_weights[2]`` (0.25), Dynamo's figures; the weighted hit is what the
affinity threshold and the cost model see. With ``calibrate`` and ``learn_tiers`` the weights are
learnt from the outcomes of picks that had lower-tier tokens
(:class:`mesh.routing.calibration.TierCostLearner`).

The predicted time to first token::

    ttft_ms(w) = theta . (1, prefill_ms, step_ms, kv_full)
    prefill_ms = 1000 * (Q_w + E_w) / rate_w        step_ms = chunks(Q_w + E_w) * step(w)

* ``E_w``: this request's uncached tokens on w (prompt minus its matched prefix);
* ``Q_w``: uncached prefill tokens queued on w: ``num_waiting_uncached_tokens`` of fresh LoadStat
  plus what this router (and, with the broker exchange, its peers) sent since that snapshot,
  drained at ``rate_w`` for the time since the snapshot (a fluid estimate); without fresh
  telemetry, the outstanding prefill tokens of this router and its peers (fail-open);
* ``rate_w``: w's measured prefill throughput (LoadStat counters, pooled over 2 s of busy time) or the configured default;
* ``step(w)``: the decode work sharing each prefill chunk's GPU step (base + per running request
  + KV read); ``chunks`` = ceil(tokens / chunk size);
* ``kv_full``: 1 when the request would not fit beside w's active KV (it would wait).

``theta`` starts at the fixed model (:class:`CostModel`: overhead, 1, 1, KV-full penalty) and is
learnt online from the first-reply times the router observes (:mod:`mesh.routing.calibration`:
recursive least squares with forgetting; the fit is used only while it predicts better than the
fixed model on the same outcomes). The score adds ``decode_harm_weight x running_w x
own_prefill_ms`` (while this prefill runs every request decoding on w stalls).

Why this shape (measured on the quality matrix, docs/routing.md): the per-request TTFT prediction is
myopic. As the primary criterion it sent requests away from prefix holders under load (the fleet
then recomputed shared prefixes and saturated: shared_prefix and zipf p95 2.6-100x greedy's). As a
tie-break it lost wherever its error was large, and even gated on a small running error (<= 10 %
or 15 %) its part-time decisions won and lost conversation cells by 5-19 %: noise, not a gain, on
the held-out seed as on the others. So the default never lets it decide; it is learnt, reported
(decision detail, ``mesh_cost_model`` metrics, the simulator's ``prediction``) and available
(``cost_ties``, ``affinity_threshold=0``). The shape is Preble's exploit/explore split (Srivatsa et
al., ICLR 2025: stick to a prefix holder when the match is long, balance load otherwise); step 1
does by a threshold what Dynamo's overlap-credit decay does continuously (a holder's overlap
credit shrinks as its active prefill load exceeds the least loaded worker's).

``affinity_threshold=0`` gives the pure cost policy: the worker is drawn from a softmax over
scores, ``p ~ exp(-(score - min) / T)`` with ``T = min(temperature_ms, temperature x min
score)`` (defaults 100 ms and 0.5); with both 0 it is the argmin, near-ties spread by a
per-request rendezvous hash (sampling against herding when routers share stale telemetry).
The candidate set is bounded: every worker when the pool is small, otherwise the ``top_k``
deepest matches plus ``sample_others`` random workers, so decision cost stays flat as the fleet
grows. Randomness comes from the seeded ``rng``, so runs are reproducible.
Reasons: ``cache_hit`` (chose the deepest match), ``load_override`` (a deeper match existed but
lost), ``stall_escape`` (the stall escape left the holder), ``cache_miss_min_load`` (no candidate
matched).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

from mesh.routing.calibration import CalibrationSettings, TierCostLearner, TtftCalibrator
from mesh.routing.view import Decision, WorkerState

try:  # xxhash is a dependency; zlib's crc32 is the fallback
    from xxhash import xxh64_intdigest as _xxh

    def hash_pair(a: str, b: str) -> int:
        return _xxh(f"{a}\x00{b}".encode())
except ImportError:  # pragma: no cover
    import zlib

    def hash_pair(a: str, b: str) -> int:
        return zlib.crc32(f"{a}\x00{b}".encode())

__all__ = ["CacheAwareGreedy", "CacheAware", "CostModel", "CollisionWindow", "part_ties", "RANK_WINDOW_PREFILLS", "RANK_REACH"]

#: ``rank_window_prefills``' default: near-ties are parted while another decision is younger than
#: this many prefills of a typical request, at most :data:`MAX_RANK_WINDOW_S`: with 100 the cap
#: decides, so a router parts while any decision was made within the last second (chosen on seeds
#: 1/3 of the 8B, 70B-class and fast engine matrices against 0.25, docs/routing.md)
RANK_WINDOW_PREFILLS = 100.0
#: before its first decision a router assumes a typical request of this many uncached tokens at
#: the reference rate (``CostModel.prefill_tokens_per_s``)
FALLBACK_PREFILL_TOKENS = 1024
#: the derived window never exceeds this (a stream of huge prompts cannot make a router part for long)
MAX_RANK_WINDOW_S = 1.0
#: the largest ``rank_window_prefills`` accepted
MAX_RANK_WINDOW_PREFILLS = 100.0
#: ``rank_reach``' default: a parted miss may take a worker whose prefill queue is at most this
#: share of the request's own prompt longer than the shortest. Swept on seeds 1/3, 4 routers over
#: one (p95): on the 70B-class engine's low_reuse 1.00x up to 0.05, 1.03x at 0.1, 1.20x at 0.5;
#: on the fast engine's trace 1.06x at 0, 1.01x at 0.02-0.03, 1.10x at 0.1 (docs/routing.md)
RANK_REACH = 0.03
#: the largest ``rank_reach`` accepted
MAX_RANK_REACH = 10.0
#: the typical prefill is a running mean over the first decisions, then an EWMA of this span
_TYPICAL_SPAN = 64


def part_ties(keyed: Sequence[tuple[tuple, float, str, Any]], rank: int):
    """The choice of router ``rank`` among ``(tie class, order, worker id, item)`` tuples: the
    items of the best tie class, ordered by (order, worker id), and of those the ``rank``-th
    (modulo their number). Rank 0 is the plain minimum. Routers sharing one view (the exchange)
    would otherwise all take the same worker for a burst that reaches them within milliseconds,
    before any of them hears of the others' choices; each takes a different one instead, and
    a lone router is unchanged."""
    if rank == 0 or len(keyed) < 2:
        return min(keyed, key=lambda k: k[:3])[3]
    best = min(k[0] for k in keyed)
    ties = sorted((k for k in keyed if k[0] == best), key=lambda k: k[:3])
    return ties[rank % len(ties)][3]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class CollisionWindow:
    """How long after a decision another one can still collide with it (the rank parting of
    :class:`CacheAware`): ``prefills`` prefill times of a typical request on this fleet, the
    typical request being a running mean (then an EWMA over ~64 decisions) of this router's
    chosen uncached prefills, each at its worker's measured prefill rate (the configured
    reference rate until one is measured), scaled by the calibrated TTFT model's prefill weight
    while its fit is used, and at most :data:`MAX_RANK_WINDOW_S`. Before the first decision: a
    :data:`FALLBACK_PREFILL_TOKENS`-token request at the reference rate. A slower engine (70B
    class) stretches the window, a faster one shrinks it; ``window_ms`` (> 0) overrides it with
    fixed wall-clock milliseconds. Pure: the caller passes every figure."""

    __slots__ = ("prefills", "fixed_s", "typical_ms", "_n")

    def __init__(self, prefills: float, window_ms: float | None, reference_rate: float) -> None:
        if not (_number(prefills) and math.isfinite(prefills) and 0 <= prefills <= MAX_RANK_WINDOW_PREFILLS):
            raise ValueError(f"rank_window_prefills must be a number in [0, {MAX_RANK_WINDOW_PREFILLS:g}], not {prefills!r}")
        if window_ms is not None and not (_number(window_ms) and window_ms >= 0 and not math.isnan(window_ms)):
            raise ValueError(f"rank_window_ms must be a number >= 0 (0 or None: derived from rank_window_prefills; "
                             f"inf: always part), not {window_ms!r}")
        self.prefills = float(prefills)
        self.fixed_s = window_ms / 1000.0 if window_ms else None
        self.typical_ms = 1000.0 * FALLBACK_PREFILL_TOKENS / reference_rate  # ms of one typical prefill
        self._n = 0

    def note(self, uncached_tokens: float, rate: float) -> None:
        """A decision sent ``uncached_tokens`` of prefill to a worker measured at ``rate`` tokens/s."""
        if rate > 0 and uncached_tokens >= 0:
            self._n = n = min(self._n + 1, _TYPICAL_SPAN)
            self.typical_ms += (1000.0 * uncached_tokens / rate - self.typical_ms) / n

    def seconds(self, scale: float = 1.0) -> float:
        """The window now; ``scale``: the calibrated model's weight on predicted prefill ms."""
        if self.fixed_s is not None:
            return self.fixed_s
        return min(MAX_RANK_WINDOW_S, self.prefills * scale * self.typical_ms / 1000.0)


def _rendezvous(request_id: str, worker_id: str) -> int:
    """Stable pseudo-random rank of a worker for one request (ties only)."""
    return hash_pair(request_id, worker_id)


class CacheAwareGreedy:
    """SGLang's threshold policy (see module docstring)."""

    name = "cache_aware_greedy"
    needs_match = True

    def __init__(self, rng: random.Random | None = None, freshness_s: float = 5.0, *, cache_threshold: float = 0.5,
                 balance_abs_threshold: float = 32, balance_rel_threshold: float = 1.1) -> None:
        self.rng = rng or random.Random()
        self.freshness_s = freshness_s
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def choose(self, req, candidates, match, now_s):
        if not candidates:
            return Decision(None, "no_candidates")
        loads = [(w.pressure(now_s, self.freshness_s), w.worker_id, w) for w in candidates]
        lo = min(loads)
        hi = max(loads)
        if hi[0] - lo[0] > self.balance_abs_threshold and hi[0] > lo[0] * self.balance_rel_threshold:
            return Decision(lo[2].worker_id, "imbalance_min_load")
        if match is not None:
            qb = max(1, getattr(match, "query_blocks", 0) or math.ceil(req.prompt_tokens / max(1, req.block_size)))
            hot = [(ld, wid, w, match.matched_blocks(wid)) for ld, wid, w in loads]
            hot = [t for t in hot if t[3] / qb > self.cache_threshold]
            if hot:
                ld, wid, w, blocks = min(hot, key=lambda t: (t[0], t[1]))
                return Decision(wid, "cache_hit", matched_blocks=blocks)
        return Decision(lo[2].worker_id, "cache_miss_min_load")


@dataclass(frozen=True, slots=True)
class CostModel:
    """Parameters of the TTFT prediction (defaults: 8B model on one H100, gpu-server-model.md)."""

    prefill_tokens_per_s: float = 25_000.0
    prefill_overhead_ms: float = 5.0
    chunk_tokens: int = 8192
    decode_base_ms: float = 7.0
    decode_per_req_ms: float = 0.02
    kv_read_ms_per_token: float = 131072 / 2.3e12 * 1000.0
    kv_full_penalty_ms: float = 2000.0


class CacheAware:
    """mesh's cost policy: lowest predicted TTFT (see module docstring)."""

    name = "cache_aware"
    needs_match = True

    def __init__(self, rng: random.Random | None = None, freshness_s: float = 5.0, *, cost: CostModel | None = None,
                 full_scan_max: int = 32, top_k: int = 8, sample_others: int = 8, temperature: float = 0.5,
                 decode_harm_weight: float = 1.0, tie_tolerance: float = 0.02, temperature_ms: float = 100.0,
                 affinity_threshold: float = 0.5, balance_abs_threshold: float = 32, balance_rel_threshold: float = 1.1,
                 load_slack: float = 1.0, calibrate: bool = True, calibration: CalibrationSettings | None = None,
                 cost_ties: str = "never", miss_queue_ms: float = 5.0, miss_load_band: int = 1,
                 imbalance_scope: str = "holder", miss_order: str = "sent", stall_escape_ms: float = 200.0,
                 stall_queue_ms: float = 1000.0, tier_weights: Sequence[float] = (1.0, 0.75, 0.25),
                 learn_tiers: bool = True, router_rank: int = 0, rank_ties: str = "misses",
                 rank_window_prefills: float = RANK_WINDOW_PREFILLS, rank_window_ms: float | None = None,
                 rank_reach: float = RANK_REACH) -> None:
        if cost_ties not in ("auto", "always", "never"):
            raise ValueError(f"cost_ties must be auto, always or never, not {cost_ties!r}")
        self.rng = rng or random.Random()
        self.freshness_s = freshness_s
        self.cost = cost or CostModel()
        self.full_scan_max = full_scan_max
        self.top_k = top_k
        self.sample_others = sample_others
        self.temperature = temperature
        self.decode_harm_weight = decode_harm_weight
        self.tie_tolerance = tie_tolerance
        self.temperature_ms = temperature_ms  # softmax scale in ms of score (wins over the relative one)
        self.affinity_threshold = affinity_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.load_slack = load_slack
        c = self.cost
        # the fixed model is the calibration's prior: (overhead, prefill x1, step x1, kv-full penalty)
        self.calibrator = TtftCalibrator((c.prefill_overhead_ms, 1.0, 1.0, c.kv_full_penalty_ms), calibration)
        self.calibrate = calibrate
        # never (default): greedy's order among equally loaded candidates; auto: the cost model
        # breaks those ties while the calibration trusts it; always: it always does
        self.cost_ties = cost_ties
        if not (math.isfinite(miss_queue_ms) and miss_queue_ms >= 0):
            raise ValueError(f"miss_queue_ms must be >= 0, not {miss_queue_ms!r}")
        if type(miss_load_band) is not int or miss_load_band < 0:
            raise ValueError(f"miss_load_band must be an int >= 0, not {miss_load_band!r}")
        # on a miss, prefill queues within this many ms of each other count as equal (0: greedy's
        # rule, the least loaded by requests)
        self.miss_queue_ms = miss_queue_ms
        self.miss_load_band = miss_load_band  # ... among workers within this many requests of the least loaded
        if imbalance_scope not in ("holder", "fleet"):
            raise ValueError(f"imbalance_scope must be holder or fleet, not {imbalance_scope!r}")
        # holder (default): the imbalance bound overrides affinity only where the holder itself is
        # the overloaded worker; fleet: SGLang's rule, any imbalance sends every request to the
        # least loaded worker
        self.imbalance_scope = imbalance_scope
        if miss_order not in ("sent", "id"):
            raise ValueError(f"miss_order must be sent or id, not {miss_order!r}")
        if not (math.isfinite(stall_escape_ms) and stall_escape_ms >= 0):
            raise ValueError(f"stall_escape_ms must be >= 0, not {stall_escape_ms!r}")
        if not (math.isfinite(stall_queue_ms) and stall_queue_ms >= 0):
            raise ValueError(f"stall_queue_ms must be >= 0, not {stall_queue_ms!r}")
        # a holder with at least stall_queue_ms of prefill queued, where this request would wait
        # more than stall_escape_ms longer than recomputing the whole prompt on the miss rule's
        # worker, is left (stall_escape_ms=0: never)
        self.stall_escape_ms = stall_escape_ms
        self.stall_queue_ms = stall_queue_ms
        # the last tie-break of the miss rule: sent (default), the worker the fleet's routers have
        # sent the least prefill work so far; id: the lowest worker id, as greedy
        self.miss_sent = miss_order == "sent"
        # a matched token held only on the host / a disk or shared store is worth this share of a
        # device hit (Dynamo's 0.75 / 0.25); with calibrate and learn_tiers, learnt from outcomes
        self.tier_learner = TierCostLearner(tier_weights)
        self.tier_weights = tuple(float(v) for v in tier_weights)
        self.learn_tiers = learn_tiers
        self._last_view: tuple[list, dict[str, float] | None] = ([], None)  # last_view()
        self.router_rank = 0
        # which exact ties are parted by router rank (misses, the default, holders or all: router k
        # takes the k-th of such a tie while decisions can collide; off: every router takes the
        # plain minimum, rank 0's choice)
        if rank_ties not in ("all", "holders", "misses", "off"):
            raise ValueError(f"rank_ties must be all, holders, misses or off, not {rank_ties!r}")
        self.rank_ties = rank_ties
        if not (_number(rank_reach) and 0 <= rank_reach <= MAX_RANK_REACH):
            raise ValueError(f"rank_reach must be a number in [0, {MAX_RANK_REACH:g}], not {rank_reach!r}")
        # a parted miss reaches workers whose prefill queue is at most this share of the request's
        # own prompt longer than the shortest
        self.rank_reach = float(rank_reach)
        # ties are parted only while decisions can collide: this router's previous decision, or
        # a peer's dispatch heard through the exchange (note_peer_dispatch), within the window
        # (CollisionWindow: rank_window_prefills typical prefills, or rank_window_ms when set)
        self.window = CollisionWindow(rank_window_prefills, rank_window_ms, self.cost.prefill_tokens_per_s)
        self._own_s = -math.inf  # this router's last decision
        self._parting = False  # whether the current decision parts near-ties (choose)
        self._peer_s = -math.inf  # the arrival of the last exchange message showing a peer's dispatch
        self.set_router_rank(router_rank)

    def set_router_rank(self, rank: int) -> None:
        """This router's rank among the routers sharing the fleet (0: the only one, or the first;
        the exchange's shell sets it from the sorted router ids, :func:`mesh.routing.peers.router_rank`).
        Near-ties of the choice are parted by it (see :func:`part_ties`)."""
        if type(rank) is not int or rank < 0:
            raise ValueError(f"router_rank must be an int >= 0, not {rank!r}")
        self.router_rank = rank
        # the rank each choice parts its ties by (0: the plain minimum)
        self._rank_hold = rank if self.rank_ties in ("all", "holders") else 0
        self._rank_miss = rank if self.rank_ties in ("all", "misses") else 0

    def note_peer_dispatch(self, now_s: float) -> None:
        """An exchange message that arrived at ``now_s`` (this router's clock) showed a peer's
        new dispatch: the peers are deciding now, so near-ties are parted for the window
        (see :meth:`_colliding`). Only the arrival time counts, never a time the peer claims:
        a peer can keep this router parting only while it keeps sending."""
        if math.isfinite(now_s) and now_s > self._peer_s:
            self._peer_s = now_s

    def _colliding(self, now_s: float) -> bool:
        """Whether this decision can collide with a peer's it has not heard of yet: another
        decision was made within the window (:attr:`rank_window_s`) before it (this router's previous one, or a
        peer's heard through the exchange). Routers then part near-ties by rank; a router alone
        in a quiet moment takes the best choice (rank 0's). Called once per decision: it also
        records this one."""
        own, self._own_s = self._own_s, max(self._own_s, now_s)
        w = self.rank_window_s
        # a second call at the same instant (a two-pass router) is the same decision
        return 0.0 < now_s - own <= w or 0.0 <= now_s - self._peer_s <= w

    @property
    def rank_window_s(self) -> float:
        """The window of :meth:`_colliding` now (:class:`CollisionWindow`: ``rank_window_prefills``
        typical prefills on this fleet, in the calibrated model's ms while its fit is used, or
        ``rank_window_ms``)."""
        cal = self.calibrator
        return self.window.seconds(max(0.0, cal.theta[1]) if self.calibrate and cal.use_fit else 1.0)

    def _ref_tokens(self, ms: float) -> float:
        """A threshold stated in ms of prefill on the reference engine (``cost.prefill_tokens_per_s``,
        the 8B/H100 figure) as the amount of prefill work it means: a worker measured at rate r
        applies it as ``ms x reference / r`` of its own milliseconds."""
        return ms * self.cost.prefill_tokens_per_s / 1000.0

    # -------------------------------------------------------------- candidate set
    def _candidates(self, candidates: Sequence[WorkerState], match, by_id: dict[str, WorkerState] | None
                    ) -> tuple[list[WorkerState], dict[str, int], bool]:
        """(candidates, matched blocks known from the ranking, whether that map is complete).

        One ``top()`` call ranks the matches deepest first; reading blocks from it avoids a
        per-worker lookup for every candidate."""
        n = len(candidates)
        if n <= self.full_scan_max:
            if match is None:
                return list(candidates), {}, True
            ids = {w.worker_id for w in candidates}
            top = match.top(n)
            known = {m.worker_id: m.blocks for m in top if m.worker_id in ids}
            # complete only when the ranking named no worker outside the candidates (tried,
            # drained, another bucket): else a candidate it crowded out is looked up, not read as 0
            return list(candidates), known, len(known) == len(top)
        chosen: dict[str, WorkerState] = {}
        known = {}
        if match is not None:
            if by_id is None:
                by_id = {w.worker_id: w for w in candidates}
            for m in match.top(self.top_k * 2):
                w = by_id.get(m.worker_id)
                if w is not None:
                    chosen[w.worker_id] = w
                    known[w.worker_id] = m.blocks
                    if len(chosen) >= self.top_k:
                        break
        for i in self.rng.sample(range(n), min(n, self.sample_others)):
            w = candidates[i]
            chosen.setdefault(w.worker_id, w)
        return list(chosen.values()), known, False

    def last_view(self) -> tuple[list, dict[str, float] | None]:
        """What the last :meth:`choose` saw, for the regret audit (:mod:`mesh.routing.regret`):
        its scored candidates ``(score, ttft, worker id, weighted hit tokens, WorkerState, x)``
        in the order it was given them, and their request pressure by worker id (None when
        that choice read no loads)."""
        return self._last_view

    # -------------------------------------------------------------- cost
    def predicted_ttft_ms(self, w: WorkerState, uncached: int, prompt_tokens: int, now_s: float) -> float:
        return self._cost(w, uncached, prompt_tokens, now_s)[0]

    def _cost(self, w: WorkerState, uncached: int, prompt_tokens: int, now_s: float
              ) -> tuple[float, float, tuple[float, float, float, float]]:
        """(predicted TTFT ms, score ms, features). The prediction is the calibrated one
        (``calibrate``; the fixed model until outcomes arrive). The score adds the harm this
        prefill does to the requests already decoding there: each of them stalls for the
        prefill's duration."""
        c = self.cost
        agg = w.fresh_load(now_s, self.freshness_s)
        rate = w.prefill_tokens_per_s or c.prefill_tokens_per_s
        queued = self._queued_tokens(w, agg, rate, now_s)
        if agg is not None:
            running = agg.running
            # num_total_tokens: KV held by running requests plus what waiting ones need (cached
            # but unreferenced pages are evictable, so num_tokens would overstate pressure)
            used = agg.total_tokens
            capacity = agg.max_tokens
        else:
            running = w.inflight + w.peer_inflight
            used = 0
            capacity = w.max_total_num_tokens
        work = queued + uncached
        chunks = max(1, math.ceil(work / c.chunk_tokens))
        step = (c.decode_base_ms + c.decode_per_req_ms * running + c.kv_read_ms_per_token * used) if running else 0.0
        own_ms = 1000.0 * uncached / rate
        # must wait for running requests to free KV
        x = (1.0, 1000.0 * work / rate, chunks * step, 1.0 if capacity and used + prompt_tokens > capacity else 0.0)
        cal = self.calibrator
        if self.calibrate:
            ttft = cal.best(x)
            if cal.use_fit:
                own_ms *= max(0.0, cal.theta[1])
        else:
            ttft = cal.predict_prior(x)
        if agg is None and w.distrusted(now_s):
            # Its LoadStat lied (it claimed fewer requests than this router has there): what it
            # has actually been delivering bounds the prediction from below.
            ttft = max(ttft, w.first_reply_ms)
        return ttft, ttft + self.decode_harm_weight * running * own_ms, x

    @staticmethod
    def _queued_tokens(w: WorkerState, agg, rate: float, now_s: float) -> float:
        """Uncached prefill tokens queued on w now. With fresh telemetry (``agg``): the fluid
        :meth:`WorkerState.queued_tokens` (the snapshot's queue, then every send of this router
        and its peers added at its time and drained at the worker's rate; without the drain every
        token sent in the last heartbeat period counted as still queued, which overstated a busy
        worker's queue several-fold). Without: the outstanding prefill tokens of this router and
        its peers (fail-open)."""
        if agg is None:
            return float(w.outstanding_prefill_tokens + w.peer_prefill_tokens)
        return w.queued_tokens(now_s, rate)

    def queued_tokens(self, w: WorkerState, now_s: float) -> float:
        """The uncached prefill tokens queued on w now (see :meth:`_queued_tokens`)."""
        rate = w.prefill_tokens_per_s or self.cost.prefill_tokens_per_s
        return self._queued_tokens(w, w.fresh_load(now_s, self.freshness_s), rate, now_s)

    def queued_prefill_ms(self, w: WorkerState, now_s: float) -> float:
        """The prefill queued on w now, in ms of its prefill rate (see :meth:`_queued_tokens`)."""
        rate = w.prefill_tokens_per_s or self.cost.prefill_tokens_per_s
        return 1000.0 * self.queued_tokens(w, now_s) / rate

    def observe(self, decision: Decision, ttft_ms: float) -> None:
        """The request routed by ``decision`` got its first reply ``ttft_ms`` after dispatch:
        teach the calibration (decisions this policy did not predict are ignored)."""
        x = decision.detail.get("cost_x")
        if x is not None:
            self.calibrator.observe(x, ttft_ms, decision.detail.get("predicted_ttft_ms"))
        tm = decision.detail.get("tier_ms")
        if tm is not None and self.learn_tiers and self.calibrate:
            self.tier_learner.observe(tm, decision.detail["tier_u"], ttft_ms, decision.detail.get("predicted_ttft_ms", 0.0))

    def route_tier_weights(self) -> tuple[float, float, float]:
        """The tier weights decisions use now: the learnt ones (``learn_tiers``, ``calibrate``)
        or the configured ones."""
        if self.calibrate and self.learn_tiers:
            return self.tier_learner.weights(self.tier_weights[0])
        return self.tier_weights

    @staticmethod
    def _tier_tokens(hit: int, host_blocks: int, store_blocks: int, bs: int) -> tuple[int, int]:
        """Host and store tokens of a ``hit``-token match (a hit is capped at the prompt minus
        one token: the cap comes off the lowest tier first)."""
        store = min(store_blocks * bs, hit)
        host = min(host_blocks * bs, hit - store)
        return host, store

    def _tier_detail(self, w: WorkerState, host_tok: int, store_tok: int, weights) -> dict:
        """Decision detail of a pick with lower-tier tokens: their recompute times in ms at the
        prediction's rate (``tier_ms``) and the costs it assumed (``tier_u``), for
        :meth:`observe`."""
        rate = w.prefill_tokens_per_s or self.cost.prefill_tokens_per_s
        cal = self.calibrator
        scale = max(0.0, cal.theta[1]) if self.calibrate and cal.use_fit else 1.0
        return {"tier_tokens": (host_tok, store_tok),
                "tier_ms": (scale * 1000.0 * host_tok / rate, scale * 1000.0 * store_tok / rate),
                "tier_u": (1.0 - weights[1], 1.0 - weights[2])}

    def _fits(self, w: WorkerState, prompt_tokens: int, now_s: float) -> bool:
        """False when w's fresh telemetry says the prompt would not fit beside its active KV."""
        agg = w.fresh_load(now_s, self.freshness_s)
        return agg is None or not agg.max_tokens or agg.total_tokens + prompt_tokens <= agg.max_tokens

    def choose(self, req, candidates, match, now_s, by_id: dict[str, WorkerState] | None = None):
        if not candidates:
            return Decision(None, "no_candidates")
        cands, known, complete = self._candidates(candidates, match, by_id)
        # near-ties are parted by router rank only while decisions can collide (see _colliding)
        self._parting = self._colliding(now_s) and self.router_rank > 0
        bs = req.block_size
        L = req.prompt_tokens
        scored = []
        best_hit = 0
        rid = req.request_id
        ct = self.cost_ties
        # without cost ties the banded choice reads loads and hits only: the prediction is made
        # for the chosen worker alone (decision detail, calibration), not for every candidate
        lazy = self.affinity_threshold > 0 and (ct == "never" or (ct == "auto" and not self.calibrator.trusted))
        # tiered caches (mesh.index.tiers): a hit held only on the host or a store counts its weight
        lower = getattr(match, "lower_tier_blocks", None) if match is not None else None
        tiered: dict[str, tuple[int, int, int]] = {}  # worker id -> (raw hit, host tokens, store tokens)
        weights = self.route_tier_weights() if lower is not None else self.tier_weights
        for w in cands:
            blocks = known.get(w.worker_id)
            if blocks is None:
                blocks = 0 if complete or match is None else match.matched_blocks(w.worker_id)
            hit = min(blocks * bs, max(0, L - 1))
            if lower is not None and hit:
                hb, sb = lower(w.worker_id)
                if hb or sb:
                    ht, st = self._tier_tokens(hit, hb, sb, bs)
                    tiered[w.worker_id] = (hit, ht, st)
                    hit = round(hit - (1.0 - weights[1]) * ht - (1.0 - weights[2]) * st)
            if hit > best_hit:
                best_hit = hit
            if lazy:
                scored.append((0.0, 0.0, w.worker_id, hit, w, None))
            else:
                ttft, score, x = self._cost(w, L - hit, L, now_s)
                scored.append((score, ttft, w.worker_id, hit, w, x))
        escaped = False
        self._last_view = (scored, None)
        if self.affinity_threshold > 0:
            pick, escaped = self._choose_banded(scored, L, now_s, rid)
        elif (self.temperature > 0 or self.temperature_ms > 0) and len(scored) > 1:
            pick = self._sample(scored)
        else:
            lo = min(t[0] for t in scored)
            # near-ties (idle workers, equal matches) are spread by a per-request rendezvous hash:
            # deterministic, yet it does not send every tie to the lowest worker id
            ties = [t for t in scored if t[0] <= lo * (1 + self.tie_tolerance) + 0.5]
            pick = ties[0] if len(ties) == 1 else min(ties, key=lambda t: (t[4].inflight, _rendezvous(rid, t[2])))
        score, cost_ms, wid, hit, w, x = pick
        if x is None:
            cost_ms, _, x = self._cost(w, L - hit, L, now_s)
        if best_hit == 0:
            reason = "cache_miss_min_load"
        elif escaped:
            reason = "stall_escape"
        elif hit >= best_hit:
            reason = "cache_hit"
        else:
            reason = "load_override"
        detail = {"predicted_ttft_ms": round(cost_ms, 3), "uncached_tokens": L - hit, "cost_x": x}
        self.window.note(L - hit, w.prefill_tokens_per_s or self.cost.prefill_tokens_per_s)
        t = tiered.get(wid)
        if t is not None:
            hit = t[0]  # matched_blocks reports what the worker holds; the weighting is in the detail
            detail.update(self._tier_detail(w, t[1], t[2], weights))
        return Decision(wid, reason, matched_blocks=hit // bs if bs else 0, detail=detail)

    def _choose_banded(self, scored, prompt_tokens: int, now_s: float, rid: str):
        """Load first, then cache, then cost (see the module docstring): the holders of at least
        ``affinity_threshold`` of the prompt whose KV can take it and that are not over SGLang's
        imbalance bound (``imbalance_scope="fleet"``: none while any worker is over it; with no
        holder left during an imbalance, the least loaded worker), then the least loaded of
        those (within ``load_slack`` requests), and among them the lowest score while the
        calibrated cost model is trusted (ties by in-flight count and a per-request rendezvous
        hash), otherwise the lowest worker id; on a miss the shortest prefill queue first (see
        the module docstring). Returns (pick, True when the stall escape left the holder)."""
        fr = self.freshness_s
        load = {t[2]: t[4].pressure(now_s, fr) for t in scored}
        self._last_view = (scored, load)
        lo_p, hi_p = min(load.values()), max(load.values())
        pool = scored
        miss = False
        ab, rb = self.balance_abs_threshold, self.balance_rel_threshold
        imbalanced = hi_p - lo_p > ab and hi_p > lo_p * rb
        if not imbalanced or self.imbalance_scope == "holder":
            # (a worker whose telemetry is distrusted, because it claimed less work than this
            # router alone has there, is no holder to stick to: its queue is unknown)
            hot = [t for t in scored if t[3] and t[3] >= self.affinity_threshold * prompt_tokens
                   and self._fits(t[4], prompt_tokens, now_s) and not t[4].distrusted(now_s)]
            if imbalanced:
                hot = [t for t in hot if not (load[t[2]] - lo_p > ab and load[t[2]] > lo_p * rb)]
            if hot:
                pool = hot
            elif not imbalanced:
                miss = self.miss_queue_ms > 0
        if scored[0][5] is None:  # no cost ties (see choose): greedy's order
            if miss:  # nobody holds enough (and no imbalance to correct): the shortest prefill queue
                return self._miss_pick(pool, load, lo_p, now_s, prompt_tokens), False
            pick = part_ties([((round(load[t[2]]),), 0, t[2], t) for t in pool], self._rank_hold if self._parting else 0)
            if self.stall_escape_ms > 0 and pool is not scored and self.miss_queue_ms > 0:
                alt = self._stall_escape(pick, scored, load, lo_p, prompt_tokens, now_s)
                return alt, alt is not pick
            return pick, False
        band = min(load[t[2]] for t in pool) + self.load_slack
        return min((t for t in pool if load[t[2]] <= band),
                   key=lambda t: (round(load[t[2]]), t[0], t[4].inflight, _rendezvous(rid, t[2]))), False

    def _miss_pick(self, pool, load, lo_p: float, now_s: float, prompt_tokens: int):
        """The miss rule: among the workers within ``miss_load_band`` requests of the least loaded,
        the shortest estimated prefill queue (classes of ``miss_queue_ms`` of reference prefill),
        then the least loaded, then the least sent; near-ties parted by router rank."""
        q_tok = self._ref_tokens(self.miss_queue_ms)
        rank = self._rank_miss if self._parting else 0
        # Parted, router k also reaches past the band, a request at a time, until the tie class
        # has more than k members, at most k requests: as if the k routers ranked before it had
        # each just placed one request of this burst on the least loaded workers, which is what
        # one router deciding them one by one would have seen. Without it the band often held one
        # or two workers (a decode more or less), every rank wrapped around onto the same idle
        # one, and a burst's misses queued behind each other; widening by k whatever the band
        # held sent zipf's misses to busier workers (held-out seed 2, 4 routers: mean TTFT +10 %).
        floor0 = round(lo_p) + self.miss_load_band
        sent = self.miss_sent
        queued = self.queued_tokens

        def key(t):
            q = queued(t[4], now_s)
            return ((int(q // q_tok), round(load[t[2]])), t[4].fleet_sent_tokens if sent else 0, t[2], t, q)

        keyed = [key(t) for t in pool if round(load[t[2]]) <= floor0]
        if not (rank and keyed):
            return part_ties([k[:4] for k in keyed], 0)
        # Parted, the tie class is every worker whose queue is at most ``rank_reach`` of this
        # request's own prompt longer than the shortest in the band, whatever its load, in the
        # rule's order: the shortest queue alone often has one or two members on a busy fleet,
        # so the ranks wrapped around onto the same idle worker and collided (a whole prefill's
        # wait) where one a few tokens behind was free. The reach is the price of parting: a
        # parted router takes that much more queue with certainty to avoid a collision that only
        # a decision within the exchange's delay can cause, so it is a small share of the
        # prefill a collision costs (docs/routing.md). Workers the widening adds come after the
        # band's, a request of load at a time, so every rank walks the same sequence and takes
        # its own member of it. Only a widening reads the queues of workers past the band.
        limit = min(k[4] for k in keyed) + self.rank_reach * prompt_tokens
        near = sum(1 for k in keyed if k[4] <= limit)
        if near <= rank:
            level = floor0
            for t in sorted((t for t in pool if floor0 < round(load[t[2]]) <= floor0 + rank),
                            key=lambda t: round(load[t[2]])):
                lv = round(load[t[2]])
                if lv > level and near > rank:
                    break  # a whole load level at a time, and only while the class is short
                level = lv
                k = key(t)
                keyed.append(k)
                near += k[4] <= limit
        return part_ties([((0,) if k[4] <= limit else k[0], (max(0, k[0][1] - floor0), k[0], k[1]), k[2], k[3])
                          for k in keyed], rank)

    def _stall_escape(self, pick, scored, load, lo_p: float, prompt_tokens: int, now_s: float):
        """Leave the holder ``pick`` when at least ``stall_queue_ms`` of prefill is queued on it
        and waiting there would take ``stall_escape_ms`` longer than recomputing the whole
        prompt on the worker the miss rule picks (a 100k-token prompt ahead of a follow-up
        blocks its holder for seconds). Relative on purpose: when every worker is as busy
        (saturation) nothing moves. The queue floor keeps short-prompt workloads on their
        holders: without it a 100 ms margin sent zipf's hits away from holders 150-300 ms deep
        and recomputed their 2k-token prefixes into an overloaded fleet (2.0x greedy's p95).
        Only on the holder's own fresh LoadStat: without one the queue estimate falls back to
        every unfinished request's prefill (decoding ones included), an upper bound, and on a fast
        engine several routers' escapes on it during their first heartbeat interval recomputed
        zipf's hot prefixes into a second queue (2.1x greedy's p95 at 4 routers)."""
        h = pick[4]
        agg = h.fresh_load(now_s, self.freshness_s)
        if agg is None:
            return pick  # no measured queue to leave it for (see the docstring)
        rate = h.prefill_tokens_per_s or self.cost.prefill_tokens_per_s
        queued_h = self._queued_tokens(h, agg, rate, now_s)
        if queued_h < self._ref_tokens(self.stall_queue_ms):
            return pick  # fast path: no holder queue that long
        wait_h = 1000.0 * (queued_h + prompt_tokens - pick[3]) / rate
        alt = self._miss_pick(scored, load, lo_p, now_s, prompt_tokens)
        if alt is pick:
            return pick
        a = alt[4]
        rate_a = a.prefill_tokens_per_s or self.cost.prefill_tokens_per_s
        wait_a = 1000.0 * (self.queued_tokens(a, now_s) + prompt_tokens - alt[3]) / rate_a
        # the margin in the holder's own ms: the reference margin scaled by its measured rate
        return alt if wait_h - wait_a > 1000.0 * self._ref_tokens(self.stall_escape_ms) / rate else pick

    def _sample(self, scored):
        lo = min(t[0] for t in scored)
        rel = max(lo, 1.0) * self.temperature if self.temperature > 0 else float("inf")
        scale = min(self.temperature_ms if self.temperature_ms > 0 else float("inf"), rel)
        weights = [math.exp(-(t[0] - lo) / scale) for t in scored]
        return self.rng.choices(scored, weights=weights, k=1)[0]
