"""The simulated GPU server's parameters and the result of one of its steps (pure data; the
model itself is :mod:`mesh.engine_model`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from mesh.errors import ConfigError
from mesh.kv_events import KvEvent
from mesh.settings_fields import setting

__all__ = ["EngineConfig", "StepResult"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Timing and memory model of one DP rank. Every number is a parameter; defaults: 8B on H100."""

    max_total_num_tokens: int = setting(400_000, unit="tokens", help="KV cache capacity")
    page_size: int = setting(16, unit="tokens", help="tokens per KV page (block)")
    max_running_requests: int = setting(256, help="requests in the running batch at most")
    prefill_tokens_per_s: float = setting(25_000.0, unit="tokens/s", help="prefill throughput")
    prefill_overhead_ms: float = setting(5.0, unit="ms", help="fixed cost of one prefill step")
    attention_coef_ms: float = setting(4e-9, unit="ms/token^2",
                                       help="extra prefill ms = chunk * (context_before + chunk) * this")
    chunked_prefill_size: int = setting(8192, unit="tokens", help="prefill chunk size")
    decode_base_ms: float = setting(7.0, unit="ms", help="fixed cost of one decode step")
    decode_per_req_ms: float = setting(0.02, unit="ms", help="decode step cost per running request")
    kv_bytes_per_token: int = setting(131_072, unit="bytes", help="KV cache bytes per token")
    hbm_bytes_per_s: float = setting(2.3e12, unit="bytes/s", help="HBM bandwidth")
    decode_log_interval: int = setting(40, unit="decode steps", help="KV event flush cadence (SGLang's default)")
    kv_transfer_bytes_per_s: float = setting(25e9, unit="bytes/s",
                                             help="PD: KV transfer bandwidth prefill -> decode (RDMA class)")
    # Free KV a new request must leave after its uncached prompt: headroom for the first decode
    # tokens of the running batch, so admission does not immediately force a retraction. Small on
    # purpose (SGLang over-commits decode and retracts); 128 tokens = 0.03 % of the default KV.
    admission_reserve_tokens: int = setting(128, unit="tokens",
                                            help="free KV a new request must leave after its uncached prompt")
    vocab_size: int = setting(32_000, unit="tokens", help="vocabulary of the modelled output tokens")
    # A host KV tier (SGLang HiCache): pages evicted from the GPU are demoted to a bounded host
    # pool, and a prompt prefix found there is loaded back at PCIe speed instead of recomputed.
    host_kv_tokens: int = setting(0, unit="tokens", help="host-memory KV tier capacity (HiCache; 0 = no host tier)")
    host_transfer_bytes_per_s: float = setting(25e9, unit="bytes/s",
                                               help="host -> GPU KV load bandwidth (PCIe class) of a host-tier hit")

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int):
                if type(v) is not int:
                    raise ConfigError(f"{f.name} must be an int, got {v!r}")
            elif type(v) not in (int, float) or not math.isfinite(v):
                raise ConfigError(f"{f.name} must be a finite number, got {v!r}")
        positive = (
            "max_total_num_tokens", "page_size", "max_running_requests", "prefill_tokens_per_s",
            "chunked_prefill_size", "hbm_bytes_per_s", "decode_log_interval", "vocab_size", "kv_transfer_bytes_per_s",
            "host_transfer_bytes_per_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        non_negative = (
            "prefill_overhead_ms", "attention_coef_ms", "decode_base_ms", "decode_per_req_ms",
            "kv_bytes_per_token", "admission_reserve_tokens", "host_kv_tokens",
        )
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.page_size > self.max_total_num_tokens:
            raise ConfigError("page_size must be <= max_total_num_tokens")
        if self.admission_reserve_tokens >= self.max_total_num_tokens:
            raise ConfigError("admission_reserve_tokens must be < max_total_num_tokens")


@dataclass(slots=True)
class StepResult:
    """What one scheduler iteration produced; everything happens at ``now_s + duration_s``.

    ``first_tokens``: (rid, cached_tokens, prompt_tokens) for requests whose first output token
    was produced (their TTFT point; the token itself is also in ``tokens``). ``tokens``: (rid,
    token_id) in emission order. ``finished``: (rid, "length", usage) with usage = prompt_tokens,
    completion_tokens, cached_tokens. ``kv_events``: events released by the flush cadence.
    """

    duration_s: float
    first_tokens: list[tuple[object, int, int]] = field(default_factory=list)
    tokens: list[tuple[object, int]] = field(default_factory=list)
    finished: list[tuple[object, str, dict[str, int]]] = field(default_factory=list)
    kv_events: list[KvEvent] = field(default_factory=list)
