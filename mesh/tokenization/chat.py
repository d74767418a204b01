"""Rendering chat messages with a model's Jinja chat template, exactly as ``transformers`` does.

The environment is the one ``transformers.utils.chat_template_utils`` builds for ``apply_chat_template``:
an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that does not HTML-escape (``json.dumps`` with ``ensure_ascii=False`` and the
``indent`` / ``separators`` / ``sort_keys`` options), and the globals ``raise_exception``, ``strftime_now``,
a restricted ``dict`` and a ``namespace`` that refuses underscore names. The template sees ``messages``,
``add_generation_prompt``, ``tools=None``, ``documents=None`` and the named special tokens (``bos_token``,
``eos_token``, ...), as ``apply_chat_template(..., tokenize=False)`` passes them. Messages are normalised as
transformers normalises them: keys whose value is None are dropped, and a message's reasoning given as
``reasoning`` or ``thinking`` is also passed as ``reasoning_content`` (and ``thinking``).

Content given as a list of parts (the OpenAI form ``[{"type": "text", "text": ...}]``):

- a template that iterates over a message's content (detected from its syntax tree, as vLLM's
  ``_detect_content_format`` and SGLang's port of it do) gets the list unchanged;
- a template that only reads content as a string gets the text parts joined: with ``"\\n"`` by default, as
  vLLM does for its "string" content format; SGLang joins them with ``" "`` instead, so the separator is a
  parameter (``text_part_separator``): a front end that forwards chat messages to SGLang engines, which
  render them again, should pass ``" "`` so its routing key matches the prompt the engine builds.
  ``transformers`` itself does neither: it hands the list to the template, which then fails (``"[INST] " +
  list``) or prints the list's Python repr (``{{ message['content'] }}``);
- a part that is not text (image, audio, file...) is refused with ``ValueError`` naming the message and part
  index: mesh routes text-only models, and silently dropping media would route a different prompt.

Encoding: the rendered prompt is encoded with ``add_special_tokens=False``, as ``apply_chat_template(...,
tokenize=True)`` does, because the template itself writes BOS (``{{ bos_token }}``) and every other control
token; a plain encode would add a second BOS for tokenizers whose post-processor adds one.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Iterable

__all__ = ["ChatTemplate", "ContentFormat", "detect_content_format", "normalize_messages"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ContentFormat:
    STRING = "string"  # the template reads message content as a string
    OPENAI = "openai"  # the template iterates over a list of content parts


def _jinja():
    try:
        import jinja2  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("chat templates need jinja2>=3.1 (pip install 'mesh-router[tokenizers]')") from exc
    return jinja2


def _build_environment():
    """The sandboxed environment transformers' ``_cached_compile_jinja_template`` builds (less its assistant
    tracker extension, which only serves ``return_assistant_tokens_mask``)."""
    jinja2 = _jinja()
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes <, >, & and ' and sorts keys; chat templates expect neither
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        # ``dict(...)`` without exposing the dict type itself to the template
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # namespaces refuse underscore-prefixed names, so a template cannot reach CPython internals through them
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def _is_content_expr(node: Any, content_vars: set[str]) -> bool:
    """True for ``x['content']``, ``x.content`` or a name assigned from one of them."""
    nodes = _jinja().nodes
    if isinstance(node, nodes.Getitem):
        if isinstance(node.arg, nodes.Slice):  # ``message['content'][1:]``
            return _is_content_expr(node.node, content_vars)
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Name):
        return node.name in content_vars
    if isinstance(node, (nodes.Filter, nodes.Test)):  # e.g. ``message['content'] | list``
        return node.node is not None and _is_content_expr(node.node, content_vars)
    return False


def detect_content_format(env: Any, source: str) -> str:
    """``"openai"`` when the template loops over a message's content (``{% for part in message['content'] %}``,
    directly or through a variable set from it), else ``"string"``. The same rule as vLLM and SGLang."""
    nodes = _jinja().nodes
    ast = env.parse(source)
    content_vars: set[str] = set()
    for assign in ast.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _is_content_expr(assign.node, set()):
            content_vars.add(assign.target.name)
    for loop in ast.find_all(nodes.For):
        if _is_content_expr(loop.iter, content_vars):
            return ContentFormat.OPENAI
    return ContentFormat.STRING


def _check_parts(parts: list, mi: int) -> list[dict]:
    for pi, part in enumerate(parts):
        if not isinstance(part, dict):
            raise ValueError(f"messages[{mi}].content[{pi}]: a content part must be an object, got {type(part).__name__}")
        kind = part.get("type", "text" if "text" in part else None)
        if kind != "text":
            raise ValueError(f"messages[{mi}].content[{pi}]: content part type {kind!r} is not supported "
                             "(only 'text' parts; this model is routed as text-only)")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{mi}].content[{pi}]: a text part needs a string 'text'")
    return parts


def normalize_messages(messages: Iterable[Any], content_format: str, text_part_separator: str = "\n") -> list[dict]:
    """Validate and normalise chat messages for a template of ``content_format``; a fresh copy, never the input."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise ValueError("messages must be a list of message objects")
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict] = []
    for mi, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{mi}]: must be an object, got {type(msg).__name__}")
        if not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{mi}]: 'role' must be a string")
        m = {k: v for k, v in msg.items() if v is not None}  # as transformers: a None value is an absent key
        content = m.get("content")
        if isinstance(content, list):
            parts = [dict(p) if isinstance(p, dict) else p for p in content]
            _check_parts(parts, mi)
            if content_format == ContentFormat.STRING:
                m["content"] = text_part_separator.join(p["text"] for p in parts)
            else:
                m["content"] = parts
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{mi}]: 'content' must be a string or a list of content parts")
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """A compiled chat template plus the special tokens it is rendered with. Thread-safe: rendering shares no
    mutable state, so the tokenizer pool's threads can render concurrently."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None,
                 additional_special_tokens: Iterable[str] = (), origin: str = "chat template",
                 text_part_separator: str = "\n") -> None:
        jinja2 = _jinja()
        self.source = source
        self.origin = origin
        self.text_part_separator = text_part_separator
        self._env = _build_environment()
        try:
            self._template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            from mesh.errors import ConfigError

            raise ConfigError(f"{origin}: not a valid Jinja template (line {exc.lineno}): {exc.message}") from exc
        self.content_format = detect_content_format(self._env, source)
        self._kwargs: dict[str, Any] = dict(special_tokens or {})
        extra = list(additional_special_tokens)
        if extra:
            self._kwargs["additional_special_tokens"] = extra

    def render(self, messages: Iterable[Any], add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The prompt text for ``messages``. Raises ``ValueError`` for malformed messages and for errors the
        template raises itself (``raise_exception``, say roles that do not alternate)."""
        jinja2 = _jinja()
        msgs = normalize_messages(messages, self.content_format, self.text_part_separator)
        kwargs = {**self._kwargs, **template_kwargs}
        kwargs.setdefault("tools", None)
        kwargs.setdefault("documents", None)
        try:
            return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt, **kwargs)
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: say str + list inside the template
            raise ValueError(f"chat template: {exc}") from exc
