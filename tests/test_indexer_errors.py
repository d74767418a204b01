"""The indexer client's one error boundary (``mesh.indexer.client.indexer_error``): what each RPC
failure becomes in the mesh error tree, against a real in-process gRPC indexer on 127.0.0.1.

A stopped indexer is a RetryableError (unavailable), a wrong token an AuthError, an oversize
message a FatalRequestError (too_large), a shed query RetryableError (overloaded); every message
names the endpoint, and no grpc error leaves the client's public API.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from mesh import kv_events as KV
from mesh.errors import AuthError, ClientStateError, ErrorCode, FatalRequestError, MeshError, RetryableError
from mesh.indexer.client import IndexerClient, indexer_error
from mesh.indexer.server import Limits, serve
from mesh.protocol import pack
from mesh.retry import RetryPolicy

from conftest import run, until

BS = 16
TOKEN = "s3cret-token"


@contextlib.asynccontextmanager
async def indexer(**kw):
    """``mesh.indexer.server.serve`` on a free 127.0.0.1 port in this loop; yields (endpoint, stop)."""
    ready: asyncio.Future = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve("127.0.0.1:0", stop=stop, ready=ready.set_result, **kw))
    done, _ = await asyncio.wait({task, ready}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # startup failed: raise why
    assert ready in done, "indexer did not start"

    async def stopped() -> None:
        stop.set()
        await asyncio.wait_for(task, 10)

    try:
        yield ready.result(), stopped
    finally:
        if not task.done():
            await stopped()


def _raw(n_blocks: int, tokens_per_block: int = BS) -> bytes:
    ev = KV.BlockStored(tuple(range(1, n_blocks + 1)), None, tuple(range(1, n_blocks * tokens_per_block + 1)), BS)
    return pack([KV.encode_event_map(ev)])


def test_a_stopped_indexer_is_retryable_unavailable_and_named() -> None:
    async def body() -> None:
        async with indexer() as (ep, stopped):
            async with IndexerClient([ep], query_timeout_ms=2000, breaker_failures=100,
                                     forward_retry=RetryPolicy(max_attempts=2, base_ms=1, cap_ms=5)) as c:
                assert (await c.fetch_stats()).workers == 0  # reachable first
                await stopped()
                with pytest.raises(RetryableError) as ei:
                    await c.fetch_stats()
                assert ei.value.code is ErrorCode.UNAVAILABLE and ep in str(ei.value) and "Stats" in str(ei.value)
                assert isinstance(ei.value.__cause__, grpc.RpcError)
                assert await c.server_stats() is None  # the lenient variant
                assert await c.match([1, 2, 3], BS) is None and c.last_degraded_reason == "unavailable"
                assert isinstance(c.last_error, RetryableError) and ep in str(c.last_error)
                # forwarding: a bounded RetryPolicy cycle, then the batch waits at the head of the queue
                c.forward("w", 0, 1, 0, _raw(2))
                await until(lambda: c.stats()["forward_give_ups"] >= 1, 10, "a forward give-up")
                assert c.stats()["forward_retried"] >= 1 and c.pending() == 1
                assert isinstance(c.last_error, RetryableError) and "ApplyKvBatches" in str(c.last_error)

    run(body(), 30)


def test_a_wrong_token_is_an_auth_error_never_retried() -> None:
    async def body() -> None:
        async with indexer(token=TOKEN) as (ep, _):
            async with IndexerClient([ep], query_timeout_ms=2000, token="wrong-token") as c:
                with pytest.raises(AuthError) as ei:
                    await c.fetch_stats()
                err = ei.value
                assert isinstance(err, FatalRequestError) and not isinstance(err, RetryableError)
                assert err.code is ErrorCode.UNAUTHORIZED and ep in str(err) and "UNAUTHENTICATED" in str(err)
                assert await c.match([1, 2, 3], BS) is None and c.last_degraded_reason == "unauthenticated"
                assert isinstance(c.last_error, AuthError)
                c.forward("w", 0, 1, 0, _raw(2))
                assert await c.flush(10)  # refused, not queued for ever
                st = c.stats()
                assert st["forward_rejected"] == 1 and st["forward_retried"] == 0 and st["auth_failures"] >= 3
            async with IndexerClient([ep], query_timeout_ms=2000, token=TOKEN) as ok:
                assert (await ok.fetch_stats()).workers == 0 and ok.last_error is None

    run(body(), 30)


def test_an_oversize_message_is_too_large_and_not_retried() -> None:
    async def body() -> None:
        async with indexer(limits=Limits(max_message_bytes=64 << 10)) as (ep, _):
            # The client allows 8 MiB (its default), the indexer 64 KiB: the indexer refuses.
            async with IndexerClient([ep], query_timeout_ms=2000) as c:
                c.forward("big-w", 0, 1, 0, _raw(1, tokens_per_block=40_000))  # ~120 KB of events
                assert await c.flush(10)
                err = c.last_error
                assert isinstance(err, FatalRequestError) and err.code is ErrorCode.TOO_LARGE, err
                assert ep in str(err) and "ApplyKvBatches" in str(err)
                st = c.stats()
                assert st["forward_rejected"] == 1 and st["forward_retried"] == 0
                assert await c.match(list(range(1, 20_000)), BS) is None and c.last_degraded_reason == "too_large"
                assert c.last_error.code is ErrorCode.TOO_LARGE and "MatchPrefix" in str(c.last_error)

    run(body(), 30)


def test_a_shed_query_is_retryable_overloaded_and_a_slow_one_unavailable() -> None:
    async def body() -> None:
        async with indexer(max_inflight_queries=1, query_delay_ms=300) as (ep, _):
            async with IndexerClient([ep], query_timeout_ms=2000) as c:
                assert (await c.fetch_stats()).workers == 0  # connected before the race
                # One query holds the indexer's only slot for 300 ms; the others sent with it are shed.
                views = await asyncio.gather(*(c.match([1, 2, i], BS) for i in range(4)))
                assert sum(v is not None for v in views) >= 1 and c.degraded["resource_exhausted"] >= 1
                shed = c.last_error
                assert isinstance(shed, RetryableError) and shed.code is ErrorCode.OVERLOADED and ep in str(shed)
            async with IndexerClient([ep], query_timeout_ms=50) as slow:
                assert await slow.match([1, 2], BS) is None and slow.last_degraded_reason == "timeout"
                err = slow.last_error
                assert isinstance(err, RetryableError) and err.code is ErrorCode.UNAVAILABLE
                assert "DEADLINE_EXCEEDED" in str(err) and ep in str(err)

    run(body(), 30)


def test_a_closed_client_is_a_state_error() -> None:
    async def body() -> None:
        c = IndexerClient(["http://127.0.0.1:1"])
        await c.start()
        with pytest.raises(ClientStateError):
            await c.start()
        await c.aclose()
        with pytest.raises(ClientStateError):
            await c.fetch_stats()
        assert isinstance(ClientStateError("x"), RuntimeError)

    run(body(), 10)


class _Rpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


S = grpc.StatusCode


@pytest.mark.parametrize("exc, rpc, cls, code", [
    (_Rpc(S.UNAVAILABLE), "MatchPrefix", RetryableError, ErrorCode.UNAVAILABLE),
    (_Rpc(S.DEADLINE_EXCEEDED), "ApplyKvBatches", RetryableError, ErrorCode.UNAVAILABLE),
    (_Rpc(S.CANCELLED), "ApplyKvBatches", RetryableError, ErrorCode.UNAVAILABLE),
    (_Rpc(S.ABORTED), "RegisterWorker", RetryableError, ErrorCode.UNAVAILABLE),
    (_Rpc(S.UNAUTHENTICATED, "missing or wrong bearer token"), "Stats", AuthError, ErrorCode.UNAUTHORIZED),
    (_Rpc(S.PERMISSION_DENIED, "another owner"), "ForgetWorker", AuthError, ErrorCode.UNAUTHORIZED),
    (_Rpc(S.INVALID_ARGUMENT), "RegisterWorker", FatalRequestError, ErrorCode.BAD_REQUEST),
    (_Rpc(S.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 8)"), "ApplyKvBatches",
     FatalRequestError, ErrorCode.TOO_LARGE),
    (_Rpc(S.RESOURCE_EXHAUSTED, "Sent message larger than max (9 vs. 8)"), "MatchPrefix",
     FatalRequestError, ErrorCode.TOO_LARGE),
    (_Rpc(S.RESOURCE_EXHAUSTED, "more than 32 prefix queries in flight"), "MatchPrefix",
     RetryableError, ErrorCode.OVERLOADED),
    (_Rpc(S.RESOURCE_EXHAUSTED, "more than 10 workers"), "RegisterWorker", FatalRequestError, ErrorCode.RATE_LIMITED),
    (_Rpc(S.INTERNAL), "Stats", FatalRequestError, ErrorCode.INTERNAL),
    (_Rpc(S.UNIMPLEMENTED), "Stats", FatalRequestError, ErrorCode.INTERNAL),
    (asyncio.TimeoutError(), "MatchPrefix", RetryableError, ErrorCode.UNAVAILABLE),
    (ConnectionRefusedError(111, "refused"), "MatchPrefix", RetryableError, ErrorCode.UNAVAILABLE),
    (ValueError("Value out of range"), "MatchPrefix", FatalRequestError, ErrorCode.BAD_REQUEST),
    (RuntimeError("bug"), "MatchPrefix", FatalRequestError, ErrorCode.INTERNAL),
])
def test_the_boundary_maps_every_failure_into_the_tree(exc, rpc, cls, code) -> None:
    err = indexer_error(exc, "http://10.0.0.9:50051", rpc)
    assert type(err) is cls and err.code is code
    assert "http://10.0.0.9:50051" in str(err) and rpc in str(err) and err.__cause__ is exc
    assert indexer_error(err, "elsewhere", "Stats") is err  # already mapped: unchanged
    assert isinstance(err, MeshError) and err.code.retryable == isinstance(err, RetryableError)
