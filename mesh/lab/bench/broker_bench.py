"""``mesh bench broker``: throughput and latency through one broker vs a minimal ZMQ forwarder.

Both arms run in the same invocation, one after the other, on the same machine, with the same
harness and the same request bytes (short non-streaming SUBMITs, 8 prompt tokens, 1 output
token):

* **mesh**: a real broker process (power_of_two) and 64 instant workers (they answer each
  REQUEST with a FINAL at once, speaking the full worker protocol, so all time is decoding,
  routing and transport);
* **baseline**: a minimal Python ROUTER-to-DEALER forwarder process (receive, forward, no
  parsing) and 64 answering DEALERs. They do the instant workers' work, decoding each SUBMIT
  and answering with a FINAL of the same shape, so the harness costs the same in both arms and
  the difference between the arms is the broker alone.

The process under test (broker or forwarder) runs alone; the load driver and the 64 workers
share one *harness* process and one loop (:class:`_Harness`). On a 2-core machine that leaves the
process under test a core of its own, as it would have in production, instead of three busy
processes taking turns on two cores (which turned scheduler waits into milliseconds of "added"
latency). Both arms use the identical harness doing the same work per request. (Pure echo
workers would leave the baseline's machine less busy, and the harness's own scheduling delays
would then be counted as latency the broker adds.)

Phase 1 (throughput): a closed loop keeps ``concurrency`` requests in flight for ``seconds``.
Phase 2 (latency): open loop at half of the mesh's phase-1 rate, the same offered load for both
arms; the round-trip time of each request is recorded. Added latency = mesh round trip minus
the forwarder's, per percentile. A *round* is both arms, mesh first; the run does ``rounds``
rounds (fresh processes each time) and reports every round plus the medians, because on a
shared machine a neighbour's burst can own one round's p99.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable
from statistics import median
from contextlib import contextmanager
from pathlib import Path

import zmq

from mesh import protocol as P
from mesh.lab.bench.cpu_pinning import Placement, pin_process, pinned_self, plan
from mesh.gc_tuning import freeze_startup_heap
from mesh.lab.procs import ProcGroup, wait_for_log_event
from mesh.sockets import ReadyPoller, recv_frames, send_frames
from mesh.stats import percentile
from workers_stub.instant import InstantFleet, instant_answer

__all__ = ["run_broker_bench"]

_TERMINAL = {bytes([P.Cmd.C_FINAL]), bytes([P.Cmd.C_ERROR])}
_ERROR = bytes([P.Cmd.C_ERROR])


def _request_frames(i: int) -> list[bytes]:
    return P.encode_submit(f"b{i}", input_ids=[1, 2, 3, 4, 5, 6, 7, 8], params={"max_new_tokens": 1},
                           stream=False, deadline_ms=10_000)


def _is_terminal(frames: list[bytes]) -> bool:
    # FINAL or ERROR terminate (both arms answer with a client FINAL).
    return len(frames) >= 2 and frames[1] in _TERMINAL


class _AnswerFleet:
    """The baseline's workers: ``n`` DEALERs behind the forwarder. Each message is a client's
    SUBMIT (after the client identity the forwarder added); it is decoded, and answered with
    a client FINAL exactly as an instant worker answers a REQUEST (same decode, same reply
    body), so the harness does the same work in both arms."""

    def __init__(self, ctx: zmq.Context, poller: ReadyPoller, backend: str, n: int) -> None:
        self.poller = poller
        self._socks: set[zmq.Socket] = set()
        for _ in range(n):
            sk = ctx.socket(zmq.DEALER)
            sk.setsockopt(zmq.LINGER, 0)
            sk.connect(backend)
            poller.register(sk)
            self._socks.add(sk)

    def owns(self, sk: zmq.Socket) -> bool:
        return sk in self._socks

    def tick(self, now_s: float) -> float:
        return float("inf")

    def serve(self, sk: zmq.Socket) -> None:
        for _ in range(256):
            try:
                frames = recv_frames(sk)
            except zmq.Again:
                break
            sub = P.decode_client(frames[1:])
            if not isinstance(sub, P.Submit):
                continue  # the harness sends nothing else through the forwarder
            out, usage = instant_answer(sub)
            send_frames(sk, [frames[0], *P.encode_client_final(sub.rid, "length", usage, "answer", 1, P.pack({"token_ids": out}))])
        self.poller.recheck(sk)

    def close(self) -> None:
        for sk in self._socks:
            self.poller.unregister(sk)
            sk.close(linger=0)


class _Harness:
    """Load driver + worker fleet in one loop: a client DEALER to ``frontend`` and the fleet
    built by ``make_fleet(ctx, poller)``, all on one :class:`ReadyPoller`."""

    def __init__(self, frontend: str, make_fleet: Callable[[zmq.Context, ReadyPoller], object]) -> None:
        self.ctx = zmq.Context()
        self.poller = ReadyPoller()
        self.fleet = make_fleet(self.ctx, self.poller)
        self.client = self.ctx.socket(zmq.DEALER)
        for opt, v in ((zmq.LINGER, 0), (zmq.SNDHWM, 100_000), (zmq.RCVHWM, 100_000)):
            self.client.setsockopt(opt, v)
        self.client.connect(frontend)
        self.poller.register(self.client)

    def close(self) -> None:
        self.fleet.close()  # type: ignore[attr-defined]
        self.poller.unregister(self.client)
        self.client.close(linger=0)
        self.poller.close()
        self.ctx.term()

    def _send(self, frames: list[bytes]) -> None:
        send_frames(self.client, frames)

    def _turn(self, timeout_s: float, on_reply: Callable[[list[bytes]], None]) -> bool:
        """One loop turn: heartbeats when due, wait up to ``timeout_s``, serve what is ready.
        Returns False when nothing was ready."""
        fleet = self.fleet
        next_tick = fleet.tick(time.monotonic())  # type: ignore[attr-defined]
        ready = self.poller.wait(max(0.0, min(timeout_s, next_tick - time.monotonic())))
        for sk in ready:
            if sk is self.client:
                for _ in range(1024):
                    try:
                        frames = recv_frames(sk)
                    except zmq.Again:
                        break
                    on_reply(frames)
                self.poller.recheck(sk)
            else:
                fleet.serve(sk)  # type: ignore[attr-defined]
        return bool(ready)

    def wait_workers(self, n: int, timeout_s: float = 30.0) -> None:
        """Serve the fleet until the broker reports ``n`` healthy workers (STATUS polling)."""
        deadline = time.monotonic() + timeout_s
        healthy = -1

        def on_reply(frames: list[bytes]) -> None:
            nonlocal healthy
            msg = P.decode_client_reply(frames)
            if isinstance(msg, P.StatusReply):
                # the summary a client gets counts every worker; its rows are one page (--status-max-workers)
                counted = msg.broker.get("workers_healthy") if isinstance(msg.broker, dict) else None
                healthy = counted if type(counted) is int else sum(1 for w in msg.workers if w.get("healthy"))

        while healthy < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {healthy}/{n} workers registered after {timeout_s}s")
            healthy = -1
            self._send(P.encode_status_query())
            t_next = time.monotonic() + 0.05
            while healthy < 0 and time.monotonic() < deadline:
                self._turn(0.05, on_reply)
            while healthy < n and time.monotonic() < t_next:
                self._turn(t_next - time.monotonic(), on_reply)

    def warm_up(self, timeout_s: float = 10.0) -> None:
        """One successful round trip, so connections are up before timing starts."""
        done = False

        def on_reply(frames: list[bytes]) -> None:
            nonlocal done
            if _is_terminal(frames):
                if frames[1] == _ERROR:
                    raise RuntimeError(f"warm-up request failed: {P.unpack(frames[2])}")
                done = True

        self._send(_request_frames(0))
        deadline = time.monotonic() + timeout_s
        while not done:
            if time.monotonic() > deadline:
                raise TimeoutError("no reply to the warm-up request")
            self._turn(0.05, on_reply)

    def closed_loop(self, concurrency: int, seconds: float) -> tuple[float, int]:
        """Keep ``concurrency`` requests in flight; returns (requests/s, errors)."""
        reqs = {f"b{i}": _request_frames(i) for i in range(concurrency)}
        done = errors = 0
        stopping = False

        def on_reply(frames: list[bytes]) -> None:
            nonlocal done, errors
            if not _is_terminal(frames):
                return
            done += 1
            if frames[1] == _ERROR:
                errors += 1
            if not stopping:
                self._send(reqs[P.unpack(frames[2])["rid"]])  # reuse the rid that just finished

        for r in reqs.values():
            self._send(r)
        t0 = time.perf_counter()
        t_end = t0 + seconds
        while time.perf_counter() < t_end:
            self._turn(0.01, on_reply)
        elapsed = time.perf_counter() - t0
        rate = done / elapsed
        stopping = True  # let what is in flight finish so the next phase starts clean
        quiet_until = time.monotonic() + 5.0
        while time.monotonic() < quiet_until and self._turn(0.2, on_reply):
            pass
        return rate, errors

    def open_loop(self, rate: float, seconds: float) -> list[float]:
        """Send at a fixed ``rate`` (everything due at each ~1 ms loop turn); returns round
        trips in ms."""
        n = max(1, int(rate * seconds))
        reqs = [_request_frames(i) for i in range(n)]
        sent_at: dict[str, float] = {}
        rtts: list[float] = []

        def on_reply(frames: list[bytes]) -> None:
            if _is_terminal(frames):
                t = sent_at.pop(P.unpack(frames[2])["rid"], None)
                if t is not None:
                    rtts.append((time.perf_counter() - t) * 1000)

        t0 = time.perf_counter()
        i = 0
        idle_since = None
        while len(rtts) < n:
            now = time.perf_counter()
            while i < n and now >= t0 + i / rate:
                sent_at[f"b{i}"] = time.perf_counter()
                self._send(reqs[i])
                i += 1
            self.poller.recheck(self.client)  # sends may have consumed the FD's signal
            wait_s = (t0 + i / rate - time.perf_counter()) if i < n else 0.1
            if self._turn(wait_s, on_reply):
                idle_since = None
            elif i >= n:
                idle_since = idle_since or time.perf_counter()
                if time.perf_counter() - idle_since > 5:
                    break  # lost replies: stop rather than hang
        return rtts


# --------------------------------------------------------------------------- baseline processes


def _forwarder(front_ep: str, back_ep: str) -> None:
    """Minimal ROUTER(frontend) <-> DEALER(backend) forwarder in Python: no parsing at all."""
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    back = ctx.socket(zmq.DEALER)
    for sk in (front, back):
        sk.setsockopt(zmq.LINGER, 0)
        sk.setsockopt(zmq.SNDHWM, 100_000)
        sk.setsockopt(zmq.RCVHWM, 100_000)
    front.bind(front_ep)
    back.bind(back_ep)
    freeze_startup_heap()  # same GC treatment as the broker
    print('{"event": "forwarder_listening", "frontend": "%s", "backend": "%s"}' % (
        front.getsockopt_string(zmq.LAST_ENDPOINT), back.getsockopt_string(zmq.LAST_ENDPOINT)), flush=True)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    while True:
        poller.poll()
        for src, dst in ((front, back), (back, front)):
            for _ in range(512):
                try:
                    msg = src.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                dst.send_multipart(msg)


# --------------------------------------------------------------------------- runner


@contextmanager
def _no_gc():
    """No cyclic GC in the harness while it measures (as timeit does): a full collection of
    the request tables it just built would pause the driver for milliseconds, in either arm."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _measure(h: _Harness, concurrency: int, seconds: float, latency_rate: float | None = None) -> dict:
    """Throughput (closed loop), then round trips in an open loop at ``latency_rate`` (default:
    half of the measured maximum)."""
    h.warm_up()
    with _no_gc():
        rps, errors = h.closed_loop(concurrency, seconds)
    rate = latency_rate or rps / 2
    with _no_gc():
        rtts = h.open_loop(rate, seconds=min(seconds, 3.0))
    rtts = sorted(rtts)
    nan = float("nan")  # no round trips measured: NaN, not mesh.stats' 0.0
    return {"rps": rps, "errors": errors, "p50_ms": percentile(rtts, 50, presorted=True) if rtts else nan,
            "p99_ms": percentile(rtts, 99, presorted=True) if rtts else nan, "latency_samples": len(rtts),
            "latency_rate_rps": rate}


def _mesh_arm(log_dir: Path, workers: int, concurrency: int, seconds: float, place: Placement | None = None) -> dict:
    """A broker process + the harness with ``workers`` instant workers."""
    with ProcGroup(log_dir) as g:
        b = g.broker("broker", "--policy", "power_of_two", "--log-level", "warning")
        if place is not None:
            pin_process(b.pid, place.under_test)
        h = _Harness(b.frontend, lambda ctx, poller: InstantFleet(ctx, poller, [b.backend], count=workers, worker_id="instant"))
        try:
            h.wait_workers(workers)
            return _measure(h, concurrency, seconds)
        finally:
            h.close()


def _baseline_arm(log_dir: Path, workers: int, concurrency: int, seconds: float, latency_rate: float,
                  place: Placement | None = None) -> dict:
    """The forwarder process (no mesh code on its data path) + the harness with answering workers."""
    import subprocess

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    fwd_log = log_dir / "forwarder.log"
    with fwd_log.open("wb") as lf:
        fwd = subprocess.Popen([sys.executable, "-m", "mesh.lab.bench.broker_bench", "forwarder"], stdout=lf, stderr=subprocess.STDOUT, env=env)
    try:
        rec = wait_for_log_event(fwd_log, "forwarder_listening", 30, fwd)
        if place is not None:
            pin_process(fwd.pid, place.under_test)
        h = _Harness(rec["frontend"], lambda ctx, poller: _AnswerFleet(ctx, poller, rec["backend"], workers))
        try:
            return _measure(h, concurrency, seconds, latency_rate=latency_rate)
        finally:
            h.close()
    finally:
        fwd.kill()
        fwd.wait(5)


def _rounds(log_dir: Path, rounds: int, workers: int, concurrency: int, seconds: float,
            place: Placement | None, progress: Callable[[int], None] | None) -> tuple[list[dict], int]:
    """Run the rounds; returns (one dict per round, errors summed over the mesh arms)."""
    per_round = []
    errors = 0
    for k in range(1, rounds + 1):
        rdir = log_dir / f"round-{k}"
        rdir.mkdir()
        mesh_res = _mesh_arm(rdir, workers, concurrency, seconds, place)
        # the forwarder's round trips are taken at the mesh's half-load rate: same offered load
        base_res = _baseline_arm(rdir, workers, concurrency, seconds, latency_rate=mesh_res["rps"] / 2, place=place)
        errors += mesh_res["errors"]
        per_round.append({
            "rps": round(mesh_res["rps"], 1),
            "baseline_rps": round(base_res["rps"], 1),
            "latency_rate_rps": round(mesh_res["latency_rate_rps"], 1),
            "latency_samples": mesh_res["latency_samples"],
            "rtt_p50_ms": round(mesh_res["p50_ms"], 3),
            "rtt_p99_ms": round(mesh_res["p99_ms"], 3),
            "baseline_p50_ms": round(base_res["p50_ms"], 3),
            "baseline_p99_ms": round(base_res["p99_ms"], 3),
            # added latency: mesh round trip minus the minimal forwarder's at the same offered load
            "p50_ms": round(max(0.0, mesh_res["p50_ms"] - base_res["p50_ms"]), 3),
            "p99_ms": round(max(0.0, mesh_res["p99_ms"] - base_res["p99_ms"]), 3),
        })
        if progress:
            progress(k)
    return per_round, errors


def run_broker_bench(workers: int = 64, seconds: float = 4.0, concurrency: int = 256, rounds: int = 3,
                     quiet: bool = False, progress: Callable[[int], None] | None = None, pin: bool = True) -> dict:
    """Run ``rounds`` rounds of both arms (mesh, then the forwarder at the same offered load)
    and return the result dict (also printed unless ``quiet``).

    With ``pin`` (default) and at least two usable CPUs, the process under test (broker or
    forwarder, every thread) runs on one CPU and this harness on the others, in both arms
    (:mod:`mesh.lab.bench.cpu_pinning` says why); the placement is recorded as ``pinning``.

    Headline figures are medians over rounds: a shared machine's noise comes and goes over
    minutes, so one round's p99 can be dominated by a neighbour; every round is in ``rounds``.
    ``progress(k)`` is called after round ``k`` (1-based)."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    log_dir = Path(tempfile.mkdtemp(prefix="mesh-bench-broker-"))
    freeze_startup_heap()  # the harness gets the same GC treatment as the processes it drives
    place = plan() if pin else None
    with pinned_self(place.harness if place else None):
        per_round, errors = _rounds(log_dir, rounds, workers, concurrency, seconds, place, progress)

    def med(key: str) -> float:
        return round(median([r[key] for r in per_round]), 3)

    rps, base_rps = med("rps"), med("baseline_rps")
    res = {
        "rps": rps,
        "baseline_rps": base_rps,
        "ratio": round(median([r["rps"] / r["baseline_rps"] for r in per_round if r["baseline_rps"]]), 3),
        "p50_ms": med("p50_ms"),
        "p99_ms": med("p99_ms"),
        "rtt_p50_ms": med("rtt_p50_ms"),
        "rtt_p99_ms": med("rtt_p99_ms"),
        "baseline_p50_ms": med("baseline_p50_ms"),
        "baseline_p99_ms": med("baseline_p99_ms"),
        "latency_rate_rps": med("latency_rate_rps"),
        "latency_samples": sum(r["latency_samples"] for r in per_round),
        "errors": errors,
        "workers": workers,
        "concurrency": concurrency,
        "seconds": seconds,
        "rounds": per_round,
        "cpus": os.cpu_count(),
        "pinning": place.as_dict() if place else None,
    }
    if not quiet:
        print_results(res)
    return res


def print_results(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    t = Table(title=f"mesh bench broker ({res['workers']} instant workers, {res['concurrency']} in flight; "
                    f"each round: mesh, then the forwarder at the mesh's half-load rate)")
    for col in ("round", "mesh req/s", "fwd req/s", "rate", "mesh RTT p50/p99 ms", "fwd RTT p50/p99 ms", "added p50/p99 ms"):
        t.add_column(col, justify="right")
    for k, r in enumerate(res["rounds"], 1):
        t.add_row(str(k), f"{r['rps']:.0f}", f"{r['baseline_rps']:.0f}", f"{r['latency_rate_rps']:.0f}",
                  f"{r['rtt_p50_ms']:.2f} / {r['rtt_p99_ms']:.2f}", f"{r['baseline_p50_ms']:.2f} / {r['baseline_p99_ms']:.2f}",
                  f"{r['p50_ms']:.2f} / {r['p99_ms']:.2f}")
    t.add_row("median", f"{res['rps']:.0f}", f"{res['baseline_rps']:.0f}", f"{res['latency_rate_rps']:.0f}",
              f"{res['rtt_p50_ms']:.2f} / {res['rtt_p99_ms']:.2f}", f"{res['baseline_p50_ms']:.2f} / {res['baseline_p99_ms']:.2f}",
              f"{res['p50_ms']:.2f} / {res['p99_ms']:.2f}", style="bold")
    c.print(t)
    pin = res.get("pinning")
    if pin:
        c.print(f"pinned: process under test on CPU {pin['process_under_test']}, harness on CPU {pin['harness']}")
    c.print(f"ratio mesh/forwarder (median) = {res['ratio']}; added latency at half the mesh maximum "
            f"(median over {len(res['rounds'])} rounds): p50 {res['p50_ms']:.3f} ms, p99 {res['p99_ms']:.3f} ms; "
            f"errors {res['errors']}")


def _main() -> None:
    ap = argparse.ArgumentParser(description="internal: the baseline process of mesh bench broker")
    ap.add_argument("role", choices=["forwarder"])
    ap.parse_args()
    _forwarder("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")


if __name__ == "__main__":
    _main()
