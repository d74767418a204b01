"""DP attention in the simulated GPU server: ``dp_size`` :class:`~mesh.engine_model.EngineModel`
ranks behind one worker (pure, like the model itself)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mesh.engine_config import EngineConfig, StepResult
from mesh.engine_model import EngineModel
from mesh.errors import ConfigError
from mesh.kv_events import KvEvent
from mesh.load import LoadStat

__all__ = ["DpEngineModel", "DpStepResult"]


@dataclass(slots=True)
class DpStepResult(StepResult):
    """A :class:`StepResult` of all ranks of a :class:`DpEngineModel`: ``kv_events`` stays empty
    and ``rank_kv_events`` holds ``(dp_rank, events)`` per rank that released events (each rank
    is its own stream: ``(worker, rank)`` in the index)."""

    rank_kv_events: list[tuple[int, list[KvEvent]]] = field(default_factory=list)


class DpEngineModel:
    """A server with data-parallel attention: ``dp_size`` :class:`EngineModel` ranks behind one
    worker, each with its own KV cache, batch, KV event stream and LoadStat (SGLang ``--dp-size``
    with ``--enable-dp-attention``). The ranks step in lockstep (their attention runs apart, the
    MoE layers together, so a step lasts as long as the slowest rank's); outputs of every rank
    appear at the step's end.

    :meth:`submit` takes ``dp_rank`` (the router's choice, SGLang's ``routed_dp_rank``); without
    one the request goes to the rank with the fewest running + waiting requests (lowest rank on
    ties), as SGLang's DP controller balances by queue. Same driving interface as
    :class:`EngineModel` (``submit``/``cancel``/``step``/``has_work``), plus :meth:`load_stats`
    (one LoadStat per rank) and :meth:`rank_of`.
    """

    def __init__(self, config: EngineConfig | None = None, dp_size: int = 2) -> None:
        if type(dp_size) is not int or not 1 <= dp_size <= 1024:
            raise ConfigError(f"dp_size must be an int in [1, 1024], got {dp_size!r}")
        self.config = config or EngineConfig()
        self.ranks = [EngineModel(self.config) for _ in range(dp_size)]
        self._rank_of: dict[object, int] = {}

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    def rank_of(self, rid: object) -> int | None:
        """The rank serving ``rid`` (None once it finished or was cancelled)."""
        return self._rank_of.get(rid)

    def submit(self, rid: object, prompt: Sequence[int], max_new_tokens: int, now_s: float, *,
               dp_rank: int | None = None, **kw) -> int:
        """Queue a request on ``dp_rank`` (or the least busy rank); returns the rank. Raises
        ValueError for a rank out of range (SGLang answers 400) and as :meth:`EngineModel.submit`."""
        if rid in self._rank_of:
            raise ValueError(f"duplicate rid {rid!r}")
        n = len(self.ranks)
        if dp_rank is None:
            dp_rank = min(range(n), key=lambda r: (self.ranks[r].num_running + self.ranks[r].num_waiting, r))
        elif type(dp_rank) is not int or not 0 <= dp_rank < n:
            raise ValueError(f"dp_rank {dp_rank!r} out of range [0, {n})")
        self.ranks[dp_rank].submit(rid, prompt, max_new_tokens, now_s, **kw)
        self._rank_of[rid] = dp_rank
        return dp_rank

    def cancel(self, rid: object) -> bool:
        r = self._rank_of.pop(rid, None)
        return r is not None and self.ranks[r].cancel(rid)

    def has_work(self) -> bool:
        return bool(self._rank_of)

    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.ranks)

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.ranks)

    def step(self, now_s: float) -> DpStepResult:
        """One lockstep iteration of every rank (an idle rank only releases buffered events)."""
        out = DpStepResult(0.0)
        for r, eng in enumerate(self.ranks):
            res = eng.step(now_s)
            out.duration_s = max(out.duration_s, res.duration_s)
            out.first_tokens += res.first_tokens
            out.tokens += res.tokens
            out.finished += res.finished
            if res.kv_events:
                out.rank_kv_events.append((r, res.kv_events))
        for rid, _reason, _usage in out.finished:
            self._rank_of.pop(rid, None)
        for eng in self.ranks:  # every rank's outputs appear at the lockstep's end
            if eng._finishing_n:
                eng._finishing_until_s = now_s + out.duration_s
        return out

    def load_stats(self, now_s: float | None = None) -> list[LoadStat]:
        """One LoadStat per rank (``attn_dp_rank`` set), as the ranks publish them."""
        return [eng.load_stat(r, now_s) for r, eng in enumerate(self.ranks)]

    def peek_cached_tokens(self, prompt: Sequence[int], namespace: str | None = None) -> list[int]:
        """Per rank, the tokens of ``prompt`` its cache holds (no side effects)."""
        return [eng.peek_cached_tokens(prompt, namespace) for eng in self.ranks]
