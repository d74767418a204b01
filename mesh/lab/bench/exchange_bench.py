"""``mesh bench exchange``: how long a broker's dispatch takes to become visible to its peers.

Real processes and sockets on 127.0.0.1, one *arm* per ``--exchange-interval-ms`` value, all in
one invocation (by default the intervals are interleaved over two rounds, 0, 5, 0, 5, so the
machine's drift shows as the spread between rounds of the same interval):

* two broker processes A and B (policy cache_aware, the default), each binding ``--exchange``
  on a free port and naming the other as ``--peer``, both with the arm's interval;
* one worker-stub process with ``workers`` simulated engines registered with both brokers;
* **background load through B only**: a separate process (``python -m mesh.lab.bench.exchange_bench
  background``, the repo's :class:`mesh.client.Client`) sends Poisson arrivals at ``rate`` req/s
  of unique prompts that decode for ``background_max_new_tokens`` steps (~7 ms each), so the workers are
  busy and B publishes (and A ingests) change messages as a loaded broker does. It is its own
  process so that its event loop never delays the probe's timestamps;
* **probes through A only**: this process subscribes to A's exchange PUB (the endpoint any peer
  connects to; every message passes :func:`mesh.protocol.decode_exchange`) and keeps A's
  per-worker figures as a peer would. One probe at a time: a unique prompt sent to A on a raw
  DEALER at ``t_submit`` (``time.monotonic``; same host, same clock); ``t_seen`` is the arrival
  of the first PEER_LOAD message from A that shows it (a worker's in-flight count above 0, or
  its sent-tokens counter above what it was at submit: only probes go through A, so either is
  the probe). Then the probe's reply and A's figures back at 0 are awaited before the next
  probe, which starts after a random gap (uniform in [0, ``gap_ms``]) so that probes land at
  every phase of A's publishing, as a busy broker's dispatches do.

**delay** = t_seen - t_submit: an upper bound of dispatch-to-peer visibility (it includes A's
ingest and routing and the bench's own wake-up). **accept** (t of A's ACCEPTED at the client)
and the probe's TTFT are recorded beside it. With an idle A a non-zero interval only holds a
message back when A sent one within the interval before the dispatch, so every probe also
records its **phase** (time since the last message from A reached the bench at submit) and the
report splits the delays by phase < / >= the largest interval compared. Per arm: the CPU
seconds of each process over the probe window (``/proc``), the background's achieved rate and
both brokers' exchange counters (STATUS ``exchange.*``, before and after the window).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from mesh import protocol as P
from mesh.lab.bench.proc_cpu import CpuSampler
from mesh.lab.procs import ProcGroup, free_port, wait_for_log_event
from mesh.sockets import CLIENT_DEALER, EXCHANGE_SUB, make_socket, recv_frames, send_frames
from mesh.stats import percentile

__all__ = ["run_exchange_bench", "print_results"]

DEFAULT_INTERVALS_MS = (0.0, 5.0)
VOCAB = 32_000
_STALE_MS = "3000"
_READY_TIMEOUT_S = 30.0


def _prompt(rng: random.Random, n: int) -> list[int]:
    """A prompt no other request shares a KV block with: a random first block, then a cheap tail
    (block hashes chain from the first block, so the tail matches nothing either)."""
    head = [rng.randrange(1, VOCAB) for _ in range(min(n, 16))]
    return head + [1 + (k % (VOCAB - 1)) for k in range(n - len(head))]


def _ratio(x: float, y: float) -> float | None:
    return round(x / y, 3) if y and x == x and y == y else None


def _summary(values: list[float]) -> dict:
    """count, min, p50, p90, p99, max, mean of ``values`` (ms); NaN figures when empty."""
    nan = float("nan")
    if not values:
        return {"n": 0, "min": nan, "p50": nan, "p90": nan, "p99": nan, "max": nan, "mean": nan}
    x = sorted(values)
    return {"n": len(x), "min": round(x[0], 3), "p50": round(percentile(x, 50, presorted=True), 3),
            "p90": round(percentile(x, 90, presorted=True), 3), "p99": round(percentile(x, 99, presorted=True), 3),
            "max": round(x[-1], 3), "mean": round(sum(x) / len(x), 3)}


# ----------------------------------------------------------------------------- A's figures as a peer sees them


class ExchangeWatch:
    """A SUB on one broker's exchange PUB and that broker's per-worker figures from its messages
    (what a peer's :class:`~mesh.routing.peers.PeerMerge` would hold for it)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, broker_id: str) -> None:
        self.broker_id = broker_id
        self.sock = make_socket(ctx, EXCHANGE_SUB, connect=endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, P.EXCHANGE_HEADER)
        self.inflight: dict[str, int] = {}  # worker -> requests A has there (as of its last message)
        self.sent: dict[str, int] = {}  # worker -> A's sent-tokens counter (never forgotten)
        self.last_arrival = float("-inf")
        self.counts = {"messages": 0, "full": 0, "changes": 0, "rejected": 0, "other_broker": 0}

    def total_inflight(self) -> int:
        return sum(self.inflight.values())

    def on_frames(self, frames: list[bytes], t: float) -> P.PeerLoad | None:
        m = P.decode_exchange(frames)
        if not isinstance(m, P.PeerLoad):
            self.counts["rejected"] += 1
            return None
        if m.broker != self.broker_id:
            self.counts["other_broker"] += 1
            return None
        self.counts["messages"] += 1
        self.last_arrival = t
        if m.full:
            self.counts["full"] += 1
            self.inflight = {}  # a full snapshot lists every worker with work: the others have none
        else:
            self.counts["changes"] += 1
        for wid, n, _pre, sent in m.workers:
            self.inflight[wid] = n
            self.sent[wid] = sent
        return m

    def close(self) -> None:
        self.sock.close(linger=0)


def _shows_probe(m: P.PeerLoad, sent_before: dict[str, int]) -> bool:
    """Does message ``m`` (after a probe's submit, A idle before it) show the probe dispatched?"""
    return any(n > 0 or sent > sent_before.get(wid, -1) for wid, n, _pre, sent in m.workers)


# ----------------------------------------------------------------------------- the probe loop


class _Prober:
    """This process's two sockets (A's exchange SUB, a DEALER to A's frontend) on one poller."""

    def __init__(self, ctx: zmq.Context, frontend: str, watch: ExchangeWatch) -> None:
        self.watch = watch
        self.dealer = make_socket(ctx, CLIENT_DEALER, connect=frontend)
        self.poller = zmq.Poller()
        self.poller.register(watch.sock, zmq.POLLIN)
        self.poller.register(self.dealer, zmq.POLLIN)
        self.on_message: Callable[[P.PeerLoad, float], None] | None = None
        self.on_reply: Callable[[object, float], None] | None = None

    def close(self) -> None:
        self.dealer.close(linger=0)

    def pump(self, until: Callable[[], bool], deadline: float) -> bool:
        """Read both sockets (each message timestamped on arrival) until ``until()`` or
        ``deadline``; returns ``until()``."""
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready = dict(self.poller.poll(max(1, int(left * 1000) + 1)))
            if self.watch.sock in ready:
                while True:
                    try:
                        frames = recv_frames(self.watch.sock)
                    except zmq.Again:
                        break
                    t = time.monotonic()
                    m = self.watch.on_frames(frames, t)
                    if m is not None and self.on_message is not None:
                        self.on_message(m, t)
            if self.dealer in ready:
                while True:
                    try:
                        frames = recv_frames(self.dealer)
                    except zmq.Again:
                        break
                    t = time.monotonic()
                    if self.on_reply is not None:
                        self.on_reply(P.decode_client_reply(frames), t)
        return True

    def probe(self, rid: str, prompt: list[int], max_new_tokens: int, timeout_s: float) -> dict:
        """One probe (A's figures at 0 before it): submit, first message from A that shows it,
        reply, A's figures back at 0. Returns its record; ``ok`` False (and ``why``) on a timeout
        or an error reply."""
        w = self.watch
        sent_before = dict(w.sent)
        rec: dict = {"rid": rid, "ok": False}
        t: dict[str, float] = {}

        def on_message(m: P.PeerLoad, ts: float) -> None:
            if "seen" not in t and _shows_probe(m, sent_before):
                t["seen"] = ts
                rec["seen_full"] = m.full  # seen first in a full snapshot (not a change message)

        def on_reply(m, ts: float) -> None:
            if getattr(m, "rid", None) != rid:
                return
            if isinstance(m, P.Accepted):
                t.setdefault("accept", ts)
                rec["worker"] = m.worker
            elif isinstance(m, P.ClientChunk):
                t.setdefault("first_chunk", ts)
            elif isinstance(m, P.ClientFinal):
                t["final"] = ts
                rec["finish_reason"] = m.finish_reason
            elif isinstance(m, P.ClientError):
                t["final"] = ts
                rec["error"] = m.code

        self.on_message, self.on_reply = on_message, on_reply
        frames = P.encode_submit(rid, input_ids=prompt, params={"max_new_tokens": max_new_tokens}, stream=True,
                                 deadline_ms=int(timeout_s * 1000))
        rec["phase_ms"] = round((time.monotonic() - w.last_arrival) * 1000, 3)
        t0 = time.monotonic()
        send_frames(self.dealer, frames)
        deadline = t0 + timeout_s
        done = self.pump(lambda: "seen" in t and "final" in t and w.total_inflight() == 0, deadline)
        self.on_message = self.on_reply = None
        for k, v in t.items():
            rec[f"{k}_ms"] = round((v - t0) * 1000, 3)
        if "seen_ms" in rec:
            rec["delay_ms"] = rec["seen_ms"]
        if not done:
            rec["why"] = ("never seen in A's exchange messages" if "seen" not in t else
                          "no reply" if "final" not in t else "A's figures did not drop back to 0")
        elif "error" in rec:
            rec["why"] = f"error reply {rec['error']}"
        else:
            rec["ok"] = True
        return rec


# ----------------------------------------------------------------------------- processes


async def _status(frontend: str, timeout_s: float = 5.0) -> P.StatusReply:
    from mesh.client import Client

    async with Client(frontend) as c:
        return await c.status(timeout_s=timeout_s)


def _exchange_counters(frontend: str) -> dict[str, int]:
    st = asyncio.run(_status(frontend))
    return {k.split(".", 1)[1]: v for k, v in st.counters.items() if k.startswith("exchange.")}


def _wait_fresh(frontends: list[str], timeout_s: float) -> None:
    """Until every broker says its peer is fresh (its first full snapshot arrived)."""
    async def body() -> None:
        t_end = time.monotonic() + timeout_s
        for fe in frontends:
            while True:
                st = (await _status(fe, timeout_s=max(0.1, t_end - time.monotonic()))).broker.get("exchange") or {}
                if st.get("fresh", 0) >= 1 and not st.get("degraded", True):
                    break
                if time.monotonic() > t_end:
                    raise TimeoutError(f"{fe}: its exchange peer not fresh within {timeout_s}s: {st}")
                await asyncio.sleep(0.05)  # STATUS polling period of this readiness wait

    asyncio.run(body())


def _wait_workers(frontends: list[str], n: int, timeout_s: float) -> None:
    from mesh.lab.up import wait_for_workers

    async def body() -> None:
        for fe in frontends:
            await wait_for_workers(fe, n, timeout_s)

    asyncio.run(body())


class _Background:
    """The background load process (``python -m mesh.lab.bench.exchange_bench background``)."""

    def __init__(self, log_path: Path, frontend: str, rate: float, max_new_tokens: int, prompt_tokens: int, seed: int) -> None:
        self.log_path = log_path
        args = [sys.executable, "-m", "mesh.lab.bench.exchange_bench", "background", "--frontend", frontend, "--rate", str(rate),
                "--max-new-tokens", str(max_new_tokens), "--prompt-tokens", str(prompt_tokens), "--seed", str(seed)]
        with log_path.open("wb") as lf:
            self.popen = subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        wait_for_log_event(log_path, "background_started", _READY_TIMEOUT_S, self.popen)

    def finish(self, timeout_s: float = 15.0) -> dict:
        """SIGTERM: it stops sending, waits for its requests in flight, says what it did."""
        self.popen.send_signal(signal.SIGTERM)
        rec = wait_for_log_event(self.log_path, "background_done", timeout_s, None)
        self.popen.wait(5)
        return rec

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)


def _arm(log_dir: Path, interval_ms: float, *, workers: int, probes: int, warmup_probes: int, rate: float,
         probe_tokens: int, probe_max_new_tokens: int, background_max_new_tokens: int, background_prompt_tokens: int,
         gap_ms: float, timeout_s: float, seed: int, split_ms: float,
         progress: Callable[[int], None] | None) -> dict:
    """One interval: fresh brokers, workers and background; ``probes`` timed probes through A."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port_a, port_b = free_port(), free_port()
    while port_b == port_a:
        port_b = free_port()
    ex_a, ex_b = f"tcp://127.0.0.1:{port_a}", f"tcp://127.0.0.1:{port_b}"
    common = ["--exchange-interval-ms", f"{interval_ms:g}", "--exchange-stale-ms", _STALE_MS, "--log-level", "warning"]
    rng = random.Random(seed)
    ctx = zmq.Context()
    bg: _Background | None = None
    watch = prober = None
    try:
        with ProcGroup(log_dir) as g:
            a = g.broker("a", "--exchange", ex_a, "--peer", ex_b, *common)
            b = g.broker("b", "--exchange", ex_b, "--peer", ex_a, *common)
            wk = g.workers("w", [a.backend, b.backend], "--log-level", "warning", count=workers)
            _wait_workers([a.frontend, b.frontend], workers, _READY_TIMEOUT_S)
            _wait_fresh([a.frontend, b.frontend], _READY_TIMEOUT_S)

            watch = ExchangeWatch(ctx, ex_a, "a")
            prober = _Prober(ctx, a.frontend, watch)
            # A's first full snapshot (at most ~1 s away) says the SUB is connected
            if not prober.pump(lambda: watch.counts["messages"] > 0, time.monotonic() + 5.0):
                raise TimeoutError(f"no exchange message from A ({ex_a}) within 5 s")

            bg = _Background(log_dir / "background.log", b.frontend, rate, background_max_new_tokens,
                             background_prompt_tokens, seed + 1)
            # let the background reach its steady state, then a few untimed probes
            prober.pump(lambda: False, time.monotonic() + 1.0)
            failures = []
            for i in range(warmup_probes):
                r = prober.probe(f"warm-{seed}-{i}", _prompt(rng, probe_tokens), probe_max_new_tokens, timeout_s)
                if not r["ok"]:
                    failures.append(r)
                    break

            ex0 = {"a": _exchange_counters(a.frontend), "b": _exchange_counters(b.frontend)}
            msgs0 = dict(watch.counts)
            cpu = CpuSampler({"broker_a": [a.pid], "broker_b": [b.pid], "workers": [wk.pid], "background": [bg.popen.pid]})
            cpu.start()
            t_start = time.monotonic()
            own0 = time.process_time()  # this process alone (a CpuSampler role would add its children)
            records = []
            consecutive = 0
            for i in range(probes):
                # a random gap (reading A's messages meanwhile): probes land at every phase of A's publishing
                prober.pump(lambda: False, time.monotonic() + rng.uniform(0.0, gap_ms) / 1000.0)
                r = prober.probe(f"probe-{seed}-{i}", _prompt(rng, probe_tokens), probe_max_new_tokens, timeout_s)
                records.append(r)
                consecutive = 0 if r["ok"] else consecutive + 1
                if not r["ok"] and watch.total_inflight():
                    # a lost probe left A's figures up: wait for them to drop before the next one
                    prober.pump(lambda: watch.total_inflight() == 0, time.monotonic() + timeout_s)
                if progress is not None:
                    progress(1)
                if consecutive >= 3:
                    break  # the exchange is not working: stop this arm, the report says why
            window_s = time.monotonic() - t_start
            cpu_s = cpu.stop()
            cpu_s["bench"] = time.process_time() - own0
            ex1 = {"a": _exchange_counters(a.frontend), "b": _exchange_counters(b.frontend)}
            msgs1 = dict(watch.counts)
            background = bg.finish()
            bg = None
    finally:
        if bg is not None:
            bg.kill()
        if prober is not None:
            prober.close()
        if watch is not None:
            watch.close()
        ctx.term()

    ok = [r for r in records if r["ok"]]
    delays = [r["delay_ms"] for r in ok]
    near = [r["delay_ms"] for r in ok if r["phase_ms"] < split_ms]
    far = [r["delay_ms"] for r in ok if r["phase_ms"] >= split_ms]
    window_ex = {side: {k: v - ex0[side].get(k, 0) for k, v in ex1[side].items() if v - ex0[side].get(k, 0)}
                 for side in ("a", "b")}
    return {
        "interval_ms": interval_ms,
        "probes": len(records),
        "seen": sum(1 for r in records if "delay_ms" in r),
        "ok": len(ok),
        "failed": [{"rid": r["rid"], "why": r.get("why")} for r in records if not r["ok"]] + [
            {"rid": r["rid"], "why": r.get("why")} for r in failures],
        "delay_ms": _summary(delays),
        "delay_ms_phase_below_split": _summary(near),
        "delay_ms_phase_above_split": _summary(far),
        "accept_ms": _summary([r["accept_ms"] for r in ok if "accept_ms" in r]),
        "exchange_after_accept_ms": _summary([r["delay_ms"] - r["accept_ms"] for r in ok if "accept_ms" in r]),
        "ttft_ms": _summary([r["first_chunk_ms"] for r in ok if "first_chunk_ms" in r]),
        "seen_in_full_snapshot": sum(1 for r in ok if r.get("seen_full")),
        "window_s": round(window_s, 3),
        "background": {k: background.get(k) for k in ("rate_rps", "sent", "ok", "errors", "achieved_rps", "wall_s")},
        "messages_from_a_in_window": {k: msgs1[k] - msgs0.get(k, 0) for k in msgs1},
        "exchange_window": window_ex,  # STATUS exchange.* counters, change over the probe window
        "exchange_total": ex1,  # the same counters since each broker started
        "b_messages_per_s": round(window_ex["b"].get("sent", 0) / window_s, 1) if window_s > 0 else None,
        "cpu_pct": {role: round(100.0 * s / window_s, 1) for role, s in cpu_s.items()} if window_s > 0 else {},
        "records": records,
    }


# ----------------------------------------------------------------------------- the bench


def run_exchange_bench(intervals_ms: list[float] | tuple[float, ...] = DEFAULT_INTERVALS_MS, *, workers: int = 4,
                       probes: int = 200, rounds: int = 2, background_rate: float = 100.0, background_max_new_tokens: int = 24,
                       background_prompt_tokens: int = 256, probe_tokens: int = 256, probe_max_new_tokens: int = 8,
                       gap_ms: float = 10.0, warmup_probes: int = 5, timeout_s: float = 10.0, seed: int = 0,
                       log_dir: str | Path | None = None, quiet: bool = False,
                       progress: Callable[[int], None] | None = None) -> dict:
    """Run one arm per interval per round (order: the intervals, ``rounds`` times) and return
    the results (also printed unless ``quiet``). ``progress(n)`` is called with 1 after every
    timed probe (``len(intervals_ms) * rounds * probes`` in all, fewer if an arm stops early).

    Headline figures per interval pool the probes of all its rounds; ``ratios`` divides each
    interval's p50 / p99 by the smallest interval's."""
    intervals = [float(x) for x in intervals_ms]
    if not intervals:
        raise ValueError("intervals_ms: at least one interval")
    if any(x < 0 or x > 1000 for x in intervals):
        raise ValueError("intervals_ms: each in [0, 1000]")
    if rounds < 1 or probes < 1 or workers < 1:
        raise ValueError("rounds, probes and workers must be >= 1")
    if background_rate < 0:
        raise ValueError("background_rate must be >= 0")
    base_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mesh-bench-exchange-"))
    split_ms = max(max(intervals), 1.0)
    arms = []
    for k in range(1, rounds + 1):
        for j, iv in enumerate(intervals):
            arm = _arm(base_dir / f"round-{k}-interval-{iv:g}", iv, workers=workers, probes=probes,
                       warmup_probes=warmup_probes, rate=background_rate, probe_tokens=probe_tokens,
                       probe_max_new_tokens=probe_max_new_tokens, background_max_new_tokens=background_max_new_tokens,
                       background_prompt_tokens=background_prompt_tokens, gap_ms=gap_ms, timeout_s=timeout_s,
                       seed=seed + 1000 * k + j, split_ms=split_ms, progress=progress)
            arm["round"] = k
            arms.append(arm)

    by_interval: dict[str, dict] = {}
    for iv in intervals:
        mine = [a for a in arms if a["interval_ms"] == iv]
        ok = [r for a in mine for r in a["records"] if r["ok"]]
        by_interval[f"{iv:g}"] = {
            "interval_ms": iv,
            "probes": sum(a["probes"] for a in mine),
            "seen": sum(a["seen"] for a in mine),
            "ok": len(ok),
            "delay_ms": _summary([r["delay_ms"] for r in ok]),
            "delay_ms_phase_below_split": _summary([r["delay_ms"] for r in ok if r["phase_ms"] < split_ms]),
            "delay_ms_phase_above_split": _summary([r["delay_ms"] for r in ok if r["phase_ms"] >= split_ms]),
            "accept_ms": _summary([r["accept_ms"] for r in ok if "accept_ms" in r]),
            "exchange_after_accept_ms": _summary([r["delay_ms"] - r["accept_ms"] for r in ok if "accept_ms" in r]),
            "ttft_ms": _summary([r["first_chunk_ms"] for r in ok if "first_chunk_ms" in r]),
            "background_achieved_rps": [a["background"]["achieved_rps"] for a in mine],
            "b_messages_per_s": [a["b_messages_per_s"] for a in mine],
            "cpu_pct_broker_a": [a["cpu_pct"].get("broker_a") for a in mine],
            "cpu_pct_broker_b": [a["cpu_pct"].get("broker_b") for a in mine],
        }
    base = f"{min(intervals):g}"
    ratios = {}
    for key, s in by_interval.items():
        if key == base:
            continue
        b = by_interval[base]["delay_ms"]
        ratios[f"{key}/{base}"] = {q: _ratio(s["delay_ms"][q], b[q]) for q in ("p50", "p99")}
        ratios[f"{key}/{base}"]["p50_phase_below_split"] = _ratio(s["delay_ms_phase_below_split"]["p50"],
                                                                  by_interval[base]["delay_ms_phase_below_split"]["p50"])
    res = {
        "intervals_ms": intervals,
        "rounds": rounds,
        "order": [a["interval_ms"] for a in arms],
        "workers": workers,
        "probes_per_arm": probes,
        "background_rate_rps": background_rate,
        "background_max_new_tokens": background_max_new_tokens,
        "probe_max_new_tokens": probe_max_new_tokens,
        "probe_tokens": probe_tokens,
        "gap_ms": gap_ms,
        "split_ms": split_ms,
        "timeout_s": timeout_s,
        "cpus": os.cpu_count(),
        "log_dir": str(base_dir),
        "ok": all(a["ok"] == a["probes"] == probes for a in arms),
        "by_interval": by_interval,
        "ratios": ratios,
        "arms": arms,
    }
    if not quiet:
        print_results(res)
    return res


def print_results(res: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from mesh.lab.bench.report import fmt

    c = console or Console()
    split = res["split_ms"]
    t = Table(title=f"mesh bench exchange: probe submitted to A -> first PEER_LOAD from A showing it, ms "
                    f"({res['workers']} workers; background {res['background_rate_rps']:g} req/s through B; "
                    f"probes through A, one at a time)")
    for col in ("interval ms", "round", "seen/probes", "delay p50", "p90", "p99", "max",
                f"p50, last msg from A <{split:g} ms before", "p50, otherwise", "accept p50", "TTFT p50",
                "bg req/s", "B msg/s", "CPU A %", "CPU B %"):
        t.add_column(col, justify="right")

    def row(label_iv, label_round, s: dict, extra: list[str], style=None) -> None:
        d = s["delay_ms"]
        t.add_row(label_iv, label_round, f"{s['seen']}/{s['probes']}", fmt(d["p50"], "{:.2f}"), fmt(d["p90"], "{:.2f}"),
                  fmt(d["p99"], "{:.2f}"), fmt(d["max"], "{:.2f}"),
                  f"{fmt(s['delay_ms_phase_below_split']['p50'], '{:.2f}')} (n={s['delay_ms_phase_below_split']['n']})",
                  f"{fmt(s['delay_ms_phase_above_split']['p50'], '{:.2f}')} (n={s['delay_ms_phase_above_split']['n']})",
                  fmt(s["accept_ms"]["p50"], "{:.2f}"), fmt(s["ttft_ms"]["p50"], "{:.1f}"), *extra, style=style)

    for a in res["arms"]:
        row(f"{a['interval_ms']:g}", str(a["round"]), a,
            [fmt(a["background"]["achieved_rps"], "{:.1f}"), fmt(a["b_messages_per_s"], "{:.0f}"),
             fmt(a["cpu_pct"].get("broker_a"), "{:.1f}"), fmt(a["cpu_pct"].get("broker_b"), "{:.1f}")])
    for key, s in res["by_interval"].items():
        row(key, "all", s, ["", "", "", ""], style="bold")
    c.print(t)
    for name, r in res["ratios"].items():
        c.print(f"interval {name} ms: delay p50 ratio {fmt(r['p50'], '{:.2f}')}, p99 ratio {fmt(r['p99'], '{:.2f}')}; "
                f"probes whose previous message from A had arrived <{split:g} ms before: "
                f"p50 ratio {fmt(r['p50_phase_below_split'], '{:.2f}')}")
    c.print(f"delay = arrival of the first exchange message from A showing the probe - the probe's submit (ms; "
            f"includes A's ingest and routing). 'last msg from A <{split:g} ms before': probes submitted less than "
            f"{split:g} ms after A's previous exchange message reached the bench, the only ones an interval can hold "
            f"back while A is otherwise idle (a busy broker publishes all the time: its dispatches are all such). "
            f"accept = A's ACCEPTED at the client. Logs: {res['log_dir']}")
    bad = [(a["interval_ms"], a["round"], f) for a in res["arms"] for f in a["failed"]]
    for iv, k, f in bad[:10]:
        c.print(f"[red]interval {iv:g} round {k}: {f['rid']}: {f['why']}[/red]")


# ----------------------------------------------------------------------------- the background load process


async def _background(frontend: str, rate: float, max_new_tokens: int, prompt_tokens: int, seed: int) -> None:
    from mesh.client import Client
    from mesh.errors import RequestError
    from mesh.logs import announce

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    rng = random.Random(seed)
    counts = {"sent": 0, "ok": 0, "ok_before_stop": 0}
    errors: dict[str, int] = {}
    stopped = False

    async def one(c: Client, prompt: list[int]) -> None:
        try:
            await c.generate(input_ids=prompt, max_new_tokens=max_new_tokens, stream=False, deadline_ms=30_000)
            counts["ok"] += 1
            if not stopped:
                counts["ok_before_stop"] += 1
        except RequestError as exc:
            errors[exc.code.value] = errors.get(exc.code.value, 0) + 1

    async with Client(frontend, default_deadline_ms=30_000) as c:
        await c.status(timeout_s=10.0)  # connected
        announce("background_started", frontend=frontend, rate_rps=rate)
        tasks: set[asyncio.Task] = set()
        stop_wait = asyncio.ensure_future(stop.wait())
        t0 = time.monotonic()
        t_next = t0
        while not stop.is_set():
            if rate <= 0:
                await stop_wait
                break
            t_next += rng.expovariate(rate)
            delay = t_next - time.monotonic()
            if delay > 0:
                await asyncio.wait([stop_wait], timeout=delay)  # the next Poisson arrival, or the stop
                if stop.is_set():
                    break
            task = asyncio.ensure_future(one(c, _prompt(rng, prompt_tokens)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            counts["sent"] += 1
        t_stop = time.monotonic()
        stopped = True
        if tasks:
            await asyncio.wait(list(tasks), timeout=10.0)
        for task in list(tasks):
            task.cancel()
        wall = t_stop - t0
        announce("background_done", rate_rps=rate, sent=counts["sent"], ok=counts["ok"], errors=errors,
                 unfinished=len(tasks), wall_s=round(wall, 3),
                 achieved_rps=round(counts["ok_before_stop"] / wall, 1) if wall > 0 else None)


def _main() -> None:
    ap = argparse.ArgumentParser(description="internal: the background load process of mesh bench exchange")
    ap.add_argument("role", choices=["background"])
    ap.add_argument("--frontend", required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    asyncio.run(_background(a.frontend, a.rate, a.max_new_tokens, a.prompt_tokens, a.seed))


if __name__ == "__main__":
    _main()
