"""Models: ``model`` travels in SUBMIT and routing is per model (real broker and worker processes).

A fleet of two models behind one broker: each request lands only on workers that serve the model
it names (or an alias of it); an unknown name is 404 ``model_not_found``; no name with several
models goes to the default model (issue 32: the model most long-registered workers serve, ties
by name; it was a 400, which one foreign READY turned on fleet-wide); STATUS lists the models that have routable workers. A single-model fleet takes
requests without a name or under ``--model-name``, as before.
"""

from __future__ import annotations

import asyncio

import pytest

from mesh.client import Client
from mesh.errors import ErrorCode, RequestError
from mesh.lab.up import wait_for_workers
from tests.conftest import run, until

FAST = ["--heartbeat-ms", "200"]


def test_requests_go_only_to_workers_of_their_model(procs):
    b = procs.broker("b", *FAST, "--model-alias", "fast=model-a", "--model-alias", "ghost=model-z")
    with procs.together():
        procs.workers("a", [b.backend], "--model", "model-a", count=2)
        procs.workers("b", [b.backend], "--model", "model-b", count=2)
    run(wait_for_workers(b.frontend, 4))

    async def body():
        async with Client(b.frontend) as c:
            async def go(model, i):
                r = await c.generate(input_ids=[i % 7 + 1] * 48, max_new_tokens=2, model=model, deadline_ms=20_000)
                return model, r.worker

            landed = await asyncio.gather(*(go(m, i) for i, m in enumerate(["model-a", "model-b", "fast"] * 8)))
            errors = {}
            unnamed = [(await c.generate(input_ids=[1] * 16, max_new_tokens=1, deadline_ms=10_000, **kw)).worker
                       for kw in ({}, {"model": "mesh"})]
            for name, kwargs in {"unknown": {"model": "no-such-model"}, "dangling_alias": {"model": "ghost"}}.items():
                with pytest.raises(RequestError) as ei:
                    await c.generate(input_ids=[1] * 16, max_new_tokens=1, deadline_ms=10_000, **kwargs)
                errors[name] = ei.value
            st = await c.status()
        return landed, errors, st, unnamed

    landed, errors, st, unnamed = run(body(), timeout_s=60)
    for model, worker in landed:
        assert worker.startswith("b-" if model == "model-b" else "a-"), (model, worker)
    assert errors["unknown"].code is ErrorCode.MODEL_NOT_FOUND and errors["unknown"].code.http_status == 404
    assert "model-a" in errors["unknown"].message and "model-b" in errors["unknown"].message
    assert errors["dangling_alias"].code is ErrorCode.MODEL_NOT_FOUND
    # two models, two workers each: a tie, broken by name (issue 32: it was a 400 "model is required")
    assert all(w.startswith("a-") for w in unnamed), unnamed
    assert st.broker["models"] == {"model-a": 2, "model-b": 2}
    assert st.broker["aliases"] == {"fast": "model-a", "ghost": "model-z"}
    assert {w["worker_id"]: w["model"] for w in st.workers}["b-0"] == "model-b"


def test_single_model_fleet_takes_no_name_and_the_fleet_name(procs):
    b = procs.broker("b", *FAST, "--model-name", "my-fleet")
    procs.workers("w", [b.backend], "--model", "llama", count=1)
    run(wait_for_workers(b.frontend, 1))

    async def body():
        async with Client(b.frontend) as c:
            ok = [await c.generate(input_ids=[3] * 16, max_new_tokens=1, deadline_ms=10_000, **kw)
                  for kw in ({}, {"model": "my-fleet"}, {"model": "llama"})]
            with pytest.raises(RequestError) as ei:
                await c.generate(input_ids=[3] * 16, max_new_tokens=1, deadline_ms=10_000, model="mesh")
        return ok, ei.value

    ok, err = run(body(), timeout_s=60)
    assert len(ok) == 3 and len({r.worker for r in ok}) == 1
    assert err.code is ErrorCode.MODEL_NOT_FOUND


def test_a_silent_peer_claiming_another_model_does_not_make_unnamed_requests_ambiguous(procs):
    import zmq
    import zmq.asyncio

    from mesh import protocol as P

    b = procs.broker("b", *FAST)
    procs.workers("w", [b.backend], "--model", "llama", count=1)
    run(wait_for_workers(b.frontend, 1))

    async def body():
        ctx = zmq.asyncio.Context()
        peer = ctx.socket(zmq.DEALER)
        peer.connect(b.backend)
        try:  # registers, then stays silent: never confirmed, never routable
            await peer.send_multipart(P.encode_ready(P.Ready("squatter", "other-model", "mixed", {}, 16, 8, 1000, 1, 1, 200)))
            async with Client(b.frontend) as c:
                async def registered() -> bool:
                    return (await c.status()).broker["workers_total"] == 2
                await until(registered, 10, "the squatter registers")
                r = await c.generate(input_ids=[3] * 16, max_new_tokens=1, deadline_ms=10_000)
                with pytest.raises(RequestError) as ei:  # its model is known, but nothing serves it
                    await c.generate(input_ids=[3] * 16, max_new_tokens=1, deadline_ms=1_500, model="other-model")
            return r, ei.value
        finally:
            peer.close(linger=0)
            ctx.term()

    r, err = run(body(), timeout_s=60)
    assert r.worker.startswith("w")
    # (issue 32: registered after the fleet's rollout window, the squatter is also quarantined: 404)
    assert err.code in (ErrorCode.NO_WORKER, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.MODEL_NOT_FOUND)


def test_a_foreign_ready_does_not_change_what_a_request_without_a_model_means(procs):
    """Issue 32: a real broker and worker serving ``model-a``; a hostile DEALER registers as a
    ``model-b`` worker (and keeps heartbeating). Requests without a model and with ``mesh`` still
    run on ``model-a`` over ZeroMQ and HTTP (they were all 400 "model is required")."""
    import aiohttp
    import zmq
    import zmq.asyncio

    from mesh import protocol as P
    from mesh.lab.procs import wait_for_log_event

    b = procs.broker("b", *FAST, "--http", "127.0.0.1:0", "--model-settle-s", "0.3")
    procs.workers("w", [b.backend], "--model", "model-a", count=1)
    url = wait_for_log_event(b.log_path, "http_listening", 30, b.popen, start=b.log_start)["url"]
    run(wait_for_workers(b.frontend, 1))

    async def body():
        await asyncio.sleep(0.5)  # past the rollout window: a new model now is a foreign one
        ctx = zmq.asyncio.Context()
        peer = ctx.socket(zmq.DEALER)
        peer.connect(b.backend)

        async def beat():
            while True:
                await peer.send_multipart(P.encode_heartbeat())
                await asyncio.sleep(0.05)

        await peer.send_multipart(P.encode_ready(P.Ready("intruder", "model-b", "mixed", {}, 16, 8, 1000, 1, 1, 200)))
        beating = asyncio.ensure_future(beat())
        try:
            async with Client(b.frontend) as c:
                async def registered():
                    return (await c.status()).broker["quarantined"] == {"model-b": 1}
                await until(registered, 10, "the intruder registers (quarantined)")
                zmq_workers = [(await c.generate(input_ids=[3] * 16, max_new_tokens=1, deadline_ms=10_000, **kw)).worker
                               for kw in ({}, {"model": "mesh"}, {}, {"model": "mesh"})]
                st = await c.status()
            http = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
                for extra in ({}, {"model": "mesh"}):
                    async with s.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1, **extra}) as r:
                        http.append((r.status, r.headers.get("x-mesh-worker", "")))
                async with s.get(url + "/v1/models") as r:
                    listed = [m["id"] for m in (await r.json())["data"]]
                async with s.post(url + "/workers/intruder/admit") as r:  # an operator admits it (loopback)
                    admitted = (r.status, (await r.json()).get("state"))
                async with s.get(url + "/v1/models") as r:
                    listed_after = [m["id"] for m in (await r.json())["data"]]
            return zmq_workers, http, listed, st, admitted, listed_after
        finally:
            beating.cancel()
            peer.close(linger=0)
            ctx.term()

    zmq_workers, http, listed, st, admitted, listed_after = run(body(), timeout_s=60)
    assert all(w.startswith("w") for w in zmq_workers), zmq_workers
    assert [s for s, _ in http] == [200, 200] and all(w.startswith("w") for _, w in http), http
    assert "model-b" not in listed and "model-a" in listed
    row = {w["worker_id"]: w for w in st.workers}["intruder"]
    assert row["state"] == "quarantined" and not row["healthy"]
    assert st.counters["workers.quarantined"] == 1
    assert admitted == (200, "routable") and "model-b" in listed_after
