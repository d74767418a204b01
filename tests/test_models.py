"""Models: ``model`` travels in SUBMIT and routing is per model (real broker and worker processes).

A fleet of two models behind one broker: each request lands only on workers that serve the model
it names (or an alias of it); an unknown name is 404 ``model_not_found``; no name with several
models is a 400; STATUS lists the models that have routable workers. A single-model fleet takes
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
            for name, kwargs in {"unknown": {"model": "no-such-model"}, "none": {}, "mesh": {"model": "mesh"},
                                 "dangling_alias": {"model": "ghost"}}.items():
                with pytest.raises(RequestError) as ei:
                    await c.generate(input_ids=[1] * 16, max_new_tokens=1, deadline_ms=10_000, **kwargs)
                errors[name] = ei.value
            st = await c.status()
        return landed, errors, st

    landed, errors, st = run(body(), timeout_s=60)
    for model, worker in landed:
        assert worker.startswith("b-" if model == "model-b" else "a-"), (model, worker)
    assert errors["unknown"].code is ErrorCode.MODEL_NOT_FOUND and errors["unknown"].code.http_status == 404
    assert "model-a" in errors["unknown"].message and "model-b" in errors["unknown"].message
    assert errors["dangling_alias"].code is ErrorCode.MODEL_NOT_FOUND
    for name in ("none", "mesh"):  # ambiguous in a two-model fleet
        assert errors[name].code is ErrorCode.BAD_REQUEST and "model is required" in errors[name].message
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
    assert err.code in (ErrorCode.NO_WORKER, ErrorCode.DEADLINE_EXCEEDED)
