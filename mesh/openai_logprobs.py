"""SGLang logprobs -> OpenAI logprobs (pure: no I/O).

SGLang's ``meta_info`` (``return_logprob``) holds positional lists, one entry per token:

* ``output_token_logprobs``: ``[logprob, token_id, text]`` triples (``text`` is null unless
  ``return_text_in_logprobs``; the first *input* token's logprob is null);
* ``output_top_logprobs`` (with ``top_logprobs_num`` > 0): per position a list of such triples,
  best first (or null);
* ``input_token_logprobs`` / ``input_top_logprobs`` likewise for the prompt (not shown by the
  OpenAI endpoints, which have no ``echo`` here).

OpenAI wants, per choice:

* completions: ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}``
  (``top_logprobs`` null when no alternatives were asked for);
* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}], "refusal": null}``.

The input is whatever an engine sent, so nothing here raises: malformed entries are skipped, a
missing text becomes ``decode([token_id])`` when a decoder is given (else ``""``), and a null or
non-finite logprob becomes -9999.0 (OpenAI's own floor for "very unlikely"; JSON has no -inf).
Streams convert each chunk's slice on its own; :class:`CompletionOffsets` carries
``text_offset`` across chunks.
"""

from __future__ import annotations

import math
from typing import Any, Callable

__all__ = ["LOGPROB_KEYS", "FLOOR", "has_logprobs", "completion_logprobs", "chat_logprobs", "TextOffset"]

#: The positional meta_info lists an engine may send (SGLang names).
LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
                "input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
FLOOR = -9999.0

Decode = Callable[[list[int]], str]


def has_logprobs(meta: Any) -> bool:
    """Whether ``meta`` (a meta_info map) carries output token logprobs to convert."""
    return type(meta) is dict and type(meta.get("output_token_logprobs")) is list


def _lp(v: Any) -> float:
    if type(v) in (int, float) and math.isfinite(v):
        return float(v)
    return FLOOR


def _entry(e: Any, decode: Decode | None) -> tuple[str, float] | None:
    """One ``[logprob, token_id, text]`` triple -> (text, logprob), or None when malformed."""
    if type(e) not in (list, tuple) or len(e) < 2:
        return None
    text = e[2] if len(e) > 2 else None
    if type(text) is not str:
        tid = e[1]
        text = ""
        if decode is not None and type(tid) is int and tid >= 0:
            try:
                text = decode([tid])
            except Exception:  # a decoder's own failure on an engine's id: no text, no 500
                text = ""
    return text, _lp(e[0])


def _pairs(meta: dict, decode: Decode | None) -> tuple[list[tuple[str, float]], list[list[tuple[str, float]]] | None]:
    toks = [x for x in (_entry(e, decode) for e in meta.get("output_token_logprobs") or ()) if x is not None]
    tops_raw = meta.get("output_top_logprobs")
    if type(tops_raw) is not list or not tops_raw:
        return toks, None
    tops: list[list[tuple[str, float]]] = []
    for pos in tops_raw[:len(toks)]:
        alts = pos if type(pos) in (list, tuple) else ()
        tops.append([x for x in (_entry(e, decode) for e in alts) if x is not None])
    tops.extend([] for _ in range(len(toks) - len(tops)))
    return toks, tops


class TextOffset:
    """Where the next token's text starts in the completion text (``text_offset`` across a stream's
    chunks)."""

    __slots__ = ("at",)

    def __init__(self, at: int = 0) -> None:
        self.at = at


def completion_logprobs(meta: Any, *, decode: Decode | None = None, offset: TextOffset | None = None) -> dict[str, Any] | None:
    """The completions ``choices[].logprobs`` object for ``meta``'s output tokens, or None when it
    has none. ``offset`` (advanced here) places ``text_offset`` after text already sent."""
    if not has_logprobs(meta):
        return None
    toks, tops = _pairs(meta, decode)
    off = offset if offset is not None else TextOffset()
    text_offset = []
    for text, _ in toks:
        text_offset.append(off.at)
        off.at += len(text)
    top_dicts = None
    if tops is not None:
        top_dicts = []
        for alts in tops:
            d: dict[str, float] = {}
            for text, lp in alts:
                d.setdefault(text, lp)  # two ids with one text: keep the better-ranked one
            top_dicts.append(d)
    return {"tokens": [t for t, _ in toks], "token_logprobs": [lp for _, lp in toks], "top_logprobs": top_dicts,
            "text_offset": text_offset}


def _chat_token(text: str, lp: float) -> dict[str, Any]:
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(meta: Any, *, decode: Decode | None = None) -> dict[str, Any] | None:
    """The chat ``choices[].logprobs`` object for ``meta``'s output tokens, or None when it has none."""
    if not has_logprobs(meta):
        return None
    toks, tops = _pairs(meta, decode)
    content = []
    for i, (text, lp) in enumerate(toks):
        item = _chat_token(text, lp)
        item["top_logprobs"] = [_chat_token(t, a) for t, a in tops[i]] if tops is not None else []
        content.append(item)
    return {"content": content, "refusal": None}
