"""Engines attached in the broker process: ``mesh broker --attach KIND=URL``.

Each attached engine runs the adapter ``mesh attach`` runs (:class:`mesh.adapters.base.Adapter`:
discovery, health gating, LoadStat, the KV relay and the request proxy, all unchanged) on the
broker's own event loop and ZeroMQ context, its broker link connected to the backend ROUTER's
``inproc://`` endpoint (:attr:`brokers.broker.Broker.inproc_backend`) instead of TCP. A request
then crosses no second process and no TCP hop, and the adapter calls the engine over HTTP from
the broker's process. The broker treats these workers as any other (READY, heartbeats, liveness,
retries, KV events); they register at once (an inproc connection has no ZMTP handshake to wait
for, see :mod:`mesh.worker.link`).

Transport (``attach_transport``): ``memory`` (the default) skips ZeroMQ for the messages too:
:class:`MemoryLinks` is the broker's end of :mod:`mesh.worker.memory` (the broker's sends to an
attached worker go to its link's ``deliver``, the link's sends to :meth:`Broker.worker_batch`),
the inproc socket then only carries the broker's goodbye at shutdown. ``zmq`` keeps every
message on the inproc sockets. Memory measured 0.81x (c=1) and 0.88x (c=64) the broker's CPU per
request of inproc (median of 9 back-to-back pairs of ``mesh bench http --arms broker_attached`` on
a busy 2-core machine; 8 of 9 pairs below 1 at c=64).

Security: inproc has no CURVE handshake, and only this process can connect to it. With a worker
allow-list (``--curve-allow-workers``) every TCP worker authenticates with a listed key (its
``User-Id``); an inproc peer carries none, so the empty key is listed under the name
:data:`ATTACHED_KEY_NAME`: attached engines register as ``attached-...`` (their default ids),
remote workers are still refused without a listed key.

Shutdown: the broker drains first (its in-flight requests finish through the attached adapters),
then :meth:`AttachedEngines.stop` closes the adapters, before the context is terminated.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable
from urllib.parse import urlsplit

from mesh.adapters.cli import make_backend
from mesh.adapters.settings import AttachSettings
from mesh.config import BrokerSettings
from mesh.errors import ConfigError
from mesh.logs import announce, get_logger

__all__ = ["ATTACHED_KEY_NAME", "AttachedCollector", "AttachedEngines", "MemoryLinks", "attach_plans"]

#: The worker-key name of the empty key (an inproc peer's) under a CURVE worker allow-list.
ATTACHED_KEY_NAME = "attached"
_INT_OPTIONS = ("block_size", "dp_size")
_PLACEHOLDER = "inproc://mesh-backend"  # replaced by the broker's own inproc endpoint at start
_STOP_S = 5.0  # the adapters are closed (not drained: the broker drained first) within this


def attach_plans(settings: BrokerSettings) -> list[tuple[str, AttachSettings]]:
    """(kind, adapter settings) of every ``--attach``, checked now (ConfigError naming ``attach``
    and the engine): option values, and what the engine's backend needs (vLLM: kv_endpoint and
    block_size)."""
    out = []
    for kind, url, options in settings.attached_engines():
        u = urlsplit(url)
        opts: dict[str, object] = dict(options)
        try:
            for name in _INT_OPTIONS:
                if name in opts:
                    opts[name] = int(str(opts[name]))
        except ValueError:
            raise ConfigError(f"attach: {url[:200]}: {name} must be an integer, got {str(opts[name])[:40]!r}") from None
        opts.setdefault("worker_id", f"{ATTACHED_KEY_NAME}-{kind}-{u.hostname}-{u.port}")
        if settings.curve_allow_workers and not str(opts["worker_id"]).startswith(ATTACHED_KEY_NAME + "-"):
            raise ConfigError(f"attach: {url[:200]}: with --curve-allow-workers an attached engine's worker_id must start "
                              f"with {ATTACHED_KEY_NAME}- (the name of in-process links)")
        if kind == "vllm" and not ("kv_endpoint" in opts and "block_size" in opts):
            raise ConfigError(f"attach: {url[:200]}: vLLM has no HTTP discovery: give its events and block size, "
                              f"vllm={url[:200]},kv_endpoint=tcp://HOST:PORT,block_size=16")
        try:
            s = AttachSettings(url=url, brokers=(_PLACEHOLDER,), heartbeat_ms=min(500, settings.max_worker_heartbeat_ms),
                               drain_timeout_s=settings.drain_timeout_s, log_level=settings.log_level, **opts)  # type: ignore[arg-type]
            s.validate()
            make_backend(kind, s)  # the backend's own checks (vLLM discovers nothing: it needs its endpoints)
        except ConfigError as exc:
            raise ConfigError(f"attach: {url[:200]}: {exc}") from None
        out.append((kind, s))
    return out


class AttachedEngines:
    """The adapters of the ``--attach`` engines, run on the broker's loop (see the module docstring)."""

    def __init__(self, plans: list[tuple[str, AttachSettings]]) -> None:
        self.plans = plans
        self.adapters: list = []  # mesh.adapters.base.Adapter (imported at start: aiohttp only when used)
        self._tasks: list[asyncio.Task] = []
        self.log = get_logger(service="broker")

    def start(self, broker, *, transport: str = "memory") -> None:
        """Start every adapter on the running loop, linked to ``broker``'s inproc backend (bound:
        :meth:`brokers.broker.Broker.bind` with ``attach`` set). An engine that is not up yet is
        waited for as ``mesh attach`` waits (the broker serves the others meanwhile)."""
        from mesh.adapters.base import Adapter

        if not self.plans:
            return
        if not broker.inproc_backend:
            raise RuntimeError("AttachedEngines.start: the broker has no inproc backend (bind it with attach set)")
        if broker.worker_keys is not None:  # CURVE allow-list: an inproc peer has no key (see the docstring)
            broker.worker_keys.setdefault(b"", ATTACHED_KEY_NAME)
        memory = MemoryLinks(broker) if transport == "memory" else None
        for kind, s in self.plans:
            s = dataclasses.replace(s, brokers=(broker.inproc_backend,))
            ad = Adapter(s, make_backend(kind, s), ctx=broker.ctx, memory=memory)
            self.adapters.append(ad)
            task = asyncio.create_task(ad.run(), name=f"attached-{ad.worker_id}")
            task.add_done_callback(self._ended)
            self._tasks.append(task)
        announce("broker_attached_engines", engines=[{"worker_id": ad.worker_id, "url": ad.s.url, "kind": ad.backend.kind}
                                                     for ad in self.adapters], backend=broker.inproc_backend,
                 transport=transport)

    def _ended(self, task: asyncio.Task) -> None:
        """An adapter that ends while the broker serves is logged (its engine's requests go to the others)."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.log.error("attached_engine_failed", task=task.get_name(), error=repr(exc)[:500])

    async def stop(self) -> None:
        """Close every adapter (after the broker drained; idempotent), bounded by ``_STOP_S``."""
        for ad in self.adapters:
            ad.request_stop(force=True)
        tasks, self._tasks = self._tasks, []
        if not tasks:
            return
        _done, pending = await asyncio.wait(tasks, timeout=_STOP_S)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ad, t in zip(self.adapters, tasks):
            if t in pending:  # cut short: its sockets must still close before the context terminates
                await ad.close()


class MemoryLinks:
    """The broker's end of the in-memory links (:class:`mesh.worker.memory.MemoryPeer`): the
    broker's sends to a linked identity go to its ``deliver`` (``Broker.memory_links``), what the
    links send is handled by :meth:`brokers.broker.Broker.worker_batch`."""

    def __init__(self, broker) -> None:
        self.broker = broker

    def link(self, identity: bytes, deliver: Callable[[list[bytes]], bool]) -> None:
        self.broker.memory_links[identity] = deliver

    def unlink(self, identity: bytes) -> None:
        self.broker.memory_links.pop(identity, None)

    def frames(self, identity: bytes, batch: list[list[bytes]]) -> None:
        self.broker.worker_batch(identity, batch)


class AttachedCollector:
    """The attached adapters' own counters on the broker's ``/metrics`` (a ``mesh attach`` process
    only logs them): ``mesh_attached_adapter_total{worker_id, what}`` (requests, engine errors,
    relayed KV batches, health failures, ...) and ``mesh_attached_adapter_healthy{worker_id}``."""

    def __init__(self, attached: AttachedEngines) -> None:
        self.attached = attached

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = CounterMetricFamily("mesh_attached_adapter", "Counters of the adapters of engines attached in this broker",
                                labels=["worker_id", "what"])
        g = GaugeMetricFamily("mesh_attached_adapter_healthy", "1 while an attached engine answers its health checks",
                              labels=["worker_id"])
        for ad in list(self.attached.adapters):
            try:  # (read from the metrics thread: a counter added meanwhile skips this adapter this scrape)
                counts = sorted(ad.counters.items())
            except RuntimeError:
                continue
            for what, v in counts:
                c.add_metric([ad.worker_id, what], v)
            g.add_metric([ad.worker_id], 1.0 if ad.healthy else 0.0)
        yield c
        yield g
