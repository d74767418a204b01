"""Test fakes with knobs shared by the routing tests (pure: no sockets)."""

from __future__ import annotations


class _M:
    __slots__ = ("worker_id", "blocks")

    def __init__(self, worker_id: str, blocks: int) -> None:
        self.worker_id, self.blocks = worker_id, blocks


class FakeMatch:
    """A MatchView with fixed per-worker matched blocks."""

    def __init__(self, blocks: dict[str, int], query_blocks: int = 1000) -> None:
        self.blocks = blocks
        self.query_blocks = query_blocks

    def matched_blocks(self, wid: str) -> int:
        return self.blocks.get(wid, 0)

    def top(self, k: int) -> list[_M]:
        items = sorted(((b, w) for w, b in self.blocks.items() if b > 0), key=lambda t: (-t[0], t[1]))
        return [_M(w, b) for b, w in items[:k]]

    @property
    def best_blocks(self) -> int:
        return max(self.blocks.values(), default=0)


class FakeProvider:
    """A prefix provider that always answers ``match`` and records where requests were routed."""

    name = "fake"

    def __init__(self, match) -> None:
        self.m = match
        self.routed: list[str] = []

    def match(self, req, now_s):
        return self.m

    def on_routed(self, req, wid, now_s):
        self.routed.append(wid)
