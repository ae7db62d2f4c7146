"""Wire-format models: parsing, OpenAI error bodies, logprob formatting (no model needed)."""
from __future__ import annotations

import pytest

from guided.errors import InvalidRequestError
from guided.server import protocol as P


def chat(**kw):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return P.parse_request(P.ChatCompletionRequest, body)[0]


def test_chat_minimal_defaults():
    req = chat()
    assert req.n == 1 and req.stream is False and req.max_new_tokens is None
    assert req.messages[0].text() == "hi"


def test_content_parts_and_tool_messages():
    req = chat(messages=[
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}])
    assert req.messages[0].text() == "ab"
    assert req.messages[1].tool_calls[0].function.name == "f"
    assert req.messages[2].tool_call_id == "call_1"


def test_unknown_fields_are_ignored_and_reported():
    _req, unknown = P.parse_request(P.ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "x"}], "frobnicate": 1})
    assert unknown == ["frobnicate"]


def test_response_format_json_schema_alias():
    req = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}})
    assert req.response_format.json_schema.schema_ == {"type": "object"}


def test_extensions_and_max_completion_tokens():
    req = chat(regex="a+", top_k=5, min_p=0.1, repetition_penalty=1.1, ignore_eos=True,
               max_tokens=5, max_completion_tokens=7)
    assert req.regex == "a+" and req.top_k == 5 and req.max_new_tokens == 7


@pytest.mark.parametrize("bad,param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"temperature": 3.0}, "temperature"),
    ({"top_logprobs": 50}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages.0.role"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_validation_errors_name_the_param(bad, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **bad}
    with pytest.raises(InvalidRequestError) as e:
        P.parse_request(P.ChatCompletionRequest, body)
    assert e.value.param == param, (e.value.param, str(e.value))


def test_body_must_be_an_object():
    with pytest.raises(InvalidRequestError):
        P.parse_request(P.ChatCompletionRequest, [1, 2])


@pytest.mark.parametrize("prompt,expected", [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_completion_prompt_forms(prompt, expected):
    req, _ = P.parse_request(P.CompletionRequest, {"model": "m", "prompt": prompt})
    assert req.prompts() == expected
    assert req.max_new_tokens == 16


def test_completion_empty_prompt_list_rejected():
    with pytest.raises(InvalidRequestError):
        P.parse_request(P.CompletionRequest, {"model": "m", "prompt": []})


def test_error_body_shape():
    body = P.error_body("bad", param="x", code="c")
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "x",
                              "code": "c"}}
