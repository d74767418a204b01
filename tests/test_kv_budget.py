"""KV work by blocks (issue 32): one worker's big KV batches cost the others nothing beyond their
share. In-process broker core (virtual clock), the protocol's decode boundary, and the adapter's
relay. The real-process flood is ``test_kv_flood_sheds_at_most_a_tenth_of_other_clients`` in
tests/test_abuse_kv_flood.py (e2e)."""

from __future__ import annotations

import zmq.asyncio

from brokers.main import build_broker
from mesh import kv_events as KV
from mesh import protocol as P
from mesh.adapters.kv_relay import KvRelay, RankStream
from mesh.broker_core.kv_backlog import KV_SLICE_BLOCKS, KV_TURN_BLOCKS, KV_WORKER_QUEUE_BLOCKS
from mesh.config import BrokerSettings, build
from mesh.errors import ProtocolError

BS = 16
_RESYNC = bytes([P.Cmd.RESYNC])


def _core():
    b = build_broker(build(BrokerSettings, {"policy": "cache_aware", "default_deadline_ms": 60_000}))
    core = b.core
    core.start(100.0)
    for wid in ("flood", "calm"):
        ident = wid.encode()
        core.worker_frames([ident, *P.encode_ready(P.Ready(wid, "m", "mixed", {}, BS, 256, 400_000, 1, 1, 500))], 100.0)
        core.worker_frames([ident, *P.encode_heartbeat()], 100.0)
    core.take()
    return core


def _stored(first: int, n: int) -> dict:
    """One BlockStored of ``n`` blocks with hashes (and tokens) unique from ``first`` on."""
    return KV.encode_event_map(KV.BlockStored(tuple(range(first, first + n)), None,
                                              tuple(range(first * BS, (first + n) * BS)), BS))


def _batch(seq: int, first: int, events: int, per_event: int) -> list[bytes]:
    return P.encode_kv_events(0, 1, seq, 0.0, [_stored(first + i * per_event, per_event) for i in range(events)])


def _entries(core) -> int:
    return core.kv.kv_sink.index.stats()["entries"]


def _kv(core, wid: str, frames: list[bytes]) -> None:
    core.worker_frames([wid.encode(), *frames], 100.0)


def _turn(core) -> None:
    """One loop turn of KV work; the virtual clock never runs out (only the block budgets bound it)."""
    core.run_kv_backlog(lambda: 0.0, 1.0)


def test_a_batch_of_few_huge_events_is_applied_in_block_slices_not_at_once():
    """Issue 32: batches were sliced by event count, so 4 events of 2,048 blocks went into the
    index in one go (inline, the loop stalled). Now they queue and one turn applies at most the
    worker's block budget."""
    core = _core()
    _kv(core, "flood", _batch(0, 1, 4, 2048))
    assert _entries(core) == 0  # not applied inline
    _turn(core)
    assert 0 < _entries(core) <= KV_TURN_BLOCKS
    while core.kv_backlog:
        _turn(core)
    assert _entries(core) == 4 * 2048


def test_a_neighbours_flood_costs_a_worker_nothing_beyond_its_share():
    """Round robin by blocks: with two max-size batches of one worker queued, another worker's
    large batch is applied in full within the first turn, and the flooding worker gets at most
    its per-turn block budget."""
    core = _core()
    _kv(core, "flood", _batch(0, 1, 4, 2048))
    _kv(core, "flood", _batch(1, 100_001, 4, 2048))
    _kv(core, "calm", _batch(0, 1_000_001, 1, 3000))  # > a slice: queued too
    assert _entries(core) == 0
    _turn(core)
    assert _entries(core) <= 3000 + KV_TURN_BLOCKS
    assert core.kv.kv_sink.index.stats()["workers"] == 2
    calm_done = "calm" not in core.kv.queue
    assert calm_done, "the calm worker's batch waited behind the flood"
    # a small batch of the calm worker, while the flood is still queued, is applied at once
    before = _entries(core)
    _kv(core, "calm", _batch(1, 2_000_001, 1, KV_SLICE_BLOCKS // 2))
    assert _entries(core) == before + KV_SLICE_BLOCKS // 2


def test_a_worker_over_its_block_budget_is_dropped_before_decode_and_resynced():
    """Over budget: that worker's batches are dropped undecoded (counted), the calm worker's are
    not, and once its queue drained the worker is asked to resync."""
    core = _core()
    for seq in range(5):
        _kv(core, "flood", _batch(seq, 1 + seq * 10_000, 4, 2048))
    flat = core.stats.flat()
    assert flat["kv.over_budget_dropped"] == 5 - KV_WORKER_QUEUE_BLOCKS // (4 * 2048)
    assert flat["kv.batches"] == KV_WORKER_QUEUE_BLOCKS // (4 * 2048)  # the dropped ones were never decoded
    _kv(core, "calm", _batch(0, 1_000_001, 1, 100))
    assert core.stats.flat().get("kv.over_budget_dropped") == flat["kv.over_budget_dropped"]
    assert _entries(core) == 100
    core.take()
    while core.kv_backlog:
        _turn(core)
    resyncs = [s for s in core.take() if s.frames[1:2] == [_RESYNC]]
    assert [s.identity for s in resyncs] == [b"flood"]
    assert P.decode_broker_to_worker(resyncs[0].frames).reason == "over_budget"
    assert core.stats.flat()["kv.resync_requested"] == 1


def test_oversize_kv_batches_are_refused_at_decode_and_counted():
    """The attack's batch (73,728 blocks in 3.9 MB) and hostile shapes: a ProtocolError naming
    the limit, never an exception; the broker counts it per reason and applies nothing."""
    big = _batch(0, 1, 36, 2048)  # 73,728 blocks
    err = P.decode_worker(big)
    assert isinstance(err, ProtocolError) and err.reason == "kv_batch_too_large", err
    # blocks over the limit in a small body: many one-block removals
    many = P.encode_kv_events(0, 1, 0, 0.0, [{"type": "AllBlocksCleared"}] * (P.MAX_KV_BATCH_BLOCKS + 1))
    assert len(many[2]) < P.MAX_KV_BATCH_BYTES
    err = P.decode_worker(many)
    assert isinstance(err, ProtocolError) and err.reason == "kv_batch_too_large"
    # bytes over the limit: refused before unpacking (a body that is not even msgpack)
    err = P.decode_worker([P.WORKER_HEADER, bytes([P.Cmd.KV_EVENTS]), b"\xc1" * (P.MAX_KV_BATCH_BYTES + 1)])
    assert isinstance(err, ProtocolError) and err.reason == "kv_batch_too_large"
    # exactly at the limit: accepted, its cost known
    ok = P.decode_worker(_batch(0, 1, 4, P.MAX_KV_BATCH_BLOCKS // 4))
    assert isinstance(ok, P.KvEventsMsg) and ok.blocks == P.MAX_KV_BATCH_BLOCKS
    # hostile event shapes are counted, never raise
    assert P.kv_block_count([None, 7, [], ["BlockStored"], ["BlockStored", "x"], {"block_hashes": 5}, {}]) == 7
    assert P.kv_block_count([{"block_hashes": []}, ["BlockRemoved", [1, 2, 3]]]) == 4
    core = _core()
    _kv(core, "flood", big)
    assert core.stats.flat()["frames_rejected.worker.kv_batch_too_large"] == 1
    assert _entries(core) == 0 and not core.kv_backlog


def test_kv_from_an_unregistered_peer_is_not_decoded():
    core = _core()
    core.worker_frames([b"stranger", *_batch(0, 1, 4, 2048)], 100.0)
    assert core.stats.flat()["frames_rejected.worker.unregistered_peer"] == 1
    assert core.stats.flat().get("kv.batches", 0) == 0


def test_split_events_bounds_blocks_and_keeps_chains():
    ev = KV.BlockStored(tuple(range(1, 11)), None, tuple(range(10 * 4)), 4)
    parts = KV.split_events([KV.AllBlocksCleared(), ev, KV.BlockRemoved(tuple(range(7)))], max_tokens=1 << 30, max_blocks=4)
    counts = [KV.event_blocks(p) for p in parts]
    assert max(counts) <= 4 and sum(counts) == 1 + 10 + 7
    stored = [e for p in parts for e in p if type(e) is KV.BlockStored]
    assert [h for e in stored for h in e.block_hashes] == list(range(1, 11))
    assert all(b.parent_block_hash == a.block_hashes[-1] for a, b in zip(stored, stored[1:]))
    removed = [h for p in parts for e in p if type(e) is KV.BlockRemoved for h in e.block_hashes]
    assert removed == list(range(7))


def test_the_relay_slices_what_it_sends_by_blocks():
    """A resync snapshot of 20,000 one-token blocks (a page size of 1: the token budget alone
    let 131,072 blocks into one batch) goes out in batches the broker accepts."""
    sent: list = []
    rs = RankStream(0, "tcp://127.0.0.1:9", None, "", 1, epoch=7)

    def send(_rank: int, frames: list[bytes]) -> None:
        m = P.decode_worker(frames)
        assert isinstance(m, P.KvEventsMsg), m
        sent.append(m)

    relay = KvRelay(zmq.asyncio.Context.instance(), [rs], send)
    rs.mirror.apply([KV.BlockStored(tuple(range(1, 20_001)), None, tuple(range(20_000)), 1)])
    assert relay.snapshot(0)
    assert len(sent) >= 3 and all(m.blocks <= P.MAX_KV_BATCH_BLOCKS for m in sent)
    assert sum(m.blocks for m in sent) == 20_001  # AllBlocksCleared + the blocks
    assert [m.seq for m in sent] == list(range(len(sent)))


def test_the_relay_resplits_a_batch_whose_body_is_too_large():
    """Long token ids and a large --max-batch-tokens: a batch under the block cap can still pass
    the byte cap; it is halved until it fits."""
    sent: list = []
    rs = RankStream(0, "tcp://127.0.0.1:9", None, "", 64, epoch=7)
    relay = KvRelay(zmq.asyncio.Context.instance(), [rs], lambda _r, f: sent.append(P.decode_worker(f)),
                    max_batch_tokens=1 << 20)
    n = 4096
    rs.mirror.apply([KV.BlockStored(tuple(range(1, n + 1)), None, tuple([2**31 + 7] * (n * 64)), 64)])
    relay.snapshot(0)
    assert all(isinstance(m, P.KvEventsMsg) for m in sent), sent[:1]
    assert relay.counters["relay_resplit"] >= 1
    assert sum(m.blocks for m in sent) == n + 1


def test_a_queued_batch_of_a_worker_that_left_is_not_applied():
    core = _core()
    _kv(core, "flood", _batch(0, 1, 4, 2048))
    core.worker_frames([b"flood", *P.encode_disconnect("worker_shutdown")], 100.1)
    while core.kv_backlog:
        _turn(core)
    st = core.kv.kv_sink.index.stats()
    assert st["entries"] == 0 and st["streams"] == 0, st
