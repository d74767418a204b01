"""Finding a model's tokenizer folder from what names it: a folder, or a model id in the local Hugging Face cache.

Engines name their tokenizer the way they were started (SGLang ``tokenizer_path``, vLLM ``/v1/models``
``root``): a model id such as ``mistralai/Mistral-7B-Instruct-v0.3`` or a local folder. ``--tokenizer``
accepts the same. :func:`resolve_model_dir` turns either into a folder holding ``tokenizer.json``, reading
only the local cache, never the network (no download, no ``huggingface_hub`` needed):

    a folder (or its tokenizer.json)        used as it is
    ORG/NAME or NAME, optional @REVISION    $HF_HUB_CACHE/models--ORG--NAME/snapshots/<commit>/, the commit
                                            read from refs/REVISION (default ``main``), else the snapshot
                                            that holds tokenizer.json (the newest if several)
    a path inside a cache (…/models--ORG--NAME/snapshots/…) that does not exist here: ORG/NAME in this
                                            host's cache (engines on another host report their own paths)

The cache is where ``huggingface_hub`` puts it: ``HF_HUB_CACHE`` (or the older ``HUGGINGFACE_HUB_CACHE``),
else ``HF_HOME/hub``, else ``XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``.
Every failure is a :class:`~mesh.errors.ConfigError` naming what was looked for, where, and the fix.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

from mesh.errors import ConfigError

__all__ = ["hub_cache_dir", "resolve_model_dir", "looks_like_model_id", "download_hint"]

_ID_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_MODEL_ID = re.compile(rf"(?:{_ID_PART}/)?{_ID_PART}(?:@[A-Za-z0-9._/-]{{1,128}})?")
_CACHE_SEGMENT = re.compile(r"models--(.+)")


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The local Hugging Face hub cache, as ``huggingface_hub`` finds it."""
    env = os.environ if env is None else env
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(env[key]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def looks_like_model_id(spec: str) -> bool:
    """``ORG/NAME`` or ``NAME`` (optionally ``@REVISION``), not a path."""
    return not spec.startswith((".", "/", "~")) and bool(_MODEL_ID.fullmatch(spec))


def download_hint(model_id: str) -> str:
    return (f"huggingface-cli download {model_id.split('@')[0]} tokenizer.json tokenizer_config.json "
            "(on a host with network; then copy the cache here), or pass --tokenizer MODEL=DIR")


_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a ref name or commit: one path segment, no ".."


def _snapshot(repo: Path, revision: str | None) -> Path | None:
    snaps = repo / "snapshots"
    if revision is not None or (repo / "refs" / "main").is_file():
        rev = revision or "main"
        if not _SEGMENT.fullmatch(rev) or ".." in rev:  # a peer-announced id must not walk out of the cache
            return None
        ref = repo / "refs" / rev
        commit = ref.read_text(encoding="utf-8", errors="replace")[:128].strip() if ref.is_file() else rev
        if not _SEGMENT.fullmatch(commit) or ".." in commit:
            return None
        d = snaps / commit
        return d if (d / "tokenizer.json").is_file() else None
    found = [d for d in snaps.iterdir() if (d / "tokenizer.json").is_file()] if snaps.is_dir() else []
    return max(found, key=lambda d: d.stat().st_mtime) if found else None


def _from_cache(model_id: str, env: Mapping[str, str] | None) -> Path:
    name, _, revision = model_id.partition("@")
    cache = hub_cache_dir(env)
    repo = cache / ("models--" + name.replace("/", "--"))
    d = _snapshot(repo, revision or None) if repo.is_dir() else None
    if d is None:
        where = f"{repo}" + (f" at revision {revision}" if revision else "")
        raise ConfigError(f"tokenizer: model {name!r} has no tokenizer.json in the local Hugging Face cache "
                          f"({where}; nothing is downloaded): {download_hint(model_id)}")
    return d


def resolve_model_dir(spec: str, env: Mapping[str, str] | None = None) -> Path:
    """The folder holding ``spec``'s tokenizer.json (see the module docstring). Raises ConfigError."""
    try:
        return _resolve_model_dir(spec, env)
    except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL byte, ...
        raise ConfigError(f"tokenizer: {spec[:200]!r} cannot be a model folder or id ({type(exc).__name__}: "
                          f"{str(exc)[:120]}): pass --tokenizer MODEL=DIR with the model's tokenizer.json") from None


def _resolve_model_dir(spec: str, env: Mapping[str, str] | None) -> Path:
    spec = spec.strip()
    if not spec:
        raise ConfigError("tokenizer: empty model name or folder")
    p = Path(spec).expanduser()
    if p.is_file() and p.name == "tokenizer.json":
        return p.parent
    if p.is_dir():
        return p
    if looks_like_model_id(spec) and not p.exists():
        return _from_cache(spec, env)
    cached = [m.group(1) for part in p.parts if (m := _CACHE_SEGMENT.fullmatch(part))]
    if cached:  # another host's cache path: the same model in this host's cache
        return _from_cache(cached[-1].replace("--", "/", 1), env)
    raise ConfigError(f"tokenizer: {spec} does not exist (neither a model folder on this host nor a model id "
                      "ORG/NAME): pass --tokenizer MODEL=DIR with the model's tokenizer.json")
