"""The protocol fuzzer: its pure generators, and a short paced + unpaced run against a real broker."""

from __future__ import annotations

import json
import random

from mesh import protocol as P
from mesh.errors import ProtocolError
from mesh.fuzz.generators import (
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
from mesh.fuzz.runner import FuzzConfig, run_fuzz
from mesh.up import wait_for_workers
from tests.conftest import run


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


# glibc keeps what libzmq's I/O thread allocated for queued inbound frames (up to 4 MB each,
# RCVHWM 10,000 per connection) in its arenas after the broker has read and freed them, and
# raises its mmap threshold after the first large free, so RSS after an unpaced burst measures
# the burst's peak queue, not what the broker still holds (~150 MB of 177 MB growth were free
# malloc memory; malloc_trim gave it back). A fixed mmap threshold and two arenas make RSS
# track live memory, so the growth check below detects what the broker keeps.
_ALLOC_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "131072"}


def _e2e(procs, seconds: float, seed: int, peers: int = 4) -> dict:
    procs.env.update(_ALLOC_ENV)
    b = procs.broker("b", "--heartbeat-ms", "200")
    procs.workers("w", [b.backend], "--time-scale", "0.2", count=1)
    run(wait_for_workers(b.frontend, 1))
    cfg = FuzzConfig(b.frontend, b.backend, seconds=seconds, seed=seed, peers=peers, paced_rate=150.0,
                     broker_pid=b.pid, broker_log=str(b.log_path))
    s = run(run_fuzz(cfg), timeout_s=seconds + 90)
    s["exit_code"] = b.popen.poll()
    print(json.dumps({k: s[k] for k in ("seed", "frames", "alive", "status_after", "real_requests", "rss_kb",
                                        "frames_rejected_total", "findings")}, indent=1, default=str))
    return s


def check_broker_survived(s: dict, max_growth_mb: float = 150.0) -> None:
    """What a fuzzed broker must still do: live, answer STATUS, serve a real request, bounded memory."""
    why = f"seed {s['seed']}; findings: {json.dumps(s['findings'], default=str)[:3000]}; log: {s.get('broker_log_errors')}"
    assert s["exit_code"] is None and s["alive"], f"broker exited ({s['exit_code']}); crash: {s.get('crash')}; {why}"
    assert s["status_after"], f"no STATUS reply after fuzzing; {why}"
    assert s["real_ok"], f"real requests after fuzzing: {s['real_requests']}; {why}"
    assert s["frames_rejected_total"] > 0 and s["frames"]["paced"] > 0 and s["frames"]["unpaced"] > 0
    growth = s["rss_kb"]["growth_mb"]
    # With _ALLOC_ENV the broker's live Python heap grows ~10-30 MB here (prefix + speculative
    # index entries, counters, pymalloc arenas kept by a few live objects); the rest is small
    # frames still queued in or freed from libzmq's pipes (24-97 MB in repeated 9 s runs). A leak
    # (1.27 GB in 40 s before) is far above this.
    assert growth is not None and growth < max_growth_mb, f"broker RSS grew {growth} MB ({s['rss_kb']}); {why}"


def test_fuzz_broker_e2e(procs):
    """~9 s paced + unpaced fuzzing of a real broker with a real worker, then the survival checks."""
    check_broker_survived(_e2e(procs, seconds=9.0, seed=20261201))
