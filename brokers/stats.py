"""Broker counters exported to Prometheus on scrape (the counters live in :mod:`mesh.broker_core.counters`).

A ``prometheus_client`` Counter costs a lock and a label lookup per increment; the broker loop is
single-threaded, so it counts into dicts and a custom collector turns them into metric families
when ``/metrics`` is scraped. Every drop the broker makes is counted here under a reason.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from mesh.broker_core.counters import REQUEST_LATENCIES, BrokerStats, LatencyHistogram

__all__ = ["BrokerStats", "StatsCollector", "LatencyHistogram", "GatewayCollector", "RegretCollector"]


def _text_unmatched_family(s: BrokerStats) -> tuple:
    return ("mesh_text_unmatched", "Text requests sent without their model's tokenizer to engines keyed by token ids "
            "(they never match a cache)", "model", s.text_unmatched)


def _latency_families(s: BrokerStats):
    fams = {name: HistogramMetricFamily(f"mesh_{name}_seconds", doc, labels=["model", "worker"])
            for name, (doc, _) in REQUEST_LATENCIES.items()}
    for (name, model, worker), h in sorted(s.latency.items()):
        fams[name].add_metric([model, worker], buckets=h.buckets(), sum_value=h.sum_s)
    return fams.values()


def _tenant_families(s: BrokerStats):
    """Per tenant (names from the keys file only): admitted, rejected_429, ... and queue waits."""
    fam = CounterMetricFamily("mesh_tenant_requests", "Requests per tenant: admitted, rejected_429 (its limits), "
                              "tenant_field_ignored (a ZeroMQ client's stamp)", labels=["tenant", "what"])
    for (tenant, what), v in sorted(s.tenants.items()):
        fam.add_metric([tenant, what], v)
    yield fam
    h = HistogramMetricFamily("mesh_tenant_queue_wait_seconds", "SUBMIT accepted -> first attempt sent, per tenant",
                              labels=["tenant"])
    for tenant, hist in sorted(s.tenant_queue.items()):
        h.add_metric([tenant], buckets=hist.buckets(), sum_value=hist.sum_s)
    yield h


class GatewayCollector(Collector):
    """The gateway's /metrics: its request outcomes, drops, and the latency histograms it observes
    on the replies it relays (TTFT, inter-token, end-to-end, by model and worker)."""

    def __init__(self, stats: BrokerStats) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats
        for name, doc, label, ctr in (("mesh_requests", "Requests by outcome", "outcome", s.requests),
                                      ("mesh_dropped", "Messages dropped by the gateway, by what", "what", s.dropped),
                                      _text_unmatched_family(s),
                                      ("mesh_migrations", "Requests moved to another broker (resubmitted, or continued from "
                                       "the tokens so far)", "cause", s.migrations),
                                      ("mesh_migration_refused", "Requests that could not move to another broker, by reason",
                                       "reason", s.migration_refused)):
            fam = CounterMetricFamily(name, doc, labels=[label])
            for k, v in sorted(ctr.items()):
                fam.add_metric([k], v)
            yield fam
        yield from _latency_families(s)


class StatsCollector(Collector):
    """Exports a BrokerStats (plus live gauges from ``gauges()``) as Prometheus families."""

    def __init__(self, stats: BrokerStats, gauges: Callable[[], dict[str, list[tuple[dict[str, str], float]]]]) -> None:
        self.stats = stats
        self.gauges = gauges

    def collect(self):
        s = self.stats
        for name, doc, label, ctr in (
            ("mesh_requests", "Requests by outcome", "outcome", s.requests),
            ("mesh_decisions", "Routing decisions by reason", "reason", s.decisions),
            ("mesh_dropped", "Messages dropped by the broker, by what", "what", s.dropped),
            ("mesh_retries", "Re-dispatches by cause", "cause", s.retries),
            ("mesh_worker_events", "Worker lifecycle events", "event", s.workers),
            ("mesh_kv_events", "KV event stream handling", "what", s.kv),
            ("mesh_loop", "Broker event loop stalls and load shedding", "what", s.loop),
            ("mesh_exchange", "Peer exchange messages and decisions made while a peer was stale", "what", s.exchange),
            ("mesh_lora", "LoRA requests and where they were sent (to an engine holding the adapter or not)", "what", s.lora),
            ("mesh_sessions", "Session affinity: hits, new pins, re-pins by cause, evictions, peers' pins applied",
             "what", s.sessions),
            _text_unmatched_family(s),
            ("mesh_migrations", "Streams continued on another worker after theirs was lost mid-stream, by cause", "cause",
             s.migrations),
            ("mesh_migration_refused", "Streams lost mid-stream that could not be continued (ended worker_lost), by reason",
             "reason", s.migration_refused),
            ("mesh_record", "--record-decisions: records and files written", "what", s.record),
            ("mesh_record_dropped", "--record-decisions: records dropped (queue_full: the disk is behind; write_error)",
             "why", s.record_dropped),
        ):
            fam = CounterMetricFamily(name, doc, labels=[label])
            for k, v in sorted(ctr.items()):
                fam.add_metric([k], v)
            yield fam
        fam = CounterMetricFamily("mesh_frames_rejected", "Frames rejected at the decode boundary", labels=["path", "reason"])
        for (path, reason), v in sorted(s.frames_rejected.items()):
            fam.add_metric([path, reason], v)
        yield fam
        yield CounterMetricFamily("mesh_degraded_decisions", "Decisions made without a cache signal", value=s.degraded_decisions)
        yield CounterMetricFamily("mesh_requests_parked", "Requests that waited for a routable worker", value=s.requests_parked)
        yield CounterMetricFamily("mesh_routed_prompt_tokens", "Prompt tokens of finished requests", value=s.prompt_tokens)
        yield CounterMetricFamily("mesh_routed_cached_tokens", "Cached prompt tokens reported by workers", value=s.cached_tokens)
        h = s.decision_latency
        yield HistogramMetricFamily("mesh_decision_latency_seconds", "Routing decision latency", buckets=h.buckets(), sum_value=h.sum_s)
        h = s.loop_lag
        yield HistogramMetricFamily("mesh_loop_lag_seconds", "Broker pump lateness plus duration", buckets=h.buckets(), sum_value=h.sum_s)
        yield from _latency_families(s)
        yield from _tenant_families(s)
        by_name: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for name, samples in self.gauges().items():
            by_name[name].extend(samples)
        for name, samples in by_name.items():
            labels = sorted(samples[0][0]) if samples else []
            fam = GaugeMetricFamily(name, name.replace("_", " "), labels=labels)
            for lab, v in samples:
                fam.add_metric([lab[k] for k in labels], v)
            yield fam


class RegretCollector(Collector):
    """cache_aware's counterfactual regret audit (:mod:`mesh.routing.regret`, ``--regret-audit``):
    ``mesh_regret_ms{baseline}``, one decision's predicted TTFT of the baseline's pick minus that of
    cache_aware's (positive: cache_aware saved that much), and the gauge
    ``mesh_cache_aware_pays_ms{baseline}``, its mean over about the last thousand decisions
    (``best``: against the better baseline), and ``mesh_cache_aware_pays_observed_ms{baseline}``, the
    same with cache_aware's side measured (the first token's real TTFT; empty before one). The buckets are signed, so by the exposition format's
    rule the histogram has no ``_sum``/``_count``: the ``+Inf`` bucket is the count, the gauge the mean."""

    def __init__(self, audit) -> None:
        self.audit = audit

    def collect(self):
        a = self.audit
        h = HistogramMetricFamily("mesh_regret_ms", "Per decision: predicted TTFT of the baseline's pick minus "
                                  "cache_aware's, ms (positive: cache_aware saved it)", labels=["baseline"])
        for name, b in a.baselines.items():
            h.add_metric([name], buckets=b.hist.buckets(), sum_value=b.hist.sum_s)
        yield h
        g = GaugeMetricFamily("mesh_cache_aware_pays_ms", "ms per request cache_aware saves against the baseline on "
                              "this traffic (predicted, windowed mean; best: the better baseline)", labels=["baseline"])
        for name, v in a.pays_ms().items():
            g.add_metric([name], v)
        yield g
        o = GaugeMetricFamily("mesh_cache_aware_pays_observed_ms", "ms per request cache_aware saves against the "
                              "baseline, its measured TTFT against the baseline's predicted one (mean since start)",
                              labels=["baseline"])
        for name, v in a.observed_pays_ms().items():
            o.add_metric([name], v)
        yield o
        yield CounterMetricFamily("mesh_regret_skipped", "cache_aware decisions the regret audit skipped (one "
                                  "candidate, or no prediction)", value=a.skipped)
