"""Generation parameters: what a SUBMIT's ``params`` map may hold, and how HTTP bodies become it.

The vocabulary is SGLang's (``/generate`` ``sampling_params`` plus a few request-level fields),
because it is the richest of the engines mesh attaches; adapters translate it for their engine
(:mod:`mesh.adapters.sglang` passes it through, :mod:`mesh.adapters.vllm` renames). The HTTP
ingress maps OpenAI completions and chat fields onto it here, and the contract is:

* every field a client sends either reaches the engine or is refused with a 400 that names it
  (:class:`ParamError`); nothing is silently dropped. The only fields accepted without effect are
  the OpenAI bookkeeping fields that never change generation (``user``, ``metadata``, ``store``,
  ``service_tier``), listed in :data:`OPENAI_NO_OPS`;
* ``max_new_tokens`` is in ``params`` only when the client gave a limit: without one the engine
  applies its own default (SGLang: 128; vLLM: the rest of the context), as it does when called
  directly;
* values are checked for type and range where a wrong one would only fail deep in the engine
  (token ids, counts, probabilities); anything structured (JSON schemas, grammars, logit bias) is
  passed as given and judged by the engine, whose 400 comes back to the client as a 400.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["SAMPLING_KEYS", "REQUEST_KEYS", "OPENAI_NO_OPS", "ParamError", "from_generate", "from_openai"]

# SGLang SamplingParams fields (sglang/srt/sampling/sampling_params.py)
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "stop_regex", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "no_stop_trim", "stream_interval",
    "logit_bias", "sampling_seed", "custom_params",
})
# Request-level /generate fields that are forwarded as they are (GenerateReqInput)
REQUEST_KEYS = frozenset({
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "lora_path",
    "extra_key", "cache_salt", "priority", "routing_key", "session_params", "session_id", "routed_dp_rank",
    "return_prompt_token_ids", "return_hidden_states",
})
OPENAI_NO_OPS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key"})  # user, prompt_cache_key: session keys
# /generate fields the ingress itself reads
_GENERATE_OWN = frozenset({"text", "input_ids", "sampling_params", "stream", "rid", "model"})  # model: a mesh extension
_OPENAI_OWN = frozenset({"model", "prompt", "messages", "stream", "stream_options"})

_MAX_STOP = 16
_OPENAI_MAX_STOP = 4  # the OpenAI API's own limit
_OPENAI_MAX_LOGPROBS = 5  # completions ``logprobs`` (the OpenAI API's own limit)
_OPENAI_MAX_TOP_LOGPROBS = 20  # chat ``top_logprobs``
_MAX_STOP_CHARS = 1024


class ParamError(ValueError):
    """A field the ingress refuses: ``field`` names it (dotted path), ``str()`` says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _num(field: str, v: Any, lo: float, hi: float) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
        raise ParamError(field, f"must be a number in [{lo:g}, {hi:g}]")
    return v


def _int(field: str, v: Any, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ParamError(field, f"must be an integer in [{lo}, {hi}]")
    return v


def _bool(field: str, v: Any) -> bool:
    if type(v) is not bool:
        raise ParamError(field, "must be true or false")
    return v


def _stop(field: str, v: Any, limit: int = _MAX_STOP) -> list[str]:
    if isinstance(v, str):
        v = [v]
    if type(v) is not list or len(v) > limit or not all(isinstance(s, str) and 0 < len(s) <= _MAX_STOP_CHARS for s in v):
        raise ParamError(field, f"must be a string or a list of at most {limit} non-empty strings")
    return v


def _token_list(field: str, v: Any) -> list[int]:
    if type(v) is not list or len(v) > 4096 or not all(type(t) is int and 0 <= t < 2**32 for t in v):
        raise ParamError(field, "must be a list of token ids")
    return v


# Checks for the fields whose wrong values would only fail deep in an engine. The rest pass as given.
_CHECKS = {
    "max_new_tokens": lambda f, v: _int(f, v, 0, 1 << 18),
    "min_new_tokens": lambda f, v: _int(f, v, 0, 1 << 18),
    "temperature": lambda f, v: _num(f, v, 0.0, 2.0),
    "top_p": lambda f, v: _num(f, v, 0.0, 1.0),
    "min_p": lambda f, v: _num(f, v, 0.0, 1.0),
    "top_k": lambda f, v: _int(f, v, -1, 1 << 20),
    "frequency_penalty": lambda f, v: _num(f, v, -2.0, 2.0),
    "presence_penalty": lambda f, v: _num(f, v, -2.0, 2.0),
    "repetition_penalty": lambda f, v: _num(f, v, 0.0, 10.0),
    "sampling_seed": lambda f, v: _int(f, v, 0, 2**63 - 1),
    "stop": _stop,
    "stop_token_ids": _token_list,
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "return_logprob": _bool,
    "return_text_in_logprobs": _bool,
    "top_logprobs_num": lambda f, v: _int(f, v, 0, 20),
    "logprob_start_len": lambda f, v: _int(f, v, -1, 1 << 22),
    "n": lambda f, v: _int(f, v, 1, 1),
}


def _put(params: dict[str, Any], key: str, field: str, v: Any) -> None:
    check = _CHECKS.get(key)
    params[key] = check(field, v) if check is not None else v


def from_generate(body: dict[str, Any]) -> dict[str, Any]:
    """SGLang ``/generate`` body -> params (``sampling_params`` keys and the request-level
    fields of :data:`REQUEST_KEYS`). Unknown fields are a :class:`ParamError`."""
    params: dict[str, Any] = {}
    sp = body.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise ParamError("sampling_params", "must be an object")
    for k, v in sp.items():
        if k not in SAMPLING_KEYS:
            raise ParamError(f"sampling_params.{k}", "is not a sampling parameter SGLang knows")
        if v is None:
            continue
        if k == "n" and (type(v) is not int or v != 1):
            raise ParamError("sampling_params.n", "must be 1 (mesh routes one sequence per request; send n requests)")
        _put(params, k, f"sampling_params.{k}", v)
    for k, v in body.items():
        if k in _GENERATE_OWN or v is None:
            continue
        if k not in REQUEST_KEYS:
            raise ParamError(k, "is not supported by mesh's /generate (multimodal inputs, embeddings and "
                                "custom logit processors are not routed)")
        _put(params, k, k, v)
    return params


def _response_format(v: Any) -> dict[str, Any]:
    """OpenAI ``response_format`` -> SGLang constrained decoding (as SGLang's OpenAI server does)."""
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise ParamError("response_format", "must be an object with a type")
    t = v["type"]
    if t == "text":
        return {}
    if t == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if t == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise ParamError("response_format.json_schema", "must be an object with a schema")
        return {"json_schema": json.dumps(js.get("schema", {}))}
    raise ParamError("response_format.type", f"must be text, json_object or json_schema, got {t!r}")


def from_openai(body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """OpenAI completions / chat body -> params. Unknown fields, and known ones mesh cannot honour
    (``n > 1``, ``best_of > 1``, ``echo``, ``suffix``, tools), are a :class:`ParamError`.

    Logprobs: completions ``logprobs`` N (0..5) and chat ``logprobs: true`` with ``top_logprobs``
    N (0..20) become SGLang's ``return_logprob``, ``top_logprobs_num`` N and
    ``return_text_in_logprobs`` (the ingress shows each token's text, as SGLang's OpenAI server)."""
    params: dict[str, Any] = {}
    wants_top = False
    for k, v in body.items():
        if k in _OPENAI_OWN or k in OPENAI_NO_OPS or v is None:
            continue
        if k in ("max_tokens", "max_completion_tokens"):
            _put(params, "max_new_tokens", k, v)
        elif k in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                   "stop_token_ids", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                   "regex", "ebnf", "json_schema", "structural_tag", "logit_bias", "stop_regex") or k in REQUEST_KEYS:
            _put(params, k, k, v)
        elif k == "stop":
            params["stop"] = _stop("stop", v, _OPENAI_MAX_STOP)
        elif k == "seed":
            _put(params, "sampling_seed", "seed", v)
        elif k in ("min_tokens",):
            _put(params, "min_new_tokens", k, v)
        elif k == "n":
            if type(v) is not int or v != 1:
                raise ParamError("n", "must be 1 (mesh routes one choice per request; send n requests)")
        elif k == "best_of" and not chat:
            if type(v) is not int or v != 1:
                raise ParamError("best_of", "must be 1")
        elif k == "echo" and not chat:
            if _bool("echo", v):
                raise ParamError("echo", "is not supported")
        elif k == "suffix" and not chat:
            if v != "":
                raise ParamError("suffix", "is not supported")
        elif k == "response_format":
            params.update(_response_format(v))
        elif k == "logprobs":
            if chat:
                if _bool("logprobs", v):
                    params.update(return_logprob=True, return_text_in_logprobs=True)
            else:  # completions: the number of alternatives per position (0: the chosen token only)
                params.update(return_logprob=True, return_text_in_logprobs=True,
                              top_logprobs_num=_int("logprobs", v, 0, _OPENAI_MAX_LOGPROBS))
        elif k == "top_logprobs" and chat:
            top = _int("top_logprobs", v, 0, _OPENAI_MAX_TOP_LOGPROBS)
            if top:
                params["top_logprobs_num"] = top
                wants_top = True
        elif k in ("tools", "functions"):
            if v:
                raise ParamError(k, "tool calling is not supported")
        elif k in ("tool_choice", "function_call"):
            if v not in ("none", "auto"):
                raise ParamError(k, "tool calling is not supported")
        elif k == "parallel_tool_calls":
            _bool(k, v)
        else:
            raise ParamError(k, f"is not a {'chat' if chat else 'completions'} field mesh knows")
    if wants_top and body.get("logprobs") is not True:
        raise ParamError("top_logprobs", "needs logprobs: true (as the OpenAI API)")
    return params
