"""tools / tool_choice -> constraint, prompt and parsing (no model needed; xgrammar for EBNF)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from guided.errors import InvalidRequestError
from guided.server.protocol import ChatMessage, NamedToolChoice, Tool
from guided.server.tool_output import ToolCallStreamer, parse_output, scan_calls
from guided.server.tools import build_messages, plan_tools, render_tools_prompt

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
    jsonschema.validate({"name": "add", "parameters": {"a": 1, "b": 2}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "parameters": {"city": "x"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "parameters": {"a": 1}}, schema)


def test_required_parallel_is_one_call_or_a_non_empty_array_of_any_tool():
    plan = plan_tools(TOOLS, "required", True)
    schema = plan.constraint["json_schema"]
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}},
                         {"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    jsonschema.validate({"name": "add", "parameters": {"a": 1, "b": 2}}, schema)
    for bad in ([], {"content": "no call"}, {"name": "add", "parameters": {"a": "x", "b": 2}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = plan_tools(TOOLS, "required", False).constraint["json_schema"]
    jsonschema.validate({"name": "get_weather", "parameters": {"city": "Oslo"}}, single)


def test_missing_parameters_means_an_object():
    plan = plan_tools(tools(("ping", None)), "required", False)
    jsonschema.validate({"name": "ping", "parameters": {}}, plan.constraint["json_schema"])


@pytest.mark.parametrize("params", [{"type": "string"}, {"type": "array"}, {"type": ["object",
                                                                                   "null"]}])
def test_parameters_that_are_not_an_object_schema_are_refused(params):
    """Arguments are a JSON object: a string schema used to come back as a JSON string."""
    with pytest.raises(InvalidRequestError, match='type "object"') as error:
        plan_tools(tools(("add", ADD), ("f", params)), "auto")
    assert error.value.param == "tools[1].function.parameters"


def test_an_invalid_parameters_schema_is_refused_naming_the_tool():
    """SGLang's function-calling test sends `"type": "int"` (OpenAI refuses it too): the 400
    points into that tool's parameters, not into the request's wrapped call schema."""
    bad = {"type": "object", "properties": {"a": {"type": "int"}}}
    for choice in ("auto", "required", named("f")):
        with pytest.raises(InvalidRequestError, match="at /properties/a/type") as error:
            plan_tools(tools(("add", ADD), ("f", bad)), choice)
        assert error.value.param == "tools[1].function.parameters"


def test_auto_schema_admits_calls_arrays_and_text():
    schema = plan_tools(TOOLS, "auto", True).constraint["json_schema"]
    jsonschema.validate({"name": "add", "parameters": {"a": 1, "b": 2}}, schema)
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}},
                         {"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    jsonschema.validate({"content": "hello"}, schema)
    for bad in ({"name": "nope", "parameters": {}}, {"content": 1}, "text",
                {"name": "add", "parameters": {"a": 1, "b": 2, "c": 3}}):  # closed objects
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = plan_tools(TOOLS, "auto", False).constraint["json_schema"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}], single)


def test_tool_schemas_pass_the_fail_closed_check():
    check_schema = pytest.importorskip("guided.fsm.schema_check").check_schema
    for choice in ("auto", "required", named("add")):
        check_schema(plan_tools(TOOLS, choice, True).constraint["json_schema"])


AUTO_TWO = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
            '{"name": "add", "parameters": {"a": 1, "b": 2}}]')


def test_parse_auto_text_and_calls():
    plan = plan_tools(TOOLS, "auto", True)
    assert parse_output(plan, '{"content": "Just text {not a call} \\u00e9"}') == (
        "Just text {not a call} \u00e9", None)
    content, calls = parse_output(plan, AUTO_TWO)
    assert content == "" and [c.function.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1].function.arguments) == {"a": 1, "b": 2}
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    _, [call] = parse_output(plan, '{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert call.function.name == "add"
    assert parse_output(plan, '{"content": "cut sho') == ("cut sho", None)


def test_parse_json_forms_and_truncation():
    plan = plan_tools(TOOLS, "required", True)
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", ' \
           '"parameters": {"city": "a \\"quoted\\" {city}"}}]'
    _, calls = parse_output(plan, text)
    assert json.loads(calls[1].function.arguments) == {"city": 'a "quoted" {city}'}
    # cut by max_tokens: the complete calls, never the call format's text
    assert parse_output(plan, text[:30]) == ("", None)
    content, [call] = parse_output(plan, text[:60])
    assert content == "" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
    named_plan = plan_tools(TOOLS, named("add"))
    _, [call] = parse_output(named_plan, '{ "name" : "add" , "parameters" : {"a":1,"b":2} }')
    assert call.function.arguments == '{"a":1,"b":2}'


def test_scan_calls_partial():
    spans = scan_calls('[{"name": "add", "parameters": {"a": 1')
    assert spans[0].name == "add" and spans[0].args_end is None and not spans[0].complete


@pytest.mark.parametrize("text,plan_args", [
    (AUTO_TWO, ("auto", True)),
    (('[{"name": "add", "parameters": {"a": 10, "b": 20}}, {"name": "get_weather", '
     '"parameters": {"city": "S\\u00e3o Paulo  ", "unit": "c"}}]'), ("required", True)),
])
def test_streamed_arguments_join_to_the_final_ones(text, plan_args):
    plan = plan_tools(TOOLS, *plan_args)
    streamer = ToolCallStreamer(plan)
    names, args = {}, {}
    for k in range(1, len(text) + 1):  # one character per step
        content, deltas = streamer.deltas(text[:k])
        assert content == ""
        for d in deltas:
            if "name" in d["function"]:
                names[d["index"]] = d["function"]["name"]
                assert d["id"].startswith("call_")
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    _, final = parse_output(plan, text)
    assert [names[i] for i in sorted(names)] == [c.function.name for c in final]
    assert [args[i] for i in sorted(args)] == [c.function.arguments for c in final]


def test_build_messages_renders_tools_without_native_support():
    plan = plan_tools(TOOLS, "auto")
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="hi"),
            ChatMessage.model_validate({"role": "assistant", "tool_calls": [
                {"id": "c1", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}),
            ChatMessage(role="tool", tool_call_id="c1", content="3")]
    out = build_messages(msgs, plan, native_tools=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert "Functions:" in out[0]["content"] and '"get_weather"' in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"name": "add", "parameters": {"a": 1, "b": 2}}
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    assert all(isinstance(m["content"], str) for m in out)


def test_build_messages_native_keeps_tool_fields():
    plan = plan_tools(TOOLS, "auto")
    msgs = [ChatMessage(role="user", content="hi"),
            ChatMessage(role="tool", tool_call_id="c1", content="3")]
    out = build_messages(msgs, plan, native_tools=True)
    assert out[1] == {"role": "tool", "content": "3", "tool_call_id": "c1"}


def test_prompt_mentions_the_output_format():
    auto = render_tools_prompt(plan_tools(TOOLS, "auto"))
    assert '"content"' in auto and '"get_weather"' in auto
    assert "JSON list" in render_tools_prompt(plan_tools(TOOLS, "required", True))
    assert "Call the function add" in render_tools_prompt(plan_tools(TOOLS, named("add")))


def test_streamed_auto_text_is_unwrapped():
    plan = plan_tools(TOOLS, "auto", True)
    text = '{"content": "caf\\u00e9 \\ud83d\\ude00 \\"ok\\"\\n"}'
    streamer, got = ToolCallStreamer(plan), ""
    for k in range(1, len(text) + 1):
        content, deltas = streamer.deltas(text[:k])
        assert deltas == [] and "\ufffd" not in content
        got += content
    assert got == json.loads(text)["content"] == parse_output(plan, text)[0]


# A tool whose parameters carry their own $defs, referenced relative to the parameters object
# (pydantic's model_json_schema() of a model with a nested model looks like this).
OPTIONS_PARAMS = {"$ref": "#/$defs/WeatherOptions", "$defs": {"WeatherOptions": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"]}, "Unit": {"enum": ["c", "f"]}}}
TREE_PARAMS = {"type": "object", "properties": {"value": {"type": "integer"}, "children": {
    "type": "array", "items": {"$ref": "#"}, "maxItems": 2}}, "required": ["value"]}


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_tool_parameters_resolve_their_own_refs_like_a_response_format(choice):
    check_schema = pytest.importorskip("guided.fsm.schema_check").check_schema
    xgr = pytest.importorskip("xgrammar")
    specs = tools(("weather", OPTIONS_PARAMS), ("tree", TREE_PARAMS), ("add", ADD))
    plan = plan_tools(specs, named("weather") if choice == "named" else choice, True)
    schema = plan.constraint["json_schema"]
    call = {"name": "weather", "parameters": {"city": "Oslo", "unit": "c"}}
    jsonschema.validate(call if choice == "named" else [call], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "weather", "parameters": {"city": "Oslo", "unit": "k"}},
                            schema)
    if choice != "named":
        tree = {"name": "tree", "parameters": {"value": 1, "children": [{"value": 2}]}}
        jsonschema.validate([tree], schema)
    checked = check_schema(schema)  # resolves: no "reference does not resolve"
    grammar = xgr.Grammar.from_json_schema(json.dumps(checked), strict_mode=True,
                                           any_whitespace=False)
    accepts = xgr.testing._is_grammar_accept_string
    good = json.dumps(call if choice == "named" else [call])
    assert accepts(grammar, good)
    assert not accepts(grammar, good.replace('"c"', '"k"'))
