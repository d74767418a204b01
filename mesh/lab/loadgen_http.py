"""Open-loop load over the OpenAI HTTP API, with the official ``openai`` client (the path users run).

The same prompt stream, arrivals and summary as :mod:`mesh.lab.loadgen` (ZeroMQ clients): one of
``spec.groups`` seeded system prompts plus a unique question each, Poisson arrivals at
``spec.rate_rps`` for ``spec.duration_s``, open loop. Each request is a streamed
``POST /v1/completions`` with ``stream_options.include_usage``, so its last chunk reports
``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``; the deadline is sent
as ``x-mesh-deadline-ms`` and the client never retries (``max_retries=0``: a failure is counted,
not hidden).

Prompts are text: :func:`prompt_text` maps each token id of the ZeroMQ prompt stream to one
printable ASCII character, so a shared token prefix is a shared text prefix and a byte-level
tokenizer (the SGLang stub's, and the broker's routing key for text prompts) sees exactly
``system_tokens + question_tokens`` tokens, as the ZeroMQ path does.

Per request: TTFT (first chunk with text), E2E (until the stream ends), ok or the error kind
(the mesh error code from an OpenAI error body, ``http_<status>``, ``connection``, ``timeout``,
``no_usage`` when the stream ended without the usage chunk), prompt and cached tokens, and the
worker the broker chose (its ``x-mesh-worker`` response header; empty when absent).

``openai`` is imported when the load runs, not when this module is imported.
"""

from __future__ import annotations

import time

from mesh.lab.loadgen import LoadSpec, Outcome, Pace, open_loop, planned_prompts

__all__ = ["prompt_text", "run_http_load"]

_FIRST, _SPAN = 33, 94  # printable ASCII '!'..'~': one UTF-8 byte per character


def prompt_text(ids: list[int]) -> str:
    """The text form of a token id prompt: one printable ASCII character per token (deterministic)."""
    return "".join(chr(_FIRST + t % _SPAN) for t in ids)


def _error_kind(exc: BaseException) -> str:
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and isinstance(err.get("code"), str) and err["code"]:
            return err["code"]
    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}"
    if isinstance(exc, openai.APIError):
        return "stream_error"
    return "connection" if isinstance(exc, OSError) or "httpx" in type(exc).__module__ else type(exc).__name__


async def _one(client, model: str, i: int, prompt: str, spec: LoadSpec, out: list[Outcome]) -> None:
    t0 = time.monotonic()
    ttft = None
    usage = None
    rid, worker = f"http-{i}", ""
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=spec.max_new_tokens, stream=True,
            stream_options={"include_usage": True}, extra_headers={"x-mesh-deadline-ms": str(spec.deadline_ms)})
        worker = stream.response.headers.get("x-mesh-worker", "")
        async for chunk in stream:
            rid = chunk.id or rid
            if ttft is None and chunk.choices and chunk.choices[0].text:
                ttft = time.monotonic() - t0
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as exc:  # every failure is an outcome (openai wraps most; a broken stream may not be)
        out.append(Outcome(rid, False, code=_error_kind(exc), worker=worker, e2e_s=time.monotonic() - t0, seq=i))
        return
    e2e = time.monotonic() - t0
    if usage is None:
        out.append(Outcome(rid, False, code="no_usage", worker=worker, ttft_s=ttft, e2e_s=e2e, seq=i))
        return
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    out.append(Outcome(rid, True, worker=worker, ttft_s=ttft, e2e_s=e2e, prompt_tokens=usage.prompt_tokens,
                       cached_tokens=cached, completion_tokens=usage.completion_tokens, seq=i))


async def run_http_load(url: str, spec: LoadSpec, progress=None, *, model: str | None = None,
                        pace: Pace | None = None) -> tuple[list[Outcome], float]:
    """Drive ``spec`` at the OpenAI API under ``url`` (``url + "/v1"``); returns the outcomes and
    the wall time (until the last reply). ``model`` defaults to the first of ``GET /v1/models``.
    ``progress(elapsed_s, done)`` is called after each arrival, as in :func:`mesh.lab.loadgen.run_load`."""
    import openai

    prompts = list(enumerate(prompt_text(p) for p in planned_prompts(spec)))
    out: list[Outcome] = []
    tick = None if progress is None else (lambda t: progress(t, len(out)))
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                  timeout=spec.deadline_ms / 1000.0 + 5.0) as client:
        if model is None:
            model = (await client.models.list()).data[0].id
        wall = await open_loop(spec, prompts, lambda ip: _one(client, model, ip[0], ip[1], spec, out), tick, pace)
    return out, wall
