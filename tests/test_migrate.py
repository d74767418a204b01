"""mesh.broker_core.migrate on its own: which streams can be continued, and the continuation built
(issue 31 item 4); the ``--max-migrations`` flag's checks."""

from __future__ import annotations

import pytest

from mesh import protocol as P
from mesh.broker_core import migrate
from mesh.config import BrokerSettings, build
from mesh.errors import ConfigError


def _sub(*, params: dict | None = None, text: str | None = None, idempotent: bool = True, **extra) -> P.Submit:
    """A SUBMIT of prompt [1, 2, 3] (or ``text``), 10 new tokens; ``extra``: more body fields."""
    body = {**P.submit_body("r", input_ids=None if text else [1, 2, 3], text=text, idempotent=idempotent,
                            params={"max_new_tokens": 10, **(params or {})}), **extra}
    sub = P.submit_of_body(body, P.pack(body))
    assert isinstance(sub, P.Submit), sub
    return sub


def _chunk(ids, text: str | None = None) -> bytes:
    d = {"token_ids": ids}
    if text is not None:
        d["text"] = text
    return P.pack(d)


@pytest.mark.parametrize("kw, reason", [
    ({"idempotent": False}, "not_idempotent"),
    ({"params": {"json_schema": "{}"}}, "constrained"),
    ({"params": {"regex": "a+"}}, "constrained"),
    ({"params": {"ebnf": "root ::= 'a'"}}, "constrained"),
    ({"params": {"structural_tag": "{}"}}, "constrained"),
    ({"params": {"stop_regex": "x"}}, "constrained"),
    ({"params": {"n": 3}}, "n"),
    ({"params": {"presence_penalty": 0.1}}, "penalties"),
    ({"params": {"repetition_penalty": 1.2}}, "penalties"),
    ({"params": {"n": 1, "frequency_penalty": 0, "repetition_penalty": 1, "json_schema": None, "temperature": 0.7}}, None),
])
def test_refusal_names_why_a_stream_cannot_be_continued(kw, reason):
    assert migrate.refusal(_sub(**kw)) == reason


def test_a_continuation_is_the_prompt_plus_the_tokens_streamed_with_fewer_new_tokens():
    sub = _sub(params={"min_new_tokens": 5, "temperature": 0.5}, deadline_ms=5000, model="m")
    new, produced = migrate.continuation(sub, [_chunk([7, 8], " a b"), _chunk([9], " c")])
    assert produced == 3 and new.input_ids == [1, 2, 3, 7, 8, 9] and new.max_new_tokens == 7
    assert new.params == {"max_new_tokens": 7, "min_new_tokens": 2, "temperature": 0.5}
    assert (new.rid, new.deadline_ms, new.model, new.stream) == ("r", 5000, "m", True)
    assert P.decode_client([P.CLIENT_HEADER, bytes([P.Cmd.C_SUBMIT]), new.raw]).input_ids == new.input_ids  # what the worker gets
    text, _ = migrate.continuation(_sub(text="Once"), [_chunk([7], " upon")])
    assert text.text == "Once upon" and text.input_ids is None


@pytest.mark.parametrize("chunks, params, body, reason", [
    ([_chunk([1] * 10)], {}, {}, "exhausted"),
    ([_chunk([1], " the end")], {"stop": ["end."]}, {}, "stop_strings"),  # " the end" + "." would stop
    ([_chunk([1])], {"stop": "x"}, {}, "stop_strings"),  # no text to check against
    ([P.pack({"text": "t"})], {}, {}, "no_token_ids"),
    ([P.pack({"token_ids": None})], {}, {}, "no_token_ids"),
    ([P.pack([1])], {}, {}, "bad_chunk"),
    ([b"\xc1"], {}, {}, "bad_chunk"),
    ([_chunk([-1])], {}, {}, "bad_chunk"),
    ([_chunk(["a"])], {}, {}, "bad_chunk"),
    ([_chunk([1])], {}, {"passthrough": {"path": "/v1/responses", "method": "POST", "body": b"{}"}}, "passthrough"),
])
def test_a_continuation_that_would_not_be_exact_is_refused_by_name(chunks, params, body, reason):
    assert migrate.continuation(_sub(params=params, **body), chunks) == reason


def test_a_continuation_past_the_prompt_limits_is_refused_not_raised():
    sub = _sub(params={"max_new_tokens": P.MAX_NEW_TOKENS})
    assert migrate.continuation(sub, [_chunk([2**32])]) == "bad_chunk"  # a token id past the wire's range
    assert migrate.continuation(sub, [_chunk([1, 2])])[1] == 2
    assert migrate.continuation(sub, []) == (sub, 0)  # nothing streamed since: the same request


def test_usage_counts_the_replayed_tokens_as_completion():
    assert migrate.continued_usage({"prompt_tokens": 13, "completion_tokens": 2, "cached_tokens": 12}, 10) == \
        {"prompt_tokens": 3, "completion_tokens": 12, "cached_tokens": 12}
    odd = {"prompt_tokens": "x", "completion_tokens": 1}
    assert migrate.continued_usage(odd, 3) is odd


@pytest.mark.parametrize("value", [-1, 11, "two", 1.5])
def test_max_migrations_is_checked_at_startup_naming_the_field(value):
    with pytest.raises(ConfigError, match="max_migrations"):
        build(BrokerSettings, {"max_migrations": value})
    assert build(BrokerSettings, {"max_migrations": 0}).max_migrations == 0
