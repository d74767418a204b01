"""Cache namespaces: which KV blocks a request may reuse.

An engine keeps blocks computed under a LoRA adapter, a ``cache_salt`` or an ``extra_key`` apart
from plain blocks with the same tokens; the router must too, or it counts another namespace's
blocks as hits. A namespace is a short string (None = the plain, shared namespace), made by
:func:`make_namespace` from its three parts, so the request side and the event side name the same
namespace the same way:

==============  =============================  ==============================================
part            request param (SGLang/OpenAI)  KV event field
==============  =============================  ==============================================
LoRA adapter    ``lora_path`` (adapter name)   ``lora_name`` (SGLang 0.5.22+, vLLM; vLLM also
                                               repeats it in each block's ``extra_keys``)
cache salt      ``cache_salt``                 ``cache_salt`` (SGLang 0.5.20+ maps; the 0.5.18
                                               array's metadata map; vLLM: the first block's
                                               ``extra_keys``)
extra key       ``extra_key``                  -- (SGLang publishes none: see below)
==============  =============================  ==============================================

How the index uses it: content keys are chained (key ``k`` identifies the whole prefix ``0..k``),
so a namespace only has to change the *root* of the chain. :func:`namespace_root_key` gives each
namespace a fixed 64-bit root (``ROOT_KEY`` = 0 for the plain namespace, so plain requests cost
nothing); a request's keys chain from its namespace's root, a root ``BlockStored`` is keyed from
the root of the namespace its event names, and every later store inherits its parent's chain.

Known limit: SGLang's events never carry a request's own ``extra_key``, so blocks an engine stores
under one look plain. A request with an ``extra_key`` is put in its own namespace anyway (the
engine will not reuse plain blocks for it); event-fed indexes then never report hits for it, only
this router's insert-on-route speculation does.

Pure functions; no I/O.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any

__all__ = [
    "ROOT_KEY",
    "make_namespace",
    "request_namespace",
    "request_event_fields",
    "event_namespace",
    "namespace_root_key",
    "event_root_key",
]

#: The plain namespace's root key (``mesh.hashing.ROOT_KEY``; a test checks they agree).
ROOT_KEY = 0
_PERSON = b"mesh-ns-v1"  # changing it changes every namespaced key (like CONTENT_KEY_SEED)


def _s(v: Any) -> str | None:
    return v if type(v) is str and v else None


def make_namespace(lora: str | None = None, extra_key: str | None = None, cache_salt: str | None = None) -> str | None:
    """The canonical namespace of an (adapter, extra key, salt) triple; None when all are unset.

    Length-prefixed parts, so no choice of strings makes two different triples collide.
    """
    lora, extra_key, cache_salt = _s(lora), _s(extra_key), _s(cache_salt)
    if lora is None and extra_key is None and cache_salt is None:
        return None
    return "\x1f".join(f"{tag}{len(v)}:{v}" for tag, v in (("l", lora), ("k", extra_key), ("s", cache_salt)) if v is not None)


def request_namespace(params: dict[str, Any]) -> str | None:
    """The namespace a request's params put it in (SGLang's ``lora_path``, ``extra_key``,
    ``cache_salt``); None when it has none."""
    if not params:
        return None
    return make_namespace(params.get("lora_path"), params.get("extra_key"), params.get("cache_salt"))


def request_event_fields(params: dict[str, Any] | None) -> tuple[str | None, str | None, str | None]:
    """``(lora_name, extra_key, cache_salt)`` an engine serving these params keys its cache by
    (the simulated engines; ``lora_name`` and ``cache_salt`` are what its events then carry)."""
    if not params:
        return None, None, None
    return _s(params.get("lora_path")), _s(params.get("extra_key")), _s(params.get("cache_salt"))


def event_namespace(lora_name: str | None, cache_salt: str | None) -> str | None:
    """The namespace a ``BlockStored``'s ``lora_name`` / ``cache_salt`` name."""
    return make_namespace(lora_name, None, cache_salt)


@lru_cache(maxsize=4096)
def _root_key(ns: str) -> int:
    k = int.from_bytes(hashlib.blake2b(ns.encode("utf-8", "surrogatepass"), digest_size=8, person=_PERSON).digest(), "little")
    return k or 1  # never the plain root


def namespace_root_key(ns: str | None) -> int:
    """The content key a namespace's chains start from: ROOT_KEY for None, else a fixed keyed
    64-bit hash of the namespace (never ROOT_KEY; equal on every host and process)."""
    return ROOT_KEY if ns is None else _root_key(ns)


def event_root_key(lora_name: str | None, cache_salt: str | None) -> int:
    """:func:`namespace_root_key` of :func:`event_namespace` (ROOT_KEY at no cost for plain events)."""
    if lora_name is None and cache_salt is None:
        return ROOT_KEY
    return namespace_root_key(event_namespace(lora_name, cache_salt))
