"""Index operations: KV events already converted into what the prefix index understands.

The index never decodes engine events and never hashes tokens itself (that is ``mesh.kv_events``
and ``mesh.hashing``); it takes these three operations per *stream* ``(worker_id, dp_rank)``:

* :class:`Store` -- a chain of blocks stored under ``parent_engine_hash`` (None = radix root;
  a root store's keys chain from its ``root_key``: ROOT_KEY for the plain cache namespace, the
  namespace's root for a LoRA adapter or a cache salt, see ``mesh.namespaces``; a store below a
  parent inherits the parent's chain and so its namespace). Two modes:

  (a) ``content_keys`` given: the caller already computed the router's content keys, chained from
      the parent's key that it obtained with ``PrefixIndex.resolve_parent_key``;
  (b) ``token_ids`` + ``block_size`` given (``content_keys`` None): the index resolves the parent's
      content key itself and calls the ``key_fn`` it was built with (normally
      ``mesh.hashing.content_keys``).

* :class:`Remove` -- engine hashes removed from that stream (each removal also drops the blocks
  stored below it in the same stream: the engine cannot reach them any more).
  Both carry the engine's ``medium`` (:mod:`mesh.index.tiers`): ownership is kept per medium, and
  a removal from one medium of a block still held on another is a demotion, not a removal.
* :class:`Clear` -- everything of that stream is gone (``AllBlocksCleared``; also the first op of
  a resync snapshot).

Engine hashes are opaque unsigned 64-bit ids (normalised by ``mesh.hashing.norm_hash``); they are
kept only for parent links and removals. Content keys are unsigned 64-bit ints where key ``k``
identifies the whole prefix ``0..k`` (it is chained from key ``k-1``); the index relies on that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ROOT_KEY", "Stream", "Store", "Remove", "Clear", "IndexOp"]

#: Parent content key of a prompt's first page. Must equal ``mesh.hashing.ROOT_KEY`` (tested); kept
#: as a local constant so the index does not depend on the hashing module.
ROOT_KEY = 0

#: A KV event stream: one engine KV cache, i.e. one publisher (``worker_id``, ``dp_rank``).
Stream = tuple[str, int]


@dataclass(slots=True, frozen=True)
class Store:
    """Blocks ``engine_hashes`` (prompt order) stored below ``parent_engine_hash`` (None = root).

    Exactly one of ``content_keys`` (one key per block) or ``token_ids`` (``block_size`` tokens per
    block) describes the content. Lengths are checked by the index (ValueError on mismatch).
    ``root_key``: the content key a root store (parent None) chains from, i.e. its cache
    namespace (``mesh.namespaces.namespace_root_key``); ignored below a parent.
    """

    engine_hashes: Sequence[int]
    parent_engine_hash: int | None = None
    content_keys: Sequence[int] | None = None
    token_ids: Sequence[int] | None = None
    block_size: int = 0
    root_key: int = ROOT_KEY
    medium: str | None = None  # where the blocks are stored (mesh.index.tiers; None: the device)


@dataclass(slots=True, frozen=True)
class Remove:
    """Blocks removed (evicted) from the stream, by engine hash; unknown hashes are counted, not errors."""

    engine_hashes: Sequence[int]
    medium: str | None = None  # the tier they left (mesh.index.tiers); None: every tier


@dataclass(slots=True, frozen=True)
class Clear:
    """Every block of the stream is gone (``AllBlocksCleared``)."""


IndexOp = Store | Remove | Clear
