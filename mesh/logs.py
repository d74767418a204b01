"""structlog setup: JSON lines (or ``--log-format console``) on stderr, stable snake_case event names, bound ids.

Use ``log = get_logger(service="broker")`` then ``log.info("worker_registered", worker_id=...)``.
:class:`RateLimiter` keeps floods (hostile input) to one line per key per interval; the matching
metric still counts every occurrence.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import structlog

__all__ = ["configure", "get_logger", "announce", "RateLimiter"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


LOG_FORMATS = ("json", "console")
_FORMAT_ENV = "MESH_LOG_FORMAT"


class _LogFormat(argparse.Action):
    """``--log-format``: recorded in the environment, so :func:`configure` (wherever a command
    calls it) and the processes a command starts (``mesh up``) all follow it."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        os.environ[_FORMAT_ENV] = values


def add_log_level_arg(parser, default: str | None = None) -> None:
    """The one ``--log-level`` / ``--log-format`` pair every mesh command shares."""
    parser.add_argument("--log-level", choices=list(_LEVELS), default=default,
                        help=f"log threshold (default {default or 'info'})")
    parser.add_argument("--log-format", choices=list(LOG_FORMATS), action=_LogFormat, default=None,
                        help=f"json lines (default) or console: readable key=value lines (default ${_FORMAT_ENV} or json; "
                             "readiness lines such as broker_listening stay JSON for supervisors)")


def configure(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog once per process, to stderr: JSON lines, or readable console lines when
    ``json`` is False (None: ``--log-format`` / ``$MESH_LOG_FORMAT``, default JSON)."""
    if json is None:
        fmt = os.environ.get(_FORMAT_ENV, "json")
        json = fmt != "console"
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def announce(event: str, **fields) -> None:
    """Emit a readiness/lifecycle JSON line whatever the log level (supervisors wait for these)."""
    import json

    rec = {"event": event, "level": "notice", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **fields}
    print(json.dumps(rec, default=str), file=sys.stderr, flush=True)


def get_logger(**bound):
    return structlog.get_logger().bind(**bound)


class RateLimiter:
    """Allow one event per key per ``interval_s`` (monotonic clock). Bounded key table."""

    def __init__(self, interval_s: float = 1.0, max_keys: int = 4096) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._last: dict[object, float] = {}

    def allow(self, key: object, now_s: float | None = None) -> bool:
        now = time.monotonic() if now_s is None else now_s
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            return False
        if len(self._last) >= self.max_keys:
            self._last.clear()  # crude but bounded: a flood of distinct keys just resets the table
        self._last[key] = now
        return True
