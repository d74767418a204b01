"""Tokenization off the event loop: a small thread pool around one model's tokenizer and chat template.

Why threads: HF ``tokenizers`` releases the GIL inside ``encode_batch`` (its single-text ``encode`` does not:
measured, a 380k-token ``encode`` lets no other Python thread run for its whole second), so the pool always
encodes through ``encode_batch_fast([text])`` (the same ids without character offsets, which nothing here
reads: about twice as fast on long texts; ``encode_batch`` on ``tokenizers`` < 0.20) and the loop keeps
serving sockets while a long prompt encodes.
Rendering the Jinja template is pure Python and holds the GIL, but it is string concatenation over the
messages: microseconds to a millisecond, against the encode's milliseconds.

Contract:
- ``await pool.encode(text)`` / ``await pool.render_chat(messages)`` never run tokenizer code on the calling
  loop; a cancelled caller's job is dropped if it has not started (it finishes, unseen, if it has).
- At most ``workers + max_queued`` jobs are admitted at once; past that a call raises ``TokenizerBusy``
  (``RetryableError``, code ``overloaded``: HTTP 429) at once instead of queueing without bound.
- Clients share the threads fairly (see :class:`TokenizerPool`): a flood from one client waits in its own
  queue and is refused past its own bound, while another client's job takes the next free thread.
- ``ModelTokenizer.max_token_chars``: no token of the vocabulary covers more characters of text, so a text
  of ``n`` characters has at least ``n / max_token_chars`` tokens: the ingress refuses, before any work,
  text that cannot fit the largest context.
- ``close()`` is idempotent, drops queued jobs and refuses new ones (``RuntimeError``).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import deque
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

from mesh.errors import ErrorCode, RetryableError

from .chat import ChatTemplate
from .model_dir import ModelFiles, load_model_dir
from .prefix_cache import PrefixEncoder, fast_encode_batch

__all__ = ["ModelTokenizer", "TokenizerPool", "TokenizerBusy", "TooManyTokens", "PREFIX_CACHE_BYTES"]

PREFIX_CACHE_BYTES = 64 << 20  # per model: token ids of chat prompts' prefixes (prefix_cache.py)


class TokenizerBusy(RetryableError):
    """More tokenization jobs are waiting than the pool admits."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.OVERLOADED, message)


class TooManyTokens(ValueError):
    """A text encodes to more tokens than the caller's ``max_tokens``: refused before its ids are made
    into a Python list (for a 2M-token text, tens of milliseconds holding the GIL)."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"prompt of {tokens} tokens exceeds the limit of {limit}")
        self.tokens = tokens
        self.limit = limit


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

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token of this vocabulary stands for (the longest piece: byte-level
        pieces spell one character per byte, SentencePiece pieces one per character, added tokens their text)."""
        vocab = self.files.tokenizer.get_vocab(with_added_tokens=True)
        return max((len(piece) for piece in vocab), default=1) or 1

    @classmethod
    def from_dir(cls, path: str | Path, chat_template_file: str | Path | None = None,
                 text_part_separator: str = "\n") -> "ModelTokenizer":
        """``text_part_separator``: how text content parts are joined for string-only templates ("\\n" as vLLM
        does, " " as SGLang does; see ``chat.py``)."""
        return cls(load_model_dir(path, chat_template_file), text_part_separator)

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int = 0) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens=True`` (completions prompts, as vLLM and SGLang encode
        them) applies tokenizer.json's post-processor, which may add BOS."""
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        # encode_batch(_fast), not encode: only the batch calls release the GIL
        try:
            enc = fast_encode_batch(self.files.tokenizer)([text], add_special_tokens=add_special_tokens)[0]
            if max_tokens and len(enc) > max_tokens:
                raise TooManyTokens(len(enc), max_tokens)
            return enc.ids
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


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class _Job:
    __slots__ = ("client", "fn", "args", "future", "loop")

    def __init__(self, client: Hashable, fn: Any, args: tuple, future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.fn = fn
        self.args = args
        self.future = future
        self.loop = loop


class TokenizerPool:
    """``workers`` threads tokenizing for one ``ModelTokenizer``; see the module docstring for the contract.

    Fair between clients: jobs wait in one queue per client (``client=`` of :meth:`encode` /
    :meth:`render_chat`: the HTTP peer or tenant) and the threads take them round robin over the
    clients, so one client's long prompts delay another's by at most the jobs already running.
    ``max_running_per_client`` keeps threads free for others (``workers - 1`` leaves one to every
    other client while one floods); ``max_queued_per_client`` refuses a client's excess at once
    (``TokenizerBusy``) before it fills the shared queue. Both default to no limit beyond the pool's."""

    def __init__(self, tokenizer: ModelTokenizer, workers: int = 2, max_queued: int = 64, *,
                 max_queued_per_client: int | None = None, max_running_per_client: int | None = None) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        if max_queued < 0:
            raise ValueError("max_queued must be >= 0")
        self.tokenizer = tokenizer
        self.workers = workers
        self.max_queued = max_queued
        self.max_queued_per_client = max_queued if max_queued_per_client is None else max(0, max_queued_per_client)
        self.max_running_per_client = workers if max_running_per_client is None else max(1, min(workers, max_running_per_client))
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mesh-tokenizer")
        self._lock = threading.Lock()
        self._waiting: dict[Hashable, deque[_Job]] = {}  # per client
        self._running: dict[Hashable, int] = {}
        self._running_total = 0
        self._queued_total = 0
        self._served: dict[Hashable, int] = {}  # client -> the turn its latest job started at
        self._turn = 0
        self._closed = False

    @property
    def admitted(self) -> int:
        """Jobs admitted and not yet finished or cancelled (queued + running)."""
        return self._queued_total + self._running_total

    async def _run(self, fn: Any, *args: Any, client: Hashable = None) -> Any:
        loop = asyncio.get_running_loop()
        job = _Job(client, fn, args, loop.create_future(), loop)
        with self._lock:
            if self._closed:
                raise RuntimeError("tokenizer pool is closed")
            blocked = self._running_total >= self.workers or self._running.get(client, 0) >= self.max_running_per_client
            if blocked and self._queued_total >= self.max_queued:
                raise TokenizerBusy(f"tokenizer pool full: {self._queued_total} jobs waiting (limit {self.max_queued})")
            mine = self._waiting.get(client)
            if mine is not None and len(mine) >= self.max_queued_per_client:
                raise TokenizerBusy(f"tokenizer share full: {len(mine)} of this client's jobs waiting "
                                    f"(limit {self.max_queued_per_client} per client)")
            self._waiting.setdefault(client, deque()).append(job)
            self._queued_total += 1
            started = self._pump_locked()
        self._watch(started)
        try:
            return await job.future
        except asyncio.CancelledError:
            with self._lock:
                q = self._waiting.get(client)
                if q is not None and job in q:  # not started: drop it (a running one finishes unseen)
                    q.remove(job)
                    self._queued_total -= 1
                    if not q:
                        del self._waiting[client]
                        self._forget_idle(client)
            raise

    def _watch(self, started: list) -> None:
        """Outside the lock: a job that is already done calls back at once, in this thread."""
        for job, cf in started:
            cf.add_done_callback(lambda f, job=job: self._finished(job, f))

    def _pump_locked(self) -> list:
        """Start waiting jobs on free threads (lock held): each time, the eligible client served longest
        ago (never served first), so clients take turns whatever their queues hold. Returns the (job,
        concurrent future) pairs started, for :meth:`_watch`."""
        out: list = []
        while self._running_total < self.workers and not self._closed:
            best = None
            for client in self._waiting:
                if self._running.get(client, 0) < self.max_running_per_client:
                    turn = self._served.get(client, -1)
                    if best is None or turn < best[0]:
                        best = (turn, client)
            if best is None:
                break
            client = best[1]
            q = self._waiting[client]
            job = q.popleft()
            if not q:
                del self._waiting[client]
            self._queued_total -= 1
            self._turn += 1
            self._served[client] = self._turn
            self._running[client] = self._running.get(client, 0) + 1
            self._running_total += 1
            try:
                cf = self._executor.submit(job.fn, *job.args)
            except BaseException as exc:  # shut down under us
                self._done_locked(job)
                job.loop.call_soon_threadsafe(_settle, job.future, None, exc)
                continue
            out.append((job, cf))
        return out

    def _done_locked(self, job: _Job) -> None:
        self._running_total -= 1
        n = self._running[job.client] - 1
        if n:
            self._running[job.client] = n
        else:
            del self._running[job.client]
            self._forget_idle(job.client)

    def _forget_idle(self, client: Hashable) -> None:
        """A client with nothing waiting or running keeps no state (its next job counts as never served)."""
        if client not in self._waiting and client not in self._running:
            self._served.pop(client, None)

    def _finished(self, job: _Job, cf: Any) -> None:
        """Executor callback (a worker thread, or the caller on cancellation)."""
        with self._lock:
            self._done_locked(job)
            started = self._pump_locked()
        self._watch(started)
        exc = cf.exception() if not cf.cancelled() else asyncio.CancelledError()
        try:
            job.loop.call_soon_threadsafe(_settle, job.future, None if exc else cf.result(), exc)
        except RuntimeError:  # the caller's loop is closed: nobody waits for this answer
            pass

    async def encode(self, text: str, add_special_tokens: bool = True, *, client: Hashable = None,
                     max_tokens: int = 0) -> list[int]:
        if max_tokens:
            return await self._run(self.tokenizer.encode, text, add_special_tokens, max_tokens, client=client)
        return await self._run(self.tokenizer.encode, text, add_special_tokens, client=client)

    async def render_chat(self, messages: Iterable[Any], add_generation_prompt: bool = True,
                          template_kwargs: dict[str, Any] | None = None, *, client: Hashable = None) -> tuple[str, list[int]]:
        # copy the outer list now: the caller may mutate it while the job waits
        return await self._run(self.tokenizer.render_chat, list(messages) if isinstance(messages, (list, tuple)) else messages,
                               add_generation_prompt, template_kwargs, client=client)

    def close(self) -> None:
        """Drop queued jobs, refuse new ones, let running ones finish in the background. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            dropped = [job for q in self._waiting.values() for job in q]
            self._waiting.clear()
            self._queued_total = 0
        for job in dropped:
            try:
                job.loop.call_soon_threadsafe(_settle, job.future, None, RuntimeError("tokenizer pool is closed"))
            except RuntimeError:
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "TokenizerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
