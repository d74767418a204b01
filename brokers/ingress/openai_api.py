"""The OpenAI endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions``.

SSE streaming and not, with a usage chunk at the end when ``stream_options.include_usage``. Logprobs:
the engine's SGLang-style ``meta_info`` lists become OpenAI's ``choices[].logprobs``
(:mod:`mesh.openai_logprobs`), per chunk in streams. The answer ids are ``cmpl-<rid>`` and
``chatcmpl-<rid>``, the rid the broker logs the request by.
"""

from __future__ import annotations

import time

from brokers.ingress import web

from brokers.ingress.endpoint import Endpoint
from brokers.ingress.passthrough import PassthroughEndpoints
from brokers.ingress.replies import REFUSALS, Call, detok, json_response, mesh_headers, status_of
from brokers.ingress.submit import opt_bool
from mesh import openai_logprobs as OL
from mesh import openai_passthrough as OP
from mesh import protocol as P
from mesh.errors import IngressBadRequest

__all__ = ["OpenAIEndpoints"]


class OpenAIEndpoints(Endpoint):
    """The completions and chat completions handlers; what mesh does not render goes through
    :attr:`passthrough` to the engine (:mod:`.passthrough`)."""

    def __init__(self, submitter, streams) -> None:
        super().__init__(submitter, streams)
        self.passthrough = PassthroughEndpoints(submitter, streams)

    async def completions(self, request: web.Request):
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request):
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool):
        try:
            slo, deadline_ms, body = await self.head(request)
            if OP.passthrough_reason(body, chat=chat) is not None:  # tools, reasoning, n > 1: the engine renders
                return await self.passthrough.openai(request, body, slo, deadline_ms, chat=chat)
            model = self.sub.model_of(body)
            tx = await self.sub.text_for(model)
            if chat:
                prompt = await self.sub.chat_input(body.get("messages"), tx)
            else:
                p = body.get("prompt")
                if type(p) is list and p and isinstance(p[0], str):
                    if len(p) != 1:
                        raise IngressBadRequest("prompt: batched prompts are not supported; send one request per prompt")
                    p = p[0]
                prompt = await (self.sub.prompt(None, p, tx) if type(p) is list else self.sub.prompt(p, None, tx))
            stream = opt_bool(body, "stream")
            so = body.get("stream_options")
            if so is not None and not isinstance(so, dict):
                raise IngressBadRequest("stream_options must be an object")
            include_usage = opt_bool(so or {}, "include_usage")
            params = self.sub.params(body, chat=chat)
            call = self.sub.submit(prompt, stream=stream, slo=slo, deadline_ms=self.sub.lifetime_ms(deadline_ms, stream),
                                   params=params, model=model, tx=tx, session=self.sub.session_of(request, body))
        except REFUSALS as exc:
            return self.refused(exc)
        try:
            return await self._reply(request, call, chat=chat, stream=stream, include_usage=include_usage)
        finally:
            call.close()

    async def _reply(self, request: web.Request, call: Call, *, chat: bool, stream: bool, include_usage: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + call.rid  # the id the broker logs the request by
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not stream:
            m = await self.final(call)
            if not isinstance(m, P.ClientFinal):
                return m
            text = detok(m.data, call.tok)
            lps = self.logprobs(m.data, chat, None, call.tok)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                       "finish_reason": finish_reason(m.finish_reason)}
                      if chat else {"index": 0, "text": text, "finish_reason": finish_reason(m.finish_reason), "logprobs": lps})
            return json_response({"id": rid, "object": obj, "created": created, "model": call.model,
                                  "choices": [choice], "usage": usage(m.usage)}, headers=mesh_headers(call, m.worker))
        early, resp, m = await self.streams.open(request, call)
        if early is not None:
            return early
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        first = True
        offset = OL.TextOffset()  # completions text_offset across chunks

        async def content(text: str, data: dict) -> None:
            nonlocal first
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if chat else None
            first = False
            choice = {"index": 0, "delta": delta, "finish_reason": None} if chat else {"index": 0, "text": text, "finish_reason": None}
            lps = self.logprobs(data, chat, offset, call.tok)  # the chunk's own tokens (the adapter sends each its slice)
            if lps is not None:
                choice["logprobs"] = lps
            await self.streams.sse(resp, {"id": rid, "object": chunk_obj, "created": created, "model": call.model, "choices": [choice]})

        while True:
            if m is None:
                m = await self.streams.next_output(call)
                if m is None:
                    await self.streams.sse_timeout(resp, call)
                    break
            if isinstance(m, P.ClientChunk):
                await content(detok(m.data, call.tok), m.data)
            elif isinstance(m, P.ClientFinal):
                if m.data.get("token_ids") or m.data.get("text"):  # the engine's last delta
                    await content(detok(m.data, call.tok), m.data)
                choice = ({"index": 0, "delta": {}, "finish_reason": finish_reason(m.finish_reason)} if chat
                          else {"index": 0, "text": "", "finish_reason": finish_reason(m.finish_reason)})
                await self.streams.sse(resp, {"id": rid, "object": chunk_obj, "created": created, "model": call.model, "choices": [choice]})
                if include_usage:
                    await self.streams.sse(resp, {"id": rid, "object": chunk_obj, "created": created, "model": call.model, "choices": [],
                                           "usage": usage(m.usage)})
                break
            elif isinstance(m, P.ClientError):
                etype = "invalid_request_error" if status_of(m.code) < 500 else "server_error"
                await self.streams.sse(resp, {"error": {"message": m.message, "type": etype, "code": m.code}})
                break
            m = None
        await self.streams.write(resp, b"data: [DONE]\n\n")
        return resp

    @staticmethod
    def logprobs(data: dict, chat: bool, offset: OL.TextOffset | None = None, tok=None) -> dict | None:
        """OpenAI logprobs from the engine's ``meta_info`` in a CHUNK or FINAL (None without any)."""
        meta = data.get("meta_info")
        if not OL.has_logprobs(meta):
            return None
        decode = tok.decode if tok is not None else None
        return OL.chat_logprobs(meta, decode=decode) if chat else OL.completion_logprobs(meta, decode=decode, offset=offset)



def finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def usage(u: dict) -> dict:
    def n(k: str) -> int:
        v = u.get(k, 0)
        return v if type(v) is int else 0

    pt, ct = n("prompt_tokens"), n("completion_tokens")
    return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct,
            "prompt_tokens_details": {"cached_tokens": n("cached_tokens")}}

