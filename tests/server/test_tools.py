"""tools / tool_choice -> constraint, prompt and parsing (no model needed; xgrammar for EBNF)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from guided.errors import InvalidRequestError
from guided.server.protocol import ChatMessage, NamedToolChoice, Tool
from guided.server.tools import (
    ToolCallStreamer,
    build_messages,
    parse_tool_calls,
    plan_tools,
    render_tools_prompt,
    scan_calls,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"]}


def tools(*specs):
    return [Tool.model_validate({"type": "function", "function": {
        "name": name, "description": f"does {name}", "parameters": params}})
        for name, params in specs]


TOOLS = tools(("get_weather", WEATHER), ("add", ADD))


def named(name):
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_none_and_no_tools_mean_no_plan():
    assert plan_tools(None, "none") is None
    assert plan_tools(None, "auto") is None
    assert plan_tools(TOOLS, "none") is None


@pytest.mark.parametrize("tool_list,choice,param", [
    (None, named("f"), "tool_choice"),
    (TOOLS, named("nope"), "tool_choice"),
    (None, "required", "tool_choice"),
    (tools(("f", ADD), ("f", ADD)), "auto", "tools"),
])
def test_bad_tool_choice(tool_list, choice, param):
    with pytest.raises(InvalidRequestError) as e:
        plan_tools(tool_list, choice)
    assert e.value.param == param


def test_named_schema_is_one_call_of_that_tool():
    plan = plan_tools(TOOLS, named("add"))
    schema = plan.constraint["json_schema"]
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "x"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {"a": 1}}, schema)


def test_required_parallel_is_a_non_empty_array_of_any_tool():
    plan = plan_tools(TOOLS, "required", True)
    schema = plan.constraint["json_schema"]
    jsonschema.validate([{"name": "add", "arguments": {"a": 1, "b": 2}},
                         {"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    single = plan_tools(TOOLS, "required", False).constraint["json_schema"]
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, single)


def test_missing_parameters_means_an_object():
    plan = plan_tools(tools(("ping", None)), "required", False)
    jsonschema.validate({"name": "ping", "arguments": {}}, plan.constraint["json_schema"])


def _matcher_accepts(grammar: str, text: str) -> bool:
    xgr = pytest.importorskip("xgrammar")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    # character-level vocabulary: enough to drive the matcher with accept_string
    vocab = {chr(i): i for i in range(32, 127)} | {"\n": 10, "</s>": 0}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[])),
                                  eos_token="</s>")
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(vocab) + 32)
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and (matcher.is_terminated() or matcher.accept_token(0))


AUTO_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
AUTO_TWO = AUTO_CALL + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize("text,parallel,ok", [
    ("The weather is nice.", True, True),
    (AUTO_CALL, False, True),
    (AUTO_TWO, True, True),
    (AUTO_TWO, False, False),
    ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', True, False),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', True, False),
    (" leading space", True, False),
])
def test_auto_grammar(text, parallel, ok):
    grammar = plan_tools(TOOLS, "auto", parallel).constraint["grammar"]
    assert _matcher_accepts(grammar, text) is ok


def test_auto_grammar_tool_named_like_a_rule():
    grammar = plan_tools(tools(("root", ADD)), "auto").constraint["grammar"]
    assert _matcher_accepts(
        grammar, '<tool_call>\n{"name": "root", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def test_parse_auto_text_and_calls():
    plan = plan_tools(TOOLS, "auto", True)
    assert parse_tool_calls(plan, "Just text {not a call}") is None
    calls = parse_tool_calls(plan, AUTO_TWO)
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1].arguments) == {"a": 1, "b": 2}
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id


def test_parse_json_forms_and_truncation():
    plan = plan_tools(TOOLS, "required", True)
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", ' \
           '"arguments": {"city": "a \\"quoted\\" {city}"}}]'
    calls = parse_tool_calls(plan, text)
    assert json.loads(calls[1].arguments) == {"city": 'a "quoted" {city}'}
    assert parse_tool_calls(plan, text[:30]) is None  # cut by max_tokens
    named_plan = plan_tools(TOOLS, named("add"))
    assert parse_tool_calls(named_plan, '{ "name" : "add" , "arguments" : {"a":1,"b":2} }')[0] \
        .arguments == '{"a":1,"b":2}'


def test_scan_calls_partial():
    spans = scan_calls('[{"name": "add", "arguments": {"a": 1')
    assert spans[0].name == "add" and spans[0].args_end is None and not spans[0].complete


@pytest.mark.parametrize("text,plan_args", [
    (AUTO_TWO, ("auto", True)),
    (('[{"name": "add", "arguments": {"a": 10, "b": 20}}, {"name": "get_weather", '
     '"arguments": {"city": "S\\u00e3o Paulo  ", "unit": "c"}}]'), ("required", True)),
])
def test_streamed_arguments_join_to_the_final_ones(text, plan_args):
    plan = plan_tools(TOOLS, *plan_args)
    streamer = ToolCallStreamer(plan)
    names, args = {}, {}
    for k in range(1, len(text) + 1):  # one character per step
        for d in streamer.deltas(text[:k]):
            if "name" in d["function"]:
                names[d["index"]] = d["function"]["name"]
                assert d["id"].startswith("call_")
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    final = parse_tool_calls(plan, text)
    assert [names[i] for i in sorted(names)] == [c.name for c in final]
    assert [args[i] for i in sorted(args)] == [c.arguments for c in final]


def test_build_messages_renders_tools_without_native_support():
    plan = plan_tools(TOOLS, "auto")
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="hi"),
            ChatMessage.model_validate({"role": "assistant", "tool_calls": [
                {"id": "c1", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}),
            ChatMessage(role="tool", tool_call_id="c1", content="3")]
    out = build_messages(msgs, plan, native_tools=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert "<tools>" in out[0]["content"] and '"get_weather"' in out[0]["content"]
    assert out[2]["content"].startswith("<tool_call>\n") and '"arguments": {"a": 1' in \
        out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    assert all(isinstance(m["content"], str) for m in out)


def test_build_messages_native_keeps_tool_fields():
    plan = plan_tools(TOOLS, "auto")
    msgs = [ChatMessage(role="user", content="hi"),
            ChatMessage(role="tool", tool_call_id="c1", content="3")]
    out = build_messages(msgs, plan, native_tools=True)
    assert out[1] == {"role": "tool", "content": "3", "tool_call_id": "c1"}


def test_prompt_mentions_the_output_format():
    assert "<tool_call>" in render_tools_prompt(plan_tools(TOOLS, "auto"))
    assert "JSON list" in render_tools_prompt(plan_tools(TOOLS, "required", True))
