"""mesh.kv_events: recorded shapes (SGLang maps/arrays, vLLM), round trips, tolerant decoding."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.errors import ProtocolError
from mesh.hashing import sglang_page_hashes, vllm_block_hashes
from mesh.kv_events import (
    MAX_HASHES_PER_EVENT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_event,
    decode_events,
    encode_batch,
    encode_event_array,
    encode_event_map,
)

H0, H1 = -3488128144981237669, 5674439469042975057  # worker-telemetry.md §8.2
U0, U1 = H0 + 2**64, H1

# The literal illustrative batch of worker-telemetry.md §2.4 (SGLang map form).
SGLANG_MAP_BATCH = [
    1700000000.5,
    [
        {"type": "BlockStored", "block_hashes": [H0, H1], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": 4, "lora_id": None, "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ],
    0,
]
EXPECTED = (
    BlockStored((U0, U1), None, (1, 2, 3, 4, 5, 6, 7, 8), 4, "GPU"),
    BlockRemoved((U1,), "GPU"),
    AllBlocksCleared(),
)


def packb(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# --------------------------------------------------------------------------- recorded shapes


def test_sglang_map_batch_from_the_reference():
    b = decode_batch(packb(SGLANG_MAP_BATCH))
    assert b == EventBatch(1700000000.5, EXPECTED, 0, {})


def test_encoders_reproduce_the_reference_batch():
    assert [encode_event_map(e) for e in EXPECTED] == SGLANG_MAP_BATCH[1]
    assert msgpack.unpackb(encode_batch(1700000000.5, EXPECTED, 0)) == SGLANG_MAP_BATCH


def test_sglang_0_5_18_arrays_with_trailing_nils_and_metadata_map():
    events = [
        ["BlockStored", [H0, H1], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", {"cache_salt": "s"}],
        ["BlockRemoved", [H1], "GPU"],
        ["AllBlocksCleared"],
    ]
    b = decode_batch(packb([1700000000.5, events, 0]))
    # the metadata map is not a lora_name; its cache_salt is the event's namespace
    assert isinstance(b, EventBatch) and b.events == (dataclasses.replace(EXPECTED[0], cache_salt="s"), *EXPECTED[1:])


def test_sglang_0_5_4_arrays_with_omitted_trailing_positions_and_two_element_batch():
    events = [["BlockStored", [H0], None, [1, 2, 3, 4], 4], ["BlockRemoved", [H0]]]
    b = decode_batch(packb([12.0, events]))
    assert isinstance(b, EventBatch)
    assert b.dp_rank is None
    assert b.events == (BlockStored((U0,), None, (1, 2, 3, 4), 4), BlockRemoved((U0,)))


def test_array_extra_positions_tolerated_and_lora_name_string():
    ev = ["BlockStored", [1], 7, [5, 6], 2, None, "CPU_PINNED", "adapter-x", None, 0, "full_attention", None, "more", 9]
    assert decode_event(ev) == BlockStored((1,), 7, (5, 6), 2, "CPU_PINNED", "adapter-x")


def test_vllm_map_shapes():
    toks = list(range(32))
    hs = vllm_block_hashes(toks, 16)
    stored = {
        "type": "BlockStored", "block_hashes": hs, "parent_block_hash": None, "token_ids": toks,
        "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
        "extra_keys": None, "kv_cache_spec_kind": "full_attention", "locality": "LOCAL",
        "session_id": "s1", "lookahead_token_ids": None,
    }
    removed = {"type": "BlockRemoved", "block_hashes": [hs[1]], "medium": "GPU", "group_idx": 0}
    evs, skipped = decode_events([stored, removed, {"type": "AllBlocksCleared"}])
    assert skipped == {}
    assert evs == [BlockStored(tuple(hs), None, tuple(toks), 16, "GPU"), BlockRemoved((hs[1],), "GPU"), AllBlocksCleared()]


def test_vllm_bytes_hashes_take_last_8_bytes():
    d0, d1 = bytes(range(32)), bytes(range(100, 132))
    ev = decode_event({"type": "BlockStored", "block_hashes": [d1], "parent_block_hash": d0,
                       "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "CPU", "lora_name": None})
    assert ev == BlockStored((int.from_bytes(d1[-8:], "big"),), int.from_bytes(d0[-8:], "big"), (1, 2), 2, "CPU")


def test_vllm_other_groups_are_skipped_with_their_own_reason():
    base = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1], "block_size": 1}
    objs = [
        {**base, "group_idx": 1},
        {**base, "kv_cache_spec_kind": "sliding_window"},
        {"type": "BlockRemoved", "block_hashes": [1], "group_idx": 2},
        ["BlockRemoved", [1], "GPU", 3],
        {**base, "group_idx": 0},
        {**base, "group_idx": None},
    ]
    evs, skipped = decode_events(objs)
    assert skipped == {"skipped_group": 4}
    assert len(evs) == 2
    with pytest.raises(ProtocolError) as ei:
        decode_event(objs[0])
    assert ei.value.reason == "skipped_group"


# --------------------------------------------------------------------------- EAGLE bigrams


def test_eagle_bigram_tokens_flattened_with_lookahead():
    pairs = [[10, 11], [11, 12], [12, 13], [13, 14]]
    ev = decode_event(["BlockStored", [11, 12], None, pairs, 2, None, None, None])
    assert ev == BlockStored((11, 12), None, (10, 11, 12, 13), 2, lookahead_token_id=14)
    assert encode_event_map(ev)["token_ids"] == pairs
    assert decode_event(encode_event_map(ev)) == ev
    assert decode_event(encode_event_array(ev)) == ev


def test_eagle_pairs_that_do_not_chain_are_unsupported():
    with pytest.raises(ProtocolError) as ei:
        decode_event(["BlockStored", [1], None, [[1, 2], [5, 6]], 2])
    assert ei.value.reason == "unsupported_tokens"


# --------------------------------------------------------------------------- round trips

u64 = st.integers(0, 2**64 - 1)
tok = st.integers(0, 2**32 - 1)
medium = st.sampled_from([None, "GPU", "CPU_PINNED", "DISK", "EXTERNAL"])


@st.composite
def stored(draw):
    n = draw(st.integers(1, 4))
    bs = draw(st.integers(1, 6))
    return BlockStored(
        tuple(draw(st.lists(u64, min_size=n, max_size=n))),
        draw(st.none() | u64),
        tuple(draw(st.lists(tok, min_size=n * bs, max_size=n * bs))),
        bs,
        draw(medium),
        draw(st.none() | st.text(max_size=8)),
        draw(st.none() | tok),
        draw(st.none() | st.text(max_size=8)),  # cache_salt
    )


events = st.one_of(
    stored(),
    st.builds(BlockRemoved, st.lists(u64, max_size=5).map(tuple), medium),
    st.just(AllBlocksCleared()),
)


@given(events)
def test_round_trip_single_event(ev):
    assert decode_event(encode_event_map(ev)) == ev
    assert decode_event(encode_event_array(ev)) == ev


@given(st.lists(events, max_size=6), st.none() | st.integers(0, 1023), st.sampled_from(["map", "array"]))
def test_round_trip_batch_through_msgpack(evs, rank, form):
    b = decode_batch(encode_batch(123.25, evs, rank, form=form))
    assert b == EventBatch(123.25, tuple(evs), rank, {})


def test_encoders_send_signed_int64():
    ev = BlockStored((2**64 - 1,), 2**63, (1,), 1, "GPU")
    m = encode_event_map(ev)
    assert m["block_hashes"] == [-1] and m["parent_block_hash"] == -(2**63)
    assert m["lora_id"] is None and "lora_name" not in m
    assert encode_event_array(BlockRemoved((2**64 - 2,))) == ["BlockRemoved", [-2], None]
    with pytest.raises(ValueError):
        encode_batch(0.0, [], 0, form="json")  # type: ignore[arg-type]


def test_engine_style_hashes_survive_the_wire():
    toks = list(range(1, 33))
    signed = sglang_page_hashes(toks, 16)
    ev = BlockStored(tuple(h & (2**64 - 1) for h in signed), None, tuple(toks), 16, "GPU")
    assert encode_event_map(ev)["block_hashes"] == signed


# --------------------------------------------------------------------------- negative cases

GOOD = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2}

BAD_EVENTS = [
    ({"type": "BlockEvicted", "block_hashes": [1]}, "unknown_event_type"),
    (["Whatever", 1], "unknown_event_type"),
    ({"block_hashes": [1]}, "bad_event"),  # no type
    ({"type": 7}, "bad_event"),
    ({**GOOD, "block_hashes": "abc"}, "bad_event"),
    ({**GOOD, "block_hashes": [1.5]}, "bad_event"),
    ({**GOOD, "block_hashes": [True]}, "bad_event"),
    ({**GOOD, "block_hashes": [2**64]}, "bad_event"),
    ({**GOOD, "block_hashes": [-(2**63) - 1]}, "bad_event"),
    ({**GOOD, "block_hashes": []}, "bad_event"),
    ({**GOOD, "block_hashes": [b""]}, "bad_event"),
    ({**GOOD, "parent_block_hash": "p"}, "bad_event"),
    ({**GOOD, "block_size": 0}, "bad_event"),
    ({**GOOD, "block_size": True}, "bad_event"),
    ({**GOOD, "block_size": "2"}, "bad_event"),
    ({**GOOD, "token_ids": [1, 2, 3]}, "bad_event"),  # length mismatch
    ({**GOOD, "token_ids": [1]}, "bad_event"),
    ({**GOOD, "token_ids": [1, -2]}, "bad_event"),
    ({**GOOD, "token_ids": [1, 2**32]}, "bad_event"),
    ({**GOOD, "token_ids": [1, "2"]}, "bad_event"),
    ({**GOOD, "token_ids": [1, 2.0]}, "bad_event"),
    ({**GOOD, "token_ids": None}, "bad_event"),
    ({**GOOD, "medium": 5}, "bad_event"),
    ({**GOOD, "token_ids": [[1, 2], 3]}, "unsupported_tokens"),
    ({**GOOD, "block_hashes": [1] * (MAX_HASHES_PER_EVENT + 1)}, "bad_event"),
    ({"type": "BlockRemoved"}, "bad_event"),
    (["BlockStored", [1], None], "bad_event"),
    (["BlockRemoved"], "bad_event"),
    ([], "bad_event"),
    ([1, 2], "bad_event"),
    (None, "bad_event"),
    (42, "bad_event"),
    ("BlockStored", "bad_event"),
    (b"\x00", "bad_event"),
]


@pytest.mark.parametrize("obj,reason", BAD_EVENTS)
def test_bad_single_event_raises_protocol_error(obj, reason):
    with pytest.raises(ProtocolError) as ei:
        decode_event(obj)
    assert ei.value.reason == reason


def test_decode_events_skips_and_counts_without_raising():
    objs = [GOOD] + [o for o, _ in BAD_EVENTS] + [{"type": "AllBlocksCleared"}]
    evs, skipped = decode_events(objs)
    assert evs == [BlockStored((1,), None, (1, 2), 2), AllBlocksCleared()]
    expected: dict[str, int] = {}
    for _, r in BAD_EVENTS:
        expected[r] = expected.get(r, 0) + 1
    assert skipped == expected
    assert decode_events("not a list") == ([], {"bad_batch": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "payload,reason",
    [
        (b"", "bad_msgpack"),
        (b"\xc1", "bad_msgpack"),
        (b"\x92\x01", "bad_msgpack"),  # truncated
        (packb([1.0, []]) + b"\x00", "bad_msgpack"),  # trailing bytes
        (packb({"ts": 1.0}), "bad_batch"),
        (packb([1.0]), "bad_batch"),
        (packb(["1.0", []]), "bad_batch"),
        (packb([float("nan"), []]), "bad_batch"),
        (packb([True, []]), "bad_batch"),
        (packb([1.0, {}]), "bad_batch"),
        (packb([1.0, [], -1]), "bad_batch"),
        (packb([1.0, [], "0"]), "bad_batch"),
    ],
)
def test_decode_batch_garbage_returns_protocol_error(payload, reason):
    r = decode_batch(payload)
    assert isinstance(r, ProtocolError) and r.reason == reason


def test_decode_batch_counts_skipped_events():
    b = decode_batch(packb([1.0, [GOOD, {"type": "Nope"}, 5], 3]))
    assert isinstance(b, EventBatch)
    assert b.events == (BlockStored((1,), None, (1, 2), 2),) and b.dp_rank == 3
    assert b.skipped == {"unknown_event_type": 1, "bad_event": 1}


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_decode_batch_never_raises_on_random_bytes(data):
    assert isinstance(decode_batch(data), (EventBatch, ProtocolError))


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)


@settings(max_examples=300)
@given(st.lists(msgpack_values, max_size=8))
def test_decode_events_never_raises_on_arbitrary_values(objs):
    evs, skipped = decode_events(objs)
    assert len(evs) + sum(skipped.values()) == len(objs)


@settings(max_examples=200)
@given(st.lists(st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"]), max_size=6), msgpack_values)
def test_decode_events_never_raises_on_mutated_good_events(keys, value):
    mutated = dict(GOOD)
    for k in keys:
        mutated[k] = value
    evs, skipped = decode_events([mutated, ["BlockStored", *[value] * len(keys)]])
    assert len(evs) + sum(skipped.values()) == 2
