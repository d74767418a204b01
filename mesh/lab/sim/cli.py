"""``mesh sim``: argument parsing and the command (wired into ``mesh.cli`` by ``add_sim_parser``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mesh.errors import ConfigError

__all__ = ["add_sim_parser", "config_from_args", "cmd_sim"]

_WORKLOAD_PARAMS = {
    "groups": int, "prompts_per_group": int, "system_tokens": int, "question_tokens": int, "output_tokens": int,
    "users": int, "rounds": int, "context_tokens": int, "zipf_alpha": float,
    # conversation
    "turns_mean": float, "think_s": float, "first_tokens": int, "message_tokens": int, "max_context_tokens": int,
    "arrival_cv": float, "burst_peak": float, "shared_first_tokens": int, "rearrival_share": float,  # every workload
}


def _csv(kind):
    def parse(s: str):
        items = [x.strip() for x in s.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        try:
            return [kind(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad list item in {s!r}") from None
    return parse


def add_sim_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``sim`` subcommand to ``mesh``'s subparsers."""
    from mesh.cli_run import writable_file
    from mesh.engine_model import EngineConfig
    from mesh.settings_fields import add_flags
    from mesh.lab.sim.workloads import WORKLOADS

    p = subparsers.add_parser(
        "sim", help="simulate routers + GPU servers in virtual time: hit rate, balance, TTFT per policy",
        description="Replay a trace or a generated workload through the real routing code (policies, prefix "
                    "providers) and engine models in virtual time. Every combination of --policy, --provider, "
                    "--routers and --workers is one arm; all arms see the identical request stream.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids)")
    src.add_argument("--workload", choices=sorted(WORKLOADS), help="generated workload")
    src.add_argument("--matrix", metavar="FILE",
                     help="run a quality matrix (e.g. configs/quality-matrix.toml): cells of workload, load, workers "
                          "and routers, every policy per cell on one stream, per-cell verdicts (see mesh/lab/sim/matrix.py)")
    src.add_argument("--fairness", action="store_true",
                     help="tenants and priority bands through the broker's core (mesh/lab/sim/fairness.py): the "
                          "fairness targets (a 10x flood vs another tenant's p95 queue wait; high vs low band under "
                          "overload), or your own --tenant workload; uses --workers, --duration-s, --seed, --json")
    p.add_argument("--tenant", action="append", default=[], metavar="NAME:BAND:WEIGHT:SHARE",
                   help="with --fairness: a tenant offering SHARE of the fleet's capacity in BAND (critical, high, "
                        "normal, low) with WEIGHT in its band (repeatable)")
    a = p.add_argument_group("arms")
    a.add_argument("--policy", type=_csv(str), default=["power_of_two"], help="comma-separated policies (default power_of_two)")
    a.add_argument("--provider", type=_csv(str), default=["radix_tree"],
                   help="comma-separated prefix providers: radix_tree, approx, indexer (default radix_tree)")
    a.add_argument("--routers", type=_csv(int), default=[1], help="router count(s), e.g. 1,4 (default 1)")
    a.add_argument("--workers", type=_csv(int), default=[16], help="worker count(s), e.g. 16,64 (default 16)")
    a.add_argument("--router-pick", choices=["round_robin", "random"], default="round_robin",
                   help="how requests reach routers (default round_robin)")
    a.add_argument("--policy-option", action="append", default=[], metavar="POLICY.KEY=VALUE",
                   help="a constructor option of one policy, e.g. cache_aware.imbalance_scope=fleet or "
                        "cache_aware.balance_abs_threshold=64 (VALUE is read as JSON when it parses, else as a "
                        "string; repeatable; see mesh/routing/cache_policies.py)")
    a.add_argument("--no-dedupe", action="store_true",
                   help="run load-only policies once per provider instead of once with provider 'none'")
    w = p.add_argument_group("request stream")
    # --arrival-scale, not --time-scale: on the workers --time-scale scales modelled GPU time, here
    # only the trace's arrival times are scaled (the old spelling is kept as a hidden alias)
    w.add_argument("--arrival-scale", "--time-scale", dest="time_scale", type=float, default=1.0, metavar="FACTOR",
                   help="multiply trace arrival times (0.25 = 4x the offered rate); GPU time is not scaled")
    w.add_argument("--rate", type=float, default=20.0, help="generated workloads: Poisson requests/s (default 20)")
    w.add_argument("--duration-s", type=float, default=60.0, help="generated workloads: seconds of arrivals (default 60)")
    w.add_argument("--max-requests", type=int, help="truncate the stream to N requests")
    w.add_argument("--seed", type=int, default=0, help="seed of workloads and routing RNGs (default 0)")
    for name, typ in _WORKLOAD_PARAMS.items():
        w.add_argument("--" + name.replace("_", "-"), type=typ, help=f"workload parameter {name}")
    f = p.add_argument_group("fleet model")
    f.add_argument("--heartbeat-ms", type=float, default=500.0, help="LoadStat interval to each router (default 500)")
    f.add_argument("--event-delay-ms", type=float, default=10.0, help="KV event delivery delay (default 10)")
    f.add_argument("--net-ms", type=float, default=0.5, help="one-way router<->worker latency (default 0.5)")
    f.add_argument("--load-freshness-s", type=float, default=5.0, help="routers ignore older LoadStat (default 5)")
    f.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="TTFT SLO for goodput (default 2000)")
    f.add_argument("--exchange", action="store_true",
                   help="routers share their in-flight figures, as brokers with --exchange/--peer do (no effect with 1 router)")
    f.add_argument("--exchange-delay-ms", type=float, default=2.0, help="exchange publish -> peers' merge delay (default 2)")
    f.add_argument("--no-exchange-routes", dest="exchange_routes", action="store_false",
                   help="with --exchange: the routers share only their in-flight figures, not where they routed each "
                        "prompt (as brokers with --no-exchange-routes; by default both, mesh.index.peer_routes)")
    f.add_argument("--exchange-interval-ms", type=float, default=0.0,
                   help="at most one change message per router per interval (default 0: one per change, as the "
                        "broker's default publishes once per pump)")
    f.add_argument("--buckets", help="bucket config (TOML/JSON, e.g. configs/buckets-example.toml): route through "
                                     "bucket domains, admission and the two-pass fallback, as the broker does")
    f.add_argument("--pd", help="P,D: prefill/decode disaggregation with P prefill and D decode workers (replaces --workers)")
    f.add_argument("--dp-size", type=int, default=1,
                   help="DP-attention ranks per worker, each its own KV cache and batch; the router picks the rank "
                        "(default 1: none)")
    f.add_argument("--no-global-cache-winner", dest="global_cache_winner", action="store_false",
                   help="with --buckets: keep cache winners inside their bucket, as the broker's flag does")
    f.add_argument("--decode-policy", choices=["power_of_two", "legacy_host_affinity"], default="power_of_two",
                   help="with --pd: how the decode worker is picked, as the broker's flag does (default power_of_two)")
    f.add_argument("--session-affinity", choices=["off", "soft", "hard"], default="off",
                   help="conversation turns stick to their session's worker, as the broker's --session-affinity "
                        "(default off here: arms compare policies alone)")
    f.add_argument("--session-ttl-s", type=float, default=600.0, help="as the broker's --session-ttl-s")
    f.add_argument("--session-table-size", type=int, default=100_000, help="as the broker's --session-table-size")
    lc = p.add_argument_group("broker lifecycle and faults (the broker's own BrokerCore in virtual time)")
    lc.add_argument("--lifecycle", choices=["fast", "core"], default="fast",
                    help="fast: routing only (Router.route/release); core: every router is the broker's BrokerCore "
                         "(registration, liveness, retries, parking, deadlines, ejection, P/D handoff). --faults and "
                         "--pd always run the core (default fast)")
    lc.add_argument("--faults", metavar="SPEC",
                    help="inject faults, e.g. kill=2/min,pause=4/min,pause_s=3,down_s=5,broker_restart=0.5/min,"
                         "broker_down_s=2,kv_loss=0.01 (rates over the whole fleet, per s|min|h; durations in s); "
                         "reports requests lost, duplicated and retried, and the TTFT of retried requests")
    lc.add_argument("--record-decisions", metavar="FILE",
                    help="with --lifecycle core, one arm, one router: record the router's decisions to FILE, as "
                         "`mesh broker --record-decisions` does (replay it with --trace FILE)")
    e = p.add_argument_group("engine model (defaults: 8B model on one H100; --config FILE: its [engine] table)")
    e.add_argument("--config", help="TOML file; its [engine] table sets the engine model (the flags below win)")
    add_flags(e, EngineConfig, dest_prefix="engine_")
    m = p.add_argument_group("matrix (with --matrix; --max-requests then caps every cell's stream)")
    m.add_argument("--seeds", type=_csv(int), help="replace the matrix's seeds, e.g. 2 (the held-out seed)")
    m.add_argument("--cells", metavar="REGEX",
                   help="run only the cells whose label matches, e.g. 'conversation' or 'W64' (labels: 'zipf L1 W16 R4')")
    m.add_argument("--jobs", type=int, default=0,
                   help="processes running calibrations and cells in parallel (default 0: every usable core; "
                        "results are identical for any value)")
    m.add_argument("--rejudge", metavar="JSON", nargs="+",
                   help="judge the runs of earlier --json reports of this matrix again, simulating nothing (the "
                        "simulator is deterministic: after a change to the judging, the same figures a rerun would "
                        "give); several files are one run sharded by seed (--seeds 1,3 here, --seeds 2 elsewhere), "
                        "judged as one report over --seeds; refused when a file is not a run of the matrix as it "
                        "is now, or the files' seeds overlap or miss one")
    m.add_argument("--extend", metavar="JSON", nargs="+",
                   help="complete earlier --json reports of this matrix (read as --rejudge reads them) that ran "
                        "fewer replicas or twin draws than it now asks for: their runs are kept and only the "
                        "missing replicas and draws run; the report equals a fresh run's")
    m.add_argument("--reuse-calibration", metavar="JSON",
                   help="reuse the power-of-two calibrations of an earlier matrix report when they still apply")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=writable_file, help="write the report (config, workload, arms) to this JSON file")
    o.add_argument("--plot", help="write a PNG: hit rate, worker CV and TTFT p95 per arm (matrix: the heatmap of "
                                  "TTFT p95 ratios to the best other policy)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--regret-shadow", type=float, metavar="RATE", default=None,
                   help="cache_aware arms also keep the regret audit's shadow counterfactual over this share of the "
                        "sessions, 0 < RATE <= 1 (mesh.routing.regret_shadow; off by default, as in the broker); "
                        "arms report it as regret.shadow and --matrix judges it beside the per-decision figure")
    o.add_argument("--regret-truth", type=int, metavar="K", default=0,
                   help="cache_aware arms replay every K-th audited decision whose baseline pick differs on copies of "
                        "both workers' engines and report the one-step regret beside the audit's prediction "
                        "(regret_truth; mesh.lab.sim.regret_truth; slow: deep copies of engines; 0: off)")
    o.add_argument("--audit", action="store_true",
                   help="the policy-level regret audit: run cache_aware and both baselines (greedy, power-of-two) on "
                        "the stream (a --trace of `mesh broker --record-decisions`: your own traffic) and print what "
                        "cache_aware pays per request against each, with 95 %% intervals; on a recording also the "
                        "engine model's fidelity (the twin's mean TTFT against the one the broker observed). "
                        "Replaces --policy; one --routers, --workers and --provider value (docs/routing.md)")
    o.add_argument("--audit-draws", metavar="N", type=int, default=1,
                   help="with --audit: average the audit over N independent draws of the twin (its policies' and "
                        "heartbeats' random numbers; 1 to 16, default 1): the interval narrows by about sqrt(N), at N "
                        "times the runs")
    o.add_argument("--audit-textfile", metavar="FILE", type=writable_file,
                   help="with --audit: also write its figures as Prometheus gauges to FILE (atomically; for "
                        "node_exporter's textfile collector, so a periodic audit of the last rotated recording "
                        "lands on the dashboard): mesh_audit_pays_ms{baseline}, mesh_audit_pays_ci95_ms{baseline}, "
                        "mesh_audit_requests, mesh_audit_engine_fidelity_ratio, mesh_audit_engine_prefill_speed, "
                        "mesh_audit_engine_decode_speed")
    o.add_argument("--fit-engine", action=argparse.BooleanOptionalAction, default=None,
                   help="with --audit of a recording (the default there): first scale the engine's prefill and decode "
                        "speeds until the twin, replaying the recording under its own policy, sees the mean TTFT and "
                        "time per output token the broker observed (within 2 %%; a few extra runs of one arm), then "
                        "audit on the fitted engine; --no-fit-engine audits the engine as described")
    o.add_argument("--compare-decisions", action="store_true",
                   help="with --trace of a recorded decisions file and --lifecycle core: print, per arm, the share of "
                        "requests routed to the worker the recording chose, by recorded reason, and the first divergences")
    p.set_defaults(func=cmd_sim, sim_parser=p)
    return p


#: options that only make sense for a single run (with --matrix the TOML says all of this)
_SINGLE_RUN_ONLY = ("policy", "policy_option", "provider", "routers", "workers", "router_pick", "no_dedupe",
                    "time_scale", "rate", "duration_s", "seed", "heartbeat_ms", "event_delay_ms", "net_ms", "load_freshness_s", "ttft_slo_ms",
                    "buckets", "global_cache_winner", "decode_policy", "pd", "exchange", "exchange_delay_ms", "exchange_interval_ms", "exchange_routes", "config",
                    "dp_size", "session_affinity", "session_ttl_s", "session_table_size")


def _check_matrix_args(args: argparse.Namespace) -> None:
    """With --matrix, refuse single-run options (they would be silently ignored otherwise)."""
    parser = getattr(args, "sim_parser", None)
    given = []
    names = list(_SINGLE_RUN_ONLY) + list(_WORKLOAD_PARAMS) + [k for k in vars(args) if k.startswith("engine_")]
    for name in names:
        default = parser.get_default(name) if parser is not None else None
        if getattr(args, name, None) != default:
            given.append("--" + name.removeprefix("engine_").replace("_", "-"))
    if given:
        raise ConfigError(f"{', '.join(given)}: not used with --matrix (set them in the matrix TOML: [matrix], [sim], "
                          f"[engine], [workloads.NAME] params)")
    if args.jobs < 0:
        raise ConfigError("jobs: must be >= 0 (0 = every usable core)")


def _policy_params(items: list[str]) -> dict[str, dict]:
    """``--policy-option POLICY.KEY=VALUE`` items as {policy: {key: value}} (ConfigError naming the item)."""
    out: dict[str, dict] = {}
    for item in items:
        head, eq, raw = item.partition("=")
        pol, dot, key = head.strip().partition(".")
        if not (eq and dot and pol and key.isidentifier()):
            raise ConfigError(f"--policy-option {item!r}: expected POLICY.KEY=VALUE, e.g. cache_aware.imbalance_scope=fleet")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out.setdefault(pol, {})[key] = value
    return out


def config_from_args(args: argparse.Namespace):
    from mesh.config import settings_from_args
    from mesh.engine_model import EngineConfig
    from mesh.lab.sim.runner import SimConfig

    engine = settings_from_args(EngineConfig, args, "engine", dest_prefix="engine_")
    params = {k: getattr(args, k) for k in _WORKLOAD_PARAMS if getattr(args, k, None) is not None}
    if args.trace and params:
        raise ConfigError(f"workload parameters ({', '.join(sorted(params))}) need --workload, not --trace")
    cfg = SimConfig(
        trace=args.trace, workload=args.workload, workload_params=params, rate=args.rate,
        duration_s=args.duration_s, time_scale=args.time_scale, max_requests=args.max_requests, seed=args.seed,
        policies=args.policy, providers=args.provider, routers=args.routers, workers=args.workers,
        router_pick=args.router_pick, heartbeat_ms=args.heartbeat_ms, event_delay_ms=args.event_delay_ms,
        net_ms=args.net_ms, load_freshness_s=args.load_freshness_s, ttft_slo_ms=args.ttft_slo_ms, engine=engine,
        dedupe_load_only=not args.no_dedupe, buckets=args.buckets, pd=_pd(args.pd),
        global_cache_winner=args.global_cache_winner, decode_policy=args.decode_policy,
        exchange=args.exchange, exchange_delay_ms=args.exchange_delay_ms, exchange_interval_ms=args.exchange_interval_ms,
        exchange_routes=args.exchange_routes, dp_size=args.dp_size,
        session_affinity=args.session_affinity, session_ttl_s=args.session_ttl_s, session_table_size=args.session_table_size,
        lifecycle=args.lifecycle, faults=args.faults, policy_params=_policy_params(getattr(args, "policy_option", [])),
        record_decisions=getattr(args, "record_decisions", None), regret_shadow_rate=getattr(args, "regret_shadow", None),
        regret_truth_every=getattr(args, "regret_truth", 0) or 0,
    )
    cfg.validate()
    return cfg


def _pd(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        p, d = (int(x) for x in text.split(","))
    except ValueError:
        from mesh.errors import ConfigError

        raise ConfigError(f"pd: expected PREFILL,DECODE worker counts, got {text!r}") from None
    return p, d


def dumps_report(report: dict) -> str:
    """The canonical JSON text of a report (sorted keys: same report, same bytes)."""
    return json.dumps(report, indent=2, sort_keys=True) + "\n"


def cmd_sim(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mesh.lab.sim.report import arm_label, render_lifecycle_table, render_table, write_plot
    from mesh.lab.sim.runner import arm_specs, build_workload, run_sim

    if getattr(args, "matrix", None):
        from mesh.lab.sim.matrix import cmd_matrix

        _check_matrix_args(args)
        return cmd_matrix(args)
    if getattr(args, "fairness", False):
        return _cmd_fairness(args)
    if getattr(args, "tenant", None):
        raise ConfigError("tenant: --tenant needs --fairness")
    if (getattr(args, "seeds", None) or getattr(args, "reuse_calibration", None) or getattr(args, "cells", None)
            or getattr(args, "rejudge", None) or getattr(args, "extend", None)):
        raise ConfigError("--seeds, --cells, --rejudge, --extend and --reuse-calibration need --matrix")
    if getattr(args, "audit_textfile", None) and not getattr(args, "audit", False):
        raise ConfigError("audit_textfile: --audit-textfile needs --audit")
    if getattr(args, "fit_engine", None) is not None and not getattr(args, "audit", False):
        raise ConfigError("fit_engine: --fit-engine and --no-fit-engine go with --audit")
    from mesh.lab.sim.twin import MAX_DRAWS

    draws = getattr(args, "audit_draws", 1)
    if draws != 1 and not getattr(args, "audit", False):
        raise ConfigError("audit_draws: --audit-draws needs --audit")
    if not 1 <= draws <= MAX_DRAWS:
        raise ConfigError(f"audit_draws: must be from 1 to {MAX_DRAWS}, got {draws}")
    if getattr(args, "audit", False):
        _audit_policies(args)
    cfg = config_from_args(args)
    console = Console(stderr=True)
    wl = build_workload(cfg)
    _recording_defaults(args, cfg, wl, console)
    if getattr(args, "audit", False) and (len(cfg.routers) > 1 or len(cfg.workers) > 1 or len(cfg.providers) > 1):
        raise ConfigError("audit: the twin is one fleet shape: give one --routers, --workers and --provider value")
    engine_fit = _fit_engine(args, cfg, wl, console) if getattr(args, "audit", False) else None
    specs = arm_specs(cfg)
    console.print(f"[bold]mesh sim[/]: {wl.name}, {len(wl.requests)} requests"
                  f"{f' ({wl.dropped} dropped: prompt > KV capacity)' if wl.dropped else ''}, {len(specs)} arm(s)")
    wall: list[float] = []
    t_arm = [time.perf_counter()]

    def on_arm(i, res):
        now = time.perf_counter()
        wall.append(now - t_arm[0])
        t_arm[0] = now

    show = not args.no_progress and console.is_terminal
    if show:
        prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True)
        tasks: dict[int, int] = {}

        def progress(i, n_arms, done, total):
            if i not in tasks:
                tasks[i] = prog.add_task(f"arm {i + 1}/{n_arms} {arm_label(specs[i].__dict__)}", total=total)
            prog.update(tasks[i], completed=done)

        with prog:
            report = run_sim(cfg, workload=wl, progress=progress, on_arm=on_arm)
    else:
        def on_arm_log(i, res):
            on_arm(i, res)
            if not args.no_progress:
                console.print(f"arm {i + 1}/{len(specs)} {arm_label(res)}: {wall[-1]:.1f} s")

        report = run_sim(cfg, workload=wl, on_arm=on_arm_log)
    out = Console()
    out = Console(width=max(out.width, 175))  # never squeeze the table below its natural width
    out.print(render_table(report, wall))
    lifecycle = render_lifecycle_table(report)
    if lifecycle is not None:
        out.print(lifecycle)
    if getattr(args, "compare_decisions", False):
        _print_agreement(report)
    if getattr(args, "audit", False):
        report["audit"] = _print_audit(report, wl, engine_fit, _more_draws(cfg, wl, draws, console, args.no_progress))
        if args.audit_textfile:
            from mesh.lab.sim.twin import write_textfile

            write_textfile(args.audit_textfile, report["audit"], requests=report["workload"]["requests"])
            console.print(f"wrote {args.audit_textfile}")
    if args.json:
        Path(args.json).write_text(dumps_report(report))
        console.print(f"wrote {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def _recording_defaults(args: argparse.Namespace, cfg, wl, console) -> None:
    """A recorded decisions file replays on its own fleet (names, order, size) unless --workers says otherwise."""
    parser = getattr(args, "sim_parser", None)
    if wl.fleet is None or parser is None:
        return
    if args.workers == parser.get_default("workers") and wl.fleet:
        cfg.workers = [len(wl.fleet)]
        console.print(f"replaying on the recording's fleet: {len(wl.fleet)} workers (--workers to change)")
        cfg.validate(source=False)


def _audit_policies(args: argparse.Namespace) -> None:
    """``--audit`` runs the twin's policies: cache_aware and both baselines (not a --policy list)."""
    from mesh.lab.sim.twin import BASELINES, SUBJECT

    parser = getattr(args, "sim_parser", None)
    if parser is not None and args.policy != parser.get_default("policy"):
        raise ConfigError(f"audit: --audit runs {SUBJECT} and {', '.join(BASELINES)} itself; drop --policy")
    args.policy = [SUBJECT, *BASELINES]


def _fit_engine(args: argparse.Namespace, cfg, wl, console) -> dict | None:
    """``--audit`` of a recording: fit the engine to what the broker observed (``--fit-engine``,
    the default there) and run the audit on it; None when not fitted (said why when asked for)."""
    from mesh.lab.sim.fit import observed_from_recording
    from mesh.lab.sim.twin import fit_twin
    from mesh.routing.router import POLICIES

    want = args.fit_engine
    if want is False:
        return None
    policy = (wl.params or {}).get("policy")
    target = observed_from_recording(wl.recorded) if wl.recorded else None
    why = None
    if not wl.recorded:
        why = "the stream is no recording (mesh broker --record-decisions)"
    elif target is None:
        why = "the recording carries no observed TTFT"
    elif (wl.params or {}).get("time_scale", 1.0) != 1.0:
        why = "--time-scale is not 1"
    elif policy not in POLICIES:
        why = f"the recording's policy {policy!r} is not one the simulator runs"
    if why is not None:
        if want:
            raise ConfigError(f"fit_engine: cannot fit the engine: {why}")
        return None
    tpot = f", TPOT {target.tpot_mean_ms:.2f} ms" if target.tpot_mean_ms is not None else " (no decode figures)"
    console.print(f"fitting the engine model to the recording: {policy} observed mean TTFT {target.ttft_mean_ms:.1f} ms"
                  f"{tpot} on {target.requests} requests")

    def on_step(st: dict) -> None:
        if not args.no_progress:
            tp = f", TPOT {st['tpot_ratio']:.3f}x" if st["tpot_ratio"] is not None else ""
            console.print(f"  prefill x{st['prefill_speed']:.3f} decode x{st['decode_speed']:.3f}: "
                          f"TTFT {st['ttft_ratio']:.3f}x{tp} the observed")

    fit = fit_twin(cfg, wl, policy, target, on_step=on_step)
    cfg.engine = fit.pop("engine")
    fit["observed"] = {"ttft_mean_ms": round(target.ttft_mean_ms, 3), "requests": target.requests,
                       "tpot_mean_ms": None if target.tpot_mean_ms is None else round(target.tpot_mean_ms, 4)}
    fit["policy"] = policy
    fit["engine"] = {k: getattr(cfg.engine, k) for k in ("prefill_tokens_per_s", "prefill_overhead_ms", "attention_coef_ms",
                                                          "decode_base_ms", "decode_per_req_ms")}
    return fit


def _more_draws(cfg, wl, draws: int, console, quiet: bool) -> list[list[dict]]:
    """``--audit-draws N``: the twin's arms on draws 1 .. N-1 of the same stream (draw 0 is the run itself)."""
    from mesh.lab.sim.runner import run_sim
    from mesh.lab.sim.twin import draw_config

    out = []
    for k in range(1, draws):
        t0 = time.perf_counter()
        out.append(run_sim(draw_config(cfg, k), workload=wl)["arms"])
        if not quiet:
            console.print(f"audit draw {k + 1}/{draws}: {time.perf_counter() - t0:.1f} s")
    return out


def _print_audit(report: dict, wl, engine_fit: dict | None = None, more_draws: list[list[dict]] | None = None) -> dict:
    """``--audit``: what cache_aware pays per request against each baseline on this stream (the
    mean over the twin's draws: the run, then ``more_draws``), and on a recording how well the
    twin's engine model matches what the broker observed."""
    from mesh.lab.sim.twin import fidelity, pooled_pays

    tp = pooled_pays([report["arms"], *(more_draws or [])])
    out: dict = {"pays": tp}
    subject = tp["subject"]
    over = f", the mean of {tp['draws']} draws" if tp["draws"] > 1 else ""
    print(f"policy-level audit (the twin: this stream through every policy on a simulated {report['arms'][0]['workers']}-worker "
          f"fleet, {report['arms'][0]['routers']} router(s){over}):")
    parts = [f"{tp['pays_ms'][b]:+.1f} ms against {b}" + (f" (95 % interval +-{tp['ci95_ms'][b]:.1f})"
                                                          if tp["ci95_ms"][b] is not None else "")
             for b in sorted(tp["pays_ms"], key=lambda b: b != tp["against"])]
    share = f" ({abs(tp['best_of_ttft']):.1%} of its mean TTFT)" if tp["best_of_ttft"] is not None else ""
    if tp["verdict"] == "tie":
        print(f"  {subject} and the better baseline, {tp['against']}, TIE on this traffic: {tp['best']:+.1f} ms per request"
              f"{share}, inside the 95 % interval; switching changes nothing measurable (more draws, --audit-draws, "
              f"narrow the interval): " + "; ".join(parts))
    else:
        verb = "saves" if tp["verdict"] == "saves" else "costs"
        print(f"  {subject} {verb} {abs(tp['best']):.1f} ms per request{share} against the better baseline, "
              f"{tp['against']}: " + "; ".join(parts))
    if engine_fit is not None:
        out["engine_fit"] = engine_fit
        e = engine_fit["engine"]
        word = "fitted" if engine_fit["converged"] else "NOT fitted within 2 % (the closest kept; trust the figures less)"
        tp = f", TPOT {engine_fit['tpot_ratio']:.2f}x" if engine_fit["tpot_ratio"] is not None else ""
        print(f"  engine model {word} in {engine_fit['evaluations']} runs: prefill x{engine_fit['prefill_speed']:.2f} "
              f"({e['prefill_tokens_per_s']:,.0f} tokens/s), decode x{engine_fit['decode_speed']:.2f} "
              f"({e['decode_base_ms']:.2f} ms + {e['decode_per_req_ms']:.3f} ms per running request) of the described; "
              f"the twin's {engine_fit['policy']} TTFT {engine_fit['ttft_ratio']:.2f}x{tp} the observed")
    recorded_policy = (wl.params or {}).get("policy")
    arm = next((a for a in report["arms"] if a["policy"] == recorded_policy), None)
    if wl.recorded and arm is not None and (wl.params or {}).get("time_scale", 1.0) == 1.0:
        f = fidelity(arm, wl.recorded)
        if f is not None:
            out["fidelity"] = {**f, "policy": recorded_policy}
            word = "matches" if f["matches"] else ("does NOT match: fit it to the recording (--fit-engine) or describe "
                                                   "the fleet's engine (--config FILE, its [engine] table, or the engine "
                                                   "flags) before trusting the figures")
            print(f"  engine model: the twin's {recorded_policy} mean TTFT {f['twin_ttft_mean_ms']:.0f} ms against "
                  f"{f['observed_ttft_mean_ms']:.0f} ms the broker observed on {f['requests']} requests "
                  f"({f['ratio']:.2f}x): {word}")
    elif wl.recorded:
        print(f"  engine model: not checked (the recording's policy {recorded_policy} is not among the twin's, or "
              f"--time-scale is not 1)")
    return out


def _print_agreement(report: dict) -> None:
    """``--compare-decisions``: each arm's choices against the recording's."""
    arms = [a for a in report["arms"] if a.get("decision_agreement")]
    if not arms:
        raise ConfigError("compare_decisions: needs --trace of a recorded decisions file (mesh broker "
                          "--record-decisions) and --lifecycle core")
    for a in arms:
        ag = a["decision_agreement"]
        share = ag["identical_share"]
        print(f"{a['policy']} ({a['provider']}, {a['workers']} workers): {ag['identical']}/{ag['compared']} identical "
              f"choices ({100 * share:.2f} %)" if share is not None else f"{a['policy']}: nothing to compare")
        for reason, r in ag["by_reason"].items():
            print(f"  {reason:28} {r['identical']:7}/{r['requests']:<7} {100 * r['share']:7.2f} %")
        for d in ag["first_divergences"][:10]:
            print(f"  request {d['request']} at {d['arrival_s']:.3f} s: recorded {d['recorded']} ({d['recorded_reason']}), "
                  f"replayed {d['replayed']} ({d['replayed_reason']})")


def _cmd_fairness(args: argparse.Namespace) -> int:
    """``mesh sim --fairness``: the two fairness checks (exit 1 when one fails), or one --tenant workload."""
    from mesh.lab.sim.fairness import fairness_checks, parse_tenant, run_fairness

    kw = dict(workers=args.workers[0], duration_s=args.duration_s, seed=args.seed)
    if args.tenant:
        loads = [parse_tenant(t) for t in args.tenant]
        if len({t.name for t in loads}) != len(loads):
            raise ConfigError("tenant: two --tenant options name the same tenant")
        report: dict = {"run": run_fairness(loads, **kw)}
        rows = [("run", report["run"])]
        ok = True
    else:
        report = fairness_checks(**kw)
        rows = [("flood: without", report["flood"]["without"]), ("flood: with", report["flood"]["with"]),
                ("bands", report["bands"]["run"])]
        ok = report["flood"]["pass"] and report["bands"]["pass"]
    for label, run in rows:
        for name, t in sorted(run["tenants"].items()):
            print(f"{label:15} {name:10} offered {t['offered']:7} served {t['served']:7} refused {t['refused']:7} "
                  f"wait p50 {t['wait_p50_s'] * 1000:9.1f} ms  p95 {t['wait_p95_s'] * 1000:9.1f} ms")
    for check in ("flood", "bands"):
        if check in report:
            c = report[check]
            print(f"{check}: p95 ratio {c['p95_ratio']:.3f} (target <= {c['max']}): {'PASS' if c['pass'] else 'FAIL'}")
    if args.json:
        Path(args.json).write_text(dumps_report(report))
        print(f"wrote {args.json}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m mesh.lab.sim.cli``), same as ``mesh sim``."""
    from mesh.cli_run import run_one

    return run_one("sim", add_sim_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
