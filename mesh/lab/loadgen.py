"""Open-loop load generator with shared-prefix prompts, and the run summary.

Arrivals are Poisson at ``rate_rps`` for ``duration_s`` (open loop: a slow mesh does not slow
the offered load, see anchors.md §5.3). Each prompt is one of ``groups`` shared system prompts
followed by a unique question, so cache-aware routing has something to find.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from mesh.client import Client
from mesh.errors import RequestError
from mesh.stats import percentile

__all__ = ["LoadSpec", "Outcome", "Summary", "run_load", "open_loop", "planned_prompts", "summarize", "shared_prefix_prompts"]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    rate_rps: float = 20.0
    duration_s: float = 15.0
    groups: int = 8
    system_tokens: int = 1024
    question_tokens: int = 128
    max_new_tokens: int = 32
    deadline_ms: int = 30_000
    seed: int = 0
    vocab: int = 32_000


@dataclass(slots=True)
class Outcome:
    rid: str
    ok: bool
    code: str = ""
    worker: str = ""
    attempt: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    seq: int = -1  # the request's place in the arrival order (-1: not recorded)


def shared_prefix_prompts(spec: LoadSpec, n: int) -> list[list[int]]:
    """``n`` prompts: a seeded system prompt per group plus a unique question each."""
    rng = random.Random(spec.seed)
    systems = [[rng.randrange(1, spec.vocab) for _ in range(spec.system_tokens)] for _ in range(spec.groups)]
    return [systems[rng.randrange(spec.groups)] + [rng.randrange(1, spec.vocab) for _ in range(spec.question_tokens)] for _ in range(n)]


async def _one(client: Client, prompt: list[int], spec: LoadSpec, out: list[Outcome]) -> None:
    try:
        res = await client.generate(input_ids=prompt, max_new_tokens=spec.max_new_tokens, deadline_ms=spec.deadline_ms)
        u = res.usage
        out.append(Outcome(res.rid, True, worker=res.worker, attempt=res.attempt, ttft_s=res.ttft_s, e2e_s=res.e2e_s,
                           prompt_tokens=int(u.get("prompt_tokens", 0)), cached_tokens=int(u.get("cached_tokens", 0)),
                           completion_tokens=int(u.get("completion_tokens", 0))))
    except RequestError as exc:
        out.append(Outcome(exc.request_id or "?", False, code=exc.code.value))


def planned_prompts(spec: LoadSpec) -> list[list[int]]:
    """The prompt stream of one run: more than the Poisson arrivals of ``spec`` will ask for."""
    return shared_prefix_prompts(spec, int(spec.rate_rps * spec.duration_s * 1.5) + 10)


@dataclass
class Pace:
    """How well the open loop kept its schedule: a load generator that falls behind (a busy
    machine) offers less than asked, and its clients' latencies include their own delay."""

    offered_rps: float = 0.0
    started: int = 0
    span_s: float = 0.0  # from the first arrival slot to the last actual start (at least the duration)
    late_s: list[float] = field(default_factory=list)  # per start: how late it was against its slot

    @property
    def achieved_rps(self) -> float:
        return self.started / self.span_s if self.span_s > 0 else 0.0

    def late_ms(self, q: float) -> float:
        xs = sorted(self.late_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else 0.0

    def lagging(self) -> bool:
        """Fell behind: under 90 % of the offered rate, or a tenth of the starts 100 ms late."""
        return self.achieved_rps < 0.9 * self.offered_rps or self.late_ms(0.9) > 100.0


async def open_loop(spec: LoadSpec, prompts: list, one: Callable[[Any], Awaitable[None]],
                    progress: Callable[[float], None] | None = None, pace: Pace | None = None) -> float:
    """Start ``one(prompts[i])`` at seeded Poisson arrivals at ``spec.rate_rps`` for
    ``spec.duration_s`` (open loop: a slow mesh never delays the next arrival), wait for every
    started request, and return the wall time (from the first arrival slot to the last reply).
    ``progress(elapsed_s)`` is called after each arrival; ``pace`` records the schedule kept."""
    rng = random.Random(spec.seed + 1)
    tasks: list[asyncio.Task] = []
    t0 = time.monotonic()
    t_next = t0
    i = 0
    if pace is not None:
        pace.offered_rps = spec.rate_rps
    while True:
        t_next += rng.expovariate(spec.rate_rps)
        if t_next - t0 > spec.duration_s or i >= len(prompts):
            break
        delay = t_next - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if pace is not None:
            now = time.monotonic()
            pace.late_s.append(max(0.0, now - t_next))
            pace.started += 1
            pace.span_s = max(spec.duration_s, now - t0)
        tasks.append(asyncio.create_task(one(prompts[i])))
        i += 1
        if progress is not None:
            progress(min(time.monotonic() - t0, spec.duration_s))
    if tasks:
        await asyncio.gather(*tasks)
    return time.monotonic() - t0


async def run_load(endpoints: list[str], spec: LoadSpec, progress=None) -> tuple[list[Outcome], float]:
    """Drive the load; returns outcomes and the wall time of the run (until the last reply)."""
    prompts = planned_prompts(spec)
    out: list[Outcome] = []
    tick = None if progress is None else (lambda t: progress(t, len(out)))
    async with Client(endpoints, default_deadline_ms=spec.deadline_ms) as client:
        wall = await open_loop(spec, prompts, lambda p: _one(client, p, spec, out), tick)
    return out, wall


@dataclass
class Summary:
    requests: int
    ok: int
    errors: Counter
    wall_s: float
    throughput_rps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    hit_rate: float
    retried: int
    per_worker: dict[str, dict] = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["errors"] = dict(self.errors)
        return d


def summarize(outcomes: list[Outcome], wall_s: float) -> Summary:
    ok = [o for o in outcomes if o.ok]
    ttfts = sorted(o.ttft_s * 1000 for o in ok if o.ttft_s is not None)
    e2es = sorted(o.e2e_s * 1000 for o in ok)
    nan = float("nan")  # the summary's "no samples" value (mesh.stats.percentile gives 0.0)
    per: dict[str, dict] = defaultdict(lambda: {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
    for o in ok:
        w = per[o.worker]
        w["requests"] += 1
        w["prompt_tokens"] += o.prompt_tokens
        w["cached_tokens"] += o.cached_tokens
    for w in per.values():
        w["hit_rate"] = w["cached_tokens"] / w["prompt_tokens"] if w["prompt_tokens"] else 0.0
    pt = sum(o.prompt_tokens for o in ok)
    return Summary(
        requests=len(outcomes), ok=len(ok), errors=Counter(o.code for o in outcomes if not o.ok), wall_s=wall_s,
        throughput_rps=len(ok) / wall_s if wall_s > 0 else 0.0,
        ttft_p50_ms=percentile(ttfts, 50, presorted=True) if ttfts else nan,
        ttft_p99_ms=percentile(ttfts, 99, presorted=True) if ttfts else nan,
        e2e_p50_ms=percentile(e2es, 50, presorted=True) if e2es else nan,
        hit_rate=sum(o.cached_tokens for o in ok) / pt if pt else 0.0,
        retried=sum(1 for o in ok if o.attempt > 1), per_worker=dict(sorted(per.items())),
    )
