"""mesh.tokenization against transformers' own apply_chat_template, with a real shipped tokenizer.

The tokenizer is Mistral-7B-Instruct-v0.3's SentencePiece model as ``mistral-common`` ships it, converted
to ``tokenizer.json`` by ``transformers`` (``mesh.lab.tokenizer_builtin``); no hub download anywhere
(HF_HUB_OFFLINE=1). Chat templates of four public models are test data in tests/data/chat_templates/.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
pytest.importorskip("mistral_common")
transformers = pytest.importorskip("transformers")

from mesh.errors import ConfigError, RetryableError  # noqa: E402
from tests.conftest import until  # noqa: E402
from mesh.tokenization import (  # noqa: E402
    ContentFormat,
    ModelTokenizer,
    TokenizerBusy,
    TokenizerPool,
    load_model_dir,
)
from mesh.lab.tokenizer_builtin import build_model_dir, shipped_spm_path  # noqa: E402

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# name -> (template file, extra control tokens, where the template is written, shipped tokenizer). The two
# Mistral models are exactly the shipped tokenizer with its own template; the others put a real template over
# the v3 (SentencePiece) or Tekken (byte-level BPE) vocabulary with the template's control tokens added.
MODELS = {
    "mistral_v3": ("mistral_v3.jinja", [], "tokenizer_config", "mistral_v3"),
    "mistral_nemo": ("mistral_v3_tekken.jinja", [], "tokenizer_config", "tekken"),
    "qwen2_chatml": ("qwen2_chatml.jinja", CHATML_TOKENS, "jinja", "tekken"),
    "llama3": ("llama3.jinja", LLAMA3_TOKENS, "tokenizer_config", "tekken"),
    "qwen2_vl": ("qwen2_vl.jinja", CHATML_TOKENS + ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"], "json",
                 "mistral_v3"),
}


def _load_hf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@pytest.fixture(scope="module")
def base_cache(tokenizer_cache) -> Path:
    # the session's converted base tokenizers (tests/conftest.py): the conversion is the same code whichever
    # process runs it, and each model dir below is still built (added tokens, template) and loaded afresh
    return tokenizer_cache


@pytest.fixture(scope="module")
def models(tmp_path_factory, base_cache) -> dict[str, tuple[ModelTokenizer, object]]:
    out = {}
    for name, (tpl_file, extra, where, kind) in MODELS.items():
        d = build_model_dir(tmp_path_factory.mktemp(name), chat_template=(TEMPLATES / tpl_file).read_text(),
                            extra_special_tokens=extra, cache_dir=base_cache, write_template=where, tokenizer=kind)
        if name == "llama3":  # Llama-3's bos is its own control token
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            cfg["bos_token"] = "<|begin_of_text|>"
            (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        out[name] = (ModelTokenizer.from_dir(d), _load_hf(d))
    return out


def _hf_chat(hf, messages, add_generation_prompt, template=None):
    # AutoTokenizer does not read chat_template.json (only the processor does): give it that template
    kw = {} if hf.chat_template is not None else {"chat_template": template}
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                 return_dict=False, **kw)
    return text, list(ids)


def _flatten(messages):
    """What a string-only template gets for content parts (our documented choice, vLLM's: "\\n"-joined)."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        out.append(m)
    return out


SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "  Hello! How can I help?  "},
        {"role": "user", "content": "Tell me a joke."},
    ],
    "system_multi_turn": [
        SYSTEM,
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one."},
    ],
    "unicode": [{"role": "user", "content": "Grüße aus Köln 👋 — 日本語のテキスト, emoji 🚀 and tabs\tand\nnewlines"}],
    "parts": [
        SYSTEM,
        {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part ✓"}]},
    ],
    "parts_multi_turn": [
        {"role": "user", "content": [{"type": "text", "text": "Summarise:"}, {"type": "text", "text": "a b c"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "abc"}]},
        {"role": "user", "content": "Thanks"},
    ],
    "none_fields": [{"role": "user", "content": "hi", "name": None, "tool_calls": None}],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("model", list(MODELS))
def test_matches_transformers_apply_chat_template(models, model, conv, add_generation_prompt):
    ours, hf = models[model]
    messages = CONVERSATIONS[conv]
    if ours.chat_template.content_format == ContentFormat.STRING:
        reference = _flatten(messages)
    else:
        reference = messages  # the template reads the parts itself: transformers passes them unchanged
    want_text, want_ids = _hf_chat(hf, reference, add_generation_prompt, ours.files.chat_template)
    text, ids = ours.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert text == want_text
    assert ids == want_ids
    # the template wrote BOS (where it has one) exactly once: encoded without special tokens
    bos = ours.files.token_id(ours.files.bos_token)
    if bos is not None and want_text.startswith(ours.files.bos_token):
        assert ids[0] == bos and ids.count(bos) == 1


def test_content_format_detection(models):
    formats = {name: m.chat_template.content_format for name, (m, _) in models.items()}
    assert formats == {"mistral_v3": "string", "mistral_nemo": "string", "qwen2_chatml": "string", "llama3": "string",
                       "qwen2_vl": "openai"}


def test_template_sources_and_special_tokens(models):
    m, _ = models["mistral_v3"]
    assert m.files.chat_template_source.endswith("tokenizer_config.json: field 'chat_template'")
    assert m.files.bos_token == "<s>" and m.files.eos_token == "</s>" and m.files.add_bos_token is True
    assert models["qwen2_chatml"][0].files.chat_template_source.endswith("chat_template.jinja")
    assert models["qwen2_vl"][0].files.chat_template_source.endswith("chat_template.json: field 'chat_template'")
    assert models["llama3"][0].files.bos_token == "<|begin_of_text|>"


def test_plain_encode_matches_transformers_and_sentencepiece(models):
    """Completions prompts: add_special_tokens=True adds BOS as the model's tokenizer.json says; the converted
    tokenizer.json encodes as the shipped SentencePiece model does."""
    import sentencepiece

    ours, hf = models["mistral_v3"]
    sp = sentencepiece.SentencePieceProcessor(model_file=str(shipped_spm_path()))
    for text in ["Hello world", "  leading spaces", "Grüße 👋 日本語", "line\nbreak\ttab", "x" * 500]:
        assert ours.encode(text) == hf.encode(text)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        if not text.startswith("  "):  # HF's Llama conversion splits leading runs of spaces differently from
            # SentencePiece itself; engines serve the tokenizer.json, so HF is the reference that matters
            assert ours.encode(text) == [sp.bos_id()] + sp.encode(text)


def _special(tk, token: str) -> int:
    return (tk.get_special_token if hasattr(tk, "get_special_token") else tk.get_control_token)(token)


def test_tekken_encodes_as_mistral_common_does(models):
    """The converted Tekken tokenizer.json gives the ids mistral-common's own Tekkenizer gives."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    from mesh.lab.tokenizer_builtin import SHIPPED_TEKKEN, shipped_file

    ours, hf = models["mistral_nemo"]
    tk = Tekkenizer.from_file(str(shipped_file(SHIPPED_TEKKEN)))
    for text in ["Hello world", "  leading spaces", "Grüße 👋 日本語", "line\nbreak\ttab", "def f(x):\n    return x"]:
        assert ours.encode(text, add_special_tokens=False) == tk.encode(text, bos=False, eos=False)
        assert ours.encode(text) == hf.encode(text) == tk.encode(text, bos=True, eos=False)
    text, ids = ours.render_chat([{"role": "user", "content": "Hi"}])
    assert text == "<s>[INST]Hi[/INST]"
    assert ids == [tk.bos_id, _special(tk, "[INST]")] + tk.encode("Hi", bos=False, eos=False) + [
        _special(tk, "[/INST]")]


def test_control_tokens_in_template_are_single_ids(models):
    ours, _ = models["qwen2_chatml"]
    _, ids = ours.render_chat([{"role": "user", "content": "hi"}])
    start = ours.files.token_id("<|im_start|>")
    assert start is not None and ids.count(start) == 3  # system, user, assistant header


def test_non_text_part_is_refused_with_its_index(models):
    ours, _ = models["qwen2_vl"]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\].*'image_url'"):
        ours.render_chat(msgs)
    string_model, _ = models["mistral_v3"]
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[0\]"):
        string_model.render_chat([SYSTEM, {"role": "user", "content": [{"type": "input_audio"}]}])


def test_template_errors_become_value_errors(models):
    ours, _ = models["mistral_v3"]
    with pytest.raises(ValueError, match="must alternate"):
        ours.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="must not be empty"):
        ours.render_chat([])
    with pytest.raises(ValueError, match=r"messages\[0\]: 'role'"):
        ours.render_chat([{"content": "x"}])


def test_environment_matches_transformers_helpers(tmp_path, base_cache):
    """tojson (no HTML escaping, indent, non-ASCII kept), strftime_now, loop controls, namespace, dict."""
    tpl = ("{%- for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
           "{{ m | tojson }}|{{ {'k': '<&>é'} | tojson(indent=2) }}|{% endfor %}"
           "{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{{ dict(a=1) | tojson }}"
           "{{ strftime_now('%Y') | length }}")
    d = build_model_dir(tmp_path / "m", chat_template=tpl, cache_dir=base_cache)
    ours, hf = ModelTokenizer.from_dir(d), _load_hf(d)
    msgs = [{"role": "user", "content": "<b>'x'</b> ü"}, {"role": "assistant", "content": "y"},
            {"role": "user", "content": "never"}]
    text, _ = ours.render_chat(msgs)
    assert text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "never" not in text and "<b>'x'</b> ü" in text


def test_named_templates_list_picks_default(tmp_path, base_cache):
    d = build_model_dir(tmp_path / "m", cache_dir=base_cache)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                            {"name": "default", "template": "{{ messages[0]['content'] }}!"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = ModelTokenizer.from_dir(d)
    assert ours.render_chat([{"role": "user", "content": "hey"}])[0] == "hey!"
    assert _load_hf(d).apply_chat_template([{"role": "user", "content": "hey"}], tokenize=False) == "hey!"


def test_chat_template_file_wins(tmp_path, base_cache):
    d = build_model_dir(tmp_path / "m", chat_template="CONFIG", cache_dir=base_cache)
    (d / "chat_template.jinja").write_text("JINJA")
    assert load_model_dir(d).chat_template == "JINJA"
    f = tmp_path / "explicit.jinja"
    f.write_text("{{ 'EXPLICIT' }}")
    assert load_model_dir(d, chat_template_file=f).chat_template == "{{ 'EXPLICIT' }}"
    j = tmp_path / "explicit.json"
    j.write_text(json.dumps({"chat_template": "FROM_JSON"}))
    assert load_model_dir(d, chat_template_file=j).chat_template == "FROM_JSON"


def test_no_template_means_encode_only(tmp_path, base_cache):
    d = build_model_dir(tmp_path / "m", cache_dir=base_cache)
    ours = ModelTokenizer.from_dir(d)
    assert ours.files.chat_template is None and ours.encode("hi")[0] == 1
    with pytest.raises(ValueError, match="no chat template"):
        ours.render_chat([{"role": "user", "content": "hi"}])


def test_post_processor_from_add_bos_token_when_tokenizer_json_has_none(tmp_path, base_cache):
    d = build_model_dir(tmp_path / "m", cache_dir=base_cache)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(tj))
    files = load_model_dir(d)
    assert files.tokenizer.encode("hi").ids[0] == 1
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_model_dir(d).tokenizer.encode("hi").ids[0] != 1


def test_special_tokens_missing_from_the_vocabulary_are_added_as_transformers_adds_them(tmp_path, base_cache):
    d = build_model_dir(tmp_path / "m", cache_dir=base_cache,
                        chat_template="{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(eos_token="<|my_eos|>", pad_token="<|my_pad|>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = ModelTokenizer.from_dir(d), _load_hf(d)
    msgs = [{"role": "user", "content": "hi"}]
    text, ids = ours.render_chat(msgs)
    assert text.endswith("<|my_eos|>") and ids[-1] == ours.files.token_id("<|my_eos|>") == hf.eos_token_id
    assert ours.files.token_id("<|my_pad|>") == hf.pad_token_id
    assert ids == list(hf.apply_chat_template(msgs, tokenize=True, return_dict=False, add_generation_prompt=True))


# ---- bad files: ConfigError naming the file and the field ------------------------------------------------

def _good_dir(tmp_path, base_cache) -> Path:
    return build_model_dir(tmp_path / "m", chat_template="{{ messages[0]['content'] }}", cache_dir=base_cache)


def _edit_cfg(d: Path, **fields) -> None:
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(fields)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fields, match", [
    ({"bos_token": 5}, r"tokenizer_config\.json: field 'bos_token'"),
    ({"eos_token": {"id": 3}}, r"field 'eos_token': must be a string, null or an object with a string 'content'"),
    ({"add_bos_token": "yes"}, r"field 'add_bos_token': must be true or false"),
    ({"chat_template": 42}, r"field 'chat_template': must be a string or a list"),
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, r"field 'chat_template': .*no 'default'"),
    ({"chat_template": [{"name": "default"}]}, r"field 'chat_template'\[0\]"),
    ({"chat_template": "{% for %}"}, r"tokenizer_config\.json: field 'chat_template': not a valid Jinja template"),
    ({"chat_template": "   "}, r"field 'chat_template': the chat template is empty"),
    ({"additional_special_tokens": "x"}, r"field 'additional_special_tokens'"),
])
def test_bad_tokenizer_config_fields(tmp_path, base_cache, fields, match):
    d = _good_dir(tmp_path, base_cache)
    _edit_cfg(d, **fields)
    with pytest.raises(ConfigError, match=match):
        ModelTokenizer.from_dir(d)


def test_bad_files(tmp_path, base_cache):
    with pytest.raises(ConfigError, match="no such directory"):
        load_model_dir(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"tokenizer\.json: no such file"):
        load_model_dir(empty)
    d = _good_dir(tmp_path, base_cache)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: not valid JSON \(line 1"):
        load_model_dir(d)
    (d / "tokenizer_config.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: must be a JSON object"):
        load_model_dir(d)
    (d / "tokenizer_config.json").write_text("{}")
    (d / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ConfigError, match=r"tokenizer\.json: not a valid tokenizer\.json"):
        load_model_dir(d)
    d2 = _good_dir(tmp_path / "b", base_cache)
    _edit_cfg(d2, chat_template=None)
    (d2 / "chat_template.json").write_text(json.dumps({"template": "x"}))
    with pytest.raises(ConfigError, match=r"chat_template\.json: field 'chat_template' is missing"):
        load_model_dir(d2)
    with pytest.raises(ConfigError, match=r"--chat-template: .*nope\.jinja: no such file"):
        load_model_dir(d2, chat_template_file=tmp_path / "nope.jinja")


# ---- the pool: off the loop, bounded ---------------------------------------------------------------------

def test_pool_matches_blocking_calls(models):
    ours, _ = models["mistral_v3"]
    msgs = CONVERSATIONS["system_multi_turn"]

    async def main():
        with TokenizerPool(ours, workers=2, max_queued=8) as pool:
            ids = await asyncio.wait_for(pool.encode("Hello world"), 10)
            chat = await asyncio.wait_for(pool.render_chat(msgs, add_generation_prompt=True), 10)
            with pytest.raises(ValueError, match="must alternate"):
                await asyncio.wait_for(pool.render_chat([msgs[1], msgs[1]]), 10)
            return ids, chat

    ids, chat = asyncio.run(main())
    assert ids == ours.encode("Hello world")
    assert chat == ours.render_chat(msgs, add_generation_prompt=True)


def test_pool_keeps_the_loop_ticking_during_a_200k_token_encode(models):
    ours, _ = models["mistral_v3"]
    text = "The quick brown fox jumps over the lazy dog; ünïcödé 日本語. " * 12000  # ~250k tokens

    async def main():
        pool = TokenizerPool(ours, workers=1)
        ticks, gaps, done = 0, [], asyncio.Event()
        loop_thread = threading.get_ident()
        seen_threads = []
        orig = ours.files.tokenizer

        async def ticker():
            nonlocal ticks
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.002)  # the probe: a tick every 2 ms measures how long the loop is blocked
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                ticks += 1

        class Spy:  # records the thread the encode runs in
            def __getattr__(self, name):
                return getattr(orig, name)

            def encode_batch(self, *a, **kw):
                seen_threads.append(threading.get_ident())
                return orig.encode_batch(*a, **kw)

            def encode_batch_fast(self, *a, **kw):  # what the pool calls where tokenizers has it
                seen_threads.append(threading.get_ident())
                return orig.encode_batch_fast(*a, **kw)

        object.__setattr__(ours.files, "tokenizer", Spy())
        try:
            t = asyncio.create_task(ticker())
            t0 = time.perf_counter()
            ids = await asyncio.wait_for(pool.encode(text), 60)
            elapsed = time.perf_counter() - t0
            done.set()
            await t
        finally:
            object.__setattr__(ours.files, "tokenizer", orig)
            pool.close()
        return ids, elapsed, ticks, gaps, seen_threads, loop_thread

    ids, elapsed, ticks, gaps, seen, loop_thread = asyncio.run(main())
    assert len(ids) > 200_000
    assert seen and all(t != loop_thread for t in seen)
    # the loop ran its 2 ms ticker all along: at least a quarter of the ideal count, no gap near the encode time
    assert ticks >= max(5, int(elapsed / 0.002 / 4)), (ticks, elapsed)
    assert max(gaps) < max(0.1, elapsed / 3), (max(gaps), elapsed)


def test_pool_refuses_past_its_queue_bound(models):
    ours, _ = models["mistral_v3"]
    gate = threading.Event()
    orig = ours.encode

    def slow_encode(text, add_special_tokens=True):
        gate.wait(10)
        return orig(text, add_special_tokens)

    async def main():
        pool = TokenizerPool(ours, workers=1, max_queued=2)
        pool.tokenizer = type("T", (), {"encode": staticmethod(slow_encode)})()
        jobs = [asyncio.ensure_future(pool.encode(f"job {i}")) for i in range(3)]  # 1 running + 2 waiting
        await until(lambda: pool.admitted == 3, 5, "three jobs admitted")
        with pytest.raises(TokenizerBusy, match=r"2 jobs waiting \(limit 2\)") as info:
            await pool.encode("one too many")
        assert isinstance(info.value, RetryableError) and info.value.code.value == "overloaded"
        jobs[2].cancel()  # a cancelled waiting job frees its slot
        await until(lambda: pool.admitted == 2, 5, "the cancelled job's slot freed")
        gate.set()
        res = await asyncio.wait_for(asyncio.gather(*jobs[:2]), 10)
        await until(lambda: pool.admitted == 0, 5, "every slot freed")
        pool.close()
        pool.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            await pool.encode("after close")
        return res

    res = asyncio.run(main())
    assert res == [orig("job 0"), orig("job 1")]


# ---- the benchmark ---------------------------------------------------------------------------------------

def test_make_prompt_hits_the_token_count(models):
    from mesh.lab.bench.tokenizer_bench import make_prompt

    ours, _ = models["mistral_v3"]
    for n in (1, 100, 1024):
        assert len(ours.encode(make_prompt(ours.files.tokenizer, n), add_special_tokens=False)) == n


def test_bench_tokenizer_cli_runs_on_the_builtin_tokenizer(tmp_path, capsys):
    from mesh.cli import main

    out = tmp_path / "tok.json"
    assert main(["bench", "tokenizer", "--builtin", "--sizes", "64,256", "--iters", "5", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    arms = {(a["size"], a["arm"]) for a in res["arms"]}
    assert arms == {(64, "encode"), (64, "render+encode"), (256, "encode"), (256, "render+encode")}
    assert all(a["tokens_per_s"] > 0 and a["p99_ms"] >= a["p50_ms"] > 0 for a in res["arms"])
    assert "render+encode" in capsys.readouterr().out


def test_bench_tokenizer_needs_a_source():
    from mesh.cli import main

    assert main(["bench", "tokenizer"]) == 2  # ConfigError: give --model-dir DIR or --builtin


def test_text_part_separator_is_a_parameter(models, tmp_path):
    ours, _ = models["qwen2_chatml"]
    sglang_style = ModelTokenizer(ours.files, text_part_separator=" ")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "<|im_start|>user\na\nb<|im_end|>" in ours.render_chat(parts)[0]  # vLLM's join
    assert "<|im_start|>user\na b<|im_end|>" in sglang_style.render_chat(parts)[0]  # SGLang's join


def test_transformers_does_not_flatten_parts_for_string_templates(models):
    """Why we flatten: transformers hands the list to a string-only template, which fails or prints a repr."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    for name in ("mistral_v3", "qwen2_chatml"):  # "[INST] " + content
        with pytest.raises(TypeError, match="concatenate"):
            models[name][1].apply_chat_template(parts, tokenize=False, add_generation_prompt=True)
    text = models["llama3"][1].apply_chat_template(parts, tokenize=False)  # content | trim: the list's repr
    assert "[{'type': 'text', 'text': 'hello'}]" in text
    assert "\n\nhello<|eot_id|>" in models["llama3"][0].render_chat(parts)[0]


@pytest.mark.parametrize("template, expected", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m['content'][1:] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m['content'] | list %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
])
def test_content_format_detection_patterns(template, expected):
    from mesh.tokenization import ChatTemplate

    assert ChatTemplate(template).content_format == expected


def test_encode_refuses_more_tokens_than_asked_before_listing_the_ids(models):
    from mesh.tokenization import TooManyTokens

    ours, _ = models["mistral_v3"]
    text = "seven " * 1000
    n = len(ours.encode(text))
    assert ours.encode(text, max_tokens=n) == ours.encode(text)  # at the limit: the same ids
    with pytest.raises(TooManyTokens) as info:
        ours.encode(text, max_tokens=n - 1)
    assert (info.value.tokens, info.value.limit) == (n, n - 1) and isinstance(info.value, ValueError)

    async def main():
        with TokenizerPool(ours, workers=1) as pool:
            with pytest.raises(TooManyTokens):
                await asyncio.wait_for(pool.encode(text, max_tokens=10), 10)
            return await asyncio.wait_for(pool.encode(text, max_tokens=n), 10)

    assert asyncio.run(main()) == ours.encode(text)


# the bench's chat workload (mesh bench http --path /v1/chat/completions --tokenizer builtin); here, not in
# test_bench_chat_workload.py, so that the suite reaches it after the session's tokenizer conversion finished
def test_the_chat_workload_hits_the_prefix_cache_through_the_builtin_tokenizer(tmp_path, tokenizer_cache):
    """``--tokenizer builtin`` used to have no chat template: the gateway then sent chat as plain text and
    encoded it whole, and its prefix cache never ran. Through the bench's own model folder and bodies, every
    request after the first reuses cached ids, and the ids are those of a full encode."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from mesh.lab.bench.chat_workload import mark_pass
    from mesh.lab.bench.http_bench import builtin_tokenizer, workload
    from mesh.tokenization import ModelTokenizer

    folder = builtin_tokenizer(tmp_path / "model")
    bodies, info = workload("/v1/chat/completions", folder, 200, stream=False, max_new_tokens=8, shape=(6, 3))
    assert info["workload"] == "conversations" and info["bodies"] == 18 and 180 <= info["prompt_tokens_mean"] <= 260
    tok = ModelTokenizer.from_dir(folder)
    plain = ModelTokenizer(tok.files, prefix_cache_bytes=0)
    assert tok.prefix is not None and tok.prefix.available
    total = 0
    for i in range(2 * len(bodies)):  # two passes: fresh conversations, the same system prompt
        msgs = json.loads(mark_pass(bodies[i % len(bodies)], i // len(bodies)))["messages"]
        text, ids = tok.render_chat(msgs)
        assert (text, ids) == plain.render_chat(msgs)
        total += len(ids)
    c = tok.prefix.cache
    assert c.misses == 1 and c.hits == 2 * len(bodies) - 1, (c.hits, c.misses)
    assert c.tokens_reused > 0.5 * total, (c.tokens_reused, total)  # the system prompt and every earlier turn
