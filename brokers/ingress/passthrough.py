"""Pass-through endpoints: what mesh does not render goes to the engine's own OpenAI server.

``POST /v1/responses``, ``/v1/embeddings``, ``/v1/rerank``, ``/v1/score``, and chat / completions
requests with tools, reasoning options or ``n`` > 1 (:func:`mesh.openai_passthrough.passthrough_reason`)
become a SUBMIT with ``passthrough`` (the path and the client's body, unchanged) plus the routing
key: the chat rendered with its tools by the model's chat template (tokenised) when the front door
has it, else :func:`~mesh.openai_passthrough.render_chat_text`; the input text of the other
endpoints (:func:`~mesh.openai_passthrough.routing_text`). The broker routes and retries it as any
request; the worker's adapter sends the body to its engine (:mod:`mesh.adapters.passthrough`).

The engine's answer reaches the client as the engine gave it: status, ``Content-Type`` and body,
an SSE stream byte for byte as it arrives (mesh's own headers ``x-mesh-worker`` and
``x-mesh-request-id`` beside). An engine's refusal keeps its status and body. mesh's own errors
(no worker, deadline, overload) are OpenAI-style bodies as on every endpoint; one that comes after a
stream started is an SSE ``error`` event. A worker that answers without the pass-through fields
(an adapter older than pass-through) is a 502, counted as ``dropped{what=passthrough_unsupported}``.
"""

from __future__ import annotations

from brokers.ingress import web

from brokers.ingress.endpoint import Endpoint
from brokers.ingress.replies import REFUSALS, Call, error_response, mesh_error_response, mesh_headers
from brokers.ingress.submit import opt_bool
from mesh import openai_passthrough as OP
from mesh import protocol as P
from mesh.errors import ErrorCode, IngressBadRequest, IngressTooLarge

__all__ = ["PassthroughEndpoints", "MAX_ANSWER_BYTES"]

MAX_ANSWER_BYTES = 256 * 1024 * 1024  # an unstreamed answer is held whole before it is sent
_NO_OUTPUT = frozenset({"/v1/embeddings", "/v1/rerank", "/v1/score"})


class PassthroughEndpoints(Endpoint):
    """The pass-through handlers (see the module docstring)."""

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._endpoint(request, "/v1/responses")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._endpoint(request, "/v1/embeddings")

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        return await self._endpoint(request, "/v1/rerank")

    async def score(self, request: web.Request) -> web.StreamResponse:
        return await self._endpoint(request, "/v1/score")

    async def _endpoint(self, request: web.Request, path: str) -> web.StreamResponse:
        try:
            slo, deadline_ms, body = await self.head(request)
            try:
                text = OP.routing_text(path, body)
            except ValueError as exc:
                raise IngressBadRequest(str(exc)) from None
            model = self.sub.model_of(body)
            tx = await self.sub.text_for(model)
            prompt = await self.sub.prompt(text, None, tx)
        except REFUSALS as exc:
            return self.refused(exc)
        return await self.forward(request, path, body, prompt, slo, deadline_ms, model, tx)

    async def openai(self, request: web.Request, body: dict, slo, deadline_ms: int | None, *, chat: bool) -> web.StreamResponse:
        """A chat or completions request :func:`~mesh.openai_passthrough.passthrough_reason` sends through."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            model = self.sub.model_of(body)
            tx = await self.sub.text_for(model)
            if chat:
                prompt = await self._chat_key(body, tx)
            else:
                p = body.get("prompt")
                if type(p) is list and len(p) == 1 and isinstance(p[0], (str, list)):
                    p = p[0]
                prompt = await (self.sub.prompt(None, p, tx) if type(p) is list else self.sub.prompt(p, None, tx))
        except REFUSALS as exc:
            return self.refused(exc)
        return await self.forward(request, path, body, prompt, slo, deadline_ms, model, tx)

    async def _chat_key(self, body: dict, tx) -> dict:
        """The chat's routing prompt, its tools included (as the engine renders it)."""
        msgs = body.get("messages")
        try:
            tools = OP.template_tools(body)
            kw = OP.template_kwargs(body)
            if type(msgs) is list:
                msgs = OP.template_messages(msgs)
            fallback = OP.render_chat_text(msgs, tools) if tx is None or tx[0].files.chat_template is None else None
        except ValueError as exc:
            raise IngressBadRequest(str(exc)) from None
        if tools:
            kw = {**kw, "tools": tools}
        return await self.sub.chat_input(msgs, tx, template_kwargs=kw or None, fallback_text=fallback)

    async def forward(self, request: web.Request, path: str, body: dict, prompt: dict, slo, deadline_ms: int | None,
                      model: str | None, tx) -> web.StreamResponse:
        """Submit the request with its body for ``path`` and answer with what the engine answered."""
        try:
            raw = await request.read()  # the body as the client sent it (kept once read)
            if len(raw) > P.MAX_PASSTHROUGH_BODY_BYTES:
                raise IngressTooLarge(f"request body of {len(raw)} bytes exceeds the pass-through limit of "
                                      f"{P.MAX_PASSTHROUGH_BODY_BYTES}")
            stream = opt_bool(body, "stream")
            # the broker's estimate of the work: what the client allows the engine to generate (one
            # position for the endpoints that generate nothing)
            mt = 1 if path in _NO_OUTPUT else body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
            params = {"max_new_tokens": mt} if type(mt) is int and 0 <= mt <= P.MAX_NEW_TOKENS else {}
            call = self.sub.submit(prompt, stream=True, slo=slo, deadline_ms=self.sub.lifetime_ms(deadline_ms, stream),
                                   params=params, model=model, tx=tx,
                                   passthrough={"path": path, "method": "POST", "body": raw},
                                   session=self.sub.session_of(request, body))
        except REFUSALS as exc:
            return self.refused(exc)
        try:
            return await self._answer(request, call)
        finally:
            call.close()

    async def _first(self, call: Call):
        """The first reply that carries output or ends the request (None: the deadline or the idle
        bound came first). Headers wait for it: the engine's status is in it."""
        m = await self.streams.first_output(call)
        while m is None and not call.done and not call.expired and not call.idle:
            m = await self.streams.next_output(call)
        return m

    def _unsupported(self) -> web.Response:
        self.sub.backend.stats.dropped["passthrough_unsupported"] += 1
        return error_response(502, "the worker answered without pass-through support (is its adapter older than mesh's "
                                   "pass-through?)", ErrorCode.WORKER_ERROR.value, "server_error")

    async def _answer(self, request: web.Request, call: Call) -> web.StreamResponse:
        m = await self._first(call)
        if m is None:
            return error_response(504, self.streams.timeout_message(call), ErrorCode.DEADLINE_EXCEEDED.value, "server_error")
        if isinstance(m, P.ClientError):
            return mesh_error_response(m.code, m.message)
        pt = P.passthrough_reply(m.data) if isinstance(m, (P.ClientChunk, P.ClientFinal)) else None
        if pt is None or pt.status is None or pt.content_type is None:
            return self._unsupported()
        worker = m.worker if isinstance(m, P.ClientFinal) else call.worker
        headers = {"Content-Type": pt.content_type, **mesh_headers(call, worker)}
        if isinstance(m, P.ClientFinal):
            return web.Response(body=pt.raw, status=pt.status, headers=headers)
        if "text/event-stream" in pt.content_type:
            return await self._relay(request, call, pt, headers)
        parts = [pt.raw]  # not a stream: the whole answer, then one response with its length
        size = len(pt.raw)
        while True:
            m = await self.streams.next_output(call)
            if m is None or isinstance(m, P.ClientError):
                return (mesh_error_response(m.code, m.message) if m is not None else
                        error_response(504, self.streams.timeout_message(call), ErrorCode.DEADLINE_EXCEEDED.value, "server_error"))
            piece = P.passthrough_reply(m.data)
            if piece is None:
                return self._unsupported()
            parts.append(piece.raw)
            size += len(piece.raw)
            if size > MAX_ANSWER_BYTES:
                self.sub.backend.stats.dropped["passthrough_answer_too_large"] += 1
                return error_response(502, f"the engine's answer exceeds {MAX_ANSWER_BYTES} bytes", ErrorCode.WORKER_ERROR.value,
                                      "server_error")
            if isinstance(m, P.ClientFinal):
                headers["x-mesh-worker"] = mesh_headers(call, m.worker).get("x-mesh-worker", "")
                return web.Response(body=b"".join(parts), status=pt.status, headers=headers)

    async def _relay(self, request: web.Request, call: Call, pt: P.PassthroughReply, headers: dict[str, str]) -> web.StreamResponse:
        """An SSE answer, piece by piece as the engine wrote it."""
        resp = web.StreamResponse(status=pt.status or 200, headers={**headers, "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await self.streams.write(resp, pt.raw)
        while True:
            m = await self.streams.next_output(call)
            if m is None:
                await self.streams.sse_timeout(resp, call)
                break
            if isinstance(m, P.ClientError):
                await self.streams.sse(resp, {"error": {"message": m.message, "type": "server_error", "code": m.code}})
                break
            piece = P.passthrough_reply(m.data)
            if piece is None:
                self.sub.backend.stats.dropped["passthrough_bad_piece"] += 1
                continue
            if piece.raw:
                await self.streams.write(resp, piece.raw)
            if isinstance(m, P.ClientFinal):
                break
        await resp.write_eof()
        return resp
