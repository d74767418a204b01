"""``mesh bench tokenize-load``: does tokenizing 8k-token HTTP prompts disturb the broker's routing?

Issue 14's target: *tokenization off-loop: broker decision latency unchanged by concurrent 8k-token
HTTP prompts*. One invocation starts one real ``mesh broker`` (``--http`` with ``--tokenizer``,
``--metrics``) in front of instant ZeroMQ workers (``mesh worker-stub --instant``) and measures, in
consecutive phases against the same broker process:

1. ``idle``: the probe only.
2. ``embedded``: the probe, while ``--http-concurrency`` closed-loop HTTP clients (wrk when on PATH,
   else the built-in generator of :mod:`mesh.lab.bench.http_load`) send ``/v1/completions`` requests
   with a ``--prompt-tokens`` (default 8,192) text prompt and ``max_tokens`` 1 to the broker's own
   HTTP ingress, which tokenises each prompt in its thread pool before routing it.
3. ``gateway``: the same HTTP load through ``mesh gateway --tokenizer ... --broker <broker>`` (its own
   process, started for this phase), which tokenises and submits over the client protocol: the
   broker routes the same 8k-token requests but tokenises nothing.
4. ``control`` (unless ``--no-control``): the same 8k-token prompts, tokenised once by the harness,
   submitted as token ids over ZeroMQ at the rate the ``embedded`` phase achieved. The broker routes
   the same mix of decisions as in ``embedded`` with no tokenizer working in it: what the 8k-token
   decisions themselves cost (index match and scoring over 512 pages instead of one), so the
   loaded/control ratio isolates the tokenizer's effect from the prompts'.

**The probe**: a :class:`mesh.client.Client` on the broker's frontend sends small token-id requests
(16 ids, ``max_new_tokens`` 1) at ``--probe-rate`` per second (open loop, default 200/s; 0 = one at a
time, closed loop) and records each round trip. Per phase, over the same measured window
(``--duration-s``, after ``--warmup-s`` of load):

- probe round trip p50/p99/max (ms) and requests completed;
- **decision latency**: the broker's ``mesh_decision_latency_seconds`` histogram (the time of
  ``router.route()``, the decision alone) from its ``--metrics`` endpoint, as the delta between the
  window's two scrapes: mean (exact: delta sum / delta count) and p50/p99 estimated from the
  buckets (linear inside a bucket, as Prometheus' ``histogram_quantile``). It covers every decision
  in the window: the probe's and, in the loaded phases, the 8k-token requests';
- **loop lag**: ``broker.loop_lag_ms`` from STATUS (the broker's time-weighted average of stalls, what
  its load shedding reads), sampled every 0.5 s: mean and max; and the ``mesh_loop_lag_seconds``
  histogram's delta (every pump's lateness plus its own duration): mean and estimated p99;
- **HTTP req/s and prompt tokens/s** over the window, from the broker's own counters (requests
  finished ``ok`` minus the probe's, ``mesh_routed_prompt_tokens`` minus the probe's tokens), and the
  load generator's own figures (its window is the measured one plus up to 1 s; 2xx answers, errors,
  HTTP p50/p99);
- **CPU** (``/proc``, :mod:`mesh.lab.bench.proc_cpu`) of the broker, workers, gateway and harness over the
  window: broker CPU per probe request (the figure asked for; it includes the HTTP work in the
  loaded phases) and per routed request (probe + HTTP), and the broker's share of a core.

**Targets** (PASS/MISS, judged for ``embedded`` and ``gateway`` against ``control``, the same 8k-token
prompts routed without any tokenizer, so that the ratio is the tokenizer's own effect; against ``idle``
with ``--no-control``; the other comparison is printed as ``info``). Against idle the loaded phases
also route 8k-token prompts, whose decisions (a match over 512 pages) are slower than the probe's
16-id ones: measured, control's decision p99 is already about 2.4x idle's with no tokenizer anywhere.

- *decision p99 <= 1.5x control.* The decision is CPU work on the loop's thread, microseconds long. If
  tokenising really runs off the loop it stays the same; if a tokenizer thread takes the GIL in the
  middle of a decision, that decision waits a GIL switch interval (5 ms, ``sys.getswitchinterval``)
  or a tokenizer call's length: 20-100x a decision, visible at p99 as soon as 1 % of decisions are
  hit. The histogram's buckets are about 1.6x apart (10, 15, 25, 40, 60, 100 us, ...), so 1.5x is
  about the smallest change the interpolated p99 resolves.
- *probe p99 <= 3x control.* The round trip adds four ZeroMQ hops and the harness's own scheduling; on a
  2-core machine the harness shares its core with the load generator, the workers and (``gateway``)
  the gateway's tokenizing, so some of its growth is the harness's, not the broker's. 3x leaves that
  room and still fails a broker whose loop or core is held for milliseconds at a time: tokenising in
  the broker's own process (``embedded``) takes its core (about 3 ms of CPU per 8k-token prompt), and
  the other clients' round trips pay for it; that is what ``mesh gateway`` is for.

A MISS does not fail the command; a broken phase (no probe answers, no 2xx HTTP answers) does.

**CPU placement** (default with 2+ CPUs; ``--no-pin`` turns it off): every thread of the broker
(its loop, ZeroMQ I/O thread, tokenizer pool, metrics server) on one CPU, everything else (harness,
workers, gateway, load generator) on the others, as in ``mesh bench broker``
(:mod:`mesh.lab.bench.cpu_pinning`). In ``embedded`` the tokenizer pool then competes with the loop
for the broker's core (what embedding means on a busy machine); in ``gateway`` the tokenizing
happens on the other core, as on a separate machine. The JSON records the placement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh.lab.bench.report import finish, fmt as _f
from mesh.stats import percentile

__all__ = ["run_tokenize_load", "print_results", "evaluate_targets", "hist_quantile", "parse_metrics",
           "add_bench_tokenize_load_parser", "DECISION_P99_MAX_RATIO", "PROBE_P99_MAX_RATIO"]

DECISION_P99_MAX_RATIO = 1.5
PROBE_P99_MAX_RATIO = 3.0
PHASES = ("idle", "embedded", "gateway", "control")
_PROBE_IDS = 16
_STARTUP_S = 60.0
_DRAIN_S = 2.0
_MODEL = "mesh"  # the broker's --model-name default: accepted in a one-model fleet


# ----------------------------------------------------------------------------- metrics


def parse_metrics(text: str) -> dict[str, Any]:
    """The figures this benchmark reads from a broker's Prometheus text: the decision-latency and
    loop-lag histograms (cumulative buckets, sum, count), requests by outcome, routed prompt tokens."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"decision": {"buckets": [], "sum": 0.0, "count": 0.0},
                           "loop_lag": {"buckets": [], "sum": 0.0, "count": 0.0},
                           "requests": {}, "prompt_tokens": 0.0}
    hists = {"mesh_decision_latency_seconds": "decision", "mesh_loop_lag_seconds": "loop_lag"}
    for fam in text_string_to_metric_families(text):
        if fam.name in hists:
            h = out[hists[fam.name]]
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    le = s.labels["le"]
                    h["buckets"].append((float("inf") if le == "+Inf" else float(le), s.value))
                elif s.name.endswith("_sum"):
                    h["sum"] = s.value
                elif s.name.endswith("_count"):
                    h["count"] = s.value
            h["buckets"].sort()
        elif fam.name in ("mesh_requests", "mesh_requests_total"):  # the family's name depends on the TYPE line
            for s in fam.samples:
                if s.name == "mesh_requests_total":
                    out["requests"][s.labels.get("outcome", "")] = s.value
        elif fam.name in ("mesh_routed_prompt_tokens", "mesh_routed_prompt_tokens_total"):
            for s in fam.samples:
                if s.name == "mesh_routed_prompt_tokens_total":
                    out["prompt_tokens"] = s.value
    return out


def hist_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Quantile ``q`` of a histogram given as sorted (upper bound, cumulative count) pairs, linear
    inside the bucket that holds it (Prometheus' ``histogram_quantile``); in the +Inf bucket, the
    highest finite bound. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, cum in buckets:
        if cum >= rank and cum > lo_count:
            if bound == float("inf"):
                return lo_bound
            return lo_bound + (bound - lo_bound) * (rank - lo_count) / (cum - lo_count)
        if bound != float("inf"):
            lo_bound = bound
        lo_count = cum
    return lo_bound


def _hist_delta(a: dict, b: dict) -> dict:
    """b - a of one histogram: count, mean and estimated p50/p99, in seconds."""
    prev = dict(a["buckets"])
    buckets = [(le, max(0.0, c - prev.get(le, 0.0))) for le, c in b["buckets"]]
    n = b["count"] - a["count"]
    s = b["sum"] - a["sum"]
    return {"count": int(n), "mean_s": s / n if n > 0 else None, "p50_s": hist_quantile(buckets, 0.5),
            "p99_s": hist_quantile(buckets, 0.99), "buckets": [[("+Inf" if le == float("inf") else le), int(c)]
                                                               for le, c in buckets]}


# ----------------------------------------------------------------------------- helpers


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 3)


def _probe_ids(i: int) -> list[int]:
    base = 1000 + (i % 4096) * _PROBE_IDS
    return [base + j for j in range(_PROBE_IDS)]


class _Sender:
    """Requests over the ZeroMQ client: open loop at ``rate``/s (``rate`` 0: one at a time), at most
    ``max_inflight`` outstanding (a send due while that many are out is counted as ``skipped``)."""

    def __init__(self, client, make_ids: Callable[[int], list[int]], rate: float, max_inflight: int = 256) -> None:
        self.client, self.make_ids, self.rate, self.max_inflight = client, make_ids, rate, max_inflight
        self.lat: list[float] = []
        self.errors: dict[str, int] = {}
        self.sent = 0
        self.skipped = 0
        self.prompt_tokens = 0  # of the requests answered

    async def _one(self, i: int) -> None:
        from mesh.errors import RequestError

        ids = self.make_ids(i)
        t0 = time.perf_counter()
        try:
            await self.client.generate(input_ids=ids, max_new_tokens=1, stream=False, deadline_ms=10_000, resubmit=0)
        except RequestError as exc:
            code = getattr(exc.code, "value", str(exc.code))
            self.errors[code] = self.errors.get(code, 0) + 1
            return
        self.lat.append(time.perf_counter() - t0)
        self.prompt_tokens += len(ids)

    async def run(self, stop_at: float) -> None:
        import asyncio

        perf = time.perf_counter
        if self.rate <= 0:
            while perf() < stop_at:
                self.sent += 1
                await self._one(self.sent)
            return
        interval = 1.0 / self.rate
        pending: set = set()
        next_t = perf()
        while True:
            now = perf()
            if next_t >= stop_at:
                break
            if next_t > now:
                await asyncio.sleep(next_t - now)
            next_t += interval
            if next_t < perf() - 0.1:
                next_t = perf()  # the harness fell behind: do not burst to catch up
            if len(pending) >= self.max_inflight:
                self.skipped += 1
                continue
            self.sent += 1
            t = asyncio.create_task(self._one(self.sent))
            pending.add(t)
            t.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending, timeout=15)

    def summary(self, seconds: float) -> dict:
        lat_ms = sorted(x * 1e3 for x in self.lat)
        return {"sent": self.sent, "ok": len(self.lat), "errors": dict(self.errors), "skipped": self.skipped,
                "rps": round(len(self.lat) / seconds, 1) if seconds > 0 else None,
                "p50_ms": _r(percentile(lat_ms, 50, presorted=True) if lat_ms else None),  # None: no probe answered
                "p99_ms": _r(percentile(lat_ms, 99, presorted=True) if lat_ms else None),
                "max_ms": _r(lat_ms[-1] if lat_ms else None)}


def _self_cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _scrape(url: str) -> dict:
    import asyncio
    import urllib.request

    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    return parse_metrics(await asyncio.to_thread(get))


def _post(url: str, body: bytes, timeout_s: float = 30.0) -> tuple[int, bytes]:
    from mesh.lab.bench.http_bench import post

    return post(url, body, timeout_s)


def _wait_http_ok(url: str, body: bytes, timeout_s: float = _STARTUP_S) -> dict:
    """Send the benchmark's own request until it answers 200 (a readiness wait on the real path:
    a gateway answers 503 until it has seen a routable worker in a STATUS); returns the answer."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, data = _post(url, body)
            if status == 200:
                return json.loads(data)
            last = f"HTTP {status}: {data[:300].decode(errors='replace')}"
        except OSError as exc:
            last = repr(exc)
        time.sleep(0.1)  # polling interval of a readiness wait
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f}s ({last})")


# ----------------------------------------------------------------------------- run


def run_tokenize_load(*, duration_s: float = 8.0, warmup_s: float = 1.0, http_concurrency: int = 8,
                      prompt_tokens: int = 8192, probe_rate: float = 200.0, workers: int = 4, loadgen: str = "auto",
                      tokenizer: str = "builtin", control: bool = True, pin: bool = True,
                      log_dir: str | Path | None = None, say: Callable[[str], None] | None = None) -> dict:
    """Run the phases (see the module docstring) and return every figure as a JSON-able dict."""
    import asyncio

    from mesh.lab.bench.cpu_pinning import pin_process, pinned_self, plan
    from mesh.lab.bench.http_bench import machine, sigterm_as_interrupt, stop_front_to_back
    from mesh.lab.bench.http_load import request_body, wrk_path
    from mesh.lab.procs import ProcGroup, wait_for_log_event
    from mesh.lab.up import wait_for_workers

    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    if duration_s <= 0 or warmup_s < 0 or http_concurrency < 1 or prompt_tokens < 1 or probe_rate < 0 or workers < 1:
        raise ValueError("duration_s > 0, warmup_s >= 0, http_concurrency >= 1, prompt_tokens >= 1, probe_rate >= 0 "
                         "and workers >= 1 are required")
    if loadgen == "auto":
        loadgen = "wrk" if wrk_path() else "python"
    if loadgen not in ("wrk", "python"):
        raise ValueError(f"loadgen: expected auto, wrk or python, got {loadgen!r}")
    if loadgen == "wrk" and not wrk_path():
        raise ValueError("loadgen wrk: wrk is not on PATH")
    root = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mesh-bench-tokload-"))
    t_prep = time.perf_counter()
    if tokenizer == "builtin":
        from mesh.lab.tokenizer_builtin import build_model_dir

        tokenizer = str(build_model_dir(root / "model", tokenizer="tekken"))
    from mesh.tokenization import ModelTokenizer
    from mesh.lab.bench.tokenizer_bench import make_prompt

    mt = ModelTokenizer.from_dir(tokenizer)
    prompt = make_prompt(mt.files.tokenizer, prompt_tokens)
    prompt_ids = mt.encode(prompt)  # what the broker's ingress sends (special tokens included)
    body = request_body("/v1/completions", stream=False, max_new_tokens=1, prompt=prompt, model=_MODEL)
    prep_s = time.perf_counter() - t_prep
    place = plan() if pin else None
    res: dict = {
        "bench": "tokenize-load",
        "config": {"duration_s": duration_s, "warmup_s": warmup_s, "http_concurrency": http_concurrency,
                   "prompt_tokens": prompt_tokens, "prompt_ids_sent": len(prompt_ids), "prompt_bytes": len(prompt.encode()),
                   "body_bytes": len(body), "probe_rate": probe_rate, "probe_ids": _PROBE_IDS, "workers": workers,
                   "loadgen": loadgen, "tokenizer": tokenizer, "control": control, "path": "/v1/completions",
                   "max_tokens": 1, "log_dir": str(root)},
        "thresholds": {"decision_p99_max_ratio": DECISION_P99_MAX_RATIO, "probe_p99_max_ratio": PROBE_P99_MAX_RATIO},
        "machine": machine(),
        "pinning": place.as_dict() if place else None,
        "prep_s": round(prep_s, 2),
        "phases": {},
    }

    # SIGTERM stops the benchmark like Ctrl-C, so every process it started is stopped too
    with sigterm_as_interrupt(), pinned_self(place.harness if place else None), ProcGroup(root / "procs") as g:
        try:
            b = g.broker("broker", "--http", "127.0.0.1:0", "--tokenizer", tokenizer, "--metrics", "127.0.0.1:0",
                         "--log-level", "warning", "--drain-timeout-s", str(_DRAIN_S), timeout_s=_STARTUP_S)
            http_url = wait_for_log_event(b.log_path, "http_listening", _STARTUP_S, b.popen, start=b.log_start)["url"]
            metrics_url = wait_for_log_event(b.log_path, "metrics_listening", _STARTUP_S, b.popen,
                                             start=b.log_start)["endpoint"]
            if place:
                pin_process(b.pid, place.under_test)
            w = g.workers("workers", [b.backend], "--instant", "--log-level", "warning", count=workers, timeout_s=_STARTUP_S)
            asyncio.run(wait_for_workers(b.frontend, workers, timeout_s=_STARTUP_S))
            check = _wait_http_ok(http_url + "/v1/completions", body)
            res["embedded_check"] = {"status": 200, "usage": check.get("usage")}
            roles = {"broker": [b.pid], "workers": [w.pid]}  # the harness is this process: getrusage, not /proc
            asyncio.run(_phases(res, g, b, http_url, metrics_url, body, prompt_ids, roles, tokenizer, duration_s, warmup_s,
                                http_concurrency, probe_rate, loadgen, control, say))
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - keep the phases measured so far; the command fails
            res["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            say(f"[bench tokenize-load] FAILED: {res['error']}")
        finally:
            stop_front_to_back(g)
    try:
        res["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    res["targets"] = evaluate_targets(res["phases"])
    res["ok"] = "error" not in res and _phases_ok(res["phases"])
    return res


async def _phases(res: dict, g, b, http_url: str, metrics_url: str, body: bytes, prompt_ids: list[int], roles: dict,
                  tokenizer: str, duration_s: float, warmup_s: float, c: int, probe_rate: float, loadgen: str,
                  control: bool, say: Callable[[str], None]) -> None:
    import asyncio

    from mesh.client import Client
    from mesh.lab.procs import wait_for_log_event

    async with Client(b.frontend) as client:
        # warm the probe path (connection handshake, first decisions) before anything is measured
        warm = _Sender(client, _probe_ids, 0)
        await warm.run(time.perf_counter() + 0.3)

        ph = await _window(client, metrics_url, roles, duration_s, probe_rate)
        res["phases"]["idle"] = ph
        say(_progress("idle", ph))

        ph = await _loaded(client, metrics_url, roles, duration_s, warmup_s, probe_rate, http_url + "/v1/completions",
                           body, c, loadgen)
        res["phases"]["embedded"] = ph
        say(_progress("embedded", ph))

        gw = g._spawn("gateway", ["gateway", "--broker", b.frontend, "--http", "127.0.0.1:0", "--tokenizer", tokenizer,
                                  "--log-level", "warning"])
        gw_url = (await asyncio.to_thread(wait_for_log_event, gw.log_path, "gateway_listening", _STARTUP_S, gw.popen,
                                          start=gw.log_start))["url"]
        check = await asyncio.to_thread(_wait_http_ok, gw_url + "/v1/completions", body)
        res["gateway_check"] = {"status": 200, "usage": check.get("usage")}
        ph = await _loaded(client, metrics_url, {**roles, "gateway": [gw.pid]}, duration_s, warmup_s, probe_rate,
                           gw_url + "/v1/completions", body, c, loadgen)
        res["phases"]["gateway"] = ph
        say(_progress("gateway", ph))
        gw.stop(5)

        if control:
            rate = res["phases"]["embedded"]["http"]["rps"] or 0.0
            if rate > 0:
                ctl = _Sender(client, lambda i: prompt_ids, rate, max_inflight=c)
                ph = await _window(client, metrics_url, roles, duration_s, probe_rate, extra=ctl)
                ph["control_requests"] = ctl.summary(ph["seconds"])
                res["phases"]["control"] = ph
                say(_progress("control", ph))
            else:
                say("[bench tokenize-load] control: skipped (the embedded phase completed no HTTP request)")


async def _loaded(client, metrics_url: str, roles: dict, duration_s: float, warmup_s: float, probe_rate: float,
                  url: str, body: bytes, c: int, loadgen: str) -> dict:
    """One loaded phase: start the HTTP load, wait until its requests finish in the broker, let it
    warm up, measure the window, then collect the load generator's own result."""
    import asyncio

    from mesh.lab.bench.http_load import run_load

    m0 = await _scrape(metrics_url)
    load = asyncio.create_task(asyncio.to_thread(run_load, url, body, c, duration_s + 1.0, warmup_s=warmup_s,
                                                 loadgen=loadgen, roles=roles))
    t_end = time.monotonic() + _STARTUP_S
    while True:  # the load is flowing once its answers count in the broker (readiness, not a guess)
        m = await _scrape(metrics_url)
        if m["requests"].get("ok", 0) - m0["requests"].get("ok", 0) >= 2 or load.done() or time.monotonic() > t_end:
            break
        await asyncio.sleep(0.1)
    if load.done():
        load.result()  # raises the load generator's failure
        raise RuntimeError("the HTTP load ended before the window")
    await asyncio.sleep(warmup_s)
    ph = await _window(client, metrics_url, roles, duration_s, probe_rate)
    lg = await load
    n, errors = int(lg["requests"]), int(lg["errors"])
    ph["loadgen"] = {"tool": lg["loadgen"], "requests": n, "errors": errors, "error_detail": lg.get("error_detail", {}),
                     "ok_2xx": max(0, n - errors), "seconds": round(lg["seconds"], 3), "rps": round(lg["rps"], 1),
                     "p50_ms": _r(lg["p50_ms"]), "p99_ms": _r(lg["p99_ms"]), "max_ms": _r(lg["max_ms"]),
                     "cpu_s": {k: _r(v) for k, v in (lg.get("cpu_s") or {}).items()},
                     "loadgen_cpu_s": _r(lg.get("loadgen_cpu_s"))}
    return ph


async def _window(client, metrics_url: str, roles: dict, duration_s: float, probe_rate: float,
                  extra: _Sender | None = None) -> dict:
    import asyncio

    from mesh.lab.bench.proc_cpu import CpuSampler

    probe = _Sender(client, _probe_ids, probe_rate)
    lags: list[float] = []

    async def sample_status(stop_at: float) -> None:
        while time.perf_counter() < stop_at:
            try:
                st = await client.status(timeout_s=2.0)
                lags.append(float(st.broker.get("loop_lag_ms", 0.0)))
            except Exception:  # noqa: BLE001 - a missed sample is not a failed phase
                pass
            await asyncio.sleep(0.5)

    m0 = await _scrape(metrics_url)
    sampler = CpuSampler(roles)
    sampler.start()
    self0 = _self_cpu_s()
    t0 = time.perf_counter()
    stop_at = t0 + duration_s
    await asyncio.gather(probe.run(stop_at), sample_status(stop_at), *([extra.run(stop_at)] if extra else []))
    seconds = time.perf_counter() - t0
    cpu = sampler.stop()
    cpu["harness"] = _self_cpu_s() - self0  # probe, STATUS sampler, scrapes (its children are not in it)
    m1 = await _scrape(metrics_url)

    dec = _hist_delta(m0["decision"], m1["decision"])
    lag = _hist_delta(m0["loop_lag"], m1["loop_lag"])
    p = probe.summary(seconds)
    ok_delta = m1["requests"].get("ok", 0) - m0["requests"].get("ok", 0)
    others_ok = len(extra.lat) if extra else 0
    http_n = max(0, int(ok_delta) - p["ok"] - others_ok)
    tok_delta = m1["prompt_tokens"] - m0["prompt_tokens"]
    http_tokens = max(0.0, tok_delta - probe.prompt_tokens - (extra.prompt_tokens if extra else 0))
    if extra:  # the control phase's 8k-token requests are "the load" in its figures
        http_n, http_tokens = others_ok, float(extra.prompt_tokens)
    broker_s = cpu.get("broker")
    routed = p["ok"] + http_n
    return {
        "seconds": round(seconds, 3),
        "probe": p,
        "decision": {"count": dec["count"], "mean_us": _r(dec["mean_s"] and dec["mean_s"] * 1e6, 1),
                     "p50_us": _r(dec["p50_s"] and dec["p50_s"] * 1e6, 1),
                     "p99_us": _r(dec["p99_s"] and dec["p99_s"] * 1e6, 1), "buckets_s": dec["buckets"]},
        "loop_lag": {"status_mean_ms": _r(sum(lags) / len(lags) if lags else None, 2),
                     "status_max_ms": _r(max(lags) if lags else None, 2), "status_samples": len(lags),
                     "pumps": lag["count"], "pump_mean_ms": _r(lag["mean_s"] and lag["mean_s"] * 1e3),
                     "pump_p99_ms": _r(lag["p99_s"] and lag["p99_s"] * 1e3)},
        "http": {"requests": http_n, "rps": round(http_n / seconds, 1), "prompt_tokens_per_s": round(http_tokens / seconds),
                 # approximate: a request may finish between the two counters' reads in a scrape
                 "tokens_per_request": round(http_tokens / http_n, 1) if http_n else None,
                 "source": "broker counters over the window" if not extra else "the harness's ZeroMQ sender"},
        "cpu_s": {k: _r(v) for k, v in cpu.items()},
        "broker_cpu_share": _r(broker_s / seconds if broker_s is not None else None),
        "broker_cpu_us_per_probe": _r(broker_s / p["ok"] * 1e6 if broker_s is not None and p["ok"] else None, 1),
        "broker_cpu_us_per_routed": _r(broker_s / routed * 1e6 if broker_s is not None and routed else None, 1),
        "cpu_lost_pids": sampler.lost,
    }


def _progress(name: str, ph: dict) -> str:
    p, d, h = ph["probe"], ph["decision"], ph["http"]
    return (f"[bench tokenize-load] {name}: probe {p['ok']} ok, p50/p99 {_f(p['p50_ms'], '{:.2f}')}/{_f(p['p99_ms'], '{:.2f}')}"
            f" ms; decision mean/p99 {_f(d['mean_us'], '{:.1f}')}/{_f(d['p99_us'], '{:.1f}')} us over {d['count']}; "
            f"load {h['rps']:.1f} req/s, {h['prompt_tokens_per_s']:,} prompt tokens/s")


def _phases_ok(phases: dict) -> bool:
    for name in ("idle", "embedded", "gateway"):
        ph = phases.get(name)
        if ph is None or ph["probe"]["ok"] == 0:
            return False
        if name != "idle" and (ph["http"]["requests"] == 0 or ph.get("loadgen", {}).get("ok_2xx", 0) == 0):
            return False
    return True


# ----------------------------------------------------------------------------- targets


def evaluate_targets(phases: dict) -> list[dict]:
    """PASS/MISS rows for the loaded phases against control (the same prompts without a
    tokenizer: the tokenizer's own effect), or against idle when there is no control phase; the
    other comparison as info rows."""
    rows: list[dict] = []
    ctl = phases.get("control")
    base, other = ("control", "idle") if ctl else ("idle", None)
    for name in ("embedded", "gateway"):
        ph = phases.get(name)
        if ph is None:
            continue
        for what, key, sub, limit in (("decision p99", "decision", "p99_us", DECISION_P99_MAX_RATIO),
                                      ("probe p99", "probe", "p99_ms", PROBE_P99_MAX_RATIO)):
            ref = phases.get(base)
            v = _ratio(ph[key][sub], ref[key][sub]) if ref else None
            rows.append({"phase": name, "name": f"{what} / {base}", "limit": limit, "value": v,
                         "result": "n/a" if v is None else ("PASS" if v <= limit else "MISS")})
            if other and phases.get(other):
                rows.append({"phase": name, "name": f"{what} / {other}", "limit": None,
                             "value": _ratio(ph[key][sub], phases[other][key][sub]), "result": "info"})
    return rows


# ----------------------------------------------------------------------------- output


def print_results(res: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    cfg = res["config"]
    t = Table(title=f"mesh bench tokenize-load: {cfg['duration_s']:g} s per phase, probe {cfg['probe_rate']:g}/s "
                    f"({cfg['probe_ids']} ids), HTTP c={cfg['http_concurrency']} x {cfg['prompt_tokens']}-token "
                    f"/v1/completions ({cfg['loadgen']}), {cfg['workers']} instant workers, {res['machine']['cpus']} CPUs")
    cols = ("phase", "probe n", "probe p50 ms", "probe p99 ms", "decisions", "decision mean us", "decision p99 us",
            "loop lag mean/max ms", "pump p99 ms", "load req/s", "prompt tok/s", "HTTP 2xx / err",
            "broker CPU us/probe", "us/routed", "broker core")
    for i, col in enumerate(cols):
        t.add_column(col, justify="left" if i == 0 else "right")
    for name in PHASES:
        ph = res["phases"].get(name)
        if ph is None:
            continue
        p, d, lag, h = ph["probe"], ph["decision"], ph["loop_lag"], ph["http"]
        lg = ph.get("loadgen")
        t.add_row(name, str(p["ok"]), _f(p["p50_ms"], "{:.2f}"), _f(p["p99_ms"], "{:.2f}"), str(d["count"]),
                  _f(d["mean_us"], "{:.1f}"), _f(d["p99_us"], "{:.1f}"),
                  f"{_f(lag['status_mean_ms'], '{:.2f}')}/{_f(lag['status_max_ms'], '{:.2f}')}",
                  _f(lag["pump_p99_ms"], "{:.2f}"), _f(h["rps"], "{:.1f}"), _f(h["prompt_tokens_per_s"], "{:,.0f}"),
                  f"{lg['ok_2xx']} / {lg['errors']}" if lg else "-", _f(ph["broker_cpu_us_per_probe"]),
                  _f(ph["broker_cpu_us_per_routed"]), _f(ph["broker_cpu_share"], "{:.2f}"))
    con.print(t)
    t = Table(title="targets (this run)")
    for col, j in (("phase", "left"), ("ratio", "left"), ("limit", "right"), ("value", "right"), ("result", "left")):
        t.add_column(col, justify=j)
    for r in res["targets"]:
        style = {"PASS": "green", "MISS": "red"}.get(r["result"], "dim")
        t.add_row(r["phase"], r["name"], f"<= {r['limit']:g}" if r["limit"] is not None else "-", _f(r["value"], "{:.2f}"),
                  f"[{style}]{r['result']}[/{style}]")
    con.print(t)
    m = res["machine"]
    pin = res.get("pinning")
    con.print(f"pinning: {'broker on CPU ' + str(pin['process_under_test']) + ', the rest on ' + str(pin['harness']) if pin else 'off'}"
              f"; load average at start {m.get('loadavg_at_start')}, at end {m.get('loadavg_at_end')}; logs in {cfg['log_dir']}")
    if res.get("error"):
        con.print(f"[red]error: {res['error']}[/red]")
    if not res.get("ok"):
        con.print("[red]a phase broke (no probe answers, or no 2xx HTTP answers): see the JSON and the logs[/red]")


# ----------------------------------------------------------------------------- CLI


def add_bench_tokenize_load_parser(bsub) -> argparse.ArgumentParser:
    """Register ``mesh bench tokenize-load`` (no heavy imports: the parser is built on every ``mesh`` run)."""
    p = bsub.add_parser(
        "tokenize-load", help="broker decision latency and probe round trips while 8k-token HTTP prompts are tokenised "
                              "(embedded ingress vs mesh gateway)",
        description="One mesh broker (--http --tokenizer --metrics) with instant ZeroMQ workers; a ZeroMQ probe sends small "
                    "token-id requests and records round trips, while the broker's decision-latency and loop-lag histograms "
                    "are read from its /metrics. Phases: idle (probe only); embedded (K HTTP clients send N-token "
                    "/v1/completions prompts to the broker's own ingress, which tokenises them); gateway (the same load "
                    "through mesh gateway --tokenizer in its own process); control (the same prompts as token ids over "
                    "ZeroMQ at the embedded phase's rate: the prompts' routing without a tokenizer). Prints a table and "
                    "PASS/MISS for decision p99 <= 1.5x and probe p99 <= 3x the control phase's (the module docstring says why); a "
                    "MISS does not fail the command, a broken phase does. Needs the dev extra's tokenizers and "
                    "mistral-common for --tokenizer builtin.")
    p.add_argument("--duration-s", type=float, default=8.0, help="measured seconds per phase (default 8; a default run "
                                                                  "takes about 50 s)")
    p.add_argument("--warmup-s", type=float, default=1.0, help="seconds of HTTP load before each loaded window (default 1)")
    p.add_argument("--http-concurrency", type=int, default=8, help="concurrent closed-loop HTTP clients K (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=8192, help="prompt length in the tokenizer's tokens (default 8192)")
    p.add_argument("--probe-rate", type=float, default=200.0,
                   help="probe requests per second, open loop (default 200; 0 = one at a time, closed loop)")
    p.add_argument("--workers", type=int, default=4, help="instant ZeroMQ workers (default 4)")
    p.add_argument("--tokenizer", default="builtin",
                   help="a model folder, or builtin (the Tekken tokenizer mistral-common ships; default)")
    p.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto",
                   help="HTTP load generator: wrk when on PATH (auto, the default) or the built-in Python one")
    p.add_argument("--no-control", dest="control", action="store_false",
                   help="skip the control phase (8k-token prompts as ids over ZeroMQ)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin the broker to one CPU and everything else to the others")
    p.add_argument("--log-dir", help="keep the processes' logs here (default: a temporary directory)")
    p.add_argument("--json", help="write every figure to this JSON file")
    p.set_defaults(func=_cmd)
    return p


def _cmd(args) -> int:
    from rich.console import Console

    con = Console()
    if not con.is_terminal:
        con = Console(width=max(con.width, 200))  # a log file or pipe: keep the table's columns whole
    try:
        res = run_tokenize_load(duration_s=args.duration_s, warmup_s=args.warmup_s, http_concurrency=args.http_concurrency,
                                prompt_tokens=args.prompt_tokens, probe_rate=args.probe_rate, workers=args.workers,
                                loadgen=args.loadgen, tokenizer=args.tokenizer, control=args.control, pin=args.pin,
                                log_dir=args.log_dir, say=lambda m: con.print(m, highlight=False))
    except ValueError as exc:
        con.print(f"mesh bench tokenize-load: {exc}")
        return 2
    except ImportError as exc:
        con.print(f"mesh bench tokenize-load: {exc} (install the dev extra: pip install '.[dev]')")
        return 2
    except KeyboardInterrupt:
        con.print("mesh bench tokenize-load: interrupted (every process it started has been stopped)")
        return 130
    return finish(res, con, args.json, print_results)
