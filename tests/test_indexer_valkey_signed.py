"""Issue 32: writers of the Valkey store without the indexer token, against real replicas.

Each test is an attack that worked before: forged ``forget`` entries wiped the index, a forged
``apply`` made the index claim a worker held a prompt it never computed, a genuine entry copied
back into the log undid a forget, one forged checkpoint (bad signature, trim mark ahead) froze
every running replica silently and stopped new ones from starting. Targets: 0 forged entries
applied, no replica frozen, no start stopped; each rejection counted and logged by name.
"""

from __future__ import annotations

import grpc
import msgpack
import pytest
import redis

from mesh.indexer import indexer_pb2 as pb
from mesh.indexer import indexer_pb2_grpc as pb_grpc
from mesh.indexer.shared import parse_id
from mesh.lab.procs import wait_for_log_event

from conftest import run, until
from test_indexer_valkey import BS, _batch, _keys, _replica, valkey  # noqa: F401 (the fixture)

TOKEN = "the-indexer-token"
MD = (("authorization", f"Bearer {TOKEN}"), ("x-mesh-owner", "broker-a"))
LOG, CKPT = "mesh:indexer:log", "mesh:indexer:checkpoint"


@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_text(TOKEN + "\n")
    return str(p)


async def _apply(s, seq: int, worker: str = "w"):
    return await s.ApplyKvBatch(pb.ApplyKvBatchRequest(worker_id=worker, dp_rank=0, epoch=1, seq=seq,
                                                       events_msgpack=_batch(seq)), timeout=5, metadata=MD)


async def _held(s, n: int) -> dict[str, int]:
    r = await s.MatchPrefix(pb.MatchPrefixRequest(keys=_keys(n), block_size=BS), timeout=5, metadata=MD)
    return {w: lv.matched_blocks for lv in r.levels for w in lv.worker_ids}


async def _counters(s) -> dict[str, int]:
    return dict((await s.Stats(pb.StatsRequest(), timeout=5, metadata=MD)).counters)


async def _apply_until_held(endpoint: str, first: int, n: int) -> dict[str, int]:
    """Batches ``first..first+n`` through ``endpoint``, then its counters once it holds them all."""
    async with grpc.aio.insecure_channel(endpoint.split("//")[1]) as ch:
        s = pb_grpc.IndexerStub(ch)
        for seq in range(first, first + n):
            await _apply(s, seq)

        async def holds():
            return (await _held(s, first + n)).get("w") == first + n

        await until(holds, 10, "the replica applies what follows")
        return await _counters(s)


def test_forged_and_replayed_entries_are_never_applied(procs, valkey, token_file):
    _, url, _ = valkey
    r1, ep = _replica(procs, "r1", url, 0, "--token-file", token_file)
    rc = redis.Redis.from_url(url)

    async def body():
        async with grpc.aio.insecure_channel(ep.split("//")[1]) as ch:
            s = pb_grpc.IndexerStub(ch)
            for seq in range(3):
                await _apply(s, seq)
            await _apply(s, 0, worker="gone")
            await s.ForgetWorker(pb.ForgetWorkerRequest(worker_id="gone"), timeout=5, metadata=MD)
            assert await _held(s, 3) == {"w": 3}
            genuine = [f for _, f in rc.xrange(LOG)]
            origin = msgpack.unpackb(genuine[0][b"o"])[0]
            # the attacks of the issue: a forged forget (unsigned, and with a made-up signature),
            # a forged apply claiming "evil" holds the prompt, and every genuine entry copied back
            # (the apply of the forgotten worker "gone" among them)
            forget = msgpack.packb([origin, 10**6, 0, "forget", "w", "broker-a"])
            apply = msgpack.packb([origin, 10**6 + 1, 0, "apply", "evil", 0, 1, 0, _batch(0), ""])
            for f in genuine:
                rc.xadd(LOG, f)
            rc.xadd(LOG, {b"o": forget})
            rc.xadd(LOG, {b"o": msgpack.packb([origin, "forget", "w", "broker-a"])})  # the entry shape before issue 32
            rc.xadd(LOG, {b"o": forget, b"m": b"\0" * 32})
            rc.xadd(LOG, {b"o": apply, b"m": b"x"})
            pipe = rc.pipeline(transaction=False)
            for i in range(2000):  # a flood of forgeries: counted and skipped, the tail keeps up
                pipe.xadd(LOG, {b"o": forget, b"m": i.to_bytes(32, "big")})
            pipe.execute()
            await _apply(s, 3)  # a genuine entry after them: the tail went past them
            assert await _held(s, 4) == {"w": 4}
            c = await _counters(s)
            assert c["service_log_bad_entries_unsigned"] == 2 and c["service_log_bad_entries_bad_signature"] == 2002
            assert c["service_log_bad_entries_replayed"] == len(genuine)
            st = await s.Stats(pb.StatsRequest(), timeout=5, metadata=MD)
            assert st.ready and st.store_rejected == "log entry: bad_signature"

    run(body(), 60)
    assert "indexer_log_entry_rejected" in r1.log_path.read_text()
    # a replica started now replays the same log and refuses the same entries
    _, ep2 = _replica(procs, "late", url, 0, "--token-file", token_file)

    async def late():
        async with grpc.aio.insecure_channel(ep2.split("//")[1]) as ch:
            s = pb_grpc.IndexerStub(ch)
            assert await _held(s, 4) == {"w": 4}

    run(late(), 30)


def test_a_forged_far_future_stream_id_makes_no_genuine_entry_stale(procs, valkey, token_file):
    """A writer without the token appends an entry whose stream id lies years ahead: Valkey then gives
    every later entry an id at that time. The genuine mutations after it still apply."""
    _, url, _ = valkey
    _, ep = _replica(procs, "r1", url, 0, "--token-file", token_file)
    rc = redis.Redis.from_url(url)

    async def body():
        async with grpc.aio.insecure_channel(ep.split("//")[1]) as ch:
            s = pb_grpc.IndexerStub(ch)
            for seq in range(2):
                await _apply(s, seq)
            assert await _held(s, 2) == {"w": 2}
            rc.xadd(LOG, {b"o": b"forged"}, id=f"{2**52}-0")  # ~140,000 years from now
            for seq in range(2, 4):
                await _apply(s, seq)
            assert await _held(s, 4) == {"w": 4}
            c = await _counters(s)
            assert c.get("service_log_bad_entries_stale", 0) == 0, c

    run(body(), 60)


@pytest.mark.parametrize("signed", [True, False])
def test_a_forged_checkpoint_freezes_no_replica_and_stops_no_start(procs, valkey, token_file, signed):
    _, url, _ = valkey
    auth = ("--token-file", token_file) if signed else ()
    r1, ep = _replica(procs, "r1", url, 0, *auth)
    rc = redis.Redis.from_url(url)

    run(_apply_until_held(ep, 0, 2), 30)
    # the checkpoint of the issue: ahead of the log, trim mark ahead, a made-up signature (with a
    # token) or none (without), and a state record that is garbage
    rc.hset(CKPT, mapping={b"id": b"99999999999999-0", b"trimmed": b"99999999999998-0", b"data": b"\xc1",
                           b"guard": b"", b"mac": b"\0" * 32})
    c = run(_apply_until_held(ep, 2, 3), 30)  # the running replica is not frozen
    assert c["service_checkpoints_rejected"] == 1
    late, ep2 = _replica(procs, "late", url, 0, *auth)  # a new replica starts
    rec = wait_for_log_event(late.log_path, "indexer_checkpoint_rejected", 10, late.popen, start=late.log_start)
    assert rec["reason"] == ("bad_signature" if signed else "ahead_of_the_log")
    run(_apply_until_held(ep2, 5, 1), 30)  # and serves: rebuilt from the log, follows it
    assert "Traceback" not in r1.log_path.read_text() + late.log_path.read_text()


def test_no_token_no_store_and_the_password_file_is_validated(procs, valkey, tmp_path):
    _, url, _ = valkey
    p = procs.spawn("nosign", ["indexer", "--listen", "127.0.0.1:0", "--backend", "valkey", "--valkey-url", url])
    assert p.popen.wait(30) == 2
    out = p.log_path.read_text()
    assert "token_file" in out and "--insecure-store" in out and "Traceback" not in out
    for i, content in enumerate((None, "", "two words", "x" * 5000)):
        f = tmp_path / f"pw{i}"
        if content is not None:
            f.write_text(content)
        p = procs.spawn(f"pw{i}", ["indexer", "--listen", "127.0.0.1:0", "--backend", "valkey", "--valkey-url", url,
                                   "--insecure-store", "--valkey-password-file", str(f)])
        assert p.popen.wait(30) == 2
        out = p.log_path.read_text()
        assert "valkey_password_file" in out and "Traceback" not in out


def test_the_deploy_files_run_valkey_with_a_password_and_sign_with_a_token():
    """Issue 32: the compose file ran Valkey without a password (and the indexer without a token)."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parent.parent / "deploy"
    compose = yaml.safe_load((root / "compose.yaml").read_text())["services"]
    assert "--requirepass" in " ".join(compose["valkey"]["command"])
    k8s = (root / "k8s" / "mesh.yaml").read_text()
    assert "--requirepass" in k8s and "MESH_VALKEY_PASSWORD" in k8s
    for name, svc in compose.items():
        argv = svc.get("command", [])
        if argv[:1] == ["indexer"] and "valkey" in argv:
            assert "--token-file" in argv and "--valkey-password-file" in argv and "--insecure-store" not in argv, name
        if argv[:1] == ["broker"]:
            assert "--kv-indexer-token-file" in argv, name


def test_a_signed_checkpoint_loads_and_carries_the_replay_guard(procs, valkey, token_file):
    """A replica that starts from a signed checkpoint refuses the same replays as one that saw
    every entry (the guard is part of the checkpoint): the replicas never disagree."""
    _, url, _ = valkey
    r1, ep = _replica(procs, "r1", url, 0, "--token-file", token_file, "--checkpoint-every", "5")
    rc = redis.Redis.from_url(url)

    async def body():
        async with grpc.aio.insecure_channel(ep.split("//")[1]) as ch:
            s = pb_grpc.IndexerStub(ch)
            await _apply(s, 0, worker="gone")
            for seq in range(12):
                await _apply(s, seq)
            await s.ForgetWorker(pb.ForgetWorkerRequest(worker_id="gone"), timeout=5, metadata=MD)

    run(body(), 30)
    wait_for_log_event(r1.log_path, "indexer_checkpoint_written", 10, r1.popen, start=r1.log_start)
    late, ep2 = _replica(procs, "late", url, 0, "--token-file", token_file)
    wait_for_log_event(late.log_path, "indexer_checkpoint_loaded", 10, late.popen, start=late.log_start)
    ck_id = rc.hget(CKPT, "id")
    covered = [f for eid, f in rc.xrange(LOG) if parse_id(eid) <= parse_id(ck_id)]  # the late replica never read them
    assert covered
    for f in covered:
        rc.xadd(LOG, f)

    async def check(endpoint):
        async with grpc.aio.insecure_channel(endpoint.split("//")[1]) as ch:
            s = pb_grpc.IndexerStub(ch)

            async def caught_up():
                return (await _counters(s)).get("service_log_bad_entries_replayed", 0) == len(covered)

            await until(caught_up, 10, "every replay refused")
            assert await _held(s, 12) == {"w": 12}

    run(check(ep), 30)
    run(check(ep2), 30)


def test_a_signed_checkpoint_that_does_not_load_is_skipped_once_and_rebuilt_from_the_log(procs, valkey, token_file):
    """A token holder of another version (or a bug) wrote a checkpoint that verifies but does not
    load: a starting replica rebuilds from the log, and does not reload it on every read."""
    from mesh.indexer.signing import LogSigner, mac_key_from_token

    _, url, _ = valkey
    r1, ep = _replica(procs, "r1", url, 0, "--token-file", token_file)
    rc = redis.Redis.from_url(url)

    run(_apply_until_held(ep, 0, 3), 30)
    last = rc.xrevrange(LOG, count=1)[0][0]
    first = rc.xrange(LOG, count=1)[0][0]  # a trim mark above 0-0: the tail checks it on every read
    sid = int(rc.get("mesh:indexer:state"))
    signer = LogSigner(mac_key_from_token(TOKEN))
    for data, guard in ((b"\xc1", b""), (msgpack.packb({"state_version": 99}), b"\xc1")):
        rc.hset(CKPT, mapping={b"id": last, b"trimmed": first, b"data": data, b"guard": guard,
                               b"mac": signer.checkpoint_mac(sid, last, first, data, guard)})
        late, ep2 = _replica(procs, f"late{len(data)}", url, 0, "--token-file", token_file)
        wait_for_log_event(late.log_path, "indexer_checkpoint_incompatible", 10, late.popen, start=late.log_start)
        c = run(_apply_until_held(ep2, 3 if len(data) == 1 else 4, 1), 30)
        assert c["service_checkpoints_incompatible"] == 1 and c.get("service_checkpoints_rejected", 0) == 0
