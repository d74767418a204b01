"""The adapter's KV relay against the stub's real ZMQ publisher (in-process sockets on 127.0.0.1):
gap replay, lost history, publisher restart (sequence back to 0, or a replay whose timestamps
differ), resync snapshots equal to the engine's cache. Relayed batches go through the broker's
own index code (LocalIndexProvider) so index effects are checked, not just frames.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from mesh import kv_events as KV
from mesh import protocol as P
from mesh.adapters.kv_relay import KvRelay, RankStream
from mesh.engine_model import EngineConfig, EngineModel
from mesh.routing.providers import LocalIndexProvider
from tests.conftest import run
from tests.adapters_support import until
from workers_stub.sglang_wire import SGLANG_PUB, SGLANG_REPLAY_ROUTER, KvPublisher, bind_port_range

BS = 4
WID = "w"


class Rig:
    """Publisher (the stub's code) -> KvRelay -> LocalIndexProvider."""

    def __init__(self, *, buffer_steps: int = 100, replay_frames: int = 4, form: str = "map", replay: bool = True) -> None:
        self.ctx = zmq.asyncio.Context.instance()
        self.form, self.replay_frames, self.buffer_steps, self.use_replay = form, replay_frames, buffer_steps, replay
        self.kv_port = self.replay_port = 0
        self.pub: KvPublisher | None = None
        self._pub_task: asyncio.Task | None = None
        self.open_publisher()
        self.provider = LocalIndexProvider(speculative_ttl_s=0)
        self.provider.add_worker(WID, BS)
        self.msgs: list[P.KvEventsMsg] = []
        self.entries_log: list[int] = []  # the worker's index entries after each relayed batch
        rs = RankStream(0, f"tcp://127.0.0.1:{self.kv_port}", f"tcp://127.0.0.1:{self.replay_port}" if replay else None, "", BS, epoch=100)
        self.rs = rs
        self.relay = KvRelay(self.ctx, [rs], self._sink, replay_timeout_s=2.0)
        self.relay.start()

    def open_publisher(self) -> None:
        (pub,), self.kv_port = bind_port_range(self.ctx, SGLANG_PUB, "127.0.0.1", self.kv_port, 1)
        rep = None
        if self.use_replay:
            (rep,), self.replay_port = bind_port_range(self.ctx, SGLANG_REPLAY_ROUTER, "127.0.0.1", self.replay_port, 1)
        self._wrap(pub, rep)

    async def reopen_publisher(self) -> None:
        """Bind the same ports again (libzmq closes listeners asynchronously: retry while in use)."""
        def bound(spec, port):
            try:
                return bind_port_range(self.ctx, spec, "127.0.0.1", port, 1)[0]
            except zmq.ZMQError:
                return None  # still in use

        (pub,) = await until(lambda: bound(SGLANG_PUB, self.kv_port), 5, "KV port released", step_s=0.02)
        (rep,) = await until(lambda: bound(SGLANG_REPLAY_ROUTER, self.replay_port), 5, "replay port released", step_s=0.02)
        self._wrap(pub, rep)

    def _wrap(self, pub, rep) -> None:
        self.pub = KvPublisher(0, pub, rep, form=self.form, replay_frames=self.replay_frames, buffer_steps=self.buffer_steps)
        self._pub_task = asyncio.create_task(self.pub.serve_replay())

    async def close_publisher(self) -> None:
        assert self.pub is not None and self._pub_task is not None
        self._pub_task.cancel()
        await asyncio.gather(self._pub_task, return_exceptions=True)
        self.pub.close()

    def _sink(self, rank: int, frames: list[bytes]) -> None:
        m = P.decode_worker(frames)
        assert isinstance(m, P.KvEventsMsg)
        self.msgs.append(m)
        assert not self.provider.on_kv_events(WID, m, time.monotonic()), "the relayed stream must never need a resync"
        self.entries_log.append(self.entries())

    def entries(self) -> int:
        return self.provider.index.worker_entries(WID)

    async def synced(self, timeout_s: float = 5.0) -> None:
        """Publish empty probes until the relay has seen the latest one live (SUB joined)."""
        t_end = time.monotonic() + timeout_s
        while True:
            seq = self.pub.publish([])
            try:
                await until(lambda: self.rs.last_seq >= seq, 0.1)
                return
            except TimeoutError:
                if time.monotonic() > t_end:
                    raise

    def probe_until_restart_seen(self) -> bool:
        """One empty probe unless the relay already saw the publisher restart (the SUB reconnects
        in its own time: probes until then)."""
        if self.relay.counters["engine_restarts"] == 0:
            self.pub.publish([])
        return self.relay.counters["engine_restarts"] > 0

    async def close(self) -> None:
        await self.relay.stop()
        await self.close_publisher()


def _stored(first: int, n_blocks: int, parent: int | None = None) -> KV.BlockStored:
    hashes = tuple(range(first, first + n_blocks))
    return KV.BlockStored(hashes, parent, tuple(t for h in hashes for t in (h,) * BS), BS, "GPU")


def test_a_dropped_live_batch_is_replayed_in_order():
    async def go():
        rig = Rig()
        try:
            await rig.synced()
            rig.pub.publish([_stored(10, 2)])
            rig.pub.drop_next(2)  # a slow subscriber's HWM drop: the live PUB skips these two
            rig.pub.publish([_stored(20, 1, parent=11)])
            rig.pub.publish([KV.BlockRemoved((20,), "GPU")])
            last = rig.pub.publish([_stored(30, 3)])
            await until(lambda: rig.rs.last_seq == last, 5, "relay caught up")
            assert rig.pub.dropped == 2
            c = rig.relay.counters
            assert c["gaps"] >= 1 and c["history_lost"] == 0 and c["engine_restarts"] == 0
            stored = [e for m in rig.msgs for e in KV.decode_events(m.events)[0] if type(e) is not KV.AllBlocksCleared]
            assert [e.block_hashes for e in stored] == [(10, 11), (20,), (20,), (30, 31, 32)]  # in publish order
            assert [m.seq for m in rig.msgs] == list(range(len(rig.msgs)))  # mesh seq contiguous
            assert rig.entries() == 5 and set(k[1] for k in rig.rs.mirror.blocks) == {10, 11, 30, 31, 32}
        finally:
            await rig.close()

    run(go(), 30)


def test_lost_history_clears_the_rank_and_never_over_reports():
    async def go():
        rig = Rig(buffer_steps=2, replay_frames=3, form="array")
        try:
            await rig.synced()
            rig.pub.publish([_stored(10, 2)])
            await until(lambda: rig.entries() == 2, 5)
            rig.pub.drop_next(3)
            rig.pub.publish([KV.BlockRemoved((11,), "GPU")])  # lost for good: the buffer keeps 2 batches
            rig.pub.publish([_stored(40, 1)])
            rig.pub.publish([_stored(50, 1)])
            last = rig.pub.publish([_stored(60, 1)])
            await until(lambda: rig.rs.last_seq == last, 5)
            assert rig.relay.counters["history_lost"] == 1
            kinds = [[type(e).__name__ for e in KV.decode_events(m.events)[0]] for m in rig.msgs]
            assert ["AllBlocksCleared"] in kinds[1:]
            # 10 and 11 are gone (11 may have been evicted; 10 we cannot vouch for), 50 and 60 kept
            assert set(k[1] for k in rig.rs.mirror.blocks) == {50, 60} and rig.entries() == 2
        finally:
            await rig.close()

    run(go(), 30)


def test_publisher_restart_sequence_back_to_zero_gives_a_new_epoch():
    async def go():
        rig = Rig()
        try:
            await rig.synced()
            for i in range(6):
                rig.pub.publish([_stored(100 + 10 * i, 1)])
            await until(lambda: rig.entries() == 6, 5)
            old_epoch = rig.msgs[-1].epoch
            await rig.close_publisher()  # the server dies ...
            await rig.reopen_publisher()  # ... and comes back on the same ports, counting from 0
            rig.pub.publish([KV.AllBlocksCleared()])  # seq 0 (SGLang's startup reset)
            rig.pub.publish([_stored(900, 2)])  # seq 1
            await until(lambda: rig.probe_until_restart_seen(), 10, "restart detected", step_s=0.05)
            await until(lambda: 900 in {k[1] for k in rig.rs.mirror.blocks}, 5, "history of the new publisher relayed")
            new = [m for m in rig.msgs if m.epoch > old_epoch]
            assert new and new[0].seq == 0 and KV.decode_events(new[0].events)[0] == [KV.AllBlocksCleared()]
            assert rig.msgs[-1].epoch == old_epoch + 1
            assert rig.entries() == 2  # old blocks dropped, the new server's rebuilt
            i6 = rig.entries_log.index(6)
            assert 0 in rig.entries_log[i6:] and rig.entries_log[-1] == 2  # 6 -> 0 (new epoch) -> 2
        finally:
            await rig.close()

    run(go(), 30)


def test_restart_hidden_behind_a_gap_is_found_by_replay_timestamps():
    async def go():
        rig = Rig()
        try:
            await rig.synced()
            rig.pub.publish([_stored(100, 1)])
            rig.pub.publish([_stored(200, 1)])
            await until(lambda: rig.entries() == 2, 5)
            last_before = rig.rs.last_seq
            await rig.close_publisher()
            await rig.reopen_publisher()
            # the new server publishes past our last seq before the SUB reconnects: a "gap"
            for i in range(last_before + 3):
                rig.pub.publish([_stored(1000 + i, 1)] if i else [KV.AllBlocksCleared()])
            await until(lambda: rig.probe_until_restart_seen(), 10, "restart detected", step_s=0.05)
            await until(lambda: rig.entries() == last_before + 2, 5)
            assert {k[1] for k in rig.rs.mirror.blocks} == {1000 + i for i in range(1, last_before + 3)}
            assert rig.relay.counters["history_lost"] == 0
            assert rig.relay.counters["restart_replay_timestamp_mismatch"] == 1
        finally:
            await rig.close()

    run(go(), 30)


def test_snapshot_matches_the_engine_cache_and_rebuilds_an_index():
    async def go():
        rig = Rig()
        eng = EngineModel(EngineConfig(page_size=BS, max_total_num_tokens=256, admission_reserve_tokens=8))
        try:
            await rig.synced()
            rig.pub.publish(eng.drain_events())
            now = 0.0
            for i in range(12):  # enough traffic to evict: stores and removals both flow
                eng.submit(i, [i % 3] * 20 + [i] * 30, 4, now)
                while eng.has_work():
                    res = eng.step(now)
                    now += res.duration_s
                    if res.kv_events:
                        rig.pub.publish(res.kv_events)
            last = rig.pub.publish(eng.drain_events())
            await until(lambda: rig.rs.last_seq >= last, 5)
            mirror = {(k[1], v[0]) for k, v in rig.rs.mirror.blocks.items()}
            assert mirror == set(eng.cached_blocks())
            n_live = rig.entries()
            assert n_live == eng.num_cached_pages
            fresh = LocalIndexProvider(speculative_ttl_s=0)
            fresh.add_worker(WID, BS)
            before = len(rig.msgs)
            rig.relay.snapshot(0)
            for m in rig.msgs[before:]:
                fresh.on_kv_events(WID, m, 0.0)
            assert fresh.index.worker_entries(WID) == n_live
            assert rig.entries() == n_live  # the snapshot is idempotent for an index already in sync
        finally:
            await rig.close()

    run(go(), 30)


# ---------------------------------------------------------------- logprob lists through the request proxy


@pytest.mark.filterwarnings("ignore:Bare functions are deprecated")  # the in-process stub's lambda routes
def test_logprob_lists_travel_as_their_new_part_per_chunk_and_whole_when_unstreamed():
    """Cumulative (SGLang's default) and incremental engine streams give the same frames: each
    CHUNK's ``meta_info`` lists hold the entries of its own tokens (the input ones with the first
    chunk), the FINAL those of its delta; an unstreamed FINAL has the whole answer's."""
    from mesh.adapters.base import Adapter
    from mesh.adapters.settings import AttachSettings
    from mesh.adapters.sglang import SglangBackend
    from tests.adapters_support import FakeBroker
    from workers_stub.sglang_server import SglangStub, StubSettings

    params = {"max_new_tokens": 6, "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True,
              "logprob_start_len": 0}

    async def go():
        for incremental in (False, True):
            stub = SglangStub(StubSettings(port=0, kv_port=None, load_port=None, time_scale=0.001,
                                           incremental_streaming_output=incremental))
            url = (await stub.start())["url"]
            fb = FakeBroker().start()
            s = AttachSettings(url=url, brokers=(fb.endpoint,), worker_id="w", heartbeat_ms=100, load_poll_ms=100)
            ad = Adapter(s, SglangBackend(s))
            await ad.start()
            try:
                await until(lambda: fb.readies and fb.sessions, 10, "registration")
                assert ad.info.incremental_streaming is incremental
                fb.request(1, P.encode_submit("s", input_ids=[3, 4, 5], params=params, stream=True)[2])
                fb.request(2, P.encode_submit("n", input_ids=[3, 4, 5], params=params, stream=False)[2])
                await until(lambda: {1, 2} <= set(fb.finals), 10, "replies")
                last = P.unpack(fb.finals[1].data)
                parts = [*fb.chunks[1], last]
                assert len(parts) >= 3
                for i, part in enumerate(parts):
                    m = part["meta_info"]
                    assert [e[1] for e in m["output_token_logprobs"]] == part["token_ids"]  # exactly its own tokens
                    assert [t[0] for t in m["output_top_logprobs"]] == m["output_token_logprobs"]
                    assert ("input_token_logprobs" in m) == (i == 0)
                assert [e[1] for e in parts[0]["meta_info"]["input_token_logprobs"]] == [3, 4, 5]
                whole = P.unpack(fb.finals[2].data)
                assert [e[1] for e in whole["meta_info"]["output_token_logprobs"]] == whole["token_ids"]
                assert len(whole["token_ids"]) == 6 and len(whole["meta_info"]["input_top_logprobs"]) == 3
                assert ad.counters["meta_info_truncated"] == 0
            finally:
                await ad.close()
                await fb.close()
                await stub.stop()

    run(go(), 60)


def test_oversized_logprob_lists_lose_inputs_then_alternatives_counted():
    from mesh.adapters import proxy as B

    class Probe:
        counters = __import__("collections").Counter()
        bounded_lists = B.RequestProxy.bounded_lists

    probe = Probe()
    triple = [-0.5, 123456, " consectetur"]
    out_lp = [triple] * 20_000
    small = {"output_token_logprobs": [triple] * 3, "output_top_logprobs": [[triple] * 2] * 3}
    assert probe.bounded_lists(small) is small and not probe.counters["meta_info_truncated"]  # a chunk: not measured
    big_inputs = {"output_token_logprobs": out_lp[:100], "input_token_logprobs": out_lp * 3}
    assert list(probe.bounded_lists(big_inputs)) == ["output_token_logprobs"]
    big_tops = {"output_token_logprobs": out_lp, "output_top_logprobs": [[triple] * 5] * 20_000}
    assert list(probe.bounded_lists(big_tops)) == ["output_token_logprobs"]
    assert probe.bounded_lists({"output_token_logprobs": out_lp * 3}) == {}
    assert probe.counters["meta_info_truncated"] == 3
