"""How mesh's long-running processes run their event loop: uvloop when it is installed.

uvloop (libuv) cuts the event loop's own cost per wake-up and per socket write, which on the
HTTP path is a large share of a request (measured with ``mesh bench http``). pyzmq's asyncio
sockets work on it unchanged (they register their FD with ``add_reader``). ``MESH_EVENT_LOOP=asyncio``
selects the standard loop (for debugging, or to compare side by side).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run", "loop_kind"]

T = TypeVar("T")


def loop_kind() -> str:
    """``"uvloop"`` or ``"asyncio"``: what :func:`run` will use."""
    if os.environ.get("MESH_EVENT_LOOP", "").lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` on the loop :func:`loop_kind` names."""
    if loop_kind() == "asyncio":
        return asyncio.run(coro)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)
