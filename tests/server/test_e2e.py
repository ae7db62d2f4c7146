"""End to end: the real server and model through the official openai client, unchanged."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "default"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
     "Get the current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                     "b": {"type": "integer"}},
                    "required": ["a", "b"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def user(text):
    return [{"role": "user", "content": text}]


def chat(client, text, **kw):
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=user(text), **kw)


def check_calls(calls):
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---- constraints ---------------------------------------------------------------------------

def test_models_and_health(client, server_url):
    ids = [m.id for m in client.models.list().data]
    assert len(ids) == 1
    assert httpx.get(server_url + "/health").json() == {"status": "ok"}


def test_json_schema_strict(client):
    r = chat(client, "Describe a person as JSON.", response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                               "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == \
        r.usage.prompt_tokens + r.usage.completion_tokens


def test_json_object(client):
    r = chat(client, "Return a JSON object with a key ok set to true.",
             response_format={"type": "json_object"}, max_tokens=64)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_choice_grammar(client):
    r = chat(client, "Give me a phone number.", extra_body={"regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].message.content)
    r = chat(client, "Is the sky blue?", extra_body={"choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    grammar = 'root ::= ("red" | "green" | "blue") " " ("car" | "bike")'
    r = chat(client, "Name a vehicle.", extra_body={"grammar": grammar})
    assert re.fullmatch(r"(red|green|blue) (car|bike)", r.choices[0].message.content)


def test_completions_with_json_schema_extension(client):
    r = client.completions.create(model=MODEL, prompt="A person as JSON: ", max_tokens=48,
                                  temperature=0, extra_body={"json_schema": PERSON})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.completions.create(model=MODEL, prompt=["Count: 1, 2,", "The sky is"],
                                  max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and all(c.text for c in r.choices)


def test_streamed_json_joins_into_valid_json(client):
    stream = chat(client, "Describe a person as JSON.", stream=True,
                  stream_options={"include_usage": True},
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "p", "schema": PERSON}})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert usage is not None and usage.completion_tokens > 0


def test_n2_logprobs_and_seed(client):
    kw = {"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 6, "logprobs": True,
          "top_logprobs": 2}
    r = chat(client, "Say something.", **kw)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.logprobs.content and all(len(t.top_logprobs) == 2 and t.logprob <= 0
                                          for t in c.logprobs.content)
    again = chat(client, "Say something.", **kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


# ---- tools ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}, "auto"])
def test_tool_calls_validate(client, tool_choice):
    r = chat(client, "What is the weather in Paris?", tools=TOOLS, tool_choice=tool_choice,
             parallel_tool_calls=False, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    check_calls(choice.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def test_parallel_tool_calls(client):
    r = chat(client, "What is the weather in Paris and in Rome?", tools=TOOLS,
             tool_choice="required", max_tokens=160)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    check_calls(r.choices[0].message.tool_calls)


def test_parallel_tool_calls_false_gives_one_call(client):
    r = chat(client, "Add 2 and 3.", tools=TOOLS, tool_choice="required",
             parallel_tool_calls=False, max_tokens=48)
    assert len(r.choices[0].message.tool_calls) == 1
    check_calls(r.choices[0].message.tool_calls)


def test_streamed_tool_call_arguments_join_into_valid_json(client):
    stream = chat(client, "What is the weather in Oslo?", tools=TOOLS, stream=True,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  max_tokens=64)
    names, args, finish = {}, {}, None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.function.name:
                    names[d.index] = d.function.name
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    assert finish == "tool_calls" and names == {0: "get_weather"}
    jsonschema.validate(json.loads(args[0]), WEATHER)


def test_tool_history_round_trip(client):
    messages = user("What is the weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                       temperature=0)
    assert r.choices[0].message.content


# ---- errors --------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("invalid schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ("unsupported keyword", {"extra_body": {"json_schema": {
        "type": "string", "not": {"const": "a"}}}}, "json_schema"),
    ("bad regex", {"extra_body": {"regex": "[.*"}}, "regex"),
    ("bad grammar", {"extra_body": {"grammar": "root ::= ("}}, "grammar"),
    ("named without tools", {"tool_choice": {"type": "function",
                                             "function": {"name": "f"}}}, "tool_choice"),
    ("unknown tool", {"tools": TOOLS, "tool_choice": {"type": "function",
                                                      "function": {"name": "nope"}}},
     "tool_choice"),
    ("negative max_tokens", {"max_tokens": -1}, "max_tokens"),
    ("two constraints", {"extra_body": {"regex": "a", "choice": ["a"]}}, None),
    ("too long for the context", {"max_tokens": 10**6}, "max_tokens"),
    ("auto without tools", {"tool_choice": "auto"}, "tool_choice"),
    ("continue a user message", {"extra_body": {"continue_final_message": True,
                                                "add_generation_prompt": False}},
     "continue_final_message"),
]


@pytest.mark.parametrize("name,kw,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_are_400_with_openai_bodies(client, name, kw, param):
    kw.setdefault("max_tokens", 4)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("hi"), **kw)
    err = e.value.body
    assert e.value.status_code == 400
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param, err


def test_errors_without_the_client(server_url):
    r = httpx.post(server_url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server_url + "/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server_url + "/v1/completions", json={"model": MODEL, "prompt": [10**9]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    r = httpx.post(server_url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 40000})
    assert r.status_code == 400


def test_unknown_model_is_404_and_the_server_still_answers(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=user("hi"), max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    r = chat(client, "Is water wet?", extra_body={"choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")


# ---- load and disconnects ------------------------------------------------------------------

def test_32_concurrent_mixed_requests(async_client):
    async def one(i):
        kind = i % 4
        if kind == 0:
            r = await async_client.chat.completions.create(
                model=MODEL, messages=user(f"Person {i} as JSON"), max_tokens=40, temperature=0,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "p", "schema": PERSON}})
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        elif kind == 1:
            r = await async_client.chat.completions.create(
                model=MODEL, messages=user(f"Weather in city {i}?"), tools=TOOLS,
                tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                temperature=0)
            check_calls(r.choices[0].message.tool_calls)
        elif kind == 2:
            r = await async_client.chat.completions.create(
                model=MODEL, messages=user(f"Say hi {i}"), max_tokens=8, temperature=0.7,
                seed=i)
            assert r.choices[0].message.content is not None
        else:
            stream = await async_client.completions.create(
                model=MODEL, prompt=f"{i} + {i} =", max_tokens=8, stream=True,
                extra_body={"regex": r" ?\d{1,4}"})
            text = "".join([c.choices[0].text async for c in stream if c.choices])
            assert re.fullmatch(r" ?\d{1,4}", text)
        return True

    async def main():
        return await asyncio.gather(*(one(i) for i in range(32)))

    assert all(asyncio.run(main()))


def _metric(server_url, name):
    text = httpx.get(server_url + "/metrics").text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def _wait_idle(server_url, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _metric(server_url, "guided_kv_blocks_in_use") == 0 and \
                _metric(server_url, "guided_requests_running") == 0 and \
                _metric(server_url, "guided_requests_waiting") == 0:
            return True
        time.sleep(0.25)
    return False


def test_disconnected_streams_free_their_blocks(server_url):
    body = {"model": MODEL, "messages": user("Write a very long story."), "stream": True,
            "max_tokens": 2000, "ignore_eos": True}
    for _ in range(4):
        with httpx.stream("POST", server_url + "/v1/chat/completions", json=body,
                          timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
        # leaving the block closes the connection mid-stream
    assert _wait_idle(server_url), "KV blocks still in use after the clients left"


def test_disconnected_non_streaming_request_is_aborted(server_url):
    body = {"model": MODEL, "messages": user("Write a very long story."),
            "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server_url + "/v1/chat/completions", json=body, timeout=2)
    assert _wait_idle(server_url)


def test_metrics_exposition(server_url):
    text = httpx.get(server_url + "/metrics").text
    for name in ("guided_kv_blocks_total", "guided_kv_blocks_in_use", "guided_requests_running",
                 "guided_requests_waiting", "guided_prompt_tokens_total",
                 "guided_generation_tokens_total", "guided_prefix_cache_hit_tokens_total",
                 "guided_jump_forward_tokens_total", "guided_grammar_compile_seconds_bucket",
                 "guided_time_to_first_token_seconds_bucket",
                 "guided_time_per_output_token_seconds_bucket",
                 "guided_request_latency_seconds_bucket", "guided_requests_total",
                 "guided_grammar_cache_hit_rate"):
        assert name in text, name
    assert _metric(server_url, "guided_kv_blocks_total") > 0
    assert _metric(server_url, "guided_generation_tokens_total") > 0
