"""End to end: prompt logprobs through the real server and model, in every form clients ask for
them: completions echo + logprobs (lm-evaluation-harness's loglikelihood requests), vLLM's
prompt_logprobs field on completions and chat, SGLang's logprob_start_len on /generate."""
from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "default"
CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATION = " Paris"


def _prompt_ids(server_url: str, text: str) -> list[int]:
    r = httpx.post(server_url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": text, "max_tokens": 1, "return_token_ids": True})
    return r.json()["choices"][0]["prompt_token_ids"]


def test_lm_eval_loglikelihood_request(client, server_url):
    """What lm-eval's local-completions sends for loglikelihood: echo, logprobs=1, max_tokens=1,
    two prompts at once; it reads token_logprobs over the prompt's tokens (the first None)."""
    prompts = [CONTEXT + CONTINUATION, CONTEXT + " London"]
    r = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1,
                                  max_tokens=1, temperature=0, seed=1234)
    assert len(r.choices) == 2
    for choice, prompt in zip(sorted(r.choices, key=lambda c: c.index), prompts):
        ids = _prompt_ids(server_url, prompt)
        lp = choice.logprobs
        assert choice.text.startswith(prompt)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(math.isfinite(v) and v <= 0 for v in lp.token_logprobs[1:])
        assert "".join(lp.tokens[:len(ids)]) == prompt
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert top[token] == value and 1 <= len(top) <= 2  # the token and the best one
        # the continuation's logprob, as lm-eval sums it: the last prompt token's entry
        assert lp.token_logprobs[len(ids) - 1] < 0
    paris, london = (sorted(r.choices, key=lambda c: c.index)[k].logprobs.token_logprobs
                     for k in (0, 1))
    shared = len(_prompt_ids(server_url, CONTEXT))  # the same context: the same values
    assert paris[1:shared] == pytest.approx(london[1:shared], abs=1e-4)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, server_url):
    """vLLM's echo without generation (OpenAI's legacy scoring request): the prompt, its
    logprobs, nothing generated."""
    r = client.completions.create(model=MODEL, prompt=CONTEXT, echo=True, logprobs=0,
                                  max_tokens=0)
    choice, ids = r.choices[0], _prompt_ids(server_url, CONTEXT)
    assert choice.text == CONTEXT and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == len(ids) and r.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v <= 0 for v in choice.logprobs.token_logprobs[1:])
    plain = client.completions.create(model=MODEL, prompt=CONTEXT, echo=True, max_tokens=0)
    assert plain.choices[0].text == CONTEXT and plain.choices[0].logprobs is None


def test_vllm_prompt_logprobs_field_on_completions_and_chat(client, server_url):
    r = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    ids = _prompt_ids(server_url, CONTEXT)
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, position in zip(ids[1:], entries[1:]):
        assert str(token_id) in position and 2 <= len(position) <= 3  # the token, the top 2
        own = position[str(token_id)]
        assert own["rank"] >= 1 and own["logprob"] <= 0 and isinstance(own["decoded_token"], str)
        assert {1, 2} <= {e["rank"] for e in position.values()}  # the top 2, by rank
        assert (len(position) == 2) == (own["rank"] <= 2)  # the token among them: once
    echoed = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=2, temperature=0,
                                       echo=True, logprobs=2)
    values = echoed.choices[0].logprobs.token_logprobs[1:len(ids)]
    assert values == pytest.approx([e[str(t)]["logprob"] for t, e in zip(ids[1:], entries[1:])],
                                   abs=1e-4)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0})
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert chat_entries[0] is None and len(chat_entries) == chat.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in chat_entries[1:])
    plain = client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=1)
    assert plain.choices[0].model_extra.get("prompt_logprobs") is None


def test_streamed_echo_carries_the_prompts_logprobs_first(client):
    chunks = list(client.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=3,
                                            temperature=0, echo=True, logprobs=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == CONTEXT and first.logprobs.token_logprobs[0] is None
    assert all(v <= 0 for v in first.logprobs.token_logprobs[1:])
    assert "".join(first.logprobs.tokens) == CONTEXT
    with pytest.raises(openai.BadRequestError) as e:  # vLLM's rule for the explicit field
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"prompt_logprobs": 21})
    assert e.value.body["param"] == "prompt_logprobs"


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_generate_input_token_logprobs(server_url, stream):
    ids = _prompt_ids(server_url, CONTEXT)
    for start in (0, 3):
        r = httpx.post(server_url + "/generate", timeout=120, json={
            "text": CONTEXT, "stream": stream, "return_logprob": True,
            "logprob_start_len": start, "top_logprobs_num": 2, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        bodies = [json.loads(e[len("data: "):]) for e in r.text.split("\n\n")
                  if e and e != "data: [DONE]"] if stream else [r.json()]
        info = bodies[-1]["meta_info"]
        inputs, tops = info["input_token_logprobs"], info["input_top_logprobs"]
        assert [e[1] for e in inputs] == ids[start:] and len(tops) == len(ids) - start
        assert CONTEXT.endswith("".join(e[2] for e in inputs))
        assert (inputs[0][0] is None) == (start == 0) and (tops[0] is None) == (start == 0)
        assert all(isinstance(e[0], float) and e[0] <= 0 for e in inputs[start == 0:])
        assert all(len(top) == 2 for top in tops[start == 0:])
        assert len(info["output_token_logprobs"]) == len(bodies[-1]["output_ids"])
