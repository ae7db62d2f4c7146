"""End to end: tool calling as clients of OpenAI and vLLM send it, through the official openai
client to the real server and model; every call's arguments validated against its tool's own
schema (references resolved relative to the parameters object, as jsonschema does)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "default"
# pydantic's model_json_schema() of a model with a nested model and an enum: local $defs
OPTIONS = {"$ref": "#/$defs/WeatherOptions", "$defs": {
    "WeatherOptions": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["city", "unit"]},
    "Unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
          "Weather in a city", "parameters": OPTIONS}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": ADD}}]
SCHEMAS = {"get_weather": OPTIONS, "add": ADD}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
          "required": ["answer"], "additionalProperties": False}


def ask(client, text, **kw):
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], temperature=0, **kw)


def check_calls(calls):
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", [
    "auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_parameters_with_their_own_defs(client, tool_choice):
    r = ask(client, "What is the weather in Paris, in celsius?", tools=TOOLS,
            tool_choice=tool_choice)
    message = r.choices[0].message
    if tool_choice != "auto":
        assert message.tool_calls and r.choices[0].finish_reason == "tool_calls", r
    if message.tool_calls:
        check_calls(message.tool_calls)
        assert message.content == ""


def test_tools_with_response_format(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    for text in ("What is the weather in Oslo?", "Say hello to me, please."):
        r = ask(client, text, tools=TOOLS, response_format=fmt)
        message = r.choices[0].message
        assert r.choices[0].finish_reason in ("stop", "tool_calls"), r
        if message.tool_calls:
            check_calls(message.tool_calls)
        else:
            jsonschema.validate(json.loads(message.content), ANSWER)
    r = ask(client, "What is the weather in Oslo?", tools=TOOLS, tool_choice="required",
            response_format=fmt)
    check_calls(r.choices[0].message.tool_calls)


def test_content_is_an_empty_string_beside_tool_calls(server_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Add 2 and 3."}],
            "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}},
            "temperature": 0, "max_tokens": 40}
    message = httpx.post(server_url + "/v1/chat/completions", json=body,
                         timeout=300).json()["choices"][0]["message"]
    assert message["content"] == "" and message["tool_calls"][0]["function"]["name"] == "add"


def test_legacy_functions_are_served_as_tools(client):
    functions = [t["function"] for t in TOOLS]
    r = ask(client, "Add 2 and 3.", functions=functions, function_call={"name": "add"})
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.function_call.name == "add"
    jsonschema.validate(json.loads(choice.message.function_call.arguments), ADD)
    stream = ask(client, "Add 2 and 3.", functions=functions, function_call={"name": "add"},
                 stream=True)
    names, args, finish = [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        if delta.function_call:
            names += [delta.function_call.name] if delta.function_call.name else []
            args += delta.function_call.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["add"] and finish == "function_call"
    jsonschema.validate(json.loads(args), ADD)
    with pytest.raises(openai.BadRequestError):
        ask(client, "x", functions=functions, tools=TOOLS)


def test_a_tool_with_an_invalid_schema_is_a_400_naming_it(client):
    """SGLang's function-calling test sends `"type": "int"`: refused (as OpenAI does), naming
    the tool's parameters and the keyword's place in them."""
    bad = {"type": "function", "function": {"name": "sub", "parameters": {
        "type": "object", "properties": {"a": {"type": "int"}}}}}
    for choice in ("auto", "required"):
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, "Compute (3+5)", tools=[TOOLS[1], bad], tool_choice=choice)
        assert e.value.body["param"] == "tools[1].function.parameters"
        assert "/properties/a/type" in e.value.body["message"]


@pytest.mark.parametrize("max_tokens", [6, 14, 22, 30])
def test_tool_calls_cut_by_max_tokens_are_never_internal_text(client, max_tokens):
    r = ask(client, "Get the weather in Paris and in Rome, then add 2 and 3.", tools=TOOLS,
            tool_choice="required", max_tokens=max_tokens)
    choice = r.choices[0]
    assert choice.finish_reason in ("length", "tool_calls"), choice
    assert not choice.message.content, choice  # never `[{"name": ...` as content
    check_calls(choice.message.tool_calls or [])
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls


def test_required_with_parallel_calls_may_stop_after_one_call(client):
    """SGLang's tool-call runner: "What is 3 + 5?" with tool_choice required and no max_tokens.
    Forced into an array, the model repeated its call until the context was full."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 3 + 5?"}],
        tools=[TOOLS[1]], tool_choice="required", temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and r.usage.completion_tokens < 100, r.usage
    check_calls(choice.message.tool_calls)


def test_chat_template_kwargs_reach_the_template(client):
    base = ask(client, "Hi", max_tokens=1).usage.prompt_tokens
    off = ask(client, "Hi", max_tokens=1,
              extra_body={"chat_template_kwargs": {"add_generation_prompt": False,
                                                   "enable_thinking": False}})
    assert off.usage.prompt_tokens < base  # no "<|im_start|>assistant\n" at the end
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "Hi", max_tokens=1, extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert e.value.body["param"] == "chat_template_kwargs.tokenize"


def test_openai_parse_with_pydantic_models(client):
    """The official client's chat.completions.parse: a pydantic model as response_format (its
    strict schema with $defs), and pydantic_function_tool for tools."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Unit(BaseModel):
        name: Literal["celsius", "fahrenheit"]

    class Forecast(BaseModel):
        city: str = Field(max_length=20)
        high: int = Field(ge=-50, le=60)
        unit: Unit

    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Tomorrow's forecast for Oslo."}],
        response_format=Forecast, temperature=0, max_tokens=60)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and -50 <= parsed.high <= 60, r

    class GetWeather(BaseModel):
        city: str = Field(max_length=20)
        unit: Unit

    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo in celsius?"}],
        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=60)
    [call] = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)
