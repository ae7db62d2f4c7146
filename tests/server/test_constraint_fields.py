"""Every constraint field name of OpenAI, vLLM and SGLang -> one constraint (no model needed)."""
from __future__ import annotations

import pytest

from guided.errors import InvalidRequestError
from guided.params import SamplingParams
from guided.server import protocol as P
from guided.server.constraint_fields import constraint_kwargs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TAG = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}


def chat(**kw):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return P.parse_request(P.ChatCompletionRequest, body)[0]


def completion(**kw):
    return P.parse_request(P.CompletionRequest, {"model": "m", "prompt": "hi", **kw})[0]


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize("fields,param,kwargs", [
    ({"guided_json": SCHEMA}, "guided_json", {"json_schema": SCHEMA}),
    ({"guided_regex": r"\d+"}, "guided_regex", {"regex": r"\d+"}),
    ({"guided_choice": ["a", "b"]}, "guided_choice", {"choice": ["a", "b"]}),
    ({"guided_grammar": 'root ::= "x"'}, "guided_grammar", {"grammar": 'root ::= "x"'}),
    ({"json_schema": '{"type": "integer"}'}, "json_schema", {"json_schema": '{"type": "integer"}'}),
    ({"regex": "a+"}, "regex", {"regex": "a+"}),
    ({"ebnf": 'root ::= "x"'}, "ebnf", {"grammar": 'root ::= "x"'}),
    ({"choice": ["x"]}, "choice", {"choice": ["x"]}),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs.json", {"json_schema": SCHEMA}),
    ({"structured_outputs": {"regex": "a"}}, "structured_outputs.regex", {"regex": "a"}),
    ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice", {"choice": ["a"]}),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "structured_outputs.grammar",
     {"grammar": 'root ::= "x"'}),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object",
     {"json_object": True}),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_regex",
     {"regex": "a"}),
    ({"structured_outputs": {"regex": "a", "disable_fallback": True, "backend": "outlines"}},
     "structured_outputs.regex", {"regex": "a"}),
    ({"response_format": {"type": "json_object"}}, "response_format", {"json_object": True}),
    ({"structural_tag": TAG}, "structural_tag", {"structural_tag": TAG}),
    ({"structured_outputs": {"structural_tag": TAG}}, "structured_outputs.structural_tag",
     {"structural_tag": TAG}),
    ({"response_format": {"type": "structural_tag", **TAG}}, "response_format",
     {"structural_tag": {"type": "structural_tag", **TAG}}),
])
def test_every_field_name_maps_to_one_constraint(make, fields, param, kwargs):
    found_param, found = constraint_kwargs(make(**fields))
    assert (found_param, found) == (param, kwargs)
    assert SamplingParams(**found).constraint is not None  # a spec the compiler takes


def test_disable_additional_properties_closes_objects():
    _, kwargs = constraint_kwargs(chat(structured_outputs={
        "json": SCHEMA, "disable_additional_properties": True}))
    assert kwargs["json_schema"]["additionalProperties"] is False


@pytest.mark.parametrize("fields,param", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex"),
    ({"ebnf": 'root ::= "x"', "guided_grammar": 'root ::= "x"'}, "guided_grammar"),
    ({"json_schema": SCHEMA, "structured_outputs": {"choice": ["a"]}},
     "structured_outputs.choice"),
])
def test_two_constraints_are_a_400_naming_the_second(fields, param):
    with pytest.raises(InvalidRequestError, match="at most one constraint") as e:
        constraint_kwargs(chat(**fields))
    assert e.value.param == param


@pytest.mark.parametrize("fields,param", [
    ({"guided_whitespace_pattern": r"[ ]?"}, "guided_whitespace_pattern"),
    ({"structural_tag": 5}, "structural_tag"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "a,b"}, "guided_choice"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_json": 5}, "guided_json"),
    ({"ebnf": ""}, "ebnf"),
])
def test_unsupported_or_malformed_constraint_fields_are_a_400_naming_them(fields, param):
    with pytest.raises(InvalidRequestError) as e:
        constraint_kwargs(chat(**fields))
    assert e.value.param == param and param.split(".")[-1] in str(e.value)


@pytest.mark.parametrize("typo,right", [
    ("response_fromat", "response_format"), ("guided_jsn", "guided_json"),
    ("guided_regx", "guided_regex"), ("json_shema", "json_schema"),
    ("structured_output", "structured_outputs"), ("guided_choise", "guided_choice"),
])
@pytest.mark.parametrize("make", [chat, completion])
def test_misspelt_constraint_fields_are_a_400_suggesting_the_name(make, typo, right):
    with pytest.raises(InvalidRequestError, match=f"did you mean '{right}'") as e:
        make(**{typo: {"type": "json_object"}})
    assert e.value.param == typo


@pytest.mark.parametrize("field", [
    "metadata", "store", "service_tier", "reasoning_effort", "modalities", "prediction",
    "web_search_options", "prompt_cache_key", "safety_identifier", "verbosity", "frobnicate",
    "separate_reasoning", "priority", "request_id", "cache_salt",
])
def test_other_unknown_fields_are_accepted(field):
    _req, unknown = P.parse_request(P.ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "x"}], field: 1})
    assert unknown == [field]
