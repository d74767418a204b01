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
