"""mesh.hashing: engine hash vectors, the content key contract, normalisation."""

from __future__ import annotations

import struct
import time

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from mesh.hashing import (
    CONTENT_KEY_SEED,
    ROOT_KEY,
    content_keys,
    content_keys_from_packed,
    norm_hash,
    pack_tokens,
    sglang_page_digests,
    sglang_page_hashes,
    sglang_page_hashes_with_digest,
    to_signed64,
    vllm_block_hashes,
)

PAGE0_HEX = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"


# --------------------------------------------------------------------------- SGLang (§8.2)


def test_sglang_vector():
    assert sglang_page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == [-3488128144981237669, 5674439469042975057]


def test_sglang_page0_digest_and_continuation():
    hashes, digest = sglang_page_hashes_with_digest([1, 2, 3, 4], 4)
    assert hashes == [-3488128144981237669]
    assert digest is not None and digest.hex() == PAGE0_HEX
    assert sglang_page_hashes([5, 6, 7, 8], 4, bytes.fromhex(PAGE0_HEX)) == [5674439469042975057]


def test_sglang_trailing_partial_page_not_hashed():
    assert sglang_page_hashes(list(range(1, 11)), 4) == sglang_page_hashes(list(range(1, 9)), 4)
    hashes, digest = sglang_page_hashes_with_digest([1, 2, 3], 4)
    assert hashes == [] and digest is None
    _, d = sglang_page_hashes_with_digest([9], 4, bytes.fromhex(PAGE0_HEX))
    assert d == bytes.fromhex(PAGE0_HEX)  # nothing hashed: the prior digest carries through


@given(st.lists(st.integers(0, 2**32 - 1), max_size=64), st.integers(1, 8), st.integers(0, 8))
def test_sglang_chain_split_anywhere_on_a_page_boundary(tokens, page, split_pages):
    cut = min(split_pages * page, (len(tokens) // page) * page)
    first, d = sglang_page_hashes_with_digest(tokens[:cut], page)
    rest = sglang_page_hashes(tokens[cut:], page, d)
    assert first + rest == sglang_page_hashes(tokens, page)
    assert len(sglang_page_digests(tokens, page)) == len(tokens) // page


# --------------------------------------------------------------------------- vLLM (§12.3)


def test_vllm_vector():
    assert vllm_block_hashes(list(range(32)), 16) == [3262291359910021016, 7142137847444424233]


# --------------------------------------------------------------------------- content keys


def test_content_key_formula_and_golden_values():
    toks = list(range(40))
    keys = content_keys(toks, 16)
    # The formula, independently of the implementation.
    k0 = xxhash.xxh3_64_intdigest(struct.pack("<Q", ROOT_KEY) + struct.pack("<16I", *range(16)), seed=CONTENT_KEY_SEED)
    k1 = xxhash.xxh3_64_intdigest(struct.pack("<Q", k0) + struct.pack("<16I", *range(16, 32)), seed=CONTENT_KEY_SEED)
    assert keys == [k0, k1]
    # Pinned values: any host, any process, any Python must produce exactly these.
    assert keys == [8278681723276564409, 17919639490436040769]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(1, 8), st.integers(0, 10))
def test_content_keys_chain_and_packed_agree(tokens, bs, split_pages):
    keys = content_keys(tokens, bs)
    assert len(keys) == len(tokens) // bs
    assert all(0 <= k < 2**64 for k in keys)
    assert content_keys_from_packed(pack_tokens(tokens), bs) == keys
    cut = min(split_pages, len(keys))
    parent = keys[cut - 1] if cut else ROOT_KEY
    assert keys[:cut] + content_keys(tokens[cut * bs :], bs, parent) == keys


def test_content_keys_depend_on_block_size_parent_and_order():
    toks = list(range(64))
    assert content_keys(toks, 16) != content_keys(toks, 8)[: 4]
    assert content_keys(toks, 16, parent_key=1) != content_keys(toks, 16)
    swapped = toks[16:32] + toks[:16] + toks[32:]
    a, b = content_keys(toks, 16), content_keys(swapped, 16)
    assert a[0] != b[1] and a[3] != b[3]  # chaining: same page content, different position/prefix


def test_pack_tokens_is_little_endian_u32():
    assert pack_tokens([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], [None]])
def test_bad_tokens_raise_value_error(bad):
    with pytest.raises(ValueError):
        content_keys(bad, 1)
    with pytest.raises(ValueError):
        sglang_page_hashes(bad, 1)


@pytest.mark.parametrize("bs", [0, -4, True, 2.0])
def test_bad_page_size(bs):
    with pytest.raises(ValueError):
        content_keys([1, 2], bs)


def test_content_keys_speed():
    """< 1 us per 16-token page amortised on an 8k prompt (asserted with 2x slack for slow CI)."""
    toks = list(range(8192))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            content_keys(toks, 16)
        best = min(best, (time.perf_counter() - t0) / 20)
    per_page_us = best * 1e6 / 512
    assert per_page_us < 2.0, per_page_us


# --------------------------------------------------------------------------- normalisation


def test_norm_hash():
    assert norm_hash(-3488128144981237669) == -3488128144981237669 + 2**64
    assert norm_hash(5) == 5
    assert norm_hash(2**64 - 1) == 2**64 - 1
    digest = bytes(range(32))
    assert norm_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert norm_hash(b"\x01\x02") == 0x0102
    for bad in (True, "12", 1.0, None, b"", [1]):
        with pytest.raises(ValueError):
            norm_hash(bad)


@given(st.integers(-(2**63), 2**63 - 1))
def test_signed_unsigned_round_trip(v):
    assert to_signed64(norm_hash(v)) == v
