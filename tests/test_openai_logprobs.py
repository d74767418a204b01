"""SGLang ``meta_info`` logprobs become OpenAI's completions and chat shapes (pure unit checks)."""

from __future__ import annotations

import math

from mesh.openai_logprobs import FLOOR, TextOffset, chat_logprobs, completion_logprobs, has_logprobs

META = {
    "output_token_logprobs": [[-0.25, 11, " lorem"], [-1.5, 12, " ipsum"]],
    "output_top_logprobs": [[[-0.25, 11, " lorem"], [-2.0, 13, " dolor"]],
                            [[-0.5, 14, " sit"], [-1.5, 12, " ipsum"], [-1.75, 15, " sit"]]],
    "prompt_tokens": 3,
}


def test_completions_shape_with_offsets_and_top_dicts():
    lp = completion_logprobs(META)
    assert lp == {"tokens": [" lorem", " ipsum"], "token_logprobs": [-0.25, -1.5],
                  "top_logprobs": [{" lorem": -0.25, " dolor": -2.0}, {" sit": -0.5, " ipsum": -1.5}],  # first " sit" kept
                  "text_offset": [0, 6]}
    off = TextOffset(10)  # a stream: the second chunk starts after text already sent
    assert completion_logprobs({"output_token_logprobs": [[-0.1, 1, "ab"]]}, offset=off)["text_offset"] == [10]
    assert completion_logprobs({"output_token_logprobs": [[-0.1, 2, "c"]]}, offset=off)["text_offset"] == [12]
    assert off.at == 13


def test_chat_shape_with_bytes():
    lp = chat_logprobs(META)
    assert lp["refusal"] is None
    first, second = lp["content"]
    assert first == {"token": " lorem", "logprob": -0.25, "bytes": list(b" lorem"),
                     "top_logprobs": [{"token": " lorem", "logprob": -0.25, "bytes": list(b" lorem")},
                                      {"token": " dolor", "logprob": -2.0, "bytes": list(b" dolor")}]}
    assert [t["token"] for t in second["top_logprobs"]] == [" sit", " ipsum", " sit"]  # chat keeps every alternative
    assert chat_logprobs({"output_token_logprobs": [[-1.0, 5, "é"]]})["content"][0] == {
        "token": "é", "logprob": -1.0, "bytes": [0xC3, 0xA9], "top_logprobs": []}


def test_no_logprobs_is_none_and_no_top_lists_is_null_or_empty():
    for meta in (None, {}, {"output_token_logprobs": None}, "x", {"output_top_logprobs": []}):
        assert completion_logprobs(meta) is None and chat_logprobs(meta) is None and not has_logprobs(meta)
    only = {"output_token_logprobs": [[-0.5, 1, "a"]]}
    assert completion_logprobs(only)["top_logprobs"] is None
    assert chat_logprobs(only)["content"][0]["top_logprobs"] == []
    assert completion_logprobs({"output_token_logprobs": []}) == {"tokens": [], "token_logprobs": [], "top_logprobs": None,
                                                                   "text_offset": []}


def test_engine_garbage_never_raises():
    meta = {"output_token_logprobs": [[None, 1, "a"], [float("-inf"), 2, "b"], [math.nan, 3, None], "junk", [1], [-0.5, 4]],
            "output_top_logprobs": [None, "junk", [[-1, 9, "z"], "bad"]]}
    lp = completion_logprobs(meta)
    assert lp["tokens"] == ["a", "b", "", ""] and lp["token_logprobs"] == [FLOOR, FLOOR, FLOOR, -0.5]
    assert lp["top_logprobs"] == [{}, {}, {"z": -1.0}, {}]
    assert len(chat_logprobs(meta)["content"]) == 4


def test_missing_text_is_decoded_when_a_decoder_is_given():
    meta = {"output_token_logprobs": [[-0.5, 7, None], [-0.6, 8, None]], "output_top_logprobs": [[[-0.5, 7, None]], []]}

    def decode(ids: list[int]) -> str:
        if ids == [8]:
            raise ValueError("unknown id")
        return f"<{ids[0]}>"

    lp = completion_logprobs(meta, decode=decode)
    assert lp["tokens"] == ["<7>", ""] and lp["top_logprobs"] == [{"<7>": -0.5}, {}]
    assert chat_logprobs(meta, decode=decode)["content"][0]["top_logprobs"][0]["token"] == "<7>"
