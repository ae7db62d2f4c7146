"""Incremental detokenization with the default model's tokenizer: the fast (Rust) decode equals
the tokenizer's own, and the deltas add up to the text of the whole output."""
from __future__ import annotations

import random

import pytest

from guided.engine.detokenizer import detokenize_rest, detokenize_step, fast_decode
from guided.params import SamplingParams
from guided.scheduler.request import Request
from guided.worker.loader import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def test_fast_decode_equals_the_tokenizers_decode(tokenizer):
    decode = fast_decode(tokenizer)
    assert decode is not tokenizer.decode  # the Rust path is taken for this tokenizer
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    for _ in range(500):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 9))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip)


def test_spaces_before_punctuation_are_kept_as_llama_cpp_decodes_them(tokenizer):
    # no "clean-up" (whatever a transformers version's default): the Rust decode stays usable
    assert tokenizer.clean_up_tokenization_spaces is False
    text = "a . b , c ! d ? e 's"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_deltas_add_up_to_the_whole_text_and_never_split_a_character(tokenizer):
    text = "Grüße, 東京! naïve café ☕ — 🙂 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    request = Request("r", [1], SamplingParams(), seed=0, eos_token_ids=(), max_tokens=100)
    decode = fast_decode(tokenizer)
    deltas = []
    for token in ids:
        request.output_token_ids.append(token)
        deltas.append(detokenize_step(decode, request, True))
        assert "\ufffd" not in deltas[-1]
    assert "".join(deltas) == request.text == tokenizer.decode(ids)


def _stepwise(decode, ids: list[int], skip: bool) -> str:
    request = Request("s", [1], SamplingParams(), seed=0, eos_token_ids=(), max_tokens=999)
    for token in ids:
        request.output_token_ids.append(token)
        detokenize_step(decode, request, skip)
    return request.text


def test_the_rest_at_once_is_the_text_token_by_token_steps_make(tokenizer):
    # output_kind "final" decodes once at the finish: the same text, a cut character included
    decode = fast_decode(tokenizer)
    rng = random.Random(1)
    pieces = ["Grüße", " 東京", "🙂", " naïve", " ☕", "\u00e9t\u00e9", " done", "—"]
    specials = list(tokenizer.all_special_ids)
    for trial in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 6)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        if trial % 3 == 0:  # random tokens: byte pieces that cut characters anywhere
            ids = ids + [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 4))]
        if trial % 5 == 0:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        if trial % 2 and len(ids) > 1:  # end inside a character (or not): the cut is held back
            ids = ids[:rng.randrange(1, len(ids))]
        skip = bool(trial % 4)
        request = Request("r", [1], SamplingParams(), seed=0, eos_token_ids=(), max_tokens=999)
        split = rng.randrange(len(ids) + 1)  # some decoded token by token first
        for token in ids[:split]:
            request.output_token_ids.append(token)
            detokenize_step(decode, request, skip)
        request.output_token_ids.extend(ids[split:])
        detokenize_rest(decode, request, skip)
        assert request.text == _stepwise(decode, ids, skip), (ids, split)
