"""append_tokens (guided/engine/append.py) against the default model's tokenizer: a row's tokens
appended at once, decoded once, and cut where the request finishes, as token by token; and
append_prompt_logprobs: a step's prompt spans onto their requests, in order, once each."""
from __future__ import annotations

import pytest

from guided.engine.append import Finish, append_prompt_logprobs, append_tokens
from guided.engine.detokenizer import fast_decode
from guided.fsm.vocab import TokenVocab
from guided.params import SamplingParams
from guided.scheduler.output import RowMap
from guided.scheduler.request import Request
from guided.scheduler.scheduler import ScheduledRequest, StepPlan
from guided.worker.loader import load_tokenizer
from guided.worker.step_io import PromptLogprobs


@pytest.fixture(scope="module")
def tok():
    tokenizer = load_tokenizer("default")
    return tokenizer, TokenVocab.from_tokenizer(tokenizer).token_bytes


class CountingDecode:
    def __init__(self, decode):
        self.decode, self.calls = decode, 0

    def __call__(self, ids, **kwargs):
        self.calls += 1
        return self.decode(ids, **kwargs)


def _request(params: SamplingParams, eos: tuple[int, ...] = (), max_tokens: int = 64) -> Request:
    return Request(request_id="r", prompt_token_ids=[1, 2], params=params, seed=0,
                   eos_token_ids=eos, max_tokens=max_tokens)


def _append(tok, request, tokens, **kwargs):
    tokenizer, token_bytes = tok
    decode = CountingDecode(fast_decode(tokenizer))
    n, finish = append_tokens(request, tokens, kwargs.pop("logprobs", None), decode=decode,
                              max_model_len=kwargs.pop("max_model_len", 4096))
    return n, finish, decode.calls


def _ids(tok, text: str) -> list[int]:
    return tok[0].encode(text, add_special_tokens=False)


def test_a_rows_tokens_are_decoded_once(tok):
    request = _request(SamplingParams())
    ids = _ids(tok, "The quick brown fox")
    n, finish, calls = _append(tok, request, ids)
    assert (n, finish) == (len(ids), None) and request.output_token_ids == ids
    assert request.text == "The quick brown fox" and calls == 2  # prefix and full, once


def test_a_stop_token_is_kept_in_the_ids_but_not_in_the_text(tok):
    eos = tok[0].eos_token_id
    request = _request(SamplingParams(skip_special_tokens=False), eos=(eos,))
    ids = _ids(tok, "Hi there")
    n, finish, _ = _append(tok, request, [*ids, eos, 42])
    assert n == len(ids) + 1 and finish == Finish("stop", eos)
    assert request.output_token_ids == [*ids, eos] and request.text == "Hi there"


def test_max_tokens_cuts_the_row(tok):
    request = _request(SamplingParams(), max_tokens=3)
    ids = _ids(tok, "one two three four five")
    n, finish, _ = _append(tok, request, ids)
    assert n == 3 and finish == Finish("length") and request.output_token_ids == ids[:3]


def test_a_stop_string_cuts_at_the_token_that_makes_it(tok):
    request = _request(SamplingParams(stop=["brown"]))
    ids = _ids(tok, "The quick brown fox jumps")
    n, finish, _ = _append(tok, request, ids)
    assert finish == Finish("stop", "brown") and request.text == "The quick "
    assert request.output_token_ids == ids[:n] and n < len(ids)


def test_logprobs_follow_the_appended_tokens(tok):
    request = _request(SamplingParams(logprobs=0))
    request.logprobs = []
    ids = _ids(tok, '{"name": "Jo')
    lps = [(-0.5, []) for _ in ids]
    n, _, _ = _append(tok, request, ids, logprobs=lps)
    assert len(request.logprobs) == n == len(ids)


def test_a_token_the_grammar_rejects_ends_the_request_unappended(tok):
    class Rejecting:
        def accept_token(self, token):
            return token != 99

        def ended_with(self, token):
            return False

    tokenizer, token_bytes = tok
    request = _request(SamplingParams())
    request.matcher = Rejecting()
    n, finish = append_tokens(request, [5, 6, 99, 7], None, decode=fast_decode(tokenizer),
                              max_model_len=4096)
    assert n == 2 and finish.reason == "error" and request.output_token_ids == [5, 6]


def test_final_outputs_are_decoded_once_at_the_finish(tok):
    ids = _ids(tok, "Grüße aus 東京, again and again 🙂")
    eos = tok[0].eos_token_id
    request = _request(SamplingParams(output_kind="final", skip_special_tokens=False),
                       eos=(eos,))
    for token in ids[:-1]:  # token by token, as steps append them: no text yet
        n, finish, calls = _append(tok, request, [token])
        assert (n, finish, calls) == (1, None, 0)
    assert request.text == ""
    n, finish, calls = _append(tok, request, [ids[-1], eos, 42])
    assert (n, finish) == (2, Finish("stop", eos))
    assert calls > 0 and request.output_token_ids == [*ids, eos]
    assert request.text == tok[0].decode(ids)  # the stop token is never text


def test_final_outputs_reach_their_length_and_still_search_stop_strings(tok):
    ids = _ids(tok, "one two three four five")
    request = _request(SamplingParams(output_kind="final"), max_tokens=len(ids) - 1)
    _, finish, _ = _append(tok, request, ids)
    assert finish == Finish("length") and request.text == tok[0].decode(ids[:-1])
    # a stop string is searched for in the text as it grows: that text is made every step
    request = _request(SamplingParams(output_kind="final", stop=["three"]))
    assert request.params.text_per_step
    _, finish, _ = _append(tok, request, ids)
    assert finish == Finish("stop", "three") and request.text == "one two "


def _span(values: list[float]) -> PromptLogprobs:
    return PromptLogprobs(values, [2] * len(values), [[9]] * len(values), [[-0.1]] * len(values))


def test_prompt_logprobs_append_in_order_and_a_recomputed_chunk_keeps_what_is_held():
    request = Request(request_id="r", prompt_token_ids=[10, 11, 12, 13, 14, 15],
                      params=SamplingParams(prompt_logprobs=1), seed=0, eos_token_ids=(),
                      max_tokens=8)
    request.prompt_logprobs = [None]
    plan = StepPlan(scheduled=[ScheduledRequest(request, 3, 0, sample=False)])
    append_prompt_logprobs(plan, RowMap(prompt_owner=[0], prompt_first=[1]),
                           [_span([-1.0, -2.0, -3.0])])  # positions 1..3
    # preempted, recomputed from the start: positions 1..5, of which 4 and 5 are new
    append_prompt_logprobs(plan, RowMap(prompt_owner=[0], prompt_first=[1]),
                           [_span([-7.0, -7.0, -7.0, -4.0, -5.0])])
    entries = request.prompt_logprobs
    assert entries[0] is None
    assert [(e.token_id, e.logprob, e.rank, e.top) for e in entries[1:]] == [
        (t, lp, 2, [(9, -0.1)]) for t, lp in zip([11, 12, 13, 14, 15], [-1, -2, -3, -4, -5])]
    request.prompt_logprobs = [None]  # a span past a gap is not appended out of place
    append_prompt_logprobs(plan, RowMap(prompt_owner=[0], prompt_first=[3]), [_span([-1.0])])
    assert request.prompt_logprobs == [None]
