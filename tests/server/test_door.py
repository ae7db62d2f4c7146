"""Checks at the door: lone surrogates named by their field, long echoes cut."""
from __future__ import annotations

import json

import pytest

from guided.errors import InvalidRequestError
from guided.server.door import MAX_ERROR_CHARS, check_unicode, clip


def check(value) -> None:
    check_unicode(json.dumps(value).encode(), value)


@pytest.mark.parametrize("value,param", [
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ({"prompt": ["ok", "x\udfff"]}, "prompt[1]"),
    ({"tools": [{"function": {"parameters": {"properties": {"p": {"enum": ["\udc00"]}}}}}]},
     "tools[0].function.parameters.properties.p.enum[0]"),
    ("\ud83d", None),  # a high surrogate without its low half
])
def test_a_lone_surrogate_is_named_by_its_field(value, param):
    with pytest.raises(InvalidRequestError, match="lone UTF-16 surrogate") as error:
        check(value)
    assert error.value.param == param


def test_a_surrogate_in_a_key_is_refused_without_echoing_it():
    with pytest.raises(InvalidRequestError) as error:
        check({"messages": [{"a\ud800": 1}]})
    assert error.value.param == "messages[0]"
    str(error.value).encode("utf-8")  # the message itself is valid Unicode


def test_paired_surrogates_and_plain_text_pass():
    check({"messages": [{"role": "user", "content": "smile \U0001F600 é 日本"}]})  # \ud83d\ude00
    check({"prompt": [1, 2, 3], "n": None, "x": [[["deep"]]]})


def test_clip_keeps_both_ends_within_the_limit():
    assert clip("short") == "short"
    long = "The model `" + "m" * 1_000_000 + "` does not exist"
    cut = clip(long)
    assert len(cut) < MAX_ERROR_CHARS + 100
    assert cut.startswith("The model `mmm") and cut.endswith("` does not exist")
    assert "characters cut" in cut
