"""``mesh report``: the result pages in ``docs/results/``, generated from the JSON the lab writes.

Reads the files ``mesh bench broker|routing|indexer|exchange|http|replay --json F`` and
``mesh sim --matrix FILE --json F`` write (or the compact ``docs/quality-matrix-summary.json``)
and writes one markdown page per file: a table, the command that made it and the date of the
run. A page is replaced on every run, so the latest result is the only one in the repository
and a new run is a new page, not a merge of prose.

    mesh report bench/*.json docs/quality-matrix-summary.json      # -> docs/results/<name>.md

Each input's kind is recognised by its keys (``--kind`` forces one); the page is named after the
kind (``broker.md``, ``http.md``, ``replay-<workload>.md``, ...) or, for a matrix, after its configuration file
(``quality-matrix.md``, ``quality-matrix-70b.md``). The date is the JSON file's modification
time in UTC unless ``--date`` gives one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "Page", "detect_kind", "main", "page_name", "render", "to_markdown"]

KINDS = ("broker", "routing", "indexer", "exchange", "http", "replay", "matrix")
SHORT = {"power_of_two": "p2c", "cache_aware_greedy": "greedy"}


@dataclass
class Page:
    """One result page: a title, what it measures, tables (header + rows) and notes under them."""

    title: str
    about: str
    command: str
    tables: list[tuple[list[str], list[list[str]]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- recognising the input


def detect_kind(data: Any) -> str | None:
    """Which command wrote this JSON (one of :data:`KINDS`), or None."""
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("cells"), list) and isinstance(data.get("summary"), dict):
        return "matrix"
    if data.get("bench") == "replay":
        return "replay"
    if data.get("bench") == "http" or ("config" in data and isinstance(data.get("cells"), list)):
        return "http"
    if "baseline_rps" in data and "rounds" in data:
        return "broker"
    if "decision" in data and "apply_blocks_per_s" in data:
        return "routing"
    if "backends" in data and "ingest_blocks_per_s" in data:
        return "indexer"
    if "by_interval" in data:
        return "exchange"
    return None


def page_name(kind: str, data: dict[str, Any]) -> str:
    """The page's file stem: the kind, for a replay with its workload (``replay-mooncake``: one page per
    workload replayed), for an HTTP run on another endpoint than ``/generate`` with the endpoint (and
    ``-single`` for one repeated chat body), or for a
    matrix the stem of its configuration file."""
    if kind == "replay":
        return f"replay-{(data.get('workload') or {}).get('name') or 'trace'}"
    if kind == "http":  # one page per endpoint loaded: /generate is http.md, /v1/chat/completions http-v1-chat-completions.md
        cfg = data.get("config") or {}
        path = str(cfg.get("path") or "/generate")
        if path == "/generate":
            return "http"
        single = "-single" if path == "/v1/chat/completions" and cfg.get("workload") == "single" else ""
        return "http-" + "-".join(x for x in path.split("/") if x) + single  # one repeated chat body: its own page
    if kind != "matrix":
        return kind
    path = (data.get("matrix") or {}).get("path") or data.get("matrix_path")
    return Path(path).stem if path else "quality-matrix"


# ----------------------------------------------------------------------------- cells


def _num(v: Any, spec: str = "{:,.0f}") -> str:
    """One table cell: ``spec`` applied to a number, "-" for a missing one (None or NaN)."""
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if isinstance(v, str):
        return v
    return spec.format(v)


def _pair(a: Any, b: Any, spec: str = "{:,.2f}") -> str:
    return f"{_num(a, spec)} / {_num(b, spec)}"


def _span(values: Iterable[Any], spec: str = "{:,.0f}") -> str:
    """A list of per-round figures as "lo-hi" (or the one value)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return _num(lo, spec) if lo == hi else f"{_num(lo, spec)}-{_num(hi, spec)}"


# ----------------------------------------------------------------------------- one renderer per kind


def _broker(d: dict[str, Any], src: str) -> Page:
    p = Page("Broker throughput and added latency",
             f"One broker with {d['workers']} instant workers against a minimal ZeroMQ forwarder, "
             f"{d['concurrency']} requests in flight for the maximum, then both at half the broker's maximum "
             "for latency. Each round runs both arms with fresh processes; the last row is the median.",
             f"mesh bench broker --workers {d['workers']} --concurrency {d['concurrency']} --seconds {d['seconds']:g} "
             f"--rounds {len(d['rounds'])}{'' if d.get('pinning') else ' --no-pin'} --json {src}")
    rows = [[str(k), _num(r["rps"]), _num(r["baseline_rps"]),
             _num(r["rps"] / r["baseline_rps"] if r.get("baseline_rps") else None, "{:.3f}"),
             _pair(r.get("p50_ms"), r.get("p99_ms"))] for k, r in enumerate(d["rounds"], 1)]
    rows.append(["**median**", _num(d["rps"]), _num(d["baseline_rps"]), _num(d["ratio"], "{:.3f}"),
                 _pair(d["p50_ms"], d["p99_ms"])])
    p.tables.append((["round", "mesh req/s", "forwarder req/s", "ratio", "added latency p50 / p99 ms"], rows))
    pin = d.get("pinning") or {}

    def cpus(v: Any) -> str:
        return ", ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)

    p.notes.append(f"Errors: {d.get('errors', 0)}. CPUs: {d.get('cpus', '-')}; pinning: "
                   + (f"process under test on CPU {cpus(pin.get('process_under_test'))}, harness on "
                      f"CPU {cpus(pin.get('harness'))}" if pin else "off") + ".")
    return p


def _routing(d: dict[str, Any], src: str) -> Page:
    sizes = ",".join(d["decision"])
    p = Page("Routing decision time",
             f"One `cache_aware` decision for a {d.get('prompt_tokens', '-')}-token prompt "
             f"({d.get('block_size', '-')}-token pages): content keys, index match, scoring and bookkeeping, "
             "in process.",
             f"mesh bench routing --sizes {sizes} --json {src}")
    rows = [[n, _num(r["p50_us"], "{:,.0f} µs"), _num(r["p99_us"], "{:,.0f} µs"), _num(r.get("index_entries"))]
            for n, r in d["decision"].items()]
    p.tables.append((["workers", "p50", "p99", "index entries"], rows))
    p.notes.append(f"Index apply: {_num(d['apply_blocks_per_s'])} blocks/s. Memory: {_num(d.get('bytes_per_block'), '{:g}')} "
                   f"bytes per indexed (block, worker) entry. p99 at 4,096 workers over p99 at 64: "
                   f"{_num(d.get('p99_ratio_4096_vs_64'), '{:.2f}')}.")
    return p


_INDEXER_ROWS: list[tuple[str, Callable[[dict[str, Any]], str], str]] = [
    ("ingest over gRPC", lambda r: _num(r.get("ingest_blocks_per_s"), "{:,.0f} blocks/s"), ">= 200,000 blocks/s"),
    ("one-batch apply p50 / p99 ms", lambda r: _pair(r.get("apply_p50_ms"), r.get("apply_p99_ms")), ""),
    ("match p50 / p99 ms, client", lambda r: _pair(r.get("match_p50_ms_client"), r.get("match_p99_ms_client")), "p99 <= 3 ms"),
    ("match p50 / p99 ms, server", lambda r: _pair(r.get("match_p50_ms_server"), r.get("match_p99_ms_server")), "p99 <= 1 ms"),
    ("bytes per indexed block (RSS)", lambda r: _num(r.get("bytes_per_block"), "{:,.0f}"), ""),
    ("replica SIGKILL -> listening with the state",
     lambda r: f"{r['restart_seconds']} s, {_num(r.get('restart_entries'))} entries" if "restart_seconds" in r else "n/a", ""),
]


def _indexer(d: dict[str, Any], src: str) -> Page:
    per = d["backends"]
    backend = "both" if len(per) > 1 else next(iter(per))
    p = Page("Shared KV indexer",
             f"The indexer server in its own process with {_num(d['workers'])} workers and "
             f"{_num(d.get('indexed_blocks'))} indexed blocks, queried with {d.get('prompt_blocks', '-')}-block prompts; "
             "every backend on the same workload in one run.",
             f"mesh bench indexer --workers {d['workers']} --blocks {d.get('ingest_blocks', d.get('indexed_blocks'))} "
             f"--backend {backend} --json {src}")
    rows = [[label, *[cell(per[b]) for b in per], target] for label, cell, target in _INDEXER_ROWS]
    p.tables.append((["measure", *per, "target"], rows))
    p.notes.append(f"Host: {d.get('host_cpus', '-')} CPUs, load average {d.get('host_loadavg_1m_at_end', '-')} at the end.")
    return p


def _exchange(d: dict[str, Any], src: str) -> Page:
    ivs = ",".join(f"{x:g}" for x in d["intervals_ms"])
    p = Page("Peer exchange delay",
             f"Two brokers peering, {d['workers']} simulated workers registered with both, "
             f"{d['background_rate_rps']:g} req/s of background load through B; probes through A, one at a time, "
             "timed from submit to the first exchange message from A that shows them. Rounds interleave the intervals.",
             f"mesh bench exchange --intervals-ms {ivs} --rounds {d['rounds']} --probes {d['probes_per_arm']} --json {src}")
    rows = []
    for key, r in d["by_interval"].items():
        dl = r["delay_ms"]
        rows.append([key + (" (default)" if key == "0" else ""), _num(dl.get("p50"), "{:.2f} ms"),
                     _num(dl.get("p90"), "{:.2f}"), _num(dl.get("p99"), "{:.2f}"),
                     _num(r["accept_ms"].get("p50"), "{:.2f} ms"), _span(r.get("b_messages_per_s", []))])
    p.tables.append((["`--exchange-interval-ms`", "delay p50", "p90", "p99", "A's ACCEPTED at the client, p50",
                      "B's messages/s"], rows))
    if d.get("ratios"):
        p.notes.append("Ratios of the delay: " + "; ".join(
            f"{k}: p50 {_num(v.get('p50'), '{:.2f}')}x, p99 {_num(v.get('p99'), '{:.2f}')}x" for k, v in d["ratios"].items())
            + ".")
    return p


def _chat_workload_args(cfg: dict[str, Any]) -> str:
    """The chat workload's flags of a /v1/chat/completions run (conversations is the default shape)."""
    if cfg.get("path") != "/v1/chat/completions":
        return ""
    if cfg.get("workload") == "single":
        return " --chat-workload single"
    if cfg.get("workload") == "conversations":
        return f" --conversations {cfg.get('conversations')} --turns {cfg.get('turns')}"
    return ""


def _http(d: dict[str, Any], src: str) -> Page:
    cfg = d["config"]
    conc = ",".join(str(c) for c in cfg["concurrency"])
    p = Page("The HTTP path",
             f"Closed-loop `POST {cfg['path']}`{' (streamed)' if cfg.get('stream') else ''}, "
             f"{cfg['max_new_tokens']} output tokens, {cfg['seconds']:g} s per cell, load generator {cfg.get('loadgen')}. "
             "CPU per request is each process group's user + system time over the window, divided by the requests. "
             f"The mesh arms route with `{cfg.get('broker_policy') or 'default'}`, the Rust router with "
             f"`{cfg.get('sglang_router_policy') or 'round_robin'}`.",
             f"mesh bench http --arms {','.join(cfg['arms'])} --concurrency {conc} --seconds {cfg['seconds']:g} "
             f"--path {cfg['path']}{' --stream' if cfg.get('stream') else ''}"
             f"{' --tokenizer ' + _tokenizer_arg(cfg) if cfg.get('tokenizer') else ''}"
             f"{' --prompt-tokens ' + str(cfg['prompt_tokens']) if cfg.get('prompt_tokens') else ''}"
             f"{_chat_workload_args(cfg)}"
             f"{' --broker-policy ' + cfg['broker_policy'] if cfg.get('broker_policy') else ''}"
             f"{' --profile' if cfg.get('profile') else ''} --json {src}")
    rows = []
    for c in cfg["concurrency"]:
        for name in cfg["arms"]:
            cell = next((x for x in d["cells"] if x["arm"] == name and x["c"] == c), None)
            if cell is None:
                status = (d.get("arms", {}).get(name) or {}).get("status", "not run")
                rows.append([name, str(c), status, "", "", "", ""])
                continue
            us = cell.get("cpu_us_per_req") or {}
            rows.append([name, str(c), _num(cell["rps"]),
                         f"{_num(cell['p50_ms'], '{:.2f}')} / {_num(cell['p99_ms'], '{:.2f}')} / {_num(cell['max_ms'], '{:.1f}')}",
                         _num(us.get("gateways"), "{:,.0f} µs"), _num(us.get("router"), "{:,.0f} µs"),
                         _num(us.get("adapters"), "{:,.0f} µs")])
    p.tables.append((["arm", "c", "req/s", "p50 / p99 / max ms", "gateways CPU/req", "router CPU/req", "adapters CPU/req"], rows))
    targets = [[t["name"], str(t["c"]), f"{t['op']} {t['target']:g} {t.get('unit', '')}".strip() if t.get("target") is not None else "-",
                _num(t.get("value"), "{:,.3g}"), _num(t.get("sglang_router"), "{:,.3g}"), t["result"]]
               for t in d.get("targets", [])]
    if targets:
        p.tables.append((["target", "c", "goal", "mesh", "sglang_router", "result"], targets))
    _http_budget(p, d)
    prof = _http_profiles(d["cells"])
    if prof:
        p.tables.append((["arm, c, process (samples)", "#", "self", "%", "inclusive", "%"], prof))
        p.notes.append("Profiles: py-spy at 100 Hz over the cell (warm-up included), one process per role; *self* is the "
                       "innermost frame of a sample (where the CPU was), *inclusive* any frame on its stack. "
                       "`Runner.run` (asyncio) self time is the event loop's own C code: polling and socket syscalls.")
    m = d.get("machine") or {}
    p.notes.append(f"Machine: {m.get('cpus', '-')} CPUs, load average {m.get('loadavg_at_start', '-')} at the start.")
    return p


def _http_budget(p: Page, d: dict[str, Any]) -> None:
    """The CPU budget at the highest concurrency (``mesh.lab.bench.http_bench.cpu_budget``): what
    each arm's CPU per request was made of, and the path's CPU at which it would match the Rust router."""
    budget = d.get("budget") or []
    if not budget:
        return
    top = max(r["c"] for r in budget)
    rows = [r for r in budget if r["c"] == top]
    p.tables.append((["arm", "c", "req/s", "load generator CPU/req", "engines CPU/req", "path CPU/req", "total",
                      "cores busy", "path CPU/req to match the Rust router", "path / that"],
                     [[r["arm"], str(r["c"]), _num(r["rps"]), _num(r["loadgen_us"], "{:,.0f} µs"),
                       _num(r["engines_us"], "{:,.0f} µs"), _num(r["path_us"], "{:,.0f} µs"), _num(r["total_us"], "{:,.0f} µs"),
                       _num(r["cores_busy"], "{:.2f}"), _num(r["match_path_us"], "{:,.0f} µs"),
                       _num(r["path_over_match"], "{:.2f}x")] for r in rows]))
    cpus = (d.get("machine") or {}).get("cpus_usable") or (d.get("machine") or {}).get("cpus")
    busy = [r["cores_busy"] for r in rows]
    note = (f"CPU budget at c={top}: every arm kept {min(busy):.2f}-{max(busy):.2f} of the machine's {cpus} CPUs busy, "
            "so req/s is those CPUs divided by the total CPU per request (load generator + engines + path); "
            "the path's CPU per request is what bounds it. *Path CPU/req to match the Rust router*: the path's "
            "CPU per request at which the arm, with the CPU it had and the same load generator and engine cost, "
            "would have served the Rust router's req/s.")
    full = next((r for r in rows if r["arm"] == "broker_adapters" and r["match_path_us"]), None)
    if full:
        note += (f" The full path spent {full['path_us']:,.0f} µs per request where {full['match_path_us']:,.0f} µs "
                 f"would match ({full['path_over_match']:.2f}x).")
    zmq = next((r for r in rows if r["arm"] == "broker_zmq" and r.get("path_us_at_1_5x") is not None), None)
    if zmq:
        at = zmq["path_us_at_1_5x"]
        note += (f" broker_zmq at 1.5x the Rust router's req/s would need a path of {at:,.0f} µs per request "
                 f"(it spent {zmq['path_us']:,.0f})." if at > 0 else
                 " broker_zmq cannot reach 1.5x the Rust router's req/s on this machine with any path: its load "
                 "generator and workers alone cost more per request than that rate leaves.")
    p.notes.append(note)


def _tokenizer_arg(cfg: dict[str, Any]) -> str:
    """``builtin`` when the bench built its tokenizer under its logs, else the folder's name (no machine path)."""
    tok, logs = str(cfg.get("tokenizer") or ""), str(cfg.get("log_dir") or "")
    return "builtin" if logs and tok.startswith(logs) else Path(tok).name


def _http_profiles(cells: list[dict[str, Any]], top: int = 8) -> list[list[str]]:
    rows: list[list[str]] = []
    for cell in cells:
        for role, prof in (cell.get("profile") or {}).items():
            label = f"{cell['arm']}, c={cell['c']}, {role}"
            if "error" in prof:
                rows.append([label, "", f"no profile: {prof['error']}", "", "", ""])
                continue
            selfs, incl = prof.get("self") or [], prof.get("inclusive") or []
            for i in range(min(top, max(len(selfs), len(incl)))):
                a = selfs[i] if i < len(selfs) else {}
                b = incl[i] if i < len(incl) else {}
                rows.append([f"{label} ({prof.get('samples', 0):,})" if i == 0 else "", str(i + 1),
                             f"`{a['frame']}`" if a else "", _num(a.get("pct"), "{:.1f}"),
                             f"`{b['frame']}`" if b else "", _num(b.get("pct"), "{:.1f}")])
    return rows


def _replay(d: dict[str, Any], src: str) -> Page:
    cfg, wl, cmp = d["config"], d["workload"], d["comparison"]
    s = cfg["slowdown"]
    source = f"--trace {cfg['trace']}" if cfg.get("trace") else f"--workload {cfg['workload']} --rate {cfg['rate']:g}"
    p = Page("Real-process replay beside mesh sim",
             f"{wl['requests']} requests of {wl['name']} ({wl['span_s']:.0f} s of arrivals) replayed through real processes: "
             f"{cfg['workers']} `mesh stub-sglang` engines behind adapters, {cfg['routers']} brokers "
             f"({cfg['provider']}{', exchange' if cfg['exchange'] and cfg['routers'] > 1 else ''}), open-loop HTTP clients on "
             f"the trace's clock x {cfg['time_scale']:g}; engines and clock slowed {s:g}x (times are real ms; / {s:g} for the "
             "full-speed engine). `mesh sim` replays the same stream through the same fleet shape.",
             f"mesh bench replay {source} --max-requests {cfg['max_requests']} --time-scale {cfg['time_scale']:g} "
             f"--slowdown {s:g} --workers {cfg['workers']} --routers {cfg['routers']} --provider {cfg['provider']}"
             f"{'' if cfg['exchange'] else ' --no-exchange'} --json {src}")
    rows = []
    for pol in cfg["policies"]:
        r, m = d["real"][pol], d["sim"][pol]
        rows.append([SHORT.get(pol, pol), _pair(r["ttft_p50_ms"], m["ttft_p50_ms"], "{:,.0f}"),
                     _pair(r["ttft_p95_ms"], m["ttft_p95_ms"], "{:,.0f}"), _num(cmp["p95_real_over_sim"].get(pol), "{:.2f}x"),
                     _pair(r["goodput"], m["goodput"], "{:.3f}"), _pair(r["hit_rate"], m["hit_rate"], "{:.3f}"),
                     _num(r["lag_p95_ms"], "{:,.0f} ms"), _num((r.get("cpu_wait_worst") or [None] * 3)[2], "{:.1%}"),
                     "CPU-bound" if r["cpu_bound"] else "ok"])
    p.tables.append((["policy", "TTFT p50 real / sim", "TTFT p95 real / sim", "p95 real/sim", "goodput real / sim",
                      "hit real / sim", "send lag p95", "most CPU wait", "result"], rows))
    p.notes.append(f"Ranking by TTFT p95: real {' < '.join(SHORT.get(x, x) for x in cmp['ranking_real'])}; sim "
                   f"{' < '.join(SHORT.get(x, x) for x in cmp['ranking_sim'])}: {'agree' if cmp['ranking_agrees'] else 'differ'}; "
                   f"every p95 within {cmp['p95_tolerance']:.0%}: {'yes' if cmp['p95_within_tolerance'] else 'no'}.")
    if cmp.get("pays"):
        p.notes.append("What cache_aware pays per request (the baseline's mean TTFT minus its own), real / sim (the "
                       "policy-level audit's twin, `mesh sim --audit`, on the same slice): "
                       + "; ".join(f"{SHORT.get(b, b)} {_pair(v['real_ms'], v['sim_ms'], '{:+,.0f}')} ms"
                                   for b, v in cmp["pays"].items()) + ".")
        ef = d.get("engine_fit")
        fc = cmp.get("fitted")
        if ef and fc:
            p.notes.append(f"On the engine fitted to the real cache_aware run: ranking "
                           f"{' < '.join(SHORT.get(x, x) for x in fc['ranking'])}: {'agree' if fc['ranking_agrees'] else 'differ'}; "
                           "p95 real/sim " + ", ".join(f"{SHORT.get(x, x)} {_num(v, '{:.2f}x')}" for x, v in fc["p95_real_over_sim"].items())
                           + f"; every p95 within {cmp['p95_tolerance']:.0%}: {'yes' if fc['p95_within_tolerance'] else 'no'}.")
        if ef and all(v.get("fitted_ms") is not None for v in cmp["pays"].values()):
            p.notes.append(f"On the engine fitted to the real cache_aware run's mean TTFT and time per output token "
                           f"(`mesh sim --audit` fits a recording so; prefill x{ef['prefill_speed']:.2f}, decode "
                           f"x{ef['decode_speed']:.2f} of the stubs' own, {ef['evaluations']} simulator runs): "
                           + "; ".join(f"{SHORT.get(b, b)} {_pair(v['real_ms'], v['fitted_ms'], '{:+,.0f}')} ms"
                                       for b, v in cmp["pays"].items()) + " (real / fitted sim).")
    if d.get("cpu_bound"):
        p.notes.append("**CPU-bound**: the real figures above measure this machine's CPU more than the mesh: "
                       + "; ".join(d["cpu_bound_reasons"]) + ".")
    m = d.get("machine") or {}
    p.notes.append(f"Machine: {m.get('cpus', '-')} CPUs, load average {m.get('loadavg_at_start', '-')} at the start.")
    return p


# ----------------------------------------------------------------------------- the quality matrix


def _matrix_cells(d: dict[str, Any], subject: str) -> list[dict[str, Any]]:
    """Cells in one shape whatever the file: {label, seeds: {seed: {arms: {policy: figures}, subject, noise}}}.

    ``mesh sim --matrix --json`` keeps every arm in ``seeds[s]["arms"]`` (a list) and its judgement in
    ``seeds[s]["analysis"]``; the compact summary keeps ``seeds[s][policy]`` and the subject's
    judgement and the noise arm's ratio per seed beside ``seeds``."""
    out = []
    for c in d["cells"]:
        seeds = {}
        for s, run in c["seeds"].items():
            if isinstance(run.get("arms"), list):
                an = run.get("analysis") or {}
                seeds[s] = {"arms": {a["policy"]: a for a in run["arms"]},
                            "subject": (an.get("policies") or {}).get(subject), "noise": an.get("noise")}
            else:
                seeds[s] = {"arms": run, "subject": (c.get(subject) or {}).get(s), "noise": (c.get("noise") or {}).get(s)}
        out.append({"label": c["label"], "seeds": seeds})
    return out


def _per_seed(seeds: dict[str, Any], get: Callable[[dict[str, Any]], Any], spec: str) -> str:
    return " / ".join(_num(get(v), spec) for v in seeds.values())


def _matrix(d: dict[str, Any], src: str) -> Page:
    mc = d.get("matrix") or {}
    pols = d["summary"]["policies"]
    subject = mc.get("subject") or ("cache_aware" if "cache_aware" in pols else next(iter(pols)))
    cells = _matrix_cells(d, subject)
    seeds = list(cells[0]["seeds"]) if cells else []
    # the matrix's own order; the compact summary keeps it in its arms (noise arms, "policy@b", aside)
    order = mc.get("policies") or d.get("policies")
    if not order:
        first = next(iter(cells[0]["seeds"].values()))["arms"] if cells else pols
        order = [a for a in first if "@" not in a]
    others = [p for p in order if p != subject]
    # the compact summary (docs/quality-matrix-summary.json) is cut from the JSON of this command
    path = mc.get("path") or d.get("matrix_path") or "configs/quality-matrix.toml"
    out = src if mc else "matrix.json"
    p = Page("Routing quality matrix",
             f"Every policy on the identical request stream in each cell (workload, load L, workers W, routers R), "
             f"in `mesh sim`, seeds {' and '.join(seeds)} (figures are per seed, \"seed {' / seed '.join(seeds)}\"). "
             f"`{subject}` is judged against the best other policy: it loses a cell when its TTFT p95 is more than 5 % "
             "above, or its goodput more than 1 point below, on any seed. The noise column is the same policy with "
             "its workers named in another order (the cell's noise floor), when the matrix runs it.",
             f"mesh sim --matrix {path} --seeds {','.join(seeds)} --json {out}")
    sm = d["summary"]
    p.tables.append((["policy", "won", "within 5 %", "lost"],
                     [[k, str(v["win"]), str(v["within"]), str(v["lose"])] for k, v in sm["policies"].items()]))
    n = sm["cells"]
    tg = sm.get("targets_passed") or {}
    p.notes.append(f"Targets for `{subject}`, every cell and every seed: TTFT p95 <= 1.05x the best other "
                   f"{tg.get('ttft_p95', '-')} / {n}; goodput >= the best other's - 1 point {tg.get('goodput', '-')} / {n}; "
                   f"hit rate >= 0.9x greedy's {tg.get('hit_rate', '-')} / {n}; all three {sm.get('cells_all_targets', '-')} / {n}."
                   + (f" Losing cells: {', '.join(sm['losing_cells'])}." if sm.get("losing_cells") else ""))
    noise = any(v["noise"] for c in cells for v in c["seeds"].values())
    head = ["cell", *[f"{SHORT.get(o, o)} p95 ms" for o in others], f"{subject} p95 ms", "/ best other",
            *(["noise"] if noise else []), "Δ goodput pts", f"hit: {subject} vs greedy", "verdict"]
    rows = []
    for c in cells:
        s = c["seeds"]
        rows.append([c["label"],
                     *[_per_seed(s, lambda v, o=o: (v["arms"].get(o) or {}).get("ttft_p95_ms"), "{:,.0f}") for o in others],
                     _per_seed(s, lambda v: (v["arms"].get(subject) or {}).get("ttft_p95_ms"), "{:,.0f}"),
                     _per_seed(s, lambda v: (v["subject"] or {}).get("p95_ratio"), "{:.2f}"),
                     *([_per_seed(s, lambda v: (v["noise"] or {}).get("p95_ratio"), "{:.2f}")] if noise else []),
                     _per_seed(s, lambda v: None if v["subject"] is None else v["subject"]["goodput_diff"] * 100, "{:+.1f}"),
                     _per_seed(s, lambda v: (v["arms"].get(subject) or {}).get("hit_rate"), "{:.2f}") + " vs "
                     + _per_seed(s, lambda v: (v["arms"].get("cache_aware_greedy") or {}).get("hit_rate"), "{:.2f}"),
                     _per_seed(s, lambda v: (v["subject"] or {}).get("status"), "{}")])
    p.tables.append((head, rows))
    if not mc:
        p.notes.append(f"`{src}` is the compact form of that command's JSON (`mesh report matrix.json --compact {src}`): "
                       "every arm's headline figures, the judgement per seed, the noise arm, the regret check and the "
                       "router rows.")
    routers = sm.get("routers") or []
    if routers:
        two = any("ratios_two_orders" in r for r in routers)  # both worker namings' geometric mean (the noise arm)
        p.tables.append((["cells", *[f"{r} routers over 1" for r in routers[0]["ratios"]], "within 5 %",
                          *(["both namings", "within 5 % on both"] if two else [])],
                         [[r["cells"], *[" / ".join(_num(x, "{:.2f}") for x in by.values()) for by in r["ratios"].values()],
                           "yes" if r["within_5pct"] else "no",
                           *([", ".join(f"R{k} " + " / ".join(_num(x, "{:.2f}") for x in by.values())
                                        for k, by in (r.get("ratios_two_orders") or {}).items()),
                              "yes" if r.get("within_5pct_two_orders") else "no"] if two else [])]
                          for r in routers]))
    rg = sm.get("regret")
    if isinstance(rg, dict) and rg.get("runs"):
        alt = "; ".join(f"{k}: {v['within_25pct']} within 25 %, sign right in {v['sign_right']}"
                        for k, v in rg.items() if k in ("observed", "shadow") and isinstance(v, dict))
        p.notes.append(f"Regret audit (docs/routing.md): its predicted \"pays X ms\" is within 25 % of the measured "
                       f"{subject} - best other mean TTFT difference in {rg['within_25pct']} of {rg['runs']} cell-seeds "
                       f"(target {rg.get('target_share', 0.8):.0%}), sign right in {rg.get('sign_right', '-')}"
                       + (f"; {alt}" if alt else "")
                       + (f"; within 25 % or within the measured difference's 95 % confidence interval (paired batch "
                          f"means) in {rg['within_25pct_or_ci95']} of {rg['ci95_runs']}" if "within_25pct_or_ci95" in rg else "")
                       + (f"; an estimator exact in expectation would be within 25 % in about "
                          f"{rg['exact_within_25pct_expected']:.0f} of {rg['ci95_runs']}, given each measured difference's "
                          f"own noise (the check's ceiling on these runs)" if "exact_within_25pct_expected" in rg else "")
                       + ".")
        if rg.get("replication"):  # how the measured difference and the twin were repeated (mesh sim --matrix)
            p.notes.append(rg["replication"][0].upper() + rg["replication"][1:] + ".")
        tw = rg.get("twin")
        if isinstance(tw, dict) and tw.get("runs"):
            p.notes.append(f"Policy-level audit (the twin, `mesh sim --audit`: each stream through {subject} and the "
                           f"baselines on the twin's own draws): "
                           + (f"per cell (its seeds pooled) within 25 % of the measured difference in {tw['cells_within_25pct']} "
                              f"of {tw['cells']} cells (target {rg.get('target_share', 0.8):.0%}); per cell-seed "
                              f"within 25 % in {tw['within_25pct']} of {tw['runs']}, "
                              if tw.get("cells") else
                              f"within 25 % of the measured difference in {tw['within_25pct']} of {tw['runs']} cell-seeds "
                              f"(target {rg.get('target_share', 0.8):.0%}), ")
                           + f"within 25 % or the 95 % interval in {tw.get('within_25pct_or_ci95', '-')}, sign right in "
                           f"{tw['sign_right']}"
                           + (f"; {tw['verdict_text']}" if isinstance(tw.get("verdict_text"), str) else "")
                           + (f"; {tw['worst_miss']['text']}" if isinstance(tw.get("worst_miss"), dict) else "")
                           + (f"; {tw['bias']['text']}" if isinstance(tw.get("bias"), dict) else "") + ".")
        ft = rg.get("twin_fit")
        if isinstance(ft, dict) and ft.get("runs"):
            p.notes.append(f"The twin's engine started {ft['engine_error']:g}x as fast as the arms' (a fleet described wrongly) "
                           f"and was fitted to the {subject} arm's mean TTFT and time per output token before each audit "
                           f"(`mesh sim --audit --fit-engine`): converged in {ft['converged']} of {ft['runs']} runs, "
                           f"{ft['evaluations_mean']:.1f} simulator runs each, prefill speed "
                           f"{ft['prefill_speed'][0]:.2f}-{ft['prefill_speed'][1]:.2f}x and decode speed "
                           f"{ft['decode_speed'][0]:.2f}-{ft['decode_speed'][1]:.2f}x of where it started.")
    return p


#: the figures of one arm the compact matrix summary keeps
_COMPACT_FIGURES = ("ttft_p50_ms", "ttft_p95_ms", "goodput", "hit_rate", "worker_cv")


def compact_matrix(d: dict[str, Any]) -> dict[str, Any]:
    """The compact form of a ``mesh sim --matrix --json`` report (``docs/quality-matrix-summary.json``):
    per cell and seed every arm's headline figures, the subject's judgement, the noise arm, the targets
    and the regret check; the summary as it is. :func:`render` draws the same page from either form."""
    mc = d.get("matrix") or {}
    subject = mc.get("subject") or "cache_aware"
    cells = []
    for c in d["cells"]:
        out: dict[str, Any] = {"label": c["label"], "seeds": {}, subject: {}, "noise": {}, "targets": {}, "regret": {}}
        for s, run in c["seeds"].items():
            out["seeds"][s] = {a["policy"]: {k: a.get(k) for k in _COMPACT_FIGURES} for a in run["arms"]}
            an = run.get("analysis") or {}
            out[subject][s] = (an.get("policies") or {}).get(subject)
            for k in ("noise", "targets", "regret"):
                if k in an:
                    out[k][s] = an[k]
        cells.append({k: v for k, v in out.items() if v != {} or k in ("label", "seeds")})
    out_d: dict[str, Any] = {"summary": d["summary"], "cells": cells}
    if mc.get("path"):
        out_d["matrix_path"] = mc["path"]
    if mc.get("policies"):
        out_d["policies"] = list(mc["policies"])  # the table's column order (the arms' keys are sorted in the file)
    return out_d


_RENDER: dict[str, Callable[[dict[str, Any], str], Page]] = {
    "broker": _broker, "routing": _routing, "indexer": _indexer, "exchange": _exchange, "http": _http, "replay": _replay,
    "matrix": _matrix,
}


def render(kind: str, data: dict[str, Any], src: str) -> Page:
    """The page for one JSON result of ``kind``; ``src`` is the path the command wrote it to."""
    return _RENDER[kind](data, src)


# ----------------------------------------------------------------------------- markdown


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |"

    align = ["---" if i == 0 else "---:" for i in range(len(head))]
    if head and head[-1] in ("verdict", "result", "target", "within 5 %"):
        align[-1] = "---"
    return [line(head), "|" + "|".join(align) + "|", *(line(r) for r in rows)]


def to_markdown(page: Page, *, src: str, date: str) -> str:
    out = [f"# {page.title}", "",
           f"<!-- generated by `mesh report` from {src}: do not edit, the next run replaces this page -->", "",
           page.about, "", f"- Command: `{page.command}`", f"- Date: {date}", f"- Source: `{src}`", ""]
    for head, rows in page.tables:
        out += [*_table(head, rows), ""]
    for note in page.notes:
        out += [note, ""]
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------- command


def _date_of(path: Path) -> str:
    return dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


_DESCRIPTION = ("Render the JSON of `mesh bench ... --json F` and `mesh sim --matrix ... --json F` as markdown "
                "pages (one per file: a table, the command that made it and the date), replacing each page.")


def build_parser() -> argparse.ArgumentParser:
    return _add_arguments(argparse.ArgumentParser(prog="mesh report", description=_DESCRIPTION))


def add_report_parser(sub) -> argparse.ArgumentParser:
    """Add ``report`` to the ``mesh`` command's subparsers."""
    p = _add_arguments(sub.add_parser("report", help="result pages in docs/results/ from bench and matrix JSON",
                                      description=_DESCRIPTION))
    p.set_defaults(func=write_pages)
    return p


def _add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("inputs", nargs="+", help="JSON result files")
    ap.add_argument("--out", default="docs/results", help="folder for the pages (default docs/results)")
    ap.add_argument("--kind", choices=KINDS, help="the inputs' kind (default: recognised from each file's keys)")
    ap.add_argument("--date", help="the date printed on the pages (default: each file's modification time, UTC)")
    ap.add_argument("--compact", metavar="FILE", help="with one matrix input: also write its compact form to FILE "
                                                      "(docs/quality-matrix-summary.json), from which the page renders")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    return write_pages(build_parser().parse_args(argv))


def write_pages(args: argparse.Namespace) -> int:
    """Write one page per input; 0 when every input was rendered, 2 when one could not be."""
    out_dir = Path(args.out)
    failed = 0
    for name in args.inputs:
        path = Path(name)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"mesh report: {name}: {exc}", file=sys.stderr)
            failed += 1
            continue
        kind = args.kind or detect_kind(data)
        if kind is None:
            print(f"mesh report: {name}: not the JSON of a mesh bench or mesh sim --matrix run", file=sys.stderr)
            failed += 1
            continue
        try:
            if getattr(args, "compact", None) and kind == "matrix" and "matrix" in data:
                data, name = compact_matrix(data), args.compact  # the page then names the compact file as its source
                Path(name).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
                print(f"wrote {name}")
            page = render(kind, data, name)
        except (KeyError, TypeError, ValueError, AttributeError, StopIteration) as exc:
            print(f"mesh report: {name}: not a {kind} result ({type(exc).__name__}: {exc})", file=sys.stderr)
            failed += 1
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        target = out_dir / f"{page_name(kind, data)}.md"
        target.write_text(to_markdown(page, src=name, date=args.date or _date_of(path)))
        print(f"wrote {target}")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
