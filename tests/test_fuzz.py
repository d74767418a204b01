"""The protocol fuzzer: its pure generators, and a short paced + unpaced run against a real broker."""

from __future__ import annotations

import json
import random

import pytest

from mesh import protocol as P
from mesh.errors import ProtocolError
from mesh.lab.fuzz.generators import (
    BODY_MUTATIONS,
    CLIENT_SEMANTIC,
    FRAME_MUTATIONS,
    HTTP_MUTATIONS,
    REPLY_KINDS,
    WORKER_SEMANTIC,
    ClientGen,
    WorkerGen,
    answer_request,
    http_case,
)
from tests.fuzz_support import check_broker_survived, run_fuzz_e2e


def _cases(seed: int, n: int):
    rng = random.Random(seed)
    cg, wg = ClientGen(rng), WorkerGen(rng, "fuzz-w0", dp_size=2)
    return [cg.case() for _ in range(n)], [wg.case() for _ in range(n)]


def test_every_mutation_class_appears():
    clients, workers = _cases(7, 6000)
    for cases, semantic in ((clients, CLIENT_SEMANTIC), (workers, WORKER_SEMANTIC)):
        seen = {c.mutation for c in cases}
        missing = set(BODY_MUTATIONS + FRAME_MUTATIONS + semantic) - seen
        assert not missing, missing
        assert None in seen  # valid cases too
        assert {c.group for c in cases} == {"valid", "semantic", "body", "frame"}
    bodies = {c.base for c in clients}
    assert {"SUBMIT", "CANCEL", "STATUS"} <= bodies
    assert {"READY", "HEARTBEAT", "KV_EVENTS", "CHUNK", "FINAL", "ERROR", "DISCONNECT"} <= {c.base for c in workers}


def test_valid_and_semantic_cases_decode():
    for seed in range(4):
        clients, workers = _cases(seed, 800)
        for c in clients:
            if c.group in ("valid", "semantic"):
                m = P.decode_client(c.frames)
                assert not isinstance(m, ProtocolError), (c.mutation, m)
        for c in workers:
            if c.group in ("valid", "semantic"):
                m = P.decode_worker(c.frames)
                assert not isinstance(m, ProtocolError), (c.mutation, m)


def test_broken_cases_are_mostly_rejected():
    clients, workers = _cases(3, 3000)
    for cases, dec in ((clients, P.decode_client), (workers, P.decode_worker)):
        broken = [c for c in cases if c.group == "frame"]
        rejected = sum(isinstance(dec(c.frames), ProtocolError) for c in broken)
        assert rejected / len(broken) > 0.9
        reasons = {dec(c.frames).reason for c in broken if isinstance(dec(c.frames), ProtocolError)}
        assert {"bad_header", "wrong_path", "bad_frame_count", "unknown_command", "bad_msgpack"} <= reasons


def test_deterministic_per_seed():
    a = _cases(11, 400)
    b = _cases(11, 400)
    assert [c.frames for c in a[0]] == [c.frames for c in b[0]]
    assert [c.frames for c in a[1]] == [c.frames for c in b[1]]
    assert [c.frames for c in _cases(12, 50)[0]] != [c.frames for c in a[0][:50]]


def test_worker_answers():
    sub = P.encode_submit("r1", input_ids=[1, 2, 3], params={"max_new_tokens": 4})
    req = P.decode_broker_to_worker(P.encode_request(7, 2, 1000, "r1", sub[2]))
    assert isinstance(req, P.Request)
    rng = random.Random(0)
    for kind in REPLY_KINDS:
        k, frames = answer_request(rng, req, kind)
        assert k == kind
        if kind == "silent":
            assert frames == []
            continue
        assert frames
    _, frames = answer_request(rng, req, "correct")
    msgs = [P.decode_worker(f) for f in frames]
    assert [type(m) for m in msgs] == [P.WorkerChunk] * 4 + [P.WorkerFinal]
    assert [m.seq for m in msgs[:4]] == [0, 1, 2, 3] and all((m.rid, m.attempt) == (7, 2) for m in msgs)
    for _ in range(50):
        _, frames = answer_request(rng, req, "garbage_payload")
        final = P.decode_worker(frames[-1])
        if frames[-1][3] == b"":  # an empty payload is an empty map: a valid FINAL
            assert isinstance(final, P.WorkerFinal)
        else:  # the decoder turns a FINAL with an undecodable payload into a malformed worker error
            assert isinstance(final, P.WorkerError) and final.malformed, final
    seen = {answer_request(rng, req)[0] for _ in range(600)}
    assert seen == set(REPLY_KINDS)


def test_http_cases():
    rng = random.Random(5)
    seen = set()
    for _ in range(800):
        path, mut, body, headers, _ = http_case(rng)
        assert path in ("/v1/completions", "/v1/chat/completions", "/generate") and isinstance(body, bytes)
        seen.add(mut)
        if mut == "valid":
            assert isinstance(json.loads(body), dict)
    assert seen == set(HTTP_MUTATIONS)


@pytest.mark.soak  # chaos/flood run: make soak
def test_fuzz_broker_e2e(procs):
    """A few seconds of paced + unpaced fuzzing of a real broker with a real worker, then the survival
    checks (make soak fuzzes for minutes)."""
    check_broker_survived(run_fuzz_e2e(procs, seconds=3.0, seed=20261201))
