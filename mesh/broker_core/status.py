"""Status views of the broker core: STATUS replies, the model catalog, per-worker entries and
token counts (pure: no I/O, no clock). Reads the worker pool, intake's aliases and the counters.

STATUS on the client port answers anyone who reaches it, so what one query may cost is bounded
(issue 32: 300 workers with the largest labels made a 1.0 MB reply to a 1-byte query):

* a client that is not authorised (:func:`may_read_full_status`) gets the *summary*: the broker's
  own state and counts, and at most ``--status-max-workers`` *short* rows (no labels, at most
  ``_SUMMARY_MAX_LORAS`` adapters) from ``offset`` on; ``broker.truncated`` says rows were left
  out (page on with ``offset``; :meth:`mesh.client.Client.status` does);
* an authorised client asking ``full`` gets whole rows (at most ``MAX_STATUS_WORKERS`` a reply);
* every client identity gets ``--status-rate`` queries a second (burst 4x,
  :class:`StatusLimiter`); a query beyond it is answered ``broker.rate_limited`` (no rows) and
  counted (``frames_rejected.client.status_rate_limited``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from mesh import protocol as P
from mesh.broker_core.counters import BrokerStats
from mesh.broker_core.intake import Intake
from mesh.broker_core.pool import SessionState, WorkerPool, WorkerSession
from mesh.config import BrokerSettings

__all__ = ["Status", "StatusLimiter", "announced_by_model", "may_read_full_status", "summary_row"]

_STATUS_CACHE_S = 0.1  # STATUS worker lists of large fleets are rebuilt at most this often
_STATUS_CACHE_MIN_WORKERS = 256  # smaller fleets always get a fresh list
_STATUS_MAX_LORAS = 64  # LoRA adapters listed per worker (a STATUS of 1,024 workers stays well under a frame)
_SUMMARY_MAX_LORAS = 4  # ... and per short row of the summary
_LIMITER_MAX_CLIENTS = 4096  # client identities whose STATUS rate is remembered (the oldest go first)


def may_read_full_status(curve_clients_listed: bool, admin: bool = False) -> bool:
    """Whether a client may read every worker's whole STATUS row: when the broker runs CURVE
    with a client allow-list (every client past the handshake holds a listed key), or when it
    holds the admin right (``admin``: wired by whoever grants it; no such right on this port yet)."""
    return curve_clients_listed or admin


def summary_row(row: dict) -> dict:
    """A worker's short STATUS row: its whole row without labels, at most ``_SUMMARY_MAX_LORAS`` adapters."""
    out = {k: v for k, v in row.items() if k != "labels"}
    out["loras"] = row["loras"][:_SUMMARY_MAX_LORAS]
    return out


class StatusLimiter:
    """STATUS queries per client identity: a token bucket each (``rate_per_s``, burst 4x), at
    most ``_LIMITER_MAX_CLIENTS`` identities remembered (a flood of identities forgets the oldest)."""

    def __init__(self, rate_per_s: float) -> None:
        self.rate_per_s = rate_per_s
        self.burst = 4.0 * rate_per_s
        self._buckets: dict[bytes, tuple[float, float]] = {}  # identity -> (tokens, at)

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, ident: bytes, now: float) -> bool:
        tokens, at = self._buckets.pop(ident, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate_per_s)
        ok = tokens >= 1.0
        if len(self._buckets) >= _LIMITER_MAX_CLIENTS:
            del self._buckets[next(iter(self._buckets))]
        self._buckets[ident] = (tokens - 1.0 if ok else tokens, now)
        return ok


def announced_by_model(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """(model, tokenizer announced by one worker) pairs -> model -> the tokenizer most of its workers
    announced (ties: the first by name); models whose workers announced none are absent."""
    votes: dict[str, dict[str, int]] = {}
    for model, tok in pairs:
        if tok:
            v = votes.setdefault(model, {})
            v[tok] = v.get(tok, 0) + 1
    return {m: max(sorted(v), key=v.__getitem__) for m, v in votes.items()}


class Status:
    """What operators, telemetry and the HTTP ingress read about the broker and its workers."""

    def __init__(self, settings: BrokerSettings, pool: WorkerPool, intake: Intake, stats: BrokerStats, router: Any,
                 broker_id: str, extra: Callable[[float], dict] | None = None, *,
                 full_allowed: Callable[[bytes], bool] | None = None) -> None:
        self.s = settings
        self.pool = pool
        self.intake = intake
        self.stats = stats
        self.router = router
        self.broker_id = broker_id
        self.extra = extra  # more STATUS fields (the shell's)
        self.full_allowed = full_allowed  # client identity -> may it read whole rows (may_read_full_status)
        self.limiter = StatusLimiter(settings.status_rate)
        self._quarantined: tuple[int, dict[str, int]] | None = None  # (pool version, quarantined())
        self._served: tuple[int, dict[str, int]] | None = None  # (pool version, served_models())
        self._cache: tuple[float, list[dict], int] | None = None  # (built at, worker rows, healthy ones)
        self._worker_tokens: dict[str, list[int]] = {}  # worker_id -> [requests, prompt tokens, cached tokens]

    def answer(self, ident: bytes, q: P.StatusQuery, now: float, broker: Callable[[], dict]) -> list[bytes]:
        """The answer to client ``ident``'s STATUS: rate-limited per identity (counted), the
        summary unless the client may read whole rows and asked ``full``; ``broker`` makes the
        broker's own fields (:meth:`broker`)."""
        if not self.limiter.allow(ident, now):
            self.stats.frames_rejected[("client", "status_rate_limited")] += 1
            return self.rate_limited(now, 1.0 / self.s.status_rate)
        full = q.full and self.full_allowed is not None and self.full_allowed(ident)
        return self.reply(now, broker(), full=full, offset=q.offset)

    def reply(self, now: float, broker: dict, *, full: bool = False, offset: int = 0) -> list[bytes]:
        """The STATUS reply (``broker``: the broker's own fields, :meth:`broker`): the summary,
        or (``full``: an authorised client asked for it) whole rows, bounded to
        ``MAX_STATUS_WORKERS``; rows from ``offset`` on (see the module docstring). For large
        fleets the worker list (O(workers) to build) is reused for ``_STATUS_CACHE_S``, so a
        flood of queries costs one build per interval; broker state and counters are always current."""
        c = self._cache
        if c is None or now - c[0] >= _STATUS_CACHE_S or len(self.pool) <= _STATUS_CACHE_MIN_WORKERS:
            rows = self.workers(now)
            c = self._cache = (now, rows, sum(1 for w in rows if w["healthy"]))
        rows = c[1]
        page = rows[offset:offset + (P.MAX_STATUS_WORKERS if full else self.s.status_max_workers)]
        if not full:
            page = [summary_row(w) for w in page]
            broker["summary"] = True
        broker["offset"] = offset
        broker["workers_healthy"] = c[2]
        broker["truncated"] = offset > 0 or offset + len(page) < len(rows)
        if broker["truncated"]:
            broker["workers_truncated"] = True
        return P.encode_status_reply(broker, page, self.stats.flat())

    def rate_limited(self, now: float, retry_after_s: float) -> list[bytes]:
        """The answer to a STATUS beyond the client's rate: no rows, no counters."""
        return P.encode_status_reply({"id": self.broker_id, "rate_limited": True, "retry_after_s": round(retry_after_s, 3)}, [], {})

    def broker(self, now: float, state: str, inflight: int, started_s: float, loop_lag_s: float) -> dict:
        out = {"id": self.broker_id, "state": state, "inflight": inflight,
               "uptime_s": round(now - started_s, 3), "policy": self.router.policy.name,
               "loop_lag_ms": round(loop_lag_s * 1000, 2), "workers_total": len(self.pool),
               "provider": getattr(self.router.provider, "name", "none"), "models": self.served_models(),
               "model_name": self.s.model_name, "aliases": self.intake.aliases,
               "default_model": self.default_model(now), "quarantined": self.quarantined()}
        if self.extra is not None:
            out.update(self.extra(now))
        return out

    def default_model(self, now: float) -> str | None:
        """What a request without a model goes to now (:meth:`Intake.unnamed`)."""
        return self.intake.unnamed(list(self.served_models()), now)

    def quarantined(self) -> dict[str, int]:
        """Model -> workers held apart announcing it (:mod:`mesh.broker_core.models`), at most 16
        models; recounted when the pool changes."""
        c = self._quarantined
        if c is not None and c[0] == self.pool.version:
            return c[1]
        out: dict[str, int] = {}
        for s in self.pool.by_id.values():
            if s.quarantined and (s.ready.model in out or len(out) < 16):
                out[s.ready.model] = out.get(s.ready.model, 0) + 1
        self._quarantined = (self.pool.version, out)
        return out

    def model_catalog(self) -> tuple[dict[str, int], dict[str, str], str]:
        """What the HTTP ingress lists and resolves: served models (routable workers each), the
        aliases and the fleet's name (``--model-name``)."""
        return self.served_models(), self.intake.aliases, self.s.model_name

    def lora_catalog(self) -> dict[str, dict[str, Any]]:
        """LoRA adapter -> ``{"parent": base model, "workers": routable workers holding it}``, over
        the models with routable workers (what ``/v1/models`` lists beside the base models)."""
        out: dict[str, dict[str, Any]] = {}
        for m in self.pool.models():
            for w in self.pool.pool(m):
                for a in w.loras:
                    e = out.get(a)
                    if e is None:
                        out[a] = {"parent": m, "workers": 1}
                    elif e["parent"] == m:
                        e["workers"] += 1
        return out

    def served_models(self) -> dict[str, int]:
        """Model name -> routable workers serving it (models whose workers are all down are absent).
        Recounted when the pool changes (the HTTP ingress reads it several times per request);
        callers read it, never change it."""
        c = self._served
        if c is not None and c[0] == self.pool.version:
            return c[1]
        out = {m: n for m in self.pool.models() if (n := len(self.pool.pool(m)))}
        self._served = (self.pool.version, out)
        return out

    def announced_tokenizers(self) -> dict[str, str]:
        """Model -> the tokenizer its registered workers announced in READY (see :func:`announced_by_model`)."""
        return announced_by_model((s.ready.model, s.ready.tokenizer) for s in self.pool.by_id.values() if not s.quarantined)

    def workers(self, now: float) -> list[dict]:
        """One entry per registered worker (STATUS, telemetry, the admin API)."""
        return [self.worker_status(sess, now) for sess in self.pool.by_id.values()]

    def worker_status(self, sess: WorkerSession, now: float) -> dict:
        st = sess.state
        agg = st.fresh_load(now, self.s.load_freshness_s)
        return {
            "worker_id": st.worker_id, "model": sess.ready.model, "tokenizer": sess.ready.tokenizer, "role": st.role,
            "labels": st.labels,
            "healthy": st.healthy and sess.confirmed and not sess.quarantined,
            "state": "quarantined" if sess.quarantined else sess.status.value,
            "inflight": st.inflight, "peer_inflight": st.peer_inflight, "peer_prefill_tokens": st.peer_prefill_tokens,
            "epoch": sess.ready.epoch, "load_distrusted": st.load_distrusted,
            "ejected_for_s": round(max(0.0, sess.ejected_until_s - now), 3) if sess.status is SessionState.EJECTED else 0.0,
            "kv_capacity_tokens": sess.ready.max_total_num_tokens,
            "loras": sorted(st.loras)[:_STATUS_MAX_LORAS],
            "load": None if agg is None else {"running": agg.running, "waiting": agg.waiting, "kv_usage": round(agg.kv_usage, 4),
                                              "kv_used_tokens": agg.used_tokens},
        }

    def count_tokens(self, worker_id: str, prompt_tokens: int, cached_tokens: int) -> None:
        """One finished request of ``worker_id`` (for :meth:`worker_tokens`)."""
        wt = self._worker_tokens.get(worker_id)
        if wt is None:
            wt = self._worker_tokens[worker_id] = [0, 0, 0]
        wt[0] += 1
        wt[1] += prompt_tokens
        wt[2] += cached_tokens

    def worker_tokens(self, worker_id: str) -> tuple[int, int, int]:
        """(requests finished, prompt tokens, cached tokens) of one worker, for telemetry."""
        wt = self._worker_tokens.get(worker_id)
        return (wt[0], wt[1], wt[2]) if wt else (0, 0, 0)
