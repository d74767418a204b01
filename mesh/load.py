"""Worker load telemetry: SGLang's ``LoadStat`` and what a router derives from it.

Wire shape (SGLang #34608 + #38139), a msgpack tagged array::

    ["LoadStat", num_running_reqs, num_waiting_reqs, num_tokens, max_total_num_tokens, attn_dp_rank,
     num_waiting_uncached_tokens, num_total_tokens, max_running_requests,
     total_prefill_uncached_tokens, total_prefill_busy_us]

Positions 0-5 are the original prefix; positions 6-10 are the extension, all-or-nothing: a short
array decodes with ``extended=False`` and such a worker carries no native admission data.
Pure code: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mesh.errors import ProtocolError

__all__ = ["LoadStat", "PREFILL_RATE_WINDOW_S", "PrefillRateEstimate", "prefill_rate_tokens_per_s"]

_TAG = "LoadStat"
_FIELDS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_tokens",
    "max_total_num_tokens",
    "attn_dp_rank",
    "num_waiting_uncached_tokens",
    "num_total_tokens",
    "max_running_requests",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
)
_BASE_LEN = 6  # tag + 5 prefix fields
_FULL_LEN = 1 + len(_FIELDS)


_MAX_VALUE = 1 << 40  # beyond any real counter; keeps sums and STATUS replies encodable


@dataclass(slots=True)
class LoadStat:
    """One DP rank's load as SGLang publishes it. ``extended`` says positions 6-10 were present."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_tokens: int = 0
    max_total_num_tokens: int = 0
    attn_dp_rank: int = 0
    num_waiting_uncached_tokens: int = 0
    num_total_tokens: int = 0
    max_running_requests: int = 0
    total_prefill_uncached_tokens: int = 0
    total_prefill_busy_us: int = 0
    extended: bool = True

    def to_wire(self) -> list[Any]:
        """Encode as SGLang's tagged array (full form unless ``extended`` is False)."""
        vals = [getattr(self, f) for f in _FIELDS]
        if not self.extended:
            vals = vals[: _BASE_LEN - 1]
        return [_TAG, *vals]

    @classmethod
    def from_wire(cls, obj: Any) -> "LoadStat":
        """Decode a tagged array (or a map with the same field names). Raises ProtocolError."""
        if isinstance(obj, dict):
            vals = [obj.get(f, 0) for f in _FIELDS]
            extended = all(f in obj for f in _FIELDS[5:])
        elif isinstance(obj, (list, tuple)):
            if len(obj) < _BASE_LEN or obj[0] != _TAG:
                raise ProtocolError("bad_loadstat", f"expected ['LoadStat', ...] with >= {_BASE_LEN} items")
            extended = len(obj) >= _FULL_LEN
            vals = list(obj[1:_FULL_LEN]) + [0] * (_FULL_LEN - min(len(obj), _FULL_LEN))
        else:
            raise ProtocolError("bad_loadstat", f"expected array or map, got {type(obj).__name__}")
        for name, v in zip(_FIELDS, vals):
            if type(v) is not int or not 0 <= v < _MAX_VALUE:
                raise ProtocolError("bad_loadstat", f"{name} must be an int in [0, 2**40), got {v!r}")
        return cls(*vals, extended=extended)

    @property
    def capacity_valid(self) -> bool:
        return self.max_total_num_tokens > 0 and self.max_running_requests > 0

    @property
    def kv_usage(self) -> float:
        """Fraction of KV capacity in use (0 when capacity is unknown)."""
        return self.num_tokens / self.max_total_num_tokens if self.max_total_num_tokens > 0 else 0.0


def _prefill_increments(prev: LoadStat, cur: LoadStat) -> tuple[int, int]:
    """(uncached prefill tokens, prefill busy µs) between two samples of the monotonic counters."""
    return (cur.total_prefill_uncached_tokens - prev.total_prefill_uncached_tokens,
            cur.total_prefill_busy_us - prev.total_prefill_busy_us)


def prefill_rate_tokens_per_s(prev: LoadStat | None, cur: LoadStat) -> float | None:
    """Prefill throughput from two consecutive samples of the monotonic counters (SGLang §13.4).

    Returns None when there is no previous sample, no busy time elapsed, or a counter went
    backwards (publisher restart).
    """
    if prev is None:
        return None
    d_tokens, d_busy_us = _prefill_increments(prev, cur)
    if d_busy_us <= 0 or d_tokens < 0:
        return None
    return 1e6 * d_tokens / d_busy_us


# Seconds of prefill busy time over which PrefillRateEstimate pools its samples.
PREFILL_RATE_WINDOW_S = 2.0


@dataclass(slots=True)
class PrefillRateEstimate:
    """One DP rank's prefill throughput, pooled over its recent samples: the counters' token and
    busy-time increments, each decayed by ``exp(-busy / window_s)`` as newer busy time arrives,
    and the rate their ratio (tokens per second of busy time).

    Why not SGLang's two-sample rate (:func:`prefill_rate_tokens_per_s`): one heartbeat interval
    can hold a single step that prefilled one page beside a full decode batch. On the quality
    matrix's shared_prefix cell (16 workers, load 1.2) a fifth of the samples read ~600 tokens/s
    while the fleet prefilled at 19,000 (the engine model's rate is 25,000), and a router that
    took the last sample as the rate saw a worker's queue 25x too long until the next one.
    Pooling weighs each sample by its busy time, so such a step moves the estimate by its 25 ms,
    not to its ratio. The window is busy time, not samples or wall time, so it does not depend on
    how often the engine publishes.

    Pure: fed LoadStat pairs, reads no clock.
    """

    window_s: float = PREFILL_RATE_WINDOW_S
    tokens: float = 0.0
    busy_s: float = 0.0

    @property
    def rate_tokens_per_s(self) -> float | None:
        """The pooled rate, or None before any busy time was seen."""
        return self.tokens / self.busy_s if self.busy_s > 0 and self.tokens > 0 else None

    def update(self, prev: LoadStat | None, cur: LoadStat) -> float | None:
        """Fold the increments from ``prev`` to ``cur`` in; returns the pooled rate. A counter
        that went backwards (the publisher restarted) starts the estimate over.

        The first sample (``prev`` None, or the one after a restart) seeds the estimate: the
        counters run from the engine's start, so they are its lifetime rate, taken with at most
        one window of weight (a router joining a fleet that ran for hours must not let the past
        outweigh what it measures next). Without the seed a worker had no rate until its second
        LoadStat and every router read its queue at the cost model's reference rate: on a fast
        engine, 4x the reference, queues looked 4x longer for the first two heartbeats and
        routers left holders for ghosts."""
        if prev is None:
            return self._seed(cur)
        d_tokens, d_busy_us = _prefill_increments(prev, cur)
        if d_tokens < 0 or d_busy_us < 0:
            self.tokens = self.busy_s = 0.0
            return self._seed(cur)
        if d_busy_us > 0:
            d_busy_s = d_busy_us / 1e6
            keep = math.exp(-d_busy_s / self.window_s)
            self.tokens = self.tokens * keep + d_tokens
            self.busy_s = self.busy_s * keep + d_busy_s
        return self.rate_tokens_per_s

    def _seed(self, cur: LoadStat) -> float | None:
        """Seed an empty estimate from ``cur``'s counters (see :meth:`update`)."""
        if self.busy_s > 0:
            return self.rate_tokens_per_s
        tok, busy_us = cur.total_prefill_uncached_tokens, cur.total_prefill_busy_us
        if not (isinstance(tok, int) and isinstance(busy_us, int)) or tok <= 0 or busy_us <= 0:
            return None
        busy_s = busy_us / 1e6
        w = min(busy_s, self.window_s)
        self.tokens = tok * (w / busy_s)
        self.busy_s = w
        return self.rate_tokens_per_s
