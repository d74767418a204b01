"""Models over HTTP: ``/v1/models``, per-model routing, aliases, 404 ``model_not_found`` and
per-model tokenizers, through ``mesh broker --http`` and ``mesh gateway`` (real processes, the
official ``openai`` client, two tokenizers that ``mistral-common`` ships).

Fleet: workers of ``model-a`` (tokenised with Mistral's SentencePiece vocabulary) and of
``model-b`` (Tekken), one broker with the alias ``fast`` -> ``model-a``, a gateway in front of it.
"""

from __future__ import annotations

import os

import aiohttp
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
openai = pytest.importorskip("openai")
pytest.importorskip("tokenizers")
pytest.importorskip("mistral_common")

from mesh.lab.procs import wait_for_log_event  # noqa: E402
from mesh.tokenization import ModelTokenizer  # noqa: E402
from mesh.lab.tokenizer_builtin import build_model_dir  # noqa: E402
from mesh.lab.up import wait_for_workers  # noqa: E402
from tests.conftest import Procs, run, until  # noqa: E402

PROMPT = "Grüße aus Köln: the router keeps every prefix where its KV cache already is."


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tokenizer_cache):
    root = tmp_path_factory.mktemp("models")
    dirs = {"model-a": build_model_dir(root / "a", tokenizer="mistral_v3"), "model-b": build_model_dir(root / "b", tokenizer="tekken")}
    group = Procs(root / "logs")
    try:
        b = group.broker("b", "--heartbeat-ms", "200", "--http", "127.0.0.1:0", "--model-alias", "fast=model-a",
                         *[x for m, d in dirs.items() for x in ("--tokenizer", f"{m}={d}")])
        # the gateway and the workers start together (each process loads its tokenizers)
        g = group.spawn("gw", ["gateway", "--http", "127.0.0.1:0", "--broker", b.frontend,
                                *[x for m, d in dirs.items() for x in ("--tokenizer", f"{m}={d}")]])
        with group.together():
            for m, d in dirs.items():  # the workers tokenise as their model's engine would
                group.workers(m[-1], [b.backend], "--model", m, "--tokenizer", str(d), "--time-scale", "0.01", count=2)
        url = wait_for_log_event(b.log_path, "http_listening", 30, b.popen, start=b.log_start)["url"]
        run(wait_for_workers(b.frontend, 4), 40)
        gw = wait_for_log_event(g.log_path, "gateway_listening", 30, g.popen, start=g.log_start)["url"]
        yield {"broker": url, "gateway": gw, "dirs": dirs}
    finally:
        group.stop_all()


async def _model_ids(url: str) -> list[str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async with s.get(url + "/v1/models") as r:
            assert r.status == 200
            return [m["id"] for m in (await r.json())["data"]]


@pytest.mark.parametrize("door", ["broker", "gateway"])
def test_models_are_listed_routed_aliased_and_tokenised_per_model(fleet, door):
    url = fleet[door]
    n_tokens = {m: len(ModelTokenizer.from_dir(d).encode(PROMPT)) for m, d in fleet["dirs"].items()}
    assert n_tokens["model-a"] != n_tokens["model-b"]  # the check below can tell the tokenizers apart

    async def body():
        async def listed() -> bool:  # the gateway learns the catalog from the brokers' STATUS
            return await _model_ids(url) == ["model-a", "model-b", "fast"]
        await until(listed, 20, "/v1/models lists both models and the alias")
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)
        try:
            for name, model, prefix in (("model-a", "model-a", "a-"), ("model-b", "model-b", "b-"), ("fast", "model-a", "a-")):
                for _ in range(3):
                    raw = await client.completions.with_raw_response.create(model=name, prompt=PROMPT, max_tokens=2)
                    r = raw.parse()
                    assert raw.headers["x-mesh-worker"].startswith(prefix), (name, raw.headers["x-mesh-worker"])
                    assert r.model == name
                    assert r.usage.prompt_tokens == n_tokens[model], (name, r.usage)  # that model's own tokenizer
                chat = await client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPT}], max_tokens=2)
                assert chat.model == name and chat.usage.completion_tokens == 2
            with pytest.raises(openai.NotFoundError) as ei:
                await client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
            assert ei.value.code == "model_not_found" and "model-a" in ei.value.message
            with pytest.raises(openai.NotFoundError):  # streams too, before any output
                await client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=2, stream=True)
        finally:
            await client.close()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            for body in ({"prompt": PROMPT, "max_tokens": 2}, {"model": "mesh", "prompt": PROMPT, "max_tokens": 2}):
                async with s.post(url + "/v1/completions", json=body) as r:  # issue 32: the default model (a 2:2
                    assert r.status == 200 and r.headers["x-mesh-worker"].startswith("a-")  # tie: by name), no 400
            async with s.post(url + "/v1/completions", json={"model": 7, "prompt": PROMPT}) as r:
                assert r.status == 400 and "model" in (await r.json())["error"]["message"]
            async with s.post(url + "/generate", json={"model": "model-b", "text": PROMPT, "sampling_params": {"max_new_tokens": 2}}) as r:
                assert r.status == 200 and r.headers["x-mesh-worker"].startswith("b-")

    run(body(), 90)


def test_a_tokenizer_for_an_unknown_path_is_a_config_error_naming_the_field(tmp_path, tokenizer_cache):
    from mesh.config import check_tokenizers
    from mesh.errors import ConfigError

    d = build_model_dir(tmp_path / "m")
    check_tokenizers([f"llama={d}", str(d)], [])
    with pytest.raises(ConfigError, match="tokenizer: .*does not exist"):
        check_tokenizers([f"llama={tmp_path / 'nope'}"], [])
    with pytest.raises(ConfigError, match="tokenizer: given twice for 'llama'"):
        check_tokenizers([f"llama={d}", f"llama={d}"], [])
    with pytest.raises(ConfigError, match="chat_template: .*needs a --tokenizer .*'qwen'"):
        check_tokenizers([f"llama={d}"], [f"qwen={d / 'tokenizer_config.json'}"])
