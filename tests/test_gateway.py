"""``mesh gateway``: the HTTP API in its own process, submitting to brokers over the client protocol
(real processes: brokers, adapters, ``mesh stub-sglang`` engines, the official ``openai`` client)."""

from __future__ import annotations

import signal

import aiohttp
import pytest

from mesh.lab.procs import ProcGroup, wait_for_log_event
from mesh.lab.up import wait_for_workers
from tests.conftest import run, until


def _gateway(procs: ProcGroup, brokers: list[str], *extra: str) -> str:
    args = ["gateway", "--http", "127.0.0.1:0", *extra]
    for b in brokers:
        args += ["--broker", b]
    p = procs.spawn("gw", args)
    return wait_for_log_event(p.log_path, "gateway_listening", 30, p.popen, start=p.log_start)["url"]


def _fleet(procs: ProcGroup, n_brokers: int = 2):
    stubs = [procs.spawn(f"stub{i}", ["stub-sglang", "--port", "0", "--time-scale", "0.001"]) for i in range(2)]  # start alongside
    brokers = [procs.broker(f"b{i}", "--policy", "round_robin") for i in range(n_brokers)]
    for i, p in enumerate(stubs):
        e = wait_for_log_event(p.log_path, "sglang_stub_listening", 30, p.popen, start=p.log_start)["url"]
        args = ["attach", "sglang", "--url", e, "--worker-id", f"a{i}"]
        for b in brokers:
            args += ["--broker", b.backend]
        procs.spawn(f"a{i}", args)
    for b in brokers:
        run(wait_for_workers(b.frontend, 2), 40)
    return brokers


def test_the_openai_client_through_the_gateway_and_a_broker_dying_under_it(procs):
    openai = pytest.importorskip("openai")
    brokers = _fleet(procs)
    url = _gateway(procs, [b.frontend for b in brokers])

    async def body() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async def healthy() -> bool:
                async with s.get(url + "/health") as r:
                    return r.status == 200 and (await r.json())["workers"] == 2
            await until(healthy, 20, "the gateway sees the workers")
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)
        r = await client.chat.completions.create(model="mesh", messages=[{"role": "user", "content": "hello"}], max_tokens=5)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
        stream = await client.completions.create(model="mesh", prompt="once upon a time", max_tokens=6, stream=True)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        assert text.strip()
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="mesh", prompt="x", max_tokens=2, n=3)
        # the gateway's own latency histograms, by model and worker, for what it relayed
        from prometheus_client.parser import text_string_to_metric_families

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.get(url + "/metrics") as resp:
                fams = {f.name: f.samples for f in text_string_to_metric_families(await resp.text())}
        for name in ("mesh_ttft_seconds", "mesh_e2e_seconds"):
            counts = {x.labels["worker"]: x.value for x in fams[name] if x.name == name + "_count"}
            assert sum(counts.values()) == 2 and set(counts) <= {"a0", "a1"}, (name, counts)
        assert sum(x.value for x in fams["mesh_inter_token_seconds"] if x.name.endswith("_count")) >= 1
        assert "mesh_tokenizer_prefix_cache_hits" in fams  # registered (no tokenizer here: no samples)

        brokers[0].signal(signal.SIGKILL)  # one broker dies: the gateway keeps serving through the other
        ok = 0
        for i in range(20):
            try:
                await client.completions.create(model="mesh", prompt=f"request {i}", max_tokens=3)
                ok += 1
            except openai.APIStatusError as exc:  # only what was in flight on the dead broker may fail
                assert exc.status_code == 503, exc
        assert ok >= 18, ok
        await client.close()

    run(body(), 120)


def test_a_gateway_with_no_reachable_broker_answers_503_not_a_hang(procs):
    url = _gateway(procs, ["tcp://127.0.0.1:9"])  # nothing listens there

    async def body() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.get(url + "/health") as r:
                assert r.status == 503
            async with s.get(url + "/readyz") as r:
                assert r.status == 503
            async with s.post(url + "/v1/completions", json={"model": "mesh", "prompt": "x", "max_tokens": 2}) as r:
                body = await r.json()
                assert r.status == 503 and body["error"]["code"] == "unavailable", body

    run(body(), 30)
