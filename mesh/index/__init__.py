"""The prefix index: which worker holds which prefix of a prompt (pure core, no I/O, no clock).

* :class:`PrefixIndex` -- exact index fed by engine KV events (converted to :mod:`ops`), with
  per-stream sequencing (:mod:`sequence`), an entry budget with LRU eviction, and a speculative
  side index for insert-on-route.
* :class:`ApproxIndex` -- the speculative structure alone: the ``approx`` provider that learns only
  from routing decisions, with a TTL.
* :class:`MatchResult` -- lazy per-worker results of one match (valid until the next mutation),
  with each worker's blocks per KV tier (:mod:`mesh.index.tiers`: device, host, store).
* :class:`mesh.index.ingest.KvIngest` -- the KV ingest rules (sequencing, epochs, resync, the
  block-size vote) that the routers' provider and the indexer service both apply.
* :func:`mesh.lab.bench.index_bench.run_index_bench` -- micro-benchmark (``python -m mesh.lab.bench.index_bench``).
"""

from mesh.index.ops import ROOT_KEY, Clear, IndexOp, Remove, Store, Stream
from mesh.index.prefix import KeyFn, PrefixIndex
from mesh.index.result import MatchResult, StaleMatchError, WorkerMatch
from mesh.index.sequence import BatchVerdict, SeqState, Verdict
from mesh.index.speculative import ApproxIndex, Record, SpeculativeIndex

__all__ = [
    "ROOT_KEY",
    "Stream",
    "Store",
    "Remove",
    "Clear",
    "IndexOp",
    "KeyFn",
    "PrefixIndex",
    "ApproxIndex",
    "SpeculativeIndex",
    "Record",
    "MatchResult",
    "WorkerMatch",
    "StaleMatchError",
    "Verdict",
    "BatchVerdict",
    "SeqState",
]
