"""Property tests: PrefixIndex / ApproxIndex against brute-force reference models.

The reference keeps, per stream, ``engine_hash -> (content_key, parent_engine_hash)`` and nothing
clever: an orphan store is ignored, an already-held engine hash is kept, a removal drops the block
and (transitively) every block whose parent link leads to it, a clear empties the stream. A worker
holds the union of its streams' keys; its match is the largest n with keys[0..n) all held.
Speculation: records (worker, chain, expiry), live while now < expiry, closed when a store of that
worker's contains the record's last key, refreshed (max expiry) when the same chain is re-sent.
"""

from __future__ import annotations

import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from mesh.index import ROOT_KEY, ApproxIndex, PrefixIndex, Verdict

from index_checks import check_index_invariants

WORKERS = ["w0", "w1", "w2", "w3"]
RANKS = [0, 1]
STREAMS = [(w, r) for w in WORKERS for r in RANKS]
PAGES = [0, 1, 2, 3]  # a tiny alphabet: prompts share prefixes across workers all the time
U64 = (1 << 64) - 1


def ckey(parent_key: int, page: int) -> int:
    """Chained content key of one page (a stand-in for mesh.hashing.content_keys)."""
    return xxhash.xxh3_64_intdigest(parent_key.to_bytes(8, "little") + page.to_bytes(4, "little"), seed=7)


def chain(pages: list[int], parent_key: int = ROOT_KEY) -> list[int]:
    out = []
    k = parent_key
    for p in pages:
        k = ckey(k, p)
        out.append(k)
    return out


def ehash(stream: tuple[str, int], key: int, ns: int) -> int:
    """Engine hash: deterministic across workers for w0/w1 (SGLang-like), salted for w2/w3 (vLLM
    with a per-process seed); ``ns`` != 0 simulates a namespace (two engine blocks, one content)."""
    salt = 0 if stream[0] in ("w0", "w1") else hash(stream) & 0xFFFF
    return xxhash.xxh3_64_intdigest(key.to_bytes(8, "little") + bytes([ns]) + salt.to_bytes(4, "little"))


class RefIndex:
    def __init__(self) -> None:
        self.streams: dict[tuple[str, int], dict[int, tuple[int, int | None]]] = {}
        self.seq: dict[tuple[str, int], list] = {}
        self.orphans = 0

    def store(self, stream, parent, ehs, keys) -> None:
        stt = self.streams.setdefault(stream, {})
        if parent is not None and parent not in stt:
            self.orphans += 1
            return
        prev = parent
        for e, k in zip(ehs, keys):
            if e not in stt:
                stt[e] = (k, prev)
            prev = e

    def remove(self, stream, ehs) -> None:
        stt = self.streams.get(stream, {})
        doomed = {e for e in ehs if e in stt}
        changed = True
        while changed:
            changed = False
            for e, (_, p) in stt.items():
                if e not in doomed and p in doomed:
                    doomed.add(e)
                    changed = True
        for e in doomed:
            del stt[e]

    def clear(self, stream) -> None:
        self.streams.get(stream, {}).clear()

    def ancestors(self, stream, eh) -> list[int]:
        stt = self.streams[stream]
        out = [eh]
        while stt[out[-1]][1] is not None:
            out.append(stt[out[-1]][1])
        return out[::-1]

    def descendants(self, stream, eh) -> set[int]:
        stt = self.streams[stream]
        out = {eh}
        changed = True
        while changed:
            changed = False
            for e, (_, p) in stt.items():
                if e not in out and p in out:
                    out.add(e)
                    changed = True
        out.discard(eh)
        return out

    def remove_worker(self, w) -> None:
        for s in [s for s in self.streams if s[0] == w]:
            del self.streams[s]
        for s in [s for s in self.seq if s[0] == w]:
            del self.seq[s]

    def held(self, w) -> set[int]:
        out: set[int] = set()
        for s, stt in self.streams.items():
            if s[0] == w:
                out.update(k for k, _ in stt.values())
        return out

    def key_of(self, stream, eh) -> int | None:
        if eh is None:
            return ROOT_KEY
        v = self.streams.get(stream, {}).get(eh)
        return None if v is None else v[0]


def prefix_len(keys: list[int], held: set[int]) -> int:
    n = 0
    while n < len(keys) and keys[n] in held:
        n += 1
    return n


class RefSpec:
    def __init__(self) -> None:
        self.recs: dict[tuple[str, int], tuple[tuple[int, ...], float]] = {}  # (w, last) -> (keys, exp)

    def expire(self, now) -> None:
        for k in [k for k, (_, exp) in self.recs.items() if exp <= now]:
            del self.recs[k]

    def insert(self, w, keys, now, ttl) -> None:
        self.expire(now)
        cur = self.recs.get((w, keys[-1]))
        exp = now + ttl
        if cur is not None:
            exp = max(exp, cur[1])
        self.recs[(w, keys[-1])] = (tuple(keys), exp)

    def close(self, w, stored_keys) -> None:
        for k in [k for k in self.recs if k[0] == w and k[1] in set(stored_keys)]:
            del self.recs[k]

    def held(self, w) -> set[int]:
        out: set[int] = set()
        for (ww, _), (keys, _) in self.recs.items():
            if ww == w:
                out.update(keys)
        return out


def all_paths(ix_keys: dict[int, tuple[int, int]], limit: int) -> list[list[int]]:
    """Full key paths of (a deterministic sample of) every key ever created."""
    out = []
    for k in sorted(ix_keys)[:limit]:
        path = [k]
        while ix_keys[path[-1]][0] != ROOT_KEY:
            path.append(ix_keys[path[-1]][0])
        path.reverse()
        out.append(path + [ckey(k, 9)])  # plus a block nobody holds
    return out


class IndexMachine(RuleBasedStateMachine):
    """Random event streams (shared prefixes, ranks, aliases, removals, clears, sequencing,
    worker removal, speculation) checked after every step against the references."""

    budget: int | None = None

    @initialize()
    def setup(self) -> None:
        self.ix = PrefixIndex(max_entries=self.budget, spec_max_entries=None)
        self.ref = RefIndex()
        self.spec = RefSpec()
        self.now = 0.0
        self.created: dict[int, tuple[int, int]] = {}  # key -> (parent key, page)
        self.epoch: dict[tuple[str, int], int] = {}
        self.last: dict[tuple[str, int], int] = {}

    # -- helpers ---------------------------------------------------------------------------
    def _keys(self, parent_key: int, pages: list[int]) -> list[int]:
        keys = chain(pages, parent_key)
        pk = parent_key
        for k, p in zip(keys, pages):
            self.created[k] = (pk, p)
            pk = k
        return keys

    def _do_store(self, data, stream) -> None:
        stt = self.ref.streams.get(stream, {})
        mode = data.draw(st.sampled_from(["root", "extend", "extend", "restore", "alias", "orphan"]), label="mode")
        if mode in ("extend", "restore", "alias") and not stt:
            mode = "root"
        ns = data.draw(st.sampled_from([0, 0, 1]), label="ns")
        pages = data.draw(st.lists(st.sampled_from(PAGES), min_size=0, max_size=4), label="pages")
        old_ehs: list[int] = []
        old_keys: list[int] = []
        parent: int | None = None
        if mode == "extend":
            parent = data.draw(st.sampled_from(sorted(stt)), label="parent_eh")
        elif mode == "orphan":
            parent = data.draw(st.integers(0, U64), label="bogus")
        elif mode == "restore":
            # Re-send an existing chain segment (engines may re-store), then maybe new blocks.
            x = data.draw(st.sampled_from(sorted(stt)), label="x")
            anc = self.ref.ancestors(stream, x)  # root .. x
            cut = data.draw(st.integers(0, len(anc) - 1), label="cut")
            old_ehs = anc[cut:]
            old_keys = [stt[e][0] for e in old_ehs]
            parent = anc[cut - 1] if cut else None
        elif mode == "alias":
            # The same content under other engine hashes (a namespace): whole path from the root.
            x = data.draw(st.sampled_from(sorted(stt)), label="x")
            old_keys = self._path(stt[x][0])
            old_ehs = [ehash(stream, k, ns) for k in old_keys]
        if not old_ehs and not pages:
            pages = [0]
        pk = self.ix.resolve_parent_key(stream, parent)
        assert pk == (self.ref.key_of(stream, parent) if parent is None or parent in stt else None)
        base = old_keys[-1] if old_keys else (ROOT_KEY if pk is None else pk)
        new_keys = self._keys(base, pages)
        keys = old_keys + new_keys
        ehs = old_ehs + [ehash(stream, k, ns) for k in new_keys]
        orphans_before = self.ix.c.orphans
        self.ix.store(stream, parent, ehs, keys)
        self.ref.store(stream, parent, ehs, keys)
        if pk is None:
            assert self.ix.c.orphans == orphans_before + 1
        else:
            self.spec.close(stream[0], keys)

    def _path(self, key: int) -> list[int]:
        path = [key]
        while self.created[path[-1]][0] != ROOT_KEY:
            path.append(self.created[path[-1]][0])
        return path[::-1]

    def _do_remove(self, data, stream) -> None:
        stt = self.ref.streams.get(stream, {})
        ehs: list[int] = []
        if stt:
            if data.draw(st.booleans(), label="subtree"):
                # An evicted leaf node's blocks, in prompt order, reversed, or shuffled.
                x = data.draw(st.sampled_from(sorted(stt)), label="x")
                sub = sorted(self.ref.descendants(stream, x) | {x}, key=lambda e: len(self.ref.ancestors(stream, e)))
                sub = sub[: data.draw(st.integers(1, len(sub)), label="n")]
                order = data.draw(st.sampled_from(["fwd", "rev", "shuffle"]), label="order")
                if order == "rev":
                    sub.reverse()
                elif order == "shuffle":
                    sub = data.draw(st.permutations(sub), label="perm")
                ehs = list(sub)
            else:
                ehs = data.draw(st.lists(st.sampled_from(sorted(stt)), max_size=3), label="rm")
        if data.draw(st.booleans(), label="unknown"):
            ehs.append(12345)
        self.ix.remove(stream, ehs)
        self.ref.remove(stream, ehs)

    # -- rules -----------------------------------------------------------------------------
    @rule(data=st.data(), stream=st.sampled_from(STREAMS))
    def store(self, data, stream) -> None:
        self._do_store(data, stream)

    @rule(data=st.data(), stream=st.sampled_from(STREAMS))
    def remove(self, data, stream) -> None:
        self._do_remove(data, stream)

    @rule(stream=st.sampled_from(STREAMS))
    def clear(self, stream) -> None:
        self.ix.clear(stream)
        self.ref.clear(stream)

    @rule(data=st.data(), stream=st.sampled_from(STREAMS), kind=st.sampled_from(["next", "next", "dup", "gap", "epoch", "stale"]))
    def batch(self, data, stream, kind) -> None:
        ep = self.epoch.get(stream, 0)
        last = self.last.get(stream)
        if kind == "epoch":
            ep += 1
            seq = 0
        elif kind == "stale":
            ep -= 1
            seq = 0
        elif last is None:
            seq = 0
        elif kind == "dup":
            seq = max(0, last - data.draw(st.integers(0, 2), label="back"))
        elif kind == "gap":
            seq = last + data.draw(st.integers(2, 4), label="ahead")
        else:
            seq = last + 1
        v = self.ix.begin_batch(stream, ep, seq)
        known_ep = self.epoch.get(stream, 0)
        if ep < known_ep:
            assert v.verdict is Verdict.STALE_EPOCH
        elif ep > known_ep:
            assert v.verdict is Verdict.NEW_EPOCH
            self.ref.clear(stream)
        elif last is None or seq == last + 1:
            assert v.verdict is Verdict.APPLY
        elif seq <= last:
            assert v.verdict is Verdict.DUPLICATE
        else:
            assert v.verdict is Verdict.GAP and v.missed == seq - last - 1
        if v.apply:
            self.epoch[stream] = ep
            self.last[stream] = seq
            if data.draw(st.booleans(), label="op"):
                self._do_store(data, stream)
            else:
                self._do_remove(data, stream)

    @rule(stream=st.sampled_from(STREAMS))
    def reset(self, stream) -> None:
        ep = self.epoch.get(stream, 0)
        seq = self.last.get(stream, 0) + 3
        self.ix.reset_stream(stream, ep, seq)
        self.ref.clear(stream)
        self.epoch[stream] = ep
        self.last[stream] = seq
        assert self.ix.is_trusted(stream)

    @rule(w=st.sampled_from(WORKERS))
    def remove_worker(self, w) -> None:
        self.ix.remove_worker(w)
        self.ref.remove_worker(w)
        self.spec.recs = {k: v for k, v in self.spec.recs.items() if k[0] != w}
        for s in [s for s in self.epoch if s[0] == w]:
            del self.epoch[s]
        for s in [s for s in self.last if s[0] == w]:
            del self.last[s]

    @rule(data=st.data(), w=st.sampled_from(WORKERS), ttl=st.sampled_from([1.0, 2.0, 5.0]))
    def speculate(self, data, w, ttl) -> None:
        pages = data.draw(st.lists(st.sampled_from(PAGES), min_size=1, max_size=5), label="spec_pages")
        keys = self._keys(ROOT_KEY, pages)
        self.ix.speculate(w, keys, self.now, ttl)
        self.spec.expire(self.now)
        if keys[-1] not in self.ref.held(w):
            self.spec.insert(w, keys, self.now, ttl)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def tick(self, dt) -> None:
        self.now += dt

    # -- checks ----------------------------------------------------------------------------
    def _compare(self, keys: list[int], use_spec: bool) -> None:
        res = self.ix.match(keys, self.now if use_spec else None)
        if use_spec:
            self.spec.expire(self.now)
        expect = {}
        for w in WORKERS:
            e = prefix_len(keys, self.ref.held(w))
            s = prefix_len(keys, self.spec.held(w)) if use_spec else 0
            got = res.get(w)
            if max(e, s) == 0:
                assert got is None, (w, keys, got)
                continue
            assert got is not None and got.blocks == max(e, s), (w, keys, got, e, s)
            assert got.speculative == (s > e), (w, got, e, s)
            if not got.speculative:
                ranks = [r for r in RANKS if prefix_len(keys, {k for k, _ in self.ref.streams.get((w, r), {}).values()}) == e]
                assert got.dp_rank == min(ranks)
            expect[w] = got.blocks
        d = res.to_dict()
        assert {w: m.blocks for w, m in d.items()} == expect
        ordered = sorted(expect, key=lambda w: (-expect[w], w))
        assert [m.worker_id for m in res.top(3)] == ordered[:3]
        assert [m.worker_id for _, ms in res.levels() for m in ms] == ordered
        assert res.best_blocks == (max(expect.values()) if expect else 0)

    @invariant()
    def matches_equal_brute_force(self) -> None:
        if not hasattr(self, "ix"):
            return
        held = sorted({k for stt in self.ref.streams.values() for k, _ in stt.values()})
        for k in held[:: max(1, len(held) // 10)] + sorted(self.created)[:3]:
            keys = self._path(k) + [ckey(k, 9)]
            self._compare(keys, use_spec=False)
            self._compare(keys, use_spec=True)

    @invariant()
    def internals_consistent(self) -> None:
        if not hasattr(self, "ix"):
            return
        check_index_invariants(self.ix)
        if self.budget:
            return
        assert self.ix.entries == sum(len(s) for s in self.ref.streams.values())
        # Same parent links as the reference: the cascade structure is right, not just the keys.
        for stream, stt in self.ref.streams.items():
            s = self.ix._streams.get(stream)
            got = {}
            for run in (s.runs if s is not None else ()):
                for i, (e, k) in enumerate(zip(run.ehs, run.keys)):
                    p = run.ehs[i - 1] if i else (run.parent.ehs[run.poff] if run.parent else None)
                    got[e] = (k, p)
            assert got == stt


IndexMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestIndexMachine = IndexMachine.TestCase


class BudgetMachine(IndexMachine):
    """Same workload under a tiny entry budget: whatever the LRU evicts, the index must stay equal
    to the reference with the evicted blocks removed (so evictions are downward closed)."""

    budget = 12

    @invariant()
    def matches_equal_brute_force(self) -> None:
        if not hasattr(self, "ix"):
            return
        assert self.ix.entries <= self.budget
        # Sync the reference: drop what the index evicted, which must already include every block
        # below an evicted one (removing them in the reference must not remove anything else).
        for stream, stt in list(self.ref.streams.items()):
            s = self.ix._streams.get(stream)
            have = set(s.ehmap) if s is not None else set()
            assert have <= set(stt)
            missing = set(stt) - have
            if missing:
                self.ref.remove(stream, missing)
                assert set(stt) == have
        for keys in all_paths(self.created, 8):
            self._compare(keys, use_spec=False)


BudgetMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBudgetMachine = BudgetMachine.TestCase


class ApproxMachine(RuleBasedStateMachine):
    """The standalone approx index against the record model (no budget pressure)."""

    @initialize()
    def setup(self) -> None:
        self.ax = ApproxIndex(max_entries=None, default_ttl_s=2.0)
        self.spec = RefSpec()
        self.now = 0.0
        self.paths: list[list[int]] = []

    @rule(data=st.data(), w=st.sampled_from(WORKERS), ttl=st.sampled_from([None, 1.0, 4.0]))
    def insert(self, data, w, ttl) -> None:
        pages = data.draw(st.lists(st.sampled_from(PAGES), min_size=1, max_size=6))
        keys = chain(pages)
        self.paths.append(keys)
        self.ax.insert(w, keys, self.now, ttl)
        self.spec.insert(w, keys, self.now, 2.0 if ttl is None else ttl)

    @rule(data=st.data(), w=st.sampled_from(WORKERS))
    def close(self, data, w) -> None:
        if self.paths:
            keys = data.draw(st.sampled_from(self.paths))
            self.ax.close(w, keys)
            self.spec.close(w, keys)

    @rule(w=st.sampled_from(WORKERS))
    def remove_worker(self, w) -> None:
        self.ax.remove_worker(w)
        self.spec.recs = {k: v for k, v in self.spec.recs.items() if k[0] != w}

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5]))
    def tick(self, dt) -> None:
        self.now += dt

    @invariant()
    def matches(self) -> None:
        if not hasattr(self, "ax"):
            return
        self.spec.expire(self.now)
        for keys in self.paths[-10:]:
            res = self.ax.match(keys + [ckey(keys[-1], 9)], self.now)
            for w in WORKERS:
                want = prefix_len(keys, self.spec.held(w))
                got = res.get(w)
                assert (got.blocks if got else 0) == want
                assert got is None or (got.speculative and got.dp_rank is None)
        assert self.ax.entries == sum(len(self.spec.held(w)) for w in WORKERS)
        assert self.ax.records == len(self.spec.recs)


ApproxMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestApproxMachine = ApproxMachine.TestCase


# --------------------------------------------------------------------------- the walk alone
from hypothesis import given  # noqa: E402

from mesh.index.walk import walk_levels  # noqa: E402


class _One:
    """A single-holder value, as the indexes store it (not a dict)."""

    def __init__(self, holder: str) -> None:
        self.holder = holder


def _linear_levels(get, keys):
    """Reference: visit every key, cut a level wherever the holder set shrinks."""
    sets = []
    for k in keys:
        v = get(k)
        if v is None:
            break
        sets.append((set(v) if type(v) is dict else {v.holder}, v))
    depths, holders = [], []
    for d, (s, v) in enumerate(sets, 1):
        if d == len(sets) or len(sets[d][0]) < len(s):
            depths.append(d)
            holders.append(v)
    return depths, holders


@settings(max_examples=300, deadline=None)
@given(
    depths=st.lists(st.integers(0, 40), min_size=0, max_size=6),
    total=st.integers(1, 40),
    one_dict=st.booleans(),
)
def test_walk_levels_matches_a_linear_scan(depths, total, one_dict):
    """Holder ``h<i>`` holds keys[0..depths[i]) (prefix-closed, so sets nest along the chain);
    the binary-search walk must find exactly the levels a key-by-key scan finds."""
    keys = list(range(100, 100 + total))
    table = {}
    for d in range(total):
        hs = [f"h{i}" for i, hd in enumerate(depths) if hd > d]
        if not hs:
            continue
        if len(hs) == 1 and not one_dict:
            table[keys[d]] = _One(hs[0])
        else:
            table[keys[d]] = {h: 1 for h in hs}
    got = walk_levels(table.get, keys)
    want = _linear_levels(table.get, keys)
    assert got[0] == want[0]
    assert [id(v) for v in got[1]] == [id(v) for v in want[1]]
