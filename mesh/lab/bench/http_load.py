"""Closed-loop HTTP load for ``mesh bench http``: ``wrk`` when it is on PATH, else a built-in
generator in its own process; both report the same numbers.

:func:`run_load` keeps ``c`` connections busy (each sends its next request as soon as the answer
is in, HTTP/1.1 keep-alive) against one URL with one POST body, or a list of bodies that the
built-in generator rotates (request ``i`` sends body ``i mod n``, its
:data:`~mesh.lab.bench.chat_workload.PASS_MARKER` replaced by ``p<i // n>``), for a warm-up, then
for the measured window, and returns requests completed in the window, req/s, round-trip p50/p99/max in
ms, errors (socket errors + HTTP status >= 400, as wrk counts them) and the CPU seconds, over the
same window, of the load generator and of every process role it was given (``roles``: role ->
root pids, see :mod:`mesh.lab.bench.proc_cpu`).

* ``wrk`` (``-t min(2, c) -c c --latency``, the body from a Lua script in a temporary file): the
  warm-up is its own short run; the window is the measured run, whose CPU is taken from
  ``wait4`` (wrk's own, every thread) and around which the roles are sampled. wrk's durations
  are whole seconds. wrk sends one body: a list of bodies is refused (``mesh bench http`` then uses
  the built-in generator).
* ``python`` (``python -m mesh.lab.bench.http_load``: aiohttp on uvloop, ``c`` loops on a pool of
  ``c`` kept-alive connections, taking the bodies in turn): the child warms up, then samples the
  roles and its own ``getrusage`` at its window's edges itself, and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from mesh.lab.bench.proc_cpu import CpuSampler
from mesh.stats import percentile

__all__ = ["request_body", "parse_wrk", "run_load", "wrk_path", "wrk_version", "PROMPT", "check_bodies", "check_sources", "read_bodies"]

PROMPT = "The quick brown fox jumps over the lazy dog"  # 43 bytes
MAX_BODIES = 100_000  # request bodies of one cell (the built-in generator rotates them)
MAX_BODY_BYTES = 8 << 20
MAX_TOTAL_BYTES = 512 << 20
MAX_SOURCES = 250  # loopback source addresses 127.0.0.2 .. 127.0.0.251
_WRK_TIMEOUT_S = 10


def request_body(path: str, *, stream: bool, max_new_tokens: int = 8, prompt: str = PROMPT, model: str = "instant") -> bytes:
    """The JSON body every request of a cell sends, for the endpoint ``path``."""
    if path == "/generate":
        d: dict = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}, "stream": stream}
    elif path == "/v1/completions":
        d = {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "stream": stream}
    elif path == "/v1/chat/completions":
        d = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_new_tokens, "stream": stream}
    else:
        raise ValueError(f"unknown endpoint {path!r} (expected /generate, /v1/completions or /v1/chat/completions)")
    return json.dumps(d, separators=(",", ":")).encode()


# ----------------------------------------------------------------------------- wrk

_UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}


def _ms(tok: str) -> float:
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)(us|ms|s|m|h)", tok.strip())
    if not m:
        raise ValueError(f"wrk: not a duration: {tok!r}")
    return float(m.group(1)) * _UNIT_MS[m.group(2)]


def parse_wrk(text: str) -> dict:
    """Numbers of a ``wrk --latency`` report: requests, seconds, rps, p50/p99/max ms, errors
    (socket connect/read/write/timeout + non-2xx/3xx), and the error breakdown."""
    m = re.search(r"^\s*(\d+) requests in ([0-9.]+\w+),", text, re.M)
    rps = re.search(r"^Requests/sec:\s+([0-9.]+)", text, re.M)
    if not m or not rps:
        raise ValueError("wrk: no 'N requests in T' / 'Requests/sec' line in its output:\n" + text[-2000:])
    out: dict = {"requests": int(m.group(1)), "seconds": _ms(m.group(2)) / 1000.0, "rps": float(rps.group(1))}
    lat = re.search(r"^\s*Latency\s+(\S+)\s+(\S+)\s+(\S+)\s", text, re.M)
    out["max_ms"] = _ms(lat.group(3)) if lat else float("nan")
    for pct, key in (("50", "p50_ms"), ("99", "p99_ms")):
        pm = re.search(rf"^\s*{pct}(?:\.0+)?%\s+(\S+)", text, re.M)
        out[key] = _ms(pm.group(1)) if pm else float("nan")
    detail = {"connect": 0, "read": 0, "write": 0, "timeout": 0, "status": 0}
    se = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if se:
        for k, v in zip(("connect", "read", "write", "timeout"), se.groups()):
            detail[k] = int(v)
    nx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    if nx:
        detail["status"] = int(nx.group(1))
    out["errors"] = sum(detail.values())
    out["error_detail"] = detail
    return out


def wrk_path() -> str | None:
    return shutil.which("wrk")


def wrk_version() -> str | None:
    exe = wrk_path()
    if exe is None:
        return None
    try:
        p = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = (p.stdout or p.stderr).strip().splitlines()
    return line[0] if line else None


def _lua_script(body: bytes, stream: bool) -> str:
    text = body.decode()
    eq = "=" * 4
    while f"]{eq}]" in text:
        eq += "="
    accept = "text/event-stream" if stream else "application/json"
    return (f'wrk.method = "POST"\nwrk.body = [{eq}[{text}]{eq}]\n'
            f'wrk.headers["Content-Type"] = "application/json"\nwrk.headers["Accept"] = "{accept}"\n')


def _wait_rusage(p: subprocess.Popen, timeout_s: float) -> tuple[int, float]:
    """Wait for ``p`` (killing it after ``timeout_s``); returns (exit code, its CPU seconds)."""
    deadline = time.monotonic() + timeout_s
    try:
        fd = os.pidfd_open(p.pid)
    except (AttributeError, OSError):
        fd = None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                p.kill()
                deadline = time.monotonic() + 30
                left = 30
            if fd is not None:
                select.select([fd], [], [], left)
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid == p.pid:
                code = os.waitstatus_to_exitcode(status)
                p.returncode = code  # reaped here: keep Popen from waiting again
                return code, ru.ru_utime + ru.ru_stime
            if fd is None:
                time.sleep(0.005)  # no pidfd: poll the child's exit (the window's end is up to 5 ms late)
    finally:
        if fd is not None:
            os.close(fd)


def _run_wrk(url: str, script: str, c: int, seconds: int, sampler: CpuSampler | None) -> dict:
    exe = wrk_path()
    if exe is None:
        raise RuntimeError("wrk is not on PATH")
    args = [exe, "-t", str(max(1, min(2, c))), "-c", str(c), "-d", f"{seconds}s", "--latency", "--timeout", f"{_WRK_TIMEOUT_S}s",
            "-s", script, url]
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            if sampler is not None:
                sampler.start()
            code, cpu = _wait_rusage(p, seconds + _WRK_TIMEOUT_S + 30)
            roles = sampler.stop() if sampler is not None else {}
        finally:
            if p.returncode is None:
                p.kill()
                p.wait(10)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if code != 0:
        raise RuntimeError(f"wrk exited with {code}:\n{text[-2000:]}")
    res = parse_wrk(text)
    res.update(loadgen="wrk", loadgen_cpu_s=cpu, cpu_s=roles, raw=text)
    return res


# ----------------------------------------------------------------------------- python generator


def check_bodies(bodies: list) -> list[bytes]:
    """The bodies of one cell: 1..MAX_BODIES non-empty UTF-8 byte strings of at most MAX_BODY_BYTES each, and
    MAX_TOTAL_BYTES in all (ValueError naming the field)."""
    if not 1 <= len(bodies) <= MAX_BODIES:
        raise ValueError(f"bodies: expected 1..{MAX_BODIES} request bodies, got {len(bodies)}")
    total = 0
    for i, b in enumerate(bodies):
        if type(b) is not bytes or not b or len(b) > MAX_BODY_BYTES:
            raise ValueError(f"bodies[{i}]: expected a non-empty byte string of at most {MAX_BODY_BYTES} bytes")
        try:
            b.decode()
        except UnicodeDecodeError:
            raise ValueError(f"bodies[{i}]: not UTF-8") from None
        total += len(b)
    if total > MAX_TOTAL_BYTES:
        raise ValueError(f"bodies: {total} bytes in all; the limit is {MAX_TOTAL_BYTES}")
    return bodies


def check_sources(url: str, sources: int) -> None:
    """ValueError naming the field unless ``sources`` is 1, or 2..MAX_SOURCES for a ``http://127.0.0.1:`` URL."""
    if type(sources) is not int or not 1 <= sources <= MAX_SOURCES:
        raise ValueError(f"sources: expected an integer in 1..{MAX_SOURCES}, got {sources!r}")
    if sources > 1 and not url.startswith("http://127.0.0.1:"):
        raise ValueError(f"sources: loopback source addresses need a http://127.0.0.1: URL, got {url[:100]!r}")


def read_bodies(path: Path) -> list[bytes]:
    """The ``--bodies-file`` of the built-in generator: a JSON list of strings (ValueError naming the field)."""
    if path.stat().st_size > MAX_TOTAL_BYTES * 2:
        raise ValueError(f"bodies_file: {path} is over {MAX_TOTAL_BYTES * 2} bytes")
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"bodies_file: {path} is not JSON: {exc}") from None
    if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
        raise ValueError(f"bodies_file: {path} must hold a JSON list of strings")
    try:
        return check_bodies([x.encode() for x in data])
    except UnicodeEncodeError:
        raise ValueError(f"bodies_file: {path} holds a string that is not valid Unicode") from None


def _cpu_self() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _python_load(url: str, bodies: Sequence[bytes], c: int, warmup_s: float, seconds: float,
                       roles: Mapping[str, list[int]], sources: int = 1) -> dict:
    import asyncio
    import itertools
    from contextlib import AsyncExitStack

    import aiohttp

    from mesh.lab.bench.chat_workload import mark_pass

    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    sampler = CpuSampler(roles)
    lat: list[float] = []
    detail = {"connect": 0, "read": 0, "write": 0, "timeout": 0, "status": 0}
    measuring = False
    stop = False
    perf = time.perf_counter
    timeout = aiohttp.ClientTimeout(total=_WRK_TIMEOUT_S)
    sent = itertools.count()
    n_bodies = len(bodies)

    def next_body() -> bytes:
        if n_bodies == 1:
            return bodies[0]
        i = next(sent)
        return mark_pass(bodies[i % n_bodies], i // n_bodies)

    async def loop(session: aiohttp.ClientSession) -> None:
        while not stop:
            body = next_body()
            t0 = perf()
            kind = None
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                    if r.status >= 400:
                        kind = "status"
            except asyncio.TimeoutError:
                kind = "timeout"
            except aiohttp.ClientConnectorError:
                kind = "connect"
            except (aiohttp.ClientError, OSError):
                kind = "read"
            if measuring:
                if kind is None or kind == "status":  # a response (wrk's count); socket errors have none
                    lat.append(perf() - t0)
                if kind is not None:
                    detail[kind] += 1
            if kind == "connect":
                await asyncio.sleep(0.01)  # a refused connection must not spin this loop

    async with AsyncExitStack() as stack:
        sessions = []
        for k in range(sources):  # sources > 1: connections spread over loopback addresses 127.0.0.2, .3, ...
            conn = aiohttp.TCPConnector(limit=-(-c // sources), force_close=False, ttl_dns_cache=None,
                                        **({"local_addr": (f"127.0.0.{2 + k}", 0)} if sources > 1 else {}))
            sessions.append(await stack.enter_async_context(aiohttp.ClientSession(connector=conn, timeout=timeout)))
        tasks = [asyncio.create_task(loop(sessions[i % sources])) for i in range(c)]
        await asyncio.sleep(warmup_s)
        sampler.start()
        cpu0, t0 = _cpu_self(), perf()
        measuring = True
        await asyncio.sleep(seconds)
        measuring = False
        elapsed, cpu1 = perf() - t0, _cpu_self()
        roles_cpu = sampler.stop()
        stop = True
        n = len(lat)
        done, pending = await asyncio.wait(tasks, timeout=_WRK_TIMEOUT_S + 5)
        for t in pending:
            t.cancel()
    lat_ms = sorted(x * 1000 for x in lat)
    nan = float("nan")  # no completed requests: NaN, not mesh.stats' 0.0
    return {"requests": n, "seconds": elapsed, "rps": n / elapsed if elapsed > 0 else 0.0,
            "p50_ms": percentile(lat_ms, 50, presorted=True) if lat_ms else nan,
            "p99_ms": percentile(lat_ms, 99, presorted=True) if lat_ms else nan,
            "max_ms": lat_ms[-1] if lat_ms else nan, "errors": sum(detail.values()),
            "error_detail": detail, "loadgen": "python", "loadgen_cpu_s": cpu1 - cpu0, "cpu_s": roles_cpu}


def _run_python(url: str, bodies: Sequence[bytes], c: int, warmup_s: float, seconds: float,
                roles: Mapping[str, list[int]], sources: int = 1) -> dict:
    with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
        f.write(json.dumps([b.decode() for b in bodies], ensure_ascii=False).encode())
        body_file = f.name
    try:
        args = [sys.executable, "-m", "mesh.lab.bench.http_load", "--url", url, "--bodies-file", body_file, "-c", str(c), "--sources", str(sources),
                "--warmup", str(warmup_s), "--seconds", str(seconds), "--roles", json.dumps({k: list(v) for k, v in roles.items()})]
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        try:
            out, err = p.communicate(timeout=warmup_s + seconds + _WRK_TIMEOUT_S + 60)
        finally:
            if p.returncode is None:
                p.kill()
                p.wait(10)
    finally:
        os.unlink(body_file)
    if p.returncode != 0:
        raise RuntimeError(f"python load generator exited with {p.returncode}:\n{err[-2000:]}")
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"python load generator printed no result:\n{out[-1000:]}\n{err[-1000:]}")
    return json.loads(lines[-1])


def run_load(url: str, body: bytes | Sequence[bytes], c: int, seconds: float, *, warmup_s: float = 1.0,
             loadgen: str = "wrk", roles: Mapping[str, list[int]] | None = None, stream: bool = False,
             sources: int = 1) -> dict:
    """One measured cell (see the module docstring). ``body``: one body, or a list the built-in generator
    rotates. ``loadgen``: ``wrk`` (one body) or ``python``. ``sources`` (built-in generator, a 127.0.0.1
    URL): the connections come from that many loopback addresses (127.0.0.2 ...), so a server that shares
    its work fairly per client address sees that many clients, not one."""
    roles = dict(roles or {})
    bodies = check_bodies([body] if isinstance(body, bytes) else list(body))
    check_sources(url, sources)
    if loadgen == "python":
        return _run_python(url, bodies, c, warmup_s, seconds, roles, sources)
    if sources != 1:
        raise ValueError("sources: wrk connects from one address; more need the built-in generator (python)")
    if loadgen != "wrk":
        raise ValueError(f"loadgen: expected wrk or python, got {loadgen!r}")
    if len(bodies) > 1:
        raise ValueError(f"loadgen: wrk sends one body; {len(bodies)} bodies need the built-in generator (python)")
    body = bodies[0]
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_lua_script(body, stream))
        script = f.name
    try:
        if warmup_s > 0:
            _run_wrk(url, script, c, max(1, round(warmup_s)), None)
        return _run_wrk(url, script, c, max(1, round(seconds)), CpuSampler(roles))
    finally:
        os.unlink(script)


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="internal: the built-in load generator of mesh bench http")
    ap.add_argument("--url", required=True)
    ap.add_argument("--bodies-file", required=True, help="JSON: a list of request bodies (strings), sent in turn")
    ap.add_argument("-c", type=int, required=True)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--roles", default="{}", help="JSON: role -> root pids whose CPU is sampled over the window")
    ap.add_argument("--sources", type=int, default=1, help="loopback source addresses to spread the connections over")
    a = ap.parse_args(argv)
    try:
        bodies = read_bodies(Path(a.bodies_file))
        check_sources(a.url, a.sources)
    except (OSError, ValueError) as exc:
        print(f"http_load: {exc}", file=sys.stderr)
        return 2
    roles = {k: [int(x) for x in v] for k, v in json.loads(a.roles).items()}
    import asyncio

    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        factory = None
    with asyncio.Runner(loop_factory=factory) as r:
        res = r.run(_python_load(a.url, bodies, a.c, a.warmup, a.seconds, roles, a.sources))
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
