"""Tokenise only what is new: token ids of rendered chat prompts cached at special-token boundaries.

A multi-turn conversation re-sends its whole history every turn, and its rendered prompt starts with the
previous turn's prompt. As SGLang's model gateway does in its L1 tokenizer cache, the ids of a rendered
prompt are kept at the boundaries that follow its special tokens (``<|im_end|>``, ``[/INST]``, ...), keyed
by a hash of the text up to there; the next prompt that starts with the same text reuses them and encodes
only the rest.

Why a special-token boundary is exact: ``tokenizers`` splits special tokens (added, not normalised) out of
the text before normalising and pre-tokenising, so the pieces on either side are tokenised independently.
The rest is encoded *with that special token in front* (``S + rest``, the token dropped from the result):
the rest then sits at a non-zero offset as it does in the whole text (``Metaspace``'s "first" prepend
scheme looks at that) and a longer added token that would swallow ``S`` shows up as a first id that is not
``S``'s, which falls back to a full encode. Tokens with ``single_word`` (matched depending on what follows)
are never boundaries. Only chat prompts use it, encoded without special tokens as ``apply_chat_template``
does (no post-processor). Tests compare every cached encode with the full one.

Memory: each encode keeps one record (its ids, 4 bytes a token) under at most ``max_keys`` boundary keys;
records are evicted least recently used past ``budget_bytes``; a record whose every key moved to a longer
record of the same conversation is dropped at once, so a conversation costs about one record.
"""

from __future__ import annotations

import hashlib
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any, Callable

__all__ = ["PrefixCache", "PrefixEncoder", "fast_encode_batch"]

_KEY_OVERHEAD_BYTES = 160  # dict entry, 16-byte key, (record, n) tuple
_RECORD_OVERHEAD_BYTES = 200


class _Record:
    __slots__ = ("ids", "keys")

    def __init__(self, ids: array) -> None:
        self.ids = ids
        self.keys: set[bytes] = set()


class PrefixCache:
    """key (hash of a text prefix) -> the token ids of that prefix; thread-safe, bounded by ``budget_bytes``."""

    def __init__(self, budget_bytes: int = 64 << 20) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0
        self.unaligned = 0  # encodes whose boundaries could not be placed (nothing stored; see PrefixEncoder._store)
        self._lock = threading.Lock()
        self._entries: dict[bytes, tuple[_Record, int]] = {}
        self._records: OrderedDict[int, _Record] = OrderedDict()  # id(record) -> record, least recent first

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, keys: list[bytes]) -> tuple[int, array, Any] | None:
        """The longest cached prefix among ``keys`` (shortest first): (its index in ``keys``, its ids, a
        handle to pass to :meth:`store` as ``extends``)."""
        with self._lock:
            for i in range(len(keys) - 1, -1, -1):
                hit = self._entries.get(keys[i])
                if hit is not None:
                    rec, n = hit
                    self._records.move_to_end(id(rec))
                    self.hits += 1
                    self.tokens_reused += n
                    return i, rec.ids[:n], hit
            self.misses += 1
            return None

    def store(self, ids: array, boundaries: list[tuple[bytes, int]], extends: Any = None) -> None:
        """Keep ``ids`` under each (key, number of leading tokens) of ``boundaries``. ``extends``: the
        :meth:`lookup` handle ``ids`` started from; that record's keys within the reused prefix move here
        too. A key already held by another record moves here, and a record left without keys is dropped."""
        if extends is not None:
            with self._lock:
                old, n_reused = extends
                if self._records.get(id(old)) is old:
                    boundaries = [*boundaries, *((k, self._entries[k][1]) for k in old.keys
                                                 if self._entries[k][1] <= n_reused)]
        if not boundaries:
            return
        rec = _Record(ids)
        cost = len(ids) * ids.itemsize + _RECORD_OVERHEAD_BYTES + len(boundaries) * _KEY_OVERHEAD_BYTES
        if cost > self.budget_bytes:
            return
        with self._lock:
            for key, n in boundaries:
                old = self._entries.get(key)
                if old is not None:
                    old[0].keys.discard(key)
                    self.bytes -= _KEY_OVERHEAD_BYTES
                    if not old[0].keys:
                        self._drop(old[0])
                self._entries[key] = (rec, n)
                rec.keys.add(key)
            self._records[id(rec)] = rec
            self.bytes += cost
            while self.bytes > self.budget_bytes and self._records:
                self._drop(next(iter(self._records.values())))

    def _drop(self, rec: _Record) -> None:
        if self._records.pop(id(rec), None) is None:
            return
        for key in rec.keys:
            if self._entries.get(key, (None,))[0] is rec:
                del self._entries[key]
        self.bytes -= len(rec.ids) * rec.ids.itemsize + _RECORD_OVERHEAD_BYTES + len(rec.keys) * _KEY_OVERHEAD_BYTES
        rec.keys = set()


class PrefixEncoder:
    """Encodes chat prompts (without special tokens) through a :class:`PrefixCache`; see the module docstring.
    ``available`` is False for a tokenizer without usable boundary tokens (then it always encodes in full)."""

    def __init__(self, tokenizer: Any, budget_bytes: int = 64 << 20, max_keys: int = 8,
                 written_by: Callable[[str], bool] = lambda _tok: True) -> None:
        """``written_by``: which special tokens may be boundaries (those the chat template writes: a regex of
        a whole vocabulary's reserved tokens would cost more than the encode it saves)."""
        self.tokenizer = tokenizer
        self._encode_batch = fast_encode_batch(tokenizer)
        self.cache = PrefixCache(budget_bytes)
        self.max_keys = max_keys
        self.boundary: dict[str, int] = {}  # special token text -> its id
        for tid, tok in tokenizer.get_added_tokens_decoder().items():
            if tok.special and not tok.normalized and not tok.single_word and tok.content and written_by(tok.content):
                if tokenizer.encode_batch([tok.content], add_special_tokens=False)[0].ids == [tid]:
                    self.boundary[tok.content] = tid
        self._ids = frozenset(self.boundary.values())
        alts = sorted(self.boundary, key=len, reverse=True)
        self._re = re.compile("|".join(map(re.escape, alts))) if alts and budget_bytes > 0 else None
        self.available = self._re is not None

    def _keys(self, text: str) -> tuple[list[bytes], list[re.Match]]:
        """A key per special-token end in ``text``: the hash of the text up to it (one pass)."""
        h = hashlib.blake2b(digest_size=16)
        keys, matches, prev = [], [], 0
        for m in self._re.finditer(text):  # type: ignore[union-attr]
            h.update(text[prev:m.end()].encode("utf-8", "surrogatepass"))
            prev = m.end()
            keys.append(h.copy().digest())
            matches.append(m)
        return keys, matches

    def encode(self, text: str) -> list[int]:
        if self._re is None:
            return self._encode_batch([text], add_special_tokens=False)[0].ids
        keys, matches = self._keys(text)
        hit = self.cache.lookup(keys) if keys else None
        start, base, extends = 0, array("I"), None  # chars of ``text`` the cache covers, their ids, its handle
        enc_ids = None  # ``Encoding.ids`` builds a new list on every read: it is read once per encode
        if hit is not None:
            i, prefix, handle = hit
            m = matches[i]
            enc_ids = self._encode_batch([m.group() + text[m.end():]], add_special_tokens=False)[0].ids
            if enc_ids and enc_ids[0] == self.boundary[m.group()]:
                start, base, extends = m.end(), prefix, handle
            else:  # a longer added token swallows the boundary: no reuse
                enc_ids = None
        if enc_ids is None:
            enc_ids = self._encode_batch([text], add_special_tokens=False)[0].ids
        ids = array("I", base)
        ids.extend(enc_ids[1:] if start else enc_ids)
        self._store(ids, enc_ids, keys, matches, start, len(base), extends)
        return ids.tolist()

    def _store(self, ids: array, enc_ids: list[int], keys: list[bytes], matches: list[re.Match], start: int,
               n_base: int, extends: Any) -> None:
        """Keep ``ids`` under the keys of the last ``max_keys`` special-token ends past ``start``. The encode
        has no character offsets (the fast call): the k-th boundary token of ``enc_ids`` is the k-th boundary
        match past ``start`` (added tokens are split out of the text first, each match is one token), checked
        by count and by each token's id; anything else (a longer added token that swallowed a match) stores
        nothing, so a later prompt encodes in full rather than reuse ids that might be misplaced."""
        skip = 1 if start else 0  # the boundary token in front of a reused prefix's rest
        past = [i for i, m in enumerate(matches) if m.end() > start]
        pos: list[int] = []
        for tid in self._ids:  # list.index scans in C: a few passes over the ids, not one Python step per token
            j = skip
            try:
                while True:
                    j = enc_ids.index(tid, j)
                    pos.append(j)
                    j += 1
            except ValueError:
                pass
        if len(pos) != len(past):
            self.cache.unaligned += 1
            return
        pos.sort()
        found: list[tuple[bytes, int]] = []
        for i, j in list(zip(past, pos))[-self.max_keys:]:
            if enc_ids[j] != self.boundary[matches[i].group()]:
                self.cache.unaligned += 1
                return
            found.append((keys[i], n_base + j + 1 - skip))
        self.cache.store(ids, found, extends)


def fast_encode_batch(tokenizer: Any) -> Callable[..., Any]:
    """``encode_batch_fast`` where ``tokenizers`` has it (0.20+: the same ids, no character offsets, about
    twice as fast on long texts, and it releases the GIL as ``encode_batch`` does), else ``encode_batch``."""
    return getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
