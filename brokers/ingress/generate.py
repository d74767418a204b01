"""SGLang's native ``POST /generate``: SGLang's answer shapes, cumulative streaming like SGLang.

Behind ``mesh attach`` the bodies are the engine's own (``meta_info`` passed through, ``id`` set to
the request's id: the client's ``rid`` when it gave one, else the rid the broker logs), and a stream
has exactly the engine's events; a stream shows the logprob lists cumulative, as SGLang does.
"""

from __future__ import annotations

from typing import Any

from brokers.ingress import web

from brokers.ingress.endpoint import Endpoint
from brokers.ingress.replies import REFUSALS, Call, detok, json_response, mesh_headers, status_of
from brokers.ingress.submit import opt_bool
from mesh import openai_logprobs as OL
from mesh import protocol as P
from mesh.errors import ErrorCode, IngressBadRequest

__all__ = ["GenerateEndpoint"]


class GenerateEndpoint(Endpoint):
    """The ``/generate`` handler."""

    async def generate(self, request: web.Request):
        try:
            slo, deadline_ms, body = await self.head(request)
            text, ids = body.get("text"), body.get("input_ids")
            if text is not None and ids is not None:
                raise IngressBadRequest("give either text or input_ids, not both")
            model = self.sub.model_of(body)  # a mesh extension: SGLang's /generate serves one model
            tx = await self.sub.text_for(model)
            prompt = await self.sub.prompt(text, ids, tx)
            params = self.sub.params(body, chat=None)
            stream = opt_bool(body, "stream")
            user_rid = body.get("rid")
            if user_rid is not None and (not isinstance(user_rid, str) or not 0 < len(user_rid) <= P.MAX_RID_BYTES):
                raise IngressBadRequest(f"rid must be a string of 1..{P.MAX_RID_BYTES} characters")
            call = self.sub.submit(prompt, stream=stream, slo=slo, deadline_ms=self.sub.lifetime_ms(deadline_ms, stream),
                                   params=params, model=model, tx=tx, session=self.sub.session_of(request, body))
        except REFUSALS as exc:
            return self.refused(exc)
        try:
            return await self._reply(request, call, user_rid or call.rid, stream)
        finally:
            call.close()

    async def _reply(self, request: web.Request, call: Call, rid: str, stream: bool):
        """SGLang's own answer shapes. Behind an adapter the engine's ``meta_info`` comes through
        as the engine wrote it (``id`` set to the request's id); workers without one (simulated)
        get the same fields built from the FINAL."""
        if not stream:
            m = await self.final(call)
            if not isinstance(m, P.ClientFinal):
                return m
            return json_response({"text": detok(m.data, call.tok), "output_ids": m.data.get("token_ids", []),
                                  "meta_info": sgl_meta(m, rid)}, headers=mesh_headers(call, m.worker))
        early, resp, m = await self.streams.open(request, call)
        if early is not None:
            return early
        ids: list[int] = []
        text = ""
        n_chunks = 0
        lists: dict[str, list] = {}  # logprob lists, cumulative like SGLang's (the adapter sends each event's new part)
        while True:
            if m is None:
                m = await self.streams.next_output(call)
                if m is None:
                    await self.streams.sse(resp, {"error": {"message": self.streams.timeout_message(call), "type": "server_error",
                                                     "code": ErrorCode.DEADLINE_EXCEEDED.value, "retryable": False}})
                    break
            if isinstance(m, P.ClientChunk):  # SGLang streams cumulative text and ids
                ids.extend(m.data.get("token_ids") or [])
                text += detok(m.data, call.tok)
                n_chunks += 1
                meta = m.data.get("meta_info")
                meta = {**meta, "id": rid} if type(meta) is dict else {"id": rid, "finish_reason": None, "completion_tokens": len(ids)}
                await self.streams.sse(resp, {"text": text, "output_ids": ids, "meta_info": cumulative(meta, lists)})
            elif isinstance(m, P.ClientFinal):
                if m.data.get("token_ids") or m.data.get("text"):  # the engine's last event
                    ids.extend(m.data.get("token_ids") or [])
                    text += detok(m.data, call.tok)
                await self.streams.sse(resp, {"text": text, "output_ids": ids, "meta_info": cumulative(sgl_meta(m, rid), lists)})
                break
            elif isinstance(m, P.ClientError):
                await self.streams.sse(resp, {"error": {"message": m.message, "type": "invalid_request_error" if status_of(m.code) < 500
                                                 else "server_error", "code": m.code, "retryable": False}})
                break
            m = None
        await self.streams.write(resp, b"data: [DONE]\n\n")
        return resp


def sgl_meta(m: P.ClientFinal, rid: str) -> dict:
    """The final ``meta_info``: the engine's own when an adapter passed it on, else SGLang's
    fields from the FINAL (``length`` as SGLang reports it: the completion length)."""
    meta = m.data.get("meta_info")
    if type(meta) is dict:
        return {**meta, "id": rid}
    u = m.usage
    fr: dict[str, Any] = {"type": m.finish_reason}
    if m.finish_reason == "length":
        fr["length"] = u.get("completion_tokens")
    return {"id": rid, "finish_reason": fr, "prompt_tokens": u.get("prompt_tokens"),
            "completion_tokens": u.get("completion_tokens"), "cached_tokens": u.get("cached_tokens")}


def cumulative(meta: dict, lists: dict[str, list]) -> dict:
    """A /generate stream event's meta_info with its logprob lists made cumulative (``lists``
    holds what earlier events carried), as SGLang streams them."""
    new = [k for k in OL.LOGPROB_KEYS if type(meta.get(k)) is list]
    if not new and not lists:
        return meta
    for k in new:
        lists.setdefault(k, []).extend(meta[k])
    return {**meta, **lists}  # serialised at once, before the next event extends them
