"""``mesh bench replay``'s HTTP clients: every request sent at its trace time, open loop.

Request ``i`` goes to broker ``i % K`` (as ``mesh sim``'s round-robin router pick) as a streamed
``POST /v1/completions`` whose ``prompt`` is the request's token ids (the same ids ``mesh sim``
feeds its engine models, so the stubs' prefix caches see the trace's reuse), ``max_tokens`` its
output length and ``stream_options.include_usage`` on. Per request: the send lag (actual send -
scheduled), TTFT (first chunk with text, from the send), E2E, ``usage.prompt_tokens_details.
cached_tokens`` and the broker's ``x-mesh-worker`` header. Bodies are encoded before the run starts
(:func:`encode_body`), so the schedule loop only sleeps and starts tasks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from mesh.lab.bench.replay_core import RequestResult

__all__ = ["Planned", "encode_body", "run_clients"]

DEADLINE_HEADER = "x-mesh-deadline-ms"


@dataclass(slots=True)
class Planned:
    idx: int
    at_s: float  # send time from the start of the run
    body: bytes


def encode_body(model: str, tokens: Sequence[int], max_tokens: int) -> bytes:
    return orjson.dumps({"model": model, "prompt": list(tokens), "max_tokens": max_tokens, "stream": True,
                         "stream_options": {"include_usage": True}})


async def _one(s: aiohttp.ClientSession, url: str, p: Planned, sched: float, deadline_ms: int) -> RequestResult:
    sent = time.monotonic()
    res = RequestResult(p.idx, False, lag_ms=max(0.0, sent - sched) * 1e3)
    try:
        async with s.post(url + "/v1/completions", data=p.body,
                          headers={"Content-Type": "application/json", DEADLINE_HEADER: str(deadline_ms)}) as resp:
            res.worker = resp.headers.get("x-mesh-worker", "")
            if resp.status != 200:
                res.error = f"http_{resp.status}"
                await resp.read()
                return res
            usage = None
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                obj = orjson.loads(data)
                if "error" in obj:
                    err = obj["error"]
                    res.error = str(err.get("code") or "stream_error") if isinstance(err, dict) else "stream_error"
                    return res
                ch = obj.get("choices") or ()
                if res.ttft_ms is None and ch and ch[0].get("text"):
                    res.ttft_ms = (time.monotonic() - sent) * 1e3
                if obj.get("usage"):
                    usage = obj["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        res.error = "timeout" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
        return res
    res.e2e_ms = (time.monotonic() - sent) * 1e3
    if usage is None:
        res.error = "no_usage"
        return res
    details = usage.get("prompt_tokens_details") or {}
    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    res.cached_tokens = int(details.get("cached_tokens") or 0)
    res.completion_tokens = int(usage.get("completion_tokens") or 0)
    if res.ttft_ms is None:  # no text at all (max_tokens 0): the first token is the end
        res.ttft_ms = res.e2e_ms
    res.ok = True
    return res


async def run_clients(urls: Sequence[str], plan: Sequence[Planned], *, deadline_ms: int = 600_000,
                      progress: Callable[[int, int], None] | None = None) -> list[RequestResult]:
    """Send ``plan`` (sorted by ``at_s``) open loop, request ``k`` to ``urls[k % len(urls)]``; wait
    for every answer. ``progress(sent, done)`` after each send and each answer."""
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=deadline_ms / 1000 + 30)
    out: list[RequestResult] = []
    sent = 0

    async def one(s, url, p, sched):
        out.append(await _one(s, url, p, sched, deadline_ms))
        if progress is not None:
            progress(sent, len(out))

    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        t0 = time.monotonic() + 0.1
        tasks = []
        for k, p in enumerate(plan):
            sched = t0 + p.at_s
            delay = sched - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(s, urls[k % len(urls)], p, sched)))
            sent += 1
            if progress is not None:
                progress(sent, len(out))
        await asyncio.gather(*tasks)
    out.sort(key=lambda r: r.idx)
    return out
