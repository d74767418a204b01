"""Fuzz the broker's HTTP ingress: mutated JSON bodies and headers, then a spoofing check.

* POSTs bodies from :func:`mesh.lab.fuzz.generators.http_case` to ``/v1/completions``,
  ``/v1/chat/completions`` and ``/generate`` (a few at a time) and records every 5xx, timeout and
  connection error with the body that caused it;
* *local-identity spoofing*: the ingress hands requests to the broker as local clients whose
  identities are ``b"\\x00http:" + a counter``; ZeroMQ lets any peer choose such a ROUTING_ID,
  so ZMQ DEALERs with those identities send a recognisable bad SUBMIT while valid HTTP requests
  are in flight, and every HTTP answer that carries the spoofer's error is counted;
* afterwards: the broker is alive, ``/health`` answers and a valid completion returns 200.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

import aiohttp
import zmq
import zmq.asyncio

from mesh import protocol as P
from mesh.lab.fuzz.generators import http_case
from mesh.lab.fuzz.runner import pid_alive, rss_kb

__all__ = ["run_http_fuzz", "spoof_check"]

_SPOOF_MARK = "spoofed-by-zmq-peer"


async def _post(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> tuple[int, str]:
    h = {"Content-Type": "application/json", **headers}
    try:
        async with session.post(url, data=body, headers=h, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return r.status, (await r.text())[:500]
    except asyncio.TimeoutError:
        return -1, "timeout"
    except aiohttp.ClientError as exc:
        return -2, f"{type(exc).__name__}: {exc}"[:300]


async def run_http_fuzz(base_url: str, frontend: str | None = None, *, seconds: float = 5.0, seed: int = 0, concurrency: int = 4,
                        broker_pid: int | None = None, api_key: str | None = None, spoof: bool = True) -> dict[str, Any]:
    rng = random.Random(seed)
    statuses: Counter = Counter()
    by_mutation: dict[str, Counter] = {}
    bad: list[dict[str, Any]] = []
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rss0 = rss_kb(broker_pid)
    t_end = time.monotonic() + seconds
    sent = 0
    async with aiohttp.ClientSession() as session:
        async def one_worker(wrng: random.Random) -> None:
            nonlocal sent
            while time.monotonic() < t_end:
                path, mut, body, headers, desc = http_case(wrng)
                code, text = await _post(session, base_url + path, body, {**auth, **headers}, 15.0)
                sent += 1
                statuses[code] += 1
                by_mutation.setdefault(mut, Counter())[code] += 1
                if code >= 500 or code < 0:
                    if len(bad) < 40:
                        bad.append({"path": path, "mutation": mut, "status": code, "headers": headers,
                                    "body": body[:300].decode("utf-8", "replace"), "response": text[:300]})
        await asyncio.gather(*(one_worker(random.Random(rng.getrandbits(62))) for _ in range(concurrency)))
        alive = pid_alive(broker_pid)
        health = await _get(session, base_url + "/health")
        code, text = await _post(session, base_url + "/v1/completions",
                                 b'{"model":"mesh","prompt":"after fuzzing","max_tokens":3}', auth, 20.0)
        spoof_res = await spoof_check(base_url, frontend, api_key=api_key) if spoof and frontend else None
    findings: list[str] = []
    distinct: dict[tuple, dict] = {}
    for b in bad:
        distinct.setdefault((b["path"], b["mutation"], b["status"]), b)
    for (path, mut, status), b in distinct.items():
        if status == 504 and "deadline_exceeded" in b["response"]:
            continue  # a tiny x-mesh-deadline-ms header legitimately ends in 504
        findings.append(f"HTTP {status} on POST {path} ({mut}): headers={b['headers']} body={b['body'][:160]!r} -> {b['response'][:160]!r}")
    if alive is False:
        findings.append("broker process died during HTTP fuzzing")
    if code != 200:
        findings.append(f"valid completion after HTTP fuzzing returned {code}: {text[:200]}")
    if spoof_res and spoof_res["hijacked"]:
        findings.append(f"HTTP responses hijacked by a ZMQ peer using ROUTING_ID b'\\x00http:N': {spoof_res['hijacked']} of "
                        f"{spoof_res['http_requests']} valid HTTP requests answered with the spoofer's error, e.g. {spoof_res['example']}")
    return {"sent": sent, "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "by_mutation": {k: {str(c): n for c, n in v.items()} for k, v in sorted(by_mutation.items())},
            "errors_5xx": bad, "alive": alive, "health_after": health, "completion_after": code,
            "spoof": spoof_res, "rss_kb": {"before": rss0, "after": rss_kb(broker_pid)}, "findings": findings}


async def _get(session: aiohttp.ClientSession, url: str) -> int:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status
    except (asyncio.TimeoutError, aiohttp.ClientError):
        return -1


async def spoof_check(base_url: str, frontend: str, *, n_ids: int = 400, http_requests: int = 40, api_key: str | None = None,
                      timeout_s: float = 20.0) -> dict[str, Any]:
    """Valid HTTP completions while ZMQ peers with ROUTING_IDs ``b"\\x00http:1".."\\x00http:N"``
    keep sending a bad SUBMIT whose error names ``spoofed-by-zmq-peer``; count HTTP answers that
    carry that error (a ZMQ peer's replies delivered to an HTTP caller)."""
    ctx = zmq.asyncio.Context()
    socks = []
    for i in range(1, n_ids + 1):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, b"\x00http:" + str(i).encode())
        s.connect(frontend)
        socks.append(s)
    bad_submit = [P.CLIENT_HEADER, bytes([P.Cmd.C_SUBMIT]), P.pack({"rid": _SPOOF_MARK, "input_ids": []})]
    stop = asyncio.Event()

    async def spoofer() -> None:
        while not stop.is_set():
            for s in socks:
                try:
                    s.send_multipart(bad_submit, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
            await asyncio.sleep(0.002)  # the spoofing rate

    task = asyncio.ensure_future(spoofer())
    hijacked = 0
    example = None
    codes: Counter = Counter()
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession() as session:
            body = b'{"model":"mesh","prompt":"a valid prompt","max_tokens":16}'
            results = await asyncio.gather(*(_post(session, base_url + "/v1/completions", body, auth, timeout_s)
                                             for _ in range(http_requests)))
        for code, text in results:
            codes[code] += 1
            if _SPOOF_MARK in text or "input_ids must be a non-empty list" in text:
                hijacked += 1
                example = example or {"status": code, "response": text[:300]}
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)
    return {"http_requests": http_requests, "hijacked": hijacked, "codes": {str(k): v for k, v in codes.items()}, "example": example}
