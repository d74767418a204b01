"""Broker process entry point: settings -> router -> Broker, signals, metrics endpoint."""

from __future__ import annotations

import errno
import ipaddress
import random
import sys
from pathlib import Path

import zmq

from brokers.attached import AttachedCollector, AttachedEngines, attach_plans
from brokers.broker import Broker
from brokers.stats import RegretCollector, StatsCollector
from mesh import aio
from mesh.config import BrokerSettings, model_paths
from mesh.errors import ConfigError
from mesh.gc_tuning import bound_malloc_retention, freeze_startup_heap
from mesh.routing.providers import make_provider
from mesh.logs import announce, configure, get_logger
from mesh.routing.factory import make_router
from mesh.routing.regret import RegretAudit, audit_enabled
from mesh.routing.router import make_policy

__all__ = ["build_broker", "serve_broker"]


def build_broker(settings: BrokerSettings, **kwargs) -> Broker:
    """Assemble a broker (router, policy, provider) from validated settings."""
    if settings.curve_secret and "curve" not in kwargs:
        from mesh.security import server_keys

        kwargs["curve"] = server_keys(settings.curve_secret)
    if settings.curve_secret and settings.curve_allow_workers and "worker_keys" not in kwargs:
        from mesh.security import allowed_key_names

        kwargs["worker_keys"] = allowed_key_names(settings.curve_allow_workers)
    rng = random.Random(settings.seed)
    try:
        opts = {}
        if settings.policy == "cache_aware":
            opts = {"stall_escape_ms": settings.stall_escape_ms, "stall_queue_ms": settings.stall_queue_ms,
                    "tier_weights": (1.0, settings.tier_weight_host, settings.tier_weight_store),
                    "rank_ties": settings.rank_ties, "rank_window_prefills": settings.rank_window_prefills,
                    "rank_window_ms": settings.rank_window_ms or None,
                    "rank_reach": settings.rank_reach}
        policy = make_policy(settings.policy, rng=rng, freshness_s=settings.load_freshness_s, **opts)
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
            token_file=settings.kv_indexer_token_file or None, owner=settings.broker_id or None,
            on_resync=lambda wid, rank, why: holder["b"].post("resync", (wid, rank, why)) if "b" in holder else None,
        )
        provider = RemoteIndexProvider(client)
        broker = Broker(settings, _router(settings, policy, provider, rng), kv_sink=provider, **kwargs)
        provider.broker = broker
        holder["b"] = broker
        return broker
    if policy.needs_match:
        try:
            provider = make_provider(settings.cache_prefix_provider)
        except ValueError as exc:
            raise ConfigError(f"cache_prefix_provider: {exc}") from None
    return Broker(settings, _router(settings, policy, provider, rng), kv_sink=provider, **kwargs)


def _router(settings: BrokerSettings, policy, provider, rng):
    """Buckets or PD: the bucket router (admission, two passes); otherwise the plain Router
    (with ``--regret-audit on`` and cache_aware, auditing its decisions: mesh.routing.regret)."""
    from mesh.routing.buckets import load_bucket_config

    buckets = load_bucket_config(settings.bucket_config) if settings.bucket_config else None
    audit = None
    if audit_enabled(settings.regret_audit) and policy.name == "cache_aware":
        # its own RNG, never the policy's (--seed's decisions stay what they are with it off)
        audit = RegretAudit(random.Random(None if settings.seed is None else f"{settings.seed}:regret"))
    return make_router(policy, provider, buckets=buckets, pd=settings.pd, rng=rng, freshness_s=settings.load_freshness_s,
                       global_cache_winner=settings.global_cache_winner, decode_policy=settings.decode_policy,
                       session_affinity=settings.session_affinity, session_ttl_s=settings.session_ttl_s,
                       session_table_size=settings.session_table_size, session_peers=max(1, len(settings.peer)),
                       regret_audit=audit)


def _gauges(broker: Broker):
    def collect():
        import time as _t

        now = _t.monotonic()
        out: dict[str, list] = {k: [] for k in ("mesh_worker_inflight", "mesh_worker_healthy", "mesh_worker_running",
                                                "mesh_worker_waiting", "mesh_worker_kv_usage", "mesh_broker_inflight",
                                                "mesh_broker_retries_in_flight", "mesh_provider_stat")}
        for sess in broker.registry.by_id.values():
            lab = {"worker_id": sess.worker_id}
            st = sess.state
            out["mesh_worker_inflight"].append((lab, float(st.inflight)))
            out["mesh_worker_healthy"].append((lab, 1.0 if st.healthy and not sess.draining else 0.0))
            agg = st.fresh_load(now, broker.s.load_freshness_s)
            if agg is not None:
                out["mesh_worker_running"].append((lab, float(agg.running)))
                out["mesh_worker_waiting"].append((lab, float(agg.waiting)))
                out["mesh_worker_kv_usage"].append((lab, agg.kv_usage))
        out["mesh_broker_inflight"].append(({"broker_id": broker.broker_id}, float(broker.inflight_count)))
        out["mesh_broker_retries_in_flight"].append(({"broker_id": broker.broker_id}, float(broker.budget.active)))
        out.setdefault("mesh_broker_parked", []).append(({"broker_id": broker.broker_id}, float(broker.parked_count)))
        sessions = getattr(broker.router, "session_table", None)
        if sessions is not None:  # sessions pinned now (mesh.routing.sessions; bounded by --session-table-size)
            out.setdefault("mesh_sessions_pinned", []).append(({"broker_id": broker.broker_id}, float(len(sessions))))
        try:  # (read from the metrics thread: a queue that changes meanwhile is skipped this scrape)
            waiting = broker.core.parked.waiting()
        except RuntimeError:
            waiting = {}
        if waiting:
            out["mesh_tenant_parked"] = [({"tenant": t, "band": b}, float(n)) for (t, b), n in sorted(waiting.items())]
        if broker.exchange is not None:
            out["mesh_exchange_peers"] = [({"state": k}, float(v)) for k, v in broker.exchange.peer_counts().items()]
            out["mesh_exchange_degraded"] = [({"broker_id": broker.broker_id}, 1.0 if broker.exchange.degraded else 0.0)]
            for sess in broker.registry.by_id.values():
                if sess.state.peer_inflight:
                    out.setdefault("mesh_worker_peer_inflight", []).append(({"worker_id": sess.worker_id}, float(sess.state.peer_inflight)))
        cal = getattr(broker.router.policy, "calibrator", None)
        if cal is not None:  # cache_aware's online TTFT calibration (mesh.routing.calibration)
            snap = cal.snapshot()
            out["mesh_cost_model"] = [({"what": k}, float(v)) for k, v in snap.items()
                                      if isinstance(v, (int, float)) and not isinstance(v, bool)]
            out["mesh_cost_model"].append(({"what": "trusted"}, 1.0 if snap["trusted"] else 0.0))
            tiers = getattr(broker.router.policy, "tier_learner", None)  # tier weights (mesh.index.tiers)
            if tiers is not None:
                out["mesh_cost_model"] += [({"what": f"tier_{k}"}, float(v)) for k, v in tiers.snapshot().items()]
        prov = broker.router.provider
        if prov is not None and hasattr(prov, "stats"):
            pst = prov.stats()
            for k, v in _flatten(pst).items():
                out["mesh_provider_stat"].append(({"provider": prov.name, "stat": k}, float(v)))
            # the shared indexer: this broker's view of each replica (which one is not ready, and why)
            for rep in pst.get("replicas", ()) if isinstance(pst, dict) else ():
                ep = str(rep.get("endpoint", ""))
                rows = out.setdefault("mesh_indexer_replica", [])
                rows.append(({"endpoint": ep, "what": "ready"}, 1.0 if rep.get("ready") else 0.0))
                rows.append(({"endpoint": ep, "what": "breaker_open"}, 0.0 if rep.get("breaker") == "closed" else 1.0))
                for what in ("uncovered_streams", "queued", "dirty_streams", "rtt_ms"):
                    v = rep.get(what)
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        rows.append(({"endpoint": ep, "what": what}, float(v)))
        return {k: v for k, v in out.items() if v}
    return collect


def _flatten(d: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
    return out


def metrics_registry(broker: Broker):
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    reg.register(StatsCollector(broker.stats, _gauges(broker)))
    audit = getattr(broker.router, "audit", None)
    if audit is not None:  # cache_aware's counterfactual regret audit (--regret-audit)
        reg.register(RegretCollector(audit))
    return reg


async def serve_broker(settings: BrokerSettings) -> None:
    """Run one broker until SIGTERM/SIGINT, then drain and exit."""
    configure(settings.log_level)
    from mesh.tracing import configure_tracing

    configure_tracing(settings.trace_exporter, settings.trace_endpoint, service="mesh-broker")
    log = get_logger(service="broker")
    bound_malloc_retention()  # before the ZeroMQ context starts its I/O threads
    attached = AttachedEngines(attach_plans(settings))  # (option errors before anything binds)
    broker = build_broker(settings)
    api_key = _api_key(settings, log) if settings.http else None
    keys = _key_ring(settings, api_key)
    if keys is not None:
        _use_keys(settings, broker, keys)
    auth = None
    if broker.curve is not None:
        from zmq.auth.asyncio import AsyncioAuthenticator

        from mesh.security import allowed_key_names, configure_allow_lists, exchange_keys

        auth = AsyncioAuthenticator(broker.ctx)
        auth.start()
        for domain, allow in (("workers", settings.curve_allow_workers), ("clients", settings.curve_allow_clients)):
            if not allow:
                get_logger(service="broker").warning("curve_allow_any", domain=domain,
                                                     note="encrypted but any key may connect; set an allow-list")
        clients = settings.curve_allow_clients
        lists: dict[str, frozenset[bytes] | None] = {
            # the worker list was read by build_broker (it binds registrations to key names)
            "workers": frozenset(broker.worker_keys) if broker.worker_keys is not None else None,
            "clients": frozenset(allowed_key_names(clients, "curve_allow_clients")) if clients else None,
            # the peer exchange: only holders of the brokers' own key pair (see brokers.peer_exchange)
            "peers": frozenset(exchange_keys(broker.curve, "", settings.peer_curve_keys)[1] or [broker.curve.public_key]),
        }
        configure_allow_lists(auth, lists)
    elif settings.exchange.startswith("tcp://") and settings.peer:
        # plaintext exchange: only the --peer hosts may subscribe (brokers.peer_exchange)
        from zmq.auth.asyncio import AsyncioAuthenticator

        from brokers.peer_exchange import peer_addresses

        allowed = peer_addresses(settings.peer)
        if allowed is None:
            log.warning("exchange_allow_list_off", peers=list(settings.peer),
                        note="a --peer host does not resolve yet: any host may subscribe to the plaintext exchange")
        else:
            auth = AsyncioAuthenticator(broker.ctx)
            auth.start()
            auth.allow(*allowed)
            log.info("exchange_subscribers_allowed", addresses=allowed,
                     note="plaintext exchange: only these hosts (the --peer hosts) may subscribe; list each other")
    _bind_or_explain(broker.bind, settings, ("frontend", "backend", "telemetry", "exchange"))
    reg = metrics_registry(broker)
    if attached.plans:
        reg.register(AttachedCollector(attached))
    if settings.metrics:
        from prometheus_client import start_http_server

        # The Prometheus port has no authentication: an empty host binds loopback only; binding
        # anything else is the operator's explicit choice (and is logged).
        host, _, port = settings.metrics.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        server, _thread = _bind_or_explain(lambda: start_http_server(int(port), addr=host, registry=reg), settings, ("metrics",))
        bound = server.server_address
        if not _is_loopback(host):
            log.warning("metrics_public", host=host, note="the --metrics port has no authentication; prefer 127.0.0.1 "
                        "and scrape through a proxy, or use the HTTP ingress's /metrics (API key)")
        announce("metrics_listening", endpoint=f"http://{_hostport(bound[0], bound[1])}/metrics")
    broker.install_signal_handlers()
    client = getattr(broker.router.provider, "client", None)
    if client is not None:
        await client.start()
    ingress = None
    if settings.http:
        from brokers.ingress import HttpIngress

        host, _, port = settings.http.rpartition(":")
        ingress = HttpIngress(broker, model=settings.model_name, api_key=api_key, keys=keys,
                              tokenizers=model_paths(settings.tokenizer, "tokenizer"),
                              chat_templates=model_paths(settings.chat_template, "chat_template"),
                              metrics_registry=reg,
                              max_connections=settings.http_max_connections, header_timeout_s=settings.http_header_timeout_s,
                              max_connections_per_address=settings.http_max_connections_per_address,
                              max_body_bytes_per_address=settings.http_max_body_bytes_per_address,
                              trusted_proxies=settings.http_trusted_proxies,
                              idle_timeout_s=settings.http_idle_timeout_s, body_timeout_s=settings.http_body_timeout_s,
                              request_timeout_s=settings.http_request_timeout_s,
                              stream_idle_timeout_s=settings.http_stream_idle_timeout_s,
                              session_sources=settings.session_sources() if settings.session_affinity != "off" else ())
        _check_fd_budget(settings, log)
        try:
            url = await ingress.start(host.strip("[]") or "127.0.0.1", int(port))
        except OSError as exc:
            raise ConfigError(_bind_message("http", settings.http, exc)) from None
        announce("http_listening", url=url)
    if settings.keys_file:
        _reload_keys_on_sighup(settings, broker, ingress, api_key, log)
    attached.start(broker, transport=settings.attach_transport)
    freeze_startup_heap()
    try:
        await broker.run()
    finally:
        await attached.stop()  # after the broker's drain, before its context terminates
        if auth is not None:
            auth.stop()
        if ingress is not None:
            await ingress.stop()
        if client is not None:
            await client.aclose()
        broker.terminate()


def _bind_message(field: str, where: str, exc: Exception) -> str:
    """One line naming the flag and the fix, for a listening address that cannot be bound."""
    if getattr(exc, "errno", None) == errno.EADDRINUSE:
        return (f"{field}: {where} is already in use (another broker or program listens there): stop it or give "
                f"--{field.replace('_', '-')} another port (port 0 / * = any free port)")
    why = getattr(exc, "strerror", None) or str(exc)
    return f"{field}: cannot listen on {where}: {why}"


def _bind_or_explain(bind, settings: BrokerSettings, fields: tuple[str, ...]):
    """Run ``bind()``; a busy or unusable address becomes a ConfigError naming its flag (which one
    is read from the endpoint the error names)."""
    try:
        return bind()
    except (zmq.ZMQError, OSError) as exc:
        text = str(exc)
        named = [f for f in fields if getattr(settings, f, None) and str(getattr(settings, f)) in text]
        field = (named or list(fields))[0]
        raise ConfigError(_bind_message(field, str(getattr(settings, field, "") or text), exc)) from None


def _api_key(settings: BrokerSettings, log) -> str | None:
    """The HTTP ingress key: --api-key-file, else --api-key / MESH_API_KEY (the CLI folds the
    environment variable into api_key). A key given as a flag is visible to every local user in
    the process list, so that is logged."""
    if settings.api_key_file:
        key = Path(settings.api_key_file).read_text().strip()
        if not key:  # validated at startup; the file may have changed since
            raise ConfigError(f"api_key_file: {settings.api_key_file} is empty")
        return key
    if settings.api_key and any(a == "--api-key" or a.startswith("--api-key=") for a in sys.argv):
        log.warning("api_key_on_command_line", note="--api-key is visible in the process list; use --api-key-file or MESH_API_KEY")
    return settings.api_key or None


def _key_ring(settings: BrokerSettings, api_key: str | None):
    """The tenants and keys (--keys-file, --api-key, --admin-key-file; brokers.keys_file), or None."""
    from brokers.keys_file import load_key_ring, read_secret

    admin = read_secret(settings.admin_key_file, "admin_key_file") if settings.admin_key_file else None
    return load_key_ring(settings.keys_file, api_key, admin)


def _use_keys(settings: BrokerSettings, broker, keys) -> None:
    """The broker's tenants, and the tenants of ZeroMQ clients' CURVE keys (the keys file's curve_keys)."""
    by_key = None
    if keys.curve_names:
        if not settings.curve_allow_clients:
            raise ConfigError("keys_file: curve_keys needs --curve-allow-clients (the directory of the clients' keys)")
        from mesh.security import allowed_key_names

        by_key = keys.curve_tenants(allowed_key_names(settings.curve_allow_clients, "curve_allow_clients"))
    broker.core.intake.tenants, broker.client_tenants = keys, by_key


def _reload_keys_on_sighup(settings: BrokerSettings, broker, ingress, api_key: str | None, log) -> None:
    """SIGHUP reads the keys file again: a valid one replaces the tenants and keys at once (requests
    in flight keep their tenant); an invalid one is logged and the old keys stay."""
    import asyncio
    import signal

    def reload() -> None:
        try:
            ring = _key_ring(settings, api_key)
            _use_keys(settings, broker, ring)
        except ConfigError as exc:
            log.error("keys_reload_failed", error=str(exc))
            return
        if ingress is not None:
            ingress.keys = ring
        log.info("keys_reloaded", tenants=len(ring.tenants), keys=len(ring.digests))

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_fd_budget(settings: BrokerSettings, log) -> None:
    """The HTTP ingress may hold http_max_connections descriptors plus its listen backlog; warn when
    that leaves too few of the process's descriptors for the ZeroMQ sockets and the rest."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - non-POSIX
        return
    need = settings.http_max_connections + min(128, settings.http_max_connections) + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("http_fd_budget", rlimit_nofile=soft, http_max_connections=settings.http_max_connections,
                    note=f"raise the descriptor limit to at least {need} or lower --http-max-connections")


def main(settings: BrokerSettings) -> None:
    aio.run(serve_broker(settings))
