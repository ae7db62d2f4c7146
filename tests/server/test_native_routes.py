"""/tokenize, /detokenize, /version, /get_model_info, GET /v1/models/{id} on the scripted fake
engine (the real server: tests/server/test_e2e_clients.py)."""
from __future__ import annotations

import pytest
from fake_engine import fake_client  # tests/ is on sys.path (its rootdir-less conftest)
from fastapi.testclient import TestClient

from guided.server.app import create_app


@pytest.fixture(scope="module")
def http():
    with TestClient(create_app(fake_client(max_waiting=8), drain_timeout=0)) as client:
        yield client


def test_tokenize_prompt_and_detokenize_round_trip(http):
    body = http.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True}).json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["count"] > 0
    assert body["max_model_len"] > 0
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "héllo"}


def test_tokenize_messages_applies_the_chat_template(http):
    messages = [{"role": "user", "content": "hi"}]
    with_prompt = http.post("/tokenize", json={"messages": messages}).json()
    without = http.post("/tokenize", json={"messages": messages,
                                           "add_generation_prompt": False}).json()
    assert with_prompt["tokens"][:without["count"]] == without["tokens"]
    assert with_prompt["count"] > without["count"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenize_requests_name_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.json()


def test_version_model_info_and_model_retrieval(http):
    assert http.get("/version").json()["version"]
    assert http.get("/get_model_info").json()["is_generation"] is True
    served = http.get("/v1/models").json()["data"][0]["id"]
    for name in (served, "default"):
        card = http.get(f"/v1/models/{name}").json()
        assert card["id"] == served and card["object"] == "model"
    r = http.get("/v1/models/not-a-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
