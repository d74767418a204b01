"""What passes through to the engine's own OpenAI server, and the routing key of such a request.

Pure (no I/O). mesh renders completions and chat itself (:mod:`mesh.params`); what it does not
render goes to the engine unchanged (SUBMIT ``passthrough``, :mod:`mesh.adapters.passthrough`):

* a chat or completions request with any of :data:`PASSTHROUGH_FIELDS` (tool calling, reasoning
  options, chat template arguments), with ``n`` > 1, or (chat) with a message that carries tool
  calls or a tool result;
* every request to :data:`PASSTHROUGH_ENDPOINTS` (Responses, embeddings, rerank, score).

Routing still uses the prompt. :func:`routing_text` is the text a request is keyed by (the
messages, the input, the query and documents); a chat request is rendered with its tools by the
model's chat template when the front door has it (as the engine renders it: SGLang passes each
tool's ``function`` object and parses the JSON ``arguments`` of earlier tool calls,
:func:`template_tools`, :func:`template_messages`), else by :func:`render_chat_text`, a plain
rendering in which each turn extends the previous one (so an agent's next turn shares its prefix).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["NO_ENGINE_MESSAGE", "PASSTHROUGH_FIELDS", "PASSTHROUGH_ENDPOINTS", "passthrough_reason", "routing_text", "render_chat_text",
           "template_tools", "template_messages", "template_kwargs"]

#: chat / completions fields mesh does not render: their presence sends the request through
PASSTHROUGH_FIELDS = frozenset({
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
    "reasoning_effort", "separate_reasoning", "stream_reasoning", "chat_template_kwargs", "reasoning",
    "continue_final_message", "documents",
})
#: endpoints served only by the engine
PASSTHROUGH_ENDPOINTS = ("/v1/responses", "/v1/embeddings", "/v1/rerank", "/v1/score")
# chat template arguments a client may not set (the renderer's own)
_RESERVED_TEMPLATE_KW = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"})
_MAX_TEMPLATE_KW = 32
_MAX_KEY_CHARS = 1 << 20  # routing needs a prefix: longer inputs are keyed by their first MiB
_MAX_MESSAGES = 10_000
#: what simulated workers (no engine behind them) answer a pass-through request with (bad_request)
NO_ENGINE_MESSAGE = ("pass-through (tools, reasoning options, n > 1, Responses, embeddings, rerank, score) needs an engine: "
                     "this simulated worker has none; use mesh attach in front of SGLang or vLLM (or mesh stub-sglang)")


def passthrough_reason(body: dict[str, Any], *, chat: bool) -> str | None:
    """Why a chat / completions body goes to the engine (the field that sends it), or None."""
    for k in PASSTHROUGH_FIELDS:
        if body.get(k) is not None:
            return k
    n = body.get("n")
    if type(n) is int and n > 1:
        return "n"
    if chat:
        msgs = body.get("messages")
        if type(msgs) is list:
            for m in msgs:
                if isinstance(m, dict) and (m.get("tool_calls") or m.get("role") in ("tool", "function")):
                    return "messages"
    return None


def _texts(v: Any, field: str, out: list[str]) -> None:
    """The strings of an input field: a string, a list of strings, or of objects with text."""
    if isinstance(v, str):
        out.append(v)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            if isinstance(x, str):
                out.append(x)
            elif isinstance(x, dict):
                for k in ("text", "content", "input", "output", "arguments"):
                    if x.get(k) is not None:
                        _texts(x[k], f"{field}[{i}].{k}", out)
            elif isinstance(x, list) or (type(x) is int and not isinstance(x, bool)):
                out.append(json.dumps(x))
            elif x is not None:
                raise ValueError(f"{field}[{i}]: must be text, a list of text or of token ids")
    elif v is not None:
        raise ValueError(f"{field}: must be a string or a list")


_KEY_FIELDS = {
    "/v1/responses": ("instructions", "input"),
    "/v1/embeddings": ("input",),
    "/v1/rerank": ("query", "documents"),
    "/v1/score": ("query", "text_1", "items", "text_2"),
}


def routing_text(path: str, body: dict[str, Any]) -> str:
    """The text a pass-through endpoint's request is routed by. Raises ValueError naming a field
    of the wrong type, or when the request holds no text at all."""
    out: list[str] = []
    for k in _KEY_FIELDS[path]:
        _texts(body.get(k), k, out)
    text = "\n".join(out)[:_MAX_KEY_CHARS]
    if not text:
        raise ValueError(f"{' or '.join(_KEY_FIELDS[path])}: the request holds no input text")
    return text


def template_tools(body: dict[str, Any]) -> list[Any] | None:
    """The tools a chat template is given, as SGLang passes them (each tool's ``function``; none
    when ``tool_choice`` is ``"none"``). Raises ValueError for a ``tools`` that is not a list."""
    tools = body.get("tools")
    if tools is None:
        return None
    if type(tools) is not list:
        raise ValueError("tools: must be a list")
    if body.get("tool_choice") == "none" or not tools:
        return None
    return [t["function"] if isinstance(t, dict) and isinstance(t.get("function"), dict) else t for t in tools]


def template_messages(msgs: list[Any]) -> list[Any]:
    """Messages as the engines give them to the template: a tool call's JSON ``arguments`` parsed."""
    out = []
    for m in msgs:
        if isinstance(m, dict) and isinstance(m.get("tool_calls"), list):
            calls = []
            for c in m["tool_calls"]:
                f = c.get("function") if isinstance(c, dict) else None
                if isinstance(f, dict) and isinstance(f.get("arguments"), str):
                    try:
                        c = {**c, "function": {**f, "arguments": json.loads(f["arguments"])}}
                    except ValueError:
                        pass
                calls.append(c)
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs`` (SGLang and vLLM pass them to the template). Raises ValueError."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if type(kw) is not dict or len(kw) > _MAX_TEMPLATE_KW or not all(type(k) is str for k in kw):
        raise ValueError(f"chat_template_kwargs: must be an object of at most {_MAX_TEMPLATE_KW} entries")
    bad = sorted(set(kw) & _RESERVED_TEMPLATE_KW)
    if bad:
        raise ValueError(f"chat_template_kwargs: {bad[0]} is the renderer's own")
    return kw


def render_chat_text(msgs: Any, tools: list[Any] | None) -> str:
    """The plain rendering of a chat with tools (no chat template): the tools, then each message with
    its tool calls, then ``assistant:``. Raises ValueError naming a malformed message."""
    if type(msgs) is not list or not msgs:
        raise ValueError("messages: must be a non-empty list")
    if len(msgs) > _MAX_MESSAGES:
        raise ValueError(f"messages: at most {_MAX_MESSAGES} entries")
    parts = [f"tools: {json.dumps(tools, sort_keys=True, ensure_ascii=False)}\n"] if tools else []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: must be an object")
        role = m.get("role")
        if not isinstance(role, str) or not role or len(role) > 64:
            raise ValueError(f"messages[{i}].role: must be a non-empty string")
        texts: list[str] = []
        _texts(m.get("content"), f"messages[{i}].content", texts)
        line = f"{role}: {''.join(texts)}"
        if m.get("tool_calls"):
            line += " " + json.dumps(template_messages([m])[0]["tool_calls"], sort_keys=True, ensure_ascii=False)
        parts.append(line + "\n")
    return ("".join(parts) + "assistant:")[:_MAX_KEY_CHARS]
