"""Continuing a stream on another worker when its worker is lost mid-stream (pure: no I/O, no clock).

A streamed request whose worker is lost after its first chunk (its connection dropped, its
heartbeats stopped, or its adapter reported that the engine failed mid-stream) is not ended with
``worker_lost`` when it can be continued exactly: the broker sends another worker the prompt
*plus the tokens already streamed* (the engine recomputes them as prefill, mostly from its prefix
cache) with ``max_new_tokens`` reduced by what was produced, and the client's stream goes on with
the next ``seq``. :func:`continuation` builds that request; :func:`refusal` says, once per request
at intake, why one cannot be continued:

* ``not_idempotent``: the client forbade re-dispatch;
* ``constrained``: ``json_schema``, ``regex``, ``ebnf``, ``structural_tag``, ``stop_regex``,
  a ``grammar`` or a ``response_format``: the grammar's state lives in the lost engine;
* ``n``: several choices per request;
* ``penalties``: ``frequency_penalty`` / ``presence_penalty`` / ``repetition_penalty`` count the
  *output* tokens, which a continuation would read as prompt;
* ``passthrough``: a request the engine's own OpenAI server answers (its body is not ours to extend).

and, at the loss, :func:`continuation`:

* ``stop_strings``: ``stop`` strings where the text streamed so far ends with the beginning of one
  (the engine would miss a stop string straddling the cut), or where the chunks carried no text;
* ``no_token_ids``: the chunks carried no token ids (the count to deduct is unknown);
* ``exhausted``: every token was already streamed (the engine died before its FINAL);
* ``bad_chunk``: a chunk that cannot be read back (not a map, token ids out of range);
* ``too_many_chunks``: more chunks than ``max_new_tokens`` (a flooding worker; they are not kept).
"""

from __future__ import annotations

from typing import Any

from mesh import protocol as P
from mesh.errors import ProtocolError

__all__ = ["CONSTRAINED_PARAMS", "refusal", "continuation", "continued_usage"]

#: sampling parameters whose state the lost engine held: such a request is not continued
CONSTRAINED_PARAMS = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex", "grammar", "response_format")
_PENALTIES = (("frequency_penalty", 0), ("presence_penalty", 0), ("repetition_penalty", 1))


def _set(v: Any) -> bool:
    return v not in (None, "", [], (), {})


def refusal(sub: P.Submit) -> str | None:
    """Why ``sub`` cannot be continued on another worker (None: it can)."""
    if not sub.idempotent:
        return "not_idempotent"
    p = sub.params
    if any(_set(p.get(k)) for k in CONSTRAINED_PARAMS):
        return "constrained"
    n = p.get("n")
    if n is not None and n != 1:
        return "n"
    if any(p.get(k) not in (None, neutral) for k, neutral in _PENALTIES):
        return "penalties"
    return None


def _stops(params: dict) -> list[str]:
    s = params.get("stop")
    if isinstance(s, str):
        return [s] if s else []
    return [x for x in s if isinstance(x, str) and x] if isinstance(s, list) else []


def _straddles(text: str, stops: list[str]) -> bool:
    """True when ``text`` ends with a proper beginning of a stop string."""
    return any(text.endswith(s[:k]) for s in stops for k in range(1, len(s)))


def continuation(sub: P.Submit, chunks: list[bytes]) -> tuple[P.Submit, int] | str:
    """The request that continues ``sub`` after ``chunks`` (the CHUNK payloads streamed since it
    was sent) and how many tokens those held; or why it cannot be (a refusal reason)."""
    if sub.passthrough is not None:
        return "passthrough"
    ids: list[int] = []
    texts: list[str] = []
    try:
        body = P.unpack(sub.raw)
        for c in chunks:
            d = P.unpack(c)
            t = d.get("token_ids")
            if type(t) is not list:
                return "no_token_ids"
            ids += t
            x = d.get("text")
            texts.append(x if type(x) is str else "")
    except (ProtocolError, AttributeError):
        return "bad_chunk"
    if not isinstance(body, dict):
        return "bad_chunk"
    if not ids:  # nothing more since it was sent (or continued): the same request again
        return "no_token_ids" if any(texts) else (sub, 0)
    produced = len(ids)
    remaining = sub.max_new_tokens - produced
    if remaining <= 0:
        return "exhausted"
    text = "".join(texts)
    stops = _stops(sub.params)
    if stops and (not text or _straddles(text, stops)):
        return "stop_strings"
    if sub.input_ids is not None:
        body["input_ids"] = list(sub.input_ids) + ids
    elif text:
        body["text"] = (sub.text or "") + text
    else:
        return "no_text"
    params = dict(sub.params)
    params["max_new_tokens"] = remaining
    mn = params.get("min_new_tokens")
    if type(mn) is int and mn > 0:
        params["min_new_tokens"] = max(0, mn - produced)
    body["params"] = params
    raw = P.pack(body)
    new = P.submit_of_body(body, raw)
    if isinstance(new, ProtocolError):  # e.g. a prompt past the wire limits
        return "bad_chunk"
    return new, produced


def continued_usage(usage: dict, produced: int) -> dict:
    """The FINAL's usage as the client's request saw it: the tokens streamed before the last
    continuation were sent as prompt, they are completion tokens."""
    pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(pt) is not int or type(ct) is not int:
        return usage
    return {**usage, "prompt_tokens": max(0, pt - produced), "completion_tokens": ct + produced}
