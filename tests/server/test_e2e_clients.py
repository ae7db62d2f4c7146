"""End to end: what clients of vLLM and SGLang send, through the official openai client to the
real server and model; every constrained output validated, every refusal a 400 naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "default"
POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}
GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'
GRAMMAR_RE = r"The answer is (yes|no)\."


def _check_json(text):
    jsonschema.validate(json.loads(text), POINT)


def _check_regex(pattern):
    return lambda text: re.fullmatch(pattern, text) is not None or pytest.fail(text)


def _check_choice(options):
    return lambda text: text in options or pytest.fail(text)


CASES = [  # (extra_body, check of the output text)
    ({"guided_json": POINT}, _check_json),
    ({"structured_outputs": {"json": POINT}}, _check_json),
    ({"json_schema": json.dumps(POINT)}, _check_json),  # SGLang sends a JSON string
    ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, _check_regex(r"[0-9]{3}-[0-9]{4}")),
    ({"structured_outputs": {"regex": r"(red|green|blue)!"}}, _check_regex(r"(red|green|blue)!")),
    ({"guided_choice": ["sunny", "rainy"]}, _check_choice({"sunny", "rainy"})),
    ({"structured_outputs": {"choice": ["left", "right"]}}, _check_choice({"left", "right"})),
    ({"guided_grammar": GRAMMAR, "guided_decoding_backend": "xgrammar"}, _check_regex(GRAMMAR_RE)),
    ({"ebnf": GRAMMAR}, _check_regex(GRAMMAR_RE)),
    ({"structured_outputs": {"grammar": GRAMMAR}}, _check_regex(GRAMMAR_RE)),
]


@pytest.mark.parametrize("extra,check", CASES, ids=[next(iter(c[0])) + str(i)
                                                    for i, c in enumerate(CASES)])
def test_vllm_and_sglang_constraint_fields_on_chat(client, extra, check):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer briefly."}], temperature=0,
        max_tokens=40, extra_body=extra)
    assert r.choices[0].finish_reason == "stop", r
    check(r.choices[0].message.content)


@pytest.mark.parametrize("extra,check", CASES[::3], ids=[next(iter(c[0])) for c in CASES[::3]])
def test_vllm_and_sglang_constraint_fields_on_completions(client, extra, check):
    r = client.completions.create(model=MODEL, prompt="Q: Say something.\nA:", temperature=0,
                                  max_tokens=40, extra_body=extra)
    assert r.choices[0].finish_reason == "stop", r
    check(r.choices[0].text)


@pytest.mark.parametrize("extra,param,words", [
    ({"guided_json": POINT, "guided_regex": "a"}, "guided_regex", "at most one constraint"),
    ({"structural_tag": "{}"}, "structural_tag", "structural tags"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "whitespace"),
    ({"structured_outputs": {"jsn": POINT}}, "structured_outputs.jsn", "did you mean 'json'"),
    ({"response_fromat": {"type": "json_object"}}, "response_fromat",
     "did you mean 'response_format'"),
    ({"guided_jsn": POINT}, "guided_jsn", "did you mean 'guided_json'"),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_refused_constraint_fields_name_the_field(client, endpoint, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=4, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    error = e.value.body
    assert error["param"] == param and words in error["message"], error


def test_unknown_non_constraint_fields_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"frobnicate": 1, "cache_salt": "x"}, metadata={"k": "v"})
    assert r.choices[0].finish_reason in ("stop", "length")
