"""DP-attention ranks: which rank of the chosen worker serves a request. Pure: no I/O, no clock.

An engine with data-parallel attention (SGLang ``--dp-size`` with ``--enable-dp-attention``, vLLM
``--data-parallel-size``) runs ``dp_size`` ranks behind one endpoint, each with its own KV cache
and batch. A worker announces ``dp_size`` in READY, publishes one KV event stream and one LoadStat
per rank (``attn_dp_rank``), and the index keeps ownership per ``(worker, rank)`` stream. The
policy picks the worker; :func:`assign_rank` then picks its rank and the broker passes it in the
REQUEST's ``dp_rank`` (the SGLang adapter as ``routed_dp_rank``, any engine also as the
``X-Data-Parallel-Rank`` header vLLM and SGLang's OpenAI endpoints read):

1. ``prefix``: the one rank holding the deepest event-fed prefix of the prompt;
2. ``prefix_tie``: several ranks hold it equally deep: the least loaded of them;
3. ``least_loaded``: no rank holds any of it (or only a speculative guess does, which names no
   rank): the least loaded rank.

Load per rank is :meth:`~mesh.routing.view.WorkerState.rank_pressure` (the rank's fresh LoadStat
corrected by this router's dispatches since, else this router's own requests there); ties go to
the lowest rank. Workers with ``dp_size`` 1 get no rank (the REQUEST carries none, as before).
"""

from __future__ import annotations

from typing import Any

from mesh.routing.view import Decision, WorkerState

__all__ = ["RANK_REASONS", "rank_depths", "choose_rank", "assign_rank"]

#: Why a rank was chosen (the broker counts ``decisions{reason="dp_rank_<why>"}``).
RANK_REASONS = ("prefix", "prefix_tie", "least_loaded")


def rank_depths(match: Any, worker_id: str) -> dict[int, int]:
    """``{rank: matched blocks}`` of the worker's ranks holding part of the query. Views with
    per-rank matches answer ``rank_blocks``; others (the indexer service's) only name the rank of
    the worker's deepest match through ``get``."""
    if match is None:
        return {}
    ranks = getattr(match, "rank_blocks", None)
    if ranks is not None:
        return ranks(worker_id)
    get = getattr(match, "get", None)
    m = get(worker_id) if get is not None else None
    if m is None or m.dp_rank is None or not m.blocks:
        return {}
    return {m.dp_rank: m.blocks}


def choose_rank(w: WorkerState, depths: dict[int, int], now_s: float, freshness_s: float) -> tuple[int, str]:
    """(rank, reason) for a request sent to ``w`` whose ranks hold ``depths`` (see module docstring)."""
    n = max(w.dp_size, 1)
    held = {r: d for r, d in depths.items() if 0 <= r < n and d > 0}
    if held:
        top = max(held.values())
        best = [r for r, d in held.items() if d == top]
        if len(best) == 1:
            return best[0], "prefix"
        return min(best, key=lambda r: (w.rank_pressure(r, now_s, freshness_s), r)), "prefix_tie"
    return min(range(n), key=lambda r: (w.rank_pressure(r, now_s, freshness_s), r)), "least_loaded"


def assign_rank(d: Decision, w: WorkerState, match: Any, now_s: float, freshness_s: float) -> None:
    """Give decision ``d`` (routed to ``w``, already recorded on it) its DP rank when ``w`` has
    several: sets ``d.dp_rank`` and ``d.detail["rank_reason"]`` and books the rank on ``w``
    (released with the decision by ``Router.release``)."""
    if w.dp_size <= 1:
        return
    rank, why = choose_rank(w, rank_depths(match, w.worker_id), now_s, freshness_s)
    d.dp_rank = rank
    d.detail["rank_reason"] = why
    w.record_rank_dispatch(rank)
