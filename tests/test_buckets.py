"""Bucket config: loading, every validation rule (messages name bucket and field), selectors,
compatible-bucket selection and SLO ordering. Pure, fast."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mesh.errors import ConfigError, ErrorCode, RequestError
from mesh.routing.buckets import (
    BucketConfig,
    SloError,
    decode_buckets_for,
    load_bucket_config,
    parse_bucket_config,
    prefill_buckets_for,
    validate_slo,
)

ROOT = Path(__file__).resolve().parent.parent


def P(id="p", rank=10, **kw):
    return {"id": id, "stage": "prefill", "rank": rank, "worker_ids": kw.pop("worker_ids", ["w-0"]), **kw}


def D(id="d", rank=10, **kw):
    return {"id": id, "stage": "decode", "rank": rank, "worker_ids": kw.pop("worker_ids", ["w-9"]), **kw}


def cfg(*buckets, **top):
    return {"buckets": list(buckets), **top}


def bad(data, *needles):
    with pytest.raises(ConfigError) as ei:
        parse_bucket_config(data)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


# ------------------------------------------------------------------ loading


def test_example_config_loads_and_matches_the_simulated_fleet():
    c = load_bucket_config(ROOT / "configs" / "buckets-example.toml")
    assert [b.id for b in c.prefill] == ["prefill-short", "prefill-long"]
    assert [b.id for b in c.decode] == ["decode-all"]
    short, long_ = c.prefill
    assert short.selects({"pool": "short", "stage": "prefill"}) and not short.selects({"pool": "long"})
    assert long_.selects({"pool": "long"})
    assert c.decode[0].selects({"stage": "decode"})
    assert c.ttft_slo_policy == "slo_first"


def test_json_and_toml_are_equivalent(tmp_path):
    data = cfg(P("a", max_extend_tokens=100, match_labels={"pool": ["x", "y"]}), D("d", tps_p05_at_capacity=2.5),
               ttft_slo_policy="best_effort")
    j = tmp_path / "b.json"
    j.write_text(json.dumps(data))
    t = tmp_path / "b.toml"
    t.write_text('ttft_slo_policy = "best_effort"\n'
                 '[[buckets]]\nid = "a"\nstage = "prefill"\nrank = 10\nworker_ids = ["w-0"]\n'
                 'max_extend_tokens = 100\nmatch_labels = { pool = ["x", "y"] }\n'
                 '[[buckets]]\nid = "d"\nstage = "decode"\nrank = 10\nworker_ids = ["w-9"]\ntps_p05_at_capacity = 2.5\n')
    assert load_bucket_config(j) == load_bucket_config(t)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_bucket_config(tmp_path / "nope.toml")
    p = tmp_path / "x.toml"
    p.write_text("buckets = [")
    with pytest.raises(ConfigError, match="x.toml"):
        load_bucket_config(p)
    p.write_text('[[buckets]]\nid = "a"\nstage = "prefill"\nrank = 1\n')
    with pytest.raises(ConfigError, match=r"x\.toml: bucket 'a': worker_ids"):
        load_bucket_config(p)


# ------------------------------------------------------------------ every validation rule


def test_unknown_fields_rejected():
    bad(cfg(P(), buckets_x=1), "buckets_x", "unknown top-level field")
    bad(cfg(P(workers=["a"])), "bucket 'p'", "workers", "unknown field")


def test_rule1_buckets_non_empty():
    bad({"buckets": []}, "buckets", "non-empty")
    bad({}, "buckets", "non-empty")
    bad({"buckets": [1]}, "buckets[0]")


def test_rule2_ids_non_empty_and_unique():
    bad(cfg(P(id="")), "buckets[0]", "id", "non-empty")
    bad(cfg({"stage": "prefill", "rank": 1, "worker_ids": ["a"]}), "buckets[0]", "id")
    bad(cfg(P("a", 10), P("a", 20, worker_ids=["w-1"])), "bucket 'a'", "id", "duplicate")


def test_rule3_rank_unique_within_stage():
    bad(cfg(P("a", 10), P("b", 10, worker_ids=["w-1"])), "bucket 'b'", "rank", "'a'")
    parse_bucket_config(cfg(P("a", 10), D("d", 10)))  # same rank, different stage: fine
    bad(cfg(P(rank=-1)), "bucket 'p'", "rank")
    bad(cfg(P(rank=1 << 32)), "bucket 'p'", "rank")
    bad(cfg(P(rank="1")), "bucket 'p'", "rank")
    bad(cfg({"id": "p", "stage": "prefill", "worker_ids": ["a"]}), "bucket 'p'", "rank", "required")


def test_rule4_members_non_empty_no_empty_or_duplicate_ids():
    bad(cfg(P(worker_ids=[])), "bucket 'p'", "worker_ids", "members")
    bad(cfg(P(worker_ids=["a", ""])), "bucket 'p'", "worker_ids", "empty")
    bad(cfg(P(worker_ids=["a", "a"])), "bucket 'p'", "worker_ids", "duplicate")
    bad(cfg(P(worker_ids="a")), "bucket 'p'", "worker_ids")
    parse_bucket_config(cfg(P(worker_ids=[], match_labels={"pool": "x"})))  # selector alone is enough


def test_rule5_worker_in_at_most_one_bucket_per_stage():
    bad(cfg(P("a", 10, worker_ids=["w-0"]), P("b", 20, worker_ids=["w-0"])), "bucket 'b'", "worker_ids", "'w-0'", "'a'")
    parse_bucket_config(cfg(P("a", worker_ids=["w-0"]), D("d", worker_ids=["w-0"])))  # one prefill + one decode: fine
    bad(cfg(P("a", 10, match_labels={"pool": "x"}), P("b", 20, worker_ids=[], match_labels={"pool": "x"})),
        "bucket 'b'", "match_labels", "'a'")


def test_rule6_min_le_max():
    bad(cfg(P(min_extend_tokens=10, max_extend_tokens=5)), "bucket 'p'", "min_extend_tokens", "max_extend_tokens")
    bad(cfg(D(min_sequence_tokens=10, max_sequence_tokens=5)), "bucket 'd'", "min_sequence_tokens")
    parse_bucket_config(cfg(P(min_extend_tokens=5, max_extend_tokens=5)))


@pytest.mark.parametrize("field,maker", [
    ("max_context_tokens", P), ("max_context_tokens", D), ("ttft_p95_at_capacity_ms", P),
    ("max_pending_prefill_tokens", P),
])
def test_rule7_positive_limits(field, maker):
    b = maker(**{field: 0})
    bad(cfg(b) if maker is P else cfg(P(), b), f"bucket '{b['id']}'", field, "> 0")
    b = maker(**{field: -3})
    bad(cfg(b) if maker is P else cfg(P(), b), field)
    b = maker(**{field: 1.5})
    bad(cfg(b) if maker is P else cfg(P(), b), field, "integer")


@pytest.mark.parametrize("v", [0, -1.0, math.inf, math.nan, "3", True])
def test_rule7_tps_finite_positive(v):
    bad(cfg(P(), D(tps_p05_at_capacity=v)), "bucket 'd'", "tps_p05_at_capacity")


@pytest.mark.parametrize("field", ["min_sequence_tokens", "max_sequence_tokens", "tps_p05_at_capacity"])
def test_rule8_decode_fields_not_on_prefill(field):
    bad(cfg(P(**{field: 5})), "bucket 'p'", field, "not allowed on a prefill bucket")


@pytest.mark.parametrize("field", ["min_extend_tokens", "max_extend_tokens", "ttft_p95_at_capacity_ms", "max_pending_prefill_tokens"])
def test_rule8_prefill_fields_not_on_decode(field):
    bad(cfg(P(), D(**{field: 5})), "bucket 'd'", field, "not allowed on a decode bucket")


def test_rule9_at_least_one_prefill_bucket():
    bad(cfg(D()), "buckets", "without a Prefill domain")
    c = parse_bucket_config(cfg(P()))  # zero decode buckets is legal
    assert c.decode == ()


def test_stage_slo_policy_and_selector_types():
    bad(cfg(P(stage="mixed")), "bucket 'p'", "stage")
    bad(cfg(P(), ttft_slo_policy="fast"), "ttft_slo_policy")
    bad(cfg(P(), tps_slo_policy=None), "tps_slo_policy")
    bad(cfg(P(match_labels=["pool"])), "bucket 'p'", "match_labels")
    bad(cfg(P(match_labels={"pool": 3})), "bucket 'p'", "match_labels", "pool")
    bad(cfg(P(match_labels={"pool": []})), "bucket 'p'", "match_labels")
    bad(cfg(P(match_labels={"": "x"})), "bucket 'p'", "match_labels")


# ------------------------------------------------------------------ selectors


def test_selector_semantics():
    c = parse_bucket_config(cfg(P(worker_ids=[], match_labels={"pool": ["a", "b"], "zone": "z1"})))
    b = c.prefill[0]
    assert b.selects({"pool": "a", "zone": "z1", "other": "x"})
    assert b.selects({"pool": "b", "zone": "z1"})
    assert not b.selects({"pool": "c", "zone": "z1"})
    assert not b.selects({"pool": "a"})
    c2 = parse_bucket_config(cfg(P()))
    assert not c2.prefill[0].selects({"pool": "a"})  # no selector: explicit ids only


# ------------------------------------------------------------------ SLO validation


@pytest.mark.parametrize("ttft,tps", [(0, None), (-5, None), (1.5, None), ("100", None), (True, None),
                                      (None, 0.0), (None, -1.0), (None, math.inf), (None, math.nan), (None, "3")])
def test_validate_slo_rejects(ttft, tps):
    with pytest.raises(SloError) as ei:
        validate_slo(ttft, tps)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, RequestError)
    assert ei.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("ttft, tps", [(None, None), (1, None), (None, 1e-9), (1, 0.5), (200, 30), (2**40, 1e12)])
def test_validate_slo_accepts(ttft, tps):
    # the smallest legal values pass; their neighbours one step outside are refused
    assert validate_slo(ttft, tps) is None
    if ttft is not None:
        with pytest.raises(SloError):
            validate_slo(ttft - ttft, tps)  # 0 ms
        with pytest.raises(SloError):
            validate_slo(float(ttft), tps)  # a float is not an integer of ms
    if tps is not None:
        with pytest.raises(SloError):
            validate_slo(ttft, -tps)


# ------------------------------------------------------------------ compatible buckets and ordering


def test_prefill_compatibility_by_extend_and_context():
    c = parse_bucket_config(cfg(P("short", 10, max_extend_tokens=100, max_context_tokens=1000),
                                P("long", 20, worker_ids=["w-1"], min_extend_tokens=101, max_context_tokens=500),
                                P("any", 30, worker_ids=["w-2"])))
    ids = lambda L: [b.id for b in prefill_buckets_for(c, L, None)]  # noqa: E731
    assert ids(100) == ["short", "any"]
    assert ids(101) == ["long", "any"]
    assert ids(501) == ["any"]  # above long's context ceiling


def test_decode_compatibility_known_and_unknown_peak():
    c = parse_bucket_config(cfg(P(), D("small", 10, max_sequence_tokens=1000), D("big", 20, worker_ids=["w-8"], min_sequence_tokens=1001,
                                                                              max_context_tokens=5000)))
    ids = lambda L, S: [b.id for b in decode_buckets_for(c, L, S, None)]  # noqa: E731
    assert ids(100, 1000) == ["small"]
    assert ids(100, 2000) == ["big"]
    assert ids(100, 6000) == []  # decode buckets exist but none fits
    assert ids(100, None) == []  # unknown peak: only catch-all buckets qualify
    c2 = parse_bucket_config(cfg(P(), D("all", 10, max_context_tokens=500), D("r", 20, worker_ids=["w-8"], max_sequence_tokens=100)))
    assert [b.id for b in decode_buckets_for(c2, 400, None, None)] == ["all"]
    assert [b.id for b in decode_buckets_for(c2, 600, None, None)] == []
    assert decode_buckets_for(parse_bucket_config(cfg(P())), 1, 2, None) is None  # no decode buckets: global pool


def _ttft_cfg(policy):
    return parse_bucket_config(cfg(P("fast", 30, ttft_p95_at_capacity_ms=100), P("slow", 10, worker_ids=["w-1"], ttft_p95_at_capacity_ms=900),
                                   P("none", 20, worker_ids=["w-2"]), ttft_slo_policy=policy))


@pytest.mark.parametrize("policy,slo,order", [
    ("disabled", 200, ["slow", "none", "fast"]),
    ("slo_first", 200, ["fast", "slow", "none"]),
    ("best_effort", 200, ["slow", "none", "fast"]),
    ("slo_first", 1000, ["slow", "fast", "none"]),  # no estimate = not eligible when the request has an SLO
    ("best_effort", 1000, ["none", "slow", "fast"]),
    ("slo_first", None, ["slow", "none", "fast"]),  # no SLO: everything eligible, rank order
    ("best_effort", None, ["slow", "none", "fast"]),
])
def test_ttft_slo_ordering(policy, slo, order):
    assert [b.id for b in prefill_buckets_for(_ttft_cfg(policy), 10, slo)] == order


@pytest.mark.parametrize("policy,slo,order", [
    ("disabled", 50.0, ["d1", "d2", "d3"]),
    ("slo_first", 50.0, ["d2", "d1", "d3"]),
    ("best_effort", 50.0, ["d1", "d3", "d2"]),
    ("slo_first", None, ["d1", "d2", "d3"]),
])
def test_tps_slo_ordering(policy, slo, order):
    c = parse_bucket_config(cfg(P(), D("d1", 1, tps_p05_at_capacity=10.0), D("d2", 2, worker_ids=["w-8"], tps_p05_at_capacity=80.0),
                                D("d3", 3, worker_ids=["w-7"]), tps_slo_policy=policy))
    assert [b.id for b in decode_buckets_for(c, 10, 20, slo)] == order


def test_rank_ties_impossible_and_order_is_rank_then_id():
    c = parse_bucket_config(cfg(P("b", 5), P("a", 7, worker_ids=["w-1"]), P("c", 1, worker_ids=["w-2"])))
    assert [b.id for b in c.prefill] == ["c", "b", "a"]
    assert isinstance(c, BucketConfig)
