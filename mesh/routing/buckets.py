"""Bucket configuration: schema, loading, strict validation, label selectors, compatible buckets.

A *bucket* is a named, ranked group of workers for one stage (``prefill`` or ``decode``) with
token-range constraints, an optional SLO profile and an optional prefill queue limit (SGLang
#38108's bucket config, see ``sglang-router-design.md`` §1-§2). Lower rank = higher priority.

mesh extends SGLang's membership: besides explicit ``worker_ids`` a bucket may carry a label
selector ``match_labels`` (``{key = "value"}`` or ``{key = ["a", "b"]}`` for any-of), matched
against the labels workers send in READY, so a worker that joins later falls into its bucket
without a restart. A worker belongs to at most one bucket per stage: an explicit id wins over a
selector, and among selectors the bucket with the lowest ``(rank, id)`` wins.

File format: TOML (top-level keys plus ``[[buckets]]`` tables) or JSON (same object), chosen by
the ``.json`` suffix. Unknown fields are rejected; every error names the bucket and the field.
Pure code apart from :func:`load_bucket_config` reading the file.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from mesh.errors import ConfigError, ErrorCode, FatalRequestError

__all__ = [
    "STAGES",
    "SLO_POLICIES",
    "BucketSpec",
    "BucketConfig",
    "SloError",
    "load_bucket_config",
    "parse_bucket_config",
    "validate_slo",
    "order_by_slo",
    "prefill_buckets_for",
    "decode_buckets_for",
]

STAGES = ("prefill", "decode")
SLO_POLICIES = ("disabled", "slo_first", "best_effort")

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1
_TOP_FIELDS = ("buckets", "ttft_slo_policy", "tps_slo_policy")
_BUCKET_FIELDS = (
    "id", "stage", "rank", "worker_ids", "match_labels",
    "min_extend_tokens", "max_extend_tokens", "min_sequence_tokens", "max_sequence_tokens",
    "max_context_tokens", "ttft_p95_at_capacity_ms", "tps_p05_at_capacity", "max_pending_prefill_tokens",
)
_PREFILL_ONLY = ("min_extend_tokens", "max_extend_tokens", "ttft_p95_at_capacity_ms", "max_pending_prefill_tokens")
_DECODE_ONLY = ("min_sequence_tokens", "max_sequence_tokens", "tps_p05_at_capacity")


class SloError(FatalRequestError, ValueError):
    """A request carries an invalid SLO (maps to ``bad_request`` / HTTP 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.BAD_REQUEST, message)


def validate_slo(ttft_slo_ms: Any, tps_slo: Any) -> None:
    """Raise :class:`SloError` unless ``ttft_slo_ms`` is None or a positive int and ``tps_slo`` is
    None or a finite positive number (SGLang's ``x-sgl-ttft-slo-ms`` / ``x-sgl-tps-slo`` rules)."""
    if ttft_slo_ms is not None and (type(ttft_slo_ms) is not int or ttft_slo_ms <= 0):
        raise SloError(f"ttft_slo_ms must be a positive integer (ms), got {ttft_slo_ms!r}")
    if tps_slo is not None and (
        isinstance(tps_slo, bool) or not isinstance(tps_slo, (int, float)) or not math.isfinite(tps_slo) or tps_slo <= 0
    ):
        raise SloError(f"tps_slo must be a finite positive number (tokens/s), got {tps_slo!r}")


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One validated bucket. ``match_labels`` maps a label key to the accepted values."""

    id: str
    stage: str
    rank: int
    worker_ids: tuple[str, ...] = ()
    match_labels: tuple[tuple[str, frozenset[str]], ...] = ()
    min_extend_tokens: int | None = None
    max_extend_tokens: int | None = None
    min_sequence_tokens: int | None = None
    max_sequence_tokens: int | None = None
    max_context_tokens: int | None = None
    ttft_p95_at_capacity_ms: int | None = None
    tps_p05_at_capacity: float | None = None
    max_pending_prefill_tokens: int | None = None

    def selects(self, labels: Mapping[str, str]) -> bool:
        """True when the label selector matches ``labels`` (an empty selector matches nothing)."""
        if not self.match_labels:
            return False
        for key, values in self.match_labels:
            v = labels.get(key)
            if v is None or v not in values:
                return False
        return True

    @property
    def catch_all_decode(self) -> bool:
        return self.min_sequence_tokens is None and self.max_sequence_tokens is None

    def fits_prefill(self, input_tokens: int) -> bool:
        """Extend range and context ceiling (unset bounds are open; with no cache hit E = L)."""
        L = input_tokens
        return ((self.min_extend_tokens is None or self.min_extend_tokens <= L)
                and (self.max_extend_tokens is None or L <= self.max_extend_tokens)
                and (self.max_context_tokens is None or L <= self.max_context_tokens))

    def fits_decode(self, input_tokens: int, peak_tokens: int | None) -> bool:
        """Sequence range for a known peak S; only catch-all buckets when S is unknown."""
        if peak_tokens is None:
            return self.catch_all_decode and (self.max_context_tokens is None or input_tokens <= self.max_context_tokens)
        S = peak_tokens
        return ((self.min_sequence_tokens is None or self.min_sequence_tokens <= S)
                and (self.max_sequence_tokens is None or S <= self.max_sequence_tokens)
                and (self.max_context_tokens is None or S <= self.max_context_tokens))

    def ttft_eligible(self, ttft_slo_ms: int | None) -> bool:
        if ttft_slo_ms is None:
            return True
        return self.ttft_p95_at_capacity_ms is not None and self.ttft_p95_at_capacity_ms <= ttft_slo_ms

    def tps_eligible(self, tps_slo: float | None) -> bool:
        if tps_slo is None:
            return True
        return self.tps_p05_at_capacity is not None and self.tps_p05_at_capacity >= tps_slo


@dataclass(frozen=True, slots=True)
class BucketConfig:
    """A validated bucket config. ``prefill`` / ``decode`` are sorted by ``(rank, id)``."""

    buckets: tuple[BucketSpec, ...]
    ttft_slo_policy: str = "disabled"
    tps_slo_policy: str = "disabled"
    prefill: tuple[BucketSpec, ...] = field(default=(), compare=False)
    decode: tuple[BucketSpec, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        key = lambda b: (b.rank, b.id)  # noqa: E731
        object.__setattr__(self, "prefill", tuple(sorted((b for b in self.buckets if b.stage == "prefill"), key=key)))
        object.__setattr__(self, "decode", tuple(sorted((b for b in self.buckets if b.stage == "decode"), key=key)))

    def bucket(self, bucket_id: str) -> BucketSpec:
        for b in self.buckets:
            if b.id == bucket_id:
                return b
        raise KeyError(bucket_id)


# --------------------------------------------------------------------------- loading


def load_bucket_config(path: str | Path) -> BucketConfig:
    """Read and validate a bucket config file (``.json`` = JSON, anything else = TOML)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"bucket config {p} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"bucket config {p}: {exc}") from exc
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"bucket config {p}: {exc}") from exc
    try:
        return parse_bucket_config(data)
    except ConfigError as exc:
        raise ConfigError(f"bucket config {p}: {exc}") from None


def _err(where: str, fld: str, msg: str) -> ConfigError:
    return ConfigError(f"{where}: {fld}: {msg}")


def _uint(where: str, d: Mapping[str, Any], name: str, hi: int = _U64_MAX, *, positive: bool = False) -> int | None:
    v = d.get(name)
    if v is None:
        return None
    if type(v) is not int:
        raise _err(where, name, f"expected an integer, got {v!r}")
    if v < 0 or v > hi:
        raise _err(where, name, f"must be in [0, {hi}], got {v}")
    if positive and v == 0:
        raise _err(where, name, "must be > 0")
    return v


def _labels(where: str, v: Any) -> tuple[tuple[str, frozenset[str]], ...]:
    if v is None:
        return ()
    if not isinstance(v, Mapping):
        raise _err(where, "match_labels", f'expected a table of label = "value" (or ["a", "b"]), got {v!r}')
    out = []
    for k, val in v.items():
        if not isinstance(k, str) or not k:
            raise _err(where, "match_labels", f"label keys must be non-empty strings, got {k!r}")
        if isinstance(val, str):
            vals = [val]
        elif isinstance(val, list) and val and all(isinstance(x, str) for x in val):
            vals = val
        else:
            raise _err(where, "match_labels", f"{k}: expected a string or a non-empty list of strings, got {val!r}")
        out.append((k, frozenset(vals)))
    return tuple(sorted(out, key=lambda t: t[0]))


def _parse_bucket(i: int, raw: Any) -> BucketSpec:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"buckets[{i}]: expected a table/object, got {type(raw).__name__}")
    bid = raw.get("id")
    if not isinstance(bid, str):
        raise ConfigError(f"buckets[{i}]: id: required non-empty string, got {bid!r}")
    if not bid:
        raise ConfigError(f"buckets[{i}]: id: must be non-empty")
    where = f"bucket {bid!r}"
    unknown = sorted(set(raw) - set(_BUCKET_FIELDS))
    if unknown:
        raise _err(where, unknown[0], f"unknown field (known: {', '.join(_BUCKET_FIELDS)})")
    stage = raw.get("stage")
    if stage not in STAGES:
        raise _err(where, "stage", f"must be prefill or decode, got {stage!r}")
    if "rank" not in raw:
        raise _err(where, "rank", "required (u32, lower = higher priority)")
    rank = _uint(where, raw, "rank", _U32_MAX)
    wids = raw.get("worker_ids", [])
    if not isinstance(wids, list) or not all(isinstance(w, str) for w in wids):
        raise _err(where, "worker_ids", f"expected a list of strings, got {wids!r}")
    if any(not w for w in wids):
        raise _err(where, "worker_ids", "contains an empty worker id")
    seen: set[str] = set()
    for w in wids:
        if w in seen:
            raise _err(where, "worker_ids", f"duplicate worker id {w!r}")
        seen.add(w)
    labels = _labels(where, raw.get("match_labels"))
    if not wids and not labels:
        raise _err(where, "worker_ids", "a bucket needs members: a non-empty worker_ids list and/or a match_labels selector")
    wrong = _PREFILL_ONLY if stage == "decode" else _DECODE_ONLY
    for name in wrong:
        if raw.get(name) is not None:
            raise _err(where, name, f"not allowed on a {stage} bucket")
    vals = {n: _uint(where, raw, n) for n in ("min_extend_tokens", "max_extend_tokens", "min_sequence_tokens", "max_sequence_tokens")}
    for lo, hi in (("min_extend_tokens", "max_extend_tokens"), ("min_sequence_tokens", "max_sequence_tokens")):
        if vals[lo] is not None and vals[hi] is not None and vals[lo] > vals[hi]:
            raise _err(where, lo, f"must be <= {hi} ({vals[lo]} > {vals[hi]})")
    ctx = _uint(where, raw, "max_context_tokens", positive=True)
    ttft = _uint(where, raw, "ttft_p95_at_capacity_ms", positive=True)
    pend = _uint(where, raw, "max_pending_prefill_tokens", positive=True)
    tps = raw.get("tps_p05_at_capacity")
    if tps is not None:
        if isinstance(tps, bool) or not isinstance(tps, (int, float)) or not math.isfinite(tps) or tps <= 0:
            raise _err(where, "tps_p05_at_capacity", f"must be a finite number > 0, got {tps!r}")
        tps = float(tps)
    return BucketSpec(bid, stage, rank, tuple(wids), labels, vals["min_extend_tokens"], vals["max_extend_tokens"],
                      vals["min_sequence_tokens"], vals["max_sequence_tokens"], ctx, ttft, tps, pend)


def parse_bucket_config(data: Any) -> BucketConfig:
    """Validate a decoded config object (SGLang §1.5 rules plus label selectors)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"bucket config: expected a table/object at the top level, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_TOP_FIELDS))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown top-level field (known: {', '.join(_TOP_FIELDS)})")
    pols = {}
    for name in ("ttft_slo_policy", "tps_slo_policy"):
        v = data.get(name, "disabled")
        if v not in SLO_POLICIES:
            raise ConfigError(f"{name}: must be one of {', '.join(SLO_POLICIES)}, got {v!r}")
        pols[name] = v
    raw = data.get("buckets")
    if not isinstance(raw, list) or not raw:
        raise ConfigError("buckets: must be a non-empty list of buckets ([[buckets]] tables)")
    specs = [_parse_bucket(i, b) for i, b in enumerate(raw)]
    ids: dict[str, int] = {}
    ranks: dict[tuple[str, int], str] = {}
    owner: dict[tuple[str, str], str] = {}
    selectors: dict[tuple[str, Any], str] = {}
    for b in specs:
        where = f"bucket {b.id!r}"
        if b.id in ids:
            raise _err(where, "id", "duplicate bucket id")
        ids[b.id] = 1
        other = ranks.get((b.stage, b.rank))
        if other is not None:
            raise _err(where, "rank", f"rank {b.rank} already used by {b.stage} bucket {other!r} (rank is unique within a stage)")
        ranks[(b.stage, b.rank)] = b.id
        for w in b.worker_ids:
            other = owner.get((b.stage, w))
            if other is not None:
                raise _err(where, "worker_ids", f"worker {w!r} is already in {b.stage} bucket {other!r} (a worker belongs to at most one bucket per stage)")
            owner[(b.stage, w)] = b.id
        if b.match_labels:
            other = selectors.get((b.stage, b.match_labels))
            if other is not None:
                raise _err(where, "match_labels", f"same selector as {b.stage} bucket {other!r} (a worker belongs to at most one bucket per stage)")
            selectors[(b.stage, b.match_labels)] = b.id
    if not any(b.stage == "prefill" for b in specs):
        raise ConfigError("buckets: at least one prefill bucket is required; enabling Bucket routing otherwise leaves "
                          "every request without a Prefill domain")
    return BucketConfig(tuple(specs), pols["ttft_slo_policy"], pols["tps_slo_policy"])


# --------------------------------------------------------------------------- selection


def order_by_slo(specs: Iterable[BucketSpec], policy: str, eligible) -> list[BucketSpec]:
    """Order rank-sorted ``specs`` by SLO policy (§2.3): ``disabled`` keeps rank order,
    ``slo_first`` puts eligible buckets first, ``best_effort`` puts non-eligible ones first."""
    specs = list(specs)
    if policy == "disabled":
        return specs
    yes = [b for b in specs if eligible(b)]
    no = [b for b in specs if not eligible(b)]
    return yes + no if policy == "slo_first" else no + yes


def prefill_buckets_for(cfg: BucketConfig, input_tokens: int, ttft_slo_ms: int | None) -> list[BucketSpec]:
    """Compatible prefill buckets for a request of ``input_tokens``, in search order."""
    fit = [b for b in cfg.prefill if b.fits_prefill(input_tokens)]
    return order_by_slo(fit, cfg.ttft_slo_policy, lambda b: b.ttft_eligible(ttft_slo_ms))


def decode_buckets_for(cfg: BucketConfig, input_tokens: int, peak_tokens: int | None, tps_slo: float | None) -> list[BucketSpec] | None:
    """Compatible decode buckets in search order; None when the config has no decode bucket
    (decode then uses the global pool); an empty list when decode buckets exist but none fits."""
    if not cfg.decode:
        return None
    fit = [b for b in cfg.decode if b.fits_decode(input_tokens, peak_tokens)]
    return order_by_slo(fit, cfg.tps_slo_policy, lambda b: b.tps_eligible(tps_slo))

