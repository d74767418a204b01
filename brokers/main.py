"""Broker process entry point: settings -> router -> Broker, signals, metrics endpoint."""

from __future__ import annotations

import asyncio
import random

from brokers.broker import Broker
from brokers.stats import StatsCollector
from mesh.config import BrokerSettings
from mesh.errors import ConfigError
from mesh.routing.providers import make_provider
from mesh.logs import configure, get_logger
from mesh.routing.router import Router, make_policy

__all__ = ["build_broker", "serve_broker"]


def build_broker(settings: BrokerSettings, **kwargs) -> Broker:
    """Assemble a broker (router, policy, provider) from validated settings."""
    rng = random.Random(settings.seed)
    try:
        policy = make_policy(settings.policy, rng=rng, freshness_s=settings.load_freshness_s)
    except ValueError as exc:
        raise ConfigError(f"policy: {exc}") from None
    provider = None
    if settings.cache_prefix_provider == "indexer":
        from brokers.indexer_provider import RemoteIndexProvider
        from mesh.indexer.client import IndexerClient

        holder: dict[str, Broker] = {}
        client = IndexerClient(
            list(settings.kv_indexer_endpoint), query_timeout_ms=settings.kv_indexer_query_timeout_ms,
            max_inflight=settings.kv_indexer_query_max_inflight,
            on_resync=lambda wid, rank, why: holder["b"].post("resync", (wid, rank, why)) if "b" in holder else None,
        )
        provider = RemoteIndexProvider(client)
        broker = Broker(settings, Router(policy, provider), kv_sink=provider, **kwargs)
        provider.broker = broker
        holder["b"] = broker
        return broker
    if policy.needs_match:
        try:
            provider = make_provider(settings.cache_prefix_provider)
        except ValueError as exc:
            raise ConfigError(f"cache_prefix_provider: {exc}") from None
    return Broker(settings, Router(policy, provider), kv_sink=provider, **kwargs)


def _gauges(broker: Broker):
    def collect():
        out: dict[str, list] = {"mesh_worker_inflight": [], "mesh_worker_healthy": [], "mesh_broker_inflight": []}
        for sess in broker.registry.by_id.values():
            lab = {"worker_id": sess.worker_id}
            out["mesh_worker_inflight"].append((lab, float(sess.state.inflight)))
            out["mesh_worker_healthy"].append((lab, 1.0 if sess.state.healthy and not sess.draining else 0.0))
        out["mesh_broker_inflight"].append(({"broker_id": broker.broker_id}, float(len(broker._inflight))))
        return {k: v for k, v in out.items() if v}
    return collect


async def serve_broker(settings: BrokerSettings) -> None:
    """Run one broker until SIGTERM/SIGINT, then drain and exit."""
    configure(settings.log_level)
    broker = build_broker(settings)
    broker.bind()
    if settings.metrics:
        from prometheus_client import CollectorRegistry, start_http_server

        host, _, port = settings.metrics.rpartition(":")
        reg = CollectorRegistry()
        reg.register(StatsCollector(broker.stats, _gauges(broker)))
        start_http_server(int(port), addr=host or "127.0.0.1", registry=reg)
        get_logger(service="broker").info("metrics_listening", endpoint=settings.metrics)
    broker.install_signal_handlers()
    client = getattr(broker.router.provider, "client", None)
    if client is not None:
        await client.start()
    try:
        await broker.run()
    finally:
        if client is not None:
            await client.aclose()


def main(settings: BrokerSettings) -> None:
    asyncio.run(serve_broker(settings))
