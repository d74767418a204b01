"""MESH/1 codec: round trips and the decode boundary's negative cases (pure, no sockets)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from mesh import protocol as P
from mesh.errors import ErrorCode, ProtocolError
from mesh.load import LoadStat


def test_submit_round_trip():
    f = P.encode_submit("r1", input_ids=[1, 2, 3], params={"max_new_tokens": 7, "temperature": 0.5}, deadline_ms=1500,
                        stream=False, idempotent=False, slo={"ttft_ms": 200, "tps": 20.5})
    m = P.decode_client(f)
    assert isinstance(m, P.Submit)
    assert (m.rid, m.input_ids, m.max_new_tokens, m.deadline_ms, m.stream, m.idempotent) == ("r1", [1, 2, 3], 7, 1500, False, False)
    assert (m.ttft_slo_ms, m.tps_slo) == (200, 20.5)
    assert m.params["temperature"] == 0.5
    assert m.raw == f[2]


@given(rid=st.text(min_size=1, max_size=40), ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=50),
       mnt=st.integers(0, 5000), stream=st.booleans())
@settings(max_examples=100, deadline=None)
def test_submit_round_trip_property(rid, ids, mnt, stream):
    m = P.decode_client(P.encode_submit(rid, input_ids=ids, params={"max_new_tokens": mnt}, stream=stream))
    assert isinstance(m, P.Submit) and m.rid == rid and m.input_ids == ids and m.max_new_tokens == mnt and m.stream == stream


def test_worker_path_round_trips():
    r = P.Ready("w1", "m", "prefill", {"zone": "a"}, 16, 64, 1000, 2, 7, 250)
    assert P.decode_worker(P.encode_ready(r)) == r
    hb = P.decode_worker(P.encode_heartbeat([LoadStat(1, 2, 3, 4, 1, 5, 6, 7, 8, 9)]))
    assert isinstance(hb, P.Heartbeat) and hb.load[0].num_waiting_uncached_tokens == 5 and hb.load[0].attn_dp_rank == 1
    ch = P.decode_worker(P.encode_worker_chunk(5, 2, 0, {"token_ids": [9]}))
    assert isinstance(ch, P.WorkerChunk) and (ch.rid, ch.attempt, ch.seq) == (5, 2, 0) and P.unpack(ch.data) == {"token_ids": [9]}
    fin = P.decode_worker(P.encode_worker_final(5, 2, "length", {"prompt_tokens": 3}))
    assert isinstance(fin, P.WorkerFinal) and fin.usage == {"prompt_tokens": 3}
    err = P.decode_worker(P.encode_worker_error(5, 1, ErrorCode.WORKER_LOST, "x"))
    assert isinstance(err, P.WorkerError) and err.code == "worker_lost"
    kv = P.decode_worker(P.encode_kv_events(0, 3, 9, 1.5, [{"type": "AllBlocksCleared"}]))
    assert isinstance(kv, P.KvEventsMsg) and (kv.dp_rank, kv.epoch, kv.seq) == (0, 3, 9)
    req = P.decode_broker_to_worker(P.encode_request(11, 1, 500, "c1", P.encode_submit("c1", text="hi")[2], {"room": 4}))
    assert isinstance(req, P.Request) and req.submit.text == "hi" and req.bootstrap == {"room": 4}
    assert isinstance(P.decode_broker_to_worker(P.encode_resync(0, "gap")), P.Resync)


def test_client_reply_round_trips():
    a = P.decode_client_reply(P.encode_accepted("r", "w", "power_of_two", 1))
    assert isinstance(a, P.Accepted) and a.worker == "w"
    c = P.decode_client_reply(P.encode_client_chunk("r", 3, P.pack({"token_ids": [1]})))
    assert isinstance(c, P.ClientChunk) and c.seq == 3 and c.data == {"token_ids": [1]}
    f = P.decode_client_reply(P.encode_client_final("r", "length", {"x": 1}, "w", 2, P.pack({}), "cache_hit"))
    assert isinstance(f, P.ClientFinal) and f.reason == "cache_hit" and f.attempt == 2
    e = P.decode_client_reply(P.encode_client_error(None, ErrorCode.BAD_REQUEST, "no"))
    assert isinstance(e, P.ClientError) and e.rid is None and e.code == "bad_request"


SUB = P.encode_submit("r1", input_ids=[1, 2, 3])


@pytest.mark.parametrize("frames,reason", [
    ([], "bad_frame_count"),
    ([P.CLIENT_HEADER], "bad_frame_count"),
    ([P.CLIENT_HEADER, b"\x11"], "bad_frame_count"),
    (SUB + [b"extra"], "bad_frame_count"),
    ([b"MESHC0", b"\x11", SUB[2]], "bad_header"),
    ([b"MESHC1\x00", b"\x11", SUB[2]], "bad_header"),
    ([P.WORKER_HEADER, b"\x11", SUB[2]], "wrong_path"),
    ([P.CLIENT_HEADER, b"", SUB[2]], "bad_command"),
    ([P.CLIENT_HEADER, b"\x11\x11", SUB[2]], "bad_command"),
    ([P.CLIENT_HEADER, b"\x00", SUB[2]], "unknown_command"),
    ([P.CLIENT_HEADER, b"\xff", SUB[2]], "unknown_command"),
    ([P.CLIENT_HEADER, b"\x13", SUB[2]], "unexpected_command"),  # a broker->client command from a client
    ([P.CLIENT_HEADER, b"\x11", SUB[2][:-3]], "bad_msgpack"),  # truncated
    ([P.CLIENT_HEADER, b"\x11", SUB[2] + b"\x00"], "bad_msgpack"),  # trailing bytes
    ([P.CLIENT_HEADER, b"\x11", b"\xc1"], "bad_msgpack"),  # reserved byte
    ([P.CLIENT_HEADER, b"\x11", b"\xdd\xff\xff\xff\xff\x01"], "bad_msgpack"),  # array32 bomb
    ([P.CLIENT_HEADER, b"\x11", b"\xa2\xff\xfe"], "bad_msgpack"),  # invalid utf-8
    ([P.CLIENT_HEADER, b"\x11", b"\x91" * 10000 + b"\xc0"], "bad_msgpack"),  # deep nesting
    ([P.CLIENT_HEADER, b"\x11", P.pack([1, 2])], "bad_body"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({1: 2})], "bad_msgpack"),  # non-string map key
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": 5, "input_ids": [1]})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "", "input_ids": [1]})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "x" * 300, "input_ids": [1]})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a"})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a", "input_ids": [1], "text": "x"})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a", "input_ids": [-1]})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a", "input_ids": [2**32]})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a", "input_ids": [1.5]})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a", "input_ids": []})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a", "input_ids": [1], "deadline_ms": "soon"})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a", "input_ids": [1], "deadline_ms": -5})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a", "input_ids": [1], "deadline_ms": True})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a", "input_ids": [1], "stream": 1})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a", "input_ids": [1], "params": {"max_new_tokens": "x"}})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a", "input_ids": [1], "slo": {"tps": float("nan")}})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", P.pack({"rid": "a", "input_ids": [1], "slo": {"ttft_ms": 0}})], "bad_field"),
    ([P.CLIENT_HEADER, b"\x11", msgpack.packb({"rid": "a", "input_ids": [1], "x": msgpack.ExtType(5, b"z")})], "ok"),
])
def test_client_decode_rejects(frames, reason):
    m = P.decode_client(frames)
    if reason == "ok":  # unknown extra fields (even ext types) are ignored, not fatal
        assert isinstance(m, P.Submit)
        return
    assert isinstance(m, ProtocolError), m
    assert m.reason == reason, (m.reason, m.detail)


@pytest.mark.parametrize("frames,reason", [
    ([P.WORKER_HEADER, b"\x05", P.pack({"rid": 1, "attempt": 1, "seq": 0})], "bad_frame_count"),  # CHUNK without data
    ([P.WORKER_HEADER, b"\x01", P.pack({"worker_id": "w"})], "bad_field"),
    ([P.WORKER_HEADER, b"\x01", P.pack({"worker_id": "w", "role": "gpu", "block_size": 16, "max_running_requests": 1,
                                        "max_total_num_tokens": 1, "epoch": 0})], "bad_field"),
    ([P.WORKER_HEADER, b"\x02", P.pack({"load": [["LoadStat", 1]]})], "bad_loadstat"),
    ([P.WORKER_HEADER, b"\x02", P.pack({"load": [["LoadStat", 1, 2, 3, 4, -1]]})], "bad_loadstat"),
    ([P.WORKER_HEADER, b"\x03", P.pack({"dp_rank": 0, "epoch": 0, "seq": 0, "events": "no"})], "bad_field"),
    ([P.WORKER_HEADER, b"\x04", P.pack({})], "unexpected_command"),  # REQUEST from a worker
    ([P.WORKER_HEADER, b"\x11", SUB[2]], "unexpected_command"),  # client command on the worker path
    ([P.CLIENT_HEADER, b"\x02", P.pack({})], "wrong_path"),
])
def test_worker_decode_rejects(frames, reason):
    m = P.decode_worker(frames)
    assert isinstance(m, ProtocolError), m
    assert m.reason == reason, (m.reason, m.detail)


def test_loadstat_wire_forms():
    full = ["LoadStat", 3, 1, 1200, 500000, 0, 0, 0, 0, 0, 0]
    ls = LoadStat.from_wire(full)
    assert ls.extended and ls.num_tokens == 1200 and ls.to_wire() == full
    short = LoadStat.from_wire(["LoadStat", 3, 1, 1200, 500000, 0])
    assert not short.extended and not short.capacity_valid
    assert LoadStat.from_wire(full + [99]).extended  # extra trailing positions tolerated


@given(st.binary(max_size=200), st.binary(max_size=3))
@settings(max_examples=300, deadline=None)
def test_decoders_never_raise(body, cmd):
    # every decoder answers with a message of the wire contract or a ProtocolError with a
    # stable snake_case reason (the frame_rejected label): never None, a raw dict or an exception
    for frames in ([P.CLIENT_HEADER, cmd, body], [P.WORKER_HEADER, cmd, body], [P.WORKER_HEADER, cmd, body, body]):
        for dec in (P.decode_client, P.decode_worker, P.decode_broker_to_worker, P.decode_client_reply):
            r = dec(frames)
            assert type(r).__module__ in (P.__name__, "mesh.errors", "mesh.load"), (dec.__name__, frames, r)
            if isinstance(r, P.ProtocolError):
                assert isinstance(r.reason, str) and r.reason.replace("_", "").isalnum(), (dec.__name__, frames, r)
        # a header of the other direction is refused, not decoded
        if frames[0] == P.WORKER_HEADER:
            assert isinstance(P.decode_client(frames), P.ProtocolError)
