"""The mesh error taxonomy: one small tree, mapped from low-level errors in one place.

::

    MeshError
    ├── ProtocolError          a frame or body failed validation (fatal for that message)
    ├── ConfigError            a config file or flag is invalid (fatal at startup; names the field)
    ├── ClientStateError       a client used before open or after close (also a RuntimeError)
    ├── CheckpointError        a shared indexer checkpoint this version cannot read (another version's)
    └── RequestError           a request ended in an error reply; carries an ErrorCode
        ├── RetryableError     worker_lost, unavailable, overloaded, worker_error: another try may succeed
        │   └── IngressOverloaded   overloaded: the HTTP front door's tokenizer pool is full (429)
        └── FatalRequestError  bad_request, deadline_exceeded, duplicate, cancelled, no_worker, internal,
            │                  context_length_exceeded, too_large, rate_limited, model_not_found
            ├── AuthError      unauthorized: credentials missing or wrong, or a call not allowed to them
            ├── IngressBadRequest   bad_request: a header, body or field the HTTP front door refuses (400)
            └── IngressTooLarge     too_large: a body, message list or encoded SUBMIT over its limits (413)

Callers decide retry versus fail from the type alone (``RetryableError``), or from
``ErrorCode.retryable`` when they hold a code from the wire. Every client maps the errors of its
transport into this tree at one boundary, so no ``zmq``, ``grpc`` or ``aiohttp`` error reaches its
caller:

* ``mesh.client`` (its send boundary): ZeroMQ and OS send errors -> ``unavailable``;
* ``mesh.indexer.client.indexer_error``: gRPC statuses, OS errors and timeouts of the indexer RPCs;
* ``brokers.ingress``: the HTTP front door raises the three ``Ingress*`` errors while it turns a
  request into a SUBMIT and answers each with its status and an OpenAI-style body;
* ``mesh.adapters.engine_client.engine_error``: HTTP client errors, timeouts, bad JSON and OS errors of the
  engine an adapter fronts (the code the worker then reports in its ERROR frame).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "ErrorCode",
    "MeshError",
    "ProtocolError",
    "ConfigError",
    "ClientStateError",
    "CheckpointError",
    "RequestError",
    "RetryableError",
    "FatalRequestError",
    "AuthError",
    "IngressBadRequest",
    "IngressTooLarge",
    "IngressOverloaded",
    "error_for",
]


class ErrorCode(StrEnum):
    """Stable error codes carried in ERROR frames and HTTP bodies. Never rename a value."""

    BAD_REQUEST = "bad_request"
    OVERLOADED = "overloaded"
    NO_WORKER = "no_worker"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    WORKER_LOST = "worker_lost"
    WORKER_ERROR = "worker_error"
    UNAVAILABLE = "unavailable"
    DUPLICATE = "duplicate"
    CANCELLED = "cancelled"
    UNAUTHORIZED = "unauthorized"
    INTERNAL = "internal"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt exceeds every worker's capacity
    TOO_LARGE = "too_large"  # a body or frame above the mesh's size limits
    RATE_LIMITED = "rate_limited"  # a per-client quota (in-flight requests) was reached
    MODEL_NOT_FOUND = "model_not_found"  # no worker serves the model asked for (and no alias names one)

    @property
    def retryable(self) -> bool:
        """True when the request was not processed and another attempt may succeed."""
        return self in _RETRYABLE

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]


_RETRYABLE = frozenset(
    {ErrorCode.WORKER_LOST, ErrorCode.UNAVAILABLE, ErrorCode.OVERLOADED, ErrorCode.WORKER_ERROR}
)

_HTTP_STATUS = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.DUPLICATE: 409,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500,
    ErrorCode.WORKER_ERROR: 502,
    ErrorCode.WORKER_LOST: 502,
    ErrorCode.NO_WORKER: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
}


class MeshError(Exception):
    """Root of every error mesh raises on purpose."""


class ProtocolError(MeshError):
    """A frame or message body failed validation.

    ``reason`` is a short stable snake_case label used as the ``frame_rejected`` metric label.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class ClientStateError(MeshError, RuntimeError):
    """A client used outside its life (not opened yet, or closed): a programming error, raised
    at once. (Also a RuntimeError, which it was before the error tree covered it.)"""


class CheckpointError(MeshError):
    """A shared indexer checkpoint written by another version (or damaged past its signature):
    the replica starts from an empty index and replays what the log still holds."""


class ConfigError(MeshError):
    """An invalid configuration value. The message names the offending field."""


class RequestError(MeshError):
    """A request ended with an error reply."""

    def __init__(self, code: ErrorCode, message: str = "", request_id: str | None = None) -> None:
        super().__init__(f"{code.value}: {message}" if message else code.value)
        self.code = code
        self.message = message
        self.request_id = request_id


class RetryableError(RequestError):
    """The request was not processed; another attempt (elsewhere) may succeed."""


class FatalRequestError(RequestError):
    """Retrying the same request will not help."""


class AuthError(FatalRequestError):
    """``unauthorized``: the caller's credentials are missing or wrong (a bearer token, a CURVE
    key), or they do not allow this call (another owner's worker). A configuration problem:
    never retried, and worth an operator's attention rather than a retry loop."""


class IngressBadRequest(FatalRequestError):
    """``bad_request`` from the HTTP front door (``message`` names the header or field). ``close``:
    the connection is not worth keeping (an unread or half-read body)."""

    def __init__(self, message: str, *, close: bool = False) -> None:
        super().__init__(ErrorCode.BAD_REQUEST, message)
        self.close = close


class IngressTooLarge(FatalRequestError):
    """``too_large`` from the HTTP front door: a body, a message list or the encoded SUBMIT."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.TOO_LARGE, message)


class IngressContextTooLong(FatalRequestError):
    """``context_length_exceeded`` from the HTTP front door, before any tokenising: the text has more
    characters than the largest context times the longest token of the model's vocabulary."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.CONTEXT_LENGTH_EXCEEDED, message)


class IngressOverloaded(RetryableError):
    """``overloaded`` from the HTTP front door: its tokenizer pool is full (retry later)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.OVERLOADED, message)


def error_for(code: ErrorCode | str, message: str = "", request_id: str | None = None) -> RequestError:
    """Build the right exception class for a wire error code (unknown codes become INTERNAL)."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        ec, message = ErrorCode.INTERNAL, f"unknown error code {code!r}: {message}"
    if ec is ErrorCode.UNAUTHORIZED:
        return AuthError(ec, message, request_id)
    cls = RetryableError if ec.retryable else FatalRequestError
    return cls(ec, message, request_id)
