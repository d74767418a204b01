"""``mesh gateway`` moves a request to another broker when its broker dies (issue 31 item 4).

In process: :class:`brokers.gateway.BrokerPool` in front of two fake brokers (ROUTER sockets this
test drives). A request that produced nothing is resubmitted as it was; one that streamed output
continues from the prompt plus the tokens so far, its client seq going on, one terminal; the rules
are ``mesh.client``'s (idempotent only, bounded, ``unavailable`` or ``worker_lost`` before output).
Plus :class:`brokers.relay.Relay` on its own, with hostile replies.
"""

from __future__ import annotations

import asyncio

import pytest

from brokers.relay import MAX_RESUBMITS, Relay
from mesh import protocol as P
from tests.conftest import run
from tests.gateway_support import next_reply as _next, pool_of as _pool, submit as _submit


def test_a_started_stream_continues_and_an_unstarted_request_is_resubmitted_when_their_broker_dies():
    async def body():
        pool, (b0, b1) = await _pool()
        try:
            q1 = _submit(pool, b"h1", "r1", deadline_ms=20_000)  # round robin: r1 on b0, r2 on b1, r3 on b0
            q2 = _submit(pool, b"h2", "r2")
            q3 = _submit(pool, b"h3", "r3", stream=False)
            s1, s3 = await b0.submit(), await b0.submit()
            assert (s1.rid, s3.rid) == ("r1", "r3")
            await b1.submit()
            await b0.send(P.encode_client_chunk("r1", 0, P.pack({"token_ids": [7], "text": " seven"})))
            assert (await _next(q1)).seq == 0
            b0.die()
            moved = {(await b1.submit()).rid: None for _ in range(2)}
            assert set(moved) == {"r1", "r3"}
            # r1 continues: prompt + the token streamed, max_new_tokens reduced; r3 is the same request
            cont = pool._relays["r1"].sub
            assert cont.input_ids == [1, 2, 3, 7] and cont.max_new_tokens == 3 and 0 < cont.deadline_ms <= 20_000
            assert pool._relays["r3"].sub.input_ids == [1, 2, 3] and pool._relays["r3"].sub.max_new_tokens == 4
            await b1.send(P.encode_client_chunk("r1", 0, P.pack({"token_ids": [8]})))
            await b1.send(P.encode_client_final("r1", "length", {"prompt_tokens": 4, "completion_tokens": 3,
                                                                 "cached_tokens": 0}, "w", 1, P.pack({})))
            c, f = await _next(q1), await _next(q1)
            assert (c.seq, c.data["token_ids"]) == (1, [8])  # the client's stream goes on
            assert isinstance(f, P.ClientFinal) and f.usage["completion_tokens"] == 4 and f.usage["prompt_tokens"] == 3
            assert q2.empty() and q3.empty()  # nothing reached the other clients: nothing was lost
            assert pool.stats.migrations == {"gateway_continued": 1, "gateway_resubmitted": 1}
        finally:
            await pool.close()

    run(body(), 30)


@pytest.mark.parametrize("code, chunks, moves", [
    ("unavailable", 0, True), ("unavailable", 1, True), ("worker_lost", 0, True), ("worker_lost", 1, False),
    ("overloaded", 0, False), ("bad_request", 0, False),
])
def test_an_error_moves_a_request_by_mesh_clients_rules(code, chunks, moves):
    async def body():
        pool, (b0, b1) = await _pool()
        try:
            q = _submit(pool, b"h1", "r1")
            await b0.submit()
            for i in range(chunks):
                await b0.send(P.encode_client_chunk("r1", i, P.pack({"token_ids": [7]})))
                await _next(q)
            await b0.send(P.encode_client_error("r1", code, "nope"))
            if moves:
                assert (await b1.submit()).rid == "r1"
                assert q.empty()
            else:
                m = await _next(q)
                assert isinstance(m, P.ClientError) and m.code == code
        finally:
            await pool.close()

    run(body(), 30)


def test_a_request_that_cannot_move_ends_unavailable_and_is_counted():
    async def body():
        pool, (b0, b1) = await _pool()
        try:
            qs = [_submit(pool, b"h1", "r1", idempotent=False), _submit(pool, b"h2", "r2"),
                  _submit(pool, b"h3", "r3", params={"json_schema": "{}"})]
            for _ in range(2):
                await b0.submit()
            await b1.submit()
            await b0.send(P.encode_client_chunk("r3", 0, P.pack({"token_ids": [7]})))
            await _next(qs[2])
            b0.die()
            for q in (qs[0], qs[2]):
                m = await _next(q)
                assert isinstance(m, P.ClientError) and m.code == "unavailable"
            assert pool.stats.migration_refused == {"not_idempotent": 1, "constrained": 1}
            b1.die()  # and with no broker left: unavailable, counted
            m = await _next(qs[1])
            assert isinstance(m, P.ClientError) and m.code == "unavailable"
            assert pool.stats.migration_refused["no_other_broker"] == 1
        finally:
            await pool.close()

    run(body(), 30)


def _relay(**kw) -> Relay:
    body = P.submit_body("r", input_ids=[1, 2], params={"max_new_tokens": 8, **kw.pop("params", {})}, **kw)
    return Relay.of(b"i", P.submit_of_body(body, P.pack(body)), None, 100.0, 30_000)


def test_relay_resubmissions_are_bounded_and_hostile_chunks_never_raise():
    r = _relay()
    for _ in range(MAX_RESUBMITS):
        assert not isinstance(r.resubmission(100.0), str)
    assert r.resubmission(100.0) == "limit"
    assert _relay(deadline_ms=1000).resubmission(102.0) == "deadline"
    for payload, why in [(P.pack([1, 2]), "bad_chunk"), (b"\xc1", "bad_chunk"), (P.pack({"token_ids": "x"}), "no_token_ids"),
                         (P.pack({"token_ids": [2**40]}), "bad_chunk"), (P.pack({"token_ids": [1] * 9}), "exhausted"),
                         (P.pack({"text": "only text"}), "no_token_ids")]:
        r = _relay()
        frames = P.encode_client_chunk("r", 0, payload)
        r.relayed(P.ClientChunk("r", 0, {}), frames)
        assert r.resubmission(100.0) == why, payload
    flood = _relay()
    for i in range(1000):  # a flood of chunks: each relayed once, renumbered after a move
        flood.relayed(P.ClientChunk("r", i, {}), P.encode_client_chunk("r", i, P.pack({"token_ids": []})))
    assert flood.sent == 1000 and flood.chunks is None  # (not kept past max_new_tokens)
    assert flood.resubmission(100.0) == "too_many_chunks"
    r = _relay()
    for i in range(3):
        r.relayed(P.ClientChunk("r", i, {}), P.encode_client_chunk("r", i, P.pack({"token_ids": [i]})))
    assert not isinstance(r.resubmission(100.0), str) and r.sub.input_ids == [1, 2, 0, 1, 2]
    out = r.relayed(P.ClientChunk("r", 0, {}), P.encode_client_chunk("r", 0, P.pack({"token_ids": [5]})))
    assert P.decode_client_reply(out).seq == 3  # renumbered after the chunks already relayed


def test_a_stream_whose_client_stopped_reading_is_cancelled_not_buffered_without_bound():
    from brokers import gateway

    async def body():
        pool, (b0,) = await _pool(1)
        try:
            q = _submit(pool, b"h1", "r1")
            qk = _submit(pool, b"h2", "r2")  # another client of the same broker connection, reading
            await b0.submit(), await b0.submit()
            for seq in range(gateway._REPLY_QUEUE_MAX + 10):  # nobody reads r1's queue
                await b0.send(P.encode_client_chunk("r1", seq, P.pack({"token_ids": [seq]})))
            await b0.send(P.encode_client_chunk("r2", 0, P.pack({"token_ids": [1]})))
            assert (await _next(qk)).seq == 0  # the connection and the other client go on

            async def cancel_seen():
                ident, *frames = await asyncio.wait_for(b0.sock.recv_multipart(), 10)
                return P.decode_client(frames)

            m = await cancel_seen()
            while isinstance(m, P.StatusQuery):
                m = await cancel_seen()
            assert isinstance(m, P.Cancel) and m.rid == "r1"
            assert q.qsize() == gateway._REPLY_QUEUE_MAX + 1  # what was queued, then the one error
            last = [q.get_nowait() for _ in range(q.qsize())][-1]
            err = P.decode_client_reply(last)
            assert isinstance(err, P.ClientError) and err.code == "cancelled"
            assert pool.stats.dropped["gateway_client_slow"] == 1
        finally:
            await pool.close()

    run(body(), 30)
