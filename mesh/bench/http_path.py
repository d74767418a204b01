"""The path users run, measured: HTTP client -> ``mesh broker --http`` -> ``mesh attach sglang`` ->
``mesh stub-sglang`` (two engines, 100x faster than the modelled GPU), C closed loops of
``/v1/completions`` (8 tokens) for T seconds; prints req/s and round-trip p50/p99.

    python -m mesh.bench.http_path C T

A stop-gap until ``mesh bench http`` (issue 13): run it with ``PYTHONPATH`` pointing at an
exported older tree to compare side by side on the same machine.
"""
import asyncio, sys, tempfile, time, statistics
from pathlib import Path
import aiohttp
from mesh.procs import ProcGroup, wait_for_log_event
from mesh.up import wait_for_workers

C, T = (int(sys.argv[1]), float(sys.argv[2])) if len(sys.argv) == 3 else (16, 8.0)
with ProcGroup(Path(tempfile.mkdtemp())) as g:
    b = g.broker("b", "--http", "127.0.0.1:0", "--log-level", "warning")
    url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen)["url"]
    stubs = []
    for i in range(2):
        p = g._spawn(f"stub{i}", ["stub-sglang", "--port", "0", "--time-scale", "0.01"])
        stubs.append(wait_for_log_event(p.log_path, "sglang_stub_listening", 30, p.popen)["url"])
        g._spawn(f"a{i}", ["attach", "sglang", "--url", stubs[-1], "--broker", b.backend, "--worker-id", f"a{i}"])
    asyncio.run(wait_for_workers(b.frontend, 2))

    async def main():
        lat, errs = [], 0
        async with aiohttp.ClientSession() as s:
            t_end = time.monotonic() + T
            async def loop(k):
                nonlocal errs
                i = 0
                while time.monotonic() < t_end:
                    i += 1
                    t0 = time.perf_counter()
                    async with s.post(url + "/v1/completions", json={"model": "m", "prompt": f"hello {k} {i}", "max_tokens": 8}) as r:
                        await r.read()
                        if r.status != 200:
                            errs += 1
                    lat.append((time.perf_counter() - t0) * 1000)
            t0 = time.monotonic()
            await asyncio.gather(*(loop(k) for k in range(C)))
            el = time.monotonic() - t0
        lat.sort()
        print(f"c={C}: {len(lat)/el:.0f} req/s  p50 {lat[len(lat)//2]:.1f} ms  p99 {lat[int(len(lat)*0.99)]:.1f} ms  errors {errs}")
    asyncio.run(main())
