"""``mesh bench http``: the HTTP path users run, measured end to end next to its baselines, in one run.

Arms, each a set of real processes on 127.0.0.1 (fresh for every arm), each measured at every
concurrency of ``--concurrency`` with a real closed-loop load generator (:mod:`mesh.lab.bench.http_load`:
wrk when on PATH, else the built-in one):

* ``direct``: load generator -> one instant HTTP engine (``mesh instant-engine``, which answers
  SGLang's API at once; the baseline).
* ``broker_zmq``: load generator -> ``mesh broker --http`` -> 4 instant ZMQ workers in one process
  (``mesh worker-stub --instant --count 4``).
* ``broker_adapters`` (the full path): load generator -> ``mesh broker --http`` -> 4 x
  ``mesh attach sglang`` -> 4 instant HTTP engines.
* ``broker_attached``: load generator -> ``mesh broker --http --attach sglang=URL`` x 4 -> the same 4
  instant HTTP engines: the full path with the adapters running inside the broker (linked over
  inproc, no adapter processes, no TCP hop; :mod:`brokers.attached`).
* ``gateway_tokenized`` (with a tokenizer: ``--tokenizer DIR|builtin``): load generator -> ``mesh gateway
  --processes 2 --tokenizer ...`` (two gateway processes on one port, SO_REUSEPORT) -> ``mesh broker`` (no
  HTTP) -> the full path's 4 adapters and engines: prompts (and chat templates) tokenised in the gateways,
  the broker routing by token ids and tokenising nothing. Its ratio to ``broker_adapters`` (the same
  requests, untokenised) is a target (issue 34: >= 0.5 for chat with 1k-token prompts). With
  ``--path /v1/chat/completions`` every arm gets the same multi-turn conversations
  (:mod:`mesh.lab.bench.chat_workload`; ``chat_workload="single"``: one repeated body).
* ``sglang_router`` (when the ``sglang_router`` package is importable, the ``bench`` extra):
  SGLang's Rust router (``--policy round_robin``) -> the same 4 instant HTTP engines. It probes
  each worker's ``/health``, ``/server_info`` and ``/model_info`` when it registers it (and
  ``/health`` every 60 s) and tries to load the tokenizer named by the served model; the
  instant engine answers all of these, and ``HF_ENDPOINT`` points at a closed local port so that
  lookup fails at once instead of leaving the machine.

Each cell (arm, c) warms up (``--warmup``, default 1 s), then measures for ``--seconds``. Besides
req/s and round-trip p50/p99/max, it records the CPU time every process of the arm spent in the
measured window (``/proc/PID/stat`` utime + stime, every thread, see :mod:`mesh.lab.bench.proc_cpu`)
divided by the requests completed in it: microseconds of CPU per request, per role: ``loadgen``,
``gateways`` (the gateway supervisor and its processes), ``router`` (broker or sglang-router),
``adapters`` (sum), ``engines`` (instant engines or ZMQ workers, sum) and ``path`` = gateways +
router + adapters (the whole path's CPU per request).

The mesh arms route with `--broker-policy` (default round_robin, the Rust arm's policy, so the arms
differ in their paths, not in where requests go). Then the targets, computed from this run only. Against SGLang's Rust router in the same run: the
full path's req/s (>= 1.0x at c=64) and CPU per request (<= 1.5x), broker_zmq's req/s (>= 1.5x),
the full path's p50 at c=1 (<= the router's + 0.5 ms). Then the full path's p99/p50 (<= 3 at c=64,
<= 2.5 at c=1), req/s / direct req/s (>= 0.32 at c=64, >= 0.25 at c=1), its max latency (<= 100 ms)
and p50 (<= 1 ms) at c=1, the broker's CPU per request in ``broker_zmq`` (<= 250 us), and
``gateway_tokenized`` req/s / full path req/s (>= 0.5 at c=64); the same four targets against the Rust
router for ``broker_attached`` (the attached path), with its req/s / the full path's and its CPU per
request beside them (no target); sglang_router's
figures (the same formula on its cells) are shown beside them.
With ``--profile``, py-spy samples the router, one adapter and one gateway process during each mesh
arm's highest-concurrency cell; the top entries go into the JSON and the page. A missed target is printed (MISS), not an error: the command exits
non-zero only when an arm broke.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mesh.lab.bench.profile import Sampler
from mesh.lab.bench.chat_workload import CHATML_TEMPLATE, CHATML_TOKENS, chat_bodies, check_shape, mark_pass
from mesh.lab.bench.http_load import MAX_SOURCES, PROMPT, request_body, run_load, wrk_path, wrk_version
from mesh.lab.bench.report import fmt as _f
from mesh.lab.procs import Proc, ProcGroup, free_port, wait_for_log_event
from mesh.lab.up import wait_for_workers

__all__ = ["ALL_ARMS", "builtin_tokenizer", "workload", "run_http_bench", "evaluate_targets", "cpu_budget", "print_results",
           "sglang_router_available"]

ALL_ARMS = ("direct", "broker_zmq", "broker_zmq_tokenized", "broker_adapters", "broker_attached", "gateway_tokenized",
            "sglang_router")
# broker_zmq_tokenized: broker_zmq with --tokenizer (only with run_http_bench(tokenizer=...)): the
# same requests, tokenised off the loop with the model's tokenizer before routing
# gateway_tokenized: 2 gateway processes (tokenising) -> a broker without HTTP -> the full path's adapters
FULL_PATH = "broker_adapters"
# the full path with the adapters inside the broker (mesh broker --attach sglang=URL x4: no adapter processes)
ATTACHED_PATH = "broker_attached"
GATEWAY_ARM, GATEWAY_PROCESSES = "gateway_tokenized", 2
ROLES = ("loadgen", "gateways", "router", "adapters", "engines")
PATH_ROLES = ("gateways", "router", "adapters")  # the path's CPU per request: what mesh runs between load and engines
MODEL = "instant"
_ENGINE_POSTS = {"/generate", "/v1/completions"}  # what mesh instant-engine answers
_BROKER_POSTS = {"/generate", "/v1/completions", "/v1/chat/completions"}  # the broker's HTTP ingress
_STARTUP_S = 60.0
CHAT_WORKLOADS = ("conversations", "single")
CHAT_CONVERSATIONS, CHAT_TURNS, CHAT_PROMPT_TOKENS = 256, 4, 1000  # the conversations workload's defaults
_DRAIN_S = 2.0


def sglang_router_available() -> bool:
    try:
        return importlib.util.find_spec("sglang_router") is not None
    except (ImportError, ValueError):
        return False


@dataclass
class _Arm:
    name: str
    url: str = ""
    roles: dict[str, list[int]] = field(default_factory=dict)  # role -> root pids (loadgen excluded)
    engine_logs: list[Path] = field(default_factory=list)


class ArmSkipped(Exception):
    """The arm cannot run here (not an error): the reason is printed and recorded."""


# ----------------------------------------------------------------------------- processes


def _spawn_engines(g: ProcGroup, n: int, prefix: str = "engine") -> tuple[list[Proc], list[str]]:
    """Start ``n`` instant engines (all at once), wait for each one's readiness line."""
    procs = [g._spawn(f"{prefix}{i}", ["instant-engine", "--host", "127.0.0.1", "--port", "0", "--model", MODEL])
             for i in range(n)]
    urls = [wait_for_log_event(p.log_path, "instant_engine_listening", _STARTUP_S, p.popen, start=p.log_start)["url"]
            for p in procs]
    return procs, urls


def _broker(g: ProcGroup, policy: str | None, tokenizer: str | None = None, http: bool = True,
            attach: Iterable[str] = ()) -> tuple[Proc, str]:
    # a short drain: the load is over when the arm is stopped; the default 10 s would only slow the teardown
    extra = (["--http", "127.0.0.1:0"] if http else []) + ["--log-level", "warning", "--drain-timeout-s", str(_DRAIN_S)] + (
        ["--policy", policy] if policy else []) + (["--tokenizer", tokenizer] if tokenizer else []) + [
        a for u in attach for a in ("--attach", f"sglang={u}")]
    b = g.broker("broker", *extra, timeout_s=_STARTUP_S)
    if not http:
        return b, ""
    url = wait_for_log_event(b.log_path, "http_listening", _STARTUP_S, b.popen, start=b.log_start)["url"]
    return b, url


def _gateways(g: ProcGroup, broker: str, tokenizer: str) -> tuple[Proc, str]:
    """``mesh gateway --processes 2`` (one supervisor, two gateway processes on one port) tokenising
    with ``tokenizer``; -> (the supervisor, its URL) once both processes listen."""
    gw = g._spawn("gateway", ["gateway", "--broker", broker, "--http", "127.0.0.1:0", "--processes", str(GATEWAY_PROCESSES),
                              "--tokenizer", tokenizer, "--log-level", "warning"])
    return gw, wait_for_log_event(gw.log_path, "gateway_listening", _STARTUP_S, gw.popen, start=gw.log_start)["url"]


def _adapters(g: ProcGroup, broker: Proc, engines: int) -> tuple[list[Proc], list[Proc]]:
    """``engines`` instant HTTP engines, each behind ``mesh attach sglang`` registered with ``broker``."""
    procs, urls = _spawn_engines(g, engines)
    adapters = [g._spawn(f"a{i}", ["attach", "sglang", "--url", u, "--broker", broker.backend, "--worker-id", f"a{i}",
                                   "--log-level", "warning", "--drain-timeout-s", str(_DRAIN_S)]) for i, u in enumerate(urls)]
    asyncio.run(wait_for_workers(broker.frontend, engines, timeout_s=_STARTUP_S))
    return procs, adapters


def post(url: str, body: bytes, timeout_s: float = 10.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _probe(arm: _Arm, path: str, body: bytes) -> None:
    """One request through the arm before any load: a broken arm fails here with its answer."""
    status, data = post(arm.url + path, body)
    if status != 200:
        raise RuntimeError(f"probe {path} answered HTTP {status}: {data[:300].decode(errors='replace')}")


def _start_arm(g: ProcGroup, name: str, *, engines: int, policy: str | None, log_dir: Path, path: str, body: bytes,
               tokenizer: str | None = None) -> _Arm:
    arm = _Arm(name)
    if name == "direct":
        procs, urls = _spawn_engines(g, 1)
        arm.url, arm.roles = urls[0], {"engines": [procs[0].pid]}
        arm.engine_logs = [p.log_path for p in procs]
    elif name in ("broker_zmq", "broker_zmq_tokenized"):
        if name == "broker_zmq_tokenized" and not tokenizer:
            raise ArmSkipped("needs --tokenizer (a model folder, or builtin)")
        b, arm.url = _broker(g, policy, tokenizer if name == "broker_zmq_tokenized" else None)
        w = g.workers("workers", [b.backend], "--instant", "--log-level", "warning", count=engines, timeout_s=_STARTUP_S)
        asyncio.run(wait_for_workers(b.frontend, engines, timeout_s=_STARTUP_S))
        arm.roles = {"router": [b.pid], "engines": [w.pid]}
    elif name in ("broker_adapters", GATEWAY_ARM):
        if name == GATEWAY_ARM and not tokenizer:
            raise ArmSkipped("needs --tokenizer (a model folder, or builtin)")
        b, arm.url = _broker(g, policy, http=name == "broker_adapters")
        procs, adapters = _adapters(g, b, engines)
        arm.roles = {"router": [b.pid], "adapters": [a.pid for a in adapters], "engines": [p.pid for p in procs]}
        if name == GATEWAY_ARM:
            gw, arm.url = _gateways(g, b.frontend, tokenizer)
            arm.roles["gateways"] = [gw.pid]  # the supervisor: its processes are its descendants
            _wait_gateway_ready(arm.url, path, body)
        arm.engine_logs = [p.log_path for p in procs]
    elif name == ATTACHED_PATH:
        procs, urls = _spawn_engines(g, engines)
        b, arm.url = _broker(g, policy, attach=urls)
        asyncio.run(wait_for_workers(b.frontend, engines, timeout_s=_STARTUP_S))
        arm.roles = {"router": [b.pid], "engines": [p.pid for p in procs]}  # the adapters' CPU is the broker's
        arm.engine_logs = [p.log_path for p in procs]
    elif name == "sglang_router":
        if not sglang_router_available():
            raise ArmSkipped("the sglang_router package is not importable (pip install '.[bench]')")
        procs, urls = _spawn_engines(g, engines)
        r = _spawn_sglang_router(g, urls, log_dir)
        arm.url = r.url
        arm.roles = {"router": [r.proc.pid], "engines": [p.pid for p in procs]}
        arm.engine_logs = [p.log_path for p in procs]
        _wait_router_ready(r, path, body)
    else:
        raise ValueError(f"unknown arm {name!r}")
    _probe(arm, path, body)
    return arm


@dataclass
class _Router:
    proc: Proc
    url: str


def _spawn_sglang_router(g: ProcGroup, worker_urls: list[str], log_dir: Path) -> _Router:
    port, prom = free_port(), free_port()
    hf = log_dir / "hf-home"
    hf.mkdir(parents=True, exist_ok=True)
    # The router tries to fetch the served model's tokenizer from the Hugging Face hub: point it at
    # a closed local port (fails at once, stays on this machine) with an empty cache.
    env = {**os.environ, **g.env, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1",
           "NO_COLOR": "1", "RUST_LOG_STYLE": "never"}
    args = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, "--policy", "round_robin",
            "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
            "--log-level", "warn", "--shutdown-grace-period-secs", "1"]
    log_path = log_dir / "sglang_router.log"
    with log_path.open("ab") as log:
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)
    proc = Proc("sglang_router", p, log_path)
    g.procs.append(proc)  # stopped with the group
    return _Router(proc, f"http://127.0.0.1:{port}")


def _wait_gateway_ready(url: str, path: str, body: bytes) -> None:
    """Each gateway process learns the broker's workers from its own STATUS poll (every second):
    until then it answers 503. Poll with the benchmark's request until it answers 200 a few times in
    a row on fresh connections (both processes)."""
    deadline, ok, last = time.monotonic() + _STARTUP_S, 0, "no answer"
    while ok < 4 * GATEWAY_PROCESSES:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateways did not answer 200 within {_STARTUP_S:.0f}s ({last})")
        status, data = post(url + path, body, timeout_s=10)
        ok = ok + 1 if status == 200 else 0
        last = f"HTTP {status}: {data[:200].decode(errors='replace')}"
        if status != 200:
            time.sleep(0.1)  # polling interval of a readiness wait


def _wait_router_ready(r: _Router, path: str, body: bytes) -> None:
    """The router registers its workers in the background: poll with the benchmark's own request
    until it answers 200 (a readiness wait on the real path)."""
    deadline = time.monotonic() + _STARTUP_S
    last = "no answer"
    while time.monotonic() < deadline:
        if not r.proc.alive():
            raise RuntimeError(f"sglang_router exited ({r.proc.popen.returncode}); log tail:\n{_tail(r.proc.log_path)}")
        try:
            status, data = post(r.url + path, body, timeout_s=5)
            if status == 200:
                return
            last = f"HTTP {status}: {data[:200].decode(errors='replace')}"
        except (OSError, urllib.error.URLError) as exc:
            last = repr(exc)
        time.sleep(0.1)  # polling interval of a readiness wait
    raise RuntimeError(f"sglang_router not ready within {_STARTUP_S:.0f}s ({last}); log tail:\n{_tail(r.proc.log_path)}")


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def stop_front_to_back(g: ProcGroup, grace_s: float = 10.0) -> None:
    """Stop the arm from the load's side inwards: the router (broker or sglang-router) first, so
    what is still in flight drains through live adapters and engines; then the adapters; then the
    engines. (All at once, an engine could go before the adapter proxying to it, failing requests
    the broker then retries on the others and an adapter's drain would wait for nothing.)"""
    def layer(p: Proc) -> int:
        if p.name == "gateway":
            return 0
        if p.name in ("broker", "sglang_router"):
            return 1
        return 2 if p.name.startswith("a") and p.name[1:].isdigit() else 3

    for k in range(4):
        g.stop_all(grace_s, procs=[p for p in g.procs if layer(p) == k])


def _engine_stats(logs: Iterable[Path], bench_path: str) -> tuple[dict[str, int], list[int | None]]:
    """Requests per path the engines saw, summed (what a router or adapter asks an engine), and
    each engine's count of ``bench_path`` (how evenly the arm spread the load), from their
    ``instant_engine_stopped`` lines (read after the stop; None for an engine without one)."""
    total: dict[str, int] = {}
    per_engine: list[int | None] = []
    for path in logs:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        rec = None
        for line in lines:
            if '"instant_engine_stopped"' in line:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    pass
        if rec is None:
            per_engine.append(None)
            continue
        paths = rec.get("paths") or {}
        for k, v in paths.items():
            total[k] = total.get(k, 0) + int(v)
        per_engine.append(int(paths.get(bench_path, 0)))
    return dict(sorted(total.items(), key=lambda kv: -kv[1])), per_engine


# ----------------------------------------------------------------------------- workload


def builtin_tokenizer(dest: Path) -> str:
    """``--tokenizer builtin``: Mistral-Nemo's Tekken vocabulary (shipped by mistral-common) with a chat
    template, ChatML (:mod:`mesh.lab.bench.chat_workload`). Without one, the ingress sends chat as the plain
    "role: content" text and encodes it whole every time: the chat template and its prefix cache go unmeasured."""
    from mesh.lab.tokenizer_builtin import build_model_dir

    return str(build_model_dir(dest, chat_template=CHATML_TEMPLATE, extra_special_tokens=CHATML_TOKENS, tokenizer="tekken"))


def workload(path: str, tokenizer: str | None, prompt_tokens: int | None, *, stream: bool, max_new_tokens: int,
              shape: tuple[int, int] | None) -> tuple[list[bytes], dict]:
    """The request bodies of every cell and what the config records of them. ``shape`` (conversations,
    turns): the chat conversations workload; None: one body (a prompt of ``prompt_tokens`` tokens of
    ``tokenizer``, words without one; the 43-byte sentence without ``prompt_tokens``)."""
    tok = None
    if tokenizer and (prompt_tokens or shape):
        from mesh.tokenization import ModelTokenizer

        tok = ModelTokenizer.from_dir(tokenizer)

    def text(n: int, seed: int) -> str:
        if tok is not None:
            from mesh.lab.bench.tokenizer_bench import make_prompt

            return make_prompt(tok.files.tokenizer, n, seed)
        return " ".join(f"w{(i * 31 + seed * 7919) % 9973}" for i in range(n))

    if shape is None:
        prompt = text(prompt_tokens, 0) if prompt_tokens else PROMPT
        body = request_body(path, stream=stream, max_new_tokens=max_new_tokens, model=MODEL, prompt=prompt)
        return [body], {"workload": "single", "prompt_bytes": len(prompt.encode()), "prompt_tokens": prompt_tokens}
    n = prompt_tokens or CHAT_PROMPT_TOKENS
    bodies = chat_bodies(text, prompt_tokens=n, conversations=shape[0], turns=shape[1], model=MODEL,
                         max_new_tokens=max_new_tokens, stream=stream)
    info = {"workload": "conversations", "client_addresses": "one per connection", "conversations": shape[0],
            "turns": shape[1], "prompt_tokens": n,
            "bodies": len(bodies), "prompt_bytes": round(sum(map(len, bodies)) / len(bodies))}
    if tok is not None and tok.chat_template is not None:  # the rendered prompts' mean length, in tokens
        lens = [len(tok.render_chat(json.loads(mark_pass(b, 0))["messages"])[1]) for b in bodies]
        info["prompt_tokens_mean"] = round(sum(lens) / len(lens))
    return bodies, info


# ----------------------------------------------------------------------------- run


def _served(arm: str, path: str) -> bool:
    return path in (_BROKER_POSTS if arm.startswith(("broker", "gateway")) else _ENGINE_POSTS)


_PROFILED_ROLES = ("router", "adapters", "gateways")  # one process of each; sglang_router is Rust (py-spy reads Python)


def _first_child(pid: int) -> int | None:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


def _sampler(arm: _Arm, seconds: float, out_dir: Path) -> Sampler | None:
    """py-spy on the first process of each mesh role of the arm (a gateway group: its first child,
    the supervisor only waits); None for arms that run no mesh process."""
    if arm.name in ("direct", "sglang_router"):
        return None
    targets: dict[str, int] = {}
    for role in _PROFILED_ROLES:
        pids = arm.roles.get(role) or []
        if not pids:
            continue
        pid = _first_child(pids[0]) if role == "gateways" else pids[0]
        if pid is not None:
            targets[role] = pid
    return Sampler(targets, seconds, out_dir) if targets else None


def _per_req(cpu_s: float | None, n: int) -> float | None:
    if cpu_s is None or n <= 0:
        return None
    return round(cpu_s / n * 1e6, 1)


def _cell(arm: _Arm, c: int, res: dict) -> dict:
    n = int(res["requests"])
    cpu = {"loadgen": res.get("loadgen_cpu_s")}
    for role in ROLES[1:]:
        cpu[role] = res["cpu_s"].get(role) if role in arm.roles else None
    us = {role: _per_req(v, n) for role, v in cpu.items()}
    path_parts = [us[r] for r in PATH_ROLES if us[r] is not None]
    us["path"] = round(sum(path_parts), 1) if n > 0 else None
    return {
        "arm": arm.name, "c": c, "loadgen": res["loadgen"], "requests": n, "seconds": round(res["seconds"], 3),
        "rps": round(res["rps"], 1), "ok_rps": round(res["rps"] * max(0, n - int((res.get("error_detail") or {}).get("status", 0))) / n, 1) if n > 0 else 0.0,
        "p50_ms": round(res["p50_ms"], 3), "p99_ms": round(res["p99_ms"], 3),
        "max_ms": round(res["max_ms"], 3), "errors": int(res["errors"]), "error_detail": res.get("error_detail", {}),
        "cpu_us_per_req": us, "cpu_s": {k: (round(v, 3) if v is not None else None) for k, v in cpu.items()},
        "processes": {role: len(pids) for role, pids in arm.roles.items()}, "cpus": os.cpu_count(),
    }


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in ("mesh-router", "aiohttp", "uvloop", "httptools", "orjson", "pyzmq", "msgpack", "sglang-router", "rich"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def machine() -> dict:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpus": os.cpu_count(), "cpus_usable": affinity, "platform": platform.platform(),
            "python": platform.python_version(), "packages": _versions(), "wrk": wrk_version(),
            "loadavg_at_start": [round(x, 2) for x in load] if load else None}


@contextmanager
def sigterm_as_interrupt():
    """SIGTERM to the benchmark stops it like Ctrl-C, so its processes are stopped too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_http_bench(*, arms: Iterable[str] | None = None, concurrency: Iterable[int] = (1, 64), seconds: float = 8.0,
                   warmup_s: float = 1.0, path: str = "/generate", stream: bool = False, max_new_tokens: int = 8,
                   loadgen: str = "auto", engines: int = 4, broker_policy: str | None = None,
                   progress: Callable[[str], None] | None = None, say: Callable[[str], None] | None = None,
                   log_dir: str | Path | None = None, tokenizer: str | None = None, prompt_tokens: int | None = None,
                   profile: bool = False, chat_workload: str = "conversations", conversations: int = CHAT_CONVERSATIONS,
                   turns: int = CHAT_TURNS) -> dict:
    """Run every (arm, concurrency) cell and return the results (see the module docstring).

    ``arms``: default all (sglang_router only when importable; asked for explicitly and missing,
    it is skipped with the reason). ``loadgen``: ``auto`` (wrk when on PATH), ``wrk`` or
    ``python``. ``progress(label)`` is called after each cell (skipped ones included), ``say(msg)``
    for notices (skips, arm failures). ``tokenizer``: a model folder, or ``"builtin"`` (the
    Tekken tokenizer mistral-common ships, converted into a folder under the logs), for the
    ``broker_zmq_tokenized`` and ``gateway_tokenized`` arms; ``prompt_tokens``: the prompt's length in that tokenizer's tokens
    (words otherwise). ``profile``: sample the router, one adapter and one gateway process with py-spy
    during each mesh arm's highest-concurrency cell (:mod:`mesh.lab.bench.profile`); the top entries land
    in that cell's ``profile``. ``chat_workload`` (``/v1/chat/completions`` only): ``conversations``
    (``conversations`` x ``turns`` multi-turn chats sharing a system prompt, ``prompt_tokens`` on average,
    default 1000; :mod:`mesh.lab.bench.chat_workload`; the built-in load generator) or ``single`` (one
    user message of ``prompt_tokens``, every request the same body)."""
    say = say or (lambda m: print(m, file=sys.stderr))
    concurrency = [int(c) for c in concurrency]
    if not concurrency or any(c < 1 for c in concurrency):
        raise ValueError("concurrency: positive integers")
    if seconds <= 0 or warmup_s < 0:
        raise ValueError("seconds must be > 0 and warmup >= 0")
    if arms is None:
        arm_list = [a for a in ALL_ARMS if a != "sglang_router" or sglang_router_available()]
    else:
        arm_list = list(arms)
    bad = [a for a in arm_list if a not in ALL_ARMS]
    if bad:
        raise ValueError(f"unknown arm(s) {bad}: choose from {', '.join(ALL_ARMS)}")
    multi = path == "/v1/chat/completions" and chat_workload == "conversations"
    if chat_workload not in CHAT_WORKLOADS:
        raise ValueError(f"chat_workload: expected one of {', '.join(CHAT_WORKLOADS)}, got {chat_workload!r}")
    if multi:
        check_shape(conversations, turns, prompt_tokens or CHAT_PROMPT_TOKENS)
        if loadgen == "wrk":
            raise ValueError("loadgen: wrk sends one body; the chat conversations workload needs the built-in generator "
                             "(--loadgen python, or --chat-workload single)")
    if loadgen == "auto":  # wrk sends one body: the conversations rotate a list, in the built-in generator
        loadgen = "wrk" if wrk_path() and not multi else "python"
        if multi and wrk_path():
            say("[bench http] the chat conversations workload runs on the built-in load generator (wrk sends one body)")
    if loadgen == "wrk" and not wrk_path():
        raise ValueError("loadgen wrk: wrk is not on PATH")
    if loadgen not in ("wrk", "python"):
        raise ValueError(f"loadgen: expected auto, wrk or python, got {loadgen!r}")
    root = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mesh-bench-http-"))
    if tokenizer == "builtin":
        tokenizer = builtin_tokenizer(root / "model")
    if tokenizer is None:
        arm_list = [a for a in arm_list if a not in ("broker_zmq_tokenized", GATEWAY_ARM)] if arms is None else arm_list
    bodies, shape_info = workload(path, tokenizer, prompt_tokens, stream=stream, max_new_tokens=max_new_tokens,
                                 shape=(conversations, turns) if multi else None)
    body = bodies[0]  # the readiness probes' request
    res: dict = {
        "bench": "http",
        "config": {"arms": arm_list, "concurrency": concurrency, "seconds": seconds, "warmup_s": warmup_s, "path": path,
                   "stream": stream, "max_new_tokens": max_new_tokens, **shape_info, "tokenizer": tokenizer,
                   "loadgen": loadgen, "engines": engines, "broker_policy": broker_policy or "default",
                   "sglang_router_policy": "round_robin", "log_dir": str(root), "profile": profile},
        "machine": machine(),
        "cells": [],
        "arms": {},
    }
    with sigterm_as_interrupt():
        for name in arm_list:
            info: dict = {"status": "ok"}
            res["arms"][name] = info
            if not _served(name, path):
                info.update(status="skipped", reason=f"{path} is not served by this arm (the instant engine answers "
                                                     f"{', '.join(sorted(_ENGINE_POSTS))})")
                say(f"[bench http] {name}: skipped: {info['reason']}")
                for c in concurrency:
                    progress and progress(f"{name} c={c} (skipped)")
                continue
            arm_dir = root / name
            done_cells = 0
            with ProcGroup(arm_dir) as g:
                try:
                    arm = _start_arm(g, name, engines=engines, policy=broker_policy, log_dir=arm_dir, path=path, body=body,
                                     tokenizer=tokenizer)
                    info["processes"] = {role: len(p) for role, p in arm.roles.items()}
                    for c in concurrency:
                        sampler = _sampler(arm, seconds + warmup_s, arm_dir) if profile and c == max(concurrency) else None
                        if sampler is not None:
                            sampler.start()
                        # the conversations are many users: one loopback address a connection (up to 250)
                        out = run_load(arm.url + path, bodies, c, seconds, warmup_s=warmup_s, loadgen=loadgen,
                                       sources=min(c, MAX_SOURCES) if multi else 1,
                                       roles=arm.roles, stream=stream)
                        dead = [p.name for p in g.procs if not p.alive()]
                        if dead:
                            raise RuntimeError(f"process(es) died during c={c}: {dead}")
                        res["cells"].append(_cell(arm, c, out))
                        if sampler is not None:
                            res["cells"][-1]["profile"] = sampler.finish()
                        done_cells += 1
                        progress and progress(f"{name} c={c}")
                except ArmSkipped as exc:
                    info.update(status="skipped", reason=str(exc))
                    say(f"[bench http] {name}: skipped: {exc}")
                except KeyboardInterrupt:
                    raise
                except Exception as exc:  # noqa: BLE001 - one broken arm must not hide the others' results
                    info.update(status="error", reason=f"{type(exc).__name__}: {exc}"[:2000])
                    say(f"[bench http] {name}: FAILED: {info['reason']}")
                finally:
                    stop_front_to_back(g)
                    for _ in range(len(concurrency) - done_cells):
                        progress and progress(f"{name} (not run)")
            if name in ("direct", FULL_PATH, ATTACHED_PATH, GATEWAY_ARM, "sglang_router") and info["status"] == "ok":
                engine_path = "/generate" if name in (FULL_PATH, ATTACHED_PATH, GATEWAY_ARM) else path  # adapters call /generate
                info["engine_paths"], info["engine_requests"] = _engine_stats(arm.engine_logs, engine_path)
                info["engine_requests_path"] = engine_path
    try:
        res["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    res["targets"] = evaluate_targets(res["cells"], concurrency)
    res["budget"] = cpu_budget(res["cells"], concurrency)
    res["ok"] = all(a["status"] != "error" for a in res["arms"].values())
    return res


# ----------------------------------------------------------------------------- targets


def _find(cells: list[dict], arm: str, c: int) -> dict | None:
    for cell in cells:
        if cell["arm"] == arm and cell["c"] == c:
            return cell
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or a != a or b != b:
        return None
    return round(a / b, 3)


def evaluate_targets(cells: list[dict], concurrency: Iterable[int]) -> list[dict]:
    """The targets' figures from this run: one row per (target, c), with mesh's value, the
    comparison value of sglang_router (same formula on its cells) and PASS/MISS (``n/a`` when a
    needed arm did not run; ``info`` for a concurrency without a target)."""
    rows: list[dict] = []

    def add(name: str, c: int, op: str, target: float | None, value: float | None, sglang: float | None, unit: str = "") -> None:
        if value is None:
            result = "n/a"
        elif target is None:
            result = "info"
        else:
            result = "PASS" if (value >= target if op == ">=" else value <= target) else "MISS"
        rows.append({"name": name, "c": c, "op": op, "target": target, "value": value, "sglang_router": sglang,
                     "unit": unit, "result": result})

    def against_rust(label: str, cell: dict | None, sg: dict | None, c: int) -> None:
        """A path's targets against SGLang's Rust router in the same run (issue 34); the router's
        own column stays empty where it would be a ratio to itself."""
        sg_rps = sg["rps"] if sg else None
        add(f"{label} req/s / sglang_router req/s", c, ">=", 1.0 if c == 64 else None,
            _ratio(cell["rps"], sg_rps) if cell else None, None)
        add(f"{label} CPU per request / sglang_router's", c, "<=", 1.5 if c == 64 else None,
            _ratio(cell["cpu_us_per_req"]["path"], sg["cpu_us_per_req"]["path"] if sg else None) if cell else None, None)
        if c == 1:
            add(f"{label} p50 - sglang_router p50", c, "<=", 0.5,
                round(cell["p50_ms"] - sg["p50_ms"], 3) if cell and sg else None, None, "ms")
        add(f"{label} p99 / p50", c, "<=", 3.0 if c == 64 else (2.5 if c == 1 else None),
            _ratio(cell["p99_ms"], cell["p50_ms"]) if cell else None, _ratio(sg["p99_ms"], sg["p50_ms"]) if sg else None)

    for c in concurrency:
        direct, full, sg, zmq = (_find(cells, a, c) for a in ("direct", FULL_PATH, "sglang_router", "broker_zmq"))
        d_rps = direct["rps"] if direct else None
        sg_rps = sg["rps"] if sg else None
        sg_path_us = sg["cpu_us_per_req"]["path"] if sg else None
        against_rust("full path", full, sg, c)
        add("broker_zmq req/s / sglang_router req/s", c, ">=", 1.5 if c == 64 else None,
            _ratio(zmq["rps"], sg_rps) if zmq else None, None)
        add("full path req/s / direct req/s", c, ">=", {1: 0.25, 64: 0.32}.get(c),
            _ratio(full["rps"], d_rps) if full else None, _ratio(sg_rps, d_rps) if sg else None)
        if c == 1:
            add("full path max latency", c, "<=", 100.0, full["max_ms"] if full else None, sg["max_ms"] if sg else None, "ms")
            add("full path p50", c, "<=", 1.0, full["p50_ms"] if full else None, sg["p50_ms"] if sg else None, "ms")
        add("broker_zmq router CPU per request", c, "<=", 250.0,
            zmq["cpu_us_per_req"]["router"] if zmq else None, sg["cpu_us_per_req"]["router"] if sg else None, "us")
        add("full path CPU per request (router + adapters)", c, "<=", None,
            full["cpu_us_per_req"]["path"] if full else None, sg_path_us, "us")
        attached = _find(cells, ATTACHED_PATH, c)  # the full path with the adapters in the broker (--attach)
        against_rust("attached path", attached, sg, c)
        add("attached path req/s / full path req/s", c, ">=", None,
            _ratio(attached["rps"], full["rps"]) if attached and full else None, None)
        add("attached path CPU per request (router)", c, "<=", None,
            attached["cpu_us_per_req"]["path"] if attached else None, sg_path_us, "us")
        gw = _find(cells, GATEWAY_ARM, c)
        # answered 200 (an arm's refusals, e.g. a tokenizer pool's fair share of one client address, are not throughput)
        add(f"tokenised via {GATEWAY_PROCESSES} gateways req/s / full path req/s (200s)", c, ">=", 0.5 if c == 64 else None,
            _ratio(gw.get("ok_rps", gw["rps"]), full.get("ok_rps", full["rps"])) if gw and full else None, None)
    return rows


def cpu_budget(cells: list[dict], concurrency: Iterable[int]) -> list[dict]:
    """Where each arm's CPU went, per request, and what bounds its req/s (pure; issue 34's "the
    profile that bounds it"). Per (arm, c): the CPU per request of the load generator, the engines
    and the path (``total_us``), and ``cores_busy`` = req/s x total: how much of the machine the
    arm kept busy. When ``cores_busy`` is close to the CPU count, req/s is that CPU divided by the
    total, and the path's share is what a faster path can win (at c=1 one request at a time keeps
    about one CPU busy: latency, not CPU, bounds req/s there). Arms without a path (direct) are
    left out. ``match_path_us``: the path's CPU per request at which this arm, given the CPU it
    had and the same load generator and engine cost per request, would have served the Rust
    router's req/s at that concurrency (``path_over_match`` = path / that; None without the Rust
    arm or when the load generator and engines alone would already exceed it);
    ``path_us_at_1_5x`` the same at 1.5x the Rust router's req/s (broker_zmq's target), zero or
    negative when no path could reach it on this machine."""
    out: list[dict] = []
    for c in concurrency:
        sg = _find(cells, "sglang_router", c)
        for cell in cells:
            if cell["c"] != c:
                continue
            us = cell.get("cpu_us_per_req") or {}
            parts = {k: us.get(k) for k in ("loadgen", "engines", "path")}
            if cell["rps"] <= 0 or any(v is None for v in parts.values()) or not parts["path"]:
                continue  # (direct: no path between the load and the engine)
            total = parts["loadgen"] + parts["engines"] + parts["path"]
            busy = cell["rps"] * total / 1e6
            row = {"arm": cell["arm"], "c": c, "rps": cell["rps"], **{f"{k}_us": round(v, 1) for k, v in parts.items()},
                   "total_us": round(total, 1), "cores_busy": round(busy, 3), "match_path_us": None, "path_over_match": None}
            if sg and sg["rps"] > 0 and cell["arm"] != "sglang_router":
                room = busy / sg["rps"] * 1e6 - parts["loadgen"] - parts["engines"]
                if room > 0:
                    row["match_path_us"] = round(room, 1)
                    row["path_over_match"] = round(parts["path"] / room, 3)
                # the same at 1.5x the Rust router's req/s (broker_zmq's target); <= 0: out of reach on this machine
                row["path_us_at_1_5x"] = round(busy / (1.5 * sg["rps"]) * 1e6 - parts["loadgen"] - parts["engines"], 1)
            out.append(row)
    return out


# ----------------------------------------------------------------------------- output


def print_results(res: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    cfg = res["config"]
    for c in cfg["concurrency"]:
        t = Table(title=f"mesh bench http: c={c}, {cfg['seconds']:g} s per cell, POST {cfg['path']}"
                        f"{' (stream)' if cfg['stream'] else ''}, max_new_tokens {cfg['max_new_tokens']}, "
                        f"loadgen {cfg['loadgen']}, {res['machine']['cpus']} CPUs")
        t.add_column("arm")
        for col in ("req/s", "p50 ms", "p99 ms", "max ms", "errors", "CPU us/req loadgen", "gateways", "router", "adapters",
                    "engines", "path"):
            t.add_column(col, justify="right")
        for name, info in res["arms"].items():
            cell = _find(res["cells"], name, c)
            if cell is None:
                t.add_row(name, f"[dim]{info['status']}[/dim]", *([""] * 11))
                continue
            us = cell["cpu_us_per_req"]
            t.add_row(name, _f(cell["rps"]), _f(cell["p50_ms"], "{:.2f}"), _f(cell["p99_ms"], "{:.2f}"), _f(cell["max_ms"], "{:.1f}"),
                      str(cell["errors"]), _f(us["loadgen"]), _f(us.get("gateways")), _f(us["router"]), _f(us["adapters"]), _f(us["engines"]),
                      _f(us["path"]), style="bold" if name == FULL_PATH else None)
        con.print(t)
    t = Table(title=f"targets (from this run; full path = {FULL_PATH}, sglang_router for comparison)")
    for col, j in (("target", "left"), ("c", "right"), ("goal", "right"), ("mesh", "right"), ("sglang_router", "right"),
                   ("result", "left")):
        t.add_column(col, justify=j)
    for r in res["targets"]:
        unit = f" {r['unit']}" if r["unit"] else ""
        fmt = "{:.3f}" if not r["unit"] else "{:.2f}" if r["unit"] == "ms" else "{:.0f}"
        goal = f"{r['op']} {r['target']:g}{unit}" if r["target"] is not None else "-"
        style = {"PASS": "green", "MISS": "red"}.get(r["result"], "dim")
        t.add_row(r["name"], str(r["c"]), goal, _f(r["value"], fmt) + (unit if r["value"] is not None else ""),
                  _f(r["sglang_router"], fmt) + (unit if r["sglang_router"] is not None else ""),
                  f"[{style}]{r['result']}[/{style}]")
    con.print(t)
    top = max(cfg["concurrency"])
    for b in res.get("budget") or []:
        if b["match_path_us"] is not None and b["c"] == top:  # (at c=1 one request at a time: latency, not CPU, bounds it)
            con.print(f"CPU budget {b['arm']} c={b['c']}: {b['cores_busy']:.2f} cores busy; path {b['path_us']:.0f} us/req, "
                      f"{b['match_path_us']:.0f} us/req would match the Rust router ({b['path_over_match']:.2f}x)")
    for name, info in res["arms"].items():
        if info["status"] != "ok":
            con.print(f"{name}: {info['status']}: {info.get('reason', '')}")
        elif info.get("engine_paths") and name != "direct":
            con.print(f"{name}: requests the engines saw, by path: {info['engine_paths']}; "
                      f"{info.get('engine_requests_path')} per engine: {info.get('engine_requests')}")
    for cell in res["cells"]:
        for role, prof in (cell.get("profile") or {}).items():
            head = f"profile {cell['arm']} c={cell['c']} {role}"
            if "error" in prof:
                con.print(f"{head}: none ({prof['error']})")
                continue
            top = ", ".join(f"{e['frame']} {e['pct']:.1f}%" for e in prof["self"][:6])
            con.print(f"{head} ({prof['samples']} samples), top self: {top}")
    m = res["machine"]
    con.print(f"load average at start {m.get('loadavg_at_start')}, at end {m.get('loadavg_at_end')}; logs in {cfg['log_dir']}")
