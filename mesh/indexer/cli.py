"""``mesh indexer`` and ``mesh bench indexer`` argument parsers (wired into :mod:`mesh.cli`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mesh.logs import add_log_level_arg
from mesh.errors import ConfigError

__all__ = ["add_indexer_parser", "add_bench_parser", "indexer_settings", "indexer_token"]

_DEFAULTS: dict[str, Any] = {
    "listen": "127.0.0.1:50051",
    "max_entries": 10_000_000,
    "max_inflight_queries": 32,
    "block_size": 16,
    "tls_cert": None,
    "tls_key": None,
    "worker_ttl_s": 900.0,
    "log_level": "info",
    "token_file": None,
    "tls_client_ca": None,
    "max_message_bytes": 8 * 1024 * 1024,
    "max_batch_events": 262_144,
    "max_workers": 16_384,
    "max_ranks_per_worker": 1024,
    "max_streams": 131_072,
    "ghost_ttl_s": 60.0,
}
_TYPES = {"listen": str, "max_entries": int, "max_inflight_queries": int, "block_size": int, "tls_cert": str,
          "tls_key": str, "worker_ttl_s": (int, float), "log_level": str, "token_file": str, "tls_client_ca": str,
          "max_message_bytes": int, "max_batch_events": int, "max_workers": int, "max_ranks_per_worker": int,
          "max_streams": int, "ghost_ttl_s": (int, float)}
_LIMITS = ("max_message_bytes", "max_batch_events", "max_workers", "max_ranks_per_worker", "max_streams", "ghost_ttl_s")


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
    p.add_argument("--listen", help="HOST:PORT to serve on (default 127.0.0.1:50051; port 0 = any free port)")
    p.add_argument("--max-entries", type=int, help="(block, worker) entries kept, LRU-evicted beyond (default 10000000; 0 = unbounded)")
    p.add_argument("--max-inflight-queries", type=int, help="prefix queries in flight before RESOURCE_EXHAUSTED (default 32)")
    p.add_argument("--block-size", type=int, help="page size assumed for workers never registered nor seen (default 16)")
    p.add_argument("--tls-cert", help="PEM certificate: serve TLS (https:// endpoint); needs --tls-key")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA bundle: require client certificates signed by it (needs --tls-cert)")
    p.add_argument("--token-file", help="file holding the shared bearer token brokers must send (overrides "
                                        "MESH_INDEXER_TOKEN); without either the server is unauthenticated")
    p.add_argument("--worker-ttl-s", type=float, help="forget workers silent this long (default 900; 0 = never)")
    p.add_argument("--max-message-bytes", type=int,
                   help="largest gRPC message accepted (default 8388608); bigger ones get RESOURCE_EXHAUSTED unread")
    p.add_argument("--max-batch-events", type=int, help="events in one batch before it is refused (default 262144)")
    p.add_argument("--max-workers", type=int, help="workers tracked before new ones are refused (default 16384)")
    p.add_argument("--max-ranks-per-worker", type=int, help="(worker, dp_rank) streams per worker (default 1024)")
    p.add_argument("--max-streams", type=int, help="streams over all workers (default 131072)")
    p.add_argument("--ghost-ttl-s", type=float,
                   help="drop workers/streams that got no block indexed this long after they appeared "
                        "(default 60; 0 = keep them until --worker-ttl-s)")
    add_log_level_arg(p)
    # Test seam: every prefix query waits this long before running (overload/deadline tests).
    p.add_argument("--fault-query-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_indexer)
    return p


def indexer_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults < [indexer] table of --config < flags; validated (ConfigError names the field)."""
    vals = dict(_DEFAULTS)
    if getattr(args, "config", None):
        from mesh.config import load_toml, suggest_name

        file_vals = load_toml(args.config, "indexer")
        unknown = sorted(set(file_vals) - set(_DEFAULTS))
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown key in [indexer] of {args.config}{suggest_name(unknown[0], _DEFAULTS)}")
        for k, v in file_vals.items():
            if not isinstance(v, _TYPES[k]) or isinstance(v, bool):
                raise ConfigError(f"{k}: wrong type, got {v!r}")
        vals.update(file_vals)
    vals.update({k: getattr(args, k) for k in _DEFAULTS if getattr(args, k, None) is not None})
    from mesh.indexer.server import parse_listen

    parse_listen(vals["listen"])
    if vals["max_entries"] < 0:
        raise ConfigError("max_entries: must be >= 0 (0 = unbounded)")
    if vals["max_inflight_queries"] < 1:
        raise ConfigError("max_inflight_queries: must be >= 1")
    if vals["worker_ttl_s"] < 0:
        raise ConfigError("worker_ttl_s: must be >= 0 (0 = never)")
    if vals["block_size"] < 1:
        raise ConfigError("block_size: must be >= 1")
    if (vals["tls_cert"] is None) != (vals["tls_key"] is None):
        raise ConfigError("tls_cert: --tls-cert and --tls-key go together")
    if vals["tls_client_ca"] is not None and vals["tls_cert"] is None:
        raise ConfigError("tls_client_ca: client certificates need TLS (--tls-cert and --tls-key)")
    for k in ("tls_cert", "tls_key", "tls_client_ca", "token_file"):
        if vals[k] is not None and not Path(vals[k]).is_file():
            raise ConfigError(f"{k}: no such file {vals[k]!r}")
    from mesh.indexer.server import Limits

    Limits(**{k: vals[k] for k in _LIMITS}).validate()
    return vals


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
    from mesh.indexer.server import Limits, run_server

    v = indexer_settings(args)
    limits = Limits(**{k: v[k] for k in _LIMITS}, owner_ttl_s=float(v["worker_ttl_s"]))
    return run_server(v["listen"], log_level=v["log_level"], max_entries=v["max_entries"] or None,
                      max_inflight_queries=v["max_inflight_queries"], block_size=v["block_size"],
                      tls_cert=v["tls_cert"], tls_key=v["tls_key"], tls_client_ca=v["tls_client_ca"],
                      token=indexer_token(v), limits=limits, worker_ttl_s=float(v["worker_ttl_s"]),
                      query_delay_ms=args.fault_query_delay_ms)


def add_bench_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add ``indexer`` to ``mesh bench``'s subparsers."""
    b = bench_subparsers.add_parser(
        "indexer", help="indexer over gRPC: ingest blocks/s, match p50/p99 (client and server), bytes per block",
        description="Start 'mesh indexer' as a subprocess, ingest >= 1M blocks for 1,000 workers over gRPC, then "
                    "time 512-block prefix queries.")
    b.add_argument("--workers", type=int, default=1000, help="simulated workers (default 1000)")
    b.add_argument("--blocks", type=int, default=1_050_000, help="blocks to index in total (default 1050000)")
    b.add_argument("--queries", type=int, default=2000, help="timed prefix queries (default 2000)")
    b.add_argument("--json", help="write results to this JSON file")
    b.set_defaults(func=_cmd_bench_indexer)
    return b


def _cmd_bench_indexer(args) -> int:
    from mesh.indexer.bench import run_indexer_bench

    res = run_indexer_bench(workers=args.workers, total_blocks=args.blocks, queries=args.queries)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0
