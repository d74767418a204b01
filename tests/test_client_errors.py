"""mesh.client's error boundary: what a caller can see is the documented tree (mesh.errors)."""

from __future__ import annotations

import pytest
import zmq

from mesh.client import Client
from mesh.errors import ClientStateError, ErrorCode, MeshError, RetryableError
from mesh.lab.up import wait_for_workers
from tests.conftest import run, until


def test_a_send_failure_is_unavailable_not_a_zmq_error(procs, monkeypatch):
    b = procs.broker("b")

    async def body():
        async with Client(b.frontend) as c:
            async def broken(frames, *a, **k):  # the fault seam: the DEALER refuses the send
                raise zmq.ZMQError(zmq.ETERM, "Context was terminated")
            for link in c.links:
                monkeypatch.setattr(link.sock, "send_multipart", broken)
            with pytest.raises(RetryableError) as ei:
                await c.submit(input_ids=[1, 2, 3], max_new_tokens=1, deadline_ms=5_000)
            assert ei.value.code is ErrorCode.UNAVAILABLE and "Context was terminated" in ei.value.message
            assert not c.open_streams  # nothing left behind for the failed request

    run(body(), timeout_s=30)


def test_a_closed_client_raises_client_state_error():
    async def body():
        c = Client("tcp://127.0.0.1:1")
        with pytest.raises(ClientStateError) as ei:
            await c.submit(input_ids=[1], max_new_tokens=1)
        assert isinstance(ei.value, MeshError) and isinstance(ei.value, RuntimeError)

    run(body(), timeout_s=10)


@pytest.mark.parametrize("idempotent", [True, False])
def test_generate_resubmits_a_failed_send_to_the_other_broker(procs, monkeypatch, idempotent):
    """A send that fails (unavailable from submit() itself: nothing reached that broker) is
    resubmitted by generate() like any other unavailable, to the other broker; never when the
    request is not idempotent."""
    brokers = [procs.broker(name) for name in ("ba", "bb")]
    for b, w in zip(brokers, ("wa", "wb")):
        procs.workers(w, [b.backend])
    for b in brokers:
        run(wait_for_workers(b.frontend, 1))

    async def body():
        async with Client([b.frontend for b in brokers]) as c:
            await until(lambda: all(link.up for link in c.links), 10, "both links up")
            failed = []
            for link in c.links:
                real = link.sock.send_multipart

                async def once(frames, *a, _link=link, _real=real, **k):  # the fault seam: the first send fails
                    if not failed:
                        failed.append(_link)
                        raise zmq.ZMQError(zmq.EHOSTUNREACH, "Host unreachable")
                    return await _real(frames, *a, **k)
                monkeypatch.setattr(link.sock, "send_multipart", once)
            if not idempotent:
                with pytest.raises(RetryableError) as ei:
                    await c.generate(input_ids=[1, 2, 3], max_new_tokens=2, deadline_ms=10_000, idempotent=False)
                assert ei.value.code is ErrorCode.UNAVAILABLE and len(failed) == 1
                return None, failed[0]
            res = await c.generate(input_ids=[1, 2, 3], max_new_tokens=2, deadline_ms=10_000)
            return res, failed[0]

    res, failed = run(body(), timeout_s=60)
    if idempotent:
        other = "wb" if failed.endpoint == brokers[0].frontend else "wa"
        assert res.token_ids and res.worker == other, (res, failed.endpoint)
