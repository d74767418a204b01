"""Loading a local model folder: ``tokenizer.json``, the chat template and the special tokens.

What is read, and from where (the same files and precedence as ``transformers``' ``AutoTokenizer``)::

    tokenizer.json           the tokenizer itself (HF ``tokenizers``); required
    tokenizer_config.json    bos/eos/unk/pad/... tokens, add_bos_token / add_eos_token, chat_template; optional
    chat_template.jinja      the chat template as a file; wins over tokenizer_config.json's chat_template
    chat_template.json       {"chat_template": "..."} (the processor's legacy file); used when neither of the above has one
    --chat-template FILE     an explicit file (a .jinja / text file, or a .json with "chat_template"); wins over all

``chat_template`` may be a string, or the list-of-named-templates form
(``[{"name": "default", "template": ...}, {"name": "tool_use", ...}]``), of which "default" is used.

Special tokens: ``tokenizer_config.json`` gives them as strings or as AddedToken dicts
(``{"content": "<s>", ...}``); one that ``tokenizer.json`` lacks is added as a special token at the next free
id, as ``transformers`` adds it. ``add_bos_token`` / ``add_eos_token`` matter only for plain encodes
(``add_special_tokens=True``): as in ``transformers`` 5, the ``post_processor`` in ``tokenizer.json`` decides
what a plain encode adds; only when ``tokenizer.json`` has no post-processor do these two flags build one
(``<bos> $A <eos>``), as ``transformers``' ``update_post_processor`` does. Chat prompts are encoded without
special tokens in any case (the template writes them; see ``chat.py``).

Every problem is a ``ConfigError`` whose message names the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mesh.errors import ConfigError

__all__ = ["ModelFiles", "load_model_dir", "read_chat_template_file", "SPECIAL_TOKEN_KEYS"]

# The named special tokens transformers exposes to chat templates (``special_tokens_map``).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ModelFiles:
    """What a model folder says about tokenizing: the loaded tokenizer, the template and the special tokens."""

    path: Path
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    chat_template_source: str  # the file (and field) the template came from, for messages and logs
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... as strings
    additional_special_tokens: tuple[str, ...] = ()
    add_bos_token: bool | None = None  # None: the config does not say
    add_eos_token: bool | None = None

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from exc


def _token_str(value: Any, where: str) -> str | None:
    """A special token as transformers stores it: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ConfigError(f"{where}: must be a string, null or an object with a string 'content', got {value!r}")


def _pick_template(value: Any, where: str) -> str | None:
    """``chat_template`` as a string, or the list of ``{"name", "template"}`` objects (pick "default")."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict):  # the in-memory form transformers builds; also accepted in files
        named = value
    elif isinstance(value, list):
        named = {}
        for i, item in enumerate(value):
            if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)):
                raise ConfigError(f"{where}[{i}]: each named template must be an object with string 'name' and 'template'")
            named[item["name"]] = item["template"]
    else:
        raise ConfigError(f"{where}: must be a string or a list of {{'name', 'template'}} objects, got {type(value).__name__}")
    if "default" not in named or not isinstance(named["default"], str):
        raise ConfigError(f"{where}: the named templates {sorted(named)} include no 'default' template")
    return named["default"]


def read_chat_template_file(path: str | Path) -> str:
    """Read an explicit ``--chat-template FILE``: a JSON file with ``chat_template``, else the file's text."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--chat-template: {p}: no such file")
    if p.suffix == ".json":
        data = _read_json(p)
        if not isinstance(data, dict) or "chat_template" not in data:
            raise ConfigError(f"{p}: field 'chat_template' is missing")
        tpl = _pick_template(data["chat_template"], f"{p}: field 'chat_template'")
        if not tpl:
            raise ConfigError(f"{p}: field 'chat_template' is empty")
        return tpl
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template: {p}: cannot read as UTF-8 text: {exc}") from exc
    if not text.strip():
        raise ConfigError(f"--chat-template: {p}: the file is empty")
    return text


def _load_tokenizer(path: Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError("tokenizer: the 'tokenizers' package is not installed (pip install 'mesh-router[tokenizers]')") from exc
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (a model folder needs tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception subclasses for every parse error
        raise ConfigError(f"{path}: not a valid tokenizer.json: {exc}") from exc


def load_model_dir(path: str | Path, chat_template_file: str | Path | None = None) -> ModelFiles:
    """Load the tokenizer, chat template and special tokens of the model folder ``path``.

    A missing chat template is not an error here (completions need none); ``ModelFiles.chat_template`` is then
    None and rendering chat raises. Raises ``ConfigError`` naming the file and field for everything malformed.
    """
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"model folder {root}: no such directory")
    tokenizer = _load_tokenizer(root / "tokenizer.json")

    cfg_path = root / "tokenizer_config.json"
    cfg: dict[str, Any] = {}
    if cfg_path.is_file():
        loaded = _read_json(cfg_path)
        if not isinstance(loaded, dict):
            raise ConfigError(f"{cfg_path}: must be a JSON object, got {type(loaded).__name__}")
        cfg = loaded

    special: dict[str, str] = {}
    for key in SPECIAL_TOKEN_KEYS:
        tok = _token_str(cfg.get(key), f"{cfg_path}: field '{key}'")
        if tok is not None:
            special[key] = tok
    extra_raw = cfg.get("additional_special_tokens", cfg.get("extra_special_tokens")) or []
    if isinstance(extra_raw, dict):  # transformers 5 allows {"name": token}
        extra_raw = list(extra_raw.values())
    if not isinstance(extra_raw, list):
        raise ConfigError(f"{cfg_path}: field 'additional_special_tokens': must be a list")
    extra = tuple(t for i, v in enumerate(extra_raw)
                  if (t := _token_str(v, f"{cfg_path}: field 'additional_special_tokens'[{i}]")) is not None)
    # Named and additional special tokens missing from tokenizer.json are added as special tokens, at the
    # next free ids, as transformers does when it loads the folder, so both give the same ids.
    missing = [t for t in (*special.values(), *extra) if tokenizer.token_to_id(t) is None]
    if missing:
        from tokenizers import AddedToken

        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)])
    flags: dict[str, bool | None] = {}
    for key in ("add_bos_token", "add_eos_token"):
        v = cfg.get(key)
        if v is not None and not isinstance(v, bool):
            raise ConfigError(f"{cfg_path}: field '{key}': must be true or false, got {v!r}")
        flags[key] = v

    template, source = None, ""
    if chat_template_file is not None:
        template, source = read_chat_template_file(chat_template_file), str(chat_template_file)
    elif (root / "chat_template.jinja").is_file():
        p = root / "chat_template.jinja"
        try:
            template = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{p}: cannot read as UTF-8 text: {exc}") from exc
        source = str(p)
    elif cfg.get("chat_template") is not None:
        source = f"{cfg_path}: field 'chat_template'"
        template = _pick_template(cfg["chat_template"], source)
    elif (root / "chat_template.json").is_file():
        p = root / "chat_template.json"
        data = _read_json(p)
        if not isinstance(data, dict) or "chat_template" not in data:
            raise ConfigError(f"{p}: field 'chat_template' is missing")
        source = f"{p}: field 'chat_template'"
        template = _pick_template(data["chat_template"], source)
    if template is not None and not template.strip():
        raise ConfigError(f"{source}: the chat template is empty")

    if tokenizer.post_processor is None and (flags["add_bos_token"] or flags["add_eos_token"]):
        _install_post_processor(tokenizer, special, flags, cfg_path)

    return ModelFiles(path=root, tokenizer=tokenizer, chat_template=template, chat_template_source=source,
                      special_tokens=special, additional_special_tokens=extra,
                      add_bos_token=flags["add_bos_token"], add_eos_token=flags["add_eos_token"])


def _install_post_processor(tokenizer: Any, special: dict[str, str], flags: dict[str, bool | None], cfg_path: Path) -> None:
    """``<bos> $A <eos>`` from add_bos_token / add_eos_token, as transformers' ``update_post_processor`` builds it."""
    from tokenizers import processors

    toks: list[tuple[str, int]] = []
    for flag, key in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        if flags[flag] and key not in special:
            raise ConfigError(f"{cfg_path}: field '{flag}' is true but field '{key}' is missing")
    bos, eos = special.get("bos_token"), special.get("eos_token")
    single = f"{bos + ':0 ' if flags['add_bos_token'] else ''}$A:0{' ' + eos + ':0' if flags['add_eos_token'] else ''}"
    pair_s = f"{single}{' ' + bos + ':1' if flags['add_bos_token'] else ''} $B:1{' ' + eos + ':1' if flags['add_eos_token'] else ''}"
    if flags["add_bos_token"]:
        toks.append((bos, tokenizer.token_to_id(bos)))
    if flags["add_eos_token"]:
        toks.append((eos, tokenizer.token_to_id(eos)))
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair_s, special_tokens=toks)
