"""``mesh indexer``'s argument parser (wired into :mod:`mesh.cli`)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.errors import ConfigError
from mesh.logs import add_log_level_arg
from mesh.settings_fields import add_flags, setting

__all__ = ["IndexerSettings", "add_indexer_parser", "indexer_settings", "indexer_token"]

@dataclass(frozen=True, slots=True)
class IndexerSettings:
    """``mesh indexer`` settings: each field's help text is its flag's ``--help``; the ``[indexer]``
    TOML table takes the same names (see :mod:`mesh.settings_fields`)."""

    listen: str = setting("127.0.0.1:50051", help="HOST:PORT to serve on (port 0 = any free port)")
    max_entries: int = setting(10_000_000, help="(block, worker) entries kept, LRU-evicted beyond (0 = unbounded)")
    max_inflight_queries: int = setting(32, help="prefix queries in flight before RESOURCE_EXHAUSTED")
    block_size: int = setting(16, unit="tokens", help="page size assumed for workers never registered nor seen")
    tls_cert: str | None = setting(None, default_text="plaintext",
                                   help="PEM certificate: serve TLS (https:// endpoint); needs --tls-key")
    tls_key: str | None = setting(None, help="PEM private key for --tls-cert")
    worker_ttl_s: float = setting(900.0, unit="s", help="forget workers silent this long (0 = never)")
    log_level: str = setting("info", add=add_log_level_arg)
    token_file: str | None = setting(None, default_text="MESH_INDEXER_TOKEN, else unauthenticated",
                                     help="file holding the shared bearer token brokers must send (overrides "
                                          "MESH_INDEXER_TOKEN)")
    tls_client_ca: str | None = setting(None, help="PEM CA bundle: require client certificates signed by it "
                                                   "(needs --tls-cert)")
    max_message_bytes: int = setting(8 * 1024 * 1024, unit="bytes",
                                     help="largest gRPC message accepted; bigger ones get RESOURCE_EXHAUSTED unread")
    max_batch_events: int = setting(262_144, help="events in one batch before it is refused")
    max_workers: int = setting(16_384, help="workers tracked before new ones are refused")
    max_ranks_per_worker: int = setting(1024, help="(worker, dp_rank) streams per worker")
    max_streams: int = setting(131_072, help="streams over all workers")
    metrics: str | None = setting(None, metavar="HOST:PORT", default_text="off",
                                  help="serve Prometheus /metrics here (no authentication: an empty host binds 127.0.0.1)")
    ghost_ttl_s: float = setting(60.0, unit="s", help="drop workers/streams that got no block indexed this long after "
                                                      "they appeared (0 = keep them until --worker-ttl-s)")
    backend: str = setting("memory", choices=("memory", "valkey"),
                           help="where the index state lives: this process (memory), or Valkey/Redis shared by "
                                "every replica given the same --valkey-url and --valkey-prefix (survives restarts)")
    valkey_url: str | None = setting(None, metavar="URL", default_text="none",
                                     help="redis://HOST:PORT[/DB] (rediss:// for TLS) of the Valkey (or Redis) server for "
                                          "--backend valkey; its password from $MESH_VALKEY_PASSWORD (kept out of logs)")
    valkey_prefix: str = setting("mesh:indexer", help="key prefix of the shared state in Valkey (one per index)")
    checkpoint_every: int = setting(20_000, unit="log entries",
                                    help="--backend valkey: write a checkpoint (and trim the log) after this many entries")
    valkey_password_file: str | None = setting(None, default_text="$MESH_VALKEY_PASSWORD (a password in the URL wins)",
                                               help="file holding the Valkey password (AUTH, requirepass); kept out "
                                                    "of the command line and the logs")
    insecure_store: bool = setting(False, help="--backend valkey without a token: run with UNSIGNED log entries and "
                                               "checkpoints (anyone who can write the store can forge them); refused "
                                               "without this flag")
    max_match_ids: int = setting(1 << 20, help="token ids (or block keys) one MatchPrefix may carry; more: "
                                                "INVALID_ARGUMENT (the largest context a model takes, 1M tokens)")

    def validate(self) -> None:
        from mesh.indexer.core import Limits
        from mesh.indexer.server import parse_listen

        parse_listen(self.listen)
        if self.max_entries < 0:
            raise ConfigError("max_entries: must be >= 0 (0 = unbounded)")
        if self.max_inflight_queries < 1:
            raise ConfigError("max_inflight_queries: must be >= 1")
        if self.worker_ttl_s < 0:
            raise ConfigError("worker_ttl_s: must be >= 0 (0 = never)")
        if self.block_size < 1:
            raise ConfigError("block_size: must be >= 1")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert: --tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_client_ca: client certificates need TLS (--tls-cert and --tls-key)")
        for k in ("tls_cert", "tls_key", "tls_client_ca", "token_file"):
            v = getattr(self, k)
            if v is not None and not Path(v).is_file():
                raise ConfigError(f"{k}: no such file {v!r}")
        Limits(**{k: getattr(self, k) for k in _LIMITS}).validate()
        if self.backend == "valkey":
            from mesh.indexer.shared import parse_valkey_url

            if not self.valkey_url:
                raise ConfigError("valkey_url: --backend valkey needs --valkey-url redis://HOST:PORT[/DB]")
            parse_valkey_url(self.valkey_url)
            try:
                import redis  # noqa: F401
            except ImportError:
                raise ConfigError("backend: valkey needs the redis package (pip install 'mesh-router[valkey]')") from None
        if self.valkey_password_file is not None:
            valkey_password(self.valkey_password_file)
        if self.checkpoint_every < 1:
            raise ConfigError("checkpoint_every: must be >= 1")
        if not self.valkey_prefix or any(ch.isspace() for ch in self.valkey_prefix):
            raise ConfigError("valkey_prefix: must be one non-empty word")


_LIMITS = ("max_message_bytes", "max_batch_events", "max_workers", "max_ranks_per_worker", "max_streams", "ghost_ttl_s",
           "max_match_ids")


def valkey_password(path: str) -> str:
    """The password in ``--valkey-password-file``: one printable word (ConfigError naming the field)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"valkey_password_file: cannot read {path!r}: {exc.strerror}") from None
    if len(raw) > 4096:
        raise ConfigError("valkey_password_file: at most 4096 bytes")
    try:
        pw = raw.decode().strip()
    except UnicodeDecodeError:
        raise ConfigError("valkey_password_file: must be UTF-8 text") from None
    if not pw or any(ch.isspace() for ch in pw) or not pw.isprintable():
        raise ConfigError("valkey_password_file: must hold one printable word")
    return pw


def add_indexer_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``indexer`` subcommand to ``mesh``'s subparsers."""
    p = subparsers.add_parser(
        "indexer", help="run the shared KV indexer (gRPC): prefix matches for every broker",
        description="Run the KV indexer: brokers forward workers' KV event batches to it and query it for "
                    "per-worker prefix matches. Announces 'indexer_listening' with the bound endpoint; "
                    "SIGTERM stops it gracefully (health NOT_SERVING first). With --token-file (or the "
                    "MESH_INDEXER_TOKEN environment variable) every call but grpc.health.v1 must carry "
                    "'authorization: Bearer <token>' (else UNAUTHENTICATED); without one it serves anyone and "
                    "logs 'indexer_unauthenticated'. A worker's registration belongs to the caller that made "
                    "it first (metadata 'x-mesh-owner', the broker id): other callers may not forget it or "
                    "change its block size (PERMISSION_DENIED).")
    p.add_argument("--config", help="TOML file; its [indexer] table uses these flag names")
    add_flags(p, IndexerSettings)
    # Test seam: every prefix query waits this long before running (overload/deadline tests).
    p.add_argument("--fault-query-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_indexer)
    return p


def indexer_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults < [indexer] table of --config < flags; validated (ConfigError names the field).
    The :class:`IndexerSettings` as a mapping."""
    from mesh.config import settings_from_args

    return dataclasses.asdict(settings_from_args(IndexerSettings, args, "indexer"))


def indexer_token(vals: dict[str, Any]) -> str | None:
    """The bearer token: --token-file (or ``token_file`` in [indexer]), else MESH_INDEXER_TOKEN, else None."""
    import os

    from mesh.indexer.server import TOKEN_ENV, read_token_file

    if vals.get("token_file"):
        return read_token_file(vals["token_file"], "token_file")
    env = os.environ.get(TOKEN_ENV)
    if env is not None:
        env = env.strip()
        if not env or any(ch.isspace() for ch in env) or not env.isprintable():
            raise ConfigError(f"{TOKEN_ENV}: must be one printable word")
        return env
    return None


def _cmd_indexer(args) -> int:
    from mesh.indexer.core import Limits
    from mesh.indexer.server import run_server

    v = indexer_settings(args)
    limits = Limits(**{k: v[k] for k in _LIMITS}, owner_ttl_s=float(v["worker_ttl_s"]))
    return run_server(v["listen"], log_level=v["log_level"], max_entries=v["max_entries"] or None,
                      max_inflight_queries=v["max_inflight_queries"], block_size=v["block_size"],
                      tls_cert=v["tls_cert"], tls_key=v["tls_key"], tls_client_ca=v["tls_client_ca"],
                      token=indexer_token(v), limits=limits, worker_ttl_s=float(v["worker_ttl_s"]),
                      query_delay_ms=args.fault_query_delay_ms, metrics=v["metrics"], backend=v["backend"],
                      valkey_url=v["valkey_url"], valkey_prefix=v["valkey_prefix"],
                      checkpoint_every=v["checkpoint_every"], insecure_store=v["insecure_store"],
                      valkey_password=valkey_password(v["valkey_password_file"]) if v["valkey_password_file"] else None)
