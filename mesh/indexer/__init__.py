"""The shared KV indexer: one prefix index that every broker feeds and queries over gRPC.

* ``indexer.proto`` (package ``mesh.indexer.v1``) and its checked-in generated code
  (``indexer_pb2*.py``; regenerate with ``python -m mesh.indexer.codegen``);
* :mod:`mesh.indexer.server` -- ``mesh indexer --listen HOST:PORT``: the gRPC service around
  :mod:`mesh.indexer.core` (the pure core: a :class:`mesh.index.PrefixIndex` fed through the same
  ingest rules as a broker's local index, :mod:`mesh.index.ingest`), with the standard
  ``grpc.health.v1`` service;
* :mod:`mesh.indexer.client` -- :class:`~mesh.indexer.client.IndexerClient`, what a broker uses:
  prefix queries with a deadline, bounded concurrency, replica failover and a circuit breaker
  (``None`` = degraded, never an exception), and ordered at-least-once event forwarding;
* :mod:`mesh.indexer.shared` -- ``--backend valkey``: replicas sharing one state (a log and
  checkpoints in Valkey); :mod:`mesh.indexer.state` -- the checkpoint's explicit msgpack record;
  :mod:`mesh.indexer.signing` -- HMAC signatures of entries and checkpoints, the replay guard;
* :mod:`mesh.lab.bench.indexer_bench` -- ``mesh bench indexer``.

Imports nothing heavy at package import: ``from mesh.indexer.client import IndexerClient``.
"""
