"""Pass-through requests: a SUBMIT's ``passthrough`` body sent to the engine's own OpenAI endpoint.

What mesh does not render itself (tool calls, reasoning options, ``n > 1``, ``/v1/responses``,
``/v1/embeddings``, ``/v1/rerank``, ``/v1/score``) the engine's OpenAI-compatible server serves: the
adapter POSTs the client's body, unchanged, to the path the SUBMIT names (the same for SGLang and
vLLM, both serve these paths) and relays the engine's answer byte for byte as pass-through data maps
(:func:`mesh.protocol.passthrough_reply`): the first piece carries the engine's status and
content type, an SSE answer goes out piece by piece as it arrives, anything else in pieces of at most
``MAX_PASSTHROUGH_PIECE_BYTES``, the rest in the FINAL. Whatever the engine answers -- a 400, a 503 --
is the client's answer (a FINAL, never retried elsewhere); only failing to reach the engine is an
ERROR (the broker may retry it on another worker).

The body is changed in one case only: its ``model`` names none of this engine's models (a broker
alias, or the fleet's name): it becomes the engine's model. The FINAL's usage is read from the
engine's answer (OpenAI ``usage``, Responses ``response.usage``) so the broker's metrics count
the tokens and the cached tokens.
"""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractAsyncContextManager
from typing import Any, AsyncIterator, Protocol

import orjson

from mesh import protocol as P
from mesh.adapters.backend import EngineInfo
from mesh.adapters.deadlines import Deadlines
from mesh.errors import ErrorCode

__all__ = ["PASSTHROUGH_NOT_DISAGGREGATED", "PassthroughProxy", "PassthroughTransport", "usage_of", "engine_body"]

_SSE = "text/event-stream"
#: a prefill/decode pair cannot serve a pass-through request: the engines' OpenAI servers take no
#: KV handoff (the prefill leg refuses it, bad_request)
PASSTHROUGH_NOT_DISAGGREGATED = ("pass-through requests (tools, reasoning options, n > 1, Responses, embeddings, rerank, "
                                 "score) are not served by prefill/decode pairs: route them to mixed workers")


class PassthroughTransport(Protocol):
    """The engine path pass-through needs (:meth:`mesh.adapters.engine_http.EngineHttp.stream_with_type`)."""

    def stream_with_type(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
                         ) -> AbstractAsyncContextManager[tuple[int, str, AsyncIterator[bytes]]]: ...


class ReplyLink(Protocol):
    def send(self, frames: list[bytes]) -> bool: ...


def usage_of(obj: Any) -> dict[str, int] | None:
    """The mesh usage map (prompt, completion and cached tokens) of an OpenAI answer or stream event
    (``usage``: chat, completions, embeddings; ``response.usage``: the Responses API), or None."""
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    if not isinstance(u, dict) and isinstance(obj.get("response"), dict):
        u = obj["response"].get("usage")
    if not isinstance(u, dict):
        return None

    def n(*keys: str) -> int:
        for k in keys:
            v = u.get(k)
            if type(v) is int and v >= 0:
                return v
        return 0

    details = u.get("prompt_tokens_details") or u.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {"prompt_tokens": n("prompt_tokens", "input_tokens"), "completion_tokens": n("completion_tokens", "output_tokens"),
            "cached_tokens": cached if type(cached) is int and cached >= 0 else 0}


def engine_body(raw: bytes, model: str | None, info: EngineInfo) -> bytes:
    """The body sent to the engine: the client's, unchanged, unless its ``model`` names none of the
    engine's models (then it names the engine's). A body that is not a JSON object goes as it is
    (the engine refuses it)."""
    if model is None or model == info.model or model in (info.loras or ()) or model.startswith(info.model + ":"):
        return raw
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw
    if not isinstance(obj, dict):
        return raw
    obj["model"] = info.model
    return orjson.dumps(obj)


class _UsageScan:
    """Finds the last usage in an SSE stream without parsing every event: only complete lines that
    mention a usage object are decoded."""

    __slots__ = ("pending", "usage")

    def __init__(self) -> None:
        self.pending = b""
        self.usage: dict[str, int] | None = None

    def feed(self, piece: bytes) -> None:
        data = self.pending + piece if self.pending else piece
        end = data.rfind(b"\n")
        if end < 0:
            self.pending = data[-(1 << 20):]
            return
        self.pending = data[end + 1:][-(1 << 20):]
        if b'"usage":{' not in data and b'"usage": {' not in data:
            return
        for line in data[:end].split(b"\n"):
            if line.startswith(b"data:") and (b'"usage":{' in line or b'"usage": {' in line):
                try:
                    u = usage_of(orjson.loads(line[5:]))
                except orjson.JSONDecodeError:
                    continue
                if u is not None:
                    self.usage = u


class PassthroughProxy:
    """Serves the pass-through REQUESTs of one engine (see the module docstring)."""

    def __init__(self, engine: PassthroughTransport, info: EngineInfo, *, url: str, counters: Counter, log,
                 deadlines: Deadlines | None = None) -> None:
        self.deadlines = deadlines or Deadlines()
        self.engine = engine
        self.info = info
        self.url = url
        self.counters = counters
        self.log = log

    async def serve(self, link: ReplyLink, r: P.Request, headers: dict[str, str] | None) -> tuple[ErrorCode | None, str]:
        """Relay the engine's answer; (None, "") once the FINAL is sent, else the error to send.
        Transport errors propagate (the proxy maps them with ``engine_error``)."""
        pt = r.submit.passthrough
        assert pt is not None
        path = pt["path"]
        body = engine_body(pt["body"], r.submit.model, self.info)
        timeout_s = r.deadline_ms / 1000 if r.deadline_ms > 0 else None
        self.counters["passthrough_requests"] += 1
        seq = 0
        try:
            async with self.deadlines.bound(timeout_s):
                async with self.engine.stream_with_type("POST", path, body, headers) as (status, ctype, chunks):
                    head: dict[str, Any] | None = {"status": status, "content_type": ctype or "application/octet-stream"}
                    sse = status == 200 and _SSE in ctype
                    scan = _UsageScan() if sse else None
                    buf = bytearray()
                    async for piece in chunks:
                        if scan is not None:
                            scan.feed(piece)
                        buf += piece
                        while buf and (sse or len(buf) >= P.MAX_PASSTHROUGH_PIECE_BYTES):
                            out = bytes(buf[:P.MAX_PASSTHROUGH_PIECE_BYTES])
                            del buf[:P.MAX_PASSTHROUGH_PIECE_BYTES]
                            link.send(P.encode_worker_chunk(r.rid, r.attempt, seq, {"token_ids": [], "raw": out, **(head or {})}))
                            head = None
                            seq += 1
        except TimeoutError:
            if seq:
                self.counters["passthrough_cut_by_deadline"] += 1
            return ErrorCode.DEADLINE_EXCEEDED, "deadline passed while the engine was answering"
        raw = bytes(buf)
        if scan is not None:
            usage = scan.usage
        else:
            try:
                usage = usage_of(orjson.loads(raw)) if seq == 0 and raw[:1] == b"{" else None
            except orjson.JSONDecodeError:
                usage = None
        if status != 200:
            self.counters["passthrough_engine_refused"] += 1
            self.log.info("passthrough_engine_refused", rid=r.rid, path=path, status=status)
        usage = usage or {"prompt_tokens": r.submit.prompt_len, "completion_tokens": 0, "cached_tokens": 0}
        link.send(P.encode_worker_final(r.rid, r.attempt, "stop" if status == 200 else f"{P.REFUSED_PREFIX}{status}", usage,
                                        {"token_ids": [], "raw": raw, **(head or {})}))
        self.counters["requests_ok"] += 1
        return None, ""
