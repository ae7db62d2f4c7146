"""Tool-call formats chosen by the chat template; tool_choice "auto" in them as a structural tag
that xgrammar compiles and that admits exactly text and well-formed calls; the output read back
as content and tool_calls, whole and streamed."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from guided.fsm.backends.xgrammar_backend import Recipe, grammar_of
from guided.fsm.structural_tags import checked_structural_tag
from guided.server.protocol import NamedToolChoice, Tool
from guided.server.tool_output import (
    FORMATS,
    ToolCallStreamer,
    detect_format,
    parse_output,
    tag_calls,
)
from guided.server.tools import plan_tools

TEMPLATES = Path(__file__).parent / "templates"
FMT = {f.name: f for f in FORMATS}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
    "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}
REFS = {"$ref": "#/$defs/A", "$defs": {"A": {"type": "object", "properties": {
    "a": {"type": "integer"}}, "required": ["a"]}}}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "get_weather",
                                                               "parameters": WEATHER}}),
         Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": REFS}})]
SCHEMAS = {"get_weather": WEATHER, "f": REFS}
SMOLLM2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}")


def call_text(fmt, name: str, args: dict) -> str:
    return fmt.begin + name + fmt.args_field + json.dumps(args) + fmt.end


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_the_test_templates_are_detected(name):
    assert detect_format((TEMPLATES / f"{name}.jinja").read_text()) is FMT[name]


@pytest.mark.parametrize("template", [None, "", SMOLLM2, "{{ tools }} plain JSON please"])
def test_templates_without_a_known_format_keep_json_first(template):
    assert detect_format(template) is None
    plan = plan_tools(TOOLS, "auto", tool_format=detect_format(template))
    assert plan.format is None and "json_schema" in plan.constraint


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_auto_is_a_structural_tag_that_admits_text_and_calls(name):
    xgr = pytest.importorskip("xgrammar")
    fmt = FMT[name]
    plan = plan_tools(TOOLS, "auto", tool_format=fmt)
    assert plan.format is fmt
    grammar = grammar_of(Recipe("structural_tag", checked_structural_tag(
        plan.constraint["structural_tag"])))

    def accepts(text: str) -> bool:
        return xgr.testing._is_grammar_accept_string(grammar, text)

    good = ("Sure. " + call_text(fmt, "get_weather", {"city": "Paris", "unit": "celsius"})
            + call_text(fmt, "f", {"a": 1}))
    assert accepts(good)
    for bad in ({"city": 3}, {"unit": "kelvin", "city": "x"}, {"city": "x", "other": 1}):
        assert not accepts(call_text(fmt, "get_weather", bad))
    assert not accepts(call_text(fmt, "no_such_tool", {}))


def test_required_named_and_response_format_stay_json_first():
    fmt = FMT["hermes"]
    assert plan_tools(TOOLS, "required", tool_format=fmt).format is None
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}})
    assert plan_tools(TOOLS, named, tool_format=fmt).format is None
    plan = plan_tools(TOOLS, "auto", tool_format=fmt, content_schema={"type": "object"})
    assert plan.format is None


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_parse_text_and_calls(name):
    fmt = FMT[name]
    plan = plan_tools(TOOLS, "auto", tool_format=fmt)
    text = (" Let me look.\n" + call_text(fmt, "get_weather", {"city": "Rome"}) + "\n"
            + call_text(fmt, "f", {"a": 2}))
    content, calls = parse_output(plan, text)
    assert content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("f", {"a": 2})]
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert parse_output(plan, "Just text.") == ("Just text.", None)
    cut = text[:-(len(fmt.end) + 3)]  # the second call cut by max_tokens: the first one only
    content, calls = parse_output(plan, cut)
    assert content == "Let me look." and [c.function.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_a_partial_trigger_is_held_back_until_known(name):
    fmt = FMT[name]
    outside, spans = tag_calls(fmt, "Hi " + fmt.trigger[:-1], finished=False)
    assert outside == "Hi " and spans == []
    outside, _ = tag_calls(fmt, "Hi " + fmt.trigger[:-1], finished=True)
    assert outside == "Hi " + fmt.trigger[:-1]


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_streamed_deltas_join_to_the_final_message(name):
    fmt = FMT[name]
    plan = plan_tools(TOOLS, "auto", tool_format=fmt)
    text = ("Ok" + call_text(fmt, "get_weather", {"city": "Rome", "unit": "celsius"})
            + " then " + call_text(fmt, "f", {"a": 12}))
    streamer, content, calls = ToolCallStreamer(plan), "", {}
    for end in range(1, len(text) + 1):
        new, deltas = streamer.deltas(text[:end], end == len(text))
        content += new
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = call["name"] or d["function"].get("name")
            call["arguments"] += d["function"]["arguments"]
    assert content == "Ok then "
    final = parse_output(plan, text)[1]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in final]
