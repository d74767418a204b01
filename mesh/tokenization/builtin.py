"""A real model's tokenizer that a PyPI package ships, as a model folder: for tests and ``--builtin`` benches.

``mistral-common`` ships Mistral's tokenizers as package data; ``mistral_instruct_tokenizer_240323.model.v3``
is the SentencePiece model of Mistral-7B-Instruct-v0.3 (32,768 pieces, [INST] / [/INST] / tool control
tokens). ``transformers`` converts it to a ``tokenizer.json`` (its ``LlamaTokenizer`` reading a local
``tokenizer.model``, offline), and this module gives it the post-processor the published model's
``tokenizer.json`` has (``<s> $A``, so plain encodes add BOS) and a ``tokenizer_config.json`` with its
special tokens. Extra control tokens (``<|im_start|>``...) can be added as special tokens, to stand in for a
model whose vocabulary declares them (a ChatML or Llama-3 template over this vocabulary).

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

__all__ = ["SHIPPED_SPM", "shipped_spm_path", "build_model_dir", "CHATML_TEMPLATE"]

SHIPPED_SPM = "mistral_instruct_tokenizer_240323.model.v3"

# Qwen2-7B-Instruct's ChatML template, for the builtin bench folder.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def shipped_spm_path() -> Path:
    try:
        import mistral_common
    except ImportError as exc:
        raise ConfigError("--builtin: needs the 'mistral-common' package (pip install 'mesh-router[dev]')") from exc
    p = Path(mistral_common.__file__).parent / "data" / SHIPPED_SPM
    if not p.is_file():
        raise ConfigError(f"--builtin: {p}: not found in this mistral-common install")
    return p


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
                    write_template: str = "tokenizer_config") -> Path:
    """Write a model folder at ``dest``: ``tokenizer.json`` from the shipped SentencePiece model, plus
    ``tokenizer_config.json``. ``chat_template`` goes into tokenizer_config.json (``write_template=
    "tokenizer_config"``), into ``chat_template.jinja`` (``"jinja"``) or ``chat_template.json`` (``"json"``).
    ``cache_dir`` keeps the converted base ``tokenizer.json`` between calls."""
    from tokenizers import AddedToken, Tokenizer, processors

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    base = Path(cache_dir) / "mistral_v3_base_tokenizer.json" if cache_dir else None
    if base is None or not base.is_file():
        target = base or (dest / "tokenizer.json")
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert(shipped_spm_path(), target)
        base = target
    tok = Tokenizer.from_file(str(base))
    tok.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    extra = list(extra_special_tokens)
    if extra:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    tok.save(str(dest / "tokenizer.json"))
    cfg: dict = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                 "add_bos_token": True, "add_eos_token": False, "tokenizer_class": "LlamaTokenizerFast"}
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
