"""The seam between the HTTP ingress and "a broker": :class:`IngressBackend`.

Two implementations: :class:`brokers.broker.Broker` (``mesh broker --http``: requests enter the
broker loop through its mailbox) and :class:`brokers.gateway.BrokerPool` (``mesh gateway``: requests
go to remote brokers over the client protocol). The ingress knows nothing else of either.

A request is submitted already decoded (a :class:`mesh.protocol.Submit`, checked as the broker's
decoder checks a received one) under a fresh in-process client identity; its replies (the frames
a broker sends a client) land in the request's :data:`ReplySink`, which the backend finds by a
dict lookup (identity or rid), until the ingress calls :meth:`IngressBackend.forget`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, MutableMapping
from typing import Any, Protocol

from mesh import protocol as P

__all__ = ["AdminCall", "IngressBackend", "IngressCounters", "ReplySink"]

#: Where a request's replies land: the frames a broker sends a client, one list per message
#: (the ingress also queues its own deadline marker there).
ReplySink = asyncio.Queue


class AdminCall(Protocol):
    def __call__(self, action: str, worker_id: str = "", for_s: float | None = None) -> Awaitable[Any]:
        """``list`` (every worker's status) or ``drain`` / ``eject`` / ``reinstate`` one worker; the
        awaitable raises KeyError for an unknown worker, ValueError for an action its state refuses."""
        ...


class IngressCounters(Protocol):
    """The counters the ingress bumps (``requests`` by error code, ``dropped`` by what, ``text_unmatched``
    by model)."""

    @property
    def requests(self) -> MutableMapping[str, int]: ...

    @property
    def dropped(self) -> MutableMapping[str, int]: ...

    @property
    def text_unmatched(self) -> MutableMapping[str, int]:
        """Text requests sent without their model's tokenizer to engines that key by token ids, by model."""
        ...


class IngressBackend(Protocol):
    """What the HTTP ingress needs from a broker (local or remote)."""

    @property
    def stats(self) -> IngressCounters: ...

    @property
    def state(self) -> str:
        """``serving`` when requests can be routed (``/readyz``)."""
        ...

    @property
    def admin(self) -> AdminCall | None:
        """The operator's worker actions (``/workers``), or None without an admin API (the gateway)."""
        ...

    def submit(self, identity: bytes, sub: P.Submit, replies: ReplySink, *, quota_key: bytes | None = None) -> None:
        """Submit ``sub`` for the in-process client ``identity`` (a fresh, secret one per request);
        ``quota_key`` is who it counts against for ``max_inflight_per_client`` (the HTTP peer)."""
        ...

    def cancel(self, identity: bytes) -> None:
        """The client went away before its terminal reply: cancel its request."""
        ...

    def forget(self, identity: bytes) -> None:
        """The ingress reads no more replies for ``identity``: drop its sink."""
        ...

    def model_catalog(self) -> tuple[dict[str, int], dict[str, str], str]:
        """Served models (routable workers each), model aliases, and the fleet's name."""
        ...

    def lora_catalog(self) -> dict[str, dict]:
        """LoRA adapters the routable workers hold: name -> ``{"parent": base model, "workers": n}``."""

    def announced_tokenizers(self) -> dict[str, str]:
        """Model -> the tokenizer its engines announced in READY (a model id or a path); models whose
        engines announced none (simulated workers keyed by bytes, older adapters) are absent."""
        ...

    def routable_workers(self) -> int:
        """How many workers can take requests now (``/health``)."""
        ...

    def prompt_token_cap(self) -> int:
        """The most KV tokens any registered worker can hold (0 while none is known): the ingress
        refuses text that cannot fit it before tokenising."""
        ...
