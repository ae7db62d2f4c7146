"""Property-based fuzzing of /v1/chat/completions and /v1/completions on the real server: random
JSON bodies and random values for every request field never get a 5xx, a hang or a dropped
connection; every status >= 400 carries OpenAI's error body; a 200 is a complete answer."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

BOUND_S = 40.0  # per request (the compile timeout is 30 s)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck),
                print_blob=True)

# Any JSON value, small (hypothesis shrinks failures to something readable).
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)

# Field values: the valid ones, their edges, and garbage. max_tokens stays small when valid, so
# requests that pass validation finish quickly on a CPU.
small_ints = st.sampled_from([-(2 ** 63), -1, 0, 1, 2, 3, 16, 17, 2 ** 31, 10 ** 12])
numbers = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6) \
    | st.sampled_from([0.0, 1e-30, 5e-324, 1.0, 2.0, 2.0000001, -0.0])
anything = json_values | small_ints | numbers
max_tokens = st.integers(0, 6) | small_ints | json_values.filter(
    lambda v: v is not None and not (type(v) in (int, float) and 18 <= v <= 100_000))  # slow
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", "", 5])
contents = st.text(max_size=40) | st.none() | json_values | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                           "text": st.text(max_size=10)}), max_size=2)
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": contents}), max_size=3) \
    | json_values
schemas = st.sampled_from([
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "maxLength": 5}, {"type": "integer", "minimum": 3, "maximum": 1},
    {"$ref": "#/$defs/x"}, {"enum": []}, {"type": "array", "minItems": 3, "maxItems": 1}, True,
    False]) | json_values
constraints = st.one_of(
    st.fixed_dictionaries({"regex": st.sampled_from(["[a-z]{1,4}", "(a+)+$", "(?=a)", r"(a)\1",
                                                     "((", "", "\\d{2}"]) | st.text(max_size=12)}),
    st.fixed_dictionaries({"choice": st.lists(st.text(max_size=6), max_size=4) | json_values}),
    st.fixed_dictionaries({"grammar": st.sampled_from(['root ::= "a" | "b"', 'root ::= "a" (',
                                                       "root ::= x"]) | st.text(max_size=12)}),
    st.fixed_dictionaries({"json_schema": schemas}),
    st.fixed_dictionaries({"response_format": st.fixed_dictionaries({
        "type": st.sampled_from(["text", "json_object", "json_schema", "xml"]),
        "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": schemas})})}),
    st.just({}))
sampling_fields = {
    "temperature": anything, "top_p": anything, "top_k": anything, "min_p": anything,
    "n": st.integers(-1, 3) | small_ints | json_values, "seed": anything,
    "stop": st.lists(st.text(max_size=4), max_size=20) | json_values,
    "presence_penalty": anything, "frequency_penalty": anything,
    "repetition_penalty": anything, "stream": st.booleans() | json_values,
    "stop_token_ids": st.lists(small_ints, max_size=3) | json_values,
    "ignore_eos": st.booleans(), "logit_bias": json_values, "user": json_values,
}


def bodies(required: dict) -> st.SearchStrategy[dict]:
    """A request: the required fields (mostly valid), an optional subset of the others, maybe
    one constraint, and max_tokens always present (small when valid)."""
    return st.builds(
        lambda base, extra, constraint, mt: {**base, **extra, **constraint, "max_tokens": mt},
        st.fixed_dictionaries(required),
        st.fixed_dictionaries({}, optional=sampling_fields), constraints, max_tokens)


chat_bodies = bodies({"model": st.sampled_from(["default", "gpt-4", ""]),
                      "messages": messages}) | json_values
completion_bodies = bodies({
    "model": st.sampled_from(["default", "nope"]),
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 60_000), max_size=5)
    | st.lists(st.lists(st.integers(-5, 60_000), max_size=3), max_size=3) | json_values,
}) | st.builds(
    lambda b, lp, echo: {**b, "logprobs": lp, "echo": echo},
    bodies({"model": st.just("default"), "prompt": st.text(min_size=1, max_size=20)}),
    st.integers(-2, 30) | json_values, st.booleans())


@pytest.fixture(scope="module")
def http(server_url):
    with httpx.Client(base_url=server_url, timeout=BOUND_S * 2) as client:
        yield client


def check(http: httpx.Client, path: str, body) -> None:
    start = time.monotonic()
    if isinstance(body, dict) and body.get("stream") is True:
        with http.stream("POST", path, json=body) as response:
            response.read()
    else:
        response = http.post(path, json=body)
    assert time.monotonic() - start < BOUND_S, f"took {time.monotonic() - start:.0f} s"
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        return
    assert response.status_code == 200
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [e[len("data: "):] for e in response.text.split("\n\n") if e]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert response.json()["choices"]


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat(http, body):
    check(http, "/v1/chat/completions", body)


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions(http, body):
    check(http, "/v1/completions", body)


@FUZZ
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_fuzz_raw_bytes(http, raw, path):
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_alive_after_fuzzing(http):
    response = http.post("/v1/completions", json={"model": "default", "prompt": "Hello",
                                                  "max_tokens": 4})
    assert response.status_code == 200 and response.json()["choices"][0]["text"]
