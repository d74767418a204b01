"""Request streams for the simulator: the Mooncake trace format and seeded generators.

Every workload is a list of :class:`SimRequest` sorted by arrival time, built once and replayed
unchanged by every arm. A request carries a *recipe* for its prompt, not the tokens: the tokens
are rebuilt on demand (:meth:`Workload.prompt`), so a 60-million-token trace costs a few MB.

Prompt recipes are tuples of segments ``(kind, key, full, n)``:

* ``kind`` 0 -- ``n`` pseudo-random tokens: the first ``n`` of the ``full`` tokens drawn from
  ``random.Random(key).randbytes(full)``. Token ids are therefore in ``[0, 256)``: CPython shares
  those int objects, which keeps the engines' cached pages cheap, and a 16-token page still has
  2**128 possible contents (collisions are not a concern). Equal keys give equal content.
* ``kind`` 1 -- the ``n`` first output tokens the engine model emits for request ``key``
  (:func:`mesh.engine_model.output_token_id`), so multi-turn histories contain the previous
  answer exactly as the simulated engine generated (and cached) it.

Byte-only prompts are returned as ``array('B')`` (a Sequence[int] that :func:`content_keys`
widens correctly -- never pass raw ``bytes``, which ``array('I', ...)`` would reinterpret);
prompts with output segments as ``array('I')``.

Workloads (all seeded and deterministic; generated ones use open-loop Poisson arrivals at
``rate`` requests/s until ``duration_s`` or ``max_requests``):

* ``mooncake`` -- the Mooncake trace format: one JSON object per line with ``timestamp`` (ms),
  ``input_length``, ``output_length`` and ``hash_ids`` (one id per 512-token block; equal ids
  mean equal content with equal prefix). Hash id ``h`` becomes a 512-token block seeded by ``h``;
  the last block is truncated to ``input_length``. Arrival = ``timestamp / 1000 * time_scale``.
* ``shared_prefix`` -- llm-d / inference-perf shared prefixes: ``groups`` (150) system prompts of
  ``system_tokens`` (6,000), each with ``prompts_per_group`` (5) questions of
  ``question_tokens`` (1,200); every request picks a (group, question) pair uniformly at random
  (with replacement) and asks for ``output_tokens`` (1,000).
* ``multi_turn`` -- production-stack multi-round QA: ``users`` (50) x ``rounds`` (8); one shared
  system prompt (1,000), a per-user context (2,000), then per round a question
  (``question_tokens``, 100) and the answer (``output_tokens``, 100). Arrival ``i`` is user
  ``i % users``, round ``i // users``: each prompt is the user's whole history (every earlier
  question and answer) plus the new question.
* ``zipf`` -- SGLang's generated-shared-prefix with Zipf group popularity: ``groups`` (64) system
  prompts of ``system_tokens`` (2,048); group ``g`` (0-based) has weight ``1/(g+1)**alpha``
  (``zipf_alpha``, 0.9); each request adds a unique question (``question_tokens``, 128) and asks
  for ``output_tokens`` (256).
* ``low_reuse`` -- control: every request picks one of ``groups`` (100,000) distinct prompts of
  ``question_tokens`` (1,024) uniformly at random; reuse is only chance repeats.
* ``conversation`` -- long-context multi-turn chat (see :func:`_conversation`): sessions start as
  a Poisson process, each has a log-normal number of turns (mean ``turns_mean``, 2; a long tail of
  long sessions) separated by
  exponential think times (mean ``think_s``, 10 s); a turn's prompt is the session's whole
  conversation so far (every earlier user message and answer) plus a new user message, so the
  reuse comes from each session's own history. The first message is log-normal with median
  ``first_tokens`` (3,000; documents, system prompt), later ones with median ``message_tokens``
  (1,500; pasted text and tool output make the tail heavy); answers are log-normal with mean
  ``output_tokens`` (350). A session ends before a prompt would exceed ``max_context_tokens``
  (131,072: a 128k-context model). ``rate`` is the *request* rate; the stream starts in steady
  state (sessions already under way at t=0, their earlier turns not in the stream). Defaults give
  a prompt mean of about 12k tokens (median ~6.5k), ~0.6 % of prompts past 100k, answers ~350
  tokens and an oracle hit rate of about 60 % (3,000 requests).

Every generated workload also takes (:data:`COMMON_PARAMS`; the defaults leave the streams above
byte-identical):

* ``arrival_cv`` (1.0 = Poisson) -- bursty arrivals: an on/off Markov-modulated Poisson process
  (bursts at ``burst_peak``, 8, times the mean rate, silence between them) with exactly this
  inter-arrival coefficient of variation (:func:`burst_warp`: a time change of the stream, so the
  mean rate, the order and every prompt stay as they were). Markov-modulated rather than Hawkes:
  its CV has a closed form, so the parameter is the measured CV, and a rate change only rescales
  time (the matrix's load calibration replays the same bursts closer together).
* ``shared_first_tokens`` (0 = off) -- every prompt starts with the same N tokens (a fleet-wide
  system prompt; multi-turn histories carry it once).
* ``rearrival_share`` (0.0; conversation only) -- the share of follow-up turns that come back
  after a short think time (exponential, mean 0.25 s: tool calls, retries) instead of
  ``think_s``: with bursty arrivals a session's next turn lands inside the same burst.
"""

from __future__ import annotations

import bisect
import json
import math
import random
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mesh.engine_model import output_token_id
from mesh.errors import ConfigError
from mesh.hashing import ROOT_KEY, content_keys

__all__ = [
    "SimRequest",
    "Workload",
    "WORKLOADS",
    "COMMON_PARAMS",
    "burst_warp",
    "MOONCAKE_BLOCK",
    "load_mooncake",
    "make_workload",
    "oracle_cached_tokens",
]

MOONCAKE_BLOCK = 512
_MASK64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15
Segment = tuple[int, int, int, int]  # (kind, key, full, n)

# Namespaces of the segment keys (so two generators never produce the same content by accident).
_NS_MOONCAKE = 1
_NS_SYSTEM = 2
_NS_QUESTION = 3
_NS_CONTEXT = 4
_NS_UNIQUE = 5
_NS_CONV_MSG = 6
_NS_CONV_OUT = 7


def seed_key(ns: int, *parts: int) -> int:
    """A deterministic 64-bit seed from small ints (no Python ``hash``: it is salted per process)."""
    k = ns
    for p in parts:
        k = ((k ^ (p & _MASK64)) * _MIX + 0x632BE59BD9B4E019) & _MASK64
        k ^= k >> 29
    return k


@dataclass(slots=True)
class SimRequest:
    """One request of the stream. ``idx`` is its position (and the engine rid)."""

    idx: int
    arrival_s: float
    prompt_len: int
    output_len: int
    segments: tuple[Segment, ...]
    session: int | None = None  # the conversation it is a turn of (session affinity, mesh.routing.sessions)
    # a replayed recording's continuation (mesh.lab.sim.recorded): the output it must emit first, as
    # slices (key, full, start, end) of kind-0 segment contents -- the tokens a later prompt holds
    output_script: tuple[tuple[int, int, int, int], ...] = ()
    max_tokens: int | None = None  # a recording's max_new_tokens asked for (routers see it; the engine emits output_len)


@dataclass(slots=True)
class Workload:
    """A replayable request stream plus what it was built from."""

    name: str
    requests: list[SimRequest]
    params: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = 32_000
    dropped: int = 0  # requests removed because they cannot fit an engine (see drop_oversized)
    fleet: list[tuple[str, str]] | None = None  # a recording's workers (id, role), in the broker's pool order
    recorded: list[dict[str, Any]] | None = None  # a recording's decisions, by request idx (compare-decisions)

    def prompt(self, req: SimRequest) -> array:
        """The request's prompt tokens (rebuilt on every call; see the module docstring)."""
        segs = req.segments
        if all(s[0] == 0 for s in segs):
            parts = []
            for _, key, full, n in segs:
                b = random.Random(key).randbytes(full)
                parts.append(b if n == full else b[:n])
            return array("B", b"".join(parts))
        out = array("I")
        vocab = self.vocab_size
        for kind, key, full, n in segs:
            if kind == 0:
                b = random.Random(key).randbytes(full)
                out.extend(b if n == full else b[:n])  # iterating bytes yields ints
            else:
                out.extend(output_token_id(key, p, vocab) for p in range(n))
        return out

    def output_tokens(self, req: SimRequest) -> list[int]:
        """The output the engine model will emit for ``req`` (when not clipped): its script
        (a recording's continuation), then :func:`output_token_id` of its idx."""
        v = self.vocab_size
        out: list[int] = []
        for key, full, start, end in req.output_script:
            out.extend(random.Random(key).randbytes(full)[start:end])
        del out[req.output_len:]
        out.extend(output_token_id(req.idx, p, v) for p in range(len(out), req.output_len))
        return out

    def drop_oversized(self, max_prompt: int) -> None:
        """Remove requests whose prompt exceeds ``max_prompt`` tokens, renumbering the rest."""
        keep = [r for r in self.requests if r.prompt_len <= max_prompt]
        if len(keep) == len(self.requests):
            return
        if any(s[0] == 1 for r in keep for s in r.segments):
            raise ConfigError("cannot drop requests from a workload whose prompts embed earlier outputs")
        self.dropped += len(self.requests) - len(keep)
        if self.recorded is not None:  # a recording's decisions stay with their requests
            self.recorded = [self.recorded[r.idx] for r in keep]
        for i, r in enumerate(keep):
            r.idx = i
        self.requests = keep

    def stats(self) -> dict[str, Any]:
        reqs = self.requests
        n = len(reqs)
        return {
            "requests": n,
            "dropped": self.dropped,
            "prompt_tokens": sum(r.prompt_len for r in reqs),
            "output_tokens": sum(r.output_len for r in reqs),
            "mean_prompt_tokens": round(sum(r.prompt_len for r in reqs) / n, 3) if n else 0.0,
            "mean_output_tokens": round(sum(r.output_len for r in reqs) / n, 3) if n else 0.0,
            "span_s": round(reqs[-1].arrival_s - reqs[0].arrival_s, 6) if n else 0.0,
        }


# --------------------------------------------------------------------------- mooncake


def load_mooncake(path: str | Path, *, time_scale: float = 1.0, max_requests: int | None = None) -> Workload:
    """Load a Mooncake-format JSONL trace (see the module docstring)."""
    if not time_scale > 0:
        raise ConfigError(f"time_scale must be > 0, got {time_scale!r}")
    reqs: list[SimRequest] = []
    p = Path(path)
    try:
        fh = p.open()
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            if max_requests is not None and len(reqs) >= max_requests:
                break
            try:
                o = json.loads(line)
                ts = float(o["timestamp"])
                n = int(o["input_length"])
                out = int(o["output_length"])
                ids = [int(h) for h in o["hash_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{path}:{lineno}: bad trace record: {exc}") from None
            if n <= 0 or out < 0 or not ids:
                raise ConfigError(f"{path}:{lineno}: input_length must be > 0 and hash_ids non-empty")
            blocks = -(-n // MOONCAKE_BLOCK)
            if blocks > len(ids):
                raise ConfigError(f"{path}:{lineno}: {len(ids)} hash_ids cannot cover {n} tokens")
            segs = []
            for j in range(blocks):
                take = min(MOONCAKE_BLOCK, n - j * MOONCAKE_BLOCK)
                segs.append((0, seed_key(_NS_MOONCAKE, ids[j]), MOONCAKE_BLOCK, take))
            reqs.append(SimRequest(0, ts / 1000.0 * time_scale, n, out, tuple(segs)))
    reqs.sort(key=lambda r: r.arrival_s)  # stable: file order breaks ties
    if reqs:
        t0 = reqs[0].arrival_s
        for i, r in enumerate(reqs):
            r.idx = i
            r.arrival_s -= t0
    return Workload("mooncake", reqs, {"trace": str(path), "time_scale": time_scale})


# --------------------------------------------------------------------------- generators


def _arrivals(rng: random.Random, rate: float, duration_s: float | None, limit: int | None) -> list[float]:
    """Poisson arrival times from 0 until ``duration_s`` (exclusive) or ``limit`` requests."""
    if not rate > 0:
        raise ConfigError(f"rate must be > 0, got {rate!r}")
    if duration_s is None and limit is None:
        raise ConfigError("generated workloads need duration_s or max_requests")
    out: list[float] = []
    t = 0.0
    while limit is None or len(out) < limit:
        if duration_s is not None and t >= duration_s:
            break
        out.append(t)
        t += rng.expovariate(rate)
    return out


# Bursty arrivals: an on/off Markov-modulated Poisson process (an interrupted Poisson process).
# Built as a time change of the Poisson (or session) stream: operational time runs at
# ``burst_peak`` x the wall clock through exponential on-periods and stops through exponential
# off-periods, so the stream keeps its mean rate and order. Why this process and not a Hawkes
# one: its inter-arrival times are i.i.d. hyperexponential with a closed-form coefficient of
# variation, so ``arrival_cv`` is the stream's CV exactly (a Hawkes process's CV has no closed form
# and a branching ratio near 1 makes it unstable), and a rate change is a pure rescaling of time
# (the matrix's load calibration replays the same bursts closer together).
_NS_FLEET = 8  # the fleet-wide shared first block


def _ipp_switch_rates(rate: float, cv: float, peak: float) -> tuple[float, float]:
    """(on->off, off->on) switching rates of an on/off process with ``rate`` arrivals/s on
    average, ``peak`` x rate while on and inter-arrival CV ``cv``: its squared CV is
    ``1 + 2 lam a / (a + b)**2`` (lam the on rate, a and b the switching rates) and its duty
    ``b / (a + b)`` is ``1 / peak``."""
    lam = peak * rate
    s = 2.0 * lam * (1.0 - 1.0 / peak) / (cv * cv - 1.0)
    return s * (1.0 - 1.0 / peak), s / peak


def burst_warp(times: list[float], *, seed: int, rate: float, cv: float, peak: float) -> list[float]:
    """Map sorted operational ``times`` (a Poisson stream at ``rate``/s, or a session stream
    with that mean rate) to wall-clock times of an on/off bursty process with inter-arrival CV
    ``cv`` (see ``_ipp_switch_rates``). Monotone; deterministic in ``seed``; the on/off periods
    scale with 1/rate."""
    a, b = _ipp_switch_rates(rate, cv, peak)
    rng = random.Random(seed_key(0xB0, seed, 1))
    out: list[float] = []
    u0 = t0 = 0.0  # operational and wall time at the start of the current on-period
    on_wall = rng.expovariate(a)
    for u in times:
        while u >= u0 + peak * on_wall:
            u0 += peak * on_wall
            t0 += on_wall + rng.expovariate(b)
            on_wall = rng.expovariate(a)
        out.append(t0 + (u - u0) / peak)
    return out


def _check_common(p: dict[str, Any]) -> None:
    """Validate the parameters every generator shares (ConfigError naming the field)."""
    cv, peak, share = p["arrival_cv"], p["burst_peak"], p["rearrival_share"]
    if type(cv) not in (int, float) or not math.isfinite(cv) or not 1.0 <= cv <= 20.0:
        raise ConfigError(f"arrival_cv must be a number in [1, 20] (1 = Poisson), got {cv!r}")
    if type(peak) not in (int, float) or not math.isfinite(peak) or not 1.0 < peak <= 1000.0:
        raise ConfigError(f"burst_peak must be a number in (1, 1000], got {peak!r}")
    if type(share) not in (int, float) or not math.isfinite(share) or not 0.0 <= share <= 1.0:
        raise ConfigError(f"rearrival_share must be a number in [0, 1], got {share!r}")
    _pos("shared_first_tokens", p["shared_first_tokens"], zero=True)
    if p["shared_first_tokens"] > 1_000_000:
        raise ConfigError(f"shared_first_tokens must be <= 1000000, got {p['shared_first_tokens']!r}")


def _with_shared_first(reqs: list[SimRequest], seed: int, n: int) -> None:
    """Prefix every prompt with the same ``n`` tokens (a fleet-wide system prompt). Each
    prompt of a multi-turn stream extends an earlier one, so one prefix per prompt keeps that."""
    seg = (0, seed_key(_NS_FLEET, seed), n, n)
    for r in reqs:
        r.segments = (seg,) + r.segments
        r.prompt_len += n


def _pos(name: str, v: Any, *, zero: bool = False) -> int:
    if type(v) is not int or v < 0 or (v == 0 and not zero):
        raise ConfigError(f"{name} must be a {'non-negative' if zero else 'positive'} int, got {v!r}")
    return v


def _shared_prefix(rng, times, seed, p):
    g_n, ppg = _pos("groups", p["groups"]), _pos("prompts_per_group", p["prompts_per_group"])
    s, q, o = _pos("system_tokens", p["system_tokens"]), _pos("question_tokens", p["question_tokens"]), _pos("output_tokens", p["output_tokens"], zero=True)
    out = []
    for i, t in enumerate(times):
        g = rng.randrange(g_n)
        k = rng.randrange(ppg)
        segs = ((0, seed_key(_NS_SYSTEM, seed, g), s, s), (0, seed_key(_NS_QUESTION, seed, g, k), q, q))
        out.append(SimRequest(i, t, s + q, o, segs))
    return out


def _multi_turn(rng, times, seed, p):
    users, rounds = _pos("users", p["users"]), _pos("rounds", p["rounds"])
    s, ctx = _pos("system_tokens", p["system_tokens"], zero=True), _pos("context_tokens", p["context_tokens"], zero=True)
    q, o = _pos("question_tokens", p["question_tokens"]), _pos("output_tokens", p["output_tokens"], zero=True)
    times = times[: users * rounds]
    history: list[tuple[Segment, ...]] = []
    for u in range(users):
        h: tuple[Segment, ...] = ()
        if s:
            h += ((0, seed_key(_NS_SYSTEM, seed, 0), s, s),)
        if ctx:
            h += ((0, seed_key(_NS_CONTEXT, seed, u), ctx, ctx),)
        history.append(h)
    out = []
    for i, t in enumerate(times):
        u, r = i % users, i // users
        segs = history[u] + ((0, seed_key(_NS_QUESTION, seed, u, r), q, q),)
        n = sum(sg[3] for sg in segs)
        out.append(SimRequest(i, t, n, o, segs))
        history[u] = segs + (((1, i, o, o),) if o else ())
    return out


def _zipf(rng, times, seed, p):
    g_n = _pos("groups", p["groups"])
    alpha = p["zipf_alpha"]
    if type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha < 0:
        raise ConfigError(f"zipf_alpha must be a finite number >= 0, got {alpha!r}")
    s, q, o = _pos("system_tokens", p["system_tokens"]), _pos("question_tokens", p["question_tokens"]), _pos("output_tokens", p["output_tokens"], zero=True)
    cum = []
    acc = 0.0
    for g in range(g_n):
        acc += 1.0 / (g + 1) ** alpha
        cum.append(acc)
    out = []
    for i, t in enumerate(times):
        g = min(bisect.bisect_right(cum, rng.random() * acc), g_n - 1)
        segs = ((0, seed_key(_NS_SYSTEM, seed, g), s, s), (0, seed_key(_NS_UNIQUE, seed, i), q, q))
        out.append(SimRequest(i, t, s + q, o, segs))
    return out


def _low_reuse(rng, times, seed, p):
    g_n = _pos("groups", p["groups"])
    q, o = _pos("question_tokens", p["question_tokens"]), _pos("output_tokens", p["output_tokens"], zero=True)
    out = []
    for i, t in enumerate(times):
        k = rng.randrange(g_n)
        out.append(SimRequest(i, t, q, o, ((0, seed_key(_NS_UNIQUE, seed, k), q, q),)))
    return out


# Shape constants of the conversation workload (log-normal sigmas; means/medians are parameters).
_CONV_TURNS_SIGMA = 0.9
_CONV_FIRST_SIGMA = 1.1
_CONV_MSG_SIGMA = 1.5
_CONV_OUT_SIGMA = 0.7
_CONV_MAX_TURNS = 64
_CONV_MAX_OUTPUT = 4096
_CONV_POOL = 512  # sessions drawn up front to measure the mean turns (and so the session rate)
_CONV_REARRIVAL_S = 0.25  # mean think time of a re-arrival (rearrival_share): inside the burst, mostly


def _conv_session(rng: random.Random, p: dict[str, Any]) -> list[tuple[int, int, float]]:
    """One session's turns: (user message tokens, answer tokens, think seconds before the turn)."""
    tm, cap = p["turns_mean"], p["max_context_tokens"]
    n_turns = max(1, min(_CONV_MAX_TURNS, round(rng.lognormvariate(math.log(tm) - _CONV_TURNS_SIGMA ** 2 / 2,
                                                                     _CONV_TURNS_SIGMA))))
    out_mu = math.log(p["output_tokens"]) - _CONV_OUT_SIGMA ** 2 / 2 if p["output_tokens"] else None
    turns = []
    ctx = 0
    for k in range(n_turns):
        if k == 0:
            msg = int(rng.lognormvariate(math.log(p["first_tokens"]), _CONV_FIRST_SIGMA))
        else:
            msg = int(rng.lognormvariate(math.log(p["message_tokens"]), _CONV_MSG_SIGMA))
        msg = max(4, msg)
        out = 0 if out_mu is None else max(1, min(_CONV_MAX_OUTPUT, int(rng.lognormvariate(out_mu, _CONV_OUT_SIGMA))))
        if k == 0:
            think = 0.0
        elif p["rearrival_share"] and rng.random() < p["rearrival_share"]:
            think = rng.expovariate(1.0 / _CONV_REARRIVAL_S)  # a quick follow-up (tool call, retry)
        else:
            think = rng.expovariate(1.0 / p["think_s"])
        if ctx + msg > cap:
            if k == 0:
                msg = cap  # a first message longer than the context window is cut to it
            else:
                break
        turns.append((msg, out, think))
        ctx += msg + out
    return turns


def _conversation(seed: int, rate: float, duration_s: float | None, limit: int | None, p: dict[str, Any]):
    """Turns of sessions interleaved in time (see the module docstring), sorted by arrival.

    Deterministic in ``seed`` and the parameters: session shapes come from one RNG in session
    order, session start gaps from another (unit exponentials scaled by the session rate, so a
    different ``rate`` replays the same sessions, closer together). The session rate is ``rate``
    / the mean turns of the first 512 sessions. Sessions start from ``-warm`` (four times the
    longest of those sessions' spans, at least 60 s) so the window [0, horizon) holds turns of
    sessions already under way; turns before 0 are not in the stream and their answers enter
    later prompts as plain tokens (cold), as in a trace cut from a running service.
    """
    if not rate > 0:
        raise ConfigError(f"rate must be > 0, got {rate!r}")
    if duration_s is None and limit is None:
        raise ConfigError("generated workloads need duration_s or max_requests")
    for name in ("turns_mean", "think_s"):
        v = p[name]
        if type(v) not in (int, float) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{name} must be a finite number > 0, got {v!r}")
    if p["turns_mean"] < 1:
        raise ConfigError(f"turns_mean must be >= 1, got {p['turns_mean']!r}")
    _pos("first_tokens", p["first_tokens"])
    _pos("message_tokens", p["message_tokens"])
    _pos("output_tokens", p["output_tokens"], zero=True)
    _pos("max_context_tokens", p["max_context_tokens"])
    shape_rng = random.Random(seed_key(0xC0, seed, 1))
    pool = [_conv_session(shape_rng, p) for _ in range(_CONV_POOL)]
    mean_turns = sum(len(s) for s in pool) / len(pool)
    span = max(sum(t[2] for t in s) for s in pool)
    warm = max(60.0, 4.0 * span)
    session_rate = rate / mean_turns
    horizon = duration_s if duration_s is not None else limit / rate * 1.25 + 1.0
    while True:
        gap_rng = random.Random(seed_key(0xC0, seed, 2))
        shape_rng = random.Random(seed_key(0xC0, seed, 1))
        turns: list[tuple[float, int, int]] = []  # (arrival, session, turn)
        shapes: list[list[tuple[int, int, float]]] = []
        t = -warm
        while True:
            t += gap_rng.expovariate(session_rate)
            if t >= horizon:
                break
            sess = _conv_session(shape_rng, p)
            sid = len(shapes)
            shapes.append(sess)
            at = t
            for k, (_msg, _out, think) in enumerate(sess):
                at += think
                if at >= horizon:
                    break
                if at >= 0.0:
                    turns.append((at, sid, k))
        turns.sort()
        if limit is None or len(turns) >= limit or duration_s is not None:
            break
        horizon *= 1.5  # not enough turns yet: the same sessions, a longer window
    if limit is not None:
        turns = turns[:limit]
    out: list[SimRequest | None] = [None] * len(turns)
    history: dict[int, tuple[Segment, ...]] = {}
    for i, (at, sid, k) in enumerate(turns):
        sess = shapes[sid]
        h = history.get(sid)
        if h is None:  # first turn of this session in the stream: earlier turns were before the window
            h = ()
            for j in range(k):
                msg, o, _ = sess[j]
                h += ((0, seed_key(_NS_CONV_MSG, seed, sid, j), msg, msg),)
                if o:
                    h += ((0, seed_key(_NS_CONV_OUT, seed, sid, j), o, o),)
        msg, o, _ = sess[k]
        segs = h + ((0, seed_key(_NS_CONV_MSG, seed, sid, k), msg, msg),)
        n = sum(sg[3] for sg in segs)
        out[i] = SimRequest(i, at, n, o, segs, session=sid)
        history[sid] = segs + (((1, i, o, o),) if o else ())
    return out


_conversation.own_arrivals = True  # type: ignore[attr-defined]


#: parameters every generated workload takes (defaults: today's streams, unchanged)
COMMON_PARAMS: dict[str, Any] = {"arrival_cv": 1.0, "burst_peak": 8.0, "shared_first_tokens": 0, "rearrival_share": 0.0}

#: name -> (generator, default parameters; every one also takes COMMON_PARAMS)
WORKLOADS: dict[str, tuple[Any, dict[str, Any]]] = {
    "shared_prefix": (_shared_prefix, {"groups": 150, "prompts_per_group": 5, "system_tokens": 6000,
                                       "question_tokens": 1200, "output_tokens": 1000}),
    "multi_turn": (_multi_turn, {"users": 50, "rounds": 8, "system_tokens": 1000, "context_tokens": 2000,
                                 "question_tokens": 100, "output_tokens": 100}),
    "zipf": (_zipf, {"groups": 64, "zipf_alpha": 0.9, "system_tokens": 2048, "question_tokens": 128,
                     "output_tokens": 256}),
    "low_reuse": (_low_reuse, {"groups": 100_000, "question_tokens": 1024, "output_tokens": 128}),
    "conversation": (_conversation, {"turns_mean": 2.0, "think_s": 10.0, "first_tokens": 3000, "message_tokens": 1500,
                                     "output_tokens": 350, "max_context_tokens": 131_072}),
}


def make_workload(
    name: str,
    *,
    seed: int = 0,
    rate: float = 20.0,
    duration_s: float | None = 60.0,
    max_requests: int | None = None,
    vocab_size: int = 32_000,
    **params: Any,
) -> Workload:
    """Build a generated workload. ``params`` override the defaults in :data:`WORKLOADS` (None
    values are ignored); unknown parameters raise ConfigError."""
    try:
        gen, defaults = WORKLOADS[name]
    except KeyError:
        raise ConfigError(f"unknown workload {name!r}; choose one of {', '.join(sorted(WORKLOADS))}") from None
    p = dict(defaults)
    p.update(COMMON_PARAMS)
    for k, v in params.items():
        if v is None:
            continue
        if k not in p:
            raise ConfigError(f"workload {name} has no parameter {k!r} (has {', '.join(sorted(p))})")
        p[k] = v
    _check_common(p)
    if getattr(gen, "own_arrivals", False):  # sessions: the generator places its own turns in time
        reqs = gen(seed, rate, duration_s, max_requests, p)
    else:
        rng = random.Random(seed_key(0xA11, seed, 1))
        times = _arrivals(rng, rate, duration_s, max_requests)
        reqs = gen(random.Random(seed_key(0xA11, seed, 2)), times, seed, p)
    if p["arrival_cv"] > 1.0:
        warped = burst_warp([r.arrival_s for r in reqs], seed=seed, rate=rate, cv=p["arrival_cv"], peak=p["burst_peak"])
        for r, t in zip(reqs, warped):
            r.arrival_s = t
    if p["shared_first_tokens"]:
        _with_shared_first(reqs, seed, p["shared_first_tokens"])
    params_out = {"seed": seed, "rate": rate, "duration_s": duration_s, **p}
    return Workload(name, reqs, params_out, vocab_size)


# --------------------------------------------------------------------------- oracle


def oracle_cached_tokens(workload: Workload, block_size: int) -> tuple[int, int]:
    """(ceiling cached prompt tokens, prompt tokens) of the stream with an infinite cache.

    Requests in arrival order; each matches the longest prefix of its full ``block_size`` pages
    that any *earlier* request's prompt or output covered, capped like the engine so at least one
    prompt token is computed (``(prompt_len - 1) // block_size`` pages). Afterwards its prompt
    pages and the full pages of prompt + output (the output being what the engine model emits)
    enter the cache. Independent of routing, timing and eviction: a ceiling for ``hit_rate``.
    """
    seen: set[int] = set()
    add = seen.update
    cached = total = 0
    for r in workload.requests:
        toks = workload.prompt(r)
        keys = content_keys(toks, block_size)
        n = r.prompt_len
        limit = min(len(keys), (n - 1) // block_size)
        # Chained keys: the seen set is prefix-closed, so membership is monotone along the chain.
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if keys[mid - 1] in seen:
                lo = mid
            else:
                hi = mid - 1
        cached += lo * block_size
        total += n
        add(keys)
        if r.output_len:
            start = len(keys) * block_size
            tail = list(toks[start:]) + workload.output_tokens(r)
            add(content_keys(tail, block_size, keys[-1] if keys else ROOT_KEY))
    return cached, total
