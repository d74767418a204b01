"""``mesh stub-sglang``'s OpenAI extras: tool calls, reasoning, ``n`` > 1, Responses, embeddings,
rerank and score -- what mesh passes through to an engine (:mod:`mesh.openai_passthrough`).

Deterministic, so tests can drive them:

* **Tool calls**, in the Hermes / Qwen format SGLang's ``qwen25`` parser reads: when a chat request
  has ``tools`` and ``tool_choice`` is not ``"none"``, the model "calls" the first tool (or the one
  ``tool_choice`` names; an unknown name is a 400) with ``{"query": <the last user message>}``: it
  writes ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, which the server parses
  into OpenAI ``tool_calls`` (``finish_reason`` ``tool_calls``), whole or streamed as
  ``delta.tool_calls`` (the name first, then the arguments).
* **Reasoning**: with ``reasoning_effort``, ``separate_reasoning`` or ``chat_template_kwargs.
  enable_thinking``, the output starts ``<think>...</think>``; unless ``separate_reasoning`` is
  false, that part is ``reasoning_content`` (streamed as ``delta.reasoning_content``).
* ``n`` 1..8 choices (each its own engine request on the same prompt).
* The prompt the engine model caches is the chat rendered with its tools (the chat template with
  ``tools=`` under ``--tokenizer``, else :func:`mesh.openai_passthrough.render_chat_text`, the
  routing key mesh's front door uses without a tokenizer), so ``cached_tokens`` shows an agent's
  next turn hitting the cache.
* ``POST /v1/embeddings`` (vectors from a hash of each input; ``dimensions``; ``encoding_format``
  ``float`` or ``base64``), ``POST /v1/responses`` (the answer text of a chat made of
  ``instructions`` and ``input``; SSE events ``response.created`` ... ``response.completed`` with
  ``stream``), ``POST /v1/rerank`` (SGLang's list of ``{score, document, index}``), ``POST
  /v1/score`` (``{"scores": [[p, ...] per item]}``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
import time
import uuid
from typing import Any, Protocol

from aiohttp import web

__all__ = ["HttpError", "OpenAIExtras", "parse_output", "MAX_CHOICES"]

MAX_CHOICES = 8
_MAX_EMBED_DIM = 4096
_TOOL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_THINK_OPEN, _THINK_CLOSE, _CALL_OPEN = "<think>", "</think>", "<tool_call>"


class HttpError(Exception):
    """A request the stub answers with ``status`` (:mod:`workers_stub.sglang_server` raises it too)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class StubRefused(ValueError):
    """A request the stub refuses as the engine would (HTTP 400)."""


def _hold(s: str, tag: str) -> str:
    """``s`` without a trailing partial ``tag`` (it may still become the tag)."""
    for k in range(len(tag) - 1, 0, -1):
        if s.endswith(tag[:k]):
            return s[:-k]
    return s


def _call_id(name: str, args: str, k: int) -> str:
    return "call_" + hashlib.sha256(f"{name}\0{args}\0{k}".encode()).hexdigest()[:24]


def parse_output(text: str, *, think: bool, final: bool) -> tuple[str, str, list[dict]]:
    """(reasoning, content, tool calls) of a model output so far; with ``final`` false, what may
    still change (a partial tag, an open tool call) is held back, so the parts only ever grow."""
    reasoning, rest = "", text
    if think and rest.startswith(_THINK_OPEN):
        end = rest.find(_THINK_CLOSE)
        if end < 0:
            reasoning, rest = rest[len(_THINK_OPEN):], ""
            if not final:
                reasoning = _hold(reasoning, _THINK_CLOSE)
        else:
            reasoning, rest = rest[len(_THINK_OPEN):end], rest[end + len(_THINK_CLOSE):]
    elif think and not final and _THINK_OPEN.startswith(rest):
        rest = ""
    calls: list[dict] = []
    content: list[str] = []
    pos = 0
    for m in _TOOL_RE.finditer(rest):
        content.append(rest[pos:m.start()])
        pos = m.end()
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            content.append(m.group(0))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            content.append(m.group(0))
            continue
        args = json.dumps(obj.get("arguments", {}), ensure_ascii=False)
        calls.append({"id": _call_id(obj["name"], args, len(calls)), "type": "function",
                      "function": {"name": obj["name"], "arguments": args}})
    tail = rest[pos:]
    if not final:
        i = tail.find(_CALL_OPEN)
        tail = tail[:i] if i >= 0 else _hold(tail, _CALL_OPEN)
    content.append(tail)
    return reasoning, "".join(content), calls


def _last_user(msgs: list[Any]) -> str:
    for m in reversed(msgs):
        if isinstance(m, dict) and m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, str):
                return c
            if isinstance(c, list):
                return " ".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _ascii(s: str, limit: int = 200) -> str:
    return s.encode("ascii", "replace").decode()[:limit]


def _thinks(body: dict) -> bool:
    kw = body.get("chat_template_kwargs")
    return bool(body.get("reasoning_effort") or body.get("separate_reasoning")
                or (isinstance(kw, dict) and kw.get("enable_thinking")))


class StubEngine(Protocol):
    """What these handlers use of :class:`~workers_stub.sglang_server.SglangStub` (its ``s`` settings too)."""

    s: Any

    def chat_prompt(self, body: dict) -> list[int]: ...
    def max_tokens(self, body: dict, default: int) -> int: ...
    def start_job(self, prompt: list[int], max_new: int, body: dict) -> Any: ...
    async def next_tokens(self, job: Any) -> tuple[list[int], tuple[str, dict] | None]: ...
    async def collect(self, job: Any) -> str: ...
    def abandon(self, job: Any) -> None: ...
    def record(self, path: str, body: Any) -> None: ...
    def encode(self, text: str) -> list[int]: ...
    async def sse_start(self, request: web.Request) -> web.StreamResponse: ...
    def forced_ids(self, text: str) -> list[int]: ...
    def text_of(self, tokens: list[int]) -> str: ...


class OpenAIExtras:
    """The extra handlers of one :class:`~workers_stub.sglang_server.SglangStub`."""

    def __init__(self, stub: StubEngine) -> None:
        self.stub = stub

    def install(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/embeddings", self.h_embeddings)
        r.add_post("/v1/responses", self.h_responses)
        r.add_post("/v1/rerank", self.h_rerank)
        r.add_post("/v1/score", self.h_score)

    # ------------------------------------------------------------------ chat

    @staticmethod
    def handles_chat(body: dict) -> bool:
        """Chat requests these handlers serve (the plain ones stay with the stub's own handler)."""
        n = body.get("n")
        return bool(body.get("tools")) or _thinks(body) or (type(n) is int and n > 1)

    def answer_text(self, body: dict) -> str:
        """The deterministic output of a chat request (see the module docstring)."""
        msgs = body.get("messages") or []
        user = _ascii(_last_user(msgs))
        out = f"{_THINK_OPEN}the user asked: {user[:60]}{_THINK_CLOSE}" if _thinks(body) else ""
        tools = body.get("tools") or []
        choice = body.get("tool_choice")
        if tools and choice != "none":
            names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
            name = names[0] if names else None
            if isinstance(choice, dict):
                want = (choice.get("function") or {}).get("name")
                if want not in names:
                    raise StubRefused(f"tool_choice names a function that is not in tools: {want!r}")
                name = want
            if name is None:
                raise StubRefused("tools[0] has no function name")
            call = json.dumps({"name": name, "arguments": {"query": user}})
            return out + f"{_CALL_OPEN}\n{call}\n</tool_call>"
        return out + "lorem ipsum dolor sit amet"

    async def chat(self, request: web.Request, body: dict) -> web.StreamResponse:
        stub = self.stub
        try:
            n = body.get("n", 1)
            if type(n) is not int or not 1 <= n <= MAX_CHOICES:
                raise HttpError(400, f"n must be an integer in [1, {MAX_CHOICES}]")
            prompt = stub.chat_prompt(body)
            try:
                forced = stub.forced_ids(self.answer_text(body))
            except StubRefused as exc:
                raise HttpError(400, str(exc)) from None
            max_new = stub.max_tokens(body, 128)
            jobs = []
            for _ in range(n):
                job = stub.start_job(prompt, max_new, body)
                job.forced = forced
                jobs.append(job)
        except HttpError as exc:
            return web.json_response({"error": {"message": exc.message, "type": "invalid_request_error", "code": exc.status}},
                                     status=exc.status)
        think = _thinks(body) and body.get("separate_reasoning") is not False
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = body.get("model") or stub.s.model
        try:
            if not body.get("stream"):
                choices = []
                for i, job in enumerate(jobs):
                    text = await stub.collect(job)
                    reasoning, content, calls = parse_output(text, think=think, final=True)
                    msg = {"role": "assistant", "content": content or None, "reasoning_content": reasoning or None,
                           "tool_calls": calls or None}
                    choices.append({"index": i, "message": msg, "logprobs": None,
                                    "finish_reason": "tool_calls" if calls else job.finished[0], "matched_stop": None})
                return web.json_response({"id": cid, "object": "chat.completion", "created": created, "model": model,
                                          "choices": choices, "usage": self._usage(jobs)})
            return await self._stream_chat(request, body, jobs, think, cid, created, model)
        finally:
            for job in jobs:
                stub.abandon(job)

    @staticmethod
    def _usage(jobs: list) -> dict:
        p, c = jobs[0].prompt_len, sum(len(j.tokens) for j in jobs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": jobs[0].cached}}

    async def _stream_chat(self, request: web.Request, body: dict, jobs: list, think: bool, cid: str, created: int,
                           model: str) -> web.StreamResponse:
        stub = self.stub
        resp = await stub.sse_start(request)

        async def send(i: int, delta: dict, finish: str | None = None, usage: dict | None = None) -> None:
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [] if usage is not None else [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}],
                   "usage": usage}
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        for i, job in enumerate(jobs):
            await send(i, {"role": "assistant", "content": ""})
            sent_r, sent_c, sent_calls = 0, 0, 0
            while True:
                _, fin = await stub.next_tokens(job)
                reasoning, content, calls = parse_output(stub.text_of(job.tokens), think=think, final=fin is not None)
                if len(reasoning) > sent_r:
                    await send(i, {"reasoning_content": reasoning[sent_r:]})
                    sent_r = len(reasoning)
                if len(content) > sent_c:
                    await send(i, {"content": content[sent_c:]})
                    sent_c = len(content)
                for k in range(sent_calls, len(calls)):
                    c = calls[k]
                    await send(i, {"tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                                   "function": {"name": c["function"]["name"], "arguments": ""}}]})
                    await send(i, {"tool_calls": [{"index": k, "function": {"arguments": c["function"]["arguments"]}}]})
                sent_calls = len(calls)
                if fin is not None:
                    await send(i, {}, "tool_calls" if calls else fin[0])
                    break
        so = body.get("stream_options")
        if isinstance(so, dict) and so.get("include_usage"):
            await send(0, {}, usage=self._usage(jobs))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------------ other endpoints

    async def _json(self, request: web.Request) -> dict | web.Response:
        try:
            body = await request.json()
        except Exception:
            return _error(400, "request body is not valid JSON")
        if type(body) is not dict:
            return _error(400, "request body must be a JSON object")
        self.stub.record(request.path, body)
        return body

    async def h_embeddings(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        inp = body.get("input")
        if isinstance(inp, str) or (type(inp) is list and inp and all(type(t) is int for t in inp)):
            inp = [inp]
        if type(inp) is not list or not inp:
            return _error(400, "input must be a non-empty string or list")
        dim = body.get("dimensions")
        dim = 16 if dim is None else dim
        if type(dim) is not int or not 1 <= dim <= _MAX_EMBED_DIM:
            return _error(400, f"dimensions must be an integer in [1, {_MAX_EMBED_DIM}]")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            return _error(400, "encoding_format must be float or base64")
        data, tokens = [], 0
        for i, x in enumerate(inp):
            text = x if isinstance(x, str) else json.dumps(x)
            tokens += len(self.stub.encode(text)) if isinstance(x, str) else len(x) if type(x) is list else 1
            vec = _vector(text, dim)
            emb: Any = base64.b64encode(struct.pack(f"<{dim}f", *vec)).decode() if fmt == "base64" else vec
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return web.json_response({"object": "list", "data": data, "model": body.get("model") or self.stub.s.model,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def h_rerank(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        q, docs = body.get("query"), body.get("documents")
        if not isinstance(q, str) or type(docs) is not list or not all(isinstance(d, str) for d in docs):
            return _error(400, "query must be a string and documents a list of strings")
        out = [{"score": _score(q, d), "document": d, "index": i, "meta_info": {"prompt_tokens": len(q) + len(d)}}
               for i, d in enumerate(docs)]
        out.sort(key=lambda e: -e["score"])
        top = body.get("top_n")
        return web.json_response(out[:top] if type(top) is int and top > 0 else out)

    async def h_score(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        q, items = body.get("query"), body.get("items")
        labels = body.get("label_token_ids") or [1]
        if not isinstance(q, str) or type(items) is not list or not all(isinstance(x, str) for x in items) or type(labels) is not list:
            return _error(400, "query must be a string, items a list of strings, label_token_ids a list")
        scores = [[_score(q + str(t), x) for t in labels] for x in items]
        n = len(q) + sum(len(x) for x in items)
        return web.json_response({"scores": scores, "model": body.get("model") or self.stub.s.model, "object": "scoring",
                                  "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}})

    async def h_responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        stub = self.stub
        msgs: list[dict] = []
        if isinstance(body.get("instructions"), str):
            msgs.append({"role": "system", "content": body["instructions"]})
        inp = body.get("input")
        if isinstance(inp, str):
            msgs.append({"role": "user", "content": inp})
        elif type(inp) is list:
            for item in inp:
                if isinstance(item, dict) and isinstance(item.get("role"), str):
                    c = item.get("content")
                    if type(c) is list:
                        c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
                    msgs.append({"role": item["role"], "content": c if isinstance(c, str) else ""})
        if not msgs or msgs[-1]["role"] == "system":
            return _error(400, "input must be a string or a list of messages")
        try:
            mo = body.get("max_output_tokens")
            job = stub.start_job(stub.chat_prompt({"messages": msgs}), mo if mo is not None else 16, body)
        except HttpError as exc:
            return _error(exc.status, exc.message)
        rid, mid = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        model = body.get("model") or stub.s.model
        created = int(time.time())

        def response(status: str, text: str | None) -> dict:
            out = [] if text is None else [{"type": "message", "id": mid, "status": "completed", "role": "assistant",
                                             "content": [{"type": "output_text", "text": text, "annotations": []}]}]
            r = {"id": rid, "object": "response", "created_at": created, "model": model, "status": status, "output": out,
                 "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None, "incomplete_details": None,
                 "instructions": body.get("instructions"), "metadata": {}, "temperature": None, "top_p": None}
            if text is not None:
                r["usage"] = {"input_tokens": job.prompt_len, "output_tokens": len(job.tokens),
                              "total_tokens": job.prompt_len + len(job.tokens),
                              "input_tokens_details": {"cached_tokens": job.cached}, "output_tokens_details": {"reasoning_tokens": 0}}
            return r

        try:
            if not body.get("stream"):
                return web.json_response(response("completed", await stub.collect(job)))
            resp = await stub.sse_start(request)
            seq = 0

            async def event(kind: str, **fields: Any) -> None:
                nonlocal seq
                payload = {"type": kind, "sequence_number": seq, **fields}
                seq += 1
                await resp.write(f"event: {kind}\ndata: ".encode() + json.dumps(payload).encode() + b"\n\n")

            await event("response.created", response=response("in_progress", None))
            item = {"type": "message", "id": mid, "status": "in_progress", "role": "assistant", "content": []}
            await event("response.output_item.added", output_index=0, item=item)
            await event("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []})
            while True:
                toks, fin = await stub.next_tokens(job)
                if toks:
                    await event("response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=stub.text_of(toks),
                                logprobs=[])
                if fin is not None:
                    break
            text = stub.text_of(job.tokens)
            await event("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=text, logprobs=[])
            part = {"type": "output_text", "text": text, "annotations": []}
            await event("response.content_part.done", item_id=mid, output_index=0, content_index=0, part=part)
            await event("response.output_item.done", output_index=0,
                        item={"type": "message", "id": mid, "status": "completed", "role": "assistant", "content": [part]})
            await event("response.completed", response=response("completed", text))
            await resp.write_eof()
            return resp
        finally:
            stub.abandon(job)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}}, status=status)


def _vector(text: str, dim: int) -> list[float]:
    raw = b""
    k = 0
    while len(raw) < dim * 4:
        raw += hashlib.sha256(f"{k}\0{text}".encode()).digest()
        k += 1
    vals = [(b - 127.5) / 127.5 for b in raw[:dim]]
    norm = sum(v * v for v in vals) ** 0.5 or 1.0
    return [round(v / norm, 6) for v in vals]


def _score(a: str, b: str) -> float:
    return round(int.from_bytes(hashlib.sha256(f"{a}\0{b}".encode()).digest()[:4], "big") / 2**32, 6)
