"""OpenAI's logit_bias and vLLM's min_tokens (SGLang's min_new_tokens) as SamplingParams
keywords, or a 400 naming the field."""
from __future__ import annotations

from typing import Any

from guided.errors import InvalidRequestError


def sampling_extras(req: Any) -> dict:
    """logit_bias (token id strings or ints -> bias) and min_tokens, where the request sets
    them; SamplingParams checks their ranges."""
    extras: dict = {}
    bias = getattr(req, "logit_bias", None)
    if bias:
        if not isinstance(bias, dict):
            raise InvalidRequestError("logit_bias must map token ids to biases",
                                      param="logit_bias")
        try:
            extras["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias must map token ids (integers) to numbers",
                                      param="logit_bias") from None
    for name in ("min_tokens", "min_new_tokens"):
        value = getattr(req, name, None)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidRequestError(f"{name} must be a non-negative integer", param=name)
        extras["min_tokens"] = value
    return extras
