"""Broker counters: plain dict increments on the hot path (the broker loop is single-threaded).

``brokers/stats.py`` turns them into Prometheus families when ``/metrics`` is scraped; STATUS
replies carry :meth:`BrokerStats.flat`. Every drop the broker makes is counted here under a reason.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter

from mesh.stats import LatencyHistogram

__all__ = ["BrokerStats", "LatencyHistogram"]

# Loop lag: 100 us .. 5 s.
_LAG_BUCKETS_S = (1e-4, 1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Request latencies as the broker sees them (labelled by model and worker; see REQUEST_LATENCIES).
_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
_ITL_BUCKETS_S = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 5.0)
_E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_QUEUE_BUCKETS_S = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
#: name -> (help, bucket bounds): the request latency histograms (``mesh_<name>_seconds``).
REQUEST_LATENCIES: dict[str, tuple[str, tuple[float, ...]]] = {
    "ttft": ("Time to first token: SUBMIT accepted -> the first output of the attempt that answered", _TTFT_BUCKETS_S),
    "inter_token": ("Time between consecutive streamed chunks of one request (a chunk may carry several tokens)", _ITL_BUCKETS_S),
    "e2e": ("SUBMIT accepted -> FINAL sent to the client", _E2E_BUCKETS_S),
    "queue": ("SUBMIT accepted -> its first attempt sent to a worker (parked, index match, admission)", _QUEUE_BUCKETS_S),
}


class BrokerStats:
    """All broker counters. Labels are plain strings so the export is trivial."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()  # outcome: ok, bad_request, no_worker, ...
        self.decisions: Counter[str] = Counter()  # reason
        self.frames_rejected: Counter[tuple[str, str]] = Counter()  # (path, reason)
        self.dropped: Counter[str] = Counter()  # what was dropped: stale_reply, send_hwm, ...
        self.retries: Counter[str] = Counter()  # why: worker_lost, worker_error, send_failed
        self.workers: Counter[str] = Counter()  # registered, expired, disconnected, replaced
        self.kv: Counter[str] = Counter()  # batches, events, duplicates, gaps, ...
        self.loop: Counter[str] = Counter()  # stalls, stalled_ms, shed: the broker's own event loop
        # peer exchange (brokers/peer_exchange.py): sent, sent_full, sent_changes, received, applied,
        # duplicate, old_epoch, restarted, gap_messages (lost), expired, rejected_<reason>,
        # decisions_peer_stale (routed on this broker's own view while a peer was stale), ...
        self.exchange: Counter[str] = Counter()
        self.lora: Counter[str] = Counter()  # sent_to_holder, sent_without_adapter (mesh.routing.lora)
        # session affinity (mesh.routing.sessions): new, hit, repin_<why>, hard_gone, hard_busy, evicted,
        # expired, remote_applied, remote_stale, remote_over_share
        self.sessions: Counter[str] = Counter()
        # text requests the HTTP ingress sent without their model's tokenizer to engines that key their
        # cache by token ids (a byte key never matches their KV events), by model
        self.text_unmatched: Counter[str] = Counter()
        # streams continued on another worker after theirs was lost mid-stream, by the loss's
        # code; and those that could not be (ended worker_lost), by reason (mesh.broker_core.migrate)
        self.migrations: Counter[str] = Counter()
        self.migration_refused: Counter[str] = Counter()
        # per tenant (names come from the keys file only: bounded): (tenant, what) with what in
        # admitted, rejected_429 (its in-flight or tokens-per-minute limit), and its queue waits
        self.tenants: Counter[tuple[str, str]] = Counter()
        self.tenant_queue: dict[str, LatencyHistogram] = {}
        # --record-decisions (brokers/decision_log.py): records and files written; records dropped by why
        # (queue_full: the writer is behind, counted by the loop; write_error: counted by the writer thread)
        self.record: Counter[str] = Counter()
        self.record_dropped: Counter[str] = Counter()
        self.degraded_decisions = 0
        self.requests_parked = 0
        self.cached_tokens = 0
        self.prompt_tokens = 0
        self.decision_latency = LatencyHistogram()
        # (name, model, worker) -> histogram, names from REQUEST_LATENCIES
        self.latency: dict[tuple[str, str, str], LatencyHistogram] = {}
        self.loop_lag = LatencyHistogram(_LAG_BUCKETS_S)  # per pump: lateness + own duration

    def histogram(self, name: str, model: str, worker: str) -> LatencyHistogram:
        """The ``name`` histogram of (model, worker), created on first use."""
        key = (name, model, worker)
        h = self.latency.get(key)
        if h is None:
            h = self.latency[key] = LatencyHistogram(REQUEST_LATENCIES[name][1])
        return h

    def observe_latency(self, name: str, model: str, worker: str, v_s: float) -> None:
        self.histogram(name, model, worker).observe(v_s)

    def tenant_queue_wait(self, tenant: str, wait_s: float) -> None:
        h = self.tenant_queue.get(tenant)
        if h is None:
            h = self.tenant_queue[tenant] = LatencyHistogram(_QUEUE_BUCKETS_S)
        h.observe(wait_s)

    def forget_worker(self, worker: str) -> None:
        """Drop a departed worker's latency series (bounded label sets as workers come and go)."""
        for key in [k for k in self.latency if k[2] == worker]:
            del self.latency[key]

    def flat(self) -> dict[str, int]:
        """All counters as one flat name -> value map (for STATUS replies and tests)."""
        out: dict[str, int] = {}
        for prefix, ctr in (
            ("requests", self.requests),
            ("decisions", self.decisions),
            ("dropped", self.dropped),
            ("retries", self.retries),
            ("workers", self.workers),
            ("kv", self.kv),
            ("loop", self.loop),
            ("exchange", self.exchange),
            ("lora", self.lora),
            ("sessions", self.sessions),
            ("text_unmatched", self.text_unmatched),
            ("migrations", self.migrations),
            ("migration_refused", self.migration_refused),
            ("record", self.record),
            ("record_dropped", self.record_dropped),
        ):
            for k, v in ctr.items():
                out[f"{prefix}.{k}"] = v
        for (path, reason), v in self.frames_rejected.items():
            out[f"frames_rejected.{path}.{reason}"] = v
        for (tenant, what), v in self.tenants.items():
            out[f"tenants.{tenant}.{what}"] = v
        out["degraded_decisions"] = self.degraded_decisions
        out["requests_parked"] = self.requests_parked
        out["cached_tokens"] = self.cached_tokens
        out["prompt_tokens"] = self.prompt_tokens
        return out
