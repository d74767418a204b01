"""The fuzzer's shell: ZeroMQ peers on both broker ports, paced and unpaced, then broker checks.

Peers (one asyncio loop, one socket per peer, each with its own seeded generator):

* **registered workers** (backend): send a valid READY, wait for the broker's first HEARTBEAT,
  keep heartbeating, answer the REQUESTs they get (correctly, with errors, silently or with
  garbage, see :func:`mesh.lab.fuzz.generators.answer_request`), re-register after a DISCONNECT, and
  between all that send fuzz cases from their own session, so worker frames reach the session
  handlers and not only the unregistered-peer path;
* **junk workers** (backend): never registered on purpose, some with ROUTING_IDs that begin with
  ``b"\\x00"``; their cases hit the unregistered path (and may register by accident);
* **clients** (frontend): valid SUBMITs with exactly-once accounting of terminal frames, cancels,
  status queries and mutated frames; some with ``b"\\x00"``-leading ROUTING_IDs.

Phases: *paced* (a fixed rate per peer) then *unpaced* (as fast as the sockets take it, bounded
by a frame count per peer and the time left). Afterwards: broker process alive, STATUS answers,
real requests through :class:`mesh.client.Client` end with FINAL, counters and RSS.

Every wait is bounded. Pacing sleeps are the rate limiter itself, never readiness guesses.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.errors import ProtocolError
from mesh.lab.fuzz.generators import Case, ClientGen, WorkerGen, answer_request

__all__ = ["FuzzConfig", "run_fuzz", "rss_kb", "broker_status", "real_requests"]

_SEND_TIMEOUT_S = 1.0
_HISTORY = 40  # cases kept per peer for the crash report
_SHED_RETRY_S = 10.0  # a real request refused as overloaded/rate_limited is retried for this long


@dataclass
class FuzzConfig:
    frontend: str
    backend: str
    seconds: float = 10.0
    seed: int = 0
    peers: int = 4  # per port
    paced_rate: float = 200.0  # frames per second per peer in the paced phase
    paced_share: float = 0.5  # share of ``seconds`` spent paced (the rest unpaced)
    unpaced_max_frames: int = 50_000  # per peer, unpaced phase
    zero_ids: bool = True  # some peers use ROUTING_IDs beginning with b"\x00"
    deadline_ms: int = 3000  # deadline of tracked (valid) fuzz SUBMITs
    broker_pid: int | None = None
    broker_log: str | None = None
    real_requests: int = 5
    real_deadline_ms: int = 10_000
    settle_s: float = 10.0  # bound on waiting for fuzz sessions to leave / tracked requests to end
    client_fuzz: bool = True  # client peers send cases (else they stay quiet)
    worker_fuzz: bool = True  # worker peers send cases (registered ones still heartbeat and answer)


def rss_kb(pid: int | None) -> int | None:
    """VmRSS of ``pid`` in kB (None when unknown or gone)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def pid_alive(pid: int | None) -> bool | None:
    if pid is None:
        return None
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


async def broker_status(ctx: zmq.asyncio.Context, frontend: str, timeout_s: float = 5.0) -> P.StatusReply | None:
    """One STATUS query on a fresh DEALER; None if no reply in time."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(frontend)
    try:
        await asyncio.wait_for(s.send_multipart(P.encode_status_query()), timeout_s)
        t_end = time.monotonic() + timeout_s
        while True:
            frames = await asyncio.wait_for(s.recv_multipart(), max(0.01, t_end - time.monotonic()))
            m = P.decode_client_reply(frames)
            if isinstance(m, P.StatusReply):
                return m
    except asyncio.TimeoutError:
        return None
    finally:
        s.close(linger=0)


async def real_requests(frontend: str, n: int, deadline_ms: int) -> list[dict[str, Any]]:
    """``n`` real requests through mesh.client.Client; each entry says how it ended."""
    from mesh.client import Client

    from mesh.errors import ErrorCode, RetryableError

    out = []
    async with Client(frontend) as c:
        for i in range(n):
            t0 = time.monotonic()
            shed = 0
            while True:
                try:
                    st = await c.submit(input_ids=[11, 12, 13, 14] * 8 + [i], max_new_tokens=4, deadline_ms=deadline_ms,
                                        stream=i % 2 == 0)
                    res = await asyncio.wait_for(st.result(), deadline_ms / 1000.0 + 3.0)
                    out.append({"ok": True, "finish_reason": res.finish_reason, "worker": res.worker, "tokens": len(res.token_ids),
                                "attempt": res.attempt, "s": round(time.monotonic() - t0, 3), "shed": shed})
                except RetryableError as exc:
                    # A broker still working off the fuzzing backlog (frames queued in its sockets)
                    # sheds new requests while its loop lags: a real client backs off and retries.
                    if exc.code in (ErrorCode.OVERLOADED, ErrorCode.RATE_LIMITED) and time.monotonic() - t0 < _SHED_RETRY_S:
                        shed += 1
                        await asyncio.sleep(min(0.5, 0.05 * 2 ** min(shed, 4)))
                        continue
                    out.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300], "s": round(time.monotonic() - t0, 3),
                                "shed": shed})
                except Exception as exc:  # noqa: BLE001 - reported, not raised
                    out.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300], "s": round(time.monotonic() - t0, 3),
                                "shed": shed})
                break
    return out


# --------------------------------------------------------------------------- peers


class _Peer:
    def __init__(self, run: "_Run", name: str, path: str, identity: bytes | None, seed: int) -> None:
        self.run = run
        self.name = name
        self.path = path
        self.identity = identity
        self.rng = random.Random(seed)
        self.sock: zmq.asyncio.Socket = run.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 100)
        self.sock.setsockopt(zmq.SNDHWM, 10_000)
        self.sock.setsockopt(zmq.RCVHWM, 10_000)
        if identity is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.connect(run.cfg.backend if path == "worker" else run.cfg.frontend)
        self.sent = 0
        self.received = 0
        self.send_timeouts = 0
        self.history: deque = deque(maxlen=_HISTORY)
        self.tasks: list[asyncio.Task] = []

    async def send(self, frames: list[bytes], case: Case | None = None) -> bool:
        if not frames:
            frames = [b""]
        if case is not None:
            self.history.append((round(time.monotonic() - self.run.t0, 4), case))
            self.run.mutations[f"{case.path}.{case.group}.{case.mutation or case.base}"] += 1
        try:
            await asyncio.wait_for(self.sock.send_multipart(frames, copy=False), _SEND_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.send_timeouts += 1
            return False
        except zmq.ZMQError as exc:
            self.run.errors[f"send_{exc.errno}"] += 1
            return False
        self.sent += 1
        self.run.frames_sent += 1
        return True

    async def _recv_batch(self) -> list[list[bytes]]:
        """One awaited message plus whatever else is queued (receivers keep up with the broker)."""
        out = [await self.sock.recv_multipart()]
        while len(out) < 1000:
            try:
                out.append(self.sock.recv_multipart(flags=zmq.NOBLOCK).result())
            except zmq.Again:
                break
        return out

    def next_case(self) -> Case:
        raise NotImplementedError

    async def fuzz_loop(self, t_end: float, rate: float | None, max_frames: int) -> None:
        """Send cases until ``t_end``: ``rate`` per second (paced) or as fast as possible."""
        if not (self.run.cfg.client_fuzz if self.path == "client" else self.run.cfg.worker_fuzz):
            return
        n = 0
        t_next = time.monotonic()
        while n < max_frames and time.monotonic() < t_end and not self.run.stop.is_set():
            case = self.next_case()
            await self.send(case.frames, case)
            n += 1
            if rate:
                t_next += 1.0 / rate
                delay = t_next - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)  # the pacing itself
            elif n % 32 == 0:
                await asyncio.sleep(0)  # let the receivers run

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.sock.close(linger=100)


class _ClientPeer(_Peer):
    def __init__(self, run, idx: int, identity: bytes | None, seed: int) -> None:
        super().__init__(run, f"client-{idx}", "client", identity, seed)
        self.gen = ClientGen(self.rng, rid_prefix=f"c{idx}")
        self.tracked: dict[str, float] = {}  # rid -> send time (valid SUBMITs)
        self.terminals: Counter = Counter()
        self.terminal_kind: dict[str, str] = {}
        self.replies: Counter = Counter()
        self.undecodable: list[str] = []
        self.resubmitted: set[str] = set()  # rids we sent again on purpose: excluded from accounting
        self.tasks.append(asyncio.ensure_future(self._recv()))

    def next_case(self) -> Case:
        case = self.gen.case()
        if case.mutation == "duplicate_rid":
            self.resubmitted.add(P.unpack(case.frames[2])["rid"])
        if case.group == "valid" and case.base == "SUBMIT" and case.rid:
            self.tracked[case.rid] = time.monotonic()
            self.gen.inflight.append(case.rid)
            if len(self.gen.inflight) > 64:
                self.gen.inflight.pop(0)
        return case

    async def _recv(self) -> None:
        try:
            while True:
                for frames in await self._recv_batch():
                    self._on_reply(frames)
        except zmq.ZMQError:  # socket closed at the end of the run
            return

    def _on_reply(self, frames: list[bytes]) -> None:
        self.received += 1
        m = P.decode_client_reply(frames)
        if isinstance(m, ProtocolError):
            self.replies["undecodable"] += 1
            if len(self.undecodable) < 5:
                self.undecodable.append(f"{m.reason}: {m.detail[:120]} frames={[f[:48].hex() for f in frames]}")
            return
        self.replies[type(m).__name__] += 1
        rid = getattr(m, "rid", None)
        if isinstance(m, P.ClientError) and m.code == "duplicate" and rid in self.tracked:
            # the answer to our own second SUBMIT with an in-flight rid (semantic duplicate_rid),
            # not a terminal of the first one: counted apart
            self.replies["duplicate_rid_error"] += 1
            return
        if isinstance(m, (P.ClientFinal, P.ClientError)) and rid in self.tracked:
            self.terminals[rid] += 1
            self.terminal_kind.setdefault(rid, "FINAL" if isinstance(m, P.ClientFinal) else f"ERROR:{m.code}")
            if rid in self.gen.inflight:
                self.gen.inflight.remove(rid)

    def pending(self) -> int:
        return sum(1 for rid in self.tracked if rid not in self.terminals)


class _WorkerPeer(_Peer):
    """A fuzzing worker: registered (heartbeats, answers REQUESTs) or junk (never registers)."""

    def __init__(self, run, idx: int, identity: bytes | None, seed: int, *, registered: bool) -> None:
        wid = f"fuzz-w{idx}" if registered else f"fuzz-junk{idx}"
        rng = random.Random(seed)
        super().__init__(run, wid, "worker", identity or f"{wid}/1/1".encode(), seed)
        self.registered_peer = registered
        self.gen = WorkerGen(self.rng, wid, dp_size=rng.choice([1, 2, 4]), epoch=rng.randint(1, 1000))
        self.reply_rng = random.Random(seed ^ 0x5EED)
        self.session = asyncio.Event()
        self.last_ready = 0.0
        self.requests = 0
        self.answers: Counter = Counter()
        self.from_broker: Counter = Counter()
        self.undecodable: list[str] = []
        self.tasks.append(asyncio.ensure_future(self._recv()))
        self._pending_rejoin = 0
        self._queued: list[Case] = []

    async def register(self, timeout_s: float = 5.0) -> bool:
        self.last_ready = time.monotonic()
        await self.send(self.gen.ready())
        try:
            await asyncio.wait_for(self.session.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def next_case(self) -> Case:
        if self._queued:
            return self._queued.pop(0)
        if self._pending_rejoin:
            self._pending_rejoin -= 1
            if self._pending_rejoin == 0:  # leave the draining session and register again
                self.session.clear()
                self.last_ready = time.monotonic()
                self._queued.append(Case("worker", "READY", "rejoin_after_drain", self.gen.ready(), group="semantic"))
                return Case("worker", "DISCONNECT", "rejoin_after_drain", P.encode_disconnect("bye"), group="semantic")
        case = self.gen.case(allow_ready=self.registered_peer)
        if case.mutation == "disconnect_draining":
            self._pending_rejoin = self.rng.randint(1, 50)
        return case

    async def heartbeat_loop(self) -> None:
        while not self.run.stop.is_set():
            await self.send(self.gen.heartbeat())
            await asyncio.sleep(0.15)  # our heartbeat interval

    async def _recv(self) -> None:
        try:
            while True:
                for frames in await self._recv_batch():
                    await self._on_broker(frames)
        except zmq.ZMQError:  # socket closed at the end of the run
            return

    async def _on_broker(self, frames: list[bytes]) -> None:
        self.received += 1
        m = P.decode_broker_to_worker(frames)
        if isinstance(m, ProtocolError):
            self.from_broker["undecodable"] += 1
            if len(self.undecodable) < 5:
                self.undecodable.append(f"{m.reason}: {m.detail[:120]}")
            return
        t = type(m).__name__
        self.from_broker[t] += 1
        if isinstance(m, P.Heartbeat):
            self.session.set()
        elif isinstance(m, P.Disconnect):
            self.session.clear()
            if self.registered_peer and not self.run.stop.is_set() and time.monotonic() - self.last_ready > 0.05:
                self.last_ready = time.monotonic()
                await self.send(self.gen.ready())
        elif isinstance(m, P.Request):
            self.requests += 1
            self.gen.requests.append((m.rid, m.attempt))
            if len(self.gen.requests) > 64:
                self.gen.requests.pop(0)
            self.gen.max_rid_seen = max(self.gen.max_rid_seen, m.rid)
            kind, replies = answer_request(self.reply_rng, m)
            self.answers[kind] += 1
            self.run.answers[m.submit.rid] = f"{self.name}:{kind}"
            for fr in replies:
                await self.send(fr)
        elif isinstance(m, P.Resync):
            rank = m.dp_rank
            if rank < self.gen.dp_size:
                seq = self.gen.kv_seq[rank]
                self.gen.kv_seq[rank] += 1
                await self.send(P.encode_kv_events(rank, self.gen.epoch, seq, 0.0, [{"type": "AllBlocksCleared"}]))


# --------------------------------------------------------------------------- run


class _Run:
    def __init__(self, cfg: FuzzConfig) -> None:
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.stop = asyncio.Event()
        self.t0 = time.monotonic()
        self.frames_sent = 0
        self.mutations: Counter = Counter()
        self.errors: Counter = Counter()
        self.answers: dict[str, str] = {}


def _identities(rng: random.Random, n: int, zero_ids: bool, kind: str) -> list[bytes | None]:
    out: list[bytes | None] = []
    for i in range(n):
        if i == 0 or not zero_ids or i % 2 == 1:
            out.append(None if kind == "client" else None)
            continue
        out.append(rng.choice([b"\x00" + rng.randbytes(4), b"\x00fuzz" + bytes([i]), b"\x00http:" + str(rng.randint(1, 50)).encode(),
                               b"\x00" + rng.randbytes(20), bytes([0, 0, 0, 0, i])]))
    return out


async def run_fuzz(cfg: FuzzConfig, progress: Callable[[float, dict], None] | None = None) -> dict[str, Any]:
    """Fuzz the broker at ``cfg.frontend``/``cfg.backend`` and check it afterwards; returns the summary."""
    run = _Run(cfg)
    rng = random.Random(cfg.seed)
    summary: dict[str, Any] = {"seed": cfg.seed, "config": asdict(cfg), "findings": []}
    pid = cfg.broker_pid
    rss0 = rss_kb(pid)
    st0 = await broker_status(run.ctx, cfg.frontend)
    summary["status_before"] = None if st0 is None else {"workers": [w.get("worker_id") for w in st0.workers]}
    counters0 = dict(st0.counters) if st0 else {}

    n_w = max(1, cfg.peers)
    w_ids = _identities(rng, n_w, cfg.zero_ids, "worker")
    c_ids = _identities(rng, max(1, cfg.peers), cfg.zero_ids, "client")
    workers = [_WorkerPeer(run, i, w_ids[i] if i % 2 else None, rng.getrandbits(62), registered=(i % 2 == 0)) for i in range(n_w)]
    clients = [_ClientPeer(run, i, c_ids[i], rng.getrandbits(62)) for i in range(len(c_ids))]
    peers: list[_Peer] = [*workers, *clients]
    reg = [w for w in workers if w.registered_peer]
    ok = await asyncio.gather(*(w.register() for w in reg))
    summary["registered_workers"] = {w.name: bool(o) for w, o in zip(reg, ok)}
    hb_tasks = [asyncio.ensure_future(w.heartbeat_loop()) for w in reg]

    crash: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []

    async def monitor() -> None:
        mctx_t = time.monotonic()
        while not run.stop.is_set():
            alive = pid_alive(pid)
            if alive is False:
                crash.update({"t_s": round(time.monotonic() - run.t0, 3), "what": "broker process exited"})
                run.stop.set()
                return
            st = await broker_status(run.ctx, cfg.frontend, timeout_s=3.0)
            samples.append({"t_s": round(time.monotonic() - run.t0, 2), "rss_kb": rss_kb(pid), "status": st is not None,
                            "handler_exception": (st.counters.get("dropped.handler_exception", 0) if st else None)})
            if st is None and pid_alive(pid) is not False:
                run.errors["status_timeout_during_fuzz"] += 1
            if progress is not None:
                progress(time.monotonic() - run.t0, {"frames": run.frames_sent, "rss_kb": samples[-1]["rss_kb"]})
            await asyncio.sleep(max(0.0, 0.5 - (time.monotonic() - mctx_t) % 0.5))

    mon = asyncio.ensure_future(monitor())
    t_start = time.monotonic()
    run.t0 = t_start
    paced_s = cfg.seconds * cfg.paced_share
    t_paced_end = t_start + paced_s
    t_end = t_start + cfg.seconds
    await asyncio.gather(*(p.fuzz_loop(t_paced_end, cfg.paced_rate, 10**9) for p in peers))
    sent_paced = run.frames_sent
    if not run.stop.is_set():
        await asyncio.gather(*(p.fuzz_loop(t_end, None, cfg.unpaced_max_frames) for p in peers))
    fuzz_s = time.monotonic() - t_start
    summary["frames"] = {"paced": sent_paced, "unpaced": run.frames_sent - sent_paced, "total": run.frames_sent,
                         "seconds": round(fuzz_s, 2), "rate_per_s": round(run.frames_sent / max(fuzz_s, 1e-9))}

    # tracked requests: wait (bounded) for their terminal frames while the workers still answer
    t_wait = time.monotonic() + cfg.deadline_ms / 1000.0 + 2.0
    while time.monotonic() < t_wait and any(c.pending() for c in clients) and not crash:
        await asyncio.sleep(0.05)
    run.stop.set()
    for t in hb_tasks:
        t.cancel()
    await asyncio.gather(*hb_tasks, return_exceptions=True)
    for w in workers:  # a polite goodbye: the session leaves now rather than by expiry (a junk peer's READY
        await w.send(P.encode_disconnect("fuzz_done"))  # registers too: its fuzz-model worker must not stay behind)
    await mon if mon.done() else None
    mon.cancel()

    # ---- accounting
    acc: dict[str, Any] = {}
    for c in clients:
        ident = "auto" if c.identity is None else c.identity.hex()
        missing = [rid for rid in c.tracked if rid not in c.terminals and rid not in c.resubmitted]
        dup = [rid for rid, n in c.terminals.items() if n > 1 and rid not in c.resubmitted]
        acc[c.name] = {"identity": ident, "tracked": len(c.tracked), "missing_terminal": len(missing),
                       "duplicate_terminal": len(dup), "replies": dict(c.replies), "undecodable_examples": c.undecodable,
                       "missing_examples": [{"rid": r, "worker_answer": run.answers.get(r, "(not dispatched to a fuzz worker)")}
                                            for r in missing[:5]],
                       "duplicate_examples": [{"rid": r, "first": c.terminal_kind.get(r), "n": c.terminals[r],
                                               "worker_answer": run.answers.get(r)} for r in dup[:5]]}
    summary["clients"] = acc
    summary["workers"] = {w.name: {"registered_peer": w.registered_peer, "identity": w.identity.hex(), "requests": w.requests,
                                   "answers": dict(w.answers), "from_broker": dict(w.from_broker), "sent": w.sent,
                                   "send_timeouts": w.send_timeouts, "undecodable_examples": w.undecodable} for w in workers}
    summary["mutations"] = dict(sorted(run.mutations.items()))
    summary["errors"] = dict(run.errors)
    for p in peers:
        p.close()

    # ---- broker checks
    alive = pid_alive(pid)
    summary["alive"] = alive
    if crash:
        summary["crash"] = crash
        summary["crash"]["last_cases"] = {p.name: [{"t_s": t, **c.describe()} for t, c in list(p.history)[-8:]] for p in peers}
        summary["findings"].append(f"broker died during fuzzing at t={crash['t_s']}s")
    st1 = await broker_status(run.ctx, cfg.frontend) if alive is not False else None
    summary["status_after"] = st1 is not None
    if alive is not False and st1 is None:
        summary["findings"].append("broker alive but did not answer STATUS within 5 s after fuzzing")
    # fuzz sessions must leave (registered ones said goodbye); anything left is reported
    leftover: list[str] = []
    if st1 is not None:
        t_settle = time.monotonic() + cfg.settle_s
        while True:
            leftover = [w.get("worker_id") for w in st1.workers if str(w.get("worker_id", "")).startswith("fuzz-")]
            if not leftover or time.monotonic() > t_settle:
                break
            await asyncio.sleep(0.1)
            st1 = await broker_status(run.ctx, cfg.frontend) or st1
    summary["fuzz_sessions_left"] = leftover
    if leftover:
        summary["findings"].append(f"fuzz worker sessions still registered {cfg.settle_s}s after their peers closed: {leftover}")
    real: list[dict[str, Any]] = []
    if alive is not False and st1 is not None:
        real = await real_requests(cfg.frontend, cfg.real_requests, cfg.real_deadline_ms)
    summary["real_requests"] = real
    summary["real_ok"] = bool(real) and all(r["ok"] and r.get("finish_reason") for r in real)
    if not summary["real_ok"]:
        summary["findings"].append(f"real requests after fuzzing did not all end with FINAL: {real}")
    st2 = await broker_status(run.ctx, cfg.frontend) if alive is not False else None
    counters1 = dict(st2.counters) if st2 else (dict(st1.counters) if st1 else {})
    delta = {k: v - counters0.get(k, 0) for k, v in counters1.items() if v != counters0.get(k, 0)}
    summary["counters_delta"] = dict(sorted(delta.items()))
    summary["frames_rejected_total"] = sum(v for k, v in delta.items() if k.startswith("frames_rejected."))
    if delta.get("dropped.handler_exception"):
        summary["findings"].append(f"dropped.handler_exception grew by {delta['dropped.handler_exception']} (a handler raised)")
    rss1 = rss_kb(pid)
    peak = max([s["rss_kb"] for s in samples if s.get("rss_kb")] + [rss1 or 0, rss0 or 0])
    summary["rss_kb"] = {"before": rss0, "after": rss1, "peak": peak,
                         "growth_mb": None if rss0 is None or rss1 is None else round((rss1 - rss0) / 1024, 1)}
    summary["samples"] = samples[-20:]
    for name, c in acc.items():
        ident = bytes.fromhex(c["identity"]) if c["identity"] not in ("auto", None) else b""
        if ident[:1] == b"\x00" and len(ident) > 5:
            c["expected_silent"] = True  # the in-process clients' namespace: refused unanswered by design
            continue
        if c["missing_terminal"]:
            summary["findings"].append(f"{name} (identity {c['identity']}): {c['missing_terminal']}/{c['tracked']} valid SUBMITs "
                                       f"never got a decodable FINAL/ERROR, e.g. {c['missing_examples'][:2]}")
        if c["duplicate_terminal"]:
            summary["findings"].append(f"{name}: {c['duplicate_terminal']} requests got more than one terminal frame, "
                                       f"e.g. {c['duplicate_examples'][:2]}")
        if c["replies"].get("undecodable"):
            summary["findings"].append(f"{name}: {c['replies']['undecodable']} broker->client frames failed decode_client_reply, "
                                       f"e.g. {c['undecodable_examples'][:1]}")
    for name, w in summary["workers"].items():
        if w["from_broker"].get("undecodable"):
            summary["findings"].append(f"{name}: {w['from_broker']['undecodable']} broker->worker frames failed decode, "
                                       f"e.g. {w['undecodable_examples'][:1]}")
    if cfg.broker_log:
        summary["broker_log_errors"] = _log_errors(cfg.broker_log)
    run.ctx.destroy(linger=0)
    return summary


def _log_errors(path: str, limit: int = 10) -> list[dict[str, Any]]:
    """Distinct handler failures the broker logged: error, the innermost mesh/broker frame, count."""
    import json

    seen: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        if '"handler_failed"' not in line and '"mail_handler_failed"' not in line and "Traceback" not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = {"error": line[:300], "exception": line}
        tb = str(rec.get("exception", ""))
        ours = [ln.strip() for ln in tb.splitlines() if ln.strip().startswith("File") and ("/brokers/" in ln or "/mesh/" in ln)]
        where = ours[-1] if ours else ""
        key = (str(rec.get("error")), where)
        if key not in seen:
            seen[key] = {"error": key[0], "where": where, "count": 0, "traceback_tail": tb[-1200:]}
        seen[key]["count"] += 1
    return list(seen.values())[:limit]
