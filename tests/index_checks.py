"""Internal consistency checks of a PrefixIndex (white-box; used by the index tests)."""

from __future__ import annotations

from collections import Counter

from mesh.index import PrefixIndex


def check_index_invariants(ix: PrefixIndex) -> None:
    total = 0
    expect: dict[int, dict[object, list[object]]] = {}  # key -> stream -> runs holding it
    all_runs = set()
    for (wid, rank), s in ix._streams.items():
        assert s.worker is ix._workers[wid] and s.rank == rank and ix._workers[wid].streams[rank] is s
        seen_ehs = {}
        for run in s.runs:
            assert run.alive and run.stream is s and run.ehs and len(run.ehs) == len(run.keys)
            all_runs.add(run)
            for e, k in zip(run.ehs, run.keys):
                assert e not in seen_ehs, "engine hash held twice in one stream"
                seen_ehs[e] = run
                expect.setdefault(k, {}).setdefault(s, []).append(run)
            if run.parent is not None:
                p = run.parent
                assert p.alive and p.stream is s and run in p.branches
                assert run.poff == len(p.ehs) - 1, "branches hang below the parent run's last block"
            else:
                assert run.poff == -1
            for b in run.branches or ():
                assert b.parent is run and b.alive
        assert seen_ehs == s.ehmap
        total += len(seen_ehs)
        for k, lst in s.alias.items():
            assert lst, "empty alias list"
    assert total == ix.entries
    assert set(ix._lru) == all_runs
    pos = {r: i for i, r in enumerate(ix._lru)}
    for r in all_runs:
        if r.parent is not None:
            assert pos[r.parent] > pos[r], "a parent run must be more recent than its children"
    assert set(ix._holders) == set(expect)
    for k, per_stream in expect.items():
        v = ix._holders[k]
        if type(v) is dict:
            assert len(v) >= 2 and set(v) == set(per_stream)
            reg = dict(v)
        else:
            assert len(per_stream) == 1 and v.stream in per_stream
            reg = {v.stream: v}
        for s, runs in per_stream.items():
            assert reg[s] in runs
            extra = Counter(runs)
            extra[reg[s]] -= 1
            want = Counter({r: c for r, c in extra.items() if c})
            assert Counter(s.alias.get(k, [])) == want, "alias bookkeeping"
        for s in ix._streams.values():
            if s not in per_stream:
                assert k not in s.alias
