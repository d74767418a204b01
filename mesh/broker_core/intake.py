"""Intake: whether a new request may run, and as what (pure: no I/O, no clock).

Per-client in-flight quotas, the broker's own load shedding, model names and aliases, LoRA
adapters (:mod:`mesh.routing.lora`: which one a request names, who holds it), and the fleet's KV
capacity (a prompt no worker could hold is refused before it is hashed). It reads the
worker pool and knows nothing of the request table, which calls :meth:`Intake.release` when a
request leaves it.
"""

from __future__ import annotations

import math
from collections import Counter

from mesh import protocol as P
from mesh.broker_core.counters import BrokerStats
from mesh.broker_core.models import ModelGate
from mesh.broker_core.pool import WorkerPool
from mesh.broker_core.requests import Inflight
from mesh.config import BrokerSettings
from mesh.errors import ErrorCode
from mesh.hashing import text_to_tokens
from mesh.namespaces import make_namespace
from mesh.routing.lora import holders_only, request_lora, split_model
from mesh.routing.view import RouteRequest, WorkerState
from mesh.tenants import KeyRing, Tenant, TenantLedger

__all__ = ["Intake", "MAX_KEY_TOKENS"]

MAX_KEY_TOKENS = 1 << 20  # prompt tokens hashed for routing while no worker has registered


class Intake:
    """Refusals before any work (quotas, load), model resolution and context limits."""

    def __init__(self, settings: BrokerSettings, pool: WorkerPool, stats: BrokerStats) -> None:
        self.s = settings
        self.pool = pool
        self.stats = stats
        self.quotas: Counter[bytes] = Counter()  # quota key -> its requests in flight
        self.aliases = settings.aliases()  # --model-alias: name -> served model
        self.models = ModelGate(settings)  # foreign models: the default model, admitted and quarantined ones
        self._unnamed: tuple[int, float, str | None] | None = None  # (pool version, valid until, model)
        self._cap_version = -1  # pool version the fleet capacity was computed at
        self._cap_tokens: dict[str | None, int] = {}  # model (None: all) -> largest KV capacity
        self.tenants = KeyRing()  # the keys file's tenants (the shell sets it; SIGHUP reloads it)
        self.ledger = TenantLedger()  # per tenant: in flight, tokens per minute

    def admit(self, quota: bytes) -> None:
        self.quotas[quota] += 1

    def release(self, quota: bytes) -> None:
        n = self.quotas[quota] - 1
        if n > 0:
            self.quotas[quota] = n
        else:
            self.quotas.pop(quota, None)

    def refusal(self, quota: bytes, sub: P.Submit, loop_lag_s: float) -> tuple[ErrorCode, str] | None:
        """Why a new SUBMIT is refused before any work is done on it (None: accept it).
        Checked in order of cost; nothing here looks at the prompt."""
        if len(sub.raw) > P.MAX_FRAME_BYTES:  # an in-process client: workers could not take the frame
            return ErrorCode.TOO_LARGE, f"request body of {len(sub.raw)} bytes exceeds the {P.MAX_FRAME_BYTES}-byte frame limit"
        if self.quotas[quota] >= self.s.max_inflight_per_client:
            return ErrorCode.RATE_LIMITED, f"this client already has {self.s.max_inflight_per_client} requests in flight"
        if loop_lag_s * 1000.0 > self.s.overload_lag_ms:
            self.stats.loop["shed"] += 1
            return ErrorCode.OVERLOADED, f"broker overloaded (event loop lag {loop_lag_s * 1000:.0f} ms)"
        return None  # the prompt's length is checked where it is routed (RequestTable.prepare_route)

    def tenant_of(self, sub: P.Submit) -> Tenant:
        """The tenant a SUBMIT runs as (its stamp, else the ZeroMQ clients' tenant) and its band
        (``sub.priority`` clamped to the tenant's ceiling) written back into ``sub``."""
        t = self.tenants.get(sub.tenant)
        sub.priority = t.clamp(sub.priority)
        return t

    def tenant_refusal(self, t: Tenant, sub: P.Submit, now: float) -> tuple[ErrorCode, str] | None:
        """``rate_limited`` when the tenant is at its in-flight limit or over its tokens per
        minute (prompt + max_new tokens); the message ends with ``retry after N s``."""
        why = self.ledger.refusal(t, sub.prompt_len + sub.max_new_tokens, now)
        if why is None:
            self.stats.tenants[(t.name, "admitted")] += 1
            return None
        self.stats.tenants[(t.name, "rejected_429")] += 1
        return ErrorCode.RATE_LIMITED, f"{why[0]}; retry after {max(1, math.ceil(why[1]))} s"

    def fleet_capacity(self, model: str | None = None) -> int:
        """The most KV tokens any registered worker (of ``model``) can hold (0 while none is registered)."""
        if self._cap_version != self.pool.version:
            self._cap_version = self.pool.version
            self._cap_tokens.clear()
        cap = self._cap_tokens.get(model)
        if cap is None:
            cap = self._cap_tokens[model] = max((s.ready.max_total_num_tokens for s in self.pool.by_id.values()
                                                 if (model is None or s.ready.model == model) and not s.quarantined), default=0)
        return cap

    def model_for(self, sub: P.Submit, now: float = 0.0) -> tuple[str | None, tuple[ErrorCode, str] | None]:
        """The model a request is routed to (None: any worker) and why it is refused, if it is.

        A name is a model some registered worker serves (READY ``model``; adapters read it from
        the engine) or an alias of one (``--model-alias``). No name, or ``--model-name`` (the id
        the HTTP ingress reports, default ``mesh``), means the default model (:meth:`unnamed`).
        Quarantined workers' models are not known here (:mod:`mesh.broker_core.models`). An unknown name is a 404 ``model_not_found``, except while no worker is
        registered at all (startup): then it waits, parked, for workers to say what they serve.

        LoRA (:mod:`mesh.routing.lora`): ``base:adapter`` is routed to the base model's workers
        (whether or not one holds the adapter: an engine may load it on demand), an adapter's own
        name to the model of the workers that hold it; an adapter name no worker holds is a 404."""
        name = sub.model
        known = self.pool.models()
        if name is not None:
            name = self.aliases.get(name, name)
            if name in known:
                return name, None
            base, adapter = split_model(name, known)
            base = self.aliases.get(base, base)
            if adapter is not None and base in known:
                return base, None
            owner = self.lora_bases().get(name)
            if owner is not None:
                return owner, None
        if name is None or name == self.s.model_name:
            # The models with routable workers decide: a registered peer that serves nothing (or
            # a model whose workers are all down) does not make unnamed requests ambiguous.
            return self.unnamed([m for m in known if self.pool.pool(m)], now), None
        if not known:
            return name, None
        listed = sorted(set(known) | set(self.aliases))
        return None, (ErrorCode.MODEL_NOT_FOUND, f"model {name!r} is not served here; models: {', '.join(listed)}")

    def unnamed(self, served: list[str], now: float) -> str | None:
        """What a request without a model means: ``--default-model``, else the model most
        long-registered admitted workers serve (:meth:`ModelGate.unnamed`); None: any worker.
        With several models the vote (O(workers)) is kept until the pool changes or a worker
        becomes long-registered: not recounted per request."""
        if self.models.default is not None or len(served) <= 1:
            return self.models.unnamed(served, (), now)
        c = self._unnamed
        if c is not None and c[0] == self.pool.version and now < c[1]:
            return c[2]
        regs = [(s.ready.model, s.registered_s) for s in self.pool.by_id.values() if not s.quarantined]
        model = self.models.unnamed(served, regs, now)
        settle_s = self.models.settle_s
        self._unnamed = (self.pool.version, min((t + settle_s for _, t in regs if now - t < settle_s), default=math.inf), model)
        return model

    def lora_bases(self) -> dict[str, str]:
        """Adapter name -> the base model of the workers holding it (registered workers; an
        adapter on workers of two models goes to the model first in name order). O(workers)."""
        out: dict[str, str] = {}
        for sess in self.pool.by_id.values():
            m = sess.ready.model
            for a in sess.state.loras if not sess.quarantined else ():
                if a not in out or m < out[a]:
                    out[a] = m
        return out

    def lora_of(self, sub: P.Submit, model: str | None) -> str | None:
        """The LoRA adapter a request routed to ``model`` (:meth:`model_for`) runs under, or None."""
        name = sub.model
        adapter = None
        if name is not None and model is not None and name != model and name != self.s.model_name:
            name = self.aliases.get(name, name)
            if name != model:
                base, adapter = split_model(name, self.pool.models())
                if adapter is None or self.aliases.get(base, base) != model:
                    adapter = name  # model_for resolved the adapter's own name to its base
        return request_lora(sub.params, adapter)

    def lora_exclusions(self, adapter: str, pool: list[WorkerState], exclude: set[str]) -> set[str]:
        """``exclude`` narrowed to the adapter's holders while one can take the request."""
        only = holders_only(pool, adapter, exclude)
        return exclude if only is None else only

    def count_lora(self, adapter: str, worker_id: str) -> None:
        """A LoRA request was sent to ``worker_id``: to an engine holding its adapter, or not."""
        sess = self.pool.by_id.get(worker_id)
        held = sess is not None and adapter in sess.state.loras
        self.stats.lora["sent_to_holder" if held else "sent_without_adapter"] += 1

    def context_refusal(self, sub: P.Submit, model: str | None = None) -> tuple[ErrorCode, str] | None:
        """A prompt longer than every worker's KV capacity can never run: refuse it before it is
        hashed. Text is counted conservatively (no real tokenizer packs 32 characters per
        token on average), so a text prompt that could fit is never refused."""
        cap = self.fleet_capacity(model)
        if not cap:
            return None  # no worker yet: checked again at dispatch
        n = len(sub.input_ids) if sub.input_ids is not None else len(sub.text or "") // 32
        if n > cap:
            return (ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                    f"prompt of {n}{'+' if sub.input_ids is None else ''} tokens exceeds the largest worker's capacity of {cap} tokens")
        return None

    def route_request(self, inf: Inflight, needs_match: bool) -> RouteRequest:
        """The request's routing view (``needs_match``: the policy matches prefixes, so a text
        prompt is keyed by its bytes)."""
        sub = inf.submit
        tokens = sub.input_ids
        packed = sub.packed
        # Only a prefix that some worker could hold can match: keys beyond the fleet's capacity
        # are never hashed (a 4M-token prompt once blocked the loop for 0.9 s hashing in full).
        cap = self.fleet_capacity(inf.model) or MAX_KEY_TOKENS
        if tokens is None and needs_match:
            tokens = text_to_tokens((sub.text or "")[:cap])[:cap]  # text prompts route by a byte-level key
            n_prompt = sub.prompt_len
        else:
            n_prompt = len(tokens) if tokens is not None else sub.prompt_len
            if tokens is not None and len(tokens) > cap:
                tokens = tokens[:cap]
                packed = packed[:cap] if packed is not None else None
        return RouteRequest(
            request_id=inf.client_rid,
            prompt_tokens=n_prompt,
            max_new_tokens=sub.max_new_tokens,
            tokens=tokens,
            packed=packed,
            ttft_slo_ms=sub.ttft_slo_ms,
            tps_slo=sub.tps_slo,
            namespace=make_namespace(self.lora_of(sub, inf.model), (sub.params or {}).get("extra_key"),
                                     (sub.params or {}).get("cache_salt")),
            session=sub.session,
        )
