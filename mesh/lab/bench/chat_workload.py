"""Chat traffic's shape for ``mesh bench http --path /v1/chat/completions``: many multi-turn conversations
that share one fleet-wide system prompt, instead of one repeated body.

:func:`chat_bodies` builds ``conversations`` x ``turns`` request bodies. Every conversation starts with the
same system prompt; turn ``t`` re-sends the whole history (system, the user messages and assistant answers
of the turns before) plus a new user message, as a chat client does. User messages and answers are distinct
pseudo-random text (seeded). Sizes: the system prompt is 30 % of ``prompt_tokens``, and each user message
and answer ``(prompt_tokens - system) / turns`` tokens, so the prompts of one conversation grow from about
half ``prompt_tokens`` to about 1.5x and average ``prompt_tokens`` (plus the template's few tokens a message).

The list is ordered turn by turn (turn 1 of every conversation, then turn 2 ...), so a conversation's next
turn comes ``conversations`` requests after its previous one (choose ``conversations`` well above the
concurrency: a next turn sent before the previous one was answered is not how people chat). The first user
message of each conversation holds :data:`PASS_MARKER`, which the load generator replaces by its pass over
the list (``p0``, ``p1`` ...): every pass is fresh conversations (no body is ever sent twice) that share the
system prompt, as real traffic does, instead of repeats that any cache would answer whole.

``CHATML_TEMPLATE`` / ``CHATML_TOKENS``: the chat template ``--tokenizer builtin`` gets (Qwen2's ChatML,
its two control tokens added to the shipped vocabulary as special tokens): the system prompt comes first,
so a fleet-wide system prompt is a shared prefix (Mistral's own templates fold it into the last user turn).
"""

from __future__ import annotations

import json
from collections.abc import Callable

__all__ = ["PASS_MARKER", "CHATML_TEMPLATE", "CHATML_TOKENS", "MAX_CONVERSATIONS", "MAX_TURNS", "chat_bodies",
           "check_shape", "mark_pass"]

PASS_MARKER = "@@pass@@"  # plain ASCII: JSON encodes it as itself, so the generator replaces bytes
MAX_CONVERSATIONS = 10_000
MAX_TURNS = 64
SYSTEM_SHARE = 0.3

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
# Qwen2-7B-Instruct's template (tests/data/chat_templates/qwen2_chatml.jinja)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n"
    "' }}{% endif %}")


def check_shape(conversations: int, turns: int, prompt_tokens: int) -> None:
    """ValueError naming the field for a shape this module does not build."""
    for name, v, hi in (("conversations", conversations, MAX_CONVERSATIONS), ("turns", turns, MAX_TURNS),
                        ("prompt_tokens", prompt_tokens, 1 << 20)):
        if type(v) is not int or not 1 <= v <= hi:
            raise ValueError(f"{name}: expected an integer in 1..{hi}, got {v!r}")
    if (prompt_tokens - round(prompt_tokens * SYSTEM_SHARE)) // turns < 1:
        raise ValueError(f"turns: {turns} turns leave no tokens for a user message of a {prompt_tokens}-token prompt")


def chat_bodies(text: Callable[[int, int], str], *, prompt_tokens: int, conversations: int, turns: int,
                model: str, max_new_tokens: int, stream: bool) -> list[bytes]:
    """``conversations`` x ``turns`` ``/v1/chat/completions`` bodies (see the module docstring).
    ``text(n_tokens, seed)``: text of about ``n_tokens`` tokens, different for every seed."""
    check_shape(conversations, turns, prompt_tokens)
    system_n = round(prompt_tokens * SYSTEM_SHARE)
    turn_n = (prompt_tokens - system_n) // turns
    system = {"role": "system", "content": text(system_n, 0)}
    histories = [[system] for _ in range(conversations)]
    out: list[bytes] = []
    for t in range(turns):
        for j, msgs in enumerate(histories):
            if t:
                msgs.append({"role": "assistant", "content": text(turn_n, 1 + 2 * (j * turns + t))})
            user = text(turn_n, 2 + 2 * (j * turns + t))
            msgs.append({"role": "user", "content": f"[{PASS_MARKER} c{j}] {user}" if t == 0 else user})
            out.append(json.dumps({"model": model, "messages": msgs, "max_tokens": max_new_tokens, "stream": stream},
                                  separators=(",", ":"), ensure_ascii=False).encode())
    return out


def mark_pass(body: bytes, n: int, marker: bytes = PASS_MARKER.encode()) -> bytes:
    """``body`` as sent on pass ``n`` over the list (the marker replaced by ``p<n>``)."""
    return body.replace(marker, b"p%d" % n)
