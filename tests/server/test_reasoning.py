"""The reasoning parser: the constraint holds after <think> ... </think>, whose text comes back
as reasoning_content and reasoning (unit tests; the real server: test_e2e_reasoning below)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from guided.fsm.backends.xgrammar_backend import Recipe, grammar_of
from guided.fsm.structural_tags import checked_structural_tag
from guided.server.jobs import split_reasoning, wrap_constraint

xgr = pytest.importorskip("xgrammar")
POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
         "additionalProperties": False}


def accepts(kwargs: dict, text: str) -> bool:
    tag = json.dumps(kwargs["structural_tag"])
    grammar = grammar_of(Recipe("structural_tag", checked_structural_tag(tag)))
    return xgr.testing._is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("kwargs,good,bad", [
    ({"json_schema": POINT}, '{"x": 1}', '{"x": "a"}'),
    ({"json_object": True}, '{"a": [1]}', "[1]"),
    ({"regex": "[0-9]{3}"}, "123", "12a"),
    ({"choice": ["yes", "no"]}, "no", "maybe"),
    ({"grammar": 'root ::= "a" | "b"'}, "b", "c"),
    ({"structural_tag": {"type": "structural_tag", "format": {  # auto's tool calls in tags
        "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [{
            "type": "tag", "begin": "<tool_call>", "end": "</tool_call>",
            "content": {"type": "json_schema", "json_schema": POINT}}]}}},
     'Sure. <tool_call>{"x": 1}</tool_call>', '<tool_call>{"x": "a"}</tool_call>'),
])
def test_the_constraint_holds_after_free_reasoning(kwargs, good, bad):
    wrapped = wrap_constraint(kwargs, "<|im_start|>assistant\n")
    assert accepts(wrapped, f"<think>Let me see: {{not json}} </thin </think>{good}")
    assert not accepts(wrapped, f"<think>hmm</think>{bad}")
    assert not accepts(wrapped, good)  # the section comes first
    opened = wrap_constraint(kwargs, "<|im_start|>assistant\n<think>\n")
    assert accepts(opened, f"already thinking</think>{good}")
    assert wrap_constraint({}, "x") == {}


def test_split_reasoning():
    assert split_reasoning("<think>a b</think>\n{}") == ("a b", "{}")
    assert split_reasoning("<think>a b</thi", finished=False) == ("a b", "")
    assert split_reasoning("<think>a b</thi") == ("a b</thi", "")
    assert split_reasoning("opened</think>x") == ("opened", "x")


@pytest.fixture(scope="module")
def reasoning_client(launch_server):
    url, _ = launch_server("--reasoning-parser", "think", name="reasoning")
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_e2e_reasoning(reasoning_client, stream):
    prompt = ("Think step by step inside <think> </think>, briefly, then give a point as JSON "
              "with an integer x.")
    kw = {"model": "default", "messages": [{"role": "user", "content": prompt}],
          "temperature": 0, "max_tokens": 160, "response_format": {
              "type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}}
    if stream:
        thought, content, finish = "", "", None
        for chunk in reasoning_client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                delta = chunk.choices[0].delta
                thought += getattr(delta, "reasoning_content", None) or ""
                assert getattr(delta, "reasoning", None) == getattr(delta, "reasoning_content", None)
                content += delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    else:
        choice = reasoning_client.chat.completions.create(**kw).choices[0]
        message = choice.message
        thought, content, finish = (getattr(message, "reasoning_content", None) or "",
                                    message.content or "", choice.finish_reason)
        assert message.reasoning == message.reasoning_content  # vLLM's newer name, SGLang's
    assert thought  # the section is forced first, and comes back apart from the content
    assert "<think>" not in content and "</think>" not in content
    if finish == "stop":
        jsonschema.validate(json.loads(content), POINT)
    else:
        assert finish == "length"


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_e2e_enable_thinking_false_constrains_from_the_start(reasoning_client, stream):
    """chat_template_kwargs enable_thinking false on a reasoning server: no think section is
    forced, the answer follows the schema from its first token, and nothing comes back as
    reasoning (vLLM's function-calling test sends it to Qwen3 with a reasoning parser)."""
    kw = {"model": "default", "messages": [{"role": "user", "content": "Give a point as JSON."}],
          "temperature": 0, "max_tokens": 40,
          "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
          "response_format": {"type": "json_schema", "json_schema": {
              "name": "point", "schema": POINT}}}
    if stream:
        content, finish, thought = "", None, []
        for chunk in reasoning_client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                delta = chunk.choices[0].delta
                thought += [getattr(delta, "reasoning_content", None),
                            getattr(delta, "reasoning", None)]
                content += delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    else:
        choice = reasoning_client.chat.completions.create(**kw).choices[0]
        message, finish, content = choice.message, choice.finish_reason, choice.message.content
        thought = [getattr(message, "reasoning_content", None),
                   getattr(message, "reasoning", None)]
    assert finish == "stop"
    assert not any(thought), thought
    jsonschema.validate(json.loads(content), POINT)
