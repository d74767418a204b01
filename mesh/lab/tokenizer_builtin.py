"""A real model's tokenizer that a PyPI package ships, as a model folder: for tests and ``--builtin`` benches.

``mistral-common`` ships Mistral's tokenizers as package data; ``mistral_instruct_tokenizer_240323.model.v3``
is the SentencePiece model of Mistral-7B-Instruct-v0.3 (32,768 pieces, [INST] / [/INST] / tool control
tokens). ``transformers`` converts it to a ``tokenizer.json`` (its ``LlamaTokenizer`` reading a local
``tokenizer.model``, offline), and this module gives it the post-processor the published model's
``tokenizer.json`` has (``<s> $A``, so plain encodes add BOS) and a ``tokenizer_config.json`` with its
special tokens. Extra control tokens (``<|im_start|>``...) can be added as special tokens, to stand in for a
model whose vocabulary declares them (a ChatML or Llama-3 template over this vocabulary).

``tokenizer="tekken"`` gives instead ``tekken_240718.json``, the Tekken (tiktoken-style byte-level BPE,
131,072 tokens) tokenizer of Mistral-Nemo-Instruct-2407, converted by ``transformers``' ``MistralConverter``.

Needs ``mistral-common`` and ``transformers`` (the ``dev`` extra); never touches the network.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from mesh.errors import ConfigError

__all__ = ["TOKENIZER_CACHE_ENV", "SHIPPED_SPM", "SHIPPED_TEKKEN", "shipped_file", "shipped_spm_path", "build_model_dir",
           "MISTRAL_V3_TEMPLATE"]

#: A folder that keeps the converted base tokenizer.json files between build_model_dir calls
#: (one conversion per kind per test session instead of one per call; 2-3 s each).
TOKENIZER_CACHE_ENV = "MESH_TOKENIZER_CACHE"
SHIPPED_SPM = "mistral_instruct_tokenizer_240323.model.v3"
SHIPPED_TEKKEN = "tekken_240718.json"

# Mistral-7B-Instruct-v0.3's chat template (mistralai's "v3" template), as its tokenizer_config.json has it;
# tests/data/chat_templates/mistral_v3.jinja holds the same text.
MISTRAL_V3_TEMPLATE = r'''{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
'''


def shipped_file(name: str) -> Path:
    try:
        import mistral_common
    except ImportError as exc:
        raise ConfigError("--builtin: needs the 'mistral-common' package (pip install 'mesh-router[dev]')") from exc
    p = Path(mistral_common.__file__).parent / "data" / name
    if not p.is_file():
        raise ConfigError(f"--builtin: {p}: not found in this mistral-common install")
    return p


def shipped_spm_path() -> Path:
    return shipped_file(SHIPPED_SPM)


def _convert_tekken(tekken: Path, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers.integrations.mistral.tokenizer import MistralConverter
    except ImportError as exc:
        raise ConfigError("--builtin: needs 'transformers' >= 5 to convert the Tekken tokenizer") from exc
    MistralConverter(str(tekken)).converted().save(str(out))


def _convert(spm: Path, out: Path) -> None:
    """SentencePiece model -> tokenizer.json, with transformers' converter (local files only)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import LlamaTokenizer
    except ImportError as exc:
        raise ConfigError("--builtin: needs the 'transformers' package to convert the SentencePiece model") from exc
    with tempfile.TemporaryDirectory(prefix="mesh-spm-") as src:
        shutil.copy(spm, Path(src) / "tokenizer.model")
        tok = LlamaTokenizer.from_pretrained(src, local_files_only=True)
        tok.backend_tokenizer.save(str(out))


def build_model_dir(dest: str | Path, chat_template: str | None = None,
                    extra_special_tokens: Iterable[str] = (), cache_dir: str | Path | None = None,
                    write_template: str = "tokenizer_config", tokenizer: str = "mistral_v3") -> Path:
    """Write a model folder at ``dest``: ``tokenizer.json`` from the shipped SentencePiece model, plus
    ``tokenizer_config.json``. ``chat_template`` goes into tokenizer_config.json (``write_template=
    "tokenizer_config"``), into ``chat_template.jinja`` (``"jinja"``) or ``chat_template.json`` (``"json"``).
    ``cache_dir`` keeps the converted base ``tokenizer.json`` between calls. ``tokenizer``: "mistral_v3"
    (SentencePiece) or "tekken"."""
    from tokenizers import AddedToken, Tokenizer, processors

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if cache_dir is None and os.environ.get(TOKENIZER_CACHE_ENV):
        cache_dir = os.environ[TOKENIZER_CACHE_ENV]  # the test session's cache (tests/conftest.py)
    if tokenizer not in ("mistral_v3", "tekken"):
        raise ValueError(f"tokenizer: {tokenizer!r} (choose mistral_v3 or tekken)")
    base = Path(cache_dir) / f"{tokenizer}_base_tokenizer.json" if cache_dir else None
    if base is None or not base.is_file():
        target = base or (dest / "tokenizer.json")
        target.parent.mkdir(parents=True, exist_ok=True)
        # written aside and renamed: a cache shared by processes never shows a half-written file
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        if tokenizer == "tekken":
            _convert_tekken(shipped_file(SHIPPED_TEKKEN), tmp)
        else:
            _convert(shipped_spm_path(), tmp)
        os.replace(tmp, target)
        base = target
    tok = Tokenizer.from_file(str(base))
    bos = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                        special_tokens=[("<s>", tok.token_to_id("<s>"))])
    # the published models' tokenizer.json adds BOS on plain encodes; Tekken keeps its byte-level step first
    tok.post_processor = bos if tok.post_processor is None or tokenizer != "tekken" else processors.Sequence(
        [tok.post_processor, bos])
    extra = list(extra_special_tokens)
    if extra:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    tok.save(str(dest / "tokenizer.json"))
    cfg: dict = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                 "add_eos_token": False,
                 "tokenizer_class": "PreTrainedTokenizerFast" if tokenizer == "tekken" else "LlamaTokenizerFast"}
    if extra:
        cfg["additional_special_tokens"] = extra
    if chat_template is not None:
        if write_template == "tokenizer_config":
            cfg["chat_template"] = chat_template
        elif write_template == "jinja":
            (dest / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
        elif write_template == "json":
            (dest / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}), encoding="utf-8")
        else:
            raise ValueError(f"write_template: {write_template!r}")
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return dest
