"""The discrete-event simulator: R routers x W engine models in virtual time.

Each arm replays the same :class:`~mesh.lab.sim.workloads.Workload` through fresh objects:

* **Workers**: one :class:`~mesh.engine_model.EngineModel` each (the same model the simulated
  workers use). A worker with work runs back-to-back scheduler steps: at a step's start the
  runner calls ``engine.step(t)`` and schedules the step's end at ``t + duration``; at the end it
  records first tokens and completions and starts the next step. ``busy time`` is the sum of
  step durations.
* **Routers**: each simulated router is a real :class:`~mesh.routing.router.Router` (policy from
  :func:`~mesh.routing.router.make_policy`, provider from
  :func:`~mesh.routing.providers.make_provider`) with its own :class:`WorkerState` per worker.
  ``Router.route`` records the dispatch on the chosen state; the runner calls
  ``Router.release`` when the request's completion reaches that router. Routing takes zero
  virtual time.
* **Telemetry**: every worker's LoadStat reaches every router every ``heartbeat_ms``, each
  (router, worker) pair with its own seeded phase offset.
* **KV events**: a step's ``kv_events`` batch (epoch 1, seq 0, 1, ... per worker, dp rank 0; with
  ``dp_size`` > 1 one batch per rank that released events, each rank its own stream)
  reaches the providers ``event_delay_ms`` after the step ends: every router's own provider for
  ``radix_tree``; the shared index once for ``indexer`` (all routers query that one index);
  never for ``approx`` (it learns only from its own router's decisions).
* **Network**: ``net_ms`` one way: router -> worker on dispatch, worker -> router for the first
  token and the completion (so TTFT and E2E include it twice).
* **Exchange** (``exchange``, several routers): each router publishes its own per-worker figures
  with :class:`~mesh.routing.peers.PeerPublisher` (a change message for every change, or at
  most every ``exchange_interval_ms`` when set, a full snapshot every second) and every
  other router merges them with :class:`~mesh.routing.peers.PeerMerge` ``exchange_delay_ms``
  later: the broker's exchange, with the same core objects and a delay instead of sockets.
* **Arrivals**: request ``i`` reaches router ``i % R`` (``router_pick="round_robin"``) or a
  seeded random router (``"random"``) at its arrival time.

Policies that never read matches (``needs_match`` False: power_of_two, round_robin, random) run
without a provider: with ``dedupe_load_only`` (default) they form one arm per fleet shape with
``provider = "none"`` instead of one identical arm per provider. ``provider = "none"`` can also
be asked for explicitly (cache-aware policies then see no matches).

Metrics of an arm (all over the requests that completed; times in virtual ms):

* ``hit_rate``: sum of engine ``usage.cached_tokens`` / sum of prompt tokens.
* ``any_hit_rate``: share of requests with at least one cached token.
* ``oracle_hit_rate``: :func:`~mesh.lab.sim.workloads.oracle_cached_tokens` / prompt tokens, the
  infinite-cache longest-prefix ceiling of the stream at the routers' block size (same for every
  arm of one stream).
* ``worker_cv``: population std / mean of requests dispatched to each worker (workers that got
  none count as 0). ``busy_cv``: the same over each worker's busy time.
* ``utilisation``: mean over workers of busy time / ``sim_span_s``, where ``sim_span_s`` runs
  from the first arrival to the last completion.
* ``ttft_*_ms``: first token at the router (step end + ``net_ms``) minus arrival at the router;
  ``e2e_p95_ms``: completion at the router minus arrival; ``tpot_mean_ms``: the mean of
  (completion - first token) / (output tokens - 1) over requests with two or more. Percentiles: linear interpolation
  (:func:`~mesh.lab.sim.metrics.percentile`).
* ``throughput_rps``: completed requests / ``sim_span_s``; ``output_tps``: completion tokens /
  ``sim_span_s``.
* ``goodput``: share of requests with TTFT <= ``ttft_slo_ms``.
* ``decisions``: ``Decision.reason`` -> count; ``degraded_decisions``: decisions flagged
  degraded (provider had no answer).
* ``queue_mean``: mean ``num_waiting_reqs`` per engine, sampled at every heartbeat interval.
* ``regret``: cache_aware arms: the regret audit of every router's decisions
  (:func:`mesh.routing.regret.merged_pays`: per baseline the decisions audited, the mean predicted
  ms per request cache_aware saved against that baseline's pick from the same view, same picks;
  ``pays_ms`` with ``best``, against the better baseline); None for other policies.
* ``regret_truth``: cache_aware arms with ``SimConfig.regret_truth_every`` (``--regret-truth K``):
  every K-th audited decision whose baseline pick differed, replayed on copies of both engines
  (:mod:`mesh.lab.sim.regret_truth`: per baseline the prediction and the one-step truth, per
  request; not on a noise arm, ``policy@tag``); None otherwise.
* ``exchange``: whether the routers exchanged figures (``SimConfig.exchange`` and R > 1);
  ``exchange_messages`` / ``exchange_entries``: messages published and worker entries in them;
  ``exchange_applied``: worker-state updates the receiving routers applied.
* ``kv_event_batches``: batches delivered to providers (each router counted for radix_tree);
  ``kv_events_applied``: events the providers' indexes applied (methodology check: an
  event-fed arm with 0 here measured nothing); ``kv_resyncs``: batches a provider refused (a
  resync reason was returned; in-order delivery should give 0).

The core of an arm is :class:`Arm`; simulated routers are :class:`SimRouter` objects whose
``route(req, now_s)`` returns a Decision, so a bucket-aware router can replace them without
touching the event loop. These arms model routing only: no registration, liveness, retries,
parking or deadlines. Arms with faults, prefill/decode arms, and any arm with ``lifecycle =
"core"`` run the broker's own lifecycle core instead (:mod:`mesh.lab.sim.core_arm`): there is one P/D
and one retry path, the broker's. Nothing here reads the wall clock; the same config and seed
give identical results.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mesh.engine_dp import DpEngineModel, DpStepResult
from mesh.engine_model import EngineConfig, EngineModel
from mesh.errors import ConfigError
from mesh.hashing import content_keys
from mesh.index import PrefixIndex
from mesh.routing.bucket_router import DECODE_POLICIES
from mesh.routing.peers import PeerMerge, PeerPublisher, apply_changes, peer_dispatched, set_router_rank
from mesh.routing.regret import merged_pays
from mesh.routing.router import POLICIES, Router, make_policy
from mesh.routing.view import Decision, RouteRequest, WorkerState
from mesh.lab.sim.events import EventQueue
from mesh.lab.sim.fleet import PROVIDER_FEEDS, engine_step, make_router, policy_base, roles_and_labels, worker_ids
from mesh.lab.sim.metrics import batch_means, cv, mean, percentile, ratio, tpot_mean_ms
from mesh.lab.sim.recorded import is_decision_file, load_decisions
from mesh.lab.sim.regret_truth import OneStepTruth
from mesh.lab.sim.workloads import Workload, load_mooncake, make_workload, oracle_cached_tokens, seed_key

__all__ = ["SimConfig", "ArmSpec", "SimRouter", "Arm", "run_sim", "run_arm", "build_workload", "arm_specs"]

ROUTER_PICKS = ("round_robin", "random")

# event kinds
_ARRIVAL, _SUBMIT, _STEP_END, _DONE, _HEARTBEAT, _KV, _X_PUB, _X_RECV = range(8)


def check_regret_shadow_rate(rate: Any, name: str = "regret_shadow_rate") -> float | None:
    """``rate`` as the shadow counterfactual's share of the sessions: None (off) or a number in
    (0, 1]; ConfigError naming ``name`` otherwise (the one check of ``mesh sim --regret-shadow``,
    ``SimConfig.regret_shadow_rate`` and the matrix's ``sim.regret_shadow_rate``)."""
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (0.0 < rate <= 1.0):
        raise ConfigError(f"{name}: must be in (0, 1], not {str(rate)[:40]!r}")
    return float(rate)


def check_regret_truth_every(k: Any, name: str = "regret_truth_every") -> int:
    """``k`` as the one-step truth's sampling period: an integer >= 0 (0: off); ConfigError naming
    ``name`` otherwise (the one check of ``mesh sim --regret-truth``, ``SimConfig.regret_truth_every``
    and the matrix's ``sim.regret_truth_every``)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError(f"{name}: must be an integer >= 0, not {str(k)[:40]!r}")
    return k


@dataclass
class SimConfig:
    """Everything one ``mesh sim`` invocation needs. Lists make arms (their cross product)."""

    trace: str | None = None
    workload: str | None = None
    workload_params: dict[str, Any] = field(default_factory=dict)
    rate: float = 20.0
    duration_s: float | None = 60.0
    time_scale: float = 1.0
    max_requests: int | None = None
    seed: int = 0
    policies: list[str] = field(default_factory=lambda: ["power_of_two"])
    providers: list[str] = field(default_factory=lambda: ["radix_tree"])
    routers: list[int] = field(default_factory=lambda: [1])
    workers: list[int] = field(default_factory=lambda: [16])
    router_pick: str = "round_robin"
    heartbeat_ms: float = 500.0
    event_delay_ms: float = 10.0
    net_ms: float = 0.5
    load_freshness_s: float = 5.0
    ttft_slo_ms: float = 2000.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    policy_options: dict[str, Any] = field(default_factory=dict)
    # per policy (base name, no @TAG): constructor options of that policy only, over policy_options
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    provider_options: dict[str, Any] = field(default_factory=dict)
    dedupe_load_only: bool = True
    buckets: str | None = None  # bucket config (TOML/JSON): arms route through BucketRouter
    global_cache_winner: bool = True  # BucketRouter: an admitted global cache winner may leave its bucket
    decode_policy: str = "power_of_two"  # BucketRouter with pd: how the decode worker is picked
    pd: tuple[int, int] | None = None  # (prefill workers, decode workers): disaggregated arms
    long_pool_share: float = 0.25  # with buckets: share of (prefill/mixed) workers labelled pool=long
    exchange: bool = False  # routers exchange their in-flight figures (mesh.routing.peers)
    exchange_delay_ms: float = 2.0  # publish -> peers' merge (the broker's few-ms socket hop)
    exchange_interval_ms: float = 0.0  # at most one change message per router per interval (0: one per change)
    exchange_routes: bool = True  # the messages also carry the prompts each router routed (mesh.index.peer_routes), as brokers' do by default
    exchange_full_ms: float = 1000.0  # full snapshot period
    # "fast": routing-only arms (Router.route / release, no broker lifecycle); "core": every router
    # is the broker's own BrokerCore (mesh.lab.sim.core_arm). Faults and P/D arms always run the core.
    lifecycle: str = "fast"
    faults: str | None = None  # mesh.lab.sim.core_arm.parse_faults: "kill=2/min,pause=4/min,..."
    broker_options: dict[str, Any] = field(default_factory=dict)  # BrokerSettings fields for core arms
    # DP-attention ranks per worker (mesh.engine_dp.DpEngineModel: a KV cache, batch, event
    # stream and LoadStat per rank; the routers pick the rank, mesh.routing.ranks); fast arms only
    dp_size: int = 1
    # session affinity (mesh.routing.sessions), as the broker's --session-affinity: conversation turns
    # carry their session; off by default here so that arms compare policies alone
    session_affinity: str = "off"
    session_ttl_s: float = 600.0
    session_table_size: int = 100_000
    record_decisions: str | None = None  # core arms: router 0 records its decisions here (mesh.broker_core.recorder)
    # the regret audit's shadow counterfactual at this share of the sessions (mesh.routing.regret_shadow;
    # None: off, as in the broker); cache_aware arms report it as regret.shadow
    regret_shadow_rate: float | None = None
    # every k-th audited decision whose baseline pick differs is replayed on copies of both engines
    # (mesh.lab.sim.regret_truth; 0: off); cache_aware arms report it as regret_truth
    regret_truth_every: int = 0

    def validate(self, *, source: bool = True) -> None:
        """Raise ConfigError on a bad setting (``source``: also check trace/workload)."""
        if source and (self.trace is None) == (self.workload is None):
            raise ConfigError("give exactly one of trace or workload")
        for name in ("heartbeat_ms", "time_scale", "load_freshness_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")
        for name in ("event_delay_ms", "net_ms", "ttft_slo_ms", "exchange_delay_ms", "exchange_interval_ms"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0")
        if not self.exchange_full_ms > 0:
            raise ConfigError("exchange_full_ms must be > 0")
        check_regret_shadow_rate(self.regret_shadow_rate)
        check_regret_truth_every(self.regret_truth_every)
        if self.session_affinity not in ("off", "soft", "hard"):
            raise ConfigError(f"session_affinity must be off, soft or hard, not {self.session_affinity!r}")
        if not (math.isfinite(self.session_ttl_s) and self.session_ttl_s > 0):
            raise ConfigError("session_ttl_s must be > 0")
        if not (type(self.session_table_size) is int and self.session_table_size >= 1):
            raise ConfigError("session_table_size must be an integer >= 1")
        if self.router_pick not in ROUTER_PICKS:
            raise ConfigError(f"router_pick must be one of {', '.join(ROUTER_PICKS)}")
        if not self.policies or not self.providers or not self.routers or not self.workers:
            raise ConfigError("policies, providers, routers and workers must be non-empty")
        for p in self.policies:
            if policy_base(p)[0] not in POLICIES:
                raise ConfigError(f"unknown policy {p!r}; choose from {', '.join(sorted(POLICIES))} "
                                  "(NAME@TAG: the same policy with its workers named in another order)")
        for name, opts in self.policy_params.items():
            if name not in POLICIES:
                raise ConfigError(f"policy option {name}.*: unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}")
            try:
                make_policy(name, **self.options_for(name))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"policy option {name}.{','.join(sorted(opts))}: {exc}") from None
        for p in self.providers:
            if p not in PROVIDER_FEEDS:
                raise ConfigError(f"unknown provider {p!r}; choose from {', '.join(sorted(PROVIDER_FEEDS))}")
        for name in ("routers", "workers"):
            for v in getattr(self, name):
                if type(v) is not int or v < 1:
                    raise ConfigError(f"{name} must be positive ints, got {v!r}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ConfigError("max_requests must be >= 1")
        if self.pd is not None and (len(self.pd) != 2 or min(self.pd) < 1):
            raise ConfigError("pd must be two positive worker counts: PREFILL,DECODE")
        if self.decode_policy not in DECODE_POLICIES:
            raise ConfigError(f"decode_policy must be one of {', '.join(DECODE_POLICIES)}, got {self.decode_policy!r}")
        if type(self.dp_size) is not int or not 1 <= self.dp_size <= 64:
            raise ConfigError(f"dp_size must be an int in [1, 64], got {self.dp_size!r}")
        if self.dp_size > 1 and self.uses_core:
            raise ConfigError("dp_size: DP-attention ranks are modelled by lifecycle=fast arms only (no faults, no pd)")
        if self.lifecycle not in ("fast", "core"):
            raise ConfigError(f"lifecycle must be fast or core, got {self.lifecycle!r}")
        if self.faults is not None:
            from mesh.lab.sim.core_arm import parse_faults

            parse_faults(self.faults)  # ConfigError naming the item
        if self.uses_core and self.exchange and max(self.routers) > 1:
            raise ConfigError("exchange: the peer exchange is modelled by lifecycle=fast arms only (no faults, no pd)")
        if self.record_decisions is not None and not (self.uses_core and self.routers == [1] and len(arm_specs(self)) == 1):
            raise ConfigError("record_decisions: needs --lifecycle core and exactly one arm with one router")
        if self.broker_options:
            from mesh.config import BrokerSettings, build

            build(BrokerSettings, dict(self.broker_options))  # ConfigError naming the field
        if self.buckets is not None:
            from mesh.routing.buckets import load_bucket_config

            load_bucket_config(self.buckets)  # ConfigError naming the bucket and field

    def options_for(self, policy: str) -> dict[str, Any]:
        """Constructor options of ``policy`` (a base name): ``policy_options`` and its own."""
        return {**self.policy_options, **self.policy_params.get(policy, {})}

    @property
    def uses_core(self) -> bool:
        """Arms run the broker's BrokerCore (faults, P/D, or asked for)."""
        return self.lifecycle == "core" or self.faults is not None or self.pd is not None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "engine"}
        d["engine"] = asdict(self.engine)
        return d


@dataclass(frozen=True)
class ArmSpec:
    policy: str
    provider: str  # "none" for load-only policies when deduplicated
    routers: int
    workers: int


def arm_specs(cfg: SimConfig) -> list[ArmSpec]:
    """The arms of a config: workers x routers x policies x providers, in that nesting order."""
    out: list[ArmSpec] = []
    for w in cfg.workers:
        for r in cfg.routers:
            for pol in cfg.policies:
                load_only = not POLICIES[policy_base(pol)[0]].needs_match
                provs = ["none"] if load_only and cfg.dedupe_load_only else cfg.providers
                for prov in provs:
                    spec = ArmSpec(pol, prov, r, w)
                    if spec not in out:
                        out.append(spec)
    return out


def build_workload(cfg: SimConfig) -> Workload:
    if cfg.trace is not None and is_decision_file(cfg.trace):  # a broker's --record-decisions file
        wl = load_decisions(cfg.trace, time_scale=cfg.time_scale, max_requests=cfg.max_requests)
    elif cfg.trace is not None:
        wl = load_mooncake(cfg.trace, time_scale=cfg.time_scale, max_requests=cfg.max_requests)
    else:
        wl = make_workload(cfg.workload, seed=cfg.seed, rate=cfg.rate, duration_s=cfg.duration_s,
                           max_requests=cfg.max_requests, vocab_size=cfg.engine.vocab_size, **cfg.workload_params)
    wl.vocab_size = cfg.engine.vocab_size
    wl.drop_oversized(cfg.engine.max_total_num_tokens - cfg.engine.admission_reserve_tokens)
    if not wl.requests:
        raise ConfigError("the workload has no requests")
    return wl


# --------------------------------------------------------------------------- routers and workers


class SimRouter:
    """One simulated router: a real routing core plus its own view of every worker.

    ``router`` is anything with the :class:`Router` contract -- ``pool(states)``,
    ``route(req, pool, now_s)`` and ``release(state, decision)`` -- so
    :class:`mesh.routing.bucket_router.BucketRouter` slots in unchanged (P/D arms run the broker's
    core, :mod:`mesh.lab.sim.core_arm`).
    """

    __slots__ = ("index", "router", "states", "pool", "by_id", "publisher", "merge", "pub_at")

    def __init__(self, index: int, router: Router, states: list[WorkerState]) -> None:
        self.index = index
        self.router = router
        self.states = states  # by worker index
        self.pool = router.pool(states)
        self.by_id = {s.worker_id: s for s in states}
        self.publisher: PeerPublisher | None = None  # the exchange (SimConfig.exchange)
        self.merge: PeerMerge | None = None
        self.pub_at = float("inf")  # when its next publish event is scheduled

    def enable_exchange(self, interval_s: float, full_s: float, routes: bool = False) -> None:
        """Publish and merge peer figures as a broker with ``--exchange`` does (``routes``: and
        the prompts it routed, as a broker with ``--exchange-routes`` does)."""
        name = f"router-{self.index}"
        self.publisher = PeerPublisher(name, 1, interval_s, full_s)
        # no message is ever lost here, so no peer goes stale (the bound only has to exceed
        # the full-snapshot period)
        self.merge = PeerMerge(name, stale_s=max(3.0, 3 * full_s))
        for st in self.states:
            st.exchange_dirty = self.publisher.dirty
        set_router_rank(self.router, self.index)  # a distinct rank per router, as the broker takes its own
        sessions = getattr(self.router, "session_table", None)
        if sessions is not None:  # session pins travel as the broker's do
            sessions.listener = self.publisher.note_session
        prov = self.router.provider
        if routes and prov is not None and hasattr(prov, "add_peer_routes"):
            prov.route_listener = self.publisher.note_route  # its insert-on-route guesses, shared

    def route(self, req: RouteRequest, now_s: float) -> Decision:
        return self.router.route(req, self.pool, now_s)

    def release(self, worker_index: int, decision: Decision) -> None:
        self.router.release(self.states[worker_index], decision)


class _Worker:
    __slots__ = ("index", "wid", "engine", "stepping", "busy_s", "served", "kv_seq", "rank_seq", "ls", "steps", "free_s")

    def __init__(self, index: int, wid: str, engine: EngineModel | DpEngineModel) -> None:
        self.index = index
        self.wid = wid
        self.engine = engine
        self.stepping = False
        self.busy_s = 0.0
        self.served = 0
        self.kv_seq = 0  # KV batches released, every rank's
        self.rank_seq = [0] * (engine.dp_size if isinstance(engine, DpEngineModel) else 1)  # next seq per rank
        self.ls = None  # cached LoadStats (one per rank); None = engine changed since
        self.steps = 0
        self.free_s = 0.0  # when the step in flight ends (valid while stepping)


class _Track:
    """Per-request bookkeeping of one arm."""

    __slots__ = ("arrival", "router", "worker", "decision", "first", "done", "cached", "prompt", "completion")

    def __init__(self, arrival: float, router: int, worker: int, decision: Decision) -> None:
        self.arrival = arrival
        self.router = router
        self.worker = worker
        self.decision = decision
        self.first = -1.0
        self.done = -1.0
        self.cached = 0
        self.prompt = 0
        self.completion = 0


class Arm:
    """One arm: builds fresh routers and engines, runs the event loop, summarises."""

    def __init__(self, cfg: SimConfig, spec: ArmSpec, workload: Workload, oracle: tuple[int, int] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> None:
        if cfg.uses_core:
            raise ConfigError("faults and P/D arms run the broker's core: use run_arm (mesh.lab.sim.core_arm.CoreArm)")
        self.cfg = cfg
        self.spec = spec
        self.wl = workload
        self.oracle = oracle
        self.progress = progress
        ecfg = cfg.engine
        self.block_size = ecfg.page_size
        n_workers = spec.workers
        ids = worker_ids(n_workers, policy_base(spec.policy)[1])
        if workload.fleet and len(workload.fleet) == n_workers and "@" not in spec.policy:  # a recording's workers
            ids = [w for w, _ in workload.fleet]
        dp = cfg.dp_size
        self.workers = [_Worker(i, wid, EngineModel(ecfg) if dp == 1 else DpEngineModel(ecfg, dp)) for i, wid in enumerate(ids)]
        roles, labels = roles_and_labels(cfg, n_workers)
        self.wix = {wid: i for i, wid in enumerate(ids)}
        feed = PROVIDER_FEEDS.get(spec.provider, "none")
        self.feed = feed
        shared = None
        if spec.provider == "indexer":
            shared = PrefixIndex(cfg.provider_options.get("max_entries", 20_000_000), key_fn=content_keys)
        self.routers: list[SimRouter] = []
        for r in range(spec.routers):
            prov = None
            if spec.provider != "none":
                from mesh.routing.providers import make_provider

                prov = make_provider(spec.provider, block_size=self.block_size, shared_index=shared, **cfg.provider_options)
                for wid in ids:
                    prov.add_worker(wid, self.block_size)
            base = policy_base(spec.policy)[0]
            pol = make_policy(base, rng=random.Random(seed_key(0x5E1, cfg.seed, r)),
                              freshness_s=cfg.load_freshness_s, **cfg.options_for(base))
            states = [WorkerState(wid, role=roles[i], labels=dict(labels[i]), block_size=self.block_size,
                                  max_running_requests=ecfg.max_running_requests, max_total_num_tokens=ecfg.max_total_num_tokens,
                                  dp_size=dp)
                      for i, wid in enumerate(ids)]
            self.routers.append(SimRouter(r, make_router(cfg, pol, prov, r), states))
        self.exchange = bool(cfg.exchange) and len(self.routers) > 1
        if self.exchange:
            for sr in self.routers:
                sr.enable_exchange(cfg.exchange_interval_ms / 1e3, cfg.exchange_full_ms / 1e3, cfg.exchange_routes)
        # KV event targets: providers that get each batch.
        if feed == "local":
            self.kv_targets = [sr.router.provider for sr in self.routers]
        elif feed == "shared":
            self.kv_targets = [self.routers[0].router.provider]
        else:
            self.kv_targets = []
        self.uses_keys = spec.provider != "none"

    # ------------------------------------------------------------------ event loop
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        wl = self.wl
        reqs = wl.requests
        n = len(reqs)
        q = EventQueue()
        push, pop = q.push, q.pop
        workers = self.workers
        routers = self.routers
        n_routers = len(routers)
        bs = self.block_size
        net = cfg.net_ms / 1e3
        hb = cfg.heartbeat_ms / 1e3
        kv_delay = cfg.event_delay_ms / 1e3
        kv_targets = self.kv_targets
        uses_keys = self.uses_keys
        pick_rng = random.Random(seed_key(0x91C, cfg.seed)) if cfg.router_pick == "random" else None
        tracks: list[_Track | None] = [None] * n
        pending_prompts: dict[int, Any] = {}
        decisions: Counter[str] = Counter()
        degraded = 0
        unrouted = 0
        kv_batches = 0
        kv_resyncs = 0
        queue_samples = 0
        queue_sum = 0
        finished = 0
        t0 = reqs[0].arrival_s
        last_done = t0
        progress = self.progress
        prog_every = max(1, n // 200)
        exchange = self.exchange
        x_delay = cfg.exchange_delay_ms / 1e3
        x_msgs = x_entries = x_applied = 0
        # (not on a noise arm: the policy under another worker naming, policy@tag)
        truth = OneStepTruth(cfg.regret_truth_every) if cfg.regret_truth_every and "@" not in self.spec.policy else None

        def x_schedule(sr: SimRouter, t: float) -> None:
            """Make sure sr's next publish event is queued at its publisher's due time."""
            due = sr.publisher.next_due()  # type: ignore[union-attr]
            if due < t:
                due = t
            if due < sr.pub_at:
                sr.pub_at = due
                push(due, _X_PUB, sr.index, None)

        if exchange:
            for sr in routers:
                x_schedule(sr, t0)

        # heartbeats: per (router, worker) phase offsets from a seeded RNG
        hb_rng = random.Random(seed_key(0x4B, cfg.seed))
        for sr in routers:
            for w in workers:
                push(t0 + hb_rng.random() * hb, _HEARTBEAT, sr.index, w.index)
        push(reqs[0].arrival_s, _ARRIVAL, 0)

        def start_step(w: _Worker, t: float) -> None:
            res = engine_step(w.engine, w.wid, t)
            d = res.duration_s
            w.busy_s += d
            w.steps += 1
            w.free_s = t + d
            w.ls = None
            w.stepping = True
            push(t + d, _STEP_END, w, res)

        while q:
            t, _, kind, a, b = pop()
            if kind == _STEP_END:
                w = a
                res = b
                w.ls = None  # the step's finished requests now leave the running count
                for rid, cached, prompt in res.first_tokens:
                    tr = tracks[rid]
                    tr.first = t + net
                    # the router sees the first reply: its policy learns
                    routers[tr.router].router.observe(tr.decision, (t + net - tr.arrival) * 1e3)
                for rid, _reason, usage in res.finished:
                    tr = tracks[rid]
                    tr.cached = usage["cached_tokens"]
                    tr.prompt = usage["prompt_tokens"]
                    tr.completion = usage["completion_tokens"]
                    if tr.first < 0:  # max_new_tokens == 0: no token, done after prefill
                        tr.first = t + net
                    push(t + net, _DONE, rid)
                for rank, events in (res.rank_kv_events if type(res) is DpStepResult else ((0, res.kv_events),)):
                    if events and kv_targets:
                        push(t + kv_delay, _KV, w, (w.rank_seq[rank], events, rank))
                    if events:
                        w.rank_seq[rank] += 1
                        w.kv_seq += 1
                if w.engine.has_work():
                    start_step(w, t)
                else:
                    w.stepping = False
            elif kind == _HEARTBEAT:
                sr = routers[a]
                w = workers[b]
                ls = w.ls
                if ls is None:  # (cached until the engine's state or its step in flight changes)
                    eng = w.engine
                    ls = w.ls = tuple(eng.load_stats(t)) if type(eng) is DpEngineModel else (eng.load_stat(now_s=t),)
                sr.states[b].update_load(ls, t)
                if a == 0:
                    queue_samples += 1
                    queue_sum += sum(x.num_waiting_reqs for x in ls)
                push(t + hb, _HEARTBEAT, a, b)
            elif kind == _ARRIVAL:
                i = a
                r = reqs[i]
                if i + 1 < n:
                    push(reqs[i + 1].arrival_s, _ARRIVAL, i + 1)
                ri = pick_rng.randrange(n_routers) if pick_rng is not None else i % n_routers
                sr = routers[ri]
                toks = wl.prompt(r)
                rr = RouteRequest(str(i), r.prompt_len, r.output_len, bs, content_keys(toks, bs) if uses_keys else None,
                                  session=None if r.session is None else str(r.session))
                d = sr.route(rr, t)
                decisions[d.reason] += 1
                if d.dp_rank is not None:  # DP attention: why this rank (mesh.routing.ranks), as the broker counts it
                    decisions["dp_rank_" + d.detail["rank_reason"]] += 1
                if d.degraded:
                    degraded += 1
                if d.worker_id is None:
                    unrouted += 1
                    finished += 1
                    if finished >= n:
                        break
                    continue
                if exchange:
                    x_schedule(sr, t)
                wi = self.wix[d.worker_id]
                workers[wi].served += 1
                tr = tracks[i] = _Track(t, ri, wi, d)
                pending_prompts[i] = toks
                if truth is not None and "regret_audit" in d.detail:
                    cw = workers[wi]
                    truth.sample(d.detail, cw.engine, cw.free_s if cw.stepping else 0.0,
                                 {w.wid: (w.engine, w.free_s if w.stepping else 0.0) for w in workers},
                                 i, toks, r.output_len, t + net)
                push(t + net, _SUBMIT, i, wi)
            elif kind == _SUBMIT:
                w = workers[b]
                if type(w.engine) is DpEngineModel:
                    w.engine.submit(a, pending_prompts.pop(a), reqs[a].output_len, t, dp_rank=tracks[a].decision.dp_rank)
                else:
                    w.engine.submit(a, pending_prompts.pop(a), reqs[a].output_len, t,
                                    output_tokens=wl.output_tokens(reqs[a]) if reqs[a].output_script else None)
                w.ls = None
                if not w.stepping:
                    start_step(w, t)
            elif kind == _DONE:
                tr = tracks[a]
                tr.done = t
                routers[tr.router].release(tr.worker, tr.decision)
                if exchange:
                    x_schedule(routers[tr.router], t)
                finished += 1
                if t > last_done:
                    last_done = t
                if progress is not None and finished % prog_every == 0:
                    progress(finished, n)
                if finished >= n:
                    break
            elif kind == _X_PUB:
                sr = routers[a]
                if t != sr.pub_at:
                    continue  # superseded by an earlier publish event
                sr.pub_at = float("inf")
                msg = sr.publisher.build(t, sr.by_id.get, lambda sr=sr: sr.states)  # type: ignore[union-attr]
                if msg is not None:
                    x_msgs += 1
                    x_entries += len(msg.workers)
                    push(t + x_delay, _X_RECV, a, msg)
                x_schedule(sr, t + 1e-9)
            elif kind == _X_RECV:
                for sr in routers:
                    if sr.index != a:
                        outcome, changes = sr.merge.apply(b, t)  # type: ignore[union-attr]
                        x_applied += apply_changes(changes, sr.by_id.get, t)
                        if outcome == "applied" and peer_dispatched(changes):  # as the broker's exchange shell
                            set_router_rank(sr.router, sr.index, t)
                        if outcome == "applied" and b.sessions and hasattr(sr.router, "session_table"):
                            sr.router.session_table.apply_remote(b.broker, b.sessions, t)
                        if outcome == "applied" and b.routes and sr.router.provider is not None:
                            add = getattr(sr.router.provider, "add_peer_routes", None)
                            if add is not None:
                                add(b.routes, t, b.broker)
            elif kind == _KV:
                w = a
                seq, events, rank = b
                for prov in kv_targets:
                    kv_batches += 1
                    if prov.apply_events(w.wid, rank, 1, seq, events, t) is not None:
                        kv_resyncs += 1
        # Deliver the KV batches still in flight so provider state matches the engines at the end
        # (the metrics above do not depend on it; tests and reports of index state do).
        while q:
            t, _, kind, a, b = pop()
            if kind == _KV:
                for prov in kv_targets:
                    kv_batches += 1
                    if prov.apply_events(a.wid, b[2], 1, b[0], b[1], t) is not None:
                        kv_resyncs += 1
        if progress is not None:
            progress(n, n)

        # ------------------------------------------------------------------ summary
        self.tracks = tracks  # per-request records (arrival, router, worker, decision, times)
        done = [tr for tr in tracks if tr is not None and tr.done >= 0]
        span = max(last_done - t0, 1e-9)
        ttft = sorted((tr.first - tr.arrival) * 1e3 for tr in done)
        e2e = sorted((tr.done - tr.arrival) * 1e3 for tr in done)
        cached = sum(tr.cached for tr in done)
        prompt = sum(tr.prompt for tr in done)
        slo = cfg.ttft_slo_ms
        busy = [w.busy_s for w in workers]
        served = [w.served for w in workers]
        oracle = self.oracle
        spec = self.spec
        applied = 0
        for prov in kv_targets:
            st = getattr(prov, "stats", None)
            if st is not None:
                applied += int(st().get("events_applied", 0))
        return {
            "prediction": _prediction_error(done, cfg.net_ms, routers),
            "policy": spec.policy,
            "provider": spec.provider,
            "routers": spec.routers,
            "workers": spec.workers,
            "requests": n,
            "completed": len(done),
            "unrouted": unrouted,
            "rejected": unrouted,  # requests that got no_worker (the simulator never sheds: no overloaded)
            "hit_rate": _r(ratio(cached, prompt)),
            "any_hit_rate": _r(ratio(sum(1 for tr in done if tr.cached), len(done))),
            "oracle_hit_rate": _r(ratio(oracle[0], oracle[1])) if oracle else None,
            "worker_cv": _r(cv(served)),
            "busy_cv": _r(cv(busy)),
            "utilisation": _r(mean(busy) / span),
            "ttft_mean_ms": _r(mean(ttft), 3),
            # per contiguous batch of request indices (the matrix's regret check: a paired CI)
            "ttft_batch_means_ms": batch_means(((i, (tr.first - tr.arrival) * 1e3) for i, tr in enumerate(tracks)
                                                if tr is not None and tr.done >= 0), n),
            "ttft_p50_ms": _r(percentile(ttft, 50, presorted=True), 3),
            "ttft_p95_ms": _r(percentile(ttft, 95, presorted=True), 3),
            "ttft_p99_ms": _r(percentile(ttft, 99, presorted=True), 3),
            "e2e_p50_ms": _r(percentile(e2e, 50, presorted=True), 3),
            "e2e_p95_ms": _r(percentile(e2e, 95, presorted=True), 3),
            "tpot_mean_ms": tpot_mean_ms((tr.first, tr.done, tr.completion) for tr in done),
            "throughput_rps": _r(ratio(len(done), span)),
            "output_tps": _r(ratio(sum(tr.completion for tr in done), span), 3),
            "goodput": _r(ratio(sum(1 for x in ttft if x <= slo), len(done))),
            "decisions": dict(sorted(decisions.items())),
            "degraded_decisions": degraded,
            "queue_mean": _r(ratio(queue_sum, queue_samples)),
            "kv_event_batches": kv_batches,
            "kv_events_applied": applied,
            "kv_resyncs": kv_resyncs,
            "exchange": exchange,
            "exchange_messages": x_msgs,
            "exchange_entries": x_entries,
            "exchange_applied": x_applied,
            "sessions": _session_stats(routers),
            "regret": merged_pays([getattr(sr.router, "audit", None) for sr in routers]),
            "regret_truth": truth.snapshot() if truth is not None and truth.audited else None,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "sim_span_s": _r(span),
            "served_per_worker": served,
            "engine_steps": sum(w.steps for w in workers),
            "events": q.popped,
        }


def _session_stats(routers: Sequence[SimRouter]) -> dict[str, int]:
    """The session stage's counters summed over the routers (empty with session affinity off)."""
    total: Counter[str] = Counter()
    for sr in routers:
        table = getattr(sr.router, "session_table", None)
        if table is not None:
            total.update(table.stats)
    return dict(sorted(total.items()))


def _prediction_error(done: list[_Track], net_ms: float, routers: Sequence[SimRouter] = ()) -> dict[str, Any] | None:
    """How well the policy predicted TTFT: for every decision that carried a prediction
    (``detail["predicted_ttft_ms"]``, cache_aware's, calibrated online), the relative error
    against the engine-side TTFT that happened (the router's TTFT minus the two network legs);
    ``raw_*`` the same for the fixed-constant model (the calibration's prior) on the same
    decisions; ``calibration`` what router 0's calibration learnt. None for policies that
    predict nothing."""
    pairs = []
    raw = []
    cal = None
    for sr in routers[:1]:
        cal = getattr(sr.router.policy, "calibrator", None)
    for tr in done:
        d = tr.decision
        p = d.detail.get("predicted_ttft_ms") if d is not None else None
        if isinstance(p, (int, float)):
            a = max(0.0, (tr.first - tr.arrival) * 1e3 - 2 * net_ms)
            pairs.append((float(p), a))
            x = d.detail.get("cost_x")
            if cal is not None and x is not None:
                raw.append((cal.predict_prior(x), a))
    if not pairs:
        return None

    def stats(prefix: str, ps: list[tuple[float, float]]) -> dict[str, float]:
        errs = sorted(abs(p - a) / max(a, 1.0) for p, a in ps)
        ratios = sorted(a / max(p, 1e-3) for p, a in ps)
        return {f"{prefix}rel_err_p50": _r(percentile(errs, 50, presorted=True), 4),
                f"{prefix}rel_err_p90": _r(percentile(errs, 90, presorted=True), 4),
                f"{prefix}actual_over_predicted_p50": _r(percentile(ratios, 50, presorted=True), 4),
                f"{prefix}actual_over_predicted_p90": _r(percentile(ratios, 90, presorted=True), 4)}

    out: dict[str, Any] = {"decisions": len(pairs), **stats("", pairs)}
    if raw:
        out.update(stats("raw_", raw))
    if cal is not None:
        out["calibration"] = cal.snapshot()
    return out


def _r(x: float, nd: int = 6) -> float:
    return round(x, nd)


def run_arm(cfg: SimConfig, spec: ArmSpec, workload: Workload, oracle: tuple[int, int] | None = None,
            progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Run one arm on ``workload``: :class:`Arm`, or the broker's core (:class:`mesh.lab.sim.core_arm.CoreArm`)
    when ``cfg.uses_core``."""
    if cfg.uses_core:
        from mesh.lab.sim.core_arm import CoreArm, parse_faults

        faults = parse_faults(cfg.faults) if cfg.faults else None
        return CoreArm(cfg, spec, workload, oracle, progress, faults=faults).run()
    return Arm(cfg, spec, workload, oracle, progress).run()


def run_sim(
    cfg: SimConfig,
    *,
    workload: Workload | None = None,
    progress: Callable[[int, int, int, int], None] | None = None,
    on_arm: Callable[[int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every arm of ``cfg`` on one request stream; returns the report dict (JSON-ready).

    ``workload`` overrides the stream built from ``cfg`` (tests). ``progress(arm, arms, done,
    total)`` is called as requests complete; ``on_arm(i, result)`` after each arm. The result
    depends only on ``cfg`` (and ``workload``): no wall-clock time is read or reported.
    """
    cfg.validate(source=workload is None)
    wl = workload if workload is not None else build_workload(cfg)
    specs = arm_specs(cfg)
    oracle = oracle_cached_tokens(wl, cfg.engine.page_size)
    arms = []
    for i, spec in enumerate(specs):
        cb = None
        if progress is not None:
            cb = (lambda i: lambda done, total: progress(i, len(specs), done, total))(i)
        res = run_arm(cfg, spec, wl, oracle, cb)
        arms.append(res)
        if on_arm is not None:
            on_arm(i, res)
    return {
        "version": 1,
        "config": cfg.to_dict(),
        "workload": {"name": wl.name, "params": wl.params, **wl.stats()},
        "oracle_hit_rate": _r(ratio(*oracle)),
        "arms": arms,
    }
