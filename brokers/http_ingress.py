"""OpenAI-compatible HTTP ingress on the broker (aiohttp).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming and not; a usage
chunk at the end when ``stream_options.include_usage``), ``POST /generate`` (SGLang native,
cumulative streaming like SGLang), ``GET /v1/models``, ``GET /health`` (200 when at least one
worker is routable), ``GET /readyz``, ``GET /metrics`` (Prometheus; needs the API key when one is
set, like every path except the health probes).

An HTTP request becomes an ordinary mesh SUBMIT from a *local client*: it enters the broker loop
through its mailbox and its replies come back through a per-request queue, so HTTP traffic gets
the same routing, retries, deadlines and exactly-one-terminal guarantee as ZeroMQ clients.
Each request gets its own local identity, ``b"\\x00http:"`` + 16 random bytes (never derived from
a counter, never shown to anyone), and a random rid; a reply on its queue whose rid is not that
rid is dropped and counted (``dropped{what=http_foreign_reply}``). The ids in answer bodies are
that rid (``cmpl-<rid>``, ``meta_info.id`` unless the client gave its own ``rid``), the id the
broker's logs carry; the identity is never shown.

Bodies: ``/generate`` answers have SGLang's fields; behind ``mesh attach`` they are the engine's
own (``meta_info`` passed through, ``id`` set as above), and a stream has exactly the engine's
events. mesh's own metadata is in headers: ``x-mesh-request-id``, ``x-mesh-worker``. Logprobs:
the engine's SGLang-style ``meta_info`` lists become OpenAI's ``choices[].logprobs``
(:mod:`mesh.openai_logprobs`), per chunk in streams; a ``/generate`` stream shows them cumulative.

Prompts: with ``--tokenizer FILE`` (a Hugging Face ``tokenizer.json``, needs the ``tokenizers``
package) prompts are tokenised here and routed by token ids; otherwise the prompt text is sent
and the broker routes by a byte-level key of the text. SLO headers ``x-sgl-ttft-slo-ms`` and
``x-sgl-tps-slo`` become the request's SLO and ``x-mesh-deadline-ms`` its deadline; an invalid
value is a 400 naming the header. Every body field is validated (400 naming the field); nothing a
client sends produces a 500. Errors are OpenAI-style JSON bodies
(``{"error": {"message", "type", "code"}}``) with the status of the mesh error code; ``overloaded``
and ``rate_limited`` are 429 with ``Retry-After``. A streamed request commits its 200 and SSE
headers only once the first output (or, after ACCEPTED, at most ``_FIRST_OUTPUT_WAIT_S``) is
there, so an error before any output keeps its HTTP status; later errors go in-band as an SSE
``error`` event.

Size limits: the worker sockets cap every frame at ``mesh.protocol.MAX_FRAME_BYTES`` (4 MiB) and the
broker forwards the SUBMIT body verbatim as the worker's REQUEST frame 3, so an oversized SUBMIT
would cost the connection of every worker it is tried on. JSON -> msgpack never grows what the
client sent (a JSON string's UTF-8 payload plus its quotes is at least the msgpack str; a token id
takes at least as many bytes in JSON, separator included, as in msgpack), but the ingress adds
bytes: chat role prefixes (``{}`` is 3 bytes of JSON and ``"user: \\n"`` 7 bytes of prompt) and
tokenisation (up to one id of up to 5 bytes per input byte). So the body limit is a cheap first
bound, ``MAX_FRAME_BYTES // 2`` (checked from Content-Length before reading), and the exact check
is on the encoded SUBMIT (at most ``MAX_SUBMIT_BYTES``). Either gives 413 ``too_large``.

Connections (slowloris): at most ``max_connections`` HTTP connections are open at once. A
connection must deliver a complete request head within ``header_timeout_s`` of connecting (or of
the first byte of its next request on a kept-alive connection), a body within ``body_timeout_s``,
and an idle kept-alive connection is closed after ``idle_timeout_s``. When the limit is reached,
a new connection evicts the connection that has waited longest for its request head, else the
longest-idle kept-alive one; when every connection is busy with a request, the new one gets a 503
and is closed. The listen backlog is bounded too, so the ingress holds at most
``max_connections + backlog`` descriptors however many connections arrive.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import ipaddress
import json
import math
import re
import secrets
import time
from typing import Any

import orjson
from aiohttp import web

from mesh import openai_logprobs as OL
from mesh import protocol as P
from mesh import tracing
from mesh.errors import ErrorCode
from mesh.logs import get_logger
from mesh.params import ParamError, from_generate, from_openai

# The quota key of the HTTP request being handled (its peer address): every HTTP request has its
# own random local identity, so the broker's per-client in-flight quota counts by this instead.
_QUOTA_KEY: contextvars.ContextVar[bytes | None] = contextvars.ContextVar("mesh_http_quota_key", default=None)
# The caller's ``x-request-id`` (validated), or None: the request's id through broker, adapter and
# engine (logs, the engine's rid) and in the reply's headers.
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("mesh_http_request_id", default=None)
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:@+=-]{1,128}")

__all__ = ["HttpIngress", "MAX_BODY_BYTES", "MAX_SUBMIT_BYTES"]

MAX_BODY_BYTES = P.MAX_FRAME_BYTES // 2
# The SUBMIT body becomes REQUEST frame 3 verbatim; keep a small margin under the frame cap.
MAX_SUBMIT_BYTES = P.MAX_FRAME_BYTES - 4096
_LOCAL_PREFIX = b"\x00http:"
_MAX_DEADLINE_MS = 86_400_000  # the protocol's deadline_ms bound
_FIRST_OUTPUT_WAIT_S = 5.0  # after ACCEPTED, how long a stream waits for output before committing a 200
_RETRY_AFTER_S = "1"
_MAX_MESSAGES = 10_000  # chat messages per request
_INT_RE = re.compile(r"[0-9]{1,12}")


def _dumps(obj: Any) -> bytes:
    """JSON for replies (orjson: several times faster than json.dumps; anything it cannot encode
    -- never expected, the bodies are built here -- falls back to the standard library)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":"), default=str).encode()


def _json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_dumps(obj), status=status, headers=headers, content_type="application/json")


def _err(status: int, message: str, code: str, etype: str = "invalid_request_error",
         headers: dict[str, str] | None = None) -> web.Response:
    return _json_response({"error": {"message": message, "type": etype, "code": code}}, status=status, headers=headers)


def _mesh_err(code: str, message: str) -> web.Response:
    try:
        ec = ErrorCode(code)
    except ValueError:
        ec = ErrorCode.INTERNAL
    etype = "invalid_request_error" if ec.http_status < 500 else "server_error"
    headers = {"Retry-After": _RETRY_AFTER_S} if ec in (ErrorCode.OVERLOADED, ErrorCode.RATE_LIMITED) else None
    return _err(ec.http_status, message, ec.value, etype, headers)


class _BadRequest(Exception):
    def __init__(self, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.close = close  # the connection is not worth keeping (an unread or half-read body)


class _TooLarge(Exception):
    pass


class _Overloaded(Exception):
    pass


def _load_tokenizer(path: str, chat_template_path: str | None):
    """``--tokenizer``: a model folder (tokenizer.json, tokenizer_config.json with its chat template)
    or a ``tokenizer.json`` inside one. Returns (ModelTokenizer, TokenizerPool)."""
    from pathlib import Path

    from mesh.errors import ConfigError

    try:
        from mesh.tokenization import ModelTokenizer, TokenizerPool
        import tokenizers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise ConfigError("tokenizer: the 'tokenizers' extra is not installed (pip install mesh-router[tokenizers])") from exc
    p = Path(path)
    if p.is_file():
        if p.name != "tokenizer.json":
            raise ConfigError(f"tokenizer: {path} must be a model folder or its tokenizer.json")
        p = p.parent
    tok = ModelTokenizer.from_dir(p, chat_template_path)
    return tok, TokenizerPool(tok, workers=2, max_queued=256)


# ---------------------------------------------------------------------------- connection guard


class _Conn(asyncio.Protocol):
    """Wraps aiohttp's RequestHandler for one connection (public protocol API only) and tracks
    where the connection is: waiting for a request head, busy with a request, or idle."""

    __slots__ = ("guard", "inner", "transport", "state", "since", "timer", "refused")

    def __init__(self, guard: "_ConnGuard", inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.state = "head"
        self.since = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.refused = False

    # asyncio protocol interface
    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.guard.admit(self):
            self.refused = True
            transport.write(_REFUSED_RESPONSE)
            transport.close()
            return
        self.inner.connection_made(transport)
        self.guard.head_started(self)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.state == "idle":  # first bytes of the next request on a kept-alive connection
            self.guard.head_started(self)
        self.inner.data_received(data)

    def eof_received(self):
        if self.refused:
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self.guard.forget(self)
        if not self.refused:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self.refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.refused:
            self.inner.resume_writing()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


_REFUSED_BODY = json.dumps({"error": {"message": "too many HTTP connections", "type": "server_error",
                                      "code": ErrorCode.UNAVAILABLE.value}}).encode()
_REFUSED_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: "
                     + _RETRY_AFTER_S.encode() + b"\r\nConnection: close\r\nContent-Length: "
                     + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n" + _REFUSED_BODY)


class _ConnGuard:
    def __init__(self, stats, max_connections: int, header_timeout_s: float) -> None:
        self.stats = stats
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.conns: dict[_Conn, None] = {}
        self.peak = 0

    def admit(self, c: _Conn) -> bool:
        if len(self.conns) >= self.max_connections:
            victim = self._victim()
            if victim is None:
                self.stats.dropped["http_conn_refused"] += 1
                return False
            self.stats.dropped["http_conn_evicted"] += 1
            self.forget(victim)
            victim.close()
        self.conns[c] = None
        self.peak = max(self.peak, len(self.conns))
        return True

    def _victim(self) -> _Conn | None:
        best = None
        for c in self.conns:
            if c.state == "busy":
                continue
            key = (c.state != "head", c.since)  # waiting for a head first, then the longest idle
            if best is None or key < best[0]:
                best = (key, c)
        return best[1] if best else None

    def head_started(self, c: _Conn) -> None:
        c.state = "head"
        c.since = time.monotonic()
        if c.timer is not None:
            c.timer.cancel()
        c.timer = asyncio.get_running_loop().call_later(self.header_timeout_s, self._head_expired, c)

    def _head_expired(self, c: _Conn) -> None:
        c.timer = None
        if c.state == "head" and c in self.conns:
            self.stats.dropped["http_header_timeout"] += 1
            self.forget(c)
            c.close()

    def busy(self, c: _Conn) -> None:
        c.state = "busy"
        if c.timer is not None:
            c.timer.cancel()
            c.timer = None

    def idle(self, c: _Conn) -> None:
        if c.state == "busy":
            c.state = "idle"
            c.since = time.monotonic()  # aiohttp's keep-alive timeout (idle_timeout_s) closes it

    def forget(self, c: _Conn) -> None:
        if c.timer is not None:
            c.timer.cancel()
            c.timer = None
        self.conns.pop(c, None)

    def close_all(self) -> None:
        for c in list(self.conns):
            self.forget(c)
            c.close()


# ---------------------------------------------------------------------------- one request


_EXPIRED = object()  # queued by a request's deadline timer


class _Call:
    """One submitted request: its replies, filtered to its own rid, until the terminal one."""

    __slots__ = ("broker", "ident", "rid", "q", "t_end", "done", "worker", "expired", "idle", "_timer", "model", "tok")

    def __init__(self, broker, ident: bytes, rid: str, q: asyncio.Queue, timeout_s: float) -> None:
        self.broker = broker
        self.ident = ident
        self.rid = rid
        self.q = q
        self.t_end = time.monotonic() + timeout_s
        self.done = False
        self.worker = ""  # the worker of the latest ACCEPTED (streams)
        self.expired = False
        self.idle = False  # a stream ended for want of output (stream_idle_timeout_s)
        self.model = "mesh"  # the model id the answer reports
        self.tok = None  # the request's model's tokenizer (ModelTokenizer), if the ingress has one
        # One timer per request puts a marker in the queue at the deadline: waits then need no
        # timeout context each (a stream waits once per token).
        self._timer = asyncio.get_running_loop().call_later(timeout_s, q.put_nowait, _EXPIRED)

    async def next(self, until: float | None = None):
        """The next reply of this request, or None when ``until`` (default: the request's own
        deadline plus grace) passes first."""
        while True:
            if self.expired:
                return None
            try:
                frames = self.q.get_nowait()  # replies are usually waiting: no timer, no task
            except asyncio.QueueEmpty:
                if until is None:
                    frames = await self.q.get()
                else:
                    left = until - time.monotonic()
                    if left <= 0:
                        return None
                    try:
                        async with asyncio.timeout(left):
                            frames = await self.q.get()
                    except TimeoutError:
                        return None
            if frames is _EXPIRED:
                self.expired = True
                return None
            m = P.decode_client_reply(frames)
            if isinstance(m, P.ProtocolError):
                self.broker.stats.dropped["http_bad_reply"] += 1
                continue
            if getattr(m, "rid", None) != self.rid:
                self.broker.stats.dropped["http_foreign_reply"] += 1
                continue
            if isinstance(m, (P.ClientFinal, P.ClientError)):
                self.done = True
                if tracing.enabled():
                    if isinstance(m, P.ClientFinal):
                        u = m.usage if isinstance(m.usage, dict) else {}
                        tracing.annotate(worker=m.worker, attempt=m.attempt, route_reason=m.reason or None,
                                         finish_reason=m.finish_reason, prompt_tokens=u.get("prompt_tokens"),
                                         cached_tokens=u.get("cached_tokens"), completion_tokens=u.get("completion_tokens"))
                    else:
                        tracing.annotate(error_code=m.code)
            elif tracing.enabled():
                if isinstance(m, P.Accepted):
                    tracing.annotate(worker=m.worker, attempt=m.attempt)
                elif isinstance(m, P.ClientChunk) and m.seq == 0:
                    tracing.add_event("first_token")
            return m

    def close(self) -> None:
        self._timer.cancel()
        if not self.done:
            self.done = True
            self.broker.cancel_local(self.ident)
        self.broker.forget_local(self.ident)


# ---------------------------------------------------------------------------- field checks


def _opt_bool(body: dict, k: str, default: bool = False) -> bool:
    v = body.get(k)
    if v is None:
        return default
    if type(v) is not bool:
        raise _BadRequest(f"{k} must be true or false")
    return v


def _token_ids(v: Any, name: str) -> list[int]:
    if type(v) is not list or not v or not all(type(t) is int and 0 <= t < P.MAX_TOKEN_ID for t in v):
        raise _BadRequest(f"{name} must be a non-empty list of integer token ids in [0, 2**32)")
    return v


class HttpIngress:
    """Serves HTTP on the broker's event loop; talks to the broker only through its mailbox."""

    def __init__(self, broker, *, model: str = "mesh", api_key: str | None = None, tokenizer_path: str | None = None,
                 chat_template_path: str | None = None, tokenizers: dict[str | None, str] | None = None,
                 chat_templates: dict[str | None, str] | None = None, metrics_registry=None, max_connections: int = 512, header_timeout_s: float = 10.0,
                 idle_timeout_s: float = 60.0, body_timeout_s: float = 30.0, backlog: int = 128,
                 request_timeout_s: float = 1800.0, stream_idle_timeout_s: float = 300.0) -> None:
        self.broker = broker
        self.request_timeout_s = request_timeout_s
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.model = model
        self._key = api_key.encode() if api_key else None
        self.metrics_registry = metrics_registry
        self.idle_timeout_s = idle_timeout_s
        self.body_timeout_s = body_timeout_s
        self.backlog = max(1, min(backlog, max_connections))
        self.guard = _ConnGuard(broker.stats, max_connections, header_timeout_s)
        self._ids = _SecretIds()
        self.log = get_logger(service="http")
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self.endpoint = ""
        # Per model (None: every model without its own): its tokenizer and chat template
        # (mesh.tokenization.ModelTokenizer) and the thread pool that runs them off the event
        # loop (HF tokenizers release the GIL).
        paths = dict(tokenizers or {})
        templates = dict(chat_templates or {})
        if tokenizer_path:
            paths[None] = tokenizer_path
        if chat_template_path:
            templates[None] = chat_template_path
        self._texts = {name: _load_tokenizer(path, templates.get(name)) for name, path in paths.items()}
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._guard_mw])
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/generate", self.generate),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/healthz", self.health),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics),
            web.get("/workers", self.workers),
            web.post("/workers/{worker_id}/{action}", self.worker_action),
        ])
        self.app = app

    @property
    def api_key(self) -> str | None:
        return self._key.decode() if self._key else None

    # ------------------------------------------------------------------ lifecycle
    async def start(self, host: str, port: int) -> str:
        # handler_cancellation: a client that goes away cancels its handler, which cancels its request
        self._runner = web.AppRunner(self.app, access_log=None, keepalive_timeout=self.idle_timeout_s, shutdown_timeout=5.0,
                                     handler_cancellation=True)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None

        def factory() -> _Conn:
            return _Conn(self.guard, server())

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(factory, host, port, backlog=self.backlog, reuse_address=True)
        h, p = self._server.sockets[0].getsockname()[:2]
        self.endpoint = f"http://{h}:{p}"
        return self.endpoint

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.guard.close_all()
        for _, pool in self._texts.values():
            pool.close()

    # ------------------------------------------------------------------ middleware
    @web.middleware
    async def _guard_mw(self, request: web.Request, handler):
        """Marks the connection busy (no head timeout, not evictable) while a request runs, checks
        the API key (every path but the health probes); turns routing errors into OpenAI-style
        bodies and any unexpected exception into a logged 500 without details (no traceback
        reaches a client), and carries the caller's ``x-request-id`` (validated) into the request and
        back on every answer. One middleware, not a chain: each layer costs every request."""
        xid = request.headers.get("x-request-id")
        if xid is not None and not _REQUEST_ID_RE.fullmatch(xid):
            self.broker.stats.requests[ErrorCode.BAD_REQUEST.value] += 1
            return _err(400, "x-request-id: 1..128 characters of A-Z a-z 0-9 . _ : @ + = -", ErrorCode.BAD_REQUEST.value)
        _REQUEST_ID.set(xid)
        tr = request.transport
        conn = tr.get_protocol() if tr is not None else None
        if isinstance(conn, _Conn):
            self.guard.busy(conn)
        _QUOTA_KEY.set(b"\x00httpq:" + (request.remote or "?").encode())
        try:
            if tracing.enabled() and request.method == "POST":
                with tracing.server_span(f"mesh {request.path}", request.headers,
                                         {"http.request.method": "POST", "url.path": request.path, "mesh.request_id": xid}):
                    resp = await self._handle(request, handler)
                    tracing.set_attributes({"http.response.status_code": resp.status})
            else:
                resp = await self._handle(request, handler)
        finally:
            if isinstance(conn, _Conn):
                self.guard.idle(conn)
        if xid is not None and not resp.prepared and "x-request-id" not in resp.headers:
            resp.headers["x-request-id"] = xid  # errors too: the caller's id comes back on every answer
        return resp

    async def _handle(self, request: web.Request, handler):
        try:
            if self._key and request.path not in ("/health", "/healthz", "/readyz"):
                got = request.headers.get("Authorization", "").encode("utf-8", "replace")
                if not hmac.compare_digest(got, b"Bearer " + self._key):
                    self.broker.stats.requests[ErrorCode.UNAUTHORIZED.value] += 1
                    return _err(401, "missing or invalid API key", "unauthorized", "authentication_error")
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "bad_request" if exc.status < 500 else "internal")
            return _err(exc.status, exc.reason, code,
                        "invalid_request_error" if exc.status < 500 else "server_error")
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as exc:
            self.broker.stats.dropped["http_handler_exception"] += 1
            self.log.exception("http_handler_failed", path=request.path, error=repr(exc))
            return _err(500, "internal error", ErrorCode.INTERNAL.value, "server_error")

    # ------------------------------------------------------------------ simple endpoints
    async def models(self, request: web.Request) -> web.Response:
        """The models that have routable workers, their aliases, and the fleet's name while it
        serves one model (each is a name requests may use)."""
        served, aliases, fleet_name = self.broker.model_catalog()
        ids = sorted(served)
        ids += sorted(a for a, target in aliases.items() if target in served and a not in served)
        if len(served) == 1 and fleet_name not in ids:
            ids.append(fleet_name)
        return _json_response({"object": "list", "data": [
            {"id": i, "object": "model", "created": 0, "owned_by": "mesh", "root": aliases.get(i, ids[0] if i == fleet_name else i)}
            for i in ids]})

    def _model_of(self, body: dict) -> str | None:
        model = body.get("model")
        if model is None:
            return None
        if not isinstance(model, str) or not 0 < len(model) <= 256:
            raise _BadRequest("model must be a string of 1..256 characters")
        return model

    def _text_for(self, model: str | None):
        """The (tokenizer, pool) for a request's model: its own (by name or through an alias, or
        the fleet's only model under no name), else the default one; None without any."""
        if not self._texts:
            return None
        if len(self._texts) > 1 or None not in self._texts:
            served, aliases, fleet_name = self.broker.model_catalog()
            name = aliases.get(model, model) if model is not None else None
            if (name is None or name == fleet_name) and len(served) == 1:
                name = next(iter(served))
            hit = self._texts.get(name) if name is not None else None
            if hit is not None:
                return hit
        return self._texts.get(None)

    def _answer_model(self, model: str | None) -> str:
        """The ``model`` an answer reports: the name asked for, else the fleet's only model."""
        if model is not None:
            return model
        served = self.broker.model_catalog()[0]
        return next(iter(served)) if len(served) == 1 else self.model

    async def health(self, request: web.Request) -> web.Response:
        n = len(self.broker.registry.pool())
        return web.json_response({"status": "ok" if n else "no_workers", "workers": n}, status=200 if n else 503)

    async def readyz(self, request: web.Request) -> web.Response:
        ok = self.broker.state == "serving"
        return web.json_response({"ready": ok, "state": self.broker.state}, status=200 if ok else 503)

    # ------------------------------------------------------------------ admin API
    async def workers(self, request: web.Request) -> web.Response:
        """Every registered worker: its state (registered, routable, ejected, draining), load,
        in-flight requests and KV capacity (behind the API key when one is set)."""
        if not hasattr(self.broker, "admin"):
            return _err(404, "no admin API on this front door (use the broker's --http)", "not_found")
        workers = await asyncio.wait_for(self.broker.admin("list"), 10)
        return _json_response({"object": "list", "data": workers})

    async def worker_action(self, request: web.Request) -> web.Response:
        """``POST /workers/{id}/drain|eject|reinstate`` (eject: optional JSON ``{"for_s": N}``).
        Without an API key these change the fleet only for loopback clients."""
        if not hasattr(self.broker, "admin"):
            return _err(404, "no admin API on this front door (use the broker's --http)", "not_found")
        if self._key is None and not _is_loopback(request.remote):
            self.broker.stats.requests[ErrorCode.UNAUTHORIZED.value] += 1
            return _err(403, "worker actions need --api-key (or a loopback client)", "unauthorized", "authentication_error")
        action = request.match_info["action"]
        if action not in ("drain", "eject", "reinstate"):
            return _err(404, f"unknown action {action!r}: drain, eject or reinstate", "not_found")
        for_s = None
        if request.can_read_body:
            try:
                body = json.loads(await request.read() or b"{}")
            except ValueError:
                return _err(400, "body: not JSON", ErrorCode.BAD_REQUEST.value)
            v = body.get("for_s") if isinstance(body, dict) else None
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    return _err(400, "for_s: must be a number of seconds", ErrorCode.BAD_REQUEST.value)
                for_s = float(v)
        try:
            entry = await asyncio.wait_for(self.broker.admin(action, request.match_info["worker_id"], for_s), 10)
        except KeyError:
            return _err(404, f"no worker {request.match_info['worker_id']!r} is registered", "not_found")
        except ValueError as exc:
            return _err(409, str(exc), "conflict")
        return _json_response(entry)

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(self.metrics_registry) if self.metrics_registry is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ request plumbing
    def _bad(self, exc: _BadRequest) -> web.Response:
        self.broker.stats.requests[ErrorCode.BAD_REQUEST.value] += 1
        resp = _err(400, str(exc), ErrorCode.BAD_REQUEST.value)
        if exc.close:
            resp.force_close()
        return resp

    def _too_large(self, message: str) -> web.Response:
        self.broker.stats.requests[ErrorCode.TOO_LARGE.value] += 1
        resp = _err(413, message, ErrorCode.TOO_LARGE.value)
        resp.force_close()  # the rest of the body is not worth reading
        return resp

    def _header_int(self, request: web.Request, name: str, lo: int, hi: int) -> int | None:
        raw = request.headers.get(name)
        if raw is None:
            return None
        raw = raw.strip()
        if not _INT_RE.fullmatch(raw) or not lo <= int(raw) <= hi:
            raise _BadRequest(f"{name} must be an integer in [{lo}, {hi}], got {raw[:40]!r}")
        return int(raw)

    def _slo(self, request: web.Request) -> dict[str, Any] | None:
        slo: dict[str, Any] = {}
        v = self._header_int(request, "x-sgl-ttft-slo-ms", 1, _MAX_DEADLINE_MS)
        if v is not None:
            slo["ttft_ms"] = v
        raw = request.headers.get("x-sgl-tps-slo")
        if raw is not None:
            try:
                f = float(raw)
            except ValueError:
                raise _BadRequest(f"x-sgl-tps-slo must be a positive number, got {raw[:40]!r}") from None
            if not math.isfinite(f) or f <= 0:
                raise _BadRequest("x-sgl-tps-slo must be a finite positive number")
            slo["tps"] = f
        return slo or None

    def _deadline_ms(self, request: web.Request) -> int | None:
        """The request's own deadline header (a bad value is a 400), or None."""
        return self._header_int(request, "x-mesh-deadline-ms", 1, _MAX_DEADLINE_MS)

    def _lifetime_ms(self, header_ms: int | None, stream: bool) -> int:
        """The header's deadline; else unstreamed requests live ``request_timeout_s`` and streams
        have no total bound (the protocol's 24 h), only ``stream_idle_timeout_s`` between outputs."""
        if header_ms is not None:
            return header_ms
        return _MAX_DEADLINE_MS if stream else int(self.request_timeout_s * 1000)

    async def _json(self, request: web.Request) -> dict:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise _TooLarge(f"request body of {request.content_length} bytes exceeds the limit of {MAX_BODY_BYTES}")
        try:
            async with asyncio.timeout(self.body_timeout_s):  # no Task per request (wait_for makes one)
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _TooLarge(f"request body exceeds the limit of {MAX_BODY_BYTES} bytes") from None
        except TimeoutError:
            self.broker.stats.dropped["http_body_timeout"] += 1
            raise _BadRequest(f"request body not received within {self.body_timeout_s:g} s", close=True) from None
        try:
            body = orjson.loads(raw)  # depth-limited (1024), strict UTF-8, 64-bit integers
        except orjson.JSONDecodeError:
            try:  # what orjson refuses but JSON allows (integers beyond 64 bits): the slow, exact parser
                body = json.loads(raw)
            except RecursionError:
                raise _BadRequest("request body is nested too deeply") from None
            except ValueError:  # JSONDecodeError, UnicodeDecodeError, ints over the digit limit
                raise _BadRequest("request body must be JSON") from None
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        return body

    async def _prompt(self, text: Any, ids: Any, tx=None) -> dict[str, Any]:
        if ids is not None:
            return {"input_ids": _token_ids(ids, "input_ids")}
        if not isinstance(text, str) or not text:
            raise _BadRequest("prompt must be a non-empty string or a list of token ids")
        if tx is not None:
            return {"input_ids": await self._tokenize(tx[1].encode, text)}
        return {"text": text}

    def _params(self, body: dict, *, chat: bool | None) -> dict[str, Any]:
        """Generation parameters (:mod:`mesh.params`): every field reaches the engine or is a 400
        that names it. ``chat`` None: SGLang's ``/generate``."""
        try:
            return from_generate(body) if chat is None else from_openai(body, chat=chat)
        except ParamError as exc:
            raise _BadRequest(str(exc)) from None

    async def _tokenize(self, fn, *args) -> list[int]:
        """Run a pool call; what the tokenizer or template refuses is a 400 naming why, a full pool
        a 429 (``overloaded``, retry later)."""
        from mesh.tokenization import TokenizerBusy

        try:
            out = await fn(*args)
        except TokenizerBusy as exc:
            self.broker.stats.dropped["tokenizer_busy"] += 1
            raise _Overloaded(str(exc)) from None
        except (ValueError, TypeError, UnicodeError) as exc:  # lone surrogates, template raise_exception, bad parts
            raise _BadRequest(f"prompt could not be tokenised: {exc}"[:400]) from None
        except Exception as exc:  # a template error (jinja2) is the request's, not the broker's
            if type(exc).__module__.startswith("jinja2"):
                raise _BadRequest(f"the chat template refused the messages: {exc}"[:400]) from None
            raise
        return out[1] if isinstance(out, tuple) else out

    async def _chat_input(self, msgs: Any, tx=None) -> dict[str, Any]:
        """Chat messages -> the prompt: rendered by the model's chat template and tokenised (off the
        loop) when the ingress has the model's tokenizer, else the plain-text fallback below."""
        if tx is None or tx[0].files.chat_template is None:
            return await self._prompt(self._chat_prompt(msgs), None, tx)
        if type(msgs) is not list or not msgs:
            raise _BadRequest("messages must be a non-empty list")
        if len(msgs) > _MAX_MESSAGES:
            raise _TooLarge(f"messages holds {len(msgs)} entries; the limit is {_MAX_MESSAGES}")
        return {"input_ids": await self._tokenize(tx[1].render_chat, msgs)}

    def _chat_prompt(self, msgs: Any) -> str:
        if type(msgs) is not list or not msgs:
            raise _BadRequest("messages must be a non-empty list")
        if len(msgs) > _MAX_MESSAGES:  # building a prompt from ~10^6 tiny messages stalls the broker loop
            raise _TooLarge(f"messages holds {len(msgs)} entries; the limit is {_MAX_MESSAGES}")
        parts = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise _BadRequest(f"messages[{i}] must be an object")
            role = m.get("role", "user")
            if not isinstance(role, str) or not role or len(role) > 64:
                raise _BadRequest(f"messages[{i}].role must be a non-empty string")
            content = m.get("content")
            if content is None:
                content = ""
            elif isinstance(content, list):  # content parts: only text parts are supported
                texts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise _BadRequest(f"messages[{i}].content[{j}] must be a text part ({{\"type\": \"text\", \"text\": ...}})")
                    texts.append(part["text"])
                content = "".join(texts)
            elif not isinstance(content, str):
                raise _BadRequest(f"messages[{i}].content must be a string or a list of text parts")
            parts.append(f"{role}: {content}\n")
        return "".join(parts) + "assistant:"

    @staticmethod
    def _detok(data: dict, tok=None) -> str:
        if "text" in data and isinstance(data["text"], str):
            return data["text"]
        ids = data.get("token_ids") or []
        if tok is not None:
            return tok.decode(ids)  # only for workers that send no text (simulated ones)
        return "".join(f" <{t}>" for t in ids)

    def _submit(self, prompt: dict[str, Any], *, stream: bool, slo, deadline_ms: int,
                params: dict[str, Any], model: str | None = None, tx=None) -> _Call:
        """Encode, check (size, and the broker's own decoder, so the broker never answers an
        unreadable rid) and submit; raises _BadRequest or _TooLarge."""
        raw = self._ids.next()
        ident = _LOCAL_PREFIX + raw[:16]  # always fresh and secret: replies are matched by identity and rid
        rid = _REQUEST_ID.get() or raw[16:].hex()
        tracing.annotate(request_id=rid, model=model)
        try:
            frames = P.encode_submit(rid, input_ids=prompt.get("input_ids"), text=prompt.get("text"),
                                     params=params, deadline_ms=deadline_ms, stream=stream, slo=slo, model=model,
                                     traceparent=tracing.current_traceparent())
        except (UnicodeEncodeError, ValueError, OverflowError, TypeError):  # lone surrogates in a string, ...
            raise _BadRequest("request holds text that is not valid Unicode") from None
        if len(frames[2]) > MAX_SUBMIT_BYTES:
            raise _TooLarge(f"the encoded request is {len(frames[2])} bytes; the limit is {MAX_SUBMIT_BYTES}")
        check = P.decode_client(frames)
        if isinstance(check, P.ProtocolError):
            raise _BadRequest(f"invalid request: {check.detail or check.reason}"[:300])
        q: asyncio.Queue = asyncio.Queue()
        # The broker takes the decoded SUBMIT as it is: decoding it twice (a 4 MiB prompt is a
        # full msgpack pass plus token validation) would cost the shared loop for nothing.
        self.broker.submit_local(ident, frames, q, quota_key=_QUOTA_KEY.get(), decoded=check)
        call = _Call(self.broker, ident, rid, q, deadline_ms / 1000.0 + 5.0)
        call.model = self._answer_model(model)
        call.tok = tx[0] if tx is not None else None
        return call

    async def _open_stream(self, request: web.Request, call: _Call):
        """Wait for the first output before sending headers: an error (or the deadline) that
        comes first keeps its HTTP status. Returns (error response, None, None) or
        (None, the prepared stream, the first message or None)."""
        m = await self._first_output(call)
        if m is None and not call.done and (call.expired or call.idle):
            return _err(504, self._timeout_message(call), ErrorCode.DEADLINE_EXCEEDED.value, "server_error"), None, None
        if isinstance(m, P.ClientError):
            return _mesh_err(m.code, m.message), None, None
        return None, await self._begin_stream(request, call), m

    async def _first_output(self, call: _Call):
        """For streams: the first reply worth committing HTTP headers for (a CHUNK or a terminal),
        or None when the request was accepted but produced nothing within _FIRST_OUTPUT_WAIT_S
        (or nothing came at all: ``call`` then has no terminal, see ``call.done``; ``call.idle``
        when that was for ``stream_idle_timeout_s``)."""
        idle_end = time.monotonic() + self.stream_idle_timeout_s
        until = idle_end
        while True:
            m = await call.next(until)
            if m is None:
                call.idle = not call.expired and time.monotonic() >= idle_end
                return None
            if not isinstance(m, P.Accepted):
                return m
            call.worker = m.worker
            until = min(idle_end, time.monotonic() + _FIRST_OUTPUT_WAIT_S)

    async def _next_output(self, call: _Call):
        """A stream's next reply, or None: the deadline passed (``call.expired``) or no output came
        for ``stream_idle_timeout_s`` (counted; the request is cancelled when the handler ends)."""
        m = await call.next(time.monotonic() + self.stream_idle_timeout_s)
        if m is None and not call.expired:
            call.idle = True
            self.broker.stats.dropped["http_stream_idle_timeout"] += 1
        return m

    def _timeout_message(self, call: _Call) -> str:
        return (f"no output for {self.stream_idle_timeout_s:g} s" if call.idle and not call.expired
                else "no reply before the deadline")

    async def _write(self, resp: web.StreamResponse, data: bytes) -> None:
        try:
            async with asyncio.timeout(self.body_timeout_s):  # no Task per write (wait_for makes one)
                await resp.write(data)
        except TimeoutError:  # a client that does not read holds a handler: drop it
            self.broker.stats.dropped["http_write_timeout"] += 1
            raise ConnectionResetError("client stopped reading") from None

    async def _sse(self, resp: web.StreamResponse, obj: dict) -> None:
        await self._write(resp, b"data: " + _dumps(obj) + b"\n\n")

    async def _begin_stream(self, request: web.Request, call: _Call) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **_mesh_headers(call, call.worker)})
        await resp.prepare(request)
        return resp

    # ------------------------------------------------------------------ OpenAI endpoints
    async def completions(self, request: web.Request):
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request):
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, *, chat: bool):
        try:
            slo = self._slo(request)
            deadline_ms = self._deadline_ms(request)
            body = await self._json(request)
            model = self._model_of(body)
            tx = self._text_for(model)
            if chat:
                prompt = await self._chat_input(body.get("messages"), tx)
            else:
                p = body.get("prompt")
                if type(p) is list and p and isinstance(p[0], str):
                    if len(p) != 1:
                        raise _BadRequest("prompt: batched prompts are not supported; send one request per prompt")
                    p = p[0]
                prompt = await (self._prompt(None, p, tx) if type(p) is list else self._prompt(p, None, tx))
            stream = _opt_bool(body, "stream")
            so = body.get("stream_options")
            if so is not None and not isinstance(so, dict):
                raise _BadRequest("stream_options must be an object")
            include_usage = _opt_bool(so or {}, "include_usage")
            params = self._params(body, chat=chat)
            call = self._submit(prompt, stream=stream, slo=slo, deadline_ms=self._lifetime_ms(deadline_ms, stream), params=params,
                                model=model, tx=tx)
        except _BadRequest as exc:
            return self._bad(exc)
        except _TooLarge as exc:
            return self._too_large(str(exc))
        except _Overloaded as exc:
            self.broker.stats.requests[ErrorCode.OVERLOADED.value] += 1
            return _mesh_err(ErrorCode.OVERLOADED.value, str(exc))
        try:
            return await self._openai_reply(request, call, chat=chat, stream=stream, include_usage=include_usage)
        finally:
            call.close()

    async def _openai_reply(self, request: web.Request, call: _Call, *, chat: bool, stream: bool, include_usage: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + call.rid  # the id the broker logs the request by
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not stream:
            while True:
                m = await call.next()
                if m is None:
                    return _err(504, "no reply before the deadline", ErrorCode.DEADLINE_EXCEEDED.value, "server_error")
                if isinstance(m, P.ClientError):
                    return _mesh_err(m.code, m.message)
                if isinstance(m, P.ClientFinal):
                    text = self._detok(m.data, call.tok)
                    lps = self._logprobs(m.data, chat, None, call.tok)
                    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                               "finish_reason": _finish(m.finish_reason)}
                              if chat else {"index": 0, "text": text, "finish_reason": _finish(m.finish_reason), "logprobs": lps})
                    return _json_response({"id": rid, "object": obj, "created": created, "model": call.model,
                                           "choices": [choice], "usage": _usage(m.usage)}, headers=_mesh_headers(call, m.worker))
        early, resp, m = await self._open_stream(request, call)
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
            lps = self._logprobs(data, chat, offset, call.tok)  # the chunk's own tokens (the adapter sends each its slice)
            if lps is not None:
                choice["logprobs"] = lps
            await self._sse(resp, {"id": rid, "object": chunk_obj, "created": created, "model": call.model, "choices": [choice]})

        while True:
            if m is None:
                m = await self._next_output(call)
                if m is None:
                    await self._sse(resp, {"error": {"message": self._timeout_message(call), "type": "server_error",
                                                     "code": ErrorCode.DEADLINE_EXCEEDED.value}})
                    break
            if isinstance(m, P.ClientChunk):
                await content(self._detok(m.data, call.tok), m.data)
            elif isinstance(m, P.ClientFinal):
                if m.data.get("token_ids") or m.data.get("text"):  # the engine's last delta
                    await content(self._detok(m.data, call.tok), m.data)
                choice = ({"index": 0, "delta": {}, "finish_reason": _finish(m.finish_reason)} if chat
                          else {"index": 0, "text": "", "finish_reason": _finish(m.finish_reason)})
                await self._sse(resp, {"id": rid, "object": chunk_obj, "created": created, "model": call.model, "choices": [choice]})
                if include_usage:
                    await self._sse(resp, {"id": rid, "object": chunk_obj, "created": created, "model": call.model, "choices": [],
                                           "usage": _usage(m.usage)})
                break
            elif isinstance(m, P.ClientError):
                etype = "invalid_request_error" if _status(m.code) < 500 else "server_error"
                await self._sse(resp, {"error": {"message": m.message, "type": etype, "code": m.code}})
                break
            m = None
        await self._write(resp, b"data: [DONE]\n\n")
        return resp

    @staticmethod
    def _logprobs(data: dict, chat: bool, offset: OL.TextOffset | None = None, tok=None) -> dict | None:
        """OpenAI logprobs from the engine's ``meta_info`` in a CHUNK or FINAL (None without any)."""
        meta = data.get("meta_info")
        if not OL.has_logprobs(meta):
            return None
        decode = tok.decode if tok is not None else None
        return OL.chat_logprobs(meta, decode=decode) if chat else OL.completion_logprobs(meta, decode=decode, offset=offset)

    # ------------------------------------------------------------------ SGLang /generate
    async def generate(self, request: web.Request):
        try:
            slo = self._slo(request)
            deadline_ms = self._deadline_ms(request)
            body = await self._json(request)
            text, ids = body.get("text"), body.get("input_ids")
            if text is not None and ids is not None:
                raise _BadRequest("give either text or input_ids, not both")
            model = self._model_of(body)  # a mesh extension: SGLang's /generate serves one model
            tx = self._text_for(model)
            prompt = await self._prompt(text, ids, tx)
            params = self._params(body, chat=None)
            stream = _opt_bool(body, "stream")
            user_rid = body.get("rid")
            if user_rid is not None and (not isinstance(user_rid, str) or not 0 < len(user_rid) <= P.MAX_RID_BYTES):
                raise _BadRequest(f"rid must be a string of 1..{P.MAX_RID_BYTES} characters")
            call = self._submit(prompt, stream=stream, slo=slo, deadline_ms=self._lifetime_ms(deadline_ms, stream), params=params,
                                model=model, tx=tx)
        except _BadRequest as exc:
            return self._bad(exc)
        except _TooLarge as exc:
            return self._too_large(str(exc))
        except _Overloaded as exc:
            self.broker.stats.requests[ErrorCode.OVERLOADED.value] += 1
            return _mesh_err(ErrorCode.OVERLOADED.value, str(exc))
        try:
            return await self._generate_reply(request, call, user_rid or call.rid, stream)
        finally:
            call.close()

    async def _generate_reply(self, request: web.Request, call: _Call, rid: str, stream: bool):
        """SGLang's own answer shapes. Behind an adapter the engine's ``meta_info`` comes through
        as the engine wrote it (``id`` set to the request's id); workers without one (simulated)
        get the same fields built from the FINAL."""
        if not stream:
            while True:
                m = await call.next()
                if m is None:
                    return _err(504, "no reply before the deadline", ErrorCode.DEADLINE_EXCEEDED.value, "server_error")
                if isinstance(m, P.ClientError):
                    return _mesh_err(m.code, m.message)
                if isinstance(m, P.ClientFinal):
                    return _json_response({"text": self._detok(m.data, call.tok), "output_ids": m.data.get("token_ids", []),
                                           "meta_info": _sgl_meta(m, rid)}, headers=_mesh_headers(call, m.worker))
        early, resp, m = await self._open_stream(request, call)
        if early is not None:
            return early
        ids: list[int] = []
        text = ""
        n_chunks = 0
        lists: dict[str, list] = {}  # logprob lists, cumulative like SGLang's (the adapter sends each event's new part)
        while True:
            if m is None:
                m = await self._next_output(call)
                if m is None:
                    await self._sse(resp, {"error": {"message": self._timeout_message(call), "type": "server_error",
                                                     "code": ErrorCode.DEADLINE_EXCEEDED.value, "retryable": False}})
                    break
            if isinstance(m, P.ClientChunk):  # SGLang streams cumulative text and ids
                ids.extend(m.data.get("token_ids") or [])
                text += self._detok(m.data, call.tok)
                n_chunks += 1
                meta = m.data.get("meta_info")
                meta = {**meta, "id": rid} if type(meta) is dict else {"id": rid, "finish_reason": None, "completion_tokens": len(ids)}
                await self._sse(resp, {"text": text, "output_ids": ids, "meta_info": _cumulative(meta, lists)})
            elif isinstance(m, P.ClientFinal):
                if m.data.get("token_ids") or m.data.get("text"):  # the engine's last event
                    ids.extend(m.data.get("token_ids") or [])
                    text += self._detok(m.data, call.tok)
                await self._sse(resp, {"text": text, "output_ids": ids, "meta_info": _cumulative(_sgl_meta(m, rid), lists)})
                break
            elif isinstance(m, P.ClientError):
                await self._sse(resp, {"error": {"message": m.message, "type": "invalid_request_error" if _status(m.code) < 500
                                                 else "server_error", "code": m.code, "retryable": False}})
                break
            m = None
        await self._write(resp, b"data: [DONE]\n\n")
        return resp


def _status(code: str) -> int:
    try:
        return ErrorCode(code).http_status
    except ValueError:
        return 500


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _usage(u: dict) -> dict:
    def n(k: str) -> int:
        v = u.get(k, 0)
        return v if type(v) is int else 0

    pt, ct = n("prompt_tokens"), n("completion_tokens")
    return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct,
            "prompt_tokens_details": {"cached_tokens": n("cached_tokens")}}


def _sgl_meta(m: P.ClientFinal, rid: str) -> dict:
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


def _cumulative(meta: dict, lists: dict[str, list]) -> dict:
    """A /generate stream event's meta_info with its logprob lists made cumulative (``lists``
    holds what earlier events carried), as SGLang streams them."""
    new = [k for k in OL.LOGPROB_KEYS if type(meta.get(k)) is list]
    if not new and not lists:
        return meta
    for k in new:
        lists.setdefault(k, []).extend(meta[k])
    return {**meta, **lists}  # serialised at once, before the next event extends them


def _mesh_headers(call: _Call, worker: str | None) -> dict[str, str]:
    """mesh's own metadata rides in headers, never in the engine's body fields."""
    h = {"x-mesh-request-id": call.rid, "x-request-id": call.rid}
    if worker:
        h["x-mesh-worker"] = _header_safe(worker)
    return h


def _header_safe(v: str) -> str:
    """A worker id as a header value: printable ASCII only (ids come from peers)."""
    v = v[:256]
    if v.isascii() and v.isprintable():
        return v
    return "".join(ch if " " <= ch <= "~" else "?" for ch in v)


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


def _is_loopback(host: str | None) -> bool:
    """True for a loopback peer address (None, a unix socket, counts as not loopback)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
