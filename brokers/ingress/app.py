"""The HTTP ingress (:mod:`.http1`, httptools on the running loop): routes, API key, lifecycle, and the
simple and admin endpoints.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (:mod:`.openai_api`), ``POST
/v1/responses``, ``/v1/embeddings``, ``/v1/rerank``, ``/v1/score`` (to the engine, :mod:`.passthrough`), ``POST
/generate`` (SGLang native, :mod:`.generate`), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` (200 when at least
one worker is routable; ``text_routing``: text requests sent without their model's tokenizer, with the
fix), ``GET /readyz``, ``GET /metrics`` (Prometheus; needs the API key when one is set, like every
path except the health probes), ``GET /workers`` and ``POST
/workers/{id}/drain|eject|reinstate`` (the admin API, on a broker only).

Keys (:mod:`brokers.keys_file`): with a keys file every key names a tenant, stamped on the request
(its priority band: the header ``x-mesh-priority``, clamped by the broker to the tenant's ceiling);
the admin API needs a key whose tenant has the admin right (403 for an inference key).

The ingress talks to "a broker" only through :class:`brokers.ingress.backend.IngressBackend`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import unquote

from brokers.ingress import web
from brokers.ingress.backend import IngressBackend
from mesh.proxies import CLIENT, TrustedProxies, parse_trusted_proxies
from brokers.ingress.generate import GenerateEndpoint
from brokers.ingress.guard import ConnGuard
from brokers.ingress.http1 import HttpConnection, Site
from brokers.ingress.openai_api import OpenAIEndpoints
from brokers.ingress.replies import ReplyStream, error_response, json_response, mesh_error_response
from brokers.ingress.submit import MAX_BODY_BYTES, PRIORITY, QUOTA_KEY, REQUEST_ID, REQUEST_ID_RE, TENANT, Submitter
from brokers.keys_file import load_key_ring
from mesh import protocol as P
from mesh import tracing
from mesh.errors import ErrorCode
from mesh.logs import get_logger
from mesh.tenants import KeyRing

__all__ = ["HttpIngress"]


def _no_admin() -> web.Response:
    return error_response(404, "no admin API on this front door (use the broker's --http)", "not_found")


async def _not_found(request: web.Request) -> web.Response:
    return error_response(404, "Not Found", "not_found")


async def _method_not_allowed(request: web.Request) -> web.Response:
    return error_response(405, "Method Not Allowed", "method_not_allowed")


class HttpIngress:
    """Serves HTTP on the running event loop; talks to its backend only through :class:`IngressBackend`."""

    def __init__(self, backend: IngressBackend, *, model: str = "mesh", api_key: str | None = None, tokenizer_path: str | None = None,
                 chat_template_path: str | None = None, tokenizers: dict[str | None, str] | None = None,
                 chat_templates: dict[str | None, str] | None = None, metrics_registry=None, max_connections: int = 512, header_timeout_s: float = 10.0,
                 idle_timeout_s: float = 60.0, body_timeout_s: float = 30.0, backlog: int = 128,
                 request_timeout_s: float = 1800.0, stream_idle_timeout_s: float = 300.0, max_connections_per_address: int = 0,
                 max_body_bytes_per_address: int = 0, session_sources: tuple[str, ...] | None = None,
                 keys: KeyRing | None = None, trusted_proxies: str = "") -> None:
        self.backend = backend
        self._key = api_key.encode() if api_key else None
        # who may call (brokers.keys_file): None, no authentication; the shell may swap it (SIGHUP)
        self.keys = keys if keys is not None else load_key_ring(api_key=api_key)
        self.metrics_registry = metrics_registry
        self.idle_timeout_s = idle_timeout_s
        self.backlog = max(1, min(backlog, max_connections))
        self.guard = ConnGuard(backend.stats, max_connections, header_timeout_s, max_connections_per_address, idle_timeout_s)
        self.proxies = TrustedProxies(parse_trusted_proxies(trusted_proxies))  # ValueError: the shell validated it
        self.body_budget = max_body_bytes_per_address  # 0: no bound (see _within_body_budget)
        self._body_bytes: dict[str, int] = {}  # peer address -> bytes of bodies of its running requests
        self.log = get_logger(service="http")
        self._server: asyncio.AbstractServer | None = None
        self._prefetch: asyncio.Task | None = None  # loads the tokenizers the engines announce
        self.endpoint = ""
        paths = dict(tokenizers or {})
        templates = dict(chat_templates or {})
        if tokenizer_path:
            paths[None] = tokenizer_path
        if chat_template_path:
            templates[None] = chat_template_path
        self.submitter = Submitter(backend, model=model, tokenizers=paths, chat_templates=templates, body_timeout_s=body_timeout_s,
                                   request_timeout_s=request_timeout_s,
                                   **({} if session_sources is None else {"session_sources": session_sources}))
        streams = ReplyStream(backend.stats, stream_idle_timeout_s=stream_idle_timeout_s, body_timeout_s=body_timeout_s)
        openai = OpenAIEndpoints(self.submitter, streams)
        generate = GenerateEndpoint(self.submitter, streams)
        get, post = ("GET", "HEAD"), ("POST",)
        # exact paths first (a dict lookup), then the two parameterised routes (_route)
        self.routes: dict[str, tuple[tuple[str, ...], Any]] = {
            "/v1/completions": (post, openai.completions),
            "/v1/chat/completions": (post, openai.chat_completions),
            "/generate": (post, generate.generate),
            "/v1/models": (get, self.models),
            "/v1/responses": (post, openai.passthrough.responses),
            "/v1/embeddings": (post, openai.passthrough.embeddings),
            "/v1/rerank": (post, openai.passthrough.rerank),
            "/v1/score": (post, openai.passthrough.score),
            "/health": (get, self.health),
            "/healthz": (get, self.health),
            "/readyz": (get, self.readyz),
            "/metrics": (get, self.metrics),
            "/workers": (get, self.workers),
        }

    @property
    def api_key(self) -> str | None:
        return self._key.decode() if self._key else None

    # ------------------------------------------------------------------ lifecycle
    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> str:
        """Listen on ``host:port`` (``reuse_port``: SO_REUSEPORT, for ``mesh gateway --processes``); returns the URL."""
        site = Site(self.guard, self._serve, self.backend.stats, MAX_BODY_BYTES)

        def factory() -> HttpConnection:
            return HttpConnection(site)

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(factory, host, port, backlog=self.backlog, reuse_address=True, reuse_port=reuse_port)
        self.guard.start()
        self._prefetch = asyncio.create_task(self.submitter.tokenizers.prefetch_loop(), name="http-tokenizer-prefetch")
        h, p = self._server.sockets[0].getsockname()[:2]
        self.endpoint = f"http://{h}:{p}"
        return self.endpoint

    async def stop(self) -> None:
        if self._prefetch is not None:
            self._prefetch.cancel()
            await asyncio.gather(self._prefetch, return_exceptions=True)
            self._prefetch = None
        if self._server is not None:
            self._server.close()
            self._server = None
        running = [c.task for c in self.guard.conns if isinstance(c, HttpConnection) and c.task is not None]
        self.guard.close_all()  # a closed connection cancels its handler (connection_lost), which cancels its request
        if running:
            await asyncio.wait(running, timeout=5.0)
        self.submitter.close()

    # ------------------------------------------------------------------ every request
    def _route(self, request: web.Request):
        """The handler of a request: an exact path, else ``/v1/models/{model_id}`` or
        ``/workers/{worker_id}/{action}`` (a parameter holds no ``/``), else the 404 or 405 answer."""
        route = self.routes.get(request.path)
        if route is None:
            raw = request.raw_path
            if raw.startswith("/v1/models/") and raw.count("/") == 3 and len(raw) > 11:
                route = (("GET", "HEAD"), self.model)
                request.match_info = {"model_id": unquote(raw[11:])}
            elif raw.startswith("/workers/") and raw.count("/") == 3:
                wid, _, action = raw[9:].partition("/")
                if wid and action:
                    route = (("POST",), self.worker_action)
                    request.match_info = {"worker_id": unquote(wid), "action": unquote(action)}
            if route is None:
                return _not_found
        return route[1] if request.method in route[0] else _method_not_allowed

    async def _serve(self, request: web.Request) -> web.Response | web.StreamResponse:
        """Every request: checks the API key (every path but the health probes), turns routing errors
        into OpenAI-style bodies and any unexpected exception into a logged 500 without details (no
        traceback reaches a client), and carries the caller's ``x-request-id`` (validated) into the
        request and back on every answer. One function, not a middleware chain: each layer costs every request."""
        xid = request.headers.get("x-request-id")
        if xid is not None and not REQUEST_ID_RE.fullmatch(xid):
            self.backend.stats.requests[ErrorCode.BAD_REQUEST.value] += 1
            return error_response(400, "x-request-id: 1..128 characters of A-Z a-z 0-9 . _ : @ + = -", ErrorCode.BAD_REQUEST.value)
        REQUEST_ID.set(xid)
        handler = self._route(request)
        client = self.proxies.client(request.remote, request.headers)
        CLIENT.set(client)
        QUOTA_KEY.set(b"\x00httpq:" + client.address.encode())
        if tracing.enabled() and request.method == "POST":
            with tracing.server_span(f"mesh {request.path}", request.headers,
                                     {"http.request.method": "POST", "url.path": request.path, "mesh.request_id": xid}):
                resp = await self._handle(request, handler)
                tracing.set_attributes({"http.response.status_code": resp.status})
        else:
            resp = await self._handle(request, handler)
        if xid is not None and not resp.prepared and "x-request-id" not in resp.headers:
            resp.headers["x-request-id"] = xid  # errors too: the caller's id comes back on every answer
        return resp

    async def _handle(self, request: web.Request, handler):
        try:
            keys = self.keys
            TENANT.set(None)  # (a kept-alive connection's handlers may share a context: set both every time)
            prio = request.headers.get("x-mesh-priority")
            PRIORITY.set(prio if prio in P.PRIORITIES else None)
            if keys is not None and request.path not in ("/health", "/healthz", "/readyz"):
                got = request.headers.get("Authorization", "")
                tenant = keys.lookup(got[7:]) if got[:7] == "Bearer " else None
                if tenant is None:
                    self.backend.stats.requests[ErrorCode.UNAUTHORIZED.value] += 1
                    return error_response(401, "missing or invalid API key", "unauthorized", "authentication_error")
                TENANT.set(tenant)
            if prio is not None and prio not in P.PRIORITIES:
                self.backend.stats.requests[ErrorCode.BAD_REQUEST.value] += 1
                return error_response(400, f"x-mesh-priority must be one of {', '.join(P.PRIORITIES)}",
                                      ErrorCode.BAD_REQUEST.value)
            if request.method != "POST" or not self.body_budget:
                return await handler(request)
            return await self._within_body_budget(request, handler)
        except asyncio.CancelledError:
            raise
        except web.BodyTooLarge:
            self.backend.stats.requests[ErrorCode.TOO_LARGE.value] += 1
            resp = error_response(413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes", ErrorCode.TOO_LARGE.value)
            resp.force_close()
            return resp
        except ConnectionError:  # the client went away or stopped reading (replies.py): counted, not a 500 with a traceback
            self.backend.stats.dropped["http_client_gone"] += 1
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=499)  # never written: the connection is closing
        except Exception as exc:
            self.backend.stats.dropped["http_handler_exception"] += 1
            self.log.exception("http_handler_failed", path=request.path, error=repr(exc))
            return error_response(500, "internal error", ErrorCode.INTERNAL.value, "server_error")

    async def _within_body_budget(self, request: web.Request, handler):
        """One peer address has at most ``body_budget`` bytes of request bodies in its running requests: past
        it a POST is refused (429) from its head, before its body is read, parsed or tokenised, and its
        connection closed (the unread body is not worth reading). Bounds the front-door work one client's
        flood of large prompts can take from the others."""
        peer = CLIENT.get().address
        n = request.content_length if request.content_length is not None else MAX_BODY_BYTES
        held = self._body_bytes.get(peer, 0)
        if held and held + n > self.body_budget:
            self.backend.stats.dropped["http_body_budget_refused"] += 1
            self.backend.stats.requests[ErrorCode.OVERLOADED.value] += 1
            resp = mesh_error_response(ErrorCode.OVERLOADED.value, f"this address has {held} bytes of request bodies in "
                                       f"flight (limit {self.body_budget}); retry when they are answered")
            resp.force_close()
            return resp
        self._body_bytes[peer] = held + n
        try:
            return await handler(request)
        finally:
            left = self._body_bytes[peer] - n
            if left:
                self._body_bytes[peer] = left
            else:
                del self._body_bytes[peer]

    # ------------------------------------------------------------------ simple endpoints
    async def models(self, request: web.Request) -> web.Response:
        """The models that have routable workers, their aliases, the fleet's name while it
        serves one model, and the LoRA adapters those workers hold (each is a name requests may
        use; ``BASE:ADAPTER`` works too)."""
        return json_response({"object": "list", "data": self._model_entries()})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: one entry of :meth:`models`, or 404 in OpenAI's shape."""
        mid = request.match_info["model_id"]
        for e in self._model_entries():
            if e["id"] == mid:
                return json_response(e)
        return json_response({"error": {"message": f"The model `{mid[:256]}` does not exist.", "type": "invalid_request_error",
                                         "param": None, "code": "model_not_found"}}, status=404)

    def _model_entries(self) -> list[dict]:
        served, aliases, fleet_name = self.backend.model_catalog()
        ids = sorted(served)
        ids += sorted(a for a, target in aliases.items() if target in served and a not in served)
        if len(served) == 1 and fleet_name not in ids:
            ids.append(fleet_name)
        data = [{"id": i, "object": "model", "created": 0, "owned_by": "mesh", "root": aliases.get(i, ids[0] if i == fleet_name else i)}
                for i in ids]
        # LoRA adapters as the engines list them: their own id, ``parent`` = the base model
        data += [{"id": a, "object": "model", "created": 0, "owned_by": "mesh", "root": a, "parent": e["parent"]}
                 for a, e in sorted(self.backend.lora_catalog().items()) if a not in served]
        return data

    async def health(self, request: web.Request) -> web.Response:
        n = self.backend.routable_workers()
        return json_response({"status": "ok" if n else "no_workers", "workers": n,
                                  "text_routing": self.submitter.tokenizers.health()}, status=200 if n else 503)

    async def readyz(self, request: web.Request) -> web.Response:
        ok = self.backend.state == "serving"
        return json_response({"ready": ok, "state": self.backend.state}, status=200 if ok else 503)

    # ------------------------------------------------------------------ admin API
    def _not_admin(self) -> web.Response | None:
        """403 when keys are required and the caller's is no admin key (admin is a right of its own)."""
        if self.keys is None:
            return None
        t = TENANT.get()
        if t is not None and t.admin:
            return None
        self.backend.stats.requests["forbidden"] += 1
        return error_response(403, "the admin API needs an admin key (--admin-key-file, or admin = true in the keys file)",
                              "forbidden", "permission_error")

    def _not_local(self) -> web.Response | None:
        """Without keys the admin API serves only clients on this host (loopback, through no proxy that
        is not a trusted one: mesh.proxies)."""
        if self.keys is not None or CLIENT.get().loopback:
            return None
        self.backend.stats.requests[ErrorCode.UNAUTHORIZED.value] += 1
        return error_response(403, "the admin API needs an API key (or a loopback client through no untrusted proxy)",
                              "unauthorized", "authentication_error")

    async def workers(self, request: web.Request) -> web.Response:
        """Every registered worker: its state (registered, routable, ejected, draining), load,
        in-flight requests and KV capacity (behind an admin key when keys are set)."""
        admin = self.backend.admin
        if admin is None:
            return _no_admin()
        if (refused := self._not_admin() or self._not_local()) is not None:
            return refused
        workers = await asyncio.wait_for(admin("list"), 10)
        return json_response({"object": "list", "data": workers})

    async def worker_action(self, request: web.Request) -> web.Response:
        """``POST /workers/{id}/drain|eject|reinstate`` (eject: optional JSON ``{"for_s": N}``).
        Without an API key these change the fleet only for loopback clients."""
        admin = self.backend.admin
        if admin is None:
            return _no_admin()
        if (refused := self._not_admin() or self._not_local()) is not None:
            return refused
        action = request.match_info["action"]
        if action not in ("drain", "eject", "reinstate", "admit"):
            return error_response(404, f"unknown action {action!r}: drain, eject, reinstate or admit", "not_found")
        for_s = None
        if request.can_read_body:
            try:
                body = json.loads(await request.read() or b"{}")
            except ValueError:
                return error_response(400, "body: not JSON", ErrorCode.BAD_REQUEST.value)
            v = body.get("for_s") if isinstance(body, dict) else None
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    return error_response(400, "for_s: must be a number of seconds", ErrorCode.BAD_REQUEST.value)
                for_s = float(v)
        try:
            entry = await asyncio.wait_for(admin(action, request.match_info["worker_id"], for_s), 10)
        except KeyError:
            return error_response(404, f"no worker {request.match_info['worker_id']!r} is registered", "not_found")
        except ValueError as exc:
            return error_response(409, str(exc), "conflict")
        return json_response(entry)

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(self.metrics_registry) if self.metrics_registry is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
