"""mesh.hashing: engine hash vectors, the content key contract, normalisation."""

from __future__ import annotations


import pytest
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


def _scalar_content_keys(tokens, bs, parent=ROOT_KEY):
    """The documented formula in plain Python ints (independent of the numpy implementation)."""
    mask = (1 << 64) - 1

    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    coeffs = [mix(CONTENT_KEY_SEED + i) | 1 for i in range(bs)]
    key, out = parent, []
    for k in range(len(tokens) // bs):
        page = mix((sum(t * c for t, c in zip(tokens[k * bs:(k + 1) * bs], coeffs)) + bs * 0xD6E8FEB86659FD93) & mask)
        key = (key * 0x9E3779B97F4A7C15 + page) & mask
        out.append(key)
    return out


def test_content_key_formula_and_golden_values():
    toks = list(range(40))
    keys = content_keys(toks, 16)
    assert keys == _scalar_content_keys(toks, 16)
    # Pinned values: any host, any process, any Python must produce exactly these.
    assert keys == [10962548295621117716, 9962193778315659427]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.sampled_from([1, 2, 3, 16, 64]), st.integers(0, 2**64 - 1))
def test_content_keys_match_scalar_formula(tokens, bs, parent):
    assert content_keys(tokens, bs, parent) == _scalar_content_keys(tokens, bs, parent)


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


def test_short_prompts_take_the_integer_path_and_get_the_same_keys(monkeypatch):
    """Prompts under ``_SMALL_TOKENS`` are keyed without numpy (its fixed cost per call was most
    of a short request's routing time); both paths give identical keys for every page size."""
    import random

    from mesh import hashing as H

    rng = random.Random(7)
    for _ in range(1500):
        bs = rng.choice([1, 2, 3, 8, 16, 32, 64])
        toks = [rng.randrange(0, 2**32) for _ in range(rng.randrange(0, 2 * H._SMALL_TOKENS))]
        parent = rng.choice([H.ROOT_KEY, rng.randrange(0, 2**64)])
        buf = H.pack_tokens(toks)
        fast = H.content_keys_from_packed(buf, bs, parent)
        monkeypatch.setattr(H, "_SMALL_TOKENS", -1)
        assert H.content_keys_from_packed(buf, bs, parent) == fast, (bs, len(toks))
        monkeypatch.setattr(H, "_SMALL_TOKENS", 96)


def test_a_repeated_short_prompt_is_keyed_once_and_callers_get_their_own_list():
    """The keys of short prompts are memoised (bounded): the same pages again (a trailing partial
    page aside) are a memo hit, not a rehash; each caller gets a fresh list it may change."""
    from mesh import hashing as H

    toks = list(range(1000, 1040))  # 2 full pages of 16 and a partial one
    first = H.content_keys(toks, 16, 5)
    before = H._content_keys_small_memo.cache_info()
    again = H.content_keys(toks[:35], 16, 5)  # the same full pages, a shorter tail
    after = H._content_keys_small_memo.cache_info()
    assert again == first and len(first) == 2
    assert after.hits == before.hits + 1 and after.misses == before.misses
    again.append(0)  # the memo keeps its own copy
    assert H.content_keys(toks, 16, 5) == first
    assert H.content_keys(toks, 16, 6) != first  # the parent is part of the key
    assert H._content_keys_small_memo.cache_info().maxsize == 4096  # bounded
