"""Text meets the engine's cache: chat requests over HTTP, tokenised with a real model's tokenizer and
chat template (the Tekken tokenizer that ``mistral-common`` ships, under Qwen2's ChatML template: one
that keeps the system prompt first, so a conversation's turns share a prefix -- Mistral's own template
moves the system prompt to the last user turn, and no cache can reuse turn 1 for turn 2) land as
cache hits on the worker whose KV events hold that tokenised prompt.

The engines are ``mesh stub-sglang --tokenizer DIR``: like SGLang they tokenise text themselves and
publish KV events with the model's token ids; with ``--tokenizer`` the broker keys requests by the same
ids and routes every follow-up turn to the engine holding the conversation, where it is a cache hit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
pytest.importorskip("mistral_common")
pytest.importorskip("transformers")

from mesh.lab.procs import wait_for_log_event  # noqa: E402
from mesh.lab.tokenizer_builtin import build_model_dir  # noqa: E402
from mesh.lab.up import wait_for_workers  # noqa: E402
from tests.conftest import run, until  # noqa: E402
from tests.tokenizer_support import MODEL_ID, SYSTEM, TEMPLATE, build_hub_cache, conversations, kv_batches_at_least  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_cache) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("chatml"), chat_template=TEMPLATE.read_text(),
                           extra_special_tokens=["<|im_start|>", "<|im_end|>"], tokenizer="tekken")


def _fleet(procs, model_dir: Path, *, broker_tokenizer: bool, via_gateway: bool = False, away: Path | None = None):
    """``away``: a Hugging Face cache (HF_HOME) holding the model, seen only by the engines (started with
    ``--model-path``): the tokenizer they announce is not on the broker's host."""
    extra = ("--tokenizer", str(model_dir)) if broker_tokenizer else ()
    stub_tok = ("--tokenizer", str(model_dir))
    if away is not None:
        (away.parent / "empty-hub").mkdir(exist_ok=True)
        procs.env.update({"HF_HUB_CACHE": str(away.parent / "empty-hub"), "HF_HUB_OFFLINE": "1"})
        stub_tok = ("--model-path", MODEL_ID)
    # greedy: always the longest match, so the test sees the index, not cache_aware's load balancing
    # (which may, rightly, send a request away from a busy holder: a load_override)
    if via_gateway:  # the HTTP API and the tokenizer in `mesh gateway`, the broker without HTTP
        b = procs.broker("b", "--policy", "cache_aware_greedy")
        door, ready = procs.spawn("gw", ["gateway", "--broker", b.frontend, "--http", "127.0.0.1:0", *extra]), "gateway_listening"
    else:
        b = procs.broker("b", "--http", "127.0.0.1:0", "--policy", "cache_aware_greedy", *extra)
        door, ready = b, "http_listening"
    # the two engines start while the HTTP door comes up (each process loads the model's tokenizer)
    if away is not None:
        procs.env["HF_HUB_CACHE"] = str(away / "hub")
    stubs = [procs.spawn(f"stub{i}", ["stub-sglang", "--port", "0", "--time-scale", "0.001", *stub_tok]) for i in range(2)]
    url = wait_for_log_event(door.log_path, ready, 30, door.popen, start=door.log_start)["url"]
    engines = [wait_for_log_event(p.log_path, "sglang_stub_listening", 30, p.popen, start=p.log_start)["url"] for p in stubs]
    for i, e in enumerate(engines):
        procs.spawn(f"a{i}", ["attach", "sglang", "--url", e, "--broker", b.backend, "--worker-id", f"a{i}"])
    run(wait_for_workers(b.frontend, 2), 40)
    return url, b.frontend, engines


@pytest.mark.parametrize("via_gateway", [False, True], ids=["broker_http", "gateway"])
def test_chat_over_http_lands_on_the_cache_holder_with_the_models_tokenizer(procs, model_dir, via_gateway):
    url, frontend, engines = _fleet(procs, model_dir, broker_tokenizer=True, via_gateway=via_gateway)
    turns, hits = run(conversations(url, frontend, engines), 90)
    print(f"turns {turns} cache-hit decisions {hits}")
    assert all(holder == w for holder, w, _ in turns), turns  # every follow-up went to the holder
    assert all(cached > 150 for _, _, cached in turns), turns  # and the engine had the prefix cached
    assert hits == len(turns)


def test_control_without_the_tokenizer_text_never_meets_the_engines_cache(procs, model_dir, tmp_path):
    """What issue 14 found: keyed by bytes, the broker cannot match the engines' token-id events. (Since
    issue 30 a broker loads the tokenizer the engines announce: here it is not on the broker's host.)"""
    away = build_hub_cache(tmp_path / "engines-hf", MODEL_ID, model_dir)
    url, frontend, engines = _fleet(procs, model_dir, broker_tokenizer=False, away=away)
    turns, hits = run(conversations(url, frontend, engines), 90)
    assert hits == 0, turns


def test_simulated_workers_with_the_tokenizer_publish_the_models_token_ids(procs, model_dir):
    """``mesh worker-stub --tokenizer``: a text prompt is tokenised as a real engine would, so a later
    request carrying the model's token ids for it (tokenised by a client) is a cache hit on that
    worker, found through its KV events alone (the text request's own speculative entries are
    byte keys and cannot match)."""
    from mesh.client import Client
    from mesh.tokenization import ModelTokenizer

    b = procs.broker("b", "--policy", "cache_aware_greedy")
    procs.workers("w", [b.backend], "--tokenizer", str(model_dir), "--time-scale", "0.001", count=2)
    run(wait_for_workers(b.frontend, 2), 40)
    tok = ModelTokenizer.from_dir(model_dir)
    text = SYSTEM + " Where is order 77?"

    async def body():
        async with Client(b.frontend) as c:
            batches0 = (await c.status()).counters.get("kv.batches", 0)
            first = await c.generate(text=text, max_new_tokens=2, deadline_ms=10_000)
            await until(lambda: kv_batches_at_least(c, batches0 + 1), 10, "the worker's KV events at the broker",
                        step_s=0.02)
            second = await c.generate(input_ids=tok.encode(text), max_new_tokens=2, deadline_ms=10_000)
            return first, second

    first, second = run(body(), 60)
    assert second.worker == first.worker and second.usage["cached_tokens"] > 100, (first, second)
