"""Issue 32's indexer leftovers, against a real ``mesh indexer`` process.

* without a token, a caller claiming the owner's ``x-mesh-owner`` from another address could
  forget and re-size its workers: ownership is now bound to the claim and the caller's address;
* one 8M-id MatchPrefix cost 14 s of handler time: ids per query are bounded
  (``--max-match-ids``, INVALID_ARGUMENT naming it, counted) before any work on them.
"""

from __future__ import annotations

import grpc

from mesh.indexer import indexer_pb2 as pb
from mesh.indexer import indexer_pb2_grpc as pb_grpc
from mesh.lab.procs import ProcGroup

from conftest import run
from test_indexer_hardening import code_of, md, raw, spawn, stored

OWNER = md(None, "broker-a")


def test_without_a_token_the_owner_claim_is_bound_to_the_callers_address(tmp_path) -> None:
    group = ProcGroup(tmp_path / "logs")
    try:
        proc, ep = spawn(group, "open-indexer", "--listen", "[::]:0")
        port = ep.rsplit(":", 1)[1]

        async def body() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as mine, \
                    grpc.aio.insecure_channel(f"[::1]:{port}") as theirs:
                a, b = pb_grpc.IndexerStub(mine), pb_grpc.IndexerStub(theirs)
                await a.RegisterWorker(pb.RegisterWorkerRequest(worker_id="w", block_size=16), metadata=OWNER, timeout=5)
                await a.ApplyKvBatch(pb.ApplyKvBatchRequest(worker_id="w", dp_rank=0, epoch=1, seq=0,
                                                            events_msgpack=raw(stored(1, 2))), metadata=OWNER, timeout=5)
                # the same claim from another address: neither forget nor re-size
                denied = grpc.StatusCode.PERMISSION_DENIED
                assert await code_of(b.ForgetWorker(pb.ForgetWorkerRequest(worker_id="w"), metadata=OWNER, timeout=5)) == denied
                assert await code_of(b.RegisterWorker(pb.RegisterWorkerRequest(worker_id="w", block_size=32),
                                                      metadata=OWNER, timeout=5)) == denied
                st = await a.Stats(pb.StatsRequest(), timeout=5)
                assert st.entries == 2 and st.counters["service_permission_denied"] == 2
                # the owner itself still may
                r = await a.ForgetWorker(pb.ForgetWorkerRequest(worker_id="w"), metadata=OWNER, timeout=5)
                assert r.entries_dropped == 2

        run(body(), 30)
    finally:
        group.stop_all()


def test_match_ids_are_bounded_before_any_work(tmp_path) -> None:
    group = ProcGroup(tmp_path / "logs")
    try:
        _, ep = spawn(group, "bounded", "--max-match-ids", "4096")

        async def body() -> None:
            async with grpc.aio.insecure_channel(ep.split("//")[1]) as ch:
                s = pb_grpc.IndexerStub(ch)
                for req in (pb.MatchPrefixRequest(token_ids=list(range(4097)), block_size=1),
                            pb.MatchPrefixRequest(keys=list(range(4097)), block_size=16)):
                    with_err = s.MatchPrefix(req, timeout=5)
                    try:
                        await with_err
                        raise AssertionError("accepted")
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_match_ids" in exc.details()
                # at the bound (hashed in slices): answered
                r = await s.MatchPrefix(pb.MatchPrefixRequest(token_ids=list(range(4096)), block_size=1), timeout=5)
                assert r.query_blocks == 4096
                st = await s.Stats(pb.StatsRequest(), timeout=5)
                assert st.counters["service_refused_match_ids"] == 2

        run(body(), 30)
    finally:
        group.stop_all()


def test_long_prompts_are_hashed_in_slices_to_the_same_keys() -> None:
    import random

    from mesh.hashing import content_keys
    from mesh.indexer.server import content_keys_sliced

    toks = [random.Random(3).randrange(1, 50_000) for _ in range(200_003)]
    for bs in (1, 16, 48_000):
        assert run(content_keys_sliced(toks, bs, 7), 30) == content_keys(toks, bs, 7)


def test_a_bad_max_match_ids_is_refused_naming_it(tmp_path) -> None:
    import re
    import subprocess
    import sys

    for bad in ("0", "-5", "many"):  # the field (max_match_ids) or its flag (--max-match-ids) is named
        p = subprocess.run([sys.executable, "-m", "mesh.cli", "indexer", "--max-match-ids", bad],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and re.search("max.match.ids", p.stderr) and "Traceback" not in p.stderr


def test_the_replay_guard_refuses_repeats_and_stale_entries_and_round_trips() -> None:
    import pytest

    from mesh.indexer.signing import MAX_SKEW_MS, LogSigner, ReplayGuard

    g = ReplayGuard()
    t = 1_000_000_000
    assert [g.check(7, n, t, t + 5) for n in (1, 3, 2)] == ["", "", ""]  # out of order within the window: fine
    assert g.check(7, 2, t, t + 6) == "replayed"
    assert g.check(8, 1, t - MAX_SKEW_MS - 1, t) == "stale"  # a replay of an entry older than the skew
    assert g.check(7, 3 - 10_000, t, t) == "replayed"  # far below the window
    for n in range(4, 20_000):  # a flood from one origin keeps the guard bounded
        assert g.check(7, n, t, t) == ""
    assert len(g.origins[7][2]) <= 2 * 4096
    h = ReplayGuard()
    h.load(g.dump())
    assert h.check(7, 19_999, t, t) == "replayed" and h.check(7, 20_000, t, t) == ""
    g.prune(t + 3 * MAX_SKEW_MS)
    assert not g.origins
    with pytest.raises((TypeError, ValueError)):
        h.load(b"\x92\x00\x91\x94\xa1x\x01\x02\x90")  # a string where an origin belongs
    # a forged stream id far in the future (every later id carries its time) makes no genuine entry stale
    f = ReplayGuard()
    assert f.check(9, 1, t, t) == ""
    assert f.check(9, 2, t + 1_000, t + 10**12) == ""  # the store's time is believed up to the skew past t
    assert f.check(9, 3, t - MAX_SKEW_MS - 5, t + 10**12) == "stale"  # an old entry replayed stays stale
    g2 = ReplayGuard()
    g2.load(f.dump())
    assert g2.newest_ms == t + 1_000 and g2.check(9, 4, t + 2_000, t + 10**12) == ""
    s = LogSigner(b"k" * 32)
    assert s.check_entry(1, b"p", s.entry_mac(1, b"p")) == ""
    assert s.check_entry(2, b"p", s.entry_mac(1, b"p")) == "bad_signature"  # another state: not replayable into it
    assert s.check_entry(1, b"p", b"") == "unsigned" and LogSigner(None).check_entry(1, b"p", b"") == ""
