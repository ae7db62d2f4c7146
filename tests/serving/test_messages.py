"""Outputs as deltas between processes: what the receiver rebuilds equals what the sender had,
step after step, when token lists grow, when a retokenized tail replaces them, when text is cut
back, with logprobs, and for finals made from copies; earlier outputs stay as they were."""
from __future__ import annotations

import pickle

from guided.outputs import RequestMetrics, RequestOutput, TokenLogprob
from guided.serving.messages import Sent, decode, encode


def _steps():
    """A request's cumulative outputs as the engine hands them out (copies of its lists)."""
    tokens, logprobs = [], []
    states = [([1, 2], "ab", False), ([1, 2, 3, 4], "abcd", False),
              ([1, 2, 9], "abX", False),  # jump-forward retokenized the tail: a new list
              ([1, 2, 9, 5, 6], "abX56", False), ([1, 2, 9, 5, 6, 7], "abX5", True)]
    for ids, text, finished in states:
        if ids[:len(tokens)] == tokens:
            tokens.extend(ids[len(tokens):])
            logprobs.extend(float(i) for i in ids[len(logprobs):])
        else:
            tokens, logprobs = list(ids), [float(i) for i in ids]
        yield RequestOutput("r", [7, 8], list(tokens), text, finished,
                            "stop" if finished else None, logprobs=list(logprobs),
                            metrics=RequestMetrics(forward_passes=len(ids)),
                            prompt_logprobs=PROMPT_LOGPROBS)


PROMPT_LOGPROBS = [None, TokenLogprob(8, -1.5, [(3, -0.5)], rank=2)]


def test_deltas_rebuild_every_output_and_leave_earlier_ones_alone():
    sent, got, rebuilt, originals = Sent(), None, [], []
    for out in _steps():
        delta = pickle.loads(pickle.dumps(encode(out, sent)))  # as through the pipe
        got = decode(delta, got)
        rebuilt.append(got)
        originals.append((list(out.token_ids), out.text, list(out.logprobs)))
        assert got == out
    for got, (ids, text, logprobs) in zip(rebuilt, originals):
        assert (got.token_ids, got.text, got.logprobs) == (ids, text, logprobs)
    assert rebuilt[-1].finished and rebuilt[-1].finish_reason == "stop"
    assert rebuilt[0].prompt_token_ids == [7, 8] == rebuilt[-1].prompt_token_ids


def test_a_delta_carries_only_what_is_new():
    steps = list(_steps())
    sent = Sent()
    first, second, retokenized = (encode(out, sent) for out in steps[:3])
    assert first.prompt_token_ids == [7, 8] and second.prompt_token_ids is None  # once
    assert first.prompt_logprobs == PROMPT_LOGPROBS and second.prompt_logprobs is None
    assert (second.token_start, second.new_token_ids) == (2, [3, 4])  # tokens from where the receiver's end
    assert (second.text_start, second.new_text) == (2, "cd")  # text likewise
    assert (retokenized.token_start, retokenized.new_token_ids) == (0, [1, 2, 9])  # a new list: all of it
    assert (retokenized.text_start, retokenized.new_text) == (0, "abX")  # text that does not extend


def test_a_final_copied_from_the_last_output_is_sent_whole():
    steps = list(_steps())
    sent, got = Sent(), None
    for out in steps[:2]:
        got = decode(encode(out, sent), got)
    final = RequestOutput("r", [7, 8], list(steps[1].token_ids), steps[1].text, True, "abort")
    got = decode(encode(final, sent), got)
    assert got.token_ids == [1, 2, 3, 4] and got.finish_reason == "abort" and got.finished
