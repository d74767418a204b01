"""OpenAI-compatible HTTP ingress on the broker (aiohttp).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming and not; a usage
chunk at the end when ``stream_options.include_usage``), ``POST /generate`` (SGLang native,
cumulative streaming like SGLang), ``GET /v1/models``, ``GET /health`` (200 when at least one
worker is routable), ``GET /readyz``, ``GET /metrics`` (Prometheus).

An HTTP request becomes an ordinary mesh SUBMIT from a *local client*: it enters the broker loop
through its mailbox and its replies come back through a per-request queue, so HTTP traffic gets
the same routing, retries, deadlines and exactly-one-terminal guarantee as ZeroMQ clients.

Prompts: with ``--tokenizer FILE`` (a Hugging Face ``tokenizer.json``, needs the ``tokenizers``
package) prompts are tokenised here and routed by token ids; otherwise the prompt text is sent
and the broker routes by a byte-level key of the text. SLO headers ``x-sgl-ttft-slo-ms`` and
``x-sgl-tps-slo`` become the request's SLO; an invalid value is a 400. Errors are OpenAI-style
JSON bodies (``{"error": {"message", "type", "code"}}``) with the status of the mesh error code.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
import uuid
from typing import Any

from aiohttp import web

from mesh import protocol as P
from mesh.errors import ErrorCode

__all__ = ["HttpIngress"]

_MAX_BODY_BYTES = 8 * 1024 * 1024
_LOCAL_PREFIX = b"\x00http:"


def _err(status: int, message: str, code: str, etype: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": etype, "code": code}}, status=status)


def _mesh_err(code: str, message: str) -> web.Response:
    try:
        ec = ErrorCode(code)
    except ValueError:
        ec = ErrorCode.INTERNAL
    etype = "invalid_request_error" if ec.http_status < 500 else "server_error"
    return _err(ec.http_status, message, ec.value, etype)


class _BadRequest(Exception):
    pass


class HttpIngress:
    """Serves HTTP on the broker's event loop; talks to the broker only through its mailbox."""

    def __init__(self, broker, *, model: str = "mesh", api_key: str | None = None, tokenizer_path: str | None = None,
                 metrics_registry=None) -> None:
        self.broker = broker
        self.model = model
        self.api_key = api_key
        self.metrics_registry = metrics_registry
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.endpoint = ""
        self.tokenizer = None
        if tokenizer_path:
            try:
                from tokenizers import Tokenizer
            except ImportError as exc:  # pragma: no cover - depends on the optional extra
                from mesh.errors import ConfigError

                raise ConfigError("tokenizer: the 'tokenizers' package is not installed (pip install mesh-router[tokenizers])") from exc
            self.tokenizer = Tokenizer.from_file(tokenizer_path)
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[self._auth])
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/generate", self.generate),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/healthz", self.health),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics),
        ])
        self.app = app

    # ------------------------------------------------------------------ lifecycle
    async def start(self, host: str, port: int) -> str:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        h, p = sock.getsockname()[:2]
        self.endpoint = f"http://{h}:{p}"
        return self.endpoint

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ middleware
    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key and request.path not in ("/health", "/healthz", "/readyz"):
            got = request.headers.get("Authorization", "")
            if got != f"Bearer {self.api_key}":
                self.broker.stats.requests[ErrorCode.UNAUTHORIZED.value] += 1
                return _err(401, "missing or invalid API key", "unauthorized", "authentication_error")
        return await handler(request)

    # ------------------------------------------------------------------ simple endpoints
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "mesh"}]})

    async def health(self, request: web.Request) -> web.Response:
        n = len(self.broker.registry.pool())
        return web.json_response({"status": "ok" if n else "no_workers", "workers": n}, status=200 if n else 503)

    async def readyz(self, request: web.Request) -> web.Response:
        ok = self.broker._state == "serving"
        return web.json_response({"ready": ok, "state": self.broker._state}, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(self.metrics_registry) if self.metrics_registry is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ request plumbing
    def _slo(self, request: web.Request) -> dict[str, Any] | None:
        slo: dict[str, Any] = {}
        raw = request.headers.get("x-sgl-ttft-slo-ms")
        if raw is not None:
            try:
                v = int(raw)
            except ValueError:
                raise _BadRequest(f"x-sgl-ttft-slo-ms must be a positive integer, got {raw!r}") from None
            if v <= 0:
                raise _BadRequest("x-sgl-ttft-slo-ms must be a positive integer")
            slo["ttft_ms"] = v
        raw = request.headers.get("x-sgl-tps-slo")
        if raw is not None:
            try:
                f = float(raw)
            except ValueError:
                raise _BadRequest(f"x-sgl-tps-slo must be a positive number, got {raw!r}") from None
            if not math.isfinite(f) or f <= 0:
                raise _BadRequest("x-sgl-tps-slo must be a finite positive number")
            slo["tps"] = f
        return slo or None

    async def _json(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _BadRequest("request body must be JSON") from None
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        return body

    def _prompt(self, text: str | None, ids: list[int] | None) -> dict[str, Any]:
        if ids is not None:
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise _BadRequest("input_ids must be a non-empty list of integers")
            return {"input_ids": ids}
        if not isinstance(text, str) or not text:
            raise _BadRequest("prompt must be a non-empty string")
        if self.tokenizer is not None:
            return {"input_ids": self.tokenizer.encode(text).ids}
        return {"text": text}

    def _max_tokens(self, body: dict, default: int = 16) -> int:
        v = body.get("max_completion_tokens", body.get("max_tokens", default))
        if v is None:
            return default
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > 1_000_000:
            raise _BadRequest("max_tokens must be a non-negative integer")
        return v

    def _detok(self, data: dict) -> str:
        if "text" in data and isinstance(data["text"], str):
            return data["text"]
        ids = data.get("token_ids") or []
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return "".join(f" <{t}>" for t in ids)

    async def _submit(self, prompt: dict[str, Any], max_new_tokens: int, *, stream: bool, slo, deadline_ms: int | None,
                      params: dict[str, Any]) -> tuple[bytes, asyncio.Queue]:
        ident = _LOCAL_PREFIX + str(next(self._ids)).encode()
        rid = uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        frames = P.encode_submit(rid, input_ids=prompt.get("input_ids"), text=prompt.get("text"),
                                 params={**params, "max_new_tokens": max_new_tokens}, deadline_ms=deadline_ms, stream=stream, slo=slo)
        self.broker.submit_local(ident, frames, q)
        return ident, q

    async def _events(self, ident: bytes, q: asyncio.Queue, timeout_s: float):
        """Yield decoded replies until the terminal one; cancel the request if the caller goes away."""
        done = False
        try:
            while True:
                frames = await asyncio.wait_for(q.get(), timeout_s)
                m = P.decode_client_reply(frames)
                if isinstance(m, (P.ClientFinal, P.ClientError)):
                    done = True
                yield m
                if done:
                    return
        finally:
            if not done:
                self.broker.cancel_local(ident)
            self.broker.forget_local(ident)

    # ------------------------------------------------------------------ OpenAI endpoints
    async def completions(self, request: web.Request):
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request):
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, *, chat: bool):
        try:
            body = await self._json(request)
            slo = self._slo(request)
            if chat:
                msgs = body.get("messages")
                if not isinstance(msgs, list) or not msgs:
                    raise _BadRequest("messages must be a non-empty list")
                parts = []
                for m in msgs:
                    if not isinstance(m, dict) or not isinstance(m.get("content", ""), str):
                        raise _BadRequest("each message needs a string content")
                    parts.append(f"{m.get('role', 'user')}: {m.get('content', '')}\n")
                prompt = self._prompt("".join(parts) + "assistant:", None)
            else:
                p = body.get("prompt")
                if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                    prompt = self._prompt(None, p)
                else:
                    prompt = self._prompt(p, None)
            max_tokens = self._max_tokens(body)
            stream = bool(body.get("stream", False))
            include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
            params = {k: body[k] for k in ("temperature", "top_p", "stop") if k in body}
        except _BadRequest as exc:
            self.broker.stats.requests[ErrorCode.BAD_REQUEST.value] += 1
            return _err(400, str(exc), "bad_request")
        deadline_ms = int(request.headers.get("x-mesh-deadline-ms", self.broker.s.default_deadline_ms))
        ident, q = await self._submit(prompt, max_tokens, stream=stream, slo=slo, deadline_ms=deadline_ms, params=params)
        rid = ("chatcmpl-" if chat else "cmpl-") + ident[len(_LOCAL_PREFIX):].decode()
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        timeout_s = deadline_ms / 1000.0 + 5.0
        if not stream:
            text = ""
            async for m in self._events(ident, q, timeout_s):
                if isinstance(m, P.ClientError):
                    return _mesh_err(m.code, m.message)
                if isinstance(m, P.ClientFinal):
                    text = self._detok(m.data)
                    usage = _usage(m.usage)
                    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": _finish(m.finish_reason)}
                              if chat else {"index": 0, "text": text, "finish_reason": _finish(m.finish_reason), "logprobs": None})
                    return web.json_response({"id": rid, "object": obj, "created": created, "model": self.model,
                                              "choices": [choice], "usage": usage})
            return _err(504, "no reply", "deadline_exceeded", "server_error")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        first = True
        try:
            async for m in self._events(ident, q, timeout_s):
                if isinstance(m, P.ClientChunk):
                    text = self._detok(m.data)
                    delta = ({"role": "assistant", "content": text} if first else {"content": text}) if chat else None
                    first = False
                    choice = {"index": 0, "delta": delta, "finish_reason": None} if chat else {"index": 0, "text": text, "finish_reason": None}
                    await _sse(resp, {"id": rid, "object": chunk_obj, "created": created, "model": self.model, "choices": [choice]})
                elif isinstance(m, P.ClientFinal):
                    choice = ({"index": 0, "delta": {}, "finish_reason": _finish(m.finish_reason)} if chat
                              else {"index": 0, "text": "", "finish_reason": _finish(m.finish_reason)})
                    await _sse(resp, {"id": rid, "object": chunk_obj, "created": created, "model": self.model, "choices": [choice]})
                    if include_usage:
                        await _sse(resp, {"id": rid, "object": chunk_obj, "created": created, "model": self.model, "choices": [],
                                          "usage": _usage(m.usage)})
                elif isinstance(m, P.ClientError):
                    await _sse(resp, {"error": {"message": m.message, "type": "server_error", "code": m.code}})
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        return resp

    # ------------------------------------------------------------------ SGLang /generate
    async def generate(self, request: web.Request):
        try:
            body = await self._json(request)
            slo = self._slo(request)
            prompt = self._prompt(body.get("text"), body.get("input_ids"))
            sp = body.get("sampling_params") or {}
            if not isinstance(sp, dict):
                raise _BadRequest("sampling_params must be an object")
            max_tokens = self._max_tokens({"max_tokens": sp.get("max_new_tokens", 128)})
            stream = bool(body.get("stream", False))
        except _BadRequest as exc:
            self.broker.stats.requests[ErrorCode.BAD_REQUEST.value] += 1
            return _err(400, str(exc), "bad_request")
        deadline_ms = int(request.headers.get("x-mesh-deadline-ms", self.broker.s.default_deadline_ms))
        ident, q = await self._submit(prompt, max_tokens, stream=stream, slo=slo, deadline_ms=deadline_ms, params={})
        rid = body.get("rid") or ident[len(_LOCAL_PREFIX):].decode()
        timeout_s = deadline_ms / 1000.0 + 5.0
        ids: list[int] = []
        text = ""
        if not stream:
            async for m in self._events(ident, q, timeout_s):
                if isinstance(m, P.ClientError):
                    return _mesh_err(m.code, m.message)
                if isinstance(m, P.ClientFinal):
                    return web.json_response({"text": self._detok(m.data), "output_ids": m.data.get("token_ids", []),
                                              "meta_info": {"id": rid, **_sgl_meta(m)}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        async for m in self._events(ident, q, timeout_s):
            if isinstance(m, P.ClientChunk):  # SGLang streams cumulative text and ids
                ids.extend(m.data.get("token_ids") or [])
                text += self._detok(m.data)
                await _sse(resp, {"text": text, "output_ids": ids, "meta_info": {"id": rid, "finish_reason": None}})
            elif isinstance(m, P.ClientFinal):
                await _sse(resp, {"text": text, "output_ids": ids, "meta_info": {"id": rid, **_sgl_meta(m)}})
            elif isinstance(m, P.ClientError):
                await _sse(resp, {"error": {"message": m.message, "type": "invalid_request_error", "code": m.code, "retryable": False}})
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _usage(u: dict) -> dict:
    pt, ct = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct,
            "prompt_tokens_details": {"cached_tokens": int(u.get("cached_tokens", 0))}}


def _sgl_meta(m: P.ClientFinal) -> dict:
    u = m.usage
    return {"finish_reason": {"type": m.finish_reason}, "prompt_tokens": u.get("prompt_tokens"),
            "completion_tokens": u.get("completion_tokens"), "cached_tokens": u.get("cached_tokens"), "worker": m.worker}


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
