"""HTTP -> SUBMIT: headers, body, prompt and parameters of one request, checked and submitted.

An HTTP request becomes an ordinary mesh SUBMIT from a *local client*, with the same routing,
retries, deadlines and exactly-one-terminal guarantee as ZeroMQ clients. Each request gets its own
local identity, ``b"\\x00http:"`` + 16 random bytes (never derived from a counter, never shown to
anyone), and a random rid. The ids in answer bodies are that rid (``cmpl-<rid>``, ``meta_info.id``
unless the client gave its own ``rid``), the id the broker's logs carry; the identity is never
shown. The request is handed to the backend decoded (:class:`mesh.protocol.Submit`), checked as
the broker's decoder checks a received SUBMIT: nothing decodes it again.

Prompts: with the model's tokenizer (``--tokenizer``, else the one its engines announce; see
:mod:`.tokenizers`; needs the ``tokenizers`` package) prompts are tokenised here and routed by token
ids; otherwise the prompt text is sent and the broker routes by a byte-level key of the text (counted
and reported when the model's engines key by token ids). SLO headers ``x-sgl-ttft-slo-ms`` and
``x-sgl-tps-slo`` become the request's SLO and ``x-mesh-deadline-ms`` its deadline; an invalid
value is a 400 naming the header. Every body field is validated (400 naming the field); nothing a
client sends produces a 500.

Size limits: the worker sockets cap every frame at ``mesh.protocol.MAX_FRAME_BYTES`` (4 MiB) and the
broker forwards the SUBMIT body verbatim as the worker's REQUEST frame 3, so an oversized SUBMIT
would cost the connection of every worker it is tried on. JSON -> msgpack never grows what the
client sent (a JSON string's UTF-8 payload plus its quotes is at least the msgpack str; a token id
takes at least as many bytes in JSON, separator included, as in msgpack), but the ingress adds
bytes: chat role prefixes (``{}`` is 3 bytes of JSON and ``"user: \\n"`` 7 bytes of prompt) and
tokenisation (up to one id of up to 5 bytes per input byte). So the body limit is a cheap first
bound, ``MAX_FRAME_BYTES // 2`` (checked from Content-Length before reading), and the exact check
is on the encoded SUBMIT (at most ``MAX_SUBMIT_BYTES``). Either gives 413 ``too_large``.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import math
import re
import secrets
from typing import Any

import orjson
from brokers.ingress import web

from brokers.ingress.backend import IngressBackend
from brokers.ingress.replies import Call
from brokers.ingress.tokenizers import Tokenizers
from mesh import protocol as P
from mesh import tracing
from mesh.errors import IngressBadRequest, IngressContextTooLong, IngressOverloaded, IngressTooLarge
from mesh.params import ParamError, from_generate, from_openai
from mesh.routing.sessions import SESSION_HEADER, SOURCES, SessionKeyError, session_key

__all__ = ["MAX_BODY_BYTES", "MAX_SUBMIT_BYTES", "PRIORITY", "QUOTA_KEY", "REQUEST_ID", "REQUEST_ID_RE", "TENANT", "Submitter",
           "opt_bool"]

# The quota key of the HTTP request being handled (its peer address): every HTTP request has its
# own random local identity, so the broker's per-client in-flight quota counts by this instead.
QUOTA_KEY: contextvars.ContextVar[bytes | None] = contextvars.ContextVar("mesh_http_quota_key", default=None)
# The caller's ``x-request-id`` (validated), or None: the request's id through broker, adapter and
# engine (logs, the engine's rid) and in the reply's headers.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("mesh_http_request_id", default=None)
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:@+=-]{1,128}")
# The caller's tenant (its API key's, mesh.tenants) and the priority band it asked for (header
# x-mesh-priority, validated): stamped on the SUBMIT; the broker clamps the band to the tenant's ceiling.
TENANT: contextvars.ContextVar[Any] = contextvars.ContextVar("mesh_http_tenant", default=None)
PRIORITY: contextvars.ContextVar[str | None] = contextvars.ContextVar("mesh_http_priority", default=None)

MAX_BODY_BYTES = P.MAX_FRAME_BYTES // 2
# The SUBMIT body becomes REQUEST frame 3 verbatim; keep a small margin under the frame cap.
MAX_SUBMIT_BYTES = P.MAX_FRAME_BYTES - 4096
_LOCAL_PREFIX = b"\x00http:"
_MAX_DEADLINE_MS = 86_400_000  # the protocol's deadline_ms bound
_MAX_MESSAGES = 10_000  # chat messages per request
_INT_RE = re.compile(r"[0-9]{1,12}")


def opt_bool(body: dict, k: str, default: bool = False) -> bool:
    v = body.get(k)
    if v is None:
        return default
    if type(v) is not bool:
        raise IngressBadRequest(f"{k} must be true or false")
    return v


def token_ids(v: Any, name: str) -> list[int]:
    if type(v) is not list or not v or not all(type(t) is int and 0 <= t < P.MAX_TOKEN_ID for t in v):
        raise IngressBadRequest(f"{name} must be a non-empty list of integer token ids in [0, 2**32)")
    return v


def _content_chars(msgs: list) -> int:
    """Characters of text in chat messages (string contents, text parts and tool-call arguments): the
    rendered prompt holds at least these."""
    n = 0
    for m in msgs:
        if not isinstance(m, dict):
            continue
        c = m.get("content")
        if isinstance(c, str):
            n += len(c)
        elif isinstance(c, list):
            n += sum(len(p["text"]) for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


class _SecretIds:
    """Unpredictable 32-byte ids without a system call each: BLAKE2b keyed with 32 random bytes
    drawn once, over a counter (a PRF: knowing any number of ids tells nothing of the next)."""

    __slots__ = ("_key", "_n")

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)
        self._n = 0

    def next(self) -> bytes:
        self._n += 1
        return hashlib.blake2b(self._n.to_bytes(8, "little"), key=self._key, digest_size=32).digest()


class Submitter:
    """Turns one HTTP request into a checked SUBMIT and submits it: reads the body (within
    ``body_timeout_s``), the headers, the prompt (tokenised off the loop when the ingress has the
    model's tokenizer) and the parameters; raises the ``Ingress*`` errors of :mod:`mesh.errors`."""

    def __init__(self, backend: IngressBackend, *, model: str = "mesh", tokenizers: dict[str | None, str] | None = None,
                 chat_templates: dict[str | None, str] | None = None, body_timeout_s: float = 30.0,
                 request_timeout_s: float = 1800.0, session_sources: tuple[str, ...] = SOURCES) -> None:
        self.backend = backend
        self.session_sources = session_sources  # where session keys come from (mesh.routing.sessions)
        self.model = model
        self.body_timeout_s = body_timeout_s
        self.request_timeout_s = request_timeout_s
        self._ids = _SecretIds()
        # Per model: its tokenizer and chat template (mesh.tokenization.ModelTokenizer) and the thread
        # pool that runs them off the event loop (HF tokenizers release the GIL): flag-named, else the
        # one its engines announced (brokers.ingress.tokenizers)
        self.tokenizers = Tokenizers(backend, tokenizers, chat_templates)

    def close(self) -> None:
        self.tokenizers.close()

    def model_of(self, body: dict) -> str | None:
        model = body.get("model")
        if model is None:
            return None
        if not isinstance(model, str) or not 0 < len(model) <= 256:
            raise IngressBadRequest("model must be a string of 1..256 characters")
        return model

    def session_of(self, request: web.Request, body: dict) -> str | None:
        """The request's session key (``x-session-id``, ``prompt_cache_key``, ``user`` or
        ``session_params.id``, as configured); a malformed one is a 400 naming where it came from."""
        if not self.session_sources:
            return None
        try:
            return session_key(request.headers.get(SESSION_HEADER), body, self.session_sources)
        except SessionKeyError as exc:
            raise IngressBadRequest(str(exc)) from None

    async def text_for(self, model: str | None):
        """The (tokenizer, pool) for a request's model (see :class:`Tokenizers`), or None."""
        return await self.tokenizers.for_model(model)

    def _fits(self, n_chars: int, tx) -> None:
        """Refuse, before tokenising, text that cannot fit the largest context: ``n_chars`` characters
        are at least ``n_chars / max_token_chars`` tokens. Bounds the tokenizer CPU one request costs."""
        cap = self.backend.prompt_token_cap()
        if cap and n_chars > cap * tx[0].max_token_chars:
            self.backend.stats.dropped["prompt_over_context_chars"] += 1
            raise IngressContextTooLong(f"prompt of {n_chars} characters is more than {cap} tokens (the largest worker's "
                                        f"capacity) with this model's tokenizer (at most {tx[0].max_token_chars} characters a token)")

    def answer_model(self, model: str | None) -> str:
        """The ``model`` an answer reports: the name asked for, else the fleet's only model."""
        if model is not None:
            return model
        served = self.backend.model_catalog()[0]
        return next(iter(served)) if len(served) == 1 else self.model

    def _header_int(self, request: web.Request, name: str, lo: int, hi: int) -> int | None:
        raw = request.headers.get(name)
        if raw is None:
            return None
        raw = raw.strip()
        if not _INT_RE.fullmatch(raw) or not lo <= int(raw) <= hi:
            raise IngressBadRequest(f"{name} must be an integer in [{lo}, {hi}], got {raw[:40]!r}")
        return int(raw)

    def slo(self, request: web.Request) -> dict[str, Any] | None:
        slo: dict[str, Any] = {}
        v = self._header_int(request, "x-sgl-ttft-slo-ms", 1, _MAX_DEADLINE_MS)
        if v is not None:
            slo["ttft_ms"] = v
        raw = request.headers.get("x-sgl-tps-slo")
        if raw is not None:
            try:
                f = float(raw)
            except ValueError:
                raise IngressBadRequest(f"x-sgl-tps-slo must be a positive number, got {raw[:40]!r}") from None
            if not math.isfinite(f) or f <= 0:
                raise IngressBadRequest("x-sgl-tps-slo must be a finite positive number")
            slo["tps"] = f
        return slo or None

    def deadline_ms(self, request: web.Request) -> int | None:
        """The request's own deadline header (a bad value is a 400), or None."""
        return self._header_int(request, "x-mesh-deadline-ms", 1, _MAX_DEADLINE_MS)

    def lifetime_ms(self, header_ms: int | None, stream: bool) -> int:
        """The header's deadline; else unstreamed requests live ``request_timeout_s`` and streams
        have no total bound (the protocol's 24 h), only ``stream_idle_timeout_s`` between outputs."""
        if header_ms is not None:
            return header_ms
        return _MAX_DEADLINE_MS if stream else int(self.request_timeout_s * 1000)

    async def read_json(self, request: web.Request) -> dict:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise IngressTooLarge(f"request body of {request.content_length} bytes exceeds the limit of {MAX_BODY_BYTES}")
        raw = request.body_now()  # usually there with the head: no timer
        try:
            if raw is None:
                async with asyncio.timeout(self.body_timeout_s):  # no Task per request (wait_for makes one)
                    raw = await request.read()
        except web.BodyTooLarge:
            raise IngressTooLarge(f"request body exceeds the limit of {MAX_BODY_BYTES} bytes") from None
        except TimeoutError:
            self.backend.stats.dropped["http_body_timeout"] += 1
            raise IngressBadRequest(f"request body not received within {self.body_timeout_s:g} s", close=True) from None
        try:
            body = orjson.loads(raw)  # depth-limited (1024), strict UTF-8, 64-bit integers
        except orjson.JSONDecodeError:
            try:  # what orjson refuses but JSON allows (integers beyond 64 bits): the slow, exact parser
                body = json.loads(raw)
            except RecursionError:
                raise IngressBadRequest("request body is nested too deeply") from None
            except ValueError:  # JSONDecodeError, UnicodeDecodeError, ints over the digit limit
                raise IngressBadRequest("request body must be JSON") from None
        if not isinstance(body, dict):
            raise IngressBadRequest("request body must be a JSON object")
        return body

    async def prompt(self, text: Any, ids: Any, tx=None) -> dict[str, Any]:
        if ids is not None:
            return {"input_ids": token_ids(ids, "input_ids")}
        if not isinstance(text, str) or not text:
            raise IngressBadRequest("prompt must be a non-empty string or a list of token ids")
        if tx is not None:
            self._fits(len(text), tx)
            cap = self.backend.prompt_token_cap()
            if cap:  # more tokens than any worker holds: refused before the ids become a list
                return {"input_ids": await self._tokenize(tx[1].encode, text, client=QUOTA_KEY.get(), max_tokens=cap)}
            return {"input_ids": await self._tokenize(tx[1].encode, text, client=QUOTA_KEY.get())}
        return {"text": text}

    def params(self, body: dict, *, chat: bool | None) -> dict[str, Any]:
        """Generation parameters (:mod:`mesh.params`): every field reaches the engine or is a 400
        that names it. ``chat`` None: SGLang's ``/generate``."""
        try:
            return from_generate(body) if chat is None else from_openai(body, chat=chat)
        except ParamError as exc:
            raise IngressBadRequest(str(exc)) from None

    async def _tokenize(self, fn, *args, client=None, **kw) -> list[int]:
        """Run a pool call; what the tokenizer or template refuses is a 400 naming why, a full pool
        a 429 (``overloaded``, retry later)."""
        from mesh.tokenization import TokenizerBusy, TooManyTokens

        try:
            out = await fn(*args, client=client, **kw)
        except TokenizerBusy as exc:
            self.backend.stats.dropped["tokenizer_busy"] += 1
            raise IngressOverloaded(str(exc)) from None
        except TooManyTokens as exc:
            self.backend.stats.dropped["prompt_over_context_tokens"] += 1
            raise IngressContextTooLong(f"prompt of {exc.tokens} tokens exceeds the largest worker's capacity of "
                                        f"{exc.limit} tokens") from None
        except (ValueError, TypeError, UnicodeError) as exc:  # lone surrogates, template raise_exception, bad parts
            raise IngressBadRequest(f"prompt could not be tokenised: {exc}"[:400]) from None
        except Exception as exc:  # a template error (jinja2) is the request's, not the broker's
            if type(exc).__module__.startswith("jinja2"):
                raise IngressBadRequest(f"the chat template refused the messages: {exc}"[:400]) from None
            raise
        return out[1] if isinstance(out, tuple) else out

    async def chat_input(self, msgs: Any, tx=None, *, template_kwargs: dict[str, Any] | None = None,
                         fallback_text: str | None = None) -> dict[str, Any]:
        """Chat messages -> the prompt: rendered by the model's chat template and tokenised (off the
        loop) when the ingress has the model's tokenizer, else the plain-text fallback below (or
        ``fallback_text``). ``template_kwargs``: what the template sees besides the messages (tools)."""
        if tx is None or tx[0].files.chat_template is None:
            return await self.prompt(self._chat_prompt(msgs) if fallback_text is None else fallback_text, None, tx)
        if type(msgs) is not list or not msgs:
            raise IngressBadRequest("messages must be a non-empty list")
        if len(msgs) > _MAX_MESSAGES:
            raise IngressTooLarge(f"messages holds {len(msgs)} entries; the limit is {_MAX_MESSAGES}")
        self._fits(_content_chars(msgs), tx)
        if template_kwargs:
            return {"input_ids": await self._tokenize(tx[1].render_chat, msgs, True, template_kwargs, client=QUOTA_KEY.get())}
        return {"input_ids": await self._tokenize(tx[1].render_chat, msgs, client=QUOTA_KEY.get())}

    def _chat_prompt(self, msgs: Any) -> str:
        if type(msgs) is not list or not msgs:
            raise IngressBadRequest("messages must be a non-empty list")
        if len(msgs) > _MAX_MESSAGES:  # building a prompt from ~10^6 tiny messages stalls the broker loop
            raise IngressTooLarge(f"messages holds {len(msgs)} entries; the limit is {_MAX_MESSAGES}")
        parts = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise IngressBadRequest(f"messages[{i}] must be an object")
            role = m.get("role", "user")
            if not isinstance(role, str) or not role or len(role) > 64:
                raise IngressBadRequest(f"messages[{i}].role must be a non-empty string")
            content = m.get("content")
            if content is None:
                content = ""
            elif isinstance(content, list):  # content parts: only text parts are supported
                texts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise IngressBadRequest(f"messages[{i}].content[{j}] must be a text part ({{\"type\": \"text\", \"text\": ...}})")
                    texts.append(part["text"])
                content = "".join(texts)
            elif not isinstance(content, str):
                raise IngressBadRequest(f"messages[{i}].content must be a string or a list of text parts")
            parts.append(f"{role}: {content}\n")
        return "".join(parts) + "assistant:"


    def submit(self, prompt: dict[str, Any], *, stream: bool, slo, deadline_ms: int,
                params: dict[str, Any], model: str | None = None, tx=None, passthrough: dict[str, Any] | None = None,
               session: str | None = None) -> Call:
        """Build the SUBMIT and check it (its encoded size, and the broker decoder's own checks, so
        the broker never answers an unreadable rid); the backend takes it decoded. Raises
        IngressBadRequest or IngressTooLarge."""
        raw = self._ids.next()
        ident = _LOCAL_PREFIX + raw[:16]  # always fresh and secret: replies are matched by identity and rid
        rid = REQUEST_ID.get() or raw[16:].hex()
        tracing.annotate(request_id=rid, model=model)
        if tx is None and "text" in prompt:
            self.tokenizers.note_text(model)
        tenant = TENANT.get()
        body = P.submit_body(rid, input_ids=prompt.get("input_ids"), text=prompt.get("text"), params=params,
                             deadline_ms=deadline_ms, stream=stream, slo=slo, model=model,
                             traceparent=tracing.current_traceparent(), passthrough=passthrough, session=session,
                             tenant=tenant.name if tenant is not None else None, priority=PRIORITY.get())
        try:
            packed = P.pack(body)  # what a worker gets as REQUEST frame 3, verbatim
        except (UnicodeEncodeError, ValueError, OverflowError, TypeError):  # lone surrogates in a string, ...
            raise IngressBadRequest("request holds text that is not valid Unicode") from None
        if len(packed) > MAX_SUBMIT_BYTES:
            raise IngressTooLarge(f"the encoded request is {len(packed)} bytes; the limit is {MAX_SUBMIT_BYTES}")
        sub = P.submit_of_body(body, packed)  # the checks of P.decode_client, without decoding ``packed``
        if isinstance(sub, P.ProtocolError):
            raise IngressBadRequest(f"invalid request: {sub.detail or sub.reason}"[:300])
        q: asyncio.Queue = asyncio.Queue()
        self.backend.submit(ident, sub, q, quota_key=QUOTA_KEY.get())
        call = Call(self.backend, ident, rid, q, deadline_ms / 1000.0 + 5.0)
        call.model = self.answer_model(model)
        call.tok = tx[0] if tx is not None else None
        return call
