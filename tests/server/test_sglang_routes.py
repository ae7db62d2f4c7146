"""SGLang's native POST /generate on the scripted fake engine (the real model:
tests/server/test_e2e_clients.py)."""
from __future__ import annotations

import json

import pytest
from fake_engine import fake_client  # tests/ is on sys.path (its rootdir-less conftest)
from fastapi.testclient import TestClient

from guided.server.app import create_app


@pytest.fixture(scope="module")
def http():
    with TestClient(create_app(fake_client(max_waiting=8), drain_timeout=0)) as client:
        yield client


@pytest.fixture
def compiled(http, monkeypatch) -> list:
    """The constraint specs the server has the engine compile, in order."""
    specs, engine = [], http.app.state.server.engine
    compile = engine.compile

    async def recording(spec):
        specs.append(spec)
        return await compile(spec)

    monkeypatch.setattr(engine, "compile", recording)
    return specs


def test_generate_text_with_a_constraint(http, compiled):
    r = http.post("/generate", json={"text": "ECHO:42", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "regex": "[0-9]+"}}).json()
    assert r["text"] == "42" and r["meta_info"]["finish_reason"]["type"] == "stop"
    assert r["meta_info"]["completion_tokens"] == len(r["output_ids"]) == 2
    assert compiled[-1].kind == "regex"


@pytest.mark.parametrize("field,kind", [("json_schema", "json_schema"), ("ebnf", "grammar"),
                                        ("regex", "regex")])
def test_sglang_constraint_names_reach_the_compiler(http, compiled, field, kind):
    value = {"json_schema": json.dumps({"type": "integer"}), "ebnf": 'root ::= "1"',
             "regex": "1"}[field]
    r = http.post("/generate", json={"text": "ECHO:1", "sampling_params": {field: value}})
    assert r.status_code == 200 and compiled[-1].kind == kind


def test_generate_batches_input_ids_and_streams(http):
    ids = http.post("/tokenize", json={"prompt": "ECHO:ab"}).json()["tokens"]
    batch = http.post("/generate", json={"input_ids": [ids, ids], "sampling_params": [
        {"max_new_tokens": 1}, {"max_new_tokens": 5}]}).json()
    assert [b["text"] for b in batch] == ["a", "ab"]
    assert batch[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    r = http.post("/generate", json={"text": "ECHO:abc", "stream": True})
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["text"] for e in events[:-1]]
    assert texts[-1] == "abc" and all(texts[-1].startswith(t) for t in texts)  # cumulative


@pytest.mark.parametrize("body,param", [
    ({"text": "x", "sampling_params": {"regx": "a"}}, "sampling_params.regx"),
    ({"text": "x", "sampling_params": {"regex": "a", "json_schema": "{}"}},
     "sampling_params.regex"),
    ({"text": "x", "sampling_params": {"structural_tag": 5}}, "sampling_params.structural_tag"),
    ({"text": "x", "sampling_params": {"min_new_tokens": -3}}, "sampling_params.min_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"text": "x", "sampling_params": {"regex": "(a"}}, "sampling_params.regex"),
    ({"text": "x", "input_ids": [1]}, "text"),
    ({"text": "x", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": "x", "return_logprob": True, "token_ids_logprob": [1]}, "token_ids_logprob"),
    ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
])
def test_bad_generate_requests_name_the_field(http, body, param):
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("stream", [False, True])
def test_return_logprob_as_sglang_returns_it(http, stream):
    """meta_info: (logprob, token id, text or None) per output token, the top ones per position
    with top_logprobs_num; cumulative in a stream, as the text."""
    r = http.post("/generate", json={"text": "ECHO:abc", "stream": stream, "return_logprob": True,
                                     "top_logprobs_num": 2, "return_text_in_logprobs": True})
    events = [json.loads(e[len("data: "):]) for e in r.text.split("\n\n")
              if e and e != "data: [DONE]"] if stream else [r.json()]
    for body in events:
        info, ids = body["meta_info"], body["output_ids"]
        assert info["input_token_logprobs"] == [] and info["input_top_logprobs"] == []
        assert [e[1] for e in info["output_token_logprobs"]] == ids
        assert "".join(e[2] for e in info["output_token_logprobs"]) == body["text"]
        assert all(isinstance(e[0], float) for e in info["output_token_logprobs"])
        assert [len(top) for top in info["output_top_logprobs"]] == [2] * len(ids)
    assert events[-1]["text"] == "abc"
    plain = http.post("/generate", json={"text": "ECHO:abc", "return_logprob": [True],
                                         "top_logprobs_num": 0}).json()["meta_info"]
    assert [e[2] for e in plain["output_token_logprobs"]] == [None] * 3
    assert "output_top_logprobs" not in plain
    assert "output_token_logprobs" not in http.post(
        "/generate", json={"text": "ECHO:abc"}).json()["meta_info"]


def test_generate_streams_a_batch_each_result_with_its_index(http):
    r = http.post("/generate", json={"text": ["ECHO:ab", "ECHO:xyz"], "stream": True,
                                     "sampling_params": {"n": 2}})
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    last: dict[int, str] = {}
    for event in events[:-1]:
        body = json.loads(event)
        assert body["text"].startswith(last.get(body["index"], ""))  # cumulative per index
        last[body["index"]] = body["text"]
    assert last == {0: "ab", 1: "ab", 2: "xyz", 3: "xyz"}
