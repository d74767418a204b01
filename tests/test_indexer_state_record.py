"""The indexer's checkpoint is an explicit msgpack record (issue 32), not a pickle.

* a record round-trips a random workload: the copy answers every match like the original and
  reaches the same verdicts on what follows;
* the record holds only plain data (no pickle opcode, no class name), and loading a pickle never
  runs it: an old (version <= 3, pickled) checkpoint is a CheckpointError, not code execution;
* hostile records (wrong types, unknown medium bits, missing fields, oversize ints) are refused
  with CheckpointError and leave the running state untouched.
"""

from __future__ import annotations

import os
import pickle

import msgpack
import pytest

from mesh import kv_events as KV
from mesh.errors import CheckpointError
from mesh.indexer.core import IndexerCore
from mesh.indexer.state import STATE_VERSION
from mesh.protocol import pack

from test_indexer import BS, FakeWorker, assert_same_matches, core_answer, reference


def _loaded(core: IndexerCore) -> IndexerCore:
    other = IndexerCore(max_entries=None, block_size=BS)
    other.load_state(core.dump_state())
    return other


def test_a_record_round_trips_a_random_workload_and_the_copy_goes_on_alike() -> None:
    workers = [FakeWorker(f"w{i}", 500 + i, dp_rank=i % 2) for i in range(5)]
    core = IndexerCore(max_entries=None, block_size=BS)
    for w in workers:
        core.register_worker(w.worker_id, BS, now_s=1.0, owner="broker-a", dp_ranks=[w.dp_rank, 7])
    for _ in range(40):
        for w in workers:
            seq, body = w.batch()
            core.apply_batch(w.worker_id, w.dp_rank, w.epoch, seq, body, now_s=2.0, owner="broker-a")
    # a hole in one stream and a tiered block in another
    core.apply_batch("w0", 0, 1, 999, workers[0].batch()[1], now_s=3.0)
    core.apply_batch("t", 0, 1, 0, pack([KV.encode_event_map(KV.BlockStored((1, 2), None, tuple(range(2 * BS)), BS, "CPU"))]),
                     now_s=3.0)
    other = _loaded(core)
    assert other.stats()["entries"] == core.stats()["entries"] > 0
    assert other.uncovered() == core.uncovered() and other.ghosts == core.ghosts
    assert other.index.untrusted_streams() == core.index.untrusted_streams() == [("w0", 0)]
    assert_same_matches(reference(workers[1:]), core_answer(other), workers[1:])
    assert other.match(content_keys_of(2)).SerializeToString() == core.match(content_keys_of(2)).SerializeToString()
    for w in workers[1:]:  # what follows is judged alike
        seq, body = w.batch()
        a = core.apply_batch(w.worker_id, w.dp_rank, w.epoch, seq, body, now_s=4.0)
        b = other.apply_batch(w.worker_id, w.dp_rank, w.epoch, seq, body, now_s=4.0)
        assert a == b
    # ownership came along: another owner may not forget the worker in the copy either
    with pytest.raises(Exception, match="another owner"):
        other.forget_worker("w1", now_s=5.0, owner="intruder")


def content_keys_of(n: int) -> list[int]:
    from mesh.hashing import content_keys

    return content_keys(list(range(n * BS)), BS)


def test_the_record_is_plain_data_and_a_pickle_is_never_run(tmp_path) -> None:
    core = IndexerCore(max_entries=None, block_size=BS)
    core.register_worker("w", BS, now_s=0.0, owner="b")
    blob = core.dump_state()
    rec = msgpack.unpackb(blob, raw=False)
    assert rec["state_version"] == STATE_VERSION and b"mesh.index" not in blob

    marker = tmp_path / "ran"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = pickle.dumps({"state_version": 3, "index": Boom()})
    with pytest.raises(CheckpointError):
        core.load_state(evil)
    assert not marker.exists()
    assert core.stats()["tracked_workers"] == 1


@pytest.mark.parametrize("field,value", [
    ("workers", "not a list"),
    ("workers", [["w", "t", 0.0, 16, "", 0.0, [0], False]]),
    ("streams", [["w", 0, 1, None, -1, True, [[None, [1, 2], [3]]], []]]),  # hashes and keys differ in length
    ("streams", [["w", 0, 1, None, -1, True, [[None, ["x"], [3]]], []]]),
    ("streams", [["w", 0, 1, None, -1, True, [], [[1, 1 << 40]]]]),  # a medium bit nobody named
    ("known", [["w"]]),
    ("expected", [[1, [0]]]),
    ("media", [1]),
    ("state_version", STATE_VERSION - 1),
])
def test_a_hostile_record_is_refused_and_the_state_kept(field, value) -> None:
    core = IndexerCore(max_entries=None, block_size=BS)
    core.apply_batch("w", 0, 1, 0, pack([KV.encode_event_map(KV.BlockStored((1,), None, tuple(range(BS)), BS))]), now_s=0.0)
    rec = msgpack.unpackb(core.dump_state(), raw=False)
    rec[field] = value
    with pytest.raises(CheckpointError):
        core.load_state(msgpack.packb(rec, use_bin_type=True))
    missing = dict(rec, state_version=STATE_VERSION)
    missing.pop("ghosts")
    with pytest.raises(CheckpointError):
        core.load_state(msgpack.packb(missing, use_bin_type=True))
    assert core.index.worker_entries("w") == 1 and core.covered(("w", 0))
