"""``mesh attach`` settings (:class:`AttachSettings`), apart from the adapter itself.

Kept in a module of its own that imports nothing heavy: ``mesh``'s argument parser needs the
dataclass to build the ``attach`` flags, and every mesh process (broker, worker, indexer) builds
that parser at startup, so importing :mod:`mesh.adapters.base` (aiohttp, the engine client) here
cost every one of them about 0.2 s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from mesh import protocol as P
from mesh.discovery import MAX_FOLLOWED, check_endpoint
from mesh.errors import ConfigError

__all__ = ["AttachSettings"]


@dataclass(frozen=True)
class AttachSettings:
    """``mesh attach`` settings. Engine fields left None come from discovery (SGLang /server_info)."""

    url: str
    brokers: tuple[str, ...]
    worker_id: str = ""
    model: str = ""
    role: str = "mixed"
    labels: dict[str, str] = field(default_factory=dict)
    kv_endpoint: str | None = None
    replay_endpoint: str | None = None
    load_endpoint: str | None = None
    block_size: int | None = None
    dp_size: int | None = None
    topic: str | None = None
    max_running_requests: int | None = None
    max_total_num_tokens: int | None = None
    incremental_streaming: bool | None = None
    bootstrap_host: str | None = None  # PD prefill servers: host of the KV bootstrap server (default: --url host)
    bootstrap_port: int = 8998  # SGLang --disaggregation-bootstrap-port
    bootstrap_timeout_s: float = 30.0  # PD prefill leg: its engine request (prefill + KV handoff) must end by then
    heartbeat_ms: int = 500
    liveness: int = 3
    reconnect_base_ms: float = 100.0
    reconnect_cap_ms: float = 5000.0
    health_path: str | None = None
    health_interval_ms: int = 1000
    health_timeout_ms: int = 5000
    unhealthy_after: int = 2
    load_poll_ms: int = 1000
    load_stale_ms: int = 3000
    lora_refresh_ms: int = 5000  # re-read the engine's LoRA adapters (/v1/models) this often; 0 = only at registration
    replay_timeout_ms: int = 2000
    discovery_timeout_s: float = 0.0  # 0 = keep trying
    max_batch_tokens: int = 131_072
    kv_events_to: str = "all"
    drain_timeout_s: float = 10.0
    log_level: str = "info"
    trace_exporter: str = "none"
    trace_endpoint: str = ""

    def validate(self) -> None:
        u = urlsplit(self.url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"url: expected http://HOST:PORT, got {self.url!r}")
        if not self.brokers:
            raise ConfigError("brokers: at least one --broker endpoint is required")
        for b in self.brokers:
            check_endpoint(b, "brokers")  # a ZeroMQ endpoint, or dns+tcp://NAME:PORT (mesh.discovery)
        if len(set(self.brokers)) > MAX_FOLLOWED:  # each is a link (3 sockets): bounded like a DNS answer
            raise ConfigError(f"brokers: at most {MAX_FOLLOWED} distinct --broker endpoints, got {len(set(self.brokers))}")
        if self.role not in P.ROLES:
            raise ConfigError(f"role: must be one of {P.ROLES}")
        for name in ("kv_endpoint", "replay_endpoint", "load_endpoint"):
            v = getattr(self, name)
            if v is not None and not v.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"{name}: {v!r} must be a tcp://, ipc:// or inproc:// endpoint")
        for name in ("block_size", "dp_size", "max_running_requests", "max_total_num_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name}: must be >= 1")
        for name in ("heartbeat_ms", "liveness", "health_interval_ms", "health_timeout_ms", "unhealthy_after", "load_poll_ms",
                     "load_stale_ms", "replay_timeout_ms", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1")
        if self.lora_refresh_ms < 0:
            raise ConfigError("lora_refresh_ms: must be >= 0 (0 = read the adapters only at registration)")
        if not (0 < self.bootstrap_timeout_s <= 3600):  # (NaN fails too)
            raise ConfigError(f"bootstrap_timeout_s: must be in (0, 3600] seconds, got {self.bootstrap_timeout_s!r}")
        if self.kv_events_to not in ("all", "one"):
            raise ConfigError("kv_events_to: must be all or one")
        if self.health_path is not None and not self.health_path.startswith("/"):
            raise ConfigError("health_path: must start with /")
        if self.trace_exporter not in ("none", "console", "otlp"):
            raise ConfigError("trace_exporter: must be none|console|otlp")

    @property
    def url_host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")
