"""P/D that fails loudly (issue 30), with real processes: ``mesh broker --pd`` (bucket domains from
configs/buckets-example.toml: prefill workers labelled ``pool=short``, decode workers
``stage=decode``), ``mesh attach sglang|vllm`` adapters with roles, and ``mesh stub-sglang``
engines speaking each engine's P/D wire contract (``--disaggregation-mode``, faults with
``--pd-fault`` or ``/debug/pd_fault``; workers_stub/pd_wire.py).

SGLang: a prefill leg failing, its engine (or its whole node) killed mid-request, or its KV
bootstrap never completing -> no request hangs: each is retried on another prefill worker or ends with one error well within
its deadline; the counts are asserted (the broker's ``decisions.pd_prefill_failed`` against the
faults the stubs injected). A failing decode leg is re-sent to another decode worker.
vLLM: a P/D pair (the prefill request with ``kv_transfer_params.do_remote_decode`` and
``max_tokens: 1``, its answer's ``kv_transfer_params`` passed to the decode request) serves chat and
completions, streamed and not, through ``mesh broker --http``.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from mesh import protocol as P
from mesh.adapters.backend import EngineInfo
from mesh.adapters.cli import settings_from_args
from mesh.adapters.settings import AttachSettings
from mesh.adapters.vllm import VllmBackend
from mesh.cli import build_parser
from mesh.client import Client
from mesh.errors import ConfigError, ErrorCode, RequestError
from mesh.lab.procs import wait_for_log_event
from mesh.lab.up import wait_for_workers
from tests.adapters_support import start_attached, start_stub
from tests.conftest import run, until
from workers_stub.pd_wire import PdWire

BUCKETS = str(Path(__file__).resolve().parents[1] / "configs" / "buckets-example.toml")
ADAPTER = ["--heartbeat-ms", "200", "--health-interval-ms", "100", "--unhealthy-after", "1", "--load-poll-ms", "200"]
DEADLINE_MS = 30_000


def _fleet(procs, engine: str, prefill: dict[str, list[str]], decode: dict[str, list[str]], *, stub: tuple[str, ...] = (),
           adapter: tuple[str, ...] = (), http: bool = False):
    """Broker + one stub and one adapter per worker; returns (broker, http url or None, {name: stub record})."""
    b = procs.broker("b", "--heartbeat-ms", "200", "--bucket-config", BUCKETS, "--pd", "--policy", "round_robin",
                     "--max-attempts", "6", "--retry-budget-min", "50", *(("--http", "127.0.0.1:0") if http else ()))
    fmt = ("--event-format", "vllm") if engine == "vllm" else ()
    roles = {**{n: "prefill" for n in prefill}, **{n: "decode" for n in decode}}
    stubs = {n: procs.spawn(f"stub-{n}", ["stub-sglang", "--port", "0", "--time-scale", "0.05", "--disaggregation-mode", roles[n],
                                          *fmt, *stub, *({**prefill, **decode}[n])]) for n in roles}
    recs = {n: wait_for_log_event(p.log_path, "sglang_stub_listening", 30, p.popen, start=p.log_start) for n, p in stubs.items()}
    for n, role in roles.items():
        rec = recs[n]
        args = ["attach", engine, "--url", rec["url"], "--broker", b.backend, "--worker-id", n, "--role", role,
                "--label", "pool=short" if role == "prefill" else "stage=decode", *ADAPTER, *adapter]
        if engine == "vllm":
            args += ["--kv-endpoint", rec["kv_endpoint"], "--replay-endpoint", rec["replay_endpoint"], "--block-size", "16"]
        elif role == "prefill":
            args += ["--bootstrap-port", str(rec["port"])]  # the stub's bootstrap (KV pull) is on its HTTP port
        recs[n]["adapter"] = procs.spawn(n, args)
    run(wait_for_workers(b.frontend, len(roles)), 40)
    url = wait_for_log_event(b.log_path, "http_listening", 20, b.popen, start=b.log_start)["url"] if http else None
    for n, p in stubs.items():
        recs[n]["proc"] = p
    return b, url, recs


async def _pd_stats(http: aiohttp.ClientSession, rec: dict) -> dict:
    async with http.get(rec["url"] + "/debug/stats") as r:
        return (await r.json())["pd"]


async def _set_fault(http: aiohttp.ClientSession, rec: dict, fault: str | None) -> None:
    async with http.post(rec["url"] + "/debug/pd_fault", json={"fault": fault}) as r:
        assert r.status == 200, await r.text()


async def _requests(c: Client, n: int, seed: int, prompt_len: int = 200, max_new: int = 6) -> list[tuple[str, float, object]]:
    """``n`` concurrent requests (every other one streamed): (outcome, seconds, result or error) each."""
    rng = random.Random(seed)

    async def one(i: int):
        t0 = time.monotonic()
        try:
            ids = [rng.randrange(1, 30_000) for _ in range(prompt_len)]
            if i % 2:
                st = await c.submit(input_ids=ids, max_new_tokens=max_new, deadline_ms=DEADLINE_MS)
                got = [t async for ch in st for t in ch]
                r = await st.result()
                assert got == r.token_ids
            else:
                r = await c.generate(input_ids=ids, max_new_tokens=max_new, deadline_ms=DEADLINE_MS, stream=False)
            assert len(r.token_ids) == max_new and r.finish_reason == "length", r
            return "ok", time.monotonic() - t0, r
        except RequestError as e:
            return e.code.value, time.monotonic() - t0, e

    return await asyncio.gather(*(one(i) for i in range(n)))


def test_sglang_prefill_leg_failing_is_retried_or_ends_with_one_error(procs):
    b, _, st = _fleet(procs, "sglang", {"pre-a": ["--pd-fault", "prefill_error"], "pre-b": []}, {"dec": []})

    async def body():
        async with Client(b.frontend) as c, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            # pre-a's prefill legs fail after their handoff: each is retried with a new pair on pre-b
            out = await _requests(c, 8, 1)
            assert [o for o, _, _ in out] == ["ok"] * 8, out
            assert all(r.worker == "dec" for _, _, r in out)
            failed = (await _pd_stats(http, st["pre-a"]))["faults"]
            counters = (await c.status()).counters
            assert failed >= 1 and counters.get("decisions.pd_prefill_failed", 0) == failed, (failed, counters)
            assert counters.get("retries.worker_error", 0) >= failed  # (HTTP 500: worker_error, retried)
            # every prefill worker failing: each request ends with one error, long before its deadline
            await _set_fault(http, st["pre-b"], "prefill_error")
            out = await _requests(c, 4, 2)
            for outcome, secs, err in out:
                assert outcome not in ("ok", ErrorCode.DEADLINE_EXCEEDED.value), (outcome, err)
                assert secs < DEADLINE_MS / 1000 / 3, (secs, err)
            counters = (await c.status()).counters
            assert counters.get("decisions.pd_prefill_failed", 0) > failed
            assert sum(counters.get(f"requests.{o}", 0) for o, _, _ in out if o != "ok") >= 4

    run(body(), timeout_s=120)


@pytest.mark.parametrize("victims,counter", [
    (("proc",), "decisions.pd_prefill_failed"),  # the engine killed: its adapter tells the broker (an ERROR)
    # the engine and its adapter killed together (a node lost): no ERROR comes; the broker sees
    # the worker expire and re-pairs the requests whose decode legs wait for its KV
    (("adapter", "proc"), "decisions.pd_prefill_lost"),
], ids=["engine", "node"])
def test_sglang_prefill_killed_mid_request_is_retried(procs, victims, counter):
    # a slow prefill (0.4 s per 2,000-token prompt at time scale 0.05) keeps the legs on pre-a open
    b, _, st = _fleet(procs, "sglang", {"pre-a": ["--prefill-tokens-per-s", "250"], "pre-b": []}, {"dec": []})

    async def body():
        async with Client(b.frontend) as c, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            task = asyncio.ensure_future(_requests(c, 6, 3, prompt_len=2000))

            async def pre_a_busy() -> bool:
                return (await _pd_stats(http, st["pre-a"]))["prefill_legs"] >= 1

            await until(pre_a_busy, 20, "pre-a running prefill legs", step_s=0.02)  # then kill it
            for v in victims:
                st["pre-a"][v].signal(signal.SIGKILL)
            out = await task
            counters = (await c.status()).counters
        assert [o for o, _, _ in out] == ["ok"] * 6, out
        assert all(secs < DEADLINE_MS / 1000 / 3 for _, secs, _ in out), out
        assert counters.get(counter, 0) >= 1, counters

    run(body(), timeout_s=120)


def test_sglang_bootstrap_that_never_completes_is_bounded(procs):
    b, _, st = _fleet(procs, "sglang", {"pre-a": ["--pd-fault", "bootstrap_hang"], "pre-b": []}, {"dec": []},
                      adapter=("--bootstrap-timeout-s", "1.5"))

    async def body():
        async with Client(b.frontend) as c, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            out = await _requests(c, 6, 4)
            assert [o for o, _, _ in out] == ["ok"] * 6, out
            hung = (await _pd_stats(http, st["pre-a"]))["faults"]
            counters = (await c.status()).counters
            assert hung >= 1 and counters.get("decisions.pd_prefill_failed", 0) == hung, (hung, counters)
            # the retried ones took the bootstrap timeout once, not the deadline
            assert max(secs for _, secs, _ in out) < 1.5 * 3 + 3, out
            await _set_fault(http, st["pre-b"], "bootstrap_hang")
            out = await _requests(c, 2, 5)
            for outcome, secs, err in out:
                assert outcome == ErrorCode.WORKER_ERROR.value and "bootstrap_timeout_s" in str(err), err
                assert secs < DEADLINE_MS / 1000 / 2, (secs, err)

    run(body(), timeout_s=120)


def test_sglang_decode_leg_failing_is_resent_to_another_decode_worker(procs):
    b, _, st = _fleet(procs, "sglang", {"pre": []}, {"dec-a": ["--pd-fault", "decode_error"], "dec-b": []})

    async def body():
        async with Client(b.frontend) as c, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            out = await _requests(c, 6, 6)
            failed = (await _pd_stats(http, st["dec-a"]))["faults"]
            counters = (await c.status()).counters
        assert [o for o, _, _ in out] == ["ok"] * 6, out
        assert all(r.worker == "dec-b" for _, _, r in out)
        assert failed >= 1 and counters.get("retries.worker_error", 0) == failed, (failed, counters)
        assert counters.get("decisions.pd_prefill_failed", 0) == 0

    run(body(), timeout_s=120)


def test_vllm_pd_pair_serves_chat_and_completions(procs):
    b, url, st = _fleet(procs, "vllm", {"pre": []}, {"dec": []}, http=True)
    model = "stub-sglang-8b"

    async def body():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            for path, req in (("/v1/completions", {"prompt": "a disaggregated hello " * 8}),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello over P/D " * 8}]})):
                for stream in (False, True):
                    async with http.post(url + path, json={"model": model, "max_tokens": 5, "stream": stream, **req}) as r:
                        assert r.status == 200, await r.text()
                        if stream:
                            events = [ln[6:] for ln in (await r.read()).split(b"\n") if ln.startswith(b"data: ")]
                            assert events[-1] == b"[DONE]" and len(events) >= 3, events
                        else:
                            d = await r.json()
                            choice = d["choices"][0]
                            assert choice["finish_reason"] == "length" and d["usage"]["completion_tokens"] == 5, d
                            assert (choice.get("text") or choice.get("message", {}).get("content"))
            async with http.get(st["pre"]["url"] + "/debug/requests") as r:
                pre_reqs = [q["body"] for q in await r.json() if q["path"] == "/v1/completions"]
            async with http.get(st["dec"]["url"] + "/debug/requests") as r:
                dec_reqs = [q["body"] for q in await r.json() if q["path"] == "/v1/completions"]
            pd = await _pd_stats(http, st["pre"])
        assert len(pre_reqs) == len(dec_reqs) == 4 and pd["pulls_served"] == 4, (pre_reqs, dec_reqs, pd)
        for q in pre_reqs:  # the prefill request, as vllm-router sends it
            assert q["kv_transfer_params"]["do_remote_decode"] is True and q["max_tokens"] == 1 and q["stream"] is False, q
        for q in dec_reqs:  # the decode request carries what the prefill engine answered
            ktp = q["kv_transfer_params"]
            assert ktp["do_remote_prefill"] is True and ktp["remote_port"] == st["pre"]["port"] and ktp["remote_request_id"], ktp
            assert q["max_tokens"] == 5

    run(body(), timeout_s=120)

    async def failing_prefill():
        async with Client(b.frontend) as c, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            await _set_fault(http, st["pre"], "prefill_error")  # vLLM's prefill leg fails before any handoff
            out = await _requests(c, 2, 7)
            for outcome, secs, err in out:
                assert outcome == ErrorCode.WORKER_ERROR.value and secs < DEADLINE_MS / 1000 / 3, (outcome, secs, err)

    run(failing_prefill(), timeout_s=60)


def test_vllm_prefill_request_and_handoff_follow_vllms_contract():
    """The adapter's prefill request and the stub's answer against the fields read from vLLM's
    own code (tests/data/vllm_pd_contract.json); no processes."""
    contract = json.loads((Path(__file__).parent / "data" / "vllm_pd_contract.json").read_text())
    be = VllmBackend(AttachSettings("http://127.0.0.1:8000", ("tcp://127.0.0.1:5556",), kv_endpoint="tcp://127.0.0.1:5557",
                                    block_size=16))
    info = EngineInfo(model="m", block_size=16, dp_size=1)
    raw = P.encode_submit("r", input_ids=[1, 2, 3], params={"max_new_tokens": 9, "min_tokens": 4}, stream=True)[2]

    def request(attempt: int, bootstrap: dict) -> P.Request:
        return P.decode_broker_to_worker(P.encode_request(7, attempt, 5000, "r", raw, bootstrap))

    r = request(1, {"mode": "prefill", "room": 3, "decode_worker": "d"})
    path, body, handoff = be.prefill_leg(r, info)
    assert path == "/v1/completions" and handoff is None  # the handoff follows the engine's answer
    for k, v in contract["prefill_request"].items():
        assert body[k] == v, (k, body[k])
    assert "stream_options" not in body and "min_tokens" not in body and body["prompt"] == [1, 2, 3]

    async def answer() -> dict:
        pd = PdWire("prefill", None, 60.0, "127.0.0.1", lambda: 8000)
        return await pd.offer_vllm(3, 1)

    ktp = asyncio.run(answer())
    assert sorted(ktp) == sorted(contract["prefill_answer_kv_transfer_params"])
    assert be.prefill_handoff({"kv_transfer_params": ktp}) == {"kv_transfer_params": ktp}
    assert be.prefill_handoff({"choices": []}) is None  # an engine without a KV connector: no handoff
    dec = request(2, {"mode": "decode", "kv_transfer_params": ktp})
    assert be.request(dec, info)[1]["kv_transfer_params"] == ktp  # passed to the decode engine as answered


def test_bootstrap_timeout_is_validated_naming_the_field():
    assert AttachSettings("http://h:1", ("tcp://b:1",)).bootstrap_timeout_s == 30.0
    for bad in (0.0, -1.0, float("nan"), 1e9):
        with pytest.raises(ConfigError, match="bootstrap_timeout_s"):
            AttachSettings("http://h:1", ("tcp://b:1",), bootstrap_timeout_s=bad).validate()
    for engine in ("sglang", "vllm"):  # a flag of both adapters (vLLM's prefill request is bounded too)
        argv = ["attach", engine, "--url", "http://h:1", "--broker", "tcp://b:1", "--kv-endpoint", "tcp://h:2", "--block-size", "16"]
        assert settings_from_args(build_parser().parse_args([*argv, "--bootstrap-timeout-s", "2.5"])).bootstrap_timeout_s == 2.5
        with pytest.raises(ConfigError, match="bootstrap_timeout_s"):
            settings_from_args(build_parser().parse_args([*argv, "--bootstrap-timeout-s", "0"]))


def test_a_cancel_right_behind_its_request_leaves_nothing_in_flight(procs):
    """A P/D abort sends CANCEL right behind the decode leg's REQUEST: the adapter's task is then
    cancelled before it ever ran. It must not stay in the in-flight table (a drain used to spin on
    it until drain_timeout_s, and the process needed SIGKILL)."""
    _, rec = start_stub(procs, "stub", "--time-scale", "0.05")

    async def go():
        fb, ad = await start_attached(rec["url"], heartbeat_ms=100, drain_timeout_s=10.0)
        try:
            raw = P.encode_submit("c", input_ids=list(range(1, 40)), params={"max_new_tokens": 50}, stream=True)[2]
            for rid in (1, 2, 3):
                fb.request(rid, raw)
                fb.cancel(rid)  # in the same breath: the adapter reads both before the task runs
            await until(lambda: ad.counters["requests_cancelled"] == 3, 10, "the cancels")
            t0 = time.monotonic()
            await ad.drain_and_stop()
            assert time.monotonic() - t0 < 3.0, "the drain waited for requests that were cancelled"
            assert not fb.finals and not fb.errors
        finally:
            await fb.close()

    run(go(), timeout_s=60)
