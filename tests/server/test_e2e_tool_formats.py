"""End to end: tool_choice "auto" in the tool-call format of the chat template (Hermes, Llama 3
JSON, Mistral; `guided serve --chat-template`), through the official openai client to the real
server and default model: free text, or calls whose arguments follow their tool's schema (every
one validated), the same whole and streamed.

The default model has no tool training: a conversation that already holds two calls shows it the
format (it then calls on its own); the constraint is what keeps every call well-formed."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"$ref": "#/$defs/Query", "$defs": {  # references relative to the parameters
    "Query": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "unit": {"$ref": "#/$defs/Unit"}},
              "required": ["city"]},
    "Unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER}}]


def shown_call(city: str, i: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": f"call_{i}", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


SHOTS = [{"role": "user", "content": "What is the weather in London?"}, shown_call("London", 1),
         {"role": "user", "content": "What is the weather in Rome?"}, shown_call("Rome", 2)]


@pytest.fixture(scope="module", params=["hermes", "llama3", "mistral"])
def client(request, launch_server):
    openai = pytest.importorskip("openai")
    url, _ = launch_server("--chat-template", str(TEMPLATES / f"{request.param}.jinja"),
                           name=request.param)
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, question: str, **kw):
    return client.chat.completions.create(
        model="default", messages=[*SHOTS, {"role": "user", "content": question}], tools=TOOLS,
        tool_choice="auto", temperature=0, max_tokens=60, **kw)


def test_auto_calls_in_the_templates_format(client):
    choice = chat(client, "What is the weather in Paris?").choices[0]
    calls = choice.message.tool_calls
    assert calls and choice.finish_reason == "tool_calls", choice
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert choice.message.content == ""


def test_streamed_calls_are_the_same_calls(client):
    whole = chat(client, "What is the weather in Tokyo?").choices[0].message.tool_calls
    names, args, finish, content = {}, {}, None, ""
    for chunk in chat(client, "What is the weather in Tokyo?", stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            names[d.index] = names.get(d.index) or d.function.name
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    assert whole and finish == "tool_calls" and content == ""
    assert [(names[i], args[i]) for i in sorted(names)] == [
        (c.function.name, c.function.arguments) for c in whole]
    for text in args.values():
        jsonschema.validate(json.loads(text), WEATHER)


def test_auto_answers_in_text_when_it_does_not_call(client):
    choice = chat(client, "Tell me a joke.").choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
