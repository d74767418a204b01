"""The HTTP ingress's seam (issue 29): both backends implement ``IngressBackend``, and a SUBMIT the
ingress builds and checks without decoding it is the one the broker's decoder reads from its bytes."""

from __future__ import annotations

import pytest

from brokers.gateway import BrokerPool
from brokers.ingress.backend import IngressBackend
from brokers.main import build_broker
from mesh import protocol as P
from mesh.config import BrokerSettings, build

from conftest import run

_MEMBERS = sorted(n for n in vars(IngressBackend) if not n.startswith("_"))


def test_the_broker_and_the_gateway_pool_implement_the_seam():
    async def body():
        b = build_broker(build(BrokerSettings, {"frontend": "tcp://127.0.0.1:*", "backend": "tcp://127.0.0.1:*"}))
        pool = BrokerPool(["tcp://127.0.0.1:9"])
        assert {"submit", "cancel", "forget", "stats", "state", "admin", "model_catalog", "routable_workers"} <= set(_MEMBERS)
        for backend in (b, pool):
            missing = [n for n in _MEMBERS if not hasattr(backend, n)]
            assert not missing, (type(backend).__name__, missing)
            assert backend.routable_workers() == 0 and isinstance(backend.model_catalog(), tuple)
        assert b.admin is not None and pool.admin is None  # the gateway has no admin API
        b.close()
        b.terminate()

    run(body())


@pytest.mark.parametrize("fields", [
    {"text": "hello", "params": {"max_new_tokens": 3, "stop": ["x"]}, "stream": False, "deadline_ms": 1000},
    {"input_ids": [1, 2, 3], "slo": {"ttft_ms": 50, "tps": 2.5}, "model": "m", "params": {}},
    {"text": "t", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "params": {"logit_bias": {"5": 1.0}}},
    {"text": "t", "traceparent": "not-a-traceparent"},
])
def test_a_submit_checked_unencoded_equals_the_decoded_one(fields):
    body = P.submit_body("rid-1", **fields)
    raw = P.pack(body)
    built = P.submit_of_body(body, raw)
    decoded = P.decode_client(P.encode_submit("rid-1", **fields))
    assert isinstance(built, P.Submit) and built.raw == decoded.raw
    assert P.submit_frames(built) == P.encode_submit("rid-1", **fields)
    for f in ("rid", "input_ids", "text", "max_new_tokens", "params", "deadline_ms", "stream", "idempotent", "ttft_slo_ms",
              "tps_slo", "model", "traceparent"):
        assert getattr(built, f) == getattr(decoded, f), f
    assert (built.packed is None) == (decoded.packed is None) and list(built.packed or []) == list(decoded.packed or [])


@pytest.mark.parametrize("fields", [
    {"text": ""}, {"input_ids": []}, {"input_ids": [2**32]}, {"text": "t", "params": {"max_new_tokens": -1}},
    {"text": "t", "model": "m" * 300}, {"text": "t", "slo": {"tps": 0}}, {"text": "t", "deadline_ms": 0},
])
def test_a_submit_the_decoder_refuses_is_refused_unencoded_too(fields):
    body = P.submit_body("rid-1", **fields)
    built = P.submit_of_body(body, P.pack(body))
    decoded = P.decode_client(P.encode_submit("rid-1", **fields))
    assert isinstance(built, P.ProtocolError) and isinstance(decoded, P.ProtocolError)
    assert (built.reason, built.detail) == (decoded.reason, decoded.detail)

