"""Which tokenizer the HTTP ingress uses for a request's model, and what it says when there is none.

In order: the one ``--tokenizer`` names for the model (``MODEL=DIR|ID``), else the one ``--tokenizer``
names for every model (``DIR|ID``), else the one the model's engines announced in READY (SGLang's
``tokenizer_path``, vLLM's ``/v1/models`` ``root``; :meth:`IngressBackend.announced_tokenizers`), found
as a folder or in the local Hugging Face cache (:func:`mesh.tokenization.resolve_model_dir`, no
download). Flag-named tokenizers load at start (a bad one stops the start, naming it); announced ones
load as soon as the engines announce them (:meth:`Tokenizers.prefetch_loop`), or on the first request
that needs them, in a thread, once per identity, and run in a :class:`mesh.tokenization.TokenizerPool`
as the configured ones do. A failed load is retried after ``retry_s``. Loading holds the interpreter
lock while ``tokenizers`` parses the file (1-2 s for a 17 MB tokenizer.json on a busy machine): a
broker serving HTTP stalls that long once per model, and sheds requests meanwhile (``overload_lag_ms``);
``--tokenizer`` (loaded before the broker serves) or the gateway avoid it.

Without a tokenizer, text is sent as text and the broker keys it by UTF-8 bytes, which never match the
KV events of engines that key their cache by token ids (every engine that announces a tokenizer). Each
such request is counted (``stats.text_unmatched[model]``, ``mesh_text_unmatched_total``), the first one
of a model is logged (``text_routed_without_tokenizer``, with the fix), and ``/health`` lists the
model with the fix (:meth:`Tokenizers.health`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from brokers.ingress.backend import IngressBackend
from mesh.errors import ConfigError
from mesh.logs import get_logger
from mesh.routing.lora import split_model

__all__ = ["PrefixCacheCollector", "Tokenizers", "load_tokenizer"]

_ANNOUNCED_TTL_S = 1.0  # how long the fleet's announced tokenizers are reused before asking the backend again


TOKENIZER_THREADS = 2


def load_tokenizer(path: str, chat_template_path: str | None):
    """A model folder, its ``tokenizer.json``, or a model id in the local Hugging Face cache ->
    (ModelTokenizer, TokenizerPool). Raises ConfigError naming what is missing."""
    try:
        from mesh.tokenization import ModelTokenizer, TokenizerPool, resolve_model_dir
        import tokenizers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise ConfigError("tokenizer: the 'tokenizers' extra is not installed (pip install mesh-router[tokenizers])") from exc
    try:
        not_a_tokenizer = Path(path).is_file() and Path(path).name != "tokenizer.json"
    except (OSError, ValueError):  # too long a name, a NUL byte: resolve_model_dir says why
        not_a_tokenizer = False
    if not_a_tokenizer:
        raise ConfigError(f"tokenizer: {path} must be a model folder or its tokenizer.json")
    tok = ModelTokenizer.from_dir(resolve_model_dir(path), chat_template_path)
    tok.max_token_chars  # noqa: B018 -- measured here, in the loader's thread, not on the loop's first request
    # Fair shares: one client (the HTTP peer, or its tenant) runs on at most one of the two threads and
    # queues at most 32 jobs, so a flood of long prompts leaves the other thread to everyone else.
    return tok, TokenizerPool(tok, workers=TOKENIZER_THREADS, max_queued=256, max_queued_per_client=32,
                              max_running_per_client=TOKENIZER_THREADS - 1)


class Tokenizers:
    """Per model: its (ModelTokenizer, TokenizerPool) or None; see the module docstring."""

    def __init__(self, backend: IngressBackend, configured: dict[str | None, str] | None = None,
                 chat_templates: dict[str | None, str] | None = None, *, retry_s: float = 60.0,
                 clock: Callable[[], float] | None = None, loader: Callable[[str, str | None], Any] = load_tokenizer) -> None:
        self.backend = backend
        templates = chat_templates or {}
        # flag-named: loaded now, so a bad one stops the start
        self._texts = {name: loader(path, templates.get(name)) for name, path in (configured or {}).items()}
        self._loader = loader
        self._retry_s = retry_s
        self._clock = clock or time.monotonic  # (the clock of asyncio's loop.time(), without a frame per call)
        self._loaded: dict[str, Any] = {}  # announced identity -> (tok, pool)
        self._loading: dict[str, asyncio.Future] = {}
        self._failed: dict[str, tuple[float, str]] = {}  # identity -> (retry after, why)
        self._announced: tuple[float, dict[str, str]] | None = None
        self.unmatched: Counter[str] = Counter()  # text requests sent without their model's tokenizer, by model
        self.missing: dict[str, dict[str, str]] = {}  # model -> {tokenizer, reason, fix}: warned once each
        self.log = get_logger(service="http")

    def close(self) -> None:
        for _, pool in [*self._texts.values(), *self._loaded.values()]:
            pool.close()

    # ------------------------------------------------------------------ lookup
    def model_name(self, model: str | None) -> str | None:
        """The served model a request's ``model`` means: itself, its alias' target, the fleet's only
        model for no name or the fleet's name, or for a LoRA adapter (``BASE:ADAPTER`` or the
        adapter's own name) its base model, whose tokenizer it shares."""
        served, aliases, fleet_name = self.backend.model_catalog()
        name = aliases.get(model, model) if model is not None else None
        if (name is None or name == fleet_name) and len(served) == 1:
            name = next(iter(served))
        if name is not None and name not in served:
            base = self._lora_base(name, served)
            if base is not None:
                name = aliases.get(base, base)
        return name

    def _lora_base(self, name: str, served: dict[str, int]) -> str | None:
        """The base model of ``BASE:ADAPTER`` or of an adapter's own name (None: not an adapter)."""
        if ":" in name:
            base, adapter = split_model(name, served)
            if adapter is not None:
                return base
        entry = self.backend.lora_catalog().get(name)
        return entry["parent"] if entry else None

    def announced(self, name: str | None) -> str:
        """The tokenizer ``name``'s engines announced, or ""."""
        if name is None:
            return ""
        now = self._clock()
        if self._announced is None or now - self._announced[0] >= _ANNOUNCED_TTL_S:
            self._announced = (now, self.backend.announced_tokenizers())
        return self._announced[1].get(name, "")

    def configured(self, model: str | None):
        """The flag-named (tokenizer, pool) of ``model``: its own, else the one for every model; None."""
        if not self._texts:
            return None
        if len(self._texts) > 1 or None not in self._texts:
            name = self.model_name(model)
            hit = self._texts.get(name) if name is not None else None
            if hit is not None:
                return hit
        return self._texts.get(None)

    async def for_model(self, model: str | None):
        """The (tokenizer, pool) for a request's model, or None; loads an announced one on first use."""
        hit = self.configured(model)
        if hit is not None:
            return hit
        ident = self.announced(self.model_name(model))
        if not ident:
            return None
        hit = self._loaded.get(ident)
        if hit is not None:
            return hit
        failed = self._failed.get(ident)
        if failed is not None and self._clock() < failed[0]:
            return None
        return await asyncio.shield(self._start_load(ident))

    def _start_load(self, ident: str) -> asyncio.Future:
        fut = self._loading.get(ident)
        if fut is None:
            fut = self._loading[ident] = asyncio.ensure_future(self._load(ident))
        return fut

    def prefetch(self) -> None:
        """Start loading every announced tokenizer a request would load (call it periodically): parsing a
        large tokenizer.json holds the interpreter lock for a second or two, better spent as the engines
        register than inside a request."""
        if None in self._texts:  # the flag names one for every model: announced ones are never used
            return
        now = self._clock()
        for model, ident in self.backend.announced_tokenizers().items():
            if (model not in self._texts and ident not in self._loaded and ident not in self._loading
                    and now >= self._failed.get(ident, (0.0, ""))[0]):
                self._start_load(ident)

    async def prefetch_loop(self, period_s: float = 1.0) -> None:
        while True:
            try:
                self.prefetch()
            except Exception as exc:  # never let the loop die: requests still load on demand
                self.log.warning("tokenizer_prefetch_failed", error=repr(exc))
            await asyncio.sleep(period_s)

    async def _load(self, ident: str):
        try:
            hit = await asyncio.to_thread(self._loader, ident, None)
        except Exception as exc:  # ConfigError: not found or malformed; anything else is logged as such
            self._failed[ident] = (self._clock() + self._retry_s, str(exc))
            self.log.info("announced_tokenizer_not_loaded", tokenizer=ident, error=str(exc)[:400],
                          retry_in_s=self._retry_s, **({} if isinstance(exc, ConfigError) else {"exception": repr(exc)}))
            return None
        finally:
            self._loading.pop(ident, None)
        self._failed.pop(ident, None)
        self._loaded[ident] = hit
        self.log.info("announced_tokenizer_loaded", tokenizer=ident, folder=str(hit[0].files.path))
        return hit

    def prefix_cache_stats(self) -> dict[str, dict[str, int]]:
        """Per loaded tokenizer (its folder): its chat prefix cache's hits, misses, tokens reused and bytes
        held (:mod:`mesh.tokenization.prefix_cache`); tokenizers without one (no chat template) are left out."""
        out: dict[str, dict[str, int]] = {}
        for tok, _ in [*self._texts.values(), *self._loaded.values()]:
            cache = getattr(getattr(tok, "prefix", None), "cache", None)
            if cache is not None:
                out[str(tok.files.path)] = {"hits": cache.hits, "misses": cache.misses,
                                            "tokens_reused": cache.tokens_reused, "bytes": cache.bytes}
        return out

    # ------------------------------------------------------------------ no tokenizer
    def note_text(self, model: str | None) -> None:
        """A text prompt goes out without its model's tokenizer: when the model's engines key their cache
        by token ids (they announced a tokenizer), count it and warn once per model with the fix."""
        name = self.model_name(model)
        ident = self.announced(name)
        if not ident or name is None:
            return
        self.unmatched[name] += 1
        self.backend.stats.text_unmatched[name] += 1
        if name in self.missing:
            return
        why = self._failed.get(ident, (0.0, "not loaded"))[1]
        fix = (f"put {ident}'s tokenizer.json (and tokenizer_config.json) where this host finds it (the local "
               f"Hugging Face cache, or the folder it names), or pass --tokenizer {name}=DIR")
        self.missing[name] = {"tokenizer": ident, "reason": why[:400], "fix": fix}
        self.log.warning("text_routed_without_tokenizer", model=name, tokenizer=ident, reason=why[:400], fix=fix,
                         effect="text requests are keyed by bytes, which never match these engines' KV events: "
                                "no cache-aware routing for them")

    def health(self) -> dict[str, Any]:
        """``/health``'s ``text_routing`` field: unmatched text requests and, per model without its
        tokenizer, why and the fix."""
        return {"unmatched_text_requests": sum(self.unmatched.values()),
                "models_without_tokenizer": {m: {**d, "unmatched": self.unmatched[m]} for m, d in self.missing.items()
                                             if self.announced(m) == d["tokenizer"] and d["tokenizer"] not in self._loaded}}


class PrefixCacheCollector:
    """``mesh_tokenizer_prefix_cache_{hits,misses,tokens_reused}_total`` and ``..._bytes`` by tokenizer: whether
    chat prompts reuse cached token ids (a model without a chat template never does; each gateway process has
    its own cache, so a conversation whose turns reach different processes hits less)."""

    def __init__(self, tokenizers: Tokenizers) -> None:
        self.tokenizers = tokenizers

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.tokenizers.prefix_cache_stats()
        for key, kind, doc in (("hits", CounterMetricFamily, "Chat prompts that reused cached token ids of a prefix"),
                               ("misses", CounterMetricFamily, "Chat prompts encoded whole (no cached prefix)"),
                               ("tokens_reused", CounterMetricFamily, "Token ids taken from the prefix cache instead of encoded"),
                               ("bytes", GaugeMetricFamily, "Bytes the prefix cache holds (bounded per tokenizer)")):
            fam = kind(f"mesh_tokenizer_prefix_cache_{key}", doc, labels=["tokenizer"])
            for tok, st in sorted(stats.items()):
                fam.add_metric([tok], st[key])
            yield fam
