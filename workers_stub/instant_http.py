"""``mesh instant-engine``: an HTTP server that answers SGLang's API at once (the baseline of
``mesh bench http``).

It does no generation: the output of a request is its first ``max_new_tokens`` prompt ids (a text
prompt counts as its UTF-8 bytes), as :func:`workers_stub.instant.instant_answer` does for ZMQ
workers, so every microsecond a benchmark measures through it is spent in the router, the
adapters, the load generator and the kernel. To stay out of the way it is written on a raw
asyncio :class:`~asyncio.Protocol` with the ``httptools`` request parser (uvloop when
importable): no framework, no task per request, one ``write`` per response.

HTTP: 1.1 with keep-alive (and pipelining: answers go out in request order), 1.0 answered and
closed unless it asks for keep-alive. Request bodies must carry ``Content-Length``: a chunked
request body gets 411 and the connection is closed (so is one over ``MAX_BODY_BYTES``: 413);
unparseable HTTP gets 400 and a close. Streamed answers use chunked transfer encoding (HTTP/1.1)
or are close-delimited (HTTP/1.0). Nothing a client sends produces a traceback: every error is a
JSON body ``{"error": {"message", "type", "code"}}``.

Endpoints (SGLang's shapes, see ``workers_stub/sglang_server.py`` for the modelled server):

* ``POST /generate`` ``{"text" | "input_ids", "sampling_params": {"max_new_tokens"}, "stream",
  "rid"}``: ``{"text", "output_ids", "meta_info"}``; streamed as one SSE event per output token
  with cumulative ``text``/``output_ids`` (``finish_reason`` null until the last), then
  ``data: [DONE]``. Output ids >= 256 have no text (the stand-in tokenizer is byte-level).
* ``POST /v1/completions`` (minimal OpenAI: ``prompt`` str or ids, ``max_tokens``, ``stream``).
* ``GET /health``, ``/health_generate``, ``/ready``, ``/liveness``, ``/readiness``: 200.
* ``GET /server_info``, ``/get_server_info`` (no ``kv_events`` block: an attached adapter runs
  without cache events), ``/get_model_info``, ``/model_info``, ``/v1/models``,
  ``/v1/loads`` (``?include=...`` ignored), ``/get_load``.

The readiness line ``instant_engine_listening`` carries ``url``; on SIGTERM the server logs
``instant_engine_stopped`` with the number of requests per path (what a router probed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
import time
from typing import Any

import httptools
import orjson

__all__ = ["EngineApp", "serve", "add_instant_engine_parser", "main", "detok", "MAX_BODY_BYTES"]

MAX_BODY_BYTES = 8 << 20
PAGE_SIZE = 16
MAX_RUNNING_REQUESTS = 1024
MAX_TOTAL_NUM_TOKENS = 1 << 20
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
_MAX_PATHS = 64  # distinct paths counted (unknown ones included): bounded under a scan

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed", 411: b"Length Required",
            413: b"Payload Too Large", 500: b"Internal Server Error"}
_JSON = b"application/json"
_SERVER = b"Server: mesh-instant-engine\r\n"


class _HttpError(Exception):
    def __init__(self, status: int, message: str, typ: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.typ = typ


def _error_body(status: int, message: str, typ: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": typ, "code": status}})


def detok(ids: list[int]) -> str:
    """The stand-in detokenizer: ids 0..255 are UTF-8 bytes, others have no text. A trailing
    incomplete UTF-8 sequence gives no text yet, so the text of a prefix of ``ids`` is a prefix
    of the text of ``ids`` (cumulative streams only grow)."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "ignore")


def _int_field(d: dict, key: str, default: int) -> int:
    v = d.get(key)
    if v is None:
        return default
    if type(v) is not int or v < 0:
        raise _HttpError(400, f"{key} must be a non-negative integer")
    return v


def _prompt_ids(text: Any, ids: Any, what: str) -> list[int]:
    if text is not None and ids is not None:
        raise _HttpError(400, f"give either {what} or input_ids, not both")
    if ids is not None:
        if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
            raise _HttpError(400, "input_ids must be a list of non-negative integers (batches are not supported)")
        return ids
    if not isinstance(text, str):
        raise _HttpError(400, f"{what} must be a string (batches are not supported)")
    return list(text.encode())


class EngineApp:
    """The request handlers, independent of the transport: ``handle`` maps (method, path, body,
    HTTP/1.0?) to the bytes of a complete response."""

    def __init__(self, model: str, port: int = 0, host: str = "127.0.0.1") -> None:
        self.model = model
        self.host = host
        self.port = port
        self.startup_time = time.time()
        self.requests = 0
        self.paths: dict[str, int] = {}
        self._static: dict[bytes, bytes] = {}
        self.rebuild_static()

    def rebuild_static(self) -> None:
        """Pre-encode the answers that never change (called again once the port is known)."""
        m = self.model
        info = {
            "model_path": m, "served_model_name": m, "tokenizer_path": m, "host": self.host, "port": self.port,
            "page_size": PAGE_SIZE, "dp_size": 1, "tp_size": 1, "pp_size": 1, "enable_dp_attention": False,
            "max_running_requests": MAX_RUNNING_REQUESTS, "max_total_num_tokens": MAX_TOTAL_NUM_TOKENS,
            "max_req_input_len": MAX_TOTAL_NUM_TOKENS - 1, "chunked_prefill_size": 8192, "stream_interval": 1,
            "incremental_streaming_output": False, "kv_events_config": None, "load_publish_endpoint": "off",
            "skip_tokenizer_init": False, "disaggregation_mode": "null", "is_embedding": False,
            "startup_time": self.startup_time, "launch_command": "mesh instant-engine", "version": "instant",
            "internal_states": [{"dp_rank": 0, "max_total_num_tokens": MAX_TOTAL_NUM_TOKENS,
                                 "max_running_requests": MAX_RUNNING_REQUESTS, "last_gen_throughput": 0.0}],
        }
        model_info = {"model_path": m, "served_model_name": m, "tokenizer_path": m, "is_generation": True,
                      "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
                      "has_audio_understanding": False, "model_type": "instant", "architectures": ["InstantForCausalLM"],
                      "disaggregation_mode": "null"}
        models = {"object": "list", "data": [{"id": m, "object": "model", "created": int(self.startup_time), "owned_by": "sglang",
                                              "root": m, "max_model_len": MAX_TOTAL_NUM_TOKENS}]}
        load = {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0, "num_total_tokens": 0,
                "max_total_num_tokens": MAX_TOTAL_NUM_TOKENS, "max_running_requests": MAX_RUNNING_REQUESTS,
                "token_usage": 0.0, "gen_throughput": 0.0, "cache_hit_rate": 0.0, "num_waiting_uncached_tokens": 0,
                "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0}
        get_load = [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        j = orjson.dumps
        self._static = {
            b"/health": b"", b"/health_generate": b"", b"/ready": b"", b"/liveness": b"", b"/readiness": b"",
            b"/server_info": j(info), b"/get_server_info": j(info), b"/get_model_info": j(model_info),
            b"/model_info": j(model_info), b"/v1/models": j(models),
            b"/v1/loads": j({"timestamp": self.startup_time, "version": "instant", "dp_rank_count": 1, "loads": [load]}),
            b"/get_load": j(get_load),
        }

    def _count(self, path: bytes) -> None:
        key = path.decode("latin-1")
        n = self.paths.get(key)
        if n is not None:
            self.paths[key] = n + 1
        elif len(self.paths) < _MAX_PATHS:
            self.paths[key] = 1

    def handle(self, method: bytes, url: bytes, body: bytes, http10: bool, keep_alive: bool) -> tuple[bytes, bool]:
        """One complete response (status line, headers, body) for one request, and whether the
        connection must be closed after it (no keep-alive, or a close-delimited stream)."""
        self.requests += 1
        path = url.split(b"?", 1)[0]
        self._count(path)
        try:
            if method == b"POST":
                if path == b"/generate":
                    return self._generate(self._json(body), http10, keep_alive), not keep_alive or http10_stream(body, http10)
                if path == b"/v1/completions":
                    return self._completions(self._json(body), http10, keep_alive), not keep_alive or http10_stream(body, http10)
                if path in self._static:
                    raise _HttpError(405, f"method POST not allowed on {path.decode('latin-1')}", "method_not_allowed")
            elif method in (b"GET", b"HEAD"):
                static = self._static.get(path)
                if static is not None:
                    return response(200, static if method == b"GET" else b"", keep_alive, _JSON if static else b"text/plain",
                                    content_length=len(static)), not keep_alive
                if path in (b"/generate", b"/v1/completions"):
                    raise _HttpError(405, f"method {method.decode('latin-1')} not allowed on {path.decode('latin-1')}",
                                     "method_not_allowed")
            raise _HttpError(404, f"no such endpoint: {method.decode('latin-1')} {path.decode('latin-1')[:200]}", "not_found")
        except _HttpError as exc:
            return response(exc.status, _error_body(exc.status, str(exc), exc.typ), keep_alive), not keep_alive
        except Exception as exc:  # noqa: BLE001 - a bug must not cost the connection a traceback
            return response(500, _error_body(500, f"internal error: {type(exc).__name__}", "server_error"), keep_alive), not keep_alive

    @staticmethod
    def _json(body: bytes) -> dict:
        try:
            d = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise _HttpError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(d, dict):
            raise _HttpError(400, "the body must be a JSON object")
        return d

    # ----------------------------------------------------------------------------- /generate

    def _generate(self, d: dict, http10: bool, keep_alive: bool) -> bytes:
        prompt = _prompt_ids(d.get("text"), d.get("input_ids"), "text")
        sp = d.get("sampling_params")
        if sp is None:
            sp = {}
        if not isinstance(sp, dict):
            raise _HttpError(400, "sampling_params must be an object")
        n = _int_field(sp, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        rid = d.get("rid")
        if rid is None:
            rid = secrets.token_hex(16)
        elif not isinstance(rid, str):
            raise _HttpError(400, "rid must be a string (batches are not supported)")
        out = prompt[:n]
        finish = {"type": "length", "length": n} if len(prompt) >= n else {"type": "stop", "matched": None}
        if not d.get("stream"):
            meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt), "completion_tokens": len(out),
                    "cached_tokens": 0, "e2e_latency": 0.0}
            return response(200, orjson.dumps({"text": detok(out), "output_ids": out, "meta_info": meta}), keep_alive)
        events = []
        for k in range(1, len(out) + 1) if out else (0,):
            ids = out[:k]
            meta = {"id": rid, "finish_reason": finish if k == len(out) else None, "prompt_tokens": len(prompt),
                    "completion_tokens": k, "cached_tokens": 0, "e2e_latency": 0.0}
            events.append(b"data: " + orjson.dumps({"text": detok(ids), "output_ids": ids, "meta_info": meta}) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return stream_response(events, http10, keep_alive)

    # ----------------------------------------------------------------------------- /v1/completions

    def _completions(self, d: dict, http10: bool, keep_alive: bool) -> bytes:
        p = d.get("prompt")
        prompt = _prompt_ids(None, p, "prompt") if isinstance(p, list) else _prompt_ids(p, None, "prompt")
        n = _int_field(d, "max_tokens", 16)
        out = prompt[:n]
        finish = "length" if len(prompt) >= n else "stop"
        cid = "cmpl-" + secrets.token_hex(12)
        created = int(time.time())
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out), "total_tokens": len(prompt) + len(out)}
        base = {"id": cid, "object": "text_completion", "created": created, "model": self.model}
        if not d.get("stream"):
            choice = {"index": 0, "text": detok(out), "logprobs": None, "finish_reason": finish}
            return response(200, orjson.dumps({**base, "choices": [choice], "usage": usage}), keep_alive)
        events = []
        sent = ""
        for k in range(1, len(out) + 1) if out else (0,):
            text = detok(out[:k])
            last = k == len(out)
            choice = {"index": 0, "text": text[len(sent):], "logprobs": None, "finish_reason": finish if last else None}
            sent = text
            ev = {**base, "choices": [choice]}
            if last:
                ev["usage"] = usage
            events.append(b"data: " + orjson.dumps(ev) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return stream_response(events, http10, keep_alive)


def http10_stream(body: bytes, http10: bool) -> bool:
    """True when an HTTP/1.0 request asked for a stream (answered close-delimited). Called only
    after the body parsed as a JSON object."""
    return http10 and bool(orjson.loads(body).get("stream"))


def response(status: int, body: bytes, keep_alive: bool, ctype: bytes = _JSON, *, content_length: int | None = None) -> bytes:
    """A complete HTTP/1.1 response with a Content-Length body."""
    n = len(body) if content_length is None else content_length
    return b"".join((b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown")), _SERVER,
                     b"Content-Type: ", ctype, b"\r\nContent-Length: %d\r\n" % n,
                     b"" if keep_alive else b"Connection: close\r\n", b"\r\n", body))


def stream_response(events: list[bytes], http10: bool, keep_alive: bool) -> bytes:
    """A server-sent-event response: chunked (HTTP/1.1) or close-delimited (HTTP/1.0; the caller
    closes the connection after it, ``keep_alive`` is ignored)."""
    head = b"HTTP/1.1 200 OK\r\n" + _SERVER + b"Content-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    if http10:
        return b"".join((head, b"Connection: close\r\n\r\n", *events))
    parts = [head, b"Transfer-Encoding: chunked\r\n", b"" if keep_alive else b"Connection: close\r\n", b"\r\n"]
    for ev in events:
        parts += (b"%x\r\n" % len(ev), ev, b"\r\n")
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


class _Conn(asyncio.Protocol):
    """One HTTP connection: the parser's callbacks collect a request, ``on_message_complete``
    answers it synchronously (so pipelined requests are answered in order)."""

    __slots__ = ("app", "conns", "transport", "parser", "url", "body", "size", "chunked", "length", "expect", "closing")

    def __init__(self, app: EngineApp, conns: set) -> None:
        self.app = app
        self.conns = conns
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.size = 0
        self.chunked = False
        self.length = 0
        self.expect = False
        self.closing = False

    # ---------------------------------------------------------------- transport events

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.conns.add(self)

    def connection_lost(self, exc) -> None:
        self.conns.discard(self)
        self.closing = True
        self.transport = None

    def pause_writing(self) -> None:  # a client that sends without reading: stop reading from it too
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closing:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            if not self.closing:
                self._fail(400, f"malformed HTTP request: {exc}")

    def _fail(self, status: int, message: str) -> None:
        """Answer an error and close: the rest of the byte stream cannot be trusted."""
        if self.closing or self.transport is None:
            return
        self.closing = True
        self.transport.write(response(status, _error_body(status, message, "invalid_request_error"), False))
        self.transport.close()

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []
        self.size = 0
        self.chunked = False
        self.length = 0
        self.expect = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        n = len(name)
        if n == 14 and name.lower() == b"content-length":
            try:
                self.length = int(value)  # llhttp has checked it is digits (and unique)
            except ValueError:
                self.length = 0
        elif n == 17 and name.lower() == b"transfer-encoding":
            self.chunked = True
        elif n == 6 and name.lower() == b"expect" and value.lower() == b"100-continue":
            self.expect = True

    def on_headers_complete(self) -> None:
        if self.chunked:
            self._fail(411, "chunked request bodies are not supported: send the body with Content-Length")
            raise _Stop
        if self.length > MAX_BODY_BYTES:
            self._fail(413, f"request body over {MAX_BODY_BYTES} bytes")
            raise _Stop
        if self.expect and self.length and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.closing:
            return
        self.body.append(body)
        self.size += len(body)

    def on_message_complete(self) -> None:
        if self.closing or self.transport is None:
            return
        p = self.parser
        http10 = p.get_http_version() == "1.0"
        keep = p.should_keep_alive()
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        out, close = self.app.handle(p.get_method(), self.url, body, http10, keep)
        self.transport.write(out)
        if close:
            self.closing = True
            self.transport.close()


class _Stop(Exception):
    """Raised from a parser callback to stop parsing a connection that was just failed."""


async def serve(host: str = "127.0.0.1", port: int = 0, model: str = "instant", *, ready=None,
                stop: asyncio.Event | None = None) -> EngineApp:
    """Serve until ``stop`` is set (default: SIGTERM/SIGINT). ``ready(url, app)`` is called once
    listening (default: the ``instant_engine_listening`` line). Returns the app (its counters)."""
    from mesh.logs import announce

    loop = asyncio.get_running_loop()
    app = EngineApp(model, port, host)
    conns: set[_Conn] = set()
    server = await loop.create_server(lambda: _Conn(app, conns), host, port, backlog=1024, reuse_address=True)
    sock = server.sockets[0]
    bound_host, bound_port = sock.getsockname()[:2]
    app.port = bound_port
    app.rebuild_static()
    h = f"[{bound_host}]" if ":" in bound_host else bound_host
    url = f"http://{h}:{bound_port}"
    own_stop = stop is None
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if ready is None:
        announce("instant_engine_listening", url=url, host=bound_host, port=bound_port, model=model, pid=os.getpid(),
                 loop=type(loop).__module__.split(".")[0])
    else:
        ready(url, app)
    try:
        await stop.wait()
    finally:
        server.close()
        for c in list(conns):
            if c.transport is not None:
                c.transport.close()
        await server.wait_closed()
        if own_stop:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
    if ready is None:
        announce("instant_engine_stopped", requests=app.requests, paths=app.paths)
    return app


def add_instant_engine_parser(subparsers) -> argparse.ArgumentParser:
    from mesh.cli_run import port_number

    p = subparsers.add_parser(
        "instant-engine", help="an HTTP server answering SGLang's API at once (benchmark baseline, no GPU, no model)",
        description="Answer SGLang's /generate (and a minimal /v1/completions), /health, /server_info, /get_model_info, "
                    "/v1/models and /v1/loads at once: the output is the first max_new_tokens prompt ids. The readiness "
                    "line 'instant_engine_listening' names the URL.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=0, help="port (default 0 = any free port)")
    p.add_argument("--model", "--served-model-name", dest="model", default="instant", help="served model name")
    p.set_defaults(func=_cmd_instant_engine)
    return p


def _cmd_instant_engine(args) -> int:
    from mesh.gc_tuning import freeze_startup_heap

    freeze_startup_heap()
    from mesh import aio

    aio.run(serve(args.host, args.port, args.model))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m workers_stub.instant_http`` = ``mesh instant-engine``."""
    from mesh.cli_run import run_one

    return run_one("instant-engine", add_instant_engine_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
