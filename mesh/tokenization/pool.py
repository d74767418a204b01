"""Tokenization off the event loop: a small thread pool around one model's tokenizer and chat template.

Why threads: HF ``tokenizers`` releases the GIL inside ``encode_batch`` (its single-text ``encode`` does not:
measured, a 380k-token ``encode`` lets no other Python thread run for its whole second), so the pool always
encodes through ``encode_batch([text])`` and the loop keeps serving sockets while a long prompt encodes.
Rendering the Jinja template is pure Python and holds the GIL, but it is string concatenation over the
messages: microseconds to a millisecond, against the encode's milliseconds.

Contract:
- ``await pool.encode(text)`` / ``await pool.render_chat(messages)`` never run tokenizer code on the calling
  loop; a cancelled caller's job is dropped if it has not started (it finishes, unseen, if it has).
- At most ``workers + max_queued`` jobs are admitted at once; past that a call raises ``TokenizerBusy``
  (``RetryableError``, code ``overloaded``: HTTP 429) at once instead of queueing without bound.
- ``close()`` is idempotent, drops queued jobs and refuses new ones (``RuntimeError``).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

from mesh.errors import ErrorCode, RetryableError

from .chat import ChatTemplate
from .model_dir import ModelFiles, load_model_dir
from .prefix_cache import PrefixEncoder

__all__ = ["ModelTokenizer", "TokenizerPool", "TokenizerBusy", "PREFIX_CACHE_BYTES"]

PREFIX_CACHE_BYTES = 64 << 20  # per model: token ids of chat prompts' prefixes (prefix_cache.py)


class TokenizerBusy(RetryableError):
    """More tokenization jobs are waiting than the pool admits."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.OVERLOADED, message)


class ModelTokenizer:
    """One model's tokenizer and chat template, with blocking calls. Thread-safe (``tokenizers.Tokenizer`` is
    immutable once loaded and the template shares no state), so a pool's threads share one instance."""

    def __init__(self, files: ModelFiles, text_part_separator: str = "\n", prefix_cache_bytes: int = PREFIX_CACHE_BYTES) -> None:
        self.files = files
        self.chat_template = (ChatTemplate(files.chat_template, files.special_tokens, files.additional_special_tokens,
                                           origin=files.chat_template_source, text_part_separator=text_part_separator)
                              if files.chat_template is not None else None)
        # chat prompts re-send their history: encode only what follows the longest cached prefix
        written = {*files.special_tokens.values(), *files.additional_special_tokens}
        self.prefix = (PrefixEncoder(files.tokenizer, prefix_cache_bytes,
                                     written_by=lambda t: t in written or t in (files.chat_template or ""))
                       if self.chat_template is not None and prefix_cache_bytes > 0 else None)

    @classmethod
    def from_dir(cls, path: str | Path, chat_template_file: str | Path | None = None,
                 text_part_separator: str = "\n") -> "ModelTokenizer":
        """``text_part_separator``: how text content parts are joined for string-only templates ("\\n" as vLLM
        does, " " as SGLang does; see ``chat.py``)."""
        return cls(load_model_dir(path, chat_template_file), text_part_separator)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens=True`` (completions prompts, as vLLM and SGLang encode
        them) applies tokenizer.json's post-processor, which may add BOS."""
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        # encode_batch, not encode: only the batch call releases the GIL
        try:
            return self.files.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:  # what tokenizers says of a lone surrogate ("TextEncodeInput must be ...")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"prompt holds text that is not valid Unicode ({exc.reason} at {exc.start})") from None
            raise

    def render(self, messages: Iterable[Any], add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
        """``template_kwargs``: what the template sees besides the messages (``tools``, a request's
        ``chat_template_kwargs``)."""
        if self.chat_template is None:
            raise ValueError(f"model {self.files.path} has no chat template (tokenizer_config.json 'chat_template', "
                             "chat_template.jinja or --chat-template FILE)")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))

    def render_chat(self, messages: Iterable[Any], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        """``(prompt_text, token_ids)``; the ids are encoded without special tokens (the template writes them),
        through the prefix cache: only what follows the longest prefix seen before is encoded."""
        text = self.render(messages, add_generation_prompt, template_kwargs)
        if self.prefix is not None:
            try:
                return text, self.prefix.encode(text)
            except TypeError:  # a lone surrogate: the plain encode names it
                pass
        return text, self.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.files.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class TokenizerPool:
    """``workers`` threads tokenizing for one ``ModelTokenizer``; see the module docstring for the contract."""

    def __init__(self, tokenizer: ModelTokenizer, workers: int = 2, max_queued: int = 64) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        if max_queued < 0:
            raise ValueError("max_queued must be >= 0")
        self.tokenizer = tokenizer
        self.workers = workers
        self.max_queued = max_queued
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mesh-tokenizer")
        self._lock = threading.Lock()
        self._admitted = 0  # jobs submitted and not yet finished or cancelled (queued + running)
        self._closed = False

    @property
    def admitted(self) -> int:
        return self._admitted

    def _release(self, _fut: Any) -> None:
        with self._lock:
            self._admitted -= 1

    async def _run(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError("tokenizer pool is closed")
            if self._admitted >= self.workers + self.max_queued:
                raise TokenizerBusy(f"tokenizer pool full: {self._admitted - self.workers} jobs waiting "
                                    f"(limit {self.max_queued})")
            self._admitted += 1
        try:
            cf = self._executor.submit(fn, *args)
        except BaseException:
            self._release(None)
            raise
        cf.add_done_callback(self._release)  # runs on completion and on cancellation alike
        return await asyncio.wrap_future(cf)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self.tokenizer.encode, text, add_special_tokens)

    async def render_chat(self, messages: Iterable[Any], add_generation_prompt: bool = True,
                          template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        # copy the outer list now: the caller may mutate it while the job waits
        return await self._run(self.tokenizer.render_chat, list(messages) if isinstance(messages, (list, tuple)) else messages,
                               add_generation_prompt, template_kwargs)

    def close(self) -> None:
        """Drop queued jobs, refuse new ones, let running ones finish in the background. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "TokenizerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
