"""--api-key on the app (scripted fake engine): every route but /health wants the Bearer key,
as the official OpenAI client sends it."""
from __future__ import annotations

import pytest
from fake_engine import fake_client  # tests/ is on sys.path (its rootdir-less conftest)
from fastapi.testclient import TestClient

from guided.server.app import create_app

KEY = "sk-test-key"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "ECHO:hi"}]}


@pytest.fixture(scope="module")
def http():
    with TestClient(create_app(fake_client(max_waiting=4), drain_timeout=0, api_key=KEY)) as client:
        yield client


@pytest.mark.parametrize("method,path", [("POST", "/v1/chat/completions"),
                                         ("POST", "/v1/completions"), ("GET", "/v1/models"),
                                         ("GET", "/metrics"), ("GET", "/docs"),
                                         ("GET", "/openapi.json"), ("GET", "/nowhere")])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", "Bearer",
                                           f"Bearer {KEY}x", KEY])
def test_every_route_but_health_wants_the_key(http, method, path, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    response = http.request(method, path, headers=headers, json=CHAT)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_health_is_open_and_the_key_opens_the_rest(http):
    assert http.get("/health").status_code == 200
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert http.get("/v1/models", headers=bearer).status_code == 200
    response = http.post("/v1/chat/completions", headers=bearer, json=CHAT)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
    assert http.get("/metrics", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_the_openai_client_sends_the_key(http):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http,
                           max_retries=0)
    assert client.models.list().data
    wrong = openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=http,
                          max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
