"""The adapter's engine HTTP client helpers: SSE and Prometheus parsing, and the error boundary.

The request path's connection pool is :mod:`mesh.adapters.engine_http`; the side API (discovery,
health, load) goes through aiohttp in :class:`mesh.adapters.backend.Backend`. Both leave through
:func:`engine_error`.

Errors: one boundary, :func:`engine_error`, turns what talking to the engine raised into the mesh
error tree (:mod:`mesh.errors`), naming the engine URL: the worker reports its code in the ERROR
frame of the request, discovery retries what is retryable, health and load polls count it.

=====================================================  ==============================
raised while talking to the engine                     becomes
=====================================================  ==============================
a non-200 answer (aiohttp.ClientResponseError too)     error_code_for_status(status)
(a request's: engine_refusal; a prompt that does not   context_length_exceeded
fit the engine's context)
TimeoutError (a per-call timeout: connect, health)     RetryableError(unavailable)
EngineConnectionError, aiohttp.ClientError, OSError    RetryableError(unavailable)
(refused, reset, truncated body)
a body that is not JSON, or JSON of the wrong shape    RetryableError(worker_error)
(ValueError, KeyError, TypeError)
anything else (a bug)                                  FatalRequestError(internal)
=====================================================  ==============================

The request's own deadline passing is ``deadline_exceeded`` (not retried: the time is gone).
"""

from __future__ import annotations

import re
from typing import AsyncIterator

import aiohttp
import orjson

from mesh.adapters.engine_http import EngineConnectionError
from mesh.errors import ErrorCode, FatalRequestError, MeshError, RequestError, RetryableError, error_for

__all__ = ["sse_events", "parse_prometheus", "error_code_for_status", "engine_refusal", "engine_error"]


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The ``data`` payloads of a server-sent-event stream, from body pieces of any size (an event
    may span pieces, a piece may hold many events; CRLF or LF line ends; multi-line data joined
    with LF, as the SSE spec says)."""
    buf = b""
    data: list[bytes] = []
    async for chunk in chunks:
        buf = buf + chunk if buf else chunk
        pos = 0
        while True:
            i = buf.find(b"\n", pos)
            if i < 0:
                break
            line = buf[pos:i]
            pos = i + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if data:
                    yield data[0] if len(data) == 1 else b"\n".join(data)
                    data = []
            elif line.startswith(b"data:"):
                v = line[5:]
                data.append(v[1:] if v.startswith(b" ") else v)
        buf = buf[pos:]
    if buf.startswith(b"data:"):
        v = buf[5:].rstrip(b"\r")
        data.append(v[1:] if v.startswith(b" ") else v)
    if data:
        yield b"\n".join(data)


_PROM_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_PROM_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line)
        if not m:
            continue
        try:
            v = float(m.group(4))
        except ValueError:
            continue
        labels = dict(_PROM_LABEL.findall(m.group(3) or ""))
        out.append((m.group(1), labels, v))
    return out


def error_code_for_status(status: int) -> ErrorCode:
    """HTTP status of an engine reply -> mesh error code (retryable or not)."""
    if status in (400, 404, 405, 413, 414, 415, 422):
        return ErrorCode.BAD_REQUEST  # the request itself is wrong: no other worker will accept it
    if status == 429:
        return ErrorCode.OVERLOADED
    if status == 503:
        return ErrorCode.UNAVAILABLE
    if status == 504 or status == 408:
        return ErrorCode.WORKER_ERROR
    return ErrorCode.WORKER_ERROR  # 401/403 (adapter misconfigured for this server), 500, 502, ...


# How engines say a prompt does not fit: SGLang ("The input (N tokens) is longer than the model's
# context length (M tokens)", "... exceeds max_req_input_len"), vLLM ("This model's maximum context
# length is M tokens. However, you requested N tokens"), mesh's stub ("exceeds the KV capacity").
_CONTEXT_LENGTH = re.compile(r"context length|context_length|max_req_input_len|max_model_len|exceeds the kv capacity|"
                             r"too long for the model|maximum context", re.IGNORECASE)


def engine_refusal(status: int, body: bytes, where: str) -> tuple[ErrorCode, str]:
    """A non-200 answer of the request path -> (code, message). The message is the engine's own
    (``error.message``, ``message`` or ``detail`` of its JSON body, not the JSON escaped), and a
    prompt the engine cannot fit is ``context_length_exceeded`` whatever status carried it."""
    text = body[:4096].decode("utf-8", "replace")
    msg = text
    try:
        obj = orjson.loads(body) if body[:1] in (b"{", b"[") else None
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        inner = obj.get("error") if isinstance(obj.get("error"), dict) else obj
        found = inner.get("message") or inner.get("detail") or obj.get("error")
        if isinstance(found, str) and found:
            msg = found
    code = error_code_for_status(status)
    if status in (400, 413, 422) and _CONTEXT_LENGTH.search(msg):
        code = ErrorCode.CONTEXT_LENGTH_EXCEEDED
    return code, f"{msg.strip()[:400]} (HTTP {status} from {where})"


def engine_error(exc: BaseException, where: str) -> MeshError:
    """The adapter's one error boundary: what talking to the engine at ``where`` (its URL and
    path) raised, as a :mod:`mesh.errors` exception (table in the module docstring) whose message
    names ``where``. A :class:`~mesh.errors.MeshError` is returned as it is; the original is the
    ``__cause__``."""
    if isinstance(exc, MeshError):
        return exc
    err: RequestError
    if isinstance(exc, aiohttp.ContentTypeError):  # a ClientResponseError, but about the body
        err = RetryableError(ErrorCode.WORKER_ERROR, f"{where}: the engine's answer is not JSON")
    elif isinstance(exc, aiohttp.ClientResponseError):
        err = error_for(error_code_for_status(exc.status), f"{where}: HTTP {exc.status} {exc.message}"[:512])
    elif isinstance(exc, TimeoutError):  # asyncio's and aiohttp's timeouts (an OSError: first)
        err = RetryableError(ErrorCode.UNAVAILABLE, f"{where}: the engine did not answer in time")
    elif isinstance(exc, (EngineConnectionError, aiohttp.ClientError, OSError)):
        err = RetryableError(ErrorCode.UNAVAILABLE, f"{where}: engine connection failed: {type(exc).__name__}: {exc}"[:512])
    elif isinstance(exc, ValueError):  # json.JSONDecodeError, orjson.JSONDecodeError
        err = RetryableError(ErrorCode.WORKER_ERROR, f"{where}: the engine's answer is not valid: {exc}"[:512])
    elif isinstance(exc, (KeyError, TypeError)):
        err = RetryableError(ErrorCode.WORKER_ERROR, f"{where}: the engine's answer has an unexpected shape: {exc!r}"[:512])
    else:
        err = FatalRequestError(ErrorCode.INTERNAL, f"{where}: {exc!r}"[:512])
    err.__cause__ = exc
    return err
