"""``mesh bench broker``: throughput and latency through one broker vs a minimal ZMQ forwarder.

Both arms run in the same invocation, one after the other, on the same machine, with the same
load driver and the same request bytes (short non-streaming SUBMITs, 8 prompt tokens, 1 output
token):

* **mesh**: a real broker process (power_of_two) with 64 instant simulated workers in a second
  process (they answer each REQUEST with a FINAL at once, so all time is routing + transport);
* **baseline**: a minimal Python ROUTER-to-DEALER forwarder (receive, forward, no parsing) with
  64 echo DEALERs in a second process.

Phase 1 (throughput): a closed loop keeps ``concurrency`` requests in flight for ``seconds``.
Phase 2 (latency): open loop at half of phase 1's rate; the round-trip time of each request is
recorded. With instant workers that round trip is the mesh's added latency (plus loopback
transport, which the baseline shows on its own).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import zmq

from mesh import protocol as P
from mesh.procs import ProcGroup, wait_for_log_event

__all__ = ["run_broker_bench"]


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * (len(xs) - 1)))] if xs else float("nan")


def _request_frames(i: int) -> list[bytes]:
    return P.encode_submit(f"b{i}", input_ids=[1, 2, 3, 4, 5, 6, 7, 8], params={"max_new_tokens": 1},
                           stream=False, deadline_ms=10_000)


def _is_terminal(frames: list[bytes]) -> bool:
    # mesh replies: FINAL or ERROR terminate; the baseline echoes the SUBMIT itself.
    return len(frames) >= 2 and frames[1] in (bytes([P.Cmd.C_FINAL]), bytes([P.Cmd.C_ERROR]), bytes([P.Cmd.C_SUBMIT]))


def _closed_loop(endpoint: str, concurrency: int, seconds: float) -> tuple[float, int]:
    """Keep ``concurrency`` requests in flight; returns (requests/s, errors)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.setsockopt(zmq.RCVHWM, 100_000)
    s.connect(endpoint)
    reqs = {f"b{i}": _request_frames(i) for i in range(concurrency)}
    # warm-up: one round trip so the connection is up before timing starts
    s.send_multipart(reqs["b0"])
    while not _is_terminal(s.recv_multipart()):
        pass
    done = errors = 0
    for r in reqs.values():
        s.send_multipart(r)
    t0 = time.perf_counter()
    t_end = t0 + seconds
    while True:
        frames = s.recv_multipart()
        if not _is_terminal(frames):
            continue
        done += 1
        if frames[1] == bytes([P.Cmd.C_ERROR]):
            errors += 1
        if time.perf_counter() >= t_end:
            break
        s.send_multipart(reqs[P.unpack(frames[2])["rid"]])  # reuse the rid that just finished
    elapsed = time.perf_counter() - t0
    s.close()
    ctx.term()
    return done / elapsed, errors


def _open_loop(endpoint: str, rate: float, seconds: float) -> list[float]:
    """Send at a fixed ``rate``; return round-trip times in ms."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.connect(endpoint)
    n = max(1, int(rate * seconds))
    reqs = [_request_frames(i) for i in range(n)]
    rids = [f"b{i}" for i in range(n)]
    sent_at: dict[str, float] = {}
    rtts: list[float] = []
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    t0 = time.perf_counter()
    i = 0
    idle_since = None
    while len(rtts) < n:
        now = time.perf_counter()
        # Send everything that is due (1 ms ticks: the driver must not spin and steal a core).
        while i < n and now >= t0 + i / rate:
            sent_at[rids[i]] = time.perf_counter()
            s.send_multipart(reqs[i])
            i += 1
        if poller.poll(1 if i < n else 100):
            idle_since = None
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if _is_terminal(frames):
                    t = sent_at.pop(P.unpack(frames[2])["rid"], None)
                    if t is not None:
                        rtts.append((time.perf_counter() - t) * 1000)
        elif i >= n:
            idle_since = idle_since or time.perf_counter()
            if time.perf_counter() - idle_since > 5:
                break  # lost replies: stop rather than hang
    s.close()
    ctx.term()
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


def _echo_workers(back_ep: str, n: int) -> None:
    """``n`` DEALERs that send every message straight back (the baseline's instant workers)."""
    ctx = zmq.Context()
    socks = []
    poller = zmq.Poller()
    for _ in range(n):
        sk = ctx.socket(zmq.DEALER)
        sk.setsockopt(zmq.LINGER, 0)
        sk.connect(back_ep)
        poller.register(sk, zmq.POLLIN)
        socks.append(sk)
    print('{"event": "workers_started", "count": %d}' % n, flush=True)
    while True:
        for sk, _ in poller.poll():
            for _ in range(512):
                try:
                    msg = sk.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                sk.send_multipart(msg)


# --------------------------------------------------------------------------- runner


def _measure(endpoint: str, concurrency: int, seconds: float, latency_rate: float | None = None) -> dict:
    """Throughput (closed loop), then round trips in an open loop at ``latency_rate`` (default:
    half of the measured maximum)."""
    rps, errors = _closed_loop(endpoint, concurrency, seconds)
    rate = latency_rate or rps / 2
    rtts = _open_loop(endpoint, rate=rate, seconds=min(seconds, 3.0))
    return {"rps": rps, "errors": errors, "p50_ms": _pct(rtts, 50), "p99_ms": _pct(rtts, 99), "latency_samples": len(rtts),
            "latency_rate_rps": rate}


def run_broker_bench(workers: int = 64, seconds: float = 4.0, concurrency: int = 256, quiet: bool = False) -> dict:
    """Run both arms and return the result dict (also printed unless ``quiet``)."""
    import asyncio
    import subprocess

    from mesh.up import wait_for_workers

    log_dir = Path(tempfile.mkdtemp(prefix="mesh-bench-broker-"))
    with ProcGroup(log_dir) as g:
        b = g.broker("broker", "--policy", "power_of_two", "--log-level", "warning")
        g.workers("instant", [b.backend], "--instant", "--log-level", "info", count=workers)
        asyncio.run(wait_for_workers(b.frontend, workers))
        mesh_res = _measure(b.frontend, concurrency, seconds)
    if True:  # baseline arm: plain subprocesses, no mesh code on the data path
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        fwd_log = log_dir / "forwarder.log"
        with fwd_log.open("wb") as lf:
            fwd = subprocess.Popen([sys.executable, "-m", "mesh.bench.broker_bench", "forwarder"], stdout=lf, stderr=subprocess.STDOUT, env=env)
        rec = wait_for_log_event(fwd_log, "forwarder_listening", 30, fwd)
        echo_log = log_dir / "echo.log"
        with echo_log.open("wb") as lf:
            echo = subprocess.Popen([sys.executable, "-m", "mesh.bench.broker_bench", "echo", rec["backend"], str(workers)],
                                    stdout=lf, stderr=subprocess.STDOUT, env=env)
        try:
            wait_for_log_event(echo_log, "workers_started", 30, echo)
            # the forwarder's round trips are taken at the mesh's half-load rate: same offered load
            base_res = _measure(rec["frontend"], concurrency, seconds, latency_rate=mesh_res["rps"] / 2)
        finally:
            for p in (echo, fwd):
                p.kill()
                p.wait(5)
    res = {
        "rps": round(mesh_res["rps"], 1),
        "baseline_rps": round(base_res["rps"], 1),
        "ratio": round(mesh_res["rps"] / base_res["rps"], 3) if base_res["rps"] else None,
        # added latency: mesh round trip minus the minimal forwarder's at the same offered load
        "p50_ms": round(max(0.0, mesh_res["p50_ms"] - base_res["p50_ms"]), 3),
        "p99_ms": round(max(0.0, mesh_res["p99_ms"] - base_res["p99_ms"]), 3),
        "rtt_p50_ms": round(mesh_res["p50_ms"], 3),
        "rtt_p99_ms": round(mesh_res["p99_ms"], 3),
        "baseline_p50_ms": round(base_res["p50_ms"], 3),
        "baseline_p99_ms": round(base_res["p99_ms"], 3),
        "errors": mesh_res["errors"],
        "workers": workers,
        "concurrency": concurrency,
        "seconds": seconds,
        "latency_rate_rps": round(mesh_res["latency_rate_rps"], 1),
        "cpus": os.cpu_count(),
    }
    if not quiet:
        _print(res)
    return res


def _print(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"mesh bench broker ({res['workers']} instant workers, {res['concurrency']} in flight)")
    t.add_column("arm")
    t.add_column("max req/s", justify="right")
    t.add_column(f"RTT p50 ms @ {res['latency_rate_rps']:.0f}/s", justify="right")
    t.add_column(f"RTT p99 ms @ {res['latency_rate_rps']:.0f}/s", justify="right")
    t.add_row("mesh broker", f"{res['rps']:.0f}", f"{res['rtt_p50_ms']:.3f}", f"{res['rtt_p99_ms']:.3f}")
    t.add_row("minimal forwarder", f"{res['baseline_rps']:.0f}", f"{res['baseline_p50_ms']:.3f}", f"{res['baseline_p99_ms']:.3f}")
    Console().print(t)
    Console().print(f"ratio mesh/forwarder = {res['ratio']}; added latency at {res['latency_rate_rps']:.0f} req/s "
                    f"(half the mesh maximum, both arms): p50 {res['p50_ms']:.3f} ms, p99 {res['p99_ms']:.3f} ms")


def _main() -> None:
    ap = argparse.ArgumentParser(description="internal: baseline processes for mesh bench broker")
    ap.add_argument("role", choices=["forwarder", "echo"])
    ap.add_argument("backend", nargs="?")
    ap.add_argument("count", nargs="?", type=int, default=64)
    a = ap.parse_args()
    if a.role == "forwarder":
        _forwarder("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    else:
        _echo_workers(a.backend, a.count)


if __name__ == "__main__":
    _main()
