"""Recorded decisions (issue 33, part 4): the recorder core, its writer, the loader, continuations
and the replay's agreement with the recording (``mesh sim --record-decisions`` then ``--trace``)."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from pathlib import Path

import pytest

from mesh import protocol as P
from mesh.broker_core import BrokerCore
from mesh.broker_core.recorder import ROTATE, DecisionRecorder
from mesh.config import BrokerSettings, build
from mesh.engine_model import EngineConfig, EngineModel
from mesh.errors import ConfigError
from mesh.lab.sim.recorded import compare_decisions, is_decision_file, load_decisions
from mesh.lab.sim.runner import SimConfig, build_workload, run_sim
from mesh.routing.router import Router, make_policy

WORD = "zebracornqx"  # a prompt word that must never reach the file


class _Log:
    def _drop(self, *a, **k) -> None:
        return None

    info = warning = debug = error = exception = _drop


def _core(recorder: DecisionRecorder | None = None, **settings) -> BrokerCore:
    s = build(BrokerSettings, {"seed": 0, **settings})
    core = BrokerCore(s, Router(make_policy("power_of_two", rng=random.Random(0)), None), log=_Log(), recorder=recorder)
    return core


def _recorder(core_ref: list, **kw) -> DecisionRecorder:
    return DecisionRecorder(broker_id="b", policy="power_of_two", block_size=lambda: 4,
                            fleet=lambda: [(s.worker_id, s.ready.role) for s in core_ref[0].pool.by_id.values()], **kw)


def _serve(core: BrokerCore, n: int, *, text: str | None = None, tokens: int = 10, t0: float = 100.0) -> None:
    """Register one worker, submit ``n`` requests, answer each (first a chunk, then FINAL)."""
    core.start(t0)
    core.worker_message(b"W", P.Ready("w0", "m", "mixed", {}, 4, 64, 100_000, 1, 1, 500), t0)
    core.worker_message(b"W", P.Heartbeat([]), t0)
    core.take()
    for i in range(n):
        t = t0 + 1 + i
        ids = [(i * 7 + j) % 50 for j in range(tokens)]
        sub = P.Submit(f"r{i}", ids, text, 5, {}, None, True, True, None, None, b"", None)
        core.submit(b"c", sub, t)
        sent = [s for s in core.take() if s.frames[1:2] and s.frames[1][:1] == bytes([P.Cmd.REQUEST])]
        rid = sent[0].ref.rid if sent else next(iter(core.inflight))
        core.worker_message(b"W", P.WorkerChunk(rid, 1, 0, P.pack({})), t + 0.05)
        core.worker_message(b"W", P.WorkerFinal(rid, 1, "length", {"prompt_tokens": tokens, "completion_tokens": 5,
                                                                     "cached_tokens": 4}, P.pack({})), t + 0.2)
        core.take()


def _lines(rec: DecisionRecorder) -> list[dict]:
    return [json.loads(x) for x in rec.out if x is not ROTATE]


def test_the_core_records_each_routed_request_with_its_decision_and_ttft_and_no_text():
    ref: list = []
    rec = _recorder(ref)
    core = _core(rec)
    ref.append(core)
    _serve(core, 3, text=f"hello {WORD} there")
    raw = b"".join(x for x in rec.out if x is not ROTATE)
    assert WORD.encode() not in raw
    lines = _lines(rec)
    assert lines[0]["format"] == "mesh-decisions" and lines[0]["version"] == 1 and lines[0]["block_size"] == 4
    assert lines[1]["fleet"] == [{"id": "w0", "role": "mixed"}]  # the first decision named a worker not yet listed
    recs = lines[2:]
    assert len(recs) == 3
    r = recs[0]
    assert r["worker"] == "w0" and r["policy"] == "power_of_two" and r["outcome"] == "ok" and r["attempts"] == 1
    assert r["input_length"] == 10 and r["output_length"] == 5 and r["cached_tokens"] == 4 and r["max_tokens"] == 5
    assert r["timestamp"] == pytest.approx(1000.0) and r["ttft_ms"] == pytest.approx(50.0)
    assert r["e2e_ms"] == pytest.approx(200.0)  # to the last token: with output_length, the decode speed
    assert len(r["hash_ids"]) == 3  # two full 4-token blocks and a fresh id for the partial last one
    assert "text" not in r and "input_ids" not in r
    assert all(type(h) is int and h < 100 for x in recs for h in x["hash_ids"])


def test_hash_ids_are_first_seen_small_ints_shared_by_equal_prefixes_and_reset_per_file():
    ref: list = []
    rec = _recorder(ref, max_bytes=1 << 20)
    core = _core(rec)
    ref.append(core)
    core.start(0.0)
    core.worker_message(b"W", P.Ready("w0", "m", "mixed", {}, 4, 64, 100_000, 1, 1, 500), 0.0)
    core.worker_message(b"W", P.Heartbeat([]), 0.0)
    core.take()
    for i, ids in enumerate(([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11], [9, 9, 9, 9])):
        core.submit(b"c", P.Submit(f"r{i}", ids, None, 1, {}, None, False, True, None, None, b"", None), 1.0 + i)
        core.take()
        rid = next(iter(core.inflight))
        core.worker_message(b"W", P.WorkerFinal(rid, 1, "length", {"completion_tokens": 1}, P.pack({})), 1.5 + i)
        core.take()
    a, b, c = [x["hash_ids"] for x in _lines(rec)[2:]]
    assert a[:2] == b[:2] == [0, 1]  # equal full blocks, equal ids, in first-seen order
    assert a[2] != b[2]  # partial last blocks: fresh ids, never shared
    assert c[0] not in a + b


def test_a_file_that_reaches_max_bytes_rotates_with_a_new_header_and_a_new_id_map():
    ref: list = []
    rec = _recorder(ref, max_bytes=600)
    core = _core(rec)
    ref.append(core)
    _serve(core, 12)
    files: list[list[dict]] = [[]]
    for x in rec.out:
        if x is ROTATE:
            files.append([])
        else:
            files[-1].append(json.loads(x))
    assert len(files) > 2
    for i, f in enumerate(files):
        assert f[0]["format"] == "mesh-decisions" and f[0]["file_index"] == i
        assert f[0]["fleet"] == [{"id": "w0", "role": "mixed"}] or i == 0
        recs = [x for x in f if "input_length" in x]
        assert recs, "every file holds at least one record"
        assert min(h for r in recs for h in r["hash_ids"]) == 0  # ids restart with every file
        size = sum(len(json.dumps(x, separators=(",", ":"))) + 1 for x in f)
        assert size <= 600 or len(recs) == 1


def test_the_id_map_is_bounded_a_full_map_starts_a_new_file():
    ref: list = []
    rec = _recorder(ref, max_ids=3)
    core = _core(rec)
    ref.append(core)
    _serve(core, 4, tokens=12)  # 3 full blocks each, all different
    assert rec.out.count(ROTATE) >= 3
    assert len(rec._ids) <= 3


def test_sessions_are_per_file_pseudonyms_only_when_session_affinity_is_on():
    for on in (False, True):
        ref: list = []
        rec = _recorder(ref, sessions=on)
        core = _core(rec)
        ref.append(core)
        core.start(0.0)
        core.worker_message(b"W", P.Ready("w0", "m", "mixed", {}, 4, 64, 100_000, 1, 1, 500), 0.0)
        core.worker_message(b"W", P.Heartbeat([]), 0.0)
        for i, sess in enumerate(["alice@example.com", "bob", "alice@example.com"]):
            sub = P.Submit(f"r{i}", [1, 2, 3, 4, 5], None, 1, {}, None, False, True, None, None, b"", None, session=sess)
            core.submit(b"c", sub, 1.0 + i)
            core.take()
            core.worker_message(b"W", P.WorkerFinal(next(iter(core.inflight)), 1, "length", {}, P.pack({})), 1.5 + i)
        raw = b"".join(x for x in rec.out if x is not ROTATE)
        assert b"alice" not in raw and b"bob" not in raw
        recs = _lines(rec)[2:]
        assert [r.get("session") for r in recs] == ([0, 1, 0] if on else [None, None, None])


def test_a_failed_request_is_recorded_with_its_error_code_and_no_output():
    ref: list = []
    rec = _recorder(ref)
    core = _core(rec)
    ref.append(core)
    core.start(0.0)
    core.worker_message(b"W", P.Ready("w0", "m", "mixed", {}, 4, 64, 100_000, 1, 1, 500), 0.0)
    core.worker_message(b"W", P.Heartbeat([]), 0.0)
    core.submit(b"c", P.Submit("r0", [1, 2, 3, 4, 5], None, 9, {}, None, False, False, None, None, b"", None), 1.0)
    core.take()
    core.worker_message(b"W", P.WorkerError(next(iter(core.inflight)), 1, "bad_request", "no", False), 1.2)
    recs = _lines(rec)[2:]
    assert len(recs) == 1 and recs[0]["outcome"] == "bad_request" and recs[0]["output_length"] == 0


# --------------------------------------------------------------------------- flags and the writer


@pytest.mark.parametrize("field,value,why", [
    ("record_max_bytes", 1000, "record_max_bytes"),
    ("record_max_bytes", "big", "record_max_bytes"),
    ("record_files", 0, "record_files"),
    ("record_files", 10_000, "record_files"),
    ("record_max_ids", 10, "record_max_ids"),
    ("record_max_ids", 1 << 40, "record_max_ids"),
    ("record_decisions", "/nonexistent-dir-33/x.jsonl", "record_decisions"),
    ("record_decisions", "/tmp", "record_decisions"),
    ("record_decisions", "x" * 5000, "record_decisions"),
])
def test_record_flags_are_validated_naming_the_field(field, value, why):
    with pytest.raises(ConfigError, match=why):
        build(BrokerSettings, {field: value})


def _writer(tmp_path: Path, **kw):
    from brokers.decision_log import DecisionLog

    stats: dict[str, Counter] = {"dropped": Counter(), "written": Counter()}
    w = DecisionLog(str(tmp_path / "d.jsonl"), files=kw.pop("files", 3), dropped=stats["dropped"],
                    written=stats["written"], log=_Log(), **kw)
    return w, stats


def test_a_full_disk_or_unwritable_path_is_a_startup_error_naming_the_flag(tmp_path):
    from brokers.decision_log import DecisionLog
    from brokers.main import build_broker

    if Path("/dev/full").exists():
        w = DecisionLog("/dev/full", files=2, dropped=Counter(), written=Counter(), log=_Log())
        with pytest.raises(ConfigError, match="record_decisions: cannot write /dev/full"):
            w.start([b'{"format":"mesh-decisions"}\n'])
        assert Path("/dev/full").exists()  # a device is never rotated away
    d = tmp_path / "dir"
    d.mkdir()
    w = DecisionLog(str(d), files=2, dropped=Counter(), written=Counter(), log=_Log())
    with pytest.raises(ConfigError, match="record_decisions"):
        w.start([b"{}\n"])
    if Path("/dev/full").exists():
        with pytest.raises(ConfigError, match="record_decisions: cannot write /dev/full"):
            build_broker(build(BrokerSettings, {"record_decisions": "/dev/full", "frontend": "tcp://127.0.0.1:*",
                                                "backend": "tcp://127.0.0.1:*"}))


def test_the_writer_rotates_files_and_keeps_at_most_record_files(tmp_path):
    w, stats = _writer(tmp_path, files=3)
    (tmp_path / "d.jsonl").write_text("old run\n")
    w.start([b'{"format":"mesh-decisions","file_index":0}\n'])
    for i in range(1, 6):
        w.put([b'{"timestamp":1}\n', ROTATE, b'{"format":"mesh-decisions","file_index":%d}\n' % i])
    w.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["d.jsonl", "d.jsonl.1", "d.jsonl.2"]
    assert (tmp_path / "d.jsonl").read_text() == '{"format":"mesh-decisions","file_index":5}\n'
    assert (tmp_path / "d.jsonl.2").read_text().startswith('{"format":"mesh-decisions","file_index":3}')
    assert stats["written"]["records"] == 5 and stats["written"]["files"] == 6
    assert not stats["dropped"]


def test_a_slow_disk_never_blocks_the_loop_the_queue_is_bounded_and_drops_are_counted(tmp_path):
    gate = threading.Event()

    class SlowFile:
        def __init__(self) -> None:
            self.data = []

        def write(self, b: bytes) -> None:
            if self.data:
                gate.wait(10)  # the disk stalls after the header
            self.data.append(b)

        def flush(self) -> None:
            return None

        def close(self) -> None:
            return None

    f = SlowFile()
    w, stats = _writer(tmp_path, queue_max=50, opener=lambda p: f)
    w.start([b'{"format":"mesh-decisions"}\n'])
    w.put([b'{"timestamp":0}\n'])  # the writer takes it and stalls on it
    for i in range(500):
        w.put([b'{"timestamp":%d}\n' % i])  # returns at once: queued or dropped
    w.put([ROTATE, b'{"format":"mesh-decisions","file_index":1}\n'])  # a rotation and its header are never dropped
    assert stats["dropped"]["queue_full"] >= 400
    gate.set()
    w.close()
    written = b"".join(f.data)
    assert written.count(b'"format"') == 2
    assert stats["written"]["records"] + stats["dropped"]["queue_full"] == 501


def test_a_write_error_at_run_time_is_counted_not_raised(tmp_path):
    class BadFile:
        n = 0

        def write(self, b: bytes) -> None:
            BadFile.n += 1
            if BadFile.n > 1:
                raise OSError(28, "No space left on device")

        def flush(self) -> None:
            return None

        def close(self) -> None:
            return None

    w, stats = _writer(tmp_path, opener=lambda p: BadFile())
    w.start([b'{"format":"mesh-decisions"}\n'])
    w.put([b'{"timestamp":1}\n', b'{"timestamp":2}\n'])
    w.close()
    assert stats["dropped"]["write_error"] == 2


# --------------------------------------------------------------------------- loader, continuations, replay


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


HEADER = {"format": "mesh-decisions", "version": 1, "policy": "cache_aware", "block_size": 4, "broker_id": "b",
          "fleet": [{"id": "gpu-b", "role": "mixed"}, {"id": "gpu-a", "role": "mixed"}]}


def test_the_loader_reads_mooncake_fields_block_size_fleet_and_keeps_decisions_aside(tmp_path):
    p = _write(tmp_path / "d.jsonl", [
        HEADER,
        {"timestamp": 2500.0, "input_length": 6, "output_length": 3, "hash_ids": [0, 1], "worker": "gpu-a", "reason": "cache_hit",
         "max_tokens": 50},
        {"fleet": [{"id": "gpu-c", "role": "mixed"}], "timestamp": 10},
        {"timestamp": 1000.5, "input_length": 9, "output_length": 2, "hash_ids": [0, 2, 3], "block_size": 4,
         "worker": "gpu-c", "reason": "least_load", "predicted_ttft_ms": 12.5},
    ])
    assert is_decision_file(p)
    wl = load_decisions(p)
    assert [r.arrival_s for r in wl.requests] == [1.0005, 2.5]  # sorted, kept on the file's clock
    assert [r.prompt_len for r in wl.requests] == [9, 6]
    assert wl.fleet == [("gpu-b", "mixed"), ("gpu-a", "mixed"), ("gpu-c", "mixed")]
    assert [d["worker"] for d in wl.recorded] == ["gpu-c", "gpu-a"]
    assert [r.max_tokens for r in wl.requests] == [None, 50]  # routers see what was asked; the engine emits output_length
    a, b = (list(wl.prompt(r)) for r in wl.requests)
    assert a[:4] == b[:4] and a[4:8] != b[4:6]  # block id 0 shared, then different blocks


@pytest.mark.parametrize("line,field", [
    ({"timestamp": "x", "input_length": 4, "output_length": 1, "hash_ids": [1]}, "timestamp"),
    ({"timestamp": 1, "input_length": -4, "output_length": 1, "hash_ids": [1]}, "input_length"),
    ({"timestamp": 1, "input_length": 4, "output_length": 1e9, "hash_ids": [1]}, "output_length"),
    ({"timestamp": 1, "input_length": 40, "output_length": 1, "hash_ids": [1]}, "hash_ids"),
    ({"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": ["a"]}, "hash_ids"),
    ({"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [1], "block_size": 0}, "block_size"),
    ({"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [1], "worker": ["x"]}, "worker"),
    ([1, 2], "JSON object"),
])
def test_hostile_records_are_refused_naming_line_and_field(tmp_path, line, field):
    p = _write(tmp_path / "d.jsonl", [HEADER, line])
    with pytest.raises(ConfigError, match=rf"d\.jsonl:2: .*{field}"):
        load_decisions(p)


def test_a_bad_header_or_an_oversize_line_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="version"):
        load_decisions(_write(tmp_path / "a.jsonl", [{**HEADER, "version": 99}]))
    with pytest.raises(ConfigError, match="block_size"):
        load_decisions(_write(tmp_path / "b.jsonl", [{**HEADER, "block_size": "x"}]))
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps(HEADER) + "\n")
    import mesh.lab.sim.recorded as R

    old = R.MAX_LINE_BYTES
    R.MAX_LINE_BYTES = 100
    try:
        with p.open("a") as fh:
            fh.write(json.dumps({"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [1] * 200}) + "\n")
        with pytest.raises(ConfigError, match="longer than"):
            load_decisions(p)
    finally:
        R.MAX_LINE_BYTES = old


def test_a_second_header_in_one_file_is_refused(tmp_path):
    """Rotated files are separate id spaces: concatenated, their ids would collide."""
    p = _write(tmp_path / "d.jsonl", [HEADER, {"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [0]},
                                      {**HEADER, "file_index": 1}])
    with pytest.raises(ConfigError, match=r"d\.jsonl:3: format: a second header"):
        load_decisions(p)


def test_continuations_make_the_engine_emit_what_the_next_turn_holds(tmp_path):
    # turn 1: 6 tokens (1 full block + 2), answers 5; turn 2 holds turn 1, its answer and more (5 blocks)
    p = _write(tmp_path / "d.jsonl", [
        HEADER,
        {"timestamp": 0, "input_length": 6, "output_length": 5, "hash_ids": [0, 1], "session": 3},
        {"timestamp": 5, "input_length": 9, "output_length": 1, "hash_ids": [7, 8, 9], "session": 4},  # another session
        {"timestamp": 9, "input_length": 19, "output_length": 2, "hash_ids": [0, 2, 3, 4, 5], "session": 3},
    ])
    wl = load_decisions(p)
    r1, _, r2 = wl.requests
    assert wl.params["continuations"] == 1
    p1, p2 = list(wl.prompt(r1)), list(wl.prompt(r2))
    out = wl.output_tokens(r1)
    assert p1 + out == p2[:11]  # the prompt's partial block and the answer are what turn 2 holds
    eng = EngineModel(EngineConfig(page_size=4))
    eng.submit("a", p1, 5, 0.0, output_tokens=out)
    t = 0.0
    while eng.has_work():
        t += eng.step(t).duration_s
    eng.submit("b", p2, 1, t)
    res = eng.step(t)
    assert res.first_tokens[0][1] == 8  # turn 2 hits turn 1's prompt and answer pages (2 full pages of 11 tokens)


def test_without_a_script_the_engine_emits_its_own_tokens_and_scripts_are_validated():
    eng = EngineModel(EngineConfig(page_size=4))
    with pytest.raises(ValueError, match="output_tokens"):
        eng.submit("x", [1, 2, 3], 2, 0.0, output_tokens=[1, 10 ** 9])


def _sim(tmp_path: Path, n: int, **kw) -> tuple[dict, Path]:
    path = tmp_path / "rec.jsonl"
    cfg = SimConfig(workload="conversation", rate=4.0, duration_s=None, max_requests=n, seed=3, policies=["cache_aware"],
                    workers=[4], lifecycle="core", record_decisions=str(path), **kw)
    return run_sim(cfg), path


def test_a_recorded_slice_replays_in_mesh_sim_to_identical_choices(tmp_path):
    """(a) on a short slice: the broker's core records; its replay chooses the same workers."""
    live, path = _sim(tmp_path, 150)
    assert b"input_ids" not in path.read_bytes()
    cfg = SimConfig(trace=str(path), policies=["cache_aware"], workers=[4], lifecycle="core", seed=3)
    wl = build_workload(cfg)
    assert len(wl.requests) == live["arms"][0]["completed"]
    rep = run_sim(cfg, workload=wl)["arms"][0]
    ag = rep["decision_agreement"]
    assert ag["compared"] == len(wl.requests) and ag["identical_share"] >= 0.99, ag
    assert rep["hit_rate"] == pytest.approx(live["arms"][0]["hit_rate"], rel=0.02)


def test_compare_decisions_lists_divergences_by_reason():
    from mesh.lab.sim.workloads import SimRequest, Workload

    wl = Workload("recorded", [SimRequest(i, float(i), 4, 1, ()) for i in range(3)])
    wl.recorded = [{"worker": "a", "reason": "cache_hit"}, {"worker": "b", "reason": "cache_hit"}, {"worker": None}]
    ag = compare_decisions(wl, [("a", "cache_hit"), ("c", "least_load"), None])
    assert ag["compared"] == 2 and ag["identical"] == 1
    assert ag["by_reason"]["cache_hit"] == {"requests": 2, "identical": 1, "share": 0.5}
    assert ag["first_divergences"][0]["replayed"] == "c"


def test_sim_record_decisions_needs_one_core_arm_with_one_router(tmp_path):
    with pytest.raises(ConfigError, match="record_decisions"):
        SimConfig(workload="zipf", policies=["cache_aware", "random"], lifecycle="core",
                  record_decisions=str(tmp_path / "x")).validate()
    with pytest.raises(ConfigError, match="record_decisions"):
        SimConfig(workload="zipf", policies=["cache_aware"], record_decisions=str(tmp_path / "x")).validate()


# --------------------------------------------------------------------------- a real broker (e2e)


async def _conversations(frontend: str, n: int, sessions: int = 8, rate: float = 40.0) -> None:
    """``n`` requests of ``sessions`` chats sharing a system prompt: each turn's prompt is the
    session's history (earlier prompts and the answers the workers streamed) plus a new message,
    one text request among them carrying WORD."""
    import asyncio

    from mesh.client import Client

    rng = random.Random(7)
    system = [rng.randrange(1, 30_000) for _ in range(200)]
    history = [list(system) for _ in range(sessions)]
    busy: set[int] = set()

    async def turn(c: Client, s: int, i: int) -> None:
        prompt = history[s] + [rng.randrange(1, 30_000) for _ in range(rng.randrange(20, 200))]
        st = await c.submit(input_ids=prompt, max_new_tokens=rng.randrange(8, 40))
        out: list[int] = []
        async for toks in st:
            out.extend(toks)
        history[s] = prompt + out
        busy.discard(s)

    async with Client(frontend) as c:
        await (await c.submit(text=f"hello {WORD} world", max_new_tokens=4)).result()
        tasks = []
        for i in range(n - 1):
            free = [s for s in range(sessions) if s not in busy] or list(range(sessions))
            s = rng.choice(free)
            busy.add(s)
            tasks.append(asyncio.create_task(turn(c, s, i)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


def record_real(procs, tmp_path: Path, n: int, workers: int = 4) -> Path:
    """A real broker recording ``n`` requests from stub workers; returns the file (after a clean stop)."""
    from conftest import run
    from mesh.lab.up import wait_for_workers

    path = tmp_path / "real.jsonl"
    b = procs.broker("b", "--record-decisions", str(path), "--seed", "1")
    procs.workers("w", [b.backend], count=workers)
    run(wait_for_workers(b.frontend, workers))
    run(_conversations(b.frontend, n), timeout_s=300)
    assert b.stop() == 0
    return path


def test_a_real_broker_records_what_mesh_sim_replays(procs, tmp_path):
    """(b), small: a broker process with stub workers records; the file holds no prompt text, loads
    with its fleet, and replays through the broker's core in mesh sim (timing differs live, so the
    agreement is reported, not required: docs/simulator.md)."""
    path = record_real(procs, tmp_path, 40)
    raw = path.read_bytes()
    assert WORD.encode() not in raw and b"hello" not in raw
    wl = load_decisions(path)
    assert len(wl.requests) == 40 and len(wl.fleet) == 4
    assert all(d["outcome"] == "ok" and d["worker"] in dict(wl.fleet) for d in wl.recorded)
    assert sum(1 for r in wl.requests if r.output_script) >= 10  # later turns continue earlier ones
    cfg = SimConfig(trace=str(path), policies=["cache_aware"], workers=[4], lifecycle="core", seed=1)
    ag = run_sim(cfg, workload=build_workload(cfg))["arms"][0]["decision_agreement"]
    assert ag["compared"] == 40 and ag["identical"] > 0


@pytest.mark.soak  # (a) at full size: ~12k requests, 16 workers (the fast slice above runs by default)
def test_a_recorded_hour_replays_to_at_least_99_percent_identical_choices(tmp_path):
    path = tmp_path / "hour.jsonl"
    cfg = SimConfig(workload="conversation", rate=3.2, duration_s=3600.0, seed=1, policies=["cache_aware"], workers=[16],
                    lifecycle="core", record_decisions=str(path))
    run_sim(cfg)
    replay = SimConfig(trace=str(path), policies=["cache_aware"], workers=[16], lifecycle="core", seed=1)
    ag = run_sim(replay, workload=build_workload(replay))["arms"][0]["decision_agreement"]
    assert ag["compared"] > 10_000 and ag["identical_share"] >= 0.99, ag


def test_the_record_counters_are_exported():
    from brokers.stats import StatsCollector
    from mesh.broker_core import BrokerStats

    s = BrokerStats()
    s.record["records"] += 3
    s.record_dropped["queue_full"] += 2
    fams = {f.name: f for f in StatsCollector(s, dict).collect()}
    assert [x.value for x in fams["mesh_record_dropped"].samples] == [2]
    assert s.flat()["record_dropped.queue_full"] == 2


def test_mesh_sim_cli_records_replays_and_compares(tmp_path, capsys):
    from mesh.lab.sim.cli import main

    path = tmp_path / "r.jsonl"
    assert main(["--workload", "conversation", "--rate", "4", "--duration-s", "15", "--seed", "2", "--workers", "3",
                 "--policy", "cache_aware", "--lifecycle", "core", "--record-decisions", str(path), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["--trace", str(path), "--policy", "cache_aware", "--lifecycle", "core", "--seed", "2",
                 "--compare-decisions", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "3 workers" in out.err and "identical choices (100.00 %)" in out.out
    mooncake = _write(tmp_path / "m.jsonl", [{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}])
    assert main(["--trace", str(mooncake), "--lifecycle", "core", "--compare-decisions", "--no-progress"]) != 0
    assert "compare_decisions" in capsys.readouterr().err


def test_a_prompt_longer_than_the_hashed_keys_gets_fresh_ids_for_the_rest():
    """The broker hashes at most what the fleet could hold: the blocks past it are fresh ids, never shared."""
    rec = DecisionRecorder(broker_id="b", policy="p", fleet=list, max_ids=4)
    a = rec._hash_ids([11, 12], 40, 4)
    b = rec._hash_ids([11, 12, 13, 14, 15, 16], 24, 4)
    assert len(a) == 10 and a[:2] == b[:2] == [0, 1] and len(set(a[2:])) == 8
    assert len(b) == 6 and not set(b[2:]) & set(a)  # past max_ids keys are numbered but not kept
    assert len(rec._ids) == 4 and rec.stats["ids_unmapped"] == 2


def test_mesh_sim_audit_replays_a_recording_through_every_policy_and_checks_the_engine_model(tmp_path, capsys):
    """``mesh sim --trace RECORDING --audit``: the policy-level regret audit (mesh.lab.sim.twin)
    runs cache_aware and both baselines on the recorded stream, prints what cache_aware pays
    against each with its interval, and sets the twin's cache_aware mean TTFT beside the one the
    recording observed: it matches on the engine that recorded it, and says so when the engine
    description is 10x off."""
    from mesh.lab.sim.cli import main

    path = tmp_path / "r.jsonl"
    assert main(["--workload", "conversation", "--rate", "2", "--duration-s", "40", "--seed", "2", "--workers", "3",
                 "--policy", "cache_aware", "--lifecycle", "core", "--record-decisions", str(path), "--no-progress"]) == 0
    capsys.readouterr()
    out_json = tmp_path / "audit.json"
    assert main(["--trace", str(path), "--audit", "--lifecycle", "core", "--seed", "2", "--no-progress",
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    rep = json.loads(out_json.read_text())
    assert [a["policy"] for a in rep["arms"]] == ["cache_aware", "cache_aware_greedy", "power_of_two"]
    pays, fid = rep["audit"]["pays"], rep["audit"]["fidelity"]
    mean = {a["policy"]: a["ttft_mean_ms"] for a in rep["arms"]}
    for b in ("cache_aware_greedy", "power_of_two"):
        assert pays["pays_ms"][b] == pytest.approx(mean[b] - mean["cache_aware"], abs=1e-3)
        assert pays["ci95_ms"][b] is not None and pays["ci95_ms"][b] >= 0
    assert pays["against"] == min(("cache_aware_greedy", "power_of_two"), key=mean.__getitem__)
    assert fid["policy"] == "cache_aware" and fid["requests"] == rep["workload"]["requests"]
    assert fid["matches"] and 1 / 1.1 <= fid["ratio"] <= 1.1, fid  # the engine that recorded it: the twin replays it
    assert "policy-level audit" in out and "against the better baseline" in out and ": matches" in out
    fit = rep["audit"]["engine_fit"]  # fitted by default: on the engine that recorded it, at once
    assert fit["converged"] and fit["evaluations"] == 1 and fit["prefill_speed"] == fit["decode_speed"] == 1.0
    assert fit["observed"]["tpot_mean_ms"] > 0 and fit["fitted_tpot"]
    # the same recording audited with an engine four times slower at prefill and twice as slow at
    # decode as the one that served it: as described, the check says it does not match ...
    slow = ["--prefill-tokens-per-s", "6250", "--decode-base-ms", "14"]
    assert main(["--trace", str(path), "--audit", "--lifecycle", "core", "--seed", "2", "--no-progress", "--no-fit-engine",
                 *slow]) == 0
    assert "does NOT match" in capsys.readouterr().out
    # ... and the fit finds the engine that served it again, and with it the audit's figures
    fitted_json = tmp_path / "fitted.json"
    assert main(["--trace", str(path), "--audit", "--lifecycle", "core", "--seed", "2", "--no-progress", *slow,
                 "--json", str(fitted_json)]) == 0
    assert "engine model fitted" in capsys.readouterr().out
    rep2 = json.loads(fitted_json.read_text())
    fit2 = rep2["audit"]["engine_fit"]
    assert fit2["converged"] and fit2["evaluations"] <= 10
    assert fit2["prefill_speed"] == pytest.approx(4.0, rel=0.25) and fit2["decode_speed"] == pytest.approx(2.0, rel=0.15)
    assert rep2["audit"]["fidelity"]["matches"]
    for b in ("cache_aware_greedy", "power_of_two"):  # what cache_aware pays, as on the right engine
        assert rep2["audit"]["pays"]["pays_ms"][b] == pytest.approx(pays["pays_ms"][b],
                                                                     abs=max(0.25 * abs(pays["pays_ms"][b]), 2 * (pays["ci95_ms"][b] or 0), 2.0))
    # --audit-draws 3: the audit is the mean of three independent draws of the twin, the first the run itself
    drawn_json = tmp_path / "drawn.json"
    assert main(["--trace", str(path), "--audit", "--lifecycle", "core", "--seed", "2", "--no-progress",
                 "--audit-draws", "3", "--json", str(drawn_json)]) == 0
    assert "the mean of 3 draws" in capsys.readouterr().out
    drawn = json.loads(drawn_json.read_text())["audit"]["pays"]
    assert drawn["draws"] == 3 and len(drawn["per_draw_ms"]) == 3
    assert drawn["per_draw_ms"][0] == pays["pays_ms"]  # draw 0: the run, as without --audit-draws
    assert drawn["per_draw_ms"][1] != drawn["per_draw_ms"][0] != drawn["per_draw_ms"][2]  # their own random numbers
    for b in ("cache_aware_greedy", "power_of_two"):
        assert drawn["pays_ms"][b] == pytest.approx(sum(d[b] for d in drawn["per_draw_ms"]) / 3, abs=2e-3)
        assert drawn["ci95_ms"][b] < pays["ci95_ms"][b]  # three draws know it better than one
    for bad in (["--audit", "--audit-draws", "0"], ["--audit", "--audit-draws", "17"], ["--audit-draws", "2"]):
        assert main(["--trace", str(path), "--no-progress", *bad]) == 2
        assert "audit_draws" in capsys.readouterr().err
    # --audit picks its own policies and one fleet shape
    assert main(["--trace", str(path), "--audit", "--policy", "cache_aware", "--no-progress"]) == 2
    assert "audit:" in capsys.readouterr().err
    assert main(["--trace", str(path), "--audit", "--routers", "1,2", "--no-progress"]) == 2
    assert "audit:" in capsys.readouterr().err
    assert main(["--trace", str(path), "--audit-textfile", str(tmp_path / "a.prom"), "--no-progress"]) == 2
    assert "audit_textfile" in capsys.readouterr().err
    assert main(["--trace", str(path), "--fit-engine", "--no-progress"]) == 2  # the fit is the audit's
    assert "fit_engine" in capsys.readouterr().err
    assert main(["--workload", "zipf", "--audit", "--fit-engine", "--duration-s", "5", "--no-progress"]) == 2
    assert "fit_engine: cannot fit the engine: the stream is no recording" in capsys.readouterr().err


def test_a_real_brokers_recording_is_audited_at_the_policy_level(procs, tmp_path, capsys):
    """A recording made by a real broker process in front of stub workers (real sockets) goes
    through ``mesh sim --audit``: every policy replays it and the engine model is compared with
    what the broker observed (the ratio is reported; live timing on a busy machine is not asserted)."""
    from mesh.lab.sim.cli import main

    path = record_real(procs, tmp_path, 40)
    out_json = tmp_path / "audit.json"
    prom = tmp_path / "audit.prom"
    assert main(["--trace", str(path), "--audit", "--no-progress", "--json", str(out_json),
                 "--audit-textfile", str(prom)]) == 0
    rep = json.loads(out_json.read_text())
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
    got = {s.labels["baseline"]: s.value for s in fams["mesh_audit_pays_ms"].samples}
    assert got == {**rep["audit"]["pays"]["pays_ms"], "best": rep["audit"]["pays"]["best"]}
    assert fams["mesh_audit_requests"].samples[0].value == 40
    assert fams["mesh_audit_verdict"].samples[0].value == {"saves": 1, "tie": 0, "costs": -1}[rep["audit"]["pays"]["verdict"]]
    assert fams["mesh_audit_engine_fidelity_ratio"].samples[0].value == rep["audit"]["fidelity"]["ratio"]
    fit = rep["audit"]["engine_fit"]  # the real broker's TTFT and TPOT, fitted
    assert fams["mesh_audit_engine_prefill_speed"].samples[0].value == fit["prefill_speed"]
    assert fams["mesh_audit_engine_decode_speed"].samples[0].value == fit["decode_speed"]
    assert fit["observed"]["requests"] == 40 and fit["evaluations"] >= 1
    assert rep["audit"]["pays"]["against"] in ("cache_aware_greedy", "power_of_two")
    fid = rep["audit"]["fidelity"]
    assert fid["requests"] == 40 and fid["observed_ttft_mean_ms"] > 0 and fid["ratio"] > 0
    assert "engine model: the twin's cache_aware mean TTFT" in capsys.readouterr().out
