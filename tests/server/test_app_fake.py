"""The app on a scripted fake engine (no model): SSE framing, UTF-8 hold-back, errors, 503."""
from __future__ import annotations

import asyncio
import json

import pytest
from fake_engine import fake_client  # tests/ is on sys.path (its rootdir-less conftest)
from fastapi.testclient import TestClient

from guided.params import SamplingParams
from guided.server.app import create_app


@pytest.fixture(scope="module")
def http():
    with TestClient(create_app(fake_client(max_waiting=4), drain_timeout=0)) as client:
        yield client


def ask(text, **kw):
    return {"model": "default", "messages": [{"role": "user", "content": f"ECHO:{text}"}], **kw}


def sse(response):
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_chat_non_streaming(http):
    r = http.post("/v1/chat/completions", json=ask("hello"))
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 5


def test_stream_framing_and_utf8_hold_back(http):
    r = http.post("/v1/chat/completions", json=ask("héllo wörld 😀", stream=True,
                                                   stream_options={"include_usage": True}))
    chunks = sse(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "héllo wörld 😀"
    assert [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_streamed_tool_call_from_the_fake(http):
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    body = ask(call, stream=True, tool_choice="required", parallel_tool_calls=False, tools=[
        {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"},
                                             "b": {"type": "integer"}}}}}])
    chunks = sse(http.post("/v1/chat/completions", json=body))
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas[0]["function"]["name"] == "add" and deltas[0]["id"].startswith("call_")
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"a": 1, "b": 2}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_engine_failure_mid_stream_ends_the_choice_and_the_stream(http):
    r = http.post("/v1/chat/completions", json=ask("RAISE", stream=True))
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"  # clients wait for it
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "error"
    assert json.loads(events[-2])["error"]["type"] == "internal_error"
    r = http.post("/v1/completions", json={"model": "default", "prompt": "ECHO:RAISE",
                                           "stream": True})
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "error"
    r = http.post("/v1/chat/completions", json=ask("RAISE"))
    assert r.status_code == 500 and r.json()["error"]["message"]
    assert http.post("/v1/chat/completions", json=ask("ok")).status_code == 200


def test_max_tokens_zero_and_n(http):
    body = http.post("/v1/completions", json={"model": "default", "prompt": "ECHO:abc",
                                              "max_tokens": 0, "n": 2}).json()
    assert [c["text"] for c in body["choices"]] == ["", ""]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    body = http.post("/v1/completions", json={"model": "default", "prompt": "ECHO:abc",
                                              "n": 3, "echo": True}).json()
    assert [c["text"] for c in body["choices"]] == ["ECHO:abcabc"] * 3


def test_overload_is_503(http):
    engine = http.app.state.server.engine

    async def fill():
        for i in range(4):  # the fake's queue holds 4
            await engine.add_request(f"s{i}", "ECHO:SLOW", SamplingParams())

    asyncio.run(fill())
    try:
        r = http.post("/v1/chat/completions", json=ask("x"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert int(r.headers["retry-after"]) >= 1
    finally:
        for i in range(4):
            engine.abort(f"s{i}")


def test_logprobs_formats(http):
    body = http.post("/v1/chat/completions", json=ask("ab", logprobs=True,
                                                      top_logprobs=1)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == ["a", "b"] and content[0]["bytes"] == [97]
    body = http.post("/v1/completions", json={"model": "default", "prompt": "ECHO:ab",
                                              "logprobs": 1}).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b"] and lp["text_offset"] == [0, 1]


def test_unknown_route_and_model(http):
    assert http.get("/nope").json()["error"]["code"] == 404
    r = http.post("/v1/chat/completions", json={**ask("x"), "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_streamed_choices_and_one_created_per_stream(http):
    r = http.post("/v1/chat/completions", json=ask("abc", stream=True, n=3))
    chunks = sse(r)
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    for i in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == "abc"
        assert [c.get("finish_reason") for c in mine][-1] == "stop"


def test_streamed_chat_logprobs(http):
    chunks = sse(http.post("/v1/chat/completions", json=ask("ab", stream=True, logprobs=True,
                                                            top_logprobs=1)))
    entries = [e for c in chunks for e in (c["choices"][0].get("logprobs") or {}).get(
        "content", [])]
    assert [e["token"] for e in entries] == ["a", "b"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "ab"


def test_streamed_completion_echo_logprobs_and_usage(http):
    r = http.post("/v1/completions", json={
        "model": "default", "prompt": "ECHO:ab", "stream": True, "echo": True, "logprobs": 1,
        "stream_options": {"include_usage": True}})
    chunks = sse(r)
    assert all(c["object"] == "text_completion" for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == "ECHO:abab"
    offsets = [o for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
               for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [7, 8]
    assert [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
