"""LoRA adapters: which adapter a request names, and the placement filter (pure: no I/O, no clock).

A request names an adapter in one of three ways, as the engines accept them:

* ``model: "base:adapter"``: SGLang's OpenAI syntax. The base is a served model's name, matched
  whole first (names may themselves contain ``:``, e.g. ``s3://...``), else everything before the
  first ``:`` (``sglang/srt/entrypoints/openai/serving_base.py`` ``_parse_model_parameter``);
* ``model: "adapter"``: the adapter's own name, as vLLM serves it and as both engines list it in
  ``/v1/models`` (an entry whose ``parent`` is the base model);
* ``lora_path: "adapter"``: SGLang's native ``/generate`` field. The model's adapter wins over it,
  as in SGLang (``_resolve_lora_path``).

Placement (:func:`holders_only`): among the workers serving the base model, only those holding the
adapter are candidates while one of them can take the request (not excluded: tried, or at its
in-flight cap); otherwise the whole base pool is, and the request goes to an engine that has to
load the adapter (SGLang reloads an evicted adapter on demand, vLLM with a LoRA resolver loads it
by name), which the broker counts (``mesh_lora{what="sent_without_adapter"}``). Like llm-d's
``lora-affinity-scorer`` this ranks "adapter loaded" above everything else, and like SGLang's
router it never refuses a request whose base model is served.
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Sequence

from mesh.routing.view import WorkerState

__all__ = ["split_model", "request_lora", "holders_only", "holds"]


def split_model(name: str, models: Iterable[str]) -> tuple[str, str | None]:
    """``(base, adapter)`` of a requested model name; ``adapter`` is None when the name names no
    adapter by the ``base:adapter`` syntax. A name that is itself a served model is never split;
    the longest served model followed by ``:`` is the base, else the text before the first ``:``."""
    if ":" not in name:
        return name, None
    best = None
    for m in models:
        if m == name:
            return name, None
        if name.startswith(m) and name[len(m):len(m) + 1] == ":" and (best is None or len(m) > len(best)):
            best = m
    if best is not None:
        base, adapter = best, name[len(best) + 1:]
    else:
        base, _, adapter = name.partition(":")
    return base.strip(), adapter.strip() or None


def request_lora(params: dict[str, Any] | None, from_model: str | None) -> str | None:
    """The adapter a request runs under: the one its model names, else its ``lora_path``."""
    if from_model:
        return from_model
    lp = params.get("lora_path") if params else None
    return lp if type(lp) is str and lp else None


def holds(w: WorkerState, adapter: str) -> bool:
    return adapter in w.loras


def holders_only(pool: Sequence[WorkerState], adapter: str, exclude: Collection[str]) -> set[str] | None:
    """The exclusion set that leaves only the adapter's holders as candidates (``exclude`` plus
    the non-holders), or None when no holder is a candidate (route over the whole pool). Per role:
    a P/D fleet whose prefill workers hold the adapter and decode workers do not keeps its decode
    workers. O(pool)."""
    roles: set[str] = set()  # roles with a holder that can take the request
    for w in pool:
        if adapter in w.loras and w.worker_id not in exclude:
            roles.add(w.role)
    if not roles:
        return None
    out = set(exclude)
    out.update(w.worker_id for w in pool if w.role in roles and adapter not in w.loras)
    return out
