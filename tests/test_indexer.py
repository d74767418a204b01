"""KV indexer, in process: verdicts, idempotence vs a reference model, match views, breaker, config.

The gRPC server and client as real processes are in test_indexer_procs.py / test_indexer_failures.py;
:class:`FakeWorker` here is shared with them.
"""

from __future__ import annotations

import argparse
import random

import pytest

from mesh import kv_events as KV
import pickle

from mesh.errors import CheckpointError, ConfigError
from mesh.hashing import content_keys
from mesh.index import PrefixIndex
from mesh.indexer import indexer_pb2 as pb
from mesh.indexer.cli import add_indexer_parser, indexer_settings
from mesh.indexer.client import BreakerState, CircuitBreaker, IndexerClient, MatchView, events_from_body, parse_endpoint
from mesh.indexer.core import IndexerCore
from mesh.protocol import pack
from mesh.routing.providers import LocalIndexProvider

from conftest import run

BS = 16
SYSTEM = [random.Random(99).randrange(1, 50_000) for _ in range(4 * BS)]  # shared by every FakeWorker


class FakeWorker:
    """One (worker, rank) KV stream: linear chains of blocks, some starting with a shared system
    prompt; publishes numbered batches (msgpack events, as in a KV_EVENTS body) and snapshots."""

    def __init__(self, worker_id: str, seed: int, *, dp_rank: int = 0, epoch: int = 1) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.epoch = epoch
        self.rng = random.Random(seed)
        self.chains: list[list[tuple[int, list[int]]]] = []  # live blocks: (engine hash, tokens)
        self.full_tokens: list[list[int]] = []  # every chain's tokens at its longest (queries)
        self.next_hash = 1 + (hash(worker_id) & 0xFFFF) * 1_000_000
        self.seq = 0
        self.published: list[tuple[int, list]] = []  # (seq, decoded events) in order

    def _new_blocks(self, tokens: list[int]) -> list[tuple[int, list[int]]]:
        out = []
        for i in range(0, len(tokens), BS):
            out.append((self.next_hash, tokens[i:i + BS]))
            self.next_hash += 1
        return out

    def _event(self) -> KV.KvEvent:
        rng = self.rng
        live = [c for c in self.chains if c]
        r = rng.random()
        if not live or r < 0.4:
            toks = (SYSTEM if rng.random() < 0.5 else []) + [rng.randrange(1, 50_000) for _ in range(BS * rng.randint(1, 6))]
            blocks = self._new_blocks(toks)
            self.chains.append(blocks)
            self.full_tokens.append(list(toks))
            return KV.BlockStored(tuple(h for h, _ in blocks), None, tuple(toks), BS)
        i = rng.randrange(len(self.chains))
        chain = self.chains[i]
        if not chain:
            return KV.BlockRemoved(())
        if r < 0.75:
            toks = [rng.randrange(1, 50_000) for _ in range(BS * rng.randint(1, 4))]
            blocks = self._new_blocks(toks)
            parent = chain[-1][0]
            chain.extend(blocks)
            full = [t for _, bt in chain for t in bt]
            if len(full) > len(self.full_tokens[i]):
                self.full_tokens[i] = full
            return KV.BlockStored(tuple(h for h, _ in blocks), parent, tuple(toks), BS)
        k = rng.randint(1, len(chain))
        gone = chain[-k:]
        del chain[-k:]
        return KV.BlockRemoved(tuple(h for h, _ in gone))

    def batch(self, n_events: int | None = None) -> tuple[int, bytes]:
        """Publish the next batch: (seq, msgpack events array)."""
        evs = [self._event() for _ in range(n_events or self.rng.randint(1, 3))]
        seq = self.seq
        self.seq += 1
        self.published.append((seq, evs))
        return seq, pack([KV.encode_event_map(e) for e in evs])

    def snapshot(self) -> tuple[int, bytes]:
        """A resync snapshot batch (AllBlocksCleared, then every live chain), next seq."""
        evs: list[KV.KvEvent] = [KV.AllBlocksCleared()]
        for c in self.chains:
            if c:
                evs.append(KV.BlockStored(tuple(h for h, _ in c), None, tuple(t for _, bt in c for t in bt), BS))
        seq = self.seq
        self.seq += 1
        self.published.append((seq, evs))
        return seq, pack([KV.encode_event_map(e) for e in evs])

    def query_keys(self) -> list[list[int]]:
        return [content_keys(t, BS) for t in self.full_tokens]


def reference(workers: list[FakeWorker]) -> PrefixIndex:
    """Every published batch applied once, in order, by the broker-local provider."""
    prov = LocalIndexProvider(block_size=BS, max_entries=None, speculative_ttl_s=0)
    for w in workers:
        for seq, evs in w.published:
            assert prov.apply_events(w.worker_id, w.dp_rank, w.epoch, seq, evs, 0.0) is None
    return prov.index


def assert_same_matches(ref: PrefixIndex, answer, workers: list[FakeWorker]) -> None:
    """``answer(keys)`` returns a MatchView-like object; it must agree with the reference index."""
    ids = sorted({w.worker_id for w in workers})
    idset = set(ids)
    for w in workers:
        for keys in w.query_keys():
            want = ref.match(keys, touch=False)
            got = answer(keys)
            assert got.best_blocks == want.best_blocks
            assert {i: got.matched_blocks(i) for i in ids} == {i: want.matched_blocks(i) for i in ids}
            # (a shared indexer may hold other tests' workers too: compare ours, in order)
            assert [(m.worker_id, m.blocks) for m in got.top(10_000) if m.worker_id in idset] == \
                   [(m.worker_id, m.blocks) for m in want.top(len(ids))]


def core_answer(core: IndexerCore):
    return lambda keys: MatchView(pb.MatchPrefixResponse.FromString(core.match(keys).SerializeToString()))


# ----------------------------------------------------------------------------- verdicts


def _raw(*evs: KV.KvEvent) -> bytes:
    return pack([KV.encode_event_map(e) for e in evs])


def _stored(h0: int, n: int, parent=None, seed: int = 0) -> KV.BlockStored:
    rng = random.Random(seed)
    return KV.BlockStored(tuple(range(h0, h0 + n)), parent, tuple(rng.randrange(1, 999) for _ in range(n * BS)), BS)


def test_verdicts_for_each_kind_of_batch() -> None:
    core = IndexerCore(max_entries=None)
    V = pb.Verdict.Name

    def apply(seq, raw, epoch=1, now=100.0):
        return core.apply_batch("w", 0, epoch, seq, raw, now_s=now)

    assert V(apply(0, _raw(_stored(1, 4))).verdict) == "NEW_EPOCH"  # first sight: epoch 1 > 0
    assert V(apply(1, _raw(_stored(5, 2, parent=4))).verdict) == "APPLY"
    dup = apply(1, _raw(_stored(5, 2, parent=4)))
    assert V(dup.verdict) == "DUPLICATE" and not dup.resync_needed
    gap = apply(4, _raw(_stored(9, 1, parent=6)))
    assert (V(gap.verdict), gap.missed, gap.resync_needed, gap.events_applied) == ("GAP", 2, True, 0)
    late = apply(2, _raw(_stored(7, 1, parent=6)))  # in order: applied, but the hole at 3 is open
    assert (V(late.verdict), late.resync_needed, late.events_applied) == ("UNTRUSTED", False, 1)
    assert apply(3, _raw(), now=106.0).resync_needed  # still untrusted after the retry interval: ask again
    assert core.index.worker_entries("w") == 7
    snap = apply(5, _raw(KV.AllBlocksCleared(), _stored(1, 3)))
    assert V(snap.verdict) == "RESYNCED" and not snap.resync_needed
    assert core.index.worker_entries("w") == 3
    assert V(apply(6, _raw(_stored(20, 1, parent=3))).verdict) == "APPLY"
    new = apply(0, _raw(_stored(30, 2)), epoch=2)
    assert V(new.verdict) == "NEW_EPOCH" and core.index.worker_entries("w") == 2  # old incarnation dropped
    assert V(apply(7, _raw(_stored(40, 1))).verdict) == "STALE_EPOCH"
    assert core.index.worker_entries("w") == 2
    bad = apply(1, b"\xc1", epoch=2)
    assert (V(bad.verdict), bad.resync_needed) == ("REJECTED", True)
    s = core.stats()
    assert s["duplicates"] == 1 and s["service"]["verdict_gap"] == 1 and s["service"]["verdict_resynced"] == 1


def test_a_checkpoint_round_trips_and_another_versions_is_refused_without_touching_the_state() -> None:
    core = IndexerCore(max_entries=None)
    core.apply_batch("w", 0, 1, 0, _raw(_stored(1, 4)), now_s=100.0)
    blob = core.dump_state()
    other = IndexerCore(max_entries=None)
    other.load_state(blob)
    assert other.index.worker_entries("w") == 4 and other.covered(("w", 0))
    old_shape = pickle.dumps({"index": other.index, "provider": None, "_known": set()})  # before KV ingest moved
    for bad in (old_shape, b"\x80\x05not a pickle", pickle.dumps([1, 2])):
        with pytest.raises(CheckpointError):
            other.load_state(bad)
        assert other.index.worker_entries("w") == 4 and other.covered(("w", 0))


def test_reordered_batch_heals_when_the_missing_one_arrives() -> None:
    core = IndexerCore(max_entries=None)
    core.apply_batch("w", 0, 1, 0, _raw(_stored(1, 2)), now_s=0.0)
    assert core.apply_batch("w", 0, 1, 2, _raw(_stored(4, 1, parent=3)), now_s=0.0).verdict == pb.GAP  # broker B was faster
    assert core.apply_batch("w", 0, 1, 1, _raw(_stored(3, 1, parent=2)), now_s=0.0).verdict == pb.UNTRUSTED
    assert core.apply_batch("w", 0, 1, 2, _raw(_stored(4, 1, parent=3)), now_s=0.0).verdict == pb.APPLY  # B retries / A forwards
    assert core.index.is_trusted(("w", 0)) and core.index.worker_entries("w") == 4


def test_unknown_stream_must_start_at_zero_or_with_a_snapshot() -> None:
    """A restarted indexer never trusts increments on top of state it never saw."""
    core = IndexerCore(max_entries=None)
    o = core.apply_batch("w", 0, 7, 41, _raw(_stored(1, 2)), now_s=0.0)
    assert (pb.Verdict.Name(o.verdict), o.missed, o.resync_needed) == ("GAP", 41, True)
    assert core.index.worker_entries("w") == 0
    o = core.apply_batch("w", 0, 7, 42, _raw(KV.AllBlocksCleared(), _stored(1, 3)), now_s=0.0)
    assert pb.Verdict.Name(o.verdict) == "RESYNCED"
    assert pb.Verdict.Name(core.apply_batch("w", 0, 7, 43, _raw(_stored(9, 1, parent=3)), now_s=0.0).verdict) == "APPLY"
    assert core.index.worker_entries("w") == 4
    core.forget_worker("w", now_s=0.0)
    assert core.index.worker_entries("w") == 0
    assert pb.Verdict.Name(core.apply_batch("w", 0, 7, 44, _raw(_stored(10, 1)), now_s=0.0).verdict) == "GAP"


def test_whole_kv_events_body_is_accepted_and_events_can_be_sliced_out() -> None:
    events = [KV.encode_event_map(_stored(1, 2))]
    body = pack({"dp_rank": 0, "epoch": 3, "seq": 0, "ts": 1.5, "events": events})
    assert events_from_body(body) == pack(events)
    core = IndexerCore(max_entries=None)
    o = core.apply_batch("w", 0, 3, 0, body, now_s=0.0)  # a map: detected as a whole body
    assert o.events_applied == 1 and core.index.worker_entries("w") == 2
    with pytest.raises(ValueError):
        events_from_body(pack({"dp_rank": 0}))
    with pytest.raises(ValueError):
        events_from_body(b"\x93\x01\x02\x03")


def test_block_size_of_registered_worker_is_enforced_and_unregistered_ones_are_learned() -> None:
    core = IndexerCore(max_entries=None)
    core.register_worker("a", 32, now_s=0.0)
    core.apply_batch("a", 0, 1, 0, _raw(_stored(1, 2)), now_s=0.0)  # 16-token pages from a 32-token worker: ignored
    assert core.index.worker_entries("a") == 0
    core.apply_batch("b", 0, 1, 0, _raw(KV.BlockStored((1,), None, tuple(range(1, 33)), 32)), now_s=0.0)
    assert core.index.worker_entries("b") == 1
    with pytest.raises(ValueError):
        core.register_worker("", 16, now_s=0.0)


def test_silent_workers_expire_and_come_back_through_a_resync() -> None:
    core = IndexerCore(max_entries=None)
    core.apply_batch("old", 0, 1, 0, _raw(_stored(1, 2)), now_s=10.0)
    core.apply_batch("new", 0, 1, 0, _raw(_stored(1, 2)), now_s=500.0)
    assert core.expire_workers(600.0, ttl_s=300.0) == ["old"]
    assert core.index.worker_entries("old") == 0 and core.index.worker_entries("new") == 2
    o = core.apply_batch("old", 0, 1, 1, _raw(_stored(3, 1, parent=2)), now_s=601.0)
    assert o.verdict == pb.GAP and o.resync_needed


def test_bounded_memory_evicts_beyond_max_entries() -> None:
    core = IndexerCore(max_entries=64)
    for i in range(20):
        core.apply_batch(f"w{i}", 0, 1, 0, _raw(_stored(1, 8, seed=i)), now_s=0.0)
    s = core.stats()
    assert s["entries"] <= 64 and s["evictions"] > 0


# ----------------------------------------------------------------------------- idempotence vs reference


@pytest.mark.parametrize("seed", range(6))
def test_two_brokers_with_duplicates_reorder_and_resync_equal_the_reference(seed: int) -> None:
    """Each batch reaches the indexer through one or both brokers, some late; gaps ask for a
    resync, the worker's snapshot repairs the stream; the result equals applying every batch
    once in order."""
    rng = random.Random(seed)
    core = IndexerCore(max_entries=None)
    workers = [FakeWorker(f"w{i}", seed * 10 + i, dp_rank=i % 2) for i in range(4)]
    resyncs: list[tuple[str, int]] = []
    for _round in range(8):
        pending: list[tuple[FakeWorker, int, bytes]] = []
        for w in workers:
            for _ in range(rng.randint(1, 4)):
                seq, raw = w.batch()
                pending.append((w, seq, raw))
                if rng.random() < 0.5:
                    pending.append((w, seq, raw))  # the other broker forwards it too
        # mild reordering: swap some neighbours (a failover delivers a later batch first)
        for i in range(len(pending) - 1):
            if rng.random() < 0.15:
                pending[i], pending[i + 1] = pending[i + 1], pending[i]
        for w, seq, raw in pending:
            o = core.apply_batch(w.worker_id, w.dp_rank, w.epoch, seq, raw, now_s=0.0)
            if o.resync_needed:
                resyncs.append((w.worker_id, w.dp_rank))
        for _attempt in range(3):  # the broker's on_resync -> the worker answers with a snapshot
            asked, resyncs = sorted(set(resyncs)), []
            for wid, rank in asked:
                w = next(x for x in workers if x.worker_id == wid)
                seq, raw = w.snapshot()
                if core.apply_batch(w.worker_id, w.dp_rank, w.epoch, seq, raw, now_s=0.0).resync_needed:
                    resyncs.append((wid, rank))
    assert core.index.untrusted_streams() == []
    ref = reference(workers)
    assert core.index.entries == ref.entries
    for w in workers:
        assert core.index.worker_entries(w.worker_id) == ref.worker_entries(w.worker_id)
    assert_same_matches(ref, core_answer(core), workers)


def test_duplicates_only_never_double_apply() -> None:
    core = IndexerCore(max_entries=None)
    workers = [FakeWorker(f"w{i}", i) for i in range(3)]
    for _ in range(30):
        for w in workers:
            seq, raw = w.batch()
            for _copy in range(2):
                o = core.apply_batch(w.worker_id, 0, w.epoch, seq, raw, now_s=0.0)
                assert not o.resync_needed
    s = core.stats()
    assert s["duplicates"] == 90
    assert_same_matches(reference(workers), core_answer(core), workers)


# ----------------------------------------------------------------------------- match views


@pytest.mark.parametrize("multi_rank", [False, True])
def test_match_view_has_the_shape_and_answers_of_match_result(multi_rank: bool) -> None:
    core = IndexerCore(max_entries=None)
    workers = [FakeWorker(f"w{i:02d}", 100 + i, dp_rank=(i % 3 if multi_rank else 0)) for i in range(12)]
    for _ in range(15):
        for w in workers:
            seq, raw = w.batch()
            core.apply_batch(w.worker_id, w.dp_rank, w.epoch, seq, raw, now_s=0.0)
    ref = reference(workers)
    assert_same_matches(ref, core_answer(core), workers)
    keys = content_keys(SYSTEM + [1] * BS, BS)
    view = core_answer(core)(keys)
    want = ref.match(keys, touch=False)
    assert view.query_blocks == want.query_blocks == len(keys)
    assert [(m.worker_id, m.blocks) for m in view.top(3)] == [(m.worker_id, m.blocks) for m in want.top(3)]
    assert {k: v.blocks for k, v in view.to_dict().items()} == {k: v.blocks for k, v in want.to_dict().items()}
    for wid in ("w00", "nobody"):
        g, e = view.get(wid), want.get(wid)
        assert (g.blocks if g else 0) == (e.blocks if e else 0)


def test_max_results_keeps_the_deepest_and_counts_all() -> None:
    core = IndexerCore(max_entries=None)
    toks = [7] * (4 * BS)
    for i in range(10):
        n = 1 + i % 4
        core.apply_batch(f"w{i}", 0, 1, 0, _raw(KV.BlockStored(tuple(range(1, n + 1)), None, tuple(toks[:n * BS]), BS)), now_s=0.0)
    resp = core.match(content_keys(toks, BS), max_results=3)
    flat = [(lvl.matched_blocks, w) for lvl in resp.levels for w in lvl.worker_ids]
    assert flat == [(4, "w3"), (4, "w7"), (3, "w2")]
    assert resp.matched_workers == 10 and resp.best_prefix_blocks == 4
    assert core.match(content_keys([8] * BS, BS)).matched_workers == 0


# ----------------------------------------------------------------------------- breaker, config


def test_circuit_breaker_opens_probes_and_closes() -> None:
    b = CircuitBreaker(failures=3, reset_s=2.0)
    for t in (0.0, 0.1):
        assert b.allow(t)
        b.failure(t)
    assert b.state is BreakerState.CLOSED
    b.failure(0.2)
    assert b.state is BreakerState.OPEN and not b.allow(1.0) and b.retry_in(1.0) == pytest.approx(1.2)
    assert b.allow(2.3) and b.state is BreakerState.HALF_OPEN
    assert not b.allow(2.3)  # one probe at a time
    b.failure(2.4)
    assert b.state is BreakerState.OPEN and not b.allow(4.0)
    assert b.allow(4.5)
    b.success()
    assert b.state is BreakerState.CLOSED and b.allow(4.6) and b.consecutive == 0
    b.failure(5.0)
    b.success()
    b.failure(5.1)
    b.failure(5.2)
    assert b.state is BreakerState.CLOSED  # failures must be consecutive


@pytest.mark.parametrize("ep, target, tls", [
    ("http://127.0.0.1:50051", "127.0.0.1:50051", False),
    ("https://indexer.internal:443/", "indexer.internal:443", True),
    ("http://[::1]:50051", "[::1]:50051", False),
    ("unix:/tmp/ix.sock", "unix:/tmp/ix.sock", False),
])
def test_endpoints_need_an_explicit_scheme(ep: str, target: str, tls: bool) -> None:
    assert parse_endpoint(ep) == (target, tls)


@pytest.mark.parametrize("bad", ["127.0.0.1:50051", "grpc://h:1", "http://h", "http://h:0", "http://h:1/x", "unix:"])
def test_bad_endpoints_are_config_errors_naming_the_field(bad: str) -> None:
    with pytest.raises(ConfigError, match="kv_indexer_endpoint"):
        IndexerClient([bad])


@pytest.mark.parametrize("kw, field", [
    ({"query_timeout_ms": 0}, "kv_indexer_query_timeout_ms"),
    ({"max_inflight": 0}, "kv_indexer_query_max_inflight"),
    ({"forward_buffer": 0}, "kv_indexer_forward_buffer"),
    ({"ca_file": "/nonexistent.pem"}, "kv_indexer_ca"),
])
def test_client_settings_are_validated(kw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        IndexerClient(["http://127.0.0.1:1"], **kw)
    with pytest.raises(ConfigError, match="kv_indexer_endpoint"):
        IndexerClient([])
    with pytest.raises(ConfigError, match="twice"):
        IndexerClient(["http://127.0.0.1:1", "http://127.0.0.1:1/"])


def test_unstarted_or_closed_client_degrades_and_counts() -> None:
    async def body() -> None:
        c = IndexerClient(["http://127.0.0.1:1"])
        await c.start()
        await c.aclose()
        assert await c.match([1, 2], BS) is None and c.last_degraded_reason == "closed"
        await c.aclose()  # idempotent
        c.forward("w", 0, 1, 0, b"\x90")
        assert c.stats()["counters"]["forward_after_close"] == 1
        with pytest.raises(RuntimeError):
            await c.start()

    run(body(), 10)


def _settings(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    add_indexer_parser(p.add_subparsers())
    return indexer_settings(p.parse_args(["indexer", *argv]))


def test_indexer_cli_settings(tmp_path) -> None:
    assert _settings()["listen"] == "127.0.0.1:50051"
    cfg = tmp_path / "ix.toml"
    cfg.write_text('[indexer]\nlisten = "0.0.0.0:6000"\nmax-inflight-queries = 8\n')
    v = _settings("--config", str(cfg), "--max-inflight-queries", "4")
    assert (v["listen"], v["max_inflight_queries"]) == ("0.0.0.0:6000", 4)
    for argv, field in ((["--listen", "nohost"], "listen"), (["--max-inflight-queries", "0"], "max_inflight_queries"),
                        (["--tls-cert", str(cfg)], "tls_cert"), (["--max-entries", "-1"], "max_entries")):
        with pytest.raises(ConfigError, match=field):
            _settings(*argv)
    cfg.write_text("[indexer]\nlisten_port = 3\n")
    with pytest.raises(ConfigError, match="listen_port"):
        _settings("--config", str(cfg))
