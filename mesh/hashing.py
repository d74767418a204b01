"""Page hashes: the engines' block hashes and the router's own content keys.

Three families live here, all over *full pages only* (a trailing partial page is never hashed,
because engines only cache and publish page-aligned blocks):

* :func:`sglang_page_hashes` -- SGLang's chained SHA-256 (``worker-telemetry.md`` §8). Each page's
  32-byte digest seeds the next one; the published hash is the first 8 bytes of the digest read
  big-endian as a *signed* int64.
* :func:`vllm_block_hashes` -- vLLM's default ``sha256`` block hash (§12.3), pickle based and
  therefore Python-specific; published unsigned (last 8 bytes).
* :func:`content_keys` -- the mesh's own content key: a polynomial chain over mixed page hashes
  (numpy-vectorised, see below).
  The prefix index is keyed by these, never by engine hashes (which may be namespaced by salts,
  LoRA adapters or formats a router cannot see). Engine hashes are opaque identities used only for
  parent links and removals.

Token packing is always uint32 little-endian, independent of the host byte order, so the same
tokens and page size give the same hashes and keys on every host. Token ids must satisfy
``0 <= t < 2**32``; anything else raises ValueError.

Pure functions: no I/O, no clock, no global state (besides bounded memos of constants and of
short prompts' content keys, whose results depend on the inputs only).
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import struct
import sys
from array import array
from collections.abc import Sequence
from operator import mul as _mul

import numpy as np

__all__ = [
    "ROOT_KEY",
    "CONTENT_KEY_SEED",
    "U64_MASK",
    "pack_tokens",
    "content_keys",
    "content_keys_from_packed",
    "sglang_page_hashes",
    "sglang_page_hashes_with_digest",
    "sglang_page_digests",
    "sglang_digest_to_hash",
    "vllm_block_hashes",
    "norm_hash",
    "to_signed64",
]

U64_MASK = 0xFFFF_FFFF_FFFF_FFFF

#: Parent key of the first page of every prompt (the radix root).
ROOT_KEY = 0
#: Fixed seed of the content key coefficients ("mesh" in ASCII). Changing it changes every key: never do
#: it without a protocol/index version bump.
CONTENT_KEY_SEED = 0x6D657368

_BIG_ENDIAN_HOST = sys.byteorder == "big"
_pack_u64_le = struct.Struct("<Q").pack
_sha256 = hashlib.sha256


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as uint32 little-endian bytes (host independent).

    Raises ValueError for an id outside ``[0, 2**32)`` or a non-int.
    """
    try:
        arr = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if arr.itemsize != 4:  # pragma: no cover - every mainstream ABI has a 4-byte unsigned int
        arr = array("L", token_ids)
        if arr.itemsize != 4:
            raise RuntimeError("no 4-byte unsigned array type on this platform")
    if _BIG_ENDIAN_HOST:  # pragma: no cover - exercised only on big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def packed_bytes(arr: array) -> bytes:
    """Little-endian bytes of an ``array('I')`` of token ids (already validated)."""
    if _BIG_ENDIAN_HOST:  # pragma: no cover
        arr = array("I", arr)
        arr.byteswap()
    return arr.tobytes()


def _check_page_size(page_size: int) -> None:
    if type(page_size) is not int or page_size <= 0:
        raise ValueError(f"page size must be a positive int, got {page_size!r}")


# --------------------------------------------------------------------------- content keys


# Content keys are a polynomial chain over mixed page hashes, computed with numpy in a few
# vector operations instead of one Python-level hash call per page (8k-token prompt: ~0.1 ms
# instead of ~0.3 ms):
#
#   page_k = splitmix64( sum_i tok[k, i] * M_i  +  block_size * S )      (uint64, wrapping)
#   key_k  = key_{k-1} * R + page_k                                    (mod 2**64), key_{-1} = parent
#
# so key_k identifies the whole prefix 0..k and a chain can be continued from any key. The
# chain is linear in the page hashes: fine for routing (a crafted collision only costs a cache
# miss; engines verify tokens themselves), not a cryptographic commitment.
_MASK = (1 << 64) - 1
_R = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64
_R_INV = pow(_R, -1, 1 << 64)
_S = 0xD6E8FEB86659FD93


def _splitmix64_int(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _splitmix64_np(x):
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_COEFFS: dict[int, "np.ndarray"] = {}
_POWS: list = [None, None, 0]  # R**k and R**-k for k < len, grown on demand


def _coeffs(block_size: int):
    c = _COEFFS.get(block_size)
    if c is None:
        c = np.array([_splitmix64_int(CONTENT_KEY_SEED + i) | 1 for i in range(block_size)], dtype=np.uint64)
        _COEFFS[block_size] = c
    return c


def _powers(n: int):
    if _POWS[2] < n:
        size = max(n, 2 * _POWS[2], 1024)
        pw = np.empty(size, dtype=np.uint64)
        pi = np.empty(size, dtype=np.uint64)
        a = b = 1
        for k in range(size):
            pw[k] = a
            pi[k] = b
            a = (a * _R) & _MASK
            b = (b * _R_INV) & _MASK
        _POWS[:] = [pw, pi, size]
    return _POWS[0][:n], _POWS[1][:n]


def content_keys_from_packed(buf: bytes, block_size: int, parent_key: int = ROOT_KEY) -> list[int]:
    """Content keys of the full pages of already-packed tokens (see :func:`pack_tokens`).

    ``key_k = key_{k-1} * R + splitmix64(sum_i tok_ki * M_i + block_size * S) (mod 2**64)`` with
    ``key_{-1} = parent_key``. Keys are unsigned 64-bit ints; equal tokens and block size give
    equal keys on every host.
    """
    _check_page_size(block_size)
    n = len(buf) // (4 * block_size)
    if n == 0:
        return []
    if n * block_size <= _SMALL_TOKENS:
        return list(_content_keys_small_memo(bytes(buf[:n * block_size * 4]), block_size, parent_key))
    toks = np.frombuffer(buf, dtype="<u4", count=n * block_size).reshape(n, block_size).astype(np.uint64)
    with np.errstate(over="ignore"):
        page = _splitmix64_np(toks @ _coeffs(block_size) + np.uint64((block_size * _S) & _MASK))  # integer matmul wraps mod 2**64
        pw, pinv = _powers(n + 1)
        # key_k = R**(k+1) * parent + sum_{i<=k} page_i * R**(k-i) = R**k * (R*parent + cumsum(page_i * R**-i))
        acc = np.cumsum(page * pinv[:n], dtype=np.uint64) + np.uint64((parent_key * _R) & _MASK)
        keys = acc * pw[:n]
    return keys.tolist()


# Below this many tokens numpy's fixed cost per call (array set-up, errstate, ~40 us) is more
# than the arithmetic: short prompts (chat turns, benchmarks) take the plain-integer path, which
# computes the same keys (tests check both paths agree).
_SMALL_TOKENS = 96
_COEFFS_INT: dict[int, tuple[int, ...]] = {}


def _content_keys_small(buf: bytes, n: int, block_size: int, parent_key: int) -> list[int]:
    c = _COEFFS_INT.get(block_size)
    if c is None:
        c = _COEFFS_INT[block_size] = tuple(int(x) for x in _coeffs(block_size))
    toks = struct.unpack_from(f"<{n * block_size}I", buf)
    bias = (block_size * _S) & _MASK
    key = parent_key & _MASK
    out = []
    for base in range(0, n * block_size, block_size):
        page = _splitmix64_int((sum(map(_mul, toks[base:base + block_size], c)) + bias) & _MASK)
        key = (key * _R + page) & _MASK
        out.append(key)
    return out


# Short prompts repeat (a chat client's fixed instructions, a probe, a benchmark): the keys of the
# last few thousand distinct short prompts are kept (bytes of their full pages, page size, parent
# -> keys; at most _SMALL_TOKENS x 4 bytes each). Results depend on the inputs only.
@functools.lru_cache(maxsize=4096)
def _content_keys_small_memo(pages: bytes, block_size: int, parent_key: int) -> tuple[int, ...]:
    return tuple(_content_keys_small(pages, len(pages) // (4 * block_size), block_size, parent_key))


def content_keys(token_ids: Sequence[int], block_size: int, parent_key: int = ROOT_KEY) -> list[int]:
    """Content keys of the full pages of ``token_ids`` (see :func:`content_keys_from_packed`)."""
    return content_keys_from_packed(pack_tokens(token_ids), block_size, parent_key)


def sglang_digest_to_hash(digest: bytes) -> int:
    """SGLang's published hash of a page digest: first 8 bytes, big-endian, signed int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


def sglang_page_digests(token_ids: Sequence[int], page_size: int, prior_digest: bytes | None = None) -> list[bytes]:
    """The 32-byte SHA-256 digest of every full page, chained from ``prior_digest`` (None at root)."""
    _check_page_size(page_size)
    if prior_digest is not None and len(prior_digest) != 32:
        raise ValueError("prior_digest must be a 32-byte SHA-256 digest")
    buf = pack_tokens(token_ids)
    step = page_size * 4
    end = (len(buf) // step) * step
    out: list[bytes] = []
    prior = prior_digest
    for off in range(0, end, step):
        page = buf[off : off + step]
        prior = _sha256(page if prior is None else prior + page).digest()
        out.append(prior)
    return out


def sglang_page_hashes_with_digest(
    token_ids: Sequence[int], page_size: int, prior_digest: bytes | None = None
) -> tuple[list[int], bytes | None]:
    """Like :func:`sglang_page_hashes`, also returning the last page's digest to continue the chain.

    The returned digest is ``prior_digest`` itself when there is no full page.
    """
    digests = sglang_page_digests(token_ids, page_size, prior_digest)
    last = digests[-1] if digests else prior_digest
    return [sglang_digest_to_hash(d) for d in digests], last


def sglang_page_hashes(token_ids: Sequence[int], page_size: int, prior_digest: bytes | None = None) -> list[int]:
    """SGLang's chained SHA-256 page hashes (signed int64), full pages only.

    Valid for un-namespaced requests (no LoRA, ``extra_key`` or ``cache_salt``; ``format`` =
    ``default``). Continuing a chain needs the previous page's 32-byte digest, not its int64.
    """
    return sglang_page_hashes_with_digest(token_ids, page_size, prior_digest)[0]


# --------------------------------------------------------------------------- vLLM


def vllm_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    prior_digest: bytes | None = None,
    *,
    none_hash_seed: str = "vllm-none-hash",
) -> list[int]:
    """vLLM's default (``sha256``) block hashes as published: last 8 bytes, unsigned.

    ``h_k = SHA-256(pickle((h_{k-1}, tuple(block_tokens), None), highest protocol))`` with
    ``h_{-1} = prior_digest`` or ``NONE_HASH = SHA-256(pickle(none_hash_seed))``. vLLM uses
    ``$PYTHONHASHSEED`` as the seed when it is set; pass it explicitly in that case (this module
    reads no environment). Plain text only (``extra_keys`` None).
    """
    _check_page_size(block_size)
    proto = pickle.HIGHEST_PROTOCOL
    parent = prior_digest if prior_digest is not None else _sha256(pickle.dumps(none_hash_seed, protocol=proto)).digest()
    toks = list(token_ids)
    out: list[int] = []
    for s in range(0, (len(toks) // block_size) * block_size, block_size):
        parent = _sha256(pickle.dumps((parent, tuple(toks[s : s + block_size]), None), protocol=proto)).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


# --------------------------------------------------------------------------- normalisation


def norm_hash(v: object) -> int:
    """Normalise an engine block hash to an unsigned 64-bit int.

    bytes -> last 8 bytes big-endian unsigned (vLLM's raw 32-byte form); int -> two's complement
    ``v & 0xFFFF_FFFF_FFFF_FFFF`` (SGLang's signed int64 and vLLM's u64 both land here). bool,
    empty bytes and every other type raise ValueError.
    """
    t = type(v)
    if t is int:
        return v & U64_MASK  # type: ignore[operator]
    if t is bytes or t is bytearray:
        if not v:
            raise ValueError("empty bytes hash")
        return int.from_bytes(v[-8:], "big")  # type: ignore[index]
    raise ValueError(f"block hash must be int or bytes, got {t.__name__}")


def to_signed64(u: int) -> int:
    """Two's complement view of an unsigned 64-bit value (how SGLang sends hashes)."""
    u &= U64_MASK
    return u - (1 << 64) if u >= (1 << 63) else u


def text_to_tokens(text: str) -> list[int]:
    """Stand-in tokenizer for text-only requests: UTF-8 bytes as token ids.

    Used where no real tokenizer is configured (simulated workers, and the broker's routing key
    for text prompts), so a shared text prefix still maps to shared pages. Deterministic.
    """
    return list(text.encode("utf-8"))
