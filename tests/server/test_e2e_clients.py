"""End to end: what clients of vLLM and SGLang send, through the official openai client to the
real server and model; every constrained output validated, every refusal a 400 naming the field."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "default"
POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}
GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'
GRAMMAR_RE = r"The answer is (yes|no)\."


def _check_json(text):
    jsonschema.validate(json.loads(text), POINT)


def _check_regex(pattern):
    return lambda text: re.fullmatch(pattern, text) is not None or pytest.fail(text)


def _check_choice(options):
    return lambda text: text in options or pytest.fail(text)


CASES = [  # (extra_body, check of the output text)
    ({"guided_json": POINT}, _check_json),
    ({"structured_outputs": {"json": POINT}}, _check_json),
    ({"json_schema": json.dumps(POINT)}, _check_json),  # SGLang sends a JSON string
    ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, _check_regex(r"[0-9]{3}-[0-9]{4}")),
    ({"structured_outputs": {"regex": r"(red|green|blue)!"}}, _check_regex(r"(red|green|blue)!")),
    ({"guided_choice": ["sunny", "rainy"]}, _check_choice({"sunny", "rainy"})),
    ({"structured_outputs": {"choice": ["left", "right"]}}, _check_choice({"left", "right"})),
    ({"guided_grammar": GRAMMAR, "guided_decoding_backend": "xgrammar"}, _check_regex(GRAMMAR_RE)),
    ({"ebnf": GRAMMAR}, _check_regex(GRAMMAR_RE)),
    ({"structured_outputs": {"grammar": GRAMMAR}}, _check_regex(GRAMMAR_RE)),
]


@pytest.mark.parametrize("extra,check", CASES, ids=[next(iter(c[0])) + str(i)
                                                    for i, c in enumerate(CASES)])
def test_vllm_and_sglang_constraint_fields_on_chat(client, extra, check):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer briefly."}], temperature=0,
        max_tokens=40, extra_body=extra)
    assert r.choices[0].finish_reason == "stop", r
    check(r.choices[0].message.content)


@pytest.mark.parametrize("extra,check", CASES[::3], ids=[next(iter(c[0])) for c in CASES[::3]])
def test_vllm_and_sglang_constraint_fields_on_completions(client, extra, check):
    r = client.completions.create(model=MODEL, prompt="Q: Say something.\nA:", temperature=0,
                                  max_tokens=40, extra_body=extra)
    assert r.choices[0].finish_reason == "stop", r
    check(r.choices[0].text)


@pytest.mark.parametrize("extra,param,words", [
    ({"guided_json": POINT, "guided_regex": "a"}, "guided_regex", "at most one constraint"),
    ({"structural_tag": "{}"}, "structural_tag", "structural_tag needs"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "whitespace"),
    ({"structured_outputs": {"jsn": POINT}}, "structured_outputs.jsn", "did you mean 'json'"),
    ({"response_fromat": {"type": "json_object"}}, "response_fromat",
     "did you mean 'response_format'"),
    ({"guided_jsn": POINT}, "guided_jsn", "did you mean 'guided_json'"),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_refused_constraint_fields_name_the_field(client, endpoint, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=4, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    error = e.value.body
    assert error["param"] == param and words in error["message"], error


def test_unknown_non_constraint_fields_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"frobnicate": 1, "cache_salt": "x"}, metadata={"k": "v"})
    assert r.choices[0].finish_reason in ("stop", "length")


# ---- SGLang's native /generate, vLLM's /tokenize, /detokenize, /version ----------------------

@pytest.mark.parametrize("params,check", [
    ({"json_schema": json.dumps(POINT)}, _check_json),
    ({"regex": r"(cat|dog)s? [0-9]{1,3}"}, _check_regex(r"(cat|dog)s? [0-9]{1,3}")),
    ({"ebnf": GRAMMAR}, _check_regex(GRAMMAR_RE)),
])
def test_sglang_generate_with_constraints(server_url, params, check):
    r = httpx.post(server_url + "/generate", timeout=300, json={
        "text": "Q: Tell me something.\nA:", "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, **params}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["meta_info"]["finish_reason"]["type"] == "stop", body
    check(body["text"])


def test_sglang_generate_reports_prompt_tokens_from_the_prefix_cache(server_url):
    text = "Q: " + " ".join(f"item {i}," for i in range(40)) + " which item comes last?\nA:"

    def generate() -> dict:
        r = httpx.post(server_url + "/generate", timeout=300, json={
            "text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]

    generate()
    again = generate()  # its full blocks were cached by the first
    assert 16 <= again["cached_tokens"] <= again["prompt_tokens"], again


def test_sglang_generate_streams_input_ids(server_url):
    ids = httpx.post(server_url + "/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
    texts = []
    with httpx.stream("POST", server_url + "/generate", timeout=300, json={
            "input_ids": ids, "stream": True, "sampling_params": {
                "max_new_tokens": 12, "temperature": 0, "regex": "( [a-z]+){1,4}\\."}}) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                texts.append(json.loads(line[5:])["text"])
    assert len(texts) > 1 and all(texts[-1].startswith(t) for t in texts)  # cumulative text
    assert re.fullmatch(r"( [a-z]+){1,4}\.", texts[-1]), texts[-1]


def test_sglang_generate_streams_a_batch(server_url):
    """A batch streamed (SGLang serves it; guided refused it): each event has its prompt's
    index and cumulative text, every final text validated."""
    pattern = "( [a-z]{1,8}){1,3}\\."
    last: dict[int, dict] = {}
    with httpx.stream("POST", server_url + "/generate", timeout=300, json={
            "text": ["The sky is", "Grass is"], "stream": True,
            "sampling_params": {"max_new_tokens": 30, "temperature": 0, "regex": pattern}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                body = json.loads(line[5:])
                last[body["index"]] = body
    assert sorted(last) == [0, 1]
    for body in last.values():
        assert re.fullmatch(pattern, body["text"]) and body["meta_info"]["finish_reason"]


def test_sglang_generate_no_stop_trim_and_logprobs(server_url):
    def generate(**kw):
        r = httpx.post(server_url + "/generate", timeout=300, json={
            "text": "Q: Name three colours.\nA:", **kw.pop("top", {}), "sampling_params": {
                "max_new_tokens": 16, "temperature": 0, "regex": "( [a-z]+,){2} [a-z]+\\.",
                **kw}})
        assert r.status_code == 200, r.text
        return r.json()

    full = generate(top={"return_logprob": True, "top_logprobs_num": 3})
    info = full["meta_info"]
    assert [e[1] for e in info["output_token_logprobs"]] == full["output_ids"]
    for (logprob, token_id, text), top in zip(info["output_token_logprobs"],
                                              info["output_top_logprobs"]):
        assert logprob <= 0 and text is None and len(top) == 3
        assert top[0][0] >= logprob  # greedy: the chosen token is the likeliest allowed one
    stop = full["text"].split(",")[1]  # the second colour, with its leading space
    trimmed, kept = generate(stop=[stop]), generate(stop=[stop], no_stop_trim=True)
    assert trimmed["text"] == full["text"][:full["text"].index(stop)]
    assert kept["text"].startswith(trimmed["text"] + stop) and full["text"].startswith(
        kept["text"])
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_tokenize_detokenize_version_and_model_alias(server_url, client):
    body = httpx.post(server_url + "/tokenize", json={"prompt": "Hello, world"}).json()
    assert body["count"] == len(body["tokens"]) > 0
    back = httpx.post(server_url + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert back["prompt"] == "Hello, world"
    chat = httpx.post(server_url + "/tokenize", json={
        "messages": [{"role": "user", "content": "Hi"}]}).json()
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=1)
    assert chat["count"] == r.usage.prompt_tokens
    assert httpx.get(server_url + "/version").json()["version"]
    served = client.models.list().data[0].id
    assert client.models.retrieve(served).id == served
    assert client.models.retrieve("default").id == served
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_logit_bias_and_min_tokens_are_applied(server_url, client):
    """A strong bias forces its token; min_tokens keeps the answer going past where greedy
    decoding would end it; a bias on a token past the vocabulary is a 400 naming the field."""
    messages = [{"role": "user", "content": "Say OK."}]
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                       logit_bias={"42": 100})
    want = httpx.post(server_url + "/detokenize", json={"tokens": [42, 42, 42]}).json()
    assert forced.choices[0].text == want["prompt"]
    short = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64,
                                           temperature=0)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    longer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64,
                                            temperature=0, extra_body={"min_tokens": n + 5})
    assert longer.usage.completion_tokens >= n + 5
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       logit_bias={"999999": 5})
    assert e.value.body["param"] == "logit_bias"


# ---- one language per constraint ------------------------------------------------------------

LARK_SQL = """
start: select_statement
select_statement: "SELECT " column " from " table " where " condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""


def test_lark_guided_grammar_as_vllm_clients_send_it(client):
    r = client.completions.create(
        model=MODEL, prompt="Generate an SQL query that selects col_1 from table_1:\n",
        temperature=0, max_tokens=40, extra_body={"guided_grammar": LARK_SQL})
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"SELECT col_[12] from table_[12] where col_[12]=[12]", r.choices[0].text)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={
            "guided_grammar": 'start: "a" " "*\n%ignore " "'})
    assert e.value.body["param"] == "guided_grammar" and "%ignore" in e.value.body["message"]
    assert "root ::=" in e.value.body["message"]


# ---- structural tags -------------------------------------------------------------------------

ANSWER_TAG = {"structures": [{"begin": "Answer: ", "schema": {"type": "integer", "minimum": 0,
                                                              "maximum": 99},
                              "end": "."}], "triggers": ["Answer: "]}


def _tagged_values(text: str) -> list[int]:
    """Every tagged section of the output parsed: after each trigger, an integer, then the end."""
    values = []
    for part in text.split("Answer: ")[1:]:
        value, end, _ = part.partition(".")
        assert end == ".", text
        values.append(json.loads(value))
        assert isinstance(values[-1], int) and 0 <= values[-1] <= 99, text
    return values


def test_structural_tag_response_format_and_sglang_field(client, server_url):
    prompt = "What is 2 + 2? Reply exactly in the form 'Answer: <number>.'"
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=40, response_format={"type": "structural_tag", **ANSWER_TAG})
    _tagged_values(r.choices[0].message.content)
    body = httpx.post(server_url + "/generate", timeout=300, json={
        "text": "Q: What is 3 + 4?\nA: Answer: ", "sampling_params": {
            "max_new_tokens": 30, "temperature": 0,
            "structural_tag": json.dumps({"structures": [{
                "begin": "<n>", "schema": {"type": "integer"}, "end": "</n>"}],
                "triggers": ["<n>"]})}}).json()
    for part in body["text"].split("<n>")[1:]:
        value, end, _ = part.partition("</n>")
        assert end and isinstance(json.loads(value), int), body["text"]


# ---- vLLM's and SGLang's response extensions, and their refusals ------------------------------

def _raw(server_url: str, path: str, **body) -> dict:
    r = httpx.post(server_url + path, timeout=300, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_stream_options_need_stream_and_continuous_usage_counts_every_chunk(client):
    """vLLM's (and OpenAI's) 400 for stream_options without a stream; continuous_usage_stats:
    usage in every chunk, its completion tokens growing, the usage-only chunk last."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=6,
        temperature=0, stream=True, stream_options=options, extra_body={"min_tokens": 6})
    counts = []
    for chunk in chat:
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        counts.append((chunk.usage.completion_tokens, bool(chunk.choices)))
    assert counts[0] == (0, True) and counts[-1] == (6, False), counts
    grown = [c for c, has_choices in counts if has_choices]
    assert grown == sorted(set(grown)), counts  # strictly growing while choices come
    text = ""
    for chunk in client.completions.create(model=MODEL, prompt="Digits: ", max_tokens=6,
                                           temperature=0, stream=True, stream_options=options,
                                           extra_body={"regex": "[0-9]{4}"}):
        assert chunk.usage.completion_tokens > 0
        text += "".join(c.text for c in chunk.choices)
    assert re.fullmatch("[0-9]{4}", text), text


def test_return_token_ids_and_tokens_as_ids(server_url, client):
    """return_token_ids: the prompt's and each choice's ids; return_tokens_as_token_ids: logprobs
    name tokens "token_id:<id>"; legacy logprobs=0 still gives the sampled token's entry."""
    ids = httpx.post(server_url + "/tokenize", json={"prompt": "Digits:"}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt="Digits:", max_tokens=6, temperature=0,
                                  logprobs=0, extra_body={"return_token_ids": True,
                                                          "return_tokens_as_token_ids": True,
                                                          "regex": " [0-9]{3}"})
    choice = r.choices[0]
    assert re.fullmatch(" [0-9]{3}", choice.text), choice.text
    assert choice.prompt_token_ids == ids and choice.token_ids
    named = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert named == choice.token_ids[:len(named)] and len(named) >= len(choice.token_ids) - 1
    assert all(top == {t: lp} for top, t, lp in zip(choice.logprobs.top_logprobs,
                                                     choice.logprobs.tokens,
                                                     choice.logprobs.token_logprobs))
    text = httpx.post(server_url + "/detokenize", json={"tokens": choice.token_ids}).json()
    assert text["prompt"].startswith(choice.text)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say yes or no."}], max_tokens=4,
        temperature=0, extra_body={"return_token_ids": True, "guided_choice": ["yes", "no"]})
    rendered = httpx.post(server_url + "/tokenize", json={
        "messages": [{"role": "user", "content": "Say yes or no."}]}).json()["tokens"]
    assert chat.prompt_token_ids == rendered and chat.choices[0].message.content in ("yes", "no")
    plain = client.chat.completions.create(model=MODEL, max_tokens=1,
                                           messages=[{"role": "user", "content": "hi"}])
    assert "prompt_token_ids" not in plain.model_dump() or plain.prompt_token_ids is None


WORDS = "( [a-z]{1,8}){1,3}\\."


def test_streamed_token_ids_and_logprobs_in_every_chunk(client):
    stream = client.completions.create(
        model=MODEL, prompt="A short fact about Python:", max_tokens=30, temperature=0,
        stream=True, logprobs=1, extra_body={"return_token_ids": True,
                                             "return_tokens_as_token_ids": True,
                                             "regex": WORDS})
    chunks = list(stream)
    assert chunks[0].choices[0].prompt_token_ids
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in chunks[1:])
    streamed = [i for c in chunks for i in c.choices[0].token_ids]
    named = [int(t.removeprefix("token_id:")) for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed and named[:len(streamed)] == streamed
    text = "".join(c.choices[0].text for c in chunks)
    assert re.fullmatch(WORDS, text), text
    chat = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        stream=True, extra_body={"return_token_ids": True}))
    assert chat[0].prompt_token_ids and all("prompt_token_ids" not in c.model_dump()
                                            for c in chat[1:])
    assert [i for c in chat for i in (c.choices[0].model_dump().get("token_ids") or [])]


def test_stop_reason_matched_stop_and_include_stop_str(server_url, client):
    """vLLM's stop_reason and SGLang's matched_stop (null on a length stop, sent all the same),
    the EOS token as SGLang's matched_stop; include_stop_str_in_output keeps the stop string."""
    kw = {"prompt": "1, 2, 3,", "max_tokens": 12, "temperature": 0, "stop": ["5"]}
    body = _raw(server_url, "/v1/completions", **kw)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "5" == \
        choice["matched_stop"] and not choice["text"].endswith("5")
    kept = _raw(server_url, "/v1/completions", include_stop_str_in_output=True, **kw)
    assert kept["choices"][0]["text"] == choice["text"] + "5"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, stream=True, extra_body={"include_stop_str_in_output": True}, **kw))
    assert streamed == choice["text"] + "5"
    cut = _raw(server_url, "/v1/chat/completions", max_tokens=2,
               messages=[{"role": "user", "content": "Hi"}])["choices"][0]
    assert cut["finish_reason"] == "length" and cut["matched_stop"] is None and \
        "matched_stop" in cut and "stop_reason" in cut
    ended = _raw(server_url, "/v1/chat/completions", max_tokens=8, temperature=0,
                 messages=[{"role": "user", "content": "Yes or no?"}],
                 guided_choice=["yes", "no"])["choices"][0]
    assert ended["message"]["content"] in ("yes", "no") and ended["finish_reason"] == "stop"
    assert ended["stop_reason"] is None  # EOS: not one of stop / stop_token_ids


@pytest.mark.parametrize("extra,param", [
    ({"use_beam_search": True, "n": 2}, "use_beam_search"),
    ({"best_of": 3}, "best_of"),
    ({"stop_regex": "and|or"}, "stop_regex"),
    ({"stop_token_ids": [49152]}, "stop_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_sampling_fields_guided_does_not_do_are_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    if param == "stop_token_ids":
        assert "49152" in e.value.body["message"]


@pytest.mark.parametrize("extra,param,words", [
    ({"logit_bias": {"bad1": 50, "bad2": 20}}, "logit_bias", ["bad1", "bad2"]),
    ({"logit_bias": {"7": "not_a_number"}}, "logit_bias", ["'7'"]),
    ({"top_logprobs": 3}, "top_logprobs", ["logprobs"]),
])
def test_chat_field_errors_name_the_offender(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, **extra)
    assert e.value.body["param"] == param
    assert all(word in e.value.body["message"] for word in words), e.value.body


def test_custom_roles_invocations_and_truncated_prompts(server_url, client):
    """vLLM takes any role (the chat template renders it) and serves /invocations by the body's
    shape; truncate_prompt_tokens keeps the prompt's last tokens."""
    answers = [client.chat.completions.create(
        model=MODEL, messages=[{"role": "my-custom-role", "content": content}], max_tokens=8,
        temperature=0, extra_body={"guided_regex": "[A-Z][a-z]+"}).choices[0].message.content
        for content in ("What is 1+1?", [{"type": "text", "text": "What is 1+1?"}])]
    assert answers[0] == answers[1] and re.fullmatch("[A-Z][a-z]+", answers[0]), answers
    chat = _raw(server_url, "/invocations", messages=[{"role": "user", "content": "Hi"}],
                max_tokens=2)
    text = _raw(server_url, "/invocations", prompt="Hi", max_tokens=2, guided_regex="[0-9]+")
    assert chat["object"] == "chat.completion" and text["object"] == "text_completion"
    assert re.fullmatch("[0-9]+", text["choices"][0]["text"])
    r = client.completions.create(model=MODEL, prompt=list(range(100, 110)), max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 4,
                                              "return_token_ids": True})
    assert r.choices[0].prompt_token_ids == list(range(106, 110)) and r.usage.prompt_tokens == 4


def test_continue_final_message_and_chat_echo(client):
    """vLLM's add_generation_prompt / continue_final_message: the answer continues the last
    assistant message; echo puts that message's text first, whole and streamed."""
    opening = "An apple a day keeps"
    messages = [{"role": "user", "content": "Tell me a common saying."},
                {"role": "assistant", "content": opening}]
    tail = " the [a-z]{1,10} away\\."

    def answer(echo: bool, **kw) -> str:
        extra = {"echo": echo, "continue_final_message": True, "add_generation_prompt": False,
                 "guided_regex": tail}
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                           temperature=0, extra_body=extra, **kw)
        if kw.get("stream"):
            return "".join(c.choices[0].delta.content or "" for c in r)
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    continued = answer(False)
    assert re.fullmatch(tail, continued), continued
    assert answer(True) == opening + continued == answer(True, stream=True)


def test_cache_report_counts_prompt_tokens_from_the_prefix_cache(launch_server, client):
    """serve --enable-cache-report (SGLang's flag; vLLM's --enable-prompt-tokens-details):
    usage.prompt_tokens_details.cached_tokens, whole and streamed; off by default (clients
    compare usage with CompletionUsage(...) whole)."""
    url, _ = launch_server("--enable-cache-report", "--max-num-seqs", "4", name="cache-report")
    reporting = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                              timeout=300)
    question = "List: " + ", ".join(f"item {i}" for i in range(30)) + ". Which is first?"
    kw = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 6,
          "temperature": 0, "extra_body": {"guided_regex": "item [0-9]{1,2}"}}
    first = reporting.chat.completions.create(**kw)
    again = reporting.chat.completions.create(**kw)
    assert re.fullmatch("item [0-9]{1,2}", again.choices[0].message.content)
    assert first.usage.prompt_tokens_details.cached_tokens < \
        again.usage.prompt_tokens_details.cached_tokens <= again.usage.prompt_tokens
    streamed = [c.usage for c in reporting.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw) if c.usage]
    assert streamed[-1].prompt_tokens_details.cached_tokens >= 16
    plain = client.chat.completions.create(**kw)
    assert plain.usage.prompt_tokens_details is None
