"""Arms that run the broker's own lifecycle core (:class:`mesh.broker_core.BrokerCore`) in virtual time.

Every simulated router is a ``BrokerCore`` -- the code ``mesh broker`` runs -- fed decoded
messages with their virtual arrival times; its sends are delivered to simulated workers
(:class:`~mesh.engine_model.EngineModel`) ``net_ms`` later, and the workers' replies (READY,
heartbeats with LoadStat, first-token CHUNK, FINAL, KV batches) go back the same way. So
registration, liveness, dispatch, the attempt fence, retries and their budget, parking,
deadlines, outlier ejection and the prefill-to-decode handoff are the broker's, not a model of
them. A simulated worker's engine emits the answer the workload's later prompts hold
(``Workload.output_tokens``: a conversation's next turn contains it), so a follow-up hits the
pages of prompt + answer as it would on a real engine. Router 0 may record its decisions
(``record_decisions``: :mod:`mesh.broker_core.recorder`), and an arm replaying a recording reports
``decision_agreement`` (:func:`mesh.lab.sim.recorded.compare_decisions`). Used for fault injection (``mesh sim --faults``), for prefill/decode arms, and for any arm
with ``lifecycle = "core"``.

Faults (:class:`FaultSpec`, ``--faults kill=2/min,pause=4/min,...``), each a Poisson process
over the whole fleet while requests arrive, seeded (every arm of a run gets the same faults at
the same times, on the same workers):

* ``kill``: a worker process dies. Its engine state and cache are gone, its connections close
  (a broker's next send to it fails as unreachable, as ROUTER_MANDATORY reports it); it comes
  back ``down_s`` later with a new epoch and an empty cache and registers again.
* ``pause``: a worker stops for ``pause_s`` (SIGSTOP): no steps, no heartbeats; what it is sent
  waits; its late replies after a broker expired it are stale.
* ``broker_restart``: a router process restarts (``broker_down_s`` down): its in-flight requests
  are lost to their clients (counted ``lost``); workers re-register when their next heartbeat
  is refused.
* ``kv_loss``: the probability that a KV event batch is lost on the way (the index sees a gap and
  the broker asks the worker to resync, which it answers with a full snapshot).

Reported per arm (besides the usual metrics): ``requests_ok``, ``failed`` by error code,
``lost`` (no terminal reply: only a broker restart may cause it), ``duplicated`` (more than one
terminal reply for one request: must be 0), ``retried`` (finished on attempt > 1) and the TTFT of
retried vs first-attempt requests, the cores' worker events (expired, connection_lost, ejected,
registered) and retry causes, and the faults injected.
"""

from __future__ import annotations

import math
import random
import re
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from mesh import protocol as P
from mesh.broker_core import TO_WORKER, BrokerCore, Receipt, Send, deliver
from mesh.broker_core.recorder import ROTATE, DecisionRecorder
from mesh.config import BrokerSettings, build
from mesh.engine_model import EngineModel
from mesh.errors import ConfigError
from mesh.index import PrefixIndex
from mesh.hashing import content_keys
from mesh.routing.router import make_policy
from mesh.lab.sim.events import EventQueue
from mesh.lab.sim.fleet import PROVIDER_FEEDS, engine_step, make_router, policy_base, roles_and_labels, worker_ids
from mesh.lab.sim.metrics import batch_means, cv, mean, percentile, ratio, tpot_mean_ms
from mesh.lab.sim.workloads import seed_key

__all__ = ["FaultSpec", "CoreArm", "parse_faults"]

_ARRIVAL, _TO_W, _TO_R, _STEP_END, _HB, _TICK, _KV, _FAULT, _RESTART_W, _RESTART_B, _RESUME = range(11)
_DATA = P.pack({})  # the simulated workers' CHUNK / FINAL payload (a msgpack map, as the decoder demands)
_CLIENTS = 64  # client identities requests are spread over (the per-client quota is per identity)


@dataclass(frozen=True)
class FaultSpec:
    """Fault rates (events per minute over the whole fleet) and durations (seconds)."""

    kill_per_min: float = 0.0
    pause_per_min: float = 0.0
    broker_restart_per_min: float = 0.0
    kv_loss: float = 0.0  # probability per KV batch
    pause_s: float = 3.0
    down_s: float = 5.0
    broker_down_s: float = 2.0

    @property
    def any(self) -> bool:
        return bool(self.kill_per_min or self.pause_per_min or self.broker_restart_per_min or self.kv_loss)

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


_RATE_KEYS = {"kill": "kill_per_min", "pause": "pause_per_min", "broker_restart": "broker_restart_per_min"}
_DUR_KEYS = {"pause_s": "pause_s", "down_s": "down_s", "broker_down_s": "broker_down_s"}


def parse_faults(text: str) -> FaultSpec:
    """``kill=2/min,pause=4/min,pause_s=3,down_s=5,broker_restart=0.5/min,broker_down_s=2,kv_loss=0.01``.

    Rates take ``/s``, ``/min`` or ``/h`` (default ``/min``). Errors name the item."""
    vals: dict[str, float] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        k, sep, v = item.partition("=")
        k = k.strip()
        if not sep:
            raise ConfigError(f"faults: {item!r} is not KEY=VALUE")
        try:
            if k in _RATE_KEYS:
                m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(?:/\s*(s|min|h))?\s*", v)
                if not m:
                    raise ValueError
                per = {"s": 60.0, "min": 1.0, "h": 1 / 60.0, None: 1.0}[m.group(2)]
                vals[_RATE_KEYS[k]] = float(m.group(1)) * per
            elif k in _DUR_KEYS:
                vals[_DUR_KEYS[k]] = float(v.strip().removesuffix("s"))
            elif k == "kv_loss":
                vals["kv_loss"] = float(v)
            else:
                known = ", ".join([*_RATE_KEYS, *_DUR_KEYS, "kv_loss"])
                raise ConfigError(f"faults: unknown key {k!r}; known: {known}")
        except ValueError:
            raise ConfigError(f"faults.{k}: {v!r} is not a number") from None
    spec = FaultSpec(**vals)
    for name, v in spec.to_dict().items():
        if not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"faults.{name}: must be a finite number >= 0, got {v}")
    if spec.kv_loss > 1:
        raise ConfigError(f"faults.kv_loss: a probability, got {spec.kv_loss}")
    return spec


class _SimWorker:
    __slots__ = ("index", "wid", "engine", "epoch", "alive", "paused_until", "stepping", "gen", "busy_s", "served",
                 "kv_seq", "jobs", "ident", "role", "labels", "steps", "held")

    def __init__(self, index: int, wid: str, engine: EngineModel, role: str, labels: dict[str, str]) -> None:
        self.index = index
        self.wid = wid
        self.engine = engine
        self.role = role
        self.labels = labels
        self.epoch = 1
        self.alive = True
        self.paused_until = float("-inf")
        self.stepping = False
        self.gen = 0  # bumps on kill: events of a dead process are ignored
        self.busy_s = 0.0
        self.served = 0
        self.kv_seq = 0
        self.steps = 0
        self.jobs: dict[int, tuple[int, int, int, str, str]] = {}  # engine rid -> (router, rid, attempt, phase, client rid)
        self.ident: list[bytes] = []  # its connection identity per router
        self.held: list[tuple[int, Any]] = []  # deliveries that arrived while paused


class CoreArm:
    """One arm whose routers are BrokerCores (see the module docstring)."""

    def __init__(self, cfg, spec, workload, oracle=None, progress: Callable[[int, int], None] | None = None,
                 faults: FaultSpec | None = None) -> None:
        self.cfg, self.spec, self.wl, self.oracle, self.progress = cfg, spec, workload, oracle, progress
        self.faults = faults or FaultSpec()
        ecfg = cfg.engine
        self.block_size = ecfg.page_size
        n_workers = spec.workers if cfg.pd is None else sum(cfg.pd)
        self._policy, tag = policy_base(spec.policy)  # "NAME@TAG": the workers named in another order
        ids = worker_ids(n_workers, tag)
        if workload.fleet and len(workload.fleet) == n_workers and not tag:  # a recording: its workers, in its order
            ids = [w for w, _ in workload.fleet]
        roles, labels = roles_and_labels(cfg, n_workers)
        self.workers = [_SimWorker(i, wid, EngineModel(ecfg), roles[i], labels[i]) for i, wid in enumerate(ids)]
        self.feed = PROVIDER_FEEDS.get(spec.provider, "none")
        self._shared = None
        if spec.provider == "indexer":
            self._shared = PrefixIndex(cfg.provider_options.get("max_entries", 20_000_000), key_fn=content_keys)
        self._make_router = make_router
        self.settings = build(BrokerSettings, {
            "heartbeat_ms": max(1, int(cfg.heartbeat_ms)), "load_freshness_s": cfg.load_freshness_s,
            "default_deadline_ms": 600_000, "max_inflight": 1_000_000, "max_inflight_per_client": 1_000_000,
            "seed": cfg.seed, **getattr(cfg, "broker_options", {}),
        })
        self.record_path = getattr(cfg, "record_decisions", None)  # mesh sim --record-decisions: router 0's decisions
        self.recorder: DecisionRecorder | None = None
        self.cores: list[BrokerCore | None] = [self._new_core(r) for r in range(spec.routers)]
        self.chosen: list[tuple[str, str] | None] = [None] * len(workload.requests)  # first attempt's (worker, reason)
        self.stats_sum: Counter[str] = Counter()  # counters of cores that were replaced (broker restarts)
        self.lost_ids: set[int] = set()  # requests a restarted broker held: no terminal reply will come

    def _new_core(self, r: int) -> BrokerCore:
        from mesh.routing.providers import make_provider
        cfg, spec = self.cfg, self.spec
        prov = None
        if spec.provider != "none":
            prov = make_provider(spec.provider, block_size=self.block_size, shared_index=self._shared, **cfg.provider_options)
        pol = make_policy(self._policy, rng=random.Random(seed_key(0x5E1, cfg.seed, r)), freshness_s=cfg.load_freshness_s,
                          **cfg.options_for(self._policy))
        router = self._make_router(cfg, pol, prov, r)
        rec = None
        if self.record_path and r == 0 and self.recorder is None:
            rec = self.recorder = DecisionRecorder(
                broker_id="router-0", policy=self._policy, origin_s=0.0, block_size=lambda: self.block_size,
                max_bytes=1 << 62, max_ids=1 << 62,  # one file, one id space: the simulator's memory is its own
                fleet=lambda: [(s.worker_id, s.ready.role) for s in self.cores[0].pool.by_id.values()])
        core = BrokerCore(self.settings, router, broker_id=f"router-{r}", kv_sink=prov, perf=lambda: 0.0,
                          log=_QuietLog(), recorder=rec)
        return core

    # ------------------------------------------------------------------ event loop
    def run(self) -> dict[str, Any]:  # noqa: C901 - one event loop, one place
        cfg, wl, fs = self.cfg, self.wl, self.faults
        reqs = wl.requests
        n = len(reqs)
        q = EventQueue(start_s=reqs[0].arrival_s - 4 * (cfg.heartbeat_ms / 1e3 + cfg.net_ms / 1e3))
        push, pop = q.push, q.pop
        workers, cores = self.workers, self.cores
        n_routers = len(cores)
        net = cfg.net_ms / 1e3
        hb = cfg.heartbeat_ms / 1e3
        kv_delay = cfg.event_delay_ms / 1e3
        ecfg = cfg.engine
        frng = random.Random(seed_key(0xFA17, cfg.seed))  # fault times and victims: the same in every arm
        kvrng = random.Random(seed_key(0xFA18, cfg.seed))  # lost KV batches (draws depend on the arm's steps)
        t0 = reqs[0].arrival_s
        t_last = reqs[-1].arrival_s
        arrival = [0.0] * n
        first = [-1.0] * n
        done_at = [-1.0] * n
        terminals = [0] * n
        attempt_of = [0] * n
        cached = [0] * n
        prompt = [0] * n
        completion = [0] * n
        code_of: list[str] = [""] * n
        router_of = [0] * n
        prompts: dict[int, list[int]] = {}
        tick_at = [float("inf")] * n_routers
        down_until = [float("-inf")] * n_routers
        injected: Counter[str] = Counter()
        counted_terminal = 0
        kv_batches = kv_resyncs = kv_lost = 0
        erid_seq = 0
        progress = self.progress
        prog_every = max(1, n // 200)
        by_ident: list[dict[bytes, int]] = [dict() for _ in range(n_routers)]
        chosen = self.chosen
        rec_fh = open(self.record_path, "wb") if self.recorder is not None else None  # noqa: SIM115 - closed below

        def write_record(lines: list[bytes | None]) -> None:
            rec_fh.writelines(x for x in lines if x is not ROTATE)  # one file: the sim never rotates
            lines.clear()

        def ident_of(w: _SimWorker, r: int) -> bytes:
            return f"{w.wid}/{w.epoch}/r{r}".encode()

        def ready_of(w: _SimWorker) -> P.Ready:
            return P.Ready(w.wid, "sim", w.role, dict(w.labels), self.block_size, ecfg.max_running_requests,
                           ecfg.max_total_num_tokens, 1, w.epoch, int(cfg.heartbeat_ms))

        def schedule_tick(r: int, t: float) -> None:
            core = cores[r]
            if core is None:
                return
            wake = core.wakeup_s()
            if wake < t:
                wake = t
            if wake < tick_at[r]:
                tick_at[r] = wake
                push(wake, _TICK, r, None)

        def flush(r: int, t: float) -> None:
            """Deliver what core r asked for; failed sends go back to it (ROUTER_MANDATORY)."""
            core = cores[r]

            def send(s: Send) -> str | None:
                nonlocal counted_terminal
                if s.to == TO_WORKER:
                    wi = by_ident[r].get(s.identity)
                    w = workers[wi] if wi is not None else None
                    if w is None or not w.alive or w.ident[r] != s.identity:
                        return "unreachable"
                    cmd = s.frames[1][0]
                    if cmd == P.Cmd.HEARTBEAT:
                        return None  # a worker only needs to know the broker is there
                    if s.receipt in (Receipt.DISPATCH, Receipt.DECODE):
                        inf = s.ref
                        payload = ("req", inf.rid, s.attempt, inf.phase, inf.client_rid)
                    else:
                        payload = ("msg", P.decode_broker_to_worker(s.frames))
                    push(t + net, _TO_W, w, (r, w.gen, payload))
                else:
                    m = P.decode_client_reply(s.frames)
                    t_m = type(m)
                    if t_m is P.Accepted:
                        if m.attempt == 1 and chosen[int(m.rid)] is None:
                            chosen[int(m.rid)] = (m.worker, m.reason)
                        return None
                    i_req = int(m.rid)
                    if t_m is P.ClientChunk:
                        if first[i_req] < 0:
                            first[i_req] = t
                        return None
                    terminals[i_req] += 1
                    if terminals[i_req] == 1:
                        counted_terminal += 1
                        done_at[i_req] = t
                        if t_m is P.ClientFinal:
                            code_of[i_req] = "ok"
                            attempt_of[i_req] = m.attempt
                            u = m.usage
                            cached[i_req] = int(u.get("cached_tokens", 0))
                            prompt[i_req] = int(u.get("prompt_tokens", 0))
                            completion[i_req] = int(u.get("completion_tokens", 0))
                            if first[i_req] < 0:
                                first[i_req] = t
                        else:
                            code_of[i_req] = m.code
                return None
            deliver(core, send, lambda: t)
            if core.recorder is not None and core.recorder.out:
                write_record(core.recorder.out)
            schedule_tick(r, t)

        def to_router(r: int, w: _SimWorker, msg: Any, t: float) -> None:
            push(t + net, _TO_R, r, (w.ident[r], msg))

        def register(w: _SimWorker, t: float, r: int | None = None) -> None:
            for rr in range(n_routers) if r is None else (r,):
                to_router(rr, w, ready_of(w), t)

        def start_step(w: _SimWorker, t: float) -> None:
            res = engine_step(w.engine, w.wid, t)
            d = res.duration_s
            w.busy_s += d
            w.steps += 1
            w.stepping = True
            push(t + d, _STEP_END, w, (w.gen, res))

        def deliver_to_worker(w: _SimWorker, r: int, payload: tuple, t: float) -> None:
            nonlocal erid_seq, kv_resyncs
            if payload[0] == "req":
                _, rid, attempt, phase, client_rid = payload
                i_req = int(client_rid)
                erid_seq += 1
                w.jobs[erid_seq] = (r, rid, attempt, phase, client_rid)
                w.served += 1
                toks = prompts[i_req]
                if phase == "prefill":
                    w.engine.submit(erid_seq, toks, 1, t)
                else:  # it answers what the workload's later prompts hold (wl.output_tokens)
                    w.engine.submit(erid_seq, toks, reqs[i_req].output_len, t, transferred=phase == "decode",
                                    output_tokens=wl.output_tokens(reqs[i_req]))
                if not w.stepping:
                    start_step(w, t)
                return
            m = payload[1]
            tm = type(m)
            if tm is P.WorkerCancel:
                for erid, job in list(w.jobs.items()):
                    if job[0] == r and job[1] == m.rid and job[2] == m.attempt:
                        w.engine.cancel(erid)
                        del w.jobs[erid]
            elif tm is P.Disconnect:
                # expired, not registered (a restarted broker), refused: register again, as a worker link does
                to_router(r, w, ready_of(w), t)
            elif tm is P.Resync:
                kv_resyncs += 1
                send_kv(w, w.engine.snapshot_events(), t)

        def send_kv(w: _SimWorker, events, t: float) -> None:
            nonlocal kv_lost
            seq = w.kv_seq
            w.kv_seq += 1
            if fs.kv_loss and kvrng.random() < fs.kv_loss:
                kv_lost += 1
                return
            push(t + kv_delay, _KV, w, (w.gen, w.epoch, seq, events))

        def kill(w: _SimWorker, t: float) -> None:
            w.alive = False
            w.gen += 1
            w.jobs.clear()
            w.stepping = False
            w.held.clear()
            push(t + fs.down_s, _RESTART_W, w, None)

        # Registration: every worker connects to every router before the first request arrives
        # (each is confirmed by its first heartbeat, at most one interval after its READY).
        t_reg = t0 - 2 * (hb + net)
        for r in range(n_routers):
            cores[r].start(t_reg)
        for w in workers:
            w.ident = [ident_of(w, r) for r in range(n_routers)]
            for r in range(n_routers):
                by_ident[r][w.ident[r]] = w.index
            register(w, t_reg)
        hb_rng = random.Random(seed_key(0x4B, cfg.seed))
        for r in range(n_routers):
            for w in workers:
                push(t_reg + net + hb_rng.random() * hb, _HB, r, w)  # after READY: the first heartbeat confirms
        push(reqs[0].arrival_s, _ARRIVAL, 0)
        rates = (("kill", fs.kill_per_min), ("pause", fs.pause_per_min), ("broker_restart", fs.broker_restart_per_min))
        for kind, per_min in rates:
            if per_min > 0:
                push(t0 + frng.expovariate(per_min / 60.0), _FAULT, kind, None)
        arrivals_done = False
        reported = -1

        while q:
            t, _, kind, a, b = pop()
            if arrivals_done and counted_terminal + len(self.lost_ids) >= n:
                break
            if kind == _TO_R:
                r = a
                core = cores[r]
                if core is None or t < down_until[r]:
                    continue  # the broker is down: the connection drops what was on its way
                ident, msg = b
                core.worker_message(ident, msg, t)
                flush(r, t)
            elif kind == _TO_W:
                w = a
                r, gen, payload = b
                if gen != w.gen or not w.alive:
                    continue
                if t < w.paused_until:
                    w.held.append((r, payload))
                    continue
                deliver_to_worker(w, r, payload, t)
            elif kind == _STEP_END:
                w = a
                gen, res = b
                if gen != w.gen:
                    continue
                if t < w.paused_until:  # stopped mid-step: the step ends when it resumes
                    push(w.paused_until, _STEP_END, w, b)
                    continue
                for erid, _cached, _prompt in res.first_tokens:
                    job = w.jobs.get(erid)
                    if job is not None and job[3] != "prefill":
                        to_router(job[0], w, P.WorkerChunk(job[1], job[2], 0, _DATA), t)
                for erid, reason, usage in res.finished:
                    job = w.jobs.pop(erid, None)
                    if job is None:
                        continue
                    fin = "prefill_done" if job[3] == "prefill" else reason
                    to_router(job[0], w, P.WorkerFinal(job[1], job[2], fin, dict(usage), _DATA), t)
                if res.kv_events:
                    if self.feed != "none":
                        send_kv(w, res.kv_events, t)
                    else:
                        w.kv_seq += 1
                if w.engine.has_work():
                    start_step(w, t)
                else:
                    w.stepping = False
            elif kind == _HB:
                r, w = a, b
                push(t + hb, _HB, r, w)
                if not w.alive or t < w.paused_until:
                    continue
                to_router(r, w, P.Heartbeat([w.engine.load_stat(now_s=t)]), t)
            elif kind == _TICK:
                r = a
                if t != tick_at[r]:
                    continue
                tick_at[r] = float("inf")
                if cores[r] is None:
                    continue
                cores[r].tick(t, True)
                flush(r, t)
            elif kind == _ARRIVAL:
                i = a
                rq = reqs[i]
                if i + 1 < n:
                    push(reqs[i + 1].arrival_s, _ARRIVAL, i + 1)
                else:
                    arrivals_done = True
                r = i % n_routers
                arrival[i] = t
                router_of[i] = r
                toks = wl.prompt(rq)
                prompts[i] = toks
                core = cores[r]
                if core is None or t < down_until[r]:
                    code_of[i] = "unavailable"  # the client could not connect: refused at once
                    terminals[i] += 1
                    counted_terminal += 1
                    done_at[i] = t
                    continue
                sub = P.Submit(str(i), toks, None, rq.max_tokens or rq.output_len, {}, None, True, True, None, None, b"", array("I", toks))
                core.submit(b"c%d" % (i % _CLIENTS), sub, t)
                flush(r, t)
            elif kind == _KV:
                w = a
                gen, epoch, seq, events = b
                if gen != w.gen:
                    continue
                for r in range(n_routers) if self.feed == "local" else (0,):
                    core = cores[r]
                    if core is None or core.kv_sink is None or t < down_until[r]:
                        continue
                    kv_batches += 1
                    why = core.kv_sink.apply_events(w.wid, 0, epoch, seq, events, t)
                    if why is not None:
                        core.resync(w.wid, 0, why, t)  # the broker asks the worker for its full state
                        flush(r, t)
            elif kind == _FAULT:
                if t > t_last:
                    continue  # faults strike while requests arrive (the same faults for every arm)
                per_min = dict(rates)[a]
                push(t + frng.expovariate(per_min / 60.0), _FAULT, a, None)
                if a == "broker_restart":
                    r = frng.randrange(n_routers)
                    if cores[r] is None:
                        continue
                    injected["broker_restart"] += 1
                    self._retire(r)
                    cores[r] = None
                    down_until[r] = t + fs.broker_down_s
                    tick_at[r] = float("inf")
                    push(t + fs.broker_down_s, _RESTART_B, r, None)
                    continue
                live = [w for w in workers if w.alive and t >= w.paused_until]
                if not live:
                    continue
                w = live[frng.randrange(len(live))]
                injected[a] += 1
                if a == "kill":
                    kill(w, t)
                else:
                    w.paused_until = t + fs.pause_s
                    push(w.paused_until, _RESUME, w, None)
            elif kind == _RESUME:
                w = a
                if t < w.paused_until or not w.alive:
                    continue
                held, w.held = w.held, []
                for r, payload in held:
                    deliver_to_worker(w, r, payload, t)
                if w.engine.has_work() and not w.stepping:
                    start_step(w, t)
            elif kind == _RESTART_W:
                w = a
                w.alive = True
                w.paused_until = float("-inf")
                w.epoch += 1
                w.engine = EngineModel(ecfg)
                w.kv_seq = 0
                w.ident = [ident_of(w, r) for r in range(n_routers)]
                for r in range(n_routers):
                    by_ident[r][w.ident[r]] = w.index
                register(w, t)
            elif kind == _RESTART_B:
                r = a
                core = cores[r] = self._new_core(r)
                core.start(t)
                by_ident[r] = {w.ident[r]: w.index for w in workers}
                # the workers' next heartbeat is refused (not registered): they send READY again
            if progress is not None and counted_terminal != reported and counted_terminal % prog_every == 0:
                reported = counted_terminal
                progress(counted_terminal, n)
        if progress is not None:
            progress(n, n)
        if rec_fh is not None:
            rec_fh.close()
        return self._summary(locals())

    def _retire(self, r: int) -> None:
        """A router process dies: keep its counters; its in-flight requests are lost to their clients."""
        core = self.cores[r]
        for k, v in core.stats.flat().items():
            self.stats_sum[k] += v
        self.lost_ids.update(int(inf.client_rid) for inf in core.inflight.values())

    def _summary(self, L: dict[str, Any]) -> dict[str, Any]:
        cfg, spec, n = self.cfg, self.spec, L["n"]
        arrival, first, done_at, terminals = L["arrival"], L["first"], L["done_at"], L["terminals"]
        code_of, attempt_of = L["code_of"], L["attempt_of"]
        stats: Counter[str] = Counter(self.stats_sum)
        for core in self.cores:
            if core is not None:
                for k, v in core.stats.flat().items():
                    stats[k] += v
        ok = [i for i in range(n) if code_of[i] == "ok"]
        lost = [i for i in range(n) if terminals[i] == 0]
        ttft = sorted((first[i] - arrival[i]) * 1e3 for i in ok)
        # a P/D request's decode leg is its second attempt: only attempts beyond its legs are retries
        legs = 2 if cfg.pd is not None else 1
        ttft_retried = sorted((first[i] - arrival[i]) * 1e3 for i in ok if attempt_of[i] > legs)
        ttft_clean = sorted((first[i] - arrival[i]) * 1e3 for i in ok if attempt_of[i] <= legs)
        e2e = sorted((done_at[i] - arrival[i]) * 1e3 for i in ok)
        failed = Counter(code_of[i] for i in range(n) if terminals[i] and code_of[i] != "ok")
        t0 = self.wl.requests[0].arrival_s
        span = max((max((done_at[i] for i in ok), default=t0) - t0), 1e-9)
        served = [w.served for w in self.workers]
        busy = [w.busy_s for w in self.workers]
        cached, prompt, completion = sum(L["cached"][i] for i in ok), sum(L["prompt"][i] for i in ok), sum(L["completion"][i] for i in ok)
        slo = cfg.ttft_slo_ms
        oracle = self.oracle

        decisions = {k.removeprefix("decisions."): v for k, v in sorted(stats.items()) if k.startswith("decisions.")}
        agreement = None
        if self.wl.recorded is not None:  # a replayed recording: its decisions against this arm's
            from mesh.lab.sim.recorded import compare_decisions

            agreement = compare_decisions(self.wl, self.chosen)
        return {
            "lifecycle": "core",
            "policy": spec.policy, "provider": spec.provider, "routers": spec.routers, "workers": spec.workers,
            "requests": n, "completed": len(ok), "requests_ok": len(ok),
            "unrouted": sum(failed.values()), "rejected": sum(failed.values()),
            "failed": dict(sorted(failed.items())),
            "lost": len(lost),
            "duplicated": sum(1 for x in terminals if x > 1),
            "retried": sum(1 for i in ok if attempt_of[i] > legs),
            "retries": {k.removeprefix("retries."): v for k, v in sorted(stats.items()) if k.startswith("retries.")},
            "worker_events": {k.removeprefix("workers."): v for k, v in sorted(stats.items()) if k.startswith("workers.")},
            "dropped": {k.removeprefix("dropped."): v for k, v in sorted(stats.items()) if k.startswith("dropped.")},
            "faults": self.faults.to_dict(), "faults_injected": dict(sorted(L["injected"].items())),
            "ttft_retried_p50_ms": _round_percentile(ttft_retried, 50), "ttft_retried_p95_ms": _round_percentile(ttft_retried, 95),
            "ttft_first_attempt_p50_ms": _round_percentile(ttft_clean, 50), "ttft_first_attempt_p95_ms": _round_percentile(ttft_clean, 95),
            "hit_rate": round(ratio(cached, prompt), 6),
            "any_hit_rate": round(ratio(sum(1 for i in ok if L["cached"][i]), len(ok)), 6),
            "oracle_hit_rate": round(ratio(oracle[0], oracle[1]), 6) if oracle else None,
            "worker_cv": round(cv(served), 6), "busy_cv": round(cv(busy), 6),
            "utilisation": round(mean(busy) / span, 6),
            "ttft_mean_ms": round(mean(ttft), 3) if ttft else None,
            "ttft_batch_means_ms": batch_means(((i, (first[i] - arrival[i]) * 1e3) for i in ok), n),
            "ttft_p50_ms": _round_percentile(ttft, 50), "ttft_p95_ms": _round_percentile(ttft, 95), "ttft_p99_ms": _round_percentile(ttft, 99),
            "e2e_p50_ms": _round_percentile(e2e, 50), "e2e_p95_ms": _round_percentile(e2e, 95),
            "tpot_mean_ms": tpot_mean_ms((first[i], done_at[i], L["completion"][i]) for i in ok),
            "throughput_rps": round(ratio(len(ok), span), 6),
            "output_tps": round(ratio(completion, span), 3),
            "goodput": round(ratio(sum(1 for x in ttft if x <= slo), len(ok)), 6),
            "success_rate": round(ratio(len(ok), n), 6),
            "decisions": decisions,
            "degraded_decisions": stats.get("degraded_decisions", 0),
            "kv_event_batches": L["kv_batches"], "kv_resyncs": L["kv_resyncs"], "kv_batches_lost": L["kv_lost"],
            "exchange": False,
            "prompt_tokens": prompt, "cached_tokens": cached,
            "sim_span_s": round(span, 6),
            "served_per_worker": served,
            "engine_steps": sum(w.steps for w in self.workers),
            "events": L["q"].popped,
            "prediction": None,
            "decision_agreement": agreement,
            "regret": None,  # the regret audit is reported by lifecycle=fast arms (the routers here restart)
        }


class _QuietLog:
    """The cores' log in the simulator: thousands of simulated retries are counted, not printed."""

    def _drop(self, *args, **kwargs) -> None:
        return None

    info = warning = debug = error = exception = _drop


def _round_percentile(xs: list[float], p: float) -> float | None:
    return round(percentile(xs, p, presorted=True), 3) if xs else None
