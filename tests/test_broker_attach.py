"""Engines attached in the broker process (``mesh broker --attach KIND=URL``, brokers/attached.py).

* a bad ``--attach`` value is a startup error naming the field (no '=', unknown kind, bad URL,
  a URL twice, unknown or malformed options, vLLM without its endpoints, oversize);
* an inproc link registers at once: no ZMTP handshake is reported on inproc, so without its own
  path READY would wait for the blind fallback;
* a broker with attached ``mesh stub-sglang`` engines serves /generate and a streamed chat over
  HTTP; one engine dying costs no request (retried on the other), the last one dying is a clear
  error and the broker keeps serving;
* an attached engine flooding KV events does not starve the broker's HTTP clients (the adapter's
  relay reads at most a bounded slice per loop turn, on the broker's own loop).
"""

from __future__ import annotations

import asyncio
import json
import signal
import struct
import threading
import time

import aiohttp
import pytest
import zmq

from brokers.attached import attach_plans
from mesh.config import MAX_ATTACHED, BrokerSettings, build
from mesh.errors import ConfigError
from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers
from tests.adapters_support import load_frames
from tests.conftest import run, until


@pytest.mark.parametrize("value,fragment", [
    ("sglang", "expected KIND=URL"),
    ("sglang:http://127.0.0.1:30000", "expected KIND=URL"),
    ("tgi=http://127.0.0.1:30000", "unknown engine kind 'tgi'"),
    ("sglang=127.0.0.1:30000", "expected KIND=http://HOST:PORT"),
    ("sglang=http://127.0.0.1", "expected KIND=http://HOST:PORT"),
    ("sglang=http://127.0.0.1:99999", "expected KIND=http://HOST:PORT"),
    ("sglang=http://127.0.0.1:30000?x=1", "expected KIND=http://HOST:PORT"),
    ("sglang=http://127.0.0.1:30000,bogus=1", "option 'bogus=1'"),
    ("sglang=http://127.0.0.1:30000,role", "option 'role'"),
    ("sglang=http://127.0.0.1:30000," + "x" * 5000, "at most 4096 characters"),
])
def test_a_bad_attach_value_is_an_error_naming_the_field(value, fragment):
    with pytest.raises(ConfigError, match="^attach: ") as err:
        build(BrokerSettings, {"attach": [value]})
    assert fragment in str(err.value)


@pytest.mark.parametrize("values,fragment", [
    (["sglang=http://127.0.0.1:30000", "sglang=http://127.0.0.1:30000/"], "attached twice"),
    ([f"sglang=http://127.0.0.1:{30000 + i}" for i in range(MAX_ATTACHED + 1)], f"at most {MAX_ATTACHED} engines"),
    (["vllm=http://127.0.0.1:8000"], "kv_endpoint=tcp://HOST:PORT,block_size=16"),
    (["vllm=http://127.0.0.1:8000,kv_endpoint=tcp://127.0.0.1:5557,block_size=x"], "block_size must be an integer"),
    (["vllm=http://127.0.0.1:8000,kv_endpoint=nope,block_size=16"], "kv_endpoint: 'nope'"),
    (["sglang=http://127.0.0.1:30000,role=boss"], "role: must be one of"),
])
def test_attached_engine_settings_are_checked_at_startup(values, fragment):
    with pytest.raises(ConfigError, match="^attach: ") as err:
        attach_plans(build(BrokerSettings, {"attach": values}))
    assert fragment in str(err.value)


def test_attach_transport_is_checked():
    with pytest.raises(ConfigError, match="^attach_transport: must be one of memory, zmq"):
        build(BrokerSettings, {"attach_transport": "tcp"})


def test_attach_values_become_adapter_settings():
    plans = attach_plans(build(BrokerSettings, {"attach": [
        "sglang=http://127.0.0.1:30000", "vllm=http://10.0.0.2:8000,kv_endpoint=tcp://10.0.0.2:5557,block_size=32,worker_id=v1"],
        "drain_timeout_s": 3.0}))
    (k1, s1), (k2, s2) = plans
    assert (k1, s1.url, s1.worker_id, s1.drain_timeout_s) == ("sglang", "http://127.0.0.1:30000", "attached-sglang-127.0.0.1-30000", 3.0)
    assert (k2, s2.worker_id, s2.kv_endpoint, s2.block_size) == ("vllm", "v1", "tcp://10.0.0.2:5557", 32)


def test_an_inproc_link_registers_at_once_without_the_fallback():
    """inproc reports no handshake: READY goes out on connect, not after the blind fallback (here
    30 s, past the test's bound)."""
    from mesh import protocol as P
    from mesh.retry import RetryPolicy
    from mesh.worker.link import BrokerLink
    from tests.adapters_support import FakeBroker

    async def body() -> None:
        fb = FakeBroker(heartbeat_s=30).start()
        fb.sock.bind("inproc://attach-test")
        ready = lambda: P.encode_ready(P.Ready("w", "m", "mixed", {}, 16, 8, 1000, 1, 1, 5000))  # noqa: E731
        link = BrokerLink(fb.ctx, "inproc://attach-test", "w", 1, ready, lambda *_: None, lambda *_: None,
                          heartbeat_ms=60_000, liveness=3, reconnect=RetryPolicy(1000, 100, 1000), ready_timeout_s=30.0)
        task = asyncio.create_task(link.run())
        try:
            await until(lambda: link.registered, 10, "registered over inproc")
            assert (link.ready_fallbacks, link.ready_sent, len(fb.readies)) == (0, 1, 1)
            assert not fb.disconnects
        finally:
            link.close()
            await asyncio.gather(task, return_exceptions=True)
            await fb.close()

    run(body(), 20)


class _Peer:
    """A broker's end of the memory links (mesh.worker.memory.MemoryPeer) that answers READY with
    HEARTBEAT, as a broker registering a worker does, and records everything."""

    def __init__(self) -> None:
        self.delivers: dict = {}
        self.got: list = []
        self.unlinked: list = []

    def link(self, identity, deliver) -> None:
        self.delivers[identity] = deliver

    def unlink(self, identity) -> None:
        self.unlinked.append(self.delivers.pop(identity, None) is not None)

    def frames(self, identity, batch) -> None:
        from mesh import protocol as P

        for frames in batch:
            msg = P.decode_worker(frames)
            self.got.append(type(msg).__name__)
            if isinstance(msg, P.Ready):
                self.delivers[identity](P.encode_heartbeat())


def test_a_memory_link_registers_and_replies_without_its_socket():
    """With a MemoryPeer the link's READY, heartbeat confirmation and request replies go to the
    peer as frames lists; the broker socket it is connected to sees none of them."""
    from mesh import protocol as P
    from mesh.retry import RetryPolicy
    from mesh.worker.link import BrokerLink
    from tests.adapters_support import FakeBroker

    async def body() -> None:
        fb = FakeBroker(heartbeat_s=30).start()
        fb.sock.bind("inproc://attach-memory-test")
        peer = _Peer()
        ready = lambda: P.encode_ready(P.Ready("w", "m", "mixed", {}, 16, 8, 1000, 1, 1, 5000))  # noqa: E731
        link = BrokerLink(fb.ctx, "inproc://attach-memory-test", "w", 1, ready, lambda *_: None, lambda *_: None,
                          heartbeat_ms=60_000, liveness=3, reconnect=RetryPolicy(1000, 100, 1000), memory=peer)
        task = asyncio.create_task(link.run())
        try:
            await until(lambda: link.registered, 10, "registered through memory")
            for rid in (1, 2, 3):  # one loop turn's replies: one batch
                link.post(P.encode_worker_final(rid, 1, "length", {"prompt_tokens": 1, "completion_tokens": 1}))
            await until(lambda: peer.got.count("WorkerFinal") == 3, 5, "replies through memory")
            assert peer.got == ["Ready", "Heartbeat", "WorkerFinal", "WorkerFinal", "WorkerFinal"], peer.got
            assert link.posted_batches == 1 and link.send_failures == 0
            assert fb.readies == [] and fb.finals == {}  # nothing went over the socket
        finally:
            link.close(say_goodbye=False)
            await asyncio.gather(task, return_exceptions=True)
            await fb.close()
        assert peer.unlinked == [True] and not peer.delivers

    run(body(), 20)


# ----------------------------------------------------------------------------- real processes


def _attached_broker(procs, engines: list[str], *extra: str):
    b = procs.broker("b", "--http", "127.0.0.1:0", "--policy", "round_robin", "--drain-timeout-s", "2",
                     *(a for e in engines for a in ("--attach", e)), *extra)
    url = wait_for_log_event(b.log_path, "http_listening", 30, b.popen, start=b.log_start)["url"]
    run(wait_for_workers(b.frontend, len(engines)), 40)
    return b, url


def _stub(procs, name: str) -> tuple[object, dict]:
    p = procs.spawn(name, ["stub-sglang", "--port", "0", "--time-scale", "0.001"])
    return p, wait_for_log_event(p.log_path, "sglang_stub_listening", 30, p.popen, start=p.log_start)


async def _generate(s: aiohttp.ClientSession, url: str, i: int) -> tuple[int, dict]:
    async with s.post(url + "/generate", json={"text": f"request {i} to an attached engine",
                                               "sampling_params": {"max_new_tokens": 4}}) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.parametrize("transport", ["memory", "zmq"])
def test_a_broker_serves_through_attached_engines_and_outlives_them(procs, transport):
    stubs = [_stub(procs, f"stub{i}") for i in range(2)]
    b, url = _attached_broker(procs, [f"sglang={rec['url']}" for _, rec in stubs], "--attach-transport", transport)
    assert wait_for_log_event(b.log_path, "broker_attached_engines", 10, b.popen, start=b.log_start)["transport"] == transport

    async def body() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            status, out = await _generate(s, url, 0)
            assert status == 200 and len(out["output_ids"]) == 4, out
            chat = {"model": "mesh", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3}
            async with s.post(url + "/v1/chat/completions", json=chat) as r:
                raw = await r.read()
                assert r.status == 200, raw
            events = [ln[6:] for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
            assert events[-1] == b"[DONE]" and len(events) >= 4, events
            assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])

            stubs[0][0].popen.send_signal(signal.SIGKILL)  # one engine dies: its requests go to the other
            stubs[0][0].popen.wait(10)
            answers = [await _generate(s, url, i) for i in range(1, 9)]
            assert [st for st, _ in answers] == [200] * 8, answers

            stubs[1][0].popen.send_signal(signal.SIGKILL)  # the last one: a clear error, the broker stays up
            stubs[1][0].popen.wait(10)
            status, out = await _generate(s, url, 9)
            assert status in (502, 503), (status, out)
            assert out["error"]["message"], out
            async with s.get(url + "/v1/models") as r:
                assert r.status == 200
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
        assert b.alive()
        # the attached adapters' own counters: requests served, and the engines' deaths (a request's
        # error or failed health checks: the last request's error status needs one of them)
        counts = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in metrics.splitlines() if ln.startswith("mesh_attached_adapter")}

        def total(what: str) -> float:
            return sum(v for k, v in counts.items() if k.startswith(f'mesh_attached_adapter_total{{what="{what}"'))

        assert total("requests_ok") >= 9 and total("errors_unavailable") + total("health_failures") >= 1, counts
        assert len([k for k in counts if k.startswith("mesh_attached_adapter_healthy")]) == 2, counts

    run(body(), 90)


def _flood(endpoint_box: list, stop: threading.Event, sent: list[int]) -> None:
    """An engine's KV publisher flooding: the recorded SGLang batches, contiguous seqs, as fast as
    the PUB takes them, until ``stop``."""
    frames = load_frames("sglang_0_5_23_frames.json")["live"][1:]  # BlockStored / BlockRemoved batches
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    endpoint_box.append(f"tcp://127.0.0.1:{port}")
    seq = 0
    try:
        while not stop.is_set():
            for _ in range(1000):
                topic, _, payload = frames[seq % len(frames)]
                pub.send_multipart([topic, struct.pack(">q", seq), payload])
                seq += 1
            sent[0] = seq
    finally:
        pub.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("transport", ["memory", pytest.param("zmq", marks=pytest.mark.soak)])  # the relay's bound is the adapter's
def test_an_attached_engines_kv_flood_does_not_starve_http_clients(procs, transport):
    _, rec = _stub(procs, "stub")
    box: list[str] = []
    stop, sent = threading.Event(), [0]
    flooder = threading.Thread(target=_flood, args=(box, stop, sent), daemon=True)
    flooder.start()
    try:
        run(until(lambda: box, 10, "flooder bound"), 15)
        b, url = _attached_broker(procs, [f"sglang={rec['url']},kv_endpoint={box[0]}"], "--attach-transport", transport)

        async def body() -> str:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                await until(lambda: sent[0] > 20_000, 30, "the flood under way")
                answers = [await _generate(s, url, i) for i in range(20)]  # while the flood goes on
                assert [st for st, _ in answers] == [200] * 20, answers[:3]
                async with s.get(url + "/metrics") as r:
                    return await r.text()

        metrics = run(body(), 90)
        assert flooder.is_alive() and not stop.is_set()  # the requests were answered during the flood
    finally:
        stop.set()
        flooder.join(10)
    applied = [ln for ln in metrics.splitlines() if ln.startswith("mesh_kv_events") and not ln.startswith("#")]
    assert any(float(ln.rsplit(" ", 1)[1]) > 0 for ln in applied), applied


def test_attached_engines_register_with_a_curve_worker_allow_list(procs, tmp_path):
    """inproc has no CURVE handshake: under an allow-list the attached engine registers by its
    in-process name (``attached``), while TCP workers still need a listed key."""
    from mesh.security import keygen

    keys, allow_w = tmp_path / "keys", tmp_path / "allow-w"
    keygen(keys, "broker")
    pub, _ = keygen(keys, "w")
    allow_w.mkdir()
    (allow_w / pub.name).write_bytes(pub.read_bytes())
    _, rec = _stub(procs, "stub")
    b = procs.broker("b", "--http", "127.0.0.1:0", "--curve-secret", str(keys / "broker.key_secret"),
                     "--curve-allow-workers", str(allow_w), "--attach", f"sglang={rec['url']}")
    url = wait_for_log_event(b.log_path, "http_listening", 30, b.popen, start=b.log_start)["url"]

    async def body() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async def answered() -> bool:
                status, _ = await _generate(s, url, 0)
                return status == 200
            await until(answered, 30, "a request answered through the attached engine", step_s=0.2)

    run(body(), 60)
    log = b.log_path.read_text()
    assert '"worker_registered"' in log and '"key_mismatch"' not in log
