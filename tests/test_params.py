"""SamplingParams refuse out-of-range values with an InvalidRequestError naming the field (a 400
at the server), before a request can reach a step."""
from __future__ import annotations

import math

import pytest

from guided.errors import InvalidRequestError
from guided.params import MAX_SEED, MAX_STOP_TOKEN_IDS, SamplingParams


@pytest.mark.parametrize("field,value", [
    ("seed", -1), ("seed", MAX_SEED), ("seed", 2 ** 64), ("seed", 1.5),
    ("temperature", math.nan), ("temperature", -0.1), ("temperature", math.inf),
    ("top_p", 0.0), ("top_p", math.nan), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", math.inf), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("logprobs", 21), ("prompt_logprobs", 21),
    ("prompt_logprobs", -1), ("prompt_logprobs", 1.5), ("n", 17), ("max_tokens", -1),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))), ("stop_token_ids", ["2"]),
    ("stop", ["a"] * 17),
])
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{field: value})
    assert error.value.param == field


@pytest.mark.parametrize("seed", [0, 1, MAX_SEED - 1])
def test_seeds_in_range_pass(seed):
    assert SamplingParams(seed=seed).seed == seed


def test_more_than_one_constraint_is_refused():
    with pytest.raises(InvalidRequestError, match="at most one constraint"):
        SamplingParams(regex="a", choice=["a"])
