"""Cache namespaces: which KV blocks a request may reuse.

An engine keeps blocks computed under a LoRA adapter, a ``cache_salt`` or an ``extra_key`` apart
from plain blocks with the same tokens; the router must too, or it counts another namespace's
blocks as hits. A namespace is a short string (None = the plain, shared namespace).

Pure functions; no I/O.
"""

from __future__ import annotations

from typing import Any

__all__ = ["request_namespace"]


def request_namespace(params: dict[str, Any]) -> str | None:
    """The namespace a request's params put it in (SGLang's ``lora_path``, ``extra_key``,
    ``cache_salt``); None when it has none."""
    parts = [f"{k}={params[k]}" for k in ("lora_path", "extra_key", "cache_salt") if isinstance(params.get(k), str) and params[k]]
    return "\x1f".join(parts) if parts else None
