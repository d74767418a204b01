"""OpenTelemetry spans of the HTTP front door (issue 17 part 4), with the SDK's in-memory exporter:
a real broker and simulated workers in this process's event loop, real HTTP."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from brokers.ingress import HttpIngress
from brokers.main import build_broker
from mesh import tracing
from mesh.config import BrokerSettings, build
from mesh.errors import ConfigError
from mesh.lab.up import wait_for_workers

from conftest import run

sdk = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402


@pytest.fixture
def spans():
    exp = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    tracing.use_provider(provider)
    yield exp
    tracing.use_provider(None)


@contextlib.asynccontextmanager
async def _broker_with_http():
    """A round-robin broker and its HTTP ingress in this loop: (broker, base URL); stopped after.
    Its loop-lag shedding is off (a lag bound of 60 s): on a busy machine a worker process's
    start lagged the loop past the default 250 ms and the traced request got a 429, which is
    the shedding's behaviour (tested on its own), not the tracing's."""
    b = build_broker(build(BrokerSettings, {"frontend": "tcp://127.0.0.1:*", "backend": "tcp://127.0.0.1:*",
                                            "policy": "round_robin", "heartbeat_ms": 200,
                                            "overload_lag_ms": 60_000}))
    task = asyncio.create_task(b.run())
    await b.ready.wait()
    ing = HttpIngress(b)
    url = await ing.start("127.0.0.1", 0)
    try:
        yield b, url
    finally:
        await ing.stop()
        b.request_stop()
        await asyncio.wait_for(task, 15)


def test_http_requests_become_spans_under_the_callers_trace(procs, spans):
    async def body():
        async with _broker_with_http() as (b, url):
            # (in a thread: starting a process blocks, and a blocked loop is lag the broker sheds load for)
            await asyncio.to_thread(procs.workers, "w", [b.backend_endpoint], "--time-scale", "0.05", count=1)
            await wait_for_workers(b.frontend_endpoint, 1)
            trace_id = "0af7651916cd43dd8448eb211c80319c"
            h = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01", "x-request-id": "order-991"}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
                async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}, headers=h) as r:
                    assert r.status == 200
                    await r.read()
                async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": -1}) as r:
                    assert r.status == 400
                async with s.get(url + "/health") as r:
                    assert r.status == 200
        return trace_id

    trace_id = run(body(), 60)
    done = spans.get_finished_spans()
    assert len(done) == 2, [s.name for s in done]  # the two POSTs; probes are not traced
    ok, bad = done
    assert ok.name == "mesh /v1/completions" and ok.kind.name == "SERVER"
    assert format(ok.context.trace_id, "032x") == trace_id  # a child of the caller's trace
    a = ok.attributes
    assert a["mesh.request_id"] == "order-991" and a["mesh.worker"] == "w" and a["mesh.attempt"] == 1
    assert a["http.response.status_code"] == 200 and a["mesh.finish_reason"] == "length"
    assert a["mesh.completion_tokens"] == 3
    assert [e.name for e in ok.events] == ["first_token"]
    assert bad.attributes["http.response.status_code"] == 400 and format(bad.context.trace_id, "032x") != trace_id


def test_tracing_settings_name_the_field():
    tracing.configure_tracing("none")
    assert not tracing.enabled()
    with pytest.raises(ConfigError, match="trace_endpoint"):
        tracing.configure_tracing("otlp", "")
    with pytest.raises(ConfigError, match="trace_exporter"):
        build(BrokerSettings, {"trace_exporter": "zipkin"})


def test_the_trace_goes_on_through_the_adapter_to_the_engine(spans):
    """HTTP -> broker -> adapter -> engine: the adapter's CLIENT span is a child of the broker's
    SERVER span (the traceparent rides in the SUBMIT), and the engine receives the adapter span's
    traceparent header. Broker, adapter and SGLang stub run in this loop, over real sockets."""
    from mesh.adapters.base import Adapter
    from mesh.adapters.settings import AttachSettings
    from mesh.adapters.sglang import SglangBackend
    from workers_stub.sglang_server import SglangStub, StubSettings

    async def body():
        async with _broker_with_http() as (b, url):
            stub = SglangStub(StubSettings(port=0, time_scale=0.05))
            info = await stub.start()
            s = AttachSettings(url=info["url"], brokers=(b.backend_endpoint,), worker_id="sg-0", heartbeat_ms=200)
            s.validate()
            adapter = Adapter(s, SglangBackend(s))
            atask = asyncio.create_task(adapter.run())
            try:
                await wait_for_workers(b.frontend_endpoint, 1, timeout_s=20)
                trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
                h = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01", "x-request-id": "cart-17"}
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as sess:
                    async with sess.post(url + "/generate", json={"input_ids": list(range(1, 40)),
                                                                  "sampling_params": {"max_new_tokens": 3}}, headers=h) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                    async with sess.post(url + "/generate", json={"input_ids": list(range(1, 40)),
                                                                  "sampling_params": {"max_new_tokens": 2}}) as r:
                        assert r.status == 200  # no caller trace: the broker's span starts one of its own
                        await r.read()
                return trace_id, list(stub.traceparents)
            finally:
                adapter.request_stop(force=True)
                await asyncio.wait_for(atask, 15)
                await stub.stop()

    trace_id, seen = run(body(), 60)
    done = spans.get_finished_spans()
    servers = [x for x in done if x.kind.name == "SERVER"]
    clients = [x for x in done if x.kind.name == "CLIENT"]
    assert len(servers) == 2 and len(clients) == 2, [(x.name, x.kind.name) for x in done]
    srv = next(x for x in servers if format(x.context.trace_id, "032x") == trace_id)
    cli = next(x for x in clients if format(x.context.trace_id, "032x") == trace_id)
    assert cli.parent is not None and cli.parent.span_id == srv.context.span_id  # adapter span under the broker's
    assert cli.name == "mesh adapter sglang" and cli.attributes["mesh.request_id"] == "cart-17"
    assert cli.attributes["mesh.worker"] == "sg-0"
    # the engine got the adapter span's own traceparent, for each request
    assert f"00-{trace_id}-{format(cli.context.span_id, '016x')}-01" in seen
    assert len(seen) == 2 and all(t.startswith("00-") for t in seen)
    other = next(x for x in clients if x is not cli)
    assert other.parent is not None and format(other.context.trace_id, "032x") != trace_id


def test_a_malformed_traceparent_is_ignored_not_refused():
    from mesh import protocol as P

    for bad in ("00-zz", "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", 7, None):
        sub = P.decode_client(P.encode_submit("r1", input_ids=[1, 2], traceparent=bad))  # type: ignore[arg-type]
        assert isinstance(sub, P.Submit) and sub.traceparent is None, bad
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert P.decode_client(P.encode_submit("r1", input_ids=[1, 2], traceparent=good)).traceparent == good
