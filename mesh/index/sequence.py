"""Per-stream batch sequencing: duplicates, gaps, epochs (the index's trust in a stream).

Each KV event publisher numbers its batches ``seq = 0, 1, 2, ...`` and restarts at 0 with the
process; the adapter turns a restart into a higher ``epoch`` (e.g. the worker's incarnation or a
counter bumped when seq goes backwards). :func:`check` decides what to do with one batch:

========== ============================================= =========================================
verdict    when                                          caller does
========== ============================================= =========================================
APPLY      first batch seen, or ``seq == last + 1``      apply the ops
DUPLICATE  same epoch, ``seq <= last``                   ignore
GAP        same epoch, ``seq > last + 1``                do not apply; replay from ``last + 1``
                                                         (or snapshot + ``reset_stream``)
NEW_EPOCH  ``epoch > known``                             the index already dropped the stream's
                                                         blocks; apply the ops
STALE      ``epoch < known``                             ignore (a late batch of a dead publisher)
========== ============================================= =========================================

After a GAP the stream is *untrusted* and ``last`` does not move, so replayed batches
``last + 1, last + 2, ...`` arrive as APPLY; the stream is trusted again once it has applied up to
the highest seq it has seen. If replay cannot cover the hole, the caller resynchronises with a
snapshot (Clear + stores) and ``reset_stream(stream, epoch, seq)``, which trusts the stream as of
``seq``. Pure code: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Verdict", "BatchVerdict", "SeqState", "check"]


class Verdict(StrEnum):
    APPLY = "apply"
    DUPLICATE = "duplicate"
    GAP = "gap"
    NEW_EPOCH = "new_epoch"
    STALE_EPOCH = "stale_epoch"


@dataclass(slots=True, frozen=True)
class BatchVerdict:
    """The verdict for one batch; ``missed`` = batches known missing (GAP only)."""

    verdict: Verdict
    missed: int = 0

    @property
    def apply(self) -> bool:
        """True when the caller should apply the batch's ops (APPLY or NEW_EPOCH)."""
        return self.verdict is Verdict.APPLY or self.verdict is Verdict.NEW_EPOCH


# Shared instances: begin_batch runs once per batch and most verdicts carry no payload.
_APPLY = BatchVerdict(Verdict.APPLY)
_DUP = BatchVerdict(Verdict.DUPLICATE)
_NEW = BatchVerdict(Verdict.NEW_EPOCH)
_STALE = BatchVerdict(Verdict.STALE_EPOCH)


@dataclass(slots=True)
class SeqState:
    """Sequencing state of one stream. ``last_seq`` None = nothing seen in this epoch yet."""

    epoch: int = 0
    last_seq: int | None = None
    max_seen: int = -1  # highest seq observed in this epoch (applied or not)
    trusted: bool = True

    def reset(self, epoch: int, seq: int | None) -> None:
        """Trust the stream as synchronised up to ``seq`` inclusive (None = nothing yet)."""
        self.epoch = epoch
        self.last_seq = seq
        self.max_seen = -1 if seq is None else seq
        self.trusted = True


def check(state: SeqState, epoch: int, seq: int) -> BatchVerdict:
    """Classify batch ``(epoch, seq)`` and update ``state`` (the caller drops blocks on NEW_EPOCH)."""
    if epoch != state.epoch:
        if epoch < state.epoch:
            return _STALE
        state.reset(epoch, seq)
        return _NEW
    last = state.last_seq
    if last is None:  # first batch of this epoch: nothing to compare against
        state.reset(epoch, seq)
        return _APPLY
    if seq == last + 1:
        state.last_seq = seq
        if seq > state.max_seen:
            state.max_seen = seq
        if not state.trusted and seq >= state.max_seen:
            state.trusted = True  # replay has filled every hole we knew of
        return _APPLY
    if seq <= last:
        return _DUP
    state.trusted = False
    missed = seq - last - 1
    if seq > state.max_seen:
        state.max_seen = seq
    return BatchVerdict(Verdict.GAP, missed)
