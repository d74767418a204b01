"""mesh.client's error boundary: what a caller can see is the documented tree (mesh.errors)."""

from __future__ import annotations

import pytest
import zmq

from mesh.client import Client
from mesh.errors import ClientStateError, ErrorCode, MeshError, RetryableError
from tests.conftest import run


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
