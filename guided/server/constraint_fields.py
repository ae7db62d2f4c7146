"""Every constraint field name clients of OpenAI, vLLM and SGLang send -> one constraint
(SamplingParams' constraint kwargs). More than one constraint is a 400, and so is a
constraint-like field we cannot honour, naming it: never dropped silently. Fields that only pick
a backend are ignored with a log note. Also logit_bias, min_tokens and prompt_logprobs, and a 400
for the sampling fields of vLLM and SGLang that guided does not do (beam search, stop_regex)."""
from __future__ import annotations

import difflib
import logging
from typing import Any

from pydantic import ConfigDict, create_model

from guided.errors import InvalidRequestError

logger = logging.getLogger("guided.server")

# request field -> SamplingParams constraint kwarg
TOP_LEVEL = {
    "json_schema": "json_schema", "guided_json": "json_schema",
    "regex": "regex", "guided_regex": "regex",
    "choice": "choice", "guided_choice": "choice",
    "grammar": "grammar", "ebnf": "grammar", "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
}
# vLLM's structured_outputs (StructuredOutputsParams) keys -> SamplingParams constraint kwarg
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                      "grammar": "grammar", "json_object": "json_object",
                      "structural_tag": "structural_tag"}
# backend choice / fallback policy: the output's language is the same whatever they say
IGNORED = {"guided_decoding_backend"}
STRUCTURED_IGNORED = {"backend", "_backend", "_backend_was_auto", "disable_fallback",
                      "disable_any_whitespace"}
# constraint-like fields we do not enforce: a 400 naming them
UNSUPPORTED = {
    "guided_whitespace_pattern": "a custom whitespace pattern is not supported (guided's JSON "
                                 "whitespace is fixed: bounded, no runaway newlines)",
}
STRUCTURED_UNSUPPORTED = {"whitespace_pattern": UNSUPPORTED["guided_whitespace_pattern"]}
# vLLM's and SGLang's fields that change the output and that guided does not do: a 400 naming
# them, not an answer that looks as if they were honoured (field -> (refused?, why))
UNSUPPORTED_SAMPLING = {
    "use_beam_search": (lambda v, n: bool(v), "beam search is not supported"),
    "best_of": (lambda v, n: v is not None and v != n,
                "best_of other than n is not supported (no beam search or reranking)"),
    "stop_regex": (lambda v, n: v is not None,
                   "stop_regex is not supported: use stop strings, or a regex constraint"),
}
# names a misspelt field is compared with (difflib ratio at least MISSPELLING_CUTOFF)
CONSTRAINT_NAMES = sorted({*TOP_LEVEL, *IGNORED, *UNSUPPORTED, "response_format",
                           "structured_outputs", "tools", "tool_choice"})
MISSPELLING_CUTOFF = 0.8


# The constraint fields beyond OpenAI's response_format (and logit_bias, min_tokens), parsed
# loosely: constraint_kwargs and sampling_extras check each value's shape, so a 400 names its field
ConstraintExtensions = create_model(
    "ConstraintExtensions", __config__=ConfigDict(extra="ignore", populate_by_name=True),
    **{name: (Any, None) for name in (*TOP_LEVEL, "structured_outputs", *IGNORED, *UNSUPPORTED,
                                      *UNSUPPORTED_SAMPLING, "logit_bias", "min_tokens",
                                      "min_new_tokens", "prompt_logprobs")})


def check_unknown_fields(names: list[str]) -> None:
    """Unknown top-level fields are accepted (as OpenAI does), but not a misspelt constraint
    field: a constraint the client believes it sent would be dropped."""
    for name in names:
        match = difflib.get_close_matches(name, CONSTRAINT_NAMES, n=1, cutoff=MISSPELLING_CUTOFF)
        if match:
            raise InvalidRequestError(
                f"unknown field {name!r}: did you mean {match[0]!r}? (a misspelt constraint "
                "would be dropped, so the request is refused)", param=name)


# constraint kind -> (whether a value has the shape SamplingParams takes, what it must be)
_SHAPES = {
    "structural_tag": (lambda v: isinstance(v, (dict, str)),
                       "a structural tag (an object or a JSON string)"),
    "json_schema": (lambda v: isinstance(v, (dict, str, bool)),
                    "a JSON schema (an object or a JSON string)"),
    "choice": (lambda v: isinstance(v, list) and v and all(isinstance(c, str) and c for c in v),
               "a non-empty list of non-empty strings"),
    "json_object": (lambda v: isinstance(v, bool), "a boolean"),
}
_TEXT_SHAPE = (lambda v: isinstance(v, str) and v.strip(), "a non-empty string")


def _value(kind: str, value: Any, param: str) -> Any:
    ok, shape = _SHAPES.get(kind, _TEXT_SHAPE)
    if not ok(value):
        raise InvalidRequestError(f"{param} must be {shape}", param=param)
    return value


def _structured_outputs(so: Any) -> list[tuple[str, dict]]:
    if not isinstance(so, dict):
        raise InvalidRequestError("structured_outputs must be an object",
                                  param="structured_outputs")
    found: list[tuple[str, dict]] = []
    closed = False
    for key, value in so.items():
        param = f"structured_outputs.{key}"
        if value is None or key in STRUCTURED_IGNORED:
            if value is not None:
                logger.info("%s=%r is ignored: guided picks its backend itself", param, value)
            continue
        if key in STRUCTURED_UNSUPPORTED:
            raise InvalidRequestError(f"{param}: {STRUCTURED_UNSUPPORTED[key]}", param=param)
        if key == "disable_additional_properties":
            closed = bool(value)
            continue
        if key not in STRUCTURED_OUTPUTS:
            known = sorted({*STRUCTURED_OUTPUTS, *STRUCTURED_IGNORED, *STRUCTURED_UNSUPPORTED})
            hint = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            raise InvalidRequestError(
                f"unknown key {param}" + (f": did you mean {hint[0]!r}?" if hint else
                                          f"; known keys: {known}"), param=param)
        kind = STRUCTURED_OUTPUTS[key]
        if kind == "json_object" and value is False:
            continue
        found.append((param, {kind: _value(kind, value, param)}))
    if closed:
        from guided.server.tools import closed_objects  # tools imports protocol: late import

        found = [(p, {"json_schema": closed_objects(kw["json_schema"])}
                  if isinstance(kw.get("json_schema"), dict) else kw) for p, kw in found]
    return found


def response_format_constraint(rf) -> list[tuple[str, dict]]:
    if rf is None or rf.type == "text":
        return []
    if rf.type == "json_object":
        return [("response_format", {"json_object": True})]
    if rf.type == "structural_tag":  # vLLM / SGLang: structures + triggers, or a format
        tag = {k: v for k, v in (("structures", rf.structures), ("triggers", rf.triggers),
                                 ("format", rf.format)) if v is not None}
        return [("response_format", {"structural_tag": {"type": "structural_tag", **tag}})]
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                  param="response_format.json_schema.schema")
    return [("response_format", {"json_schema": rf.json_schema.schema_})]


def constraint_kwargs(req, tool_constraint: dict | None = None) -> tuple[str | None, dict]:
    """(the field the request's one constraint came from, SamplingParams kwargs)."""
    found: list[tuple[str, dict]] = []
    if tool_constraint:
        # a response_format beside tools shapes the text answer inside the tool constraint
        found.append(("tools", tool_constraint))
    else:
        found += response_format_constraint(getattr(req, "response_format", None))
    for name, kind in TOP_LEVEL.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, {kind: _value(kind, value, name)}))
    if getattr(req, "structured_outputs", None) is not None:
        found += _structured_outputs(req.structured_outputs)
    for name, why in UNSUPPORTED.items():
        if getattr(req, name, None) is not None:
            raise InvalidRequestError(f"{name}: {why}", param=name)
    for name in IGNORED:
        if getattr(req, name, None) is not None:
            logger.info("%s=%r is ignored: guided picks its backend itself", name,
                        getattr(req, name))
    if len(found) > 1:
        raise InvalidRequestError(
            f"at most one constraint per request; got {[name for name, _ in found]}",
            param=found[1][0])
    return found[0] if found else (None, {})


def sampling_extras(req: Any) -> dict:
    """logit_bias, min_tokens (SGLang's min_new_tokens) and prompt_logprobs where the request
    sets them, or a 400 naming the field; SamplingParams checks their ranges."""
    for name, (refused, why) in UNSUPPORTED_SAMPLING.items():
        if refused(getattr(req, name, None), getattr(req, "n", 1)):
            raise InvalidRequestError(f"{name}: {why}", param=name)
    extras: dict = {}
    bias = getattr(req, "logit_bias", None)
    if bias:
        if not isinstance(bias, dict):
            raise InvalidRequestError("logit_bias must map token ids to biases",
                                      param="logit_bias")
        extras["logit_bias"] = _logit_bias(bias)
    for name in ("min_tokens", "min_new_tokens"):
        value = getattr(req, name, None)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidRequestError(f"{name} must be a non-negative integer", param=name)
        extras["min_tokens"] = value
    num = getattr(req, "prompt_logprobs", None)
    if num is None and getattr(req, "echo", False):  # vLLM's: the echoed prompt's logprobs
        num = getattr(req, "top_logprobs", getattr(req, "logprobs", None))  # chat's, or legacy
    if num is not None:
        extras["prompt_logprobs"] = num
    return extras


def _number(value: Any, kind: type) -> Any:
    try:
        return kind(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError, OverflowError):
        return None


def _logit_bias(bias: dict) -> dict[int, float]:
    """{token id: bias}, or a 400 naming every key that is not a token id, then every value
    that is not a number (vLLM's clients look for the offending key in the message)."""
    bad_keys = [k for k in bias if _number(k, int) is None]
    if bad_keys:
        raise InvalidRequestError(f"logit_bias keys must be token ids (integers); these are "
                                  f"not: {bad_keys[:10]}", param="logit_bias")
    bad_values = [k for k, v in bias.items() if _number(v, float) is None]
    if bad_values:
        raise InvalidRequestError(f"logit_bias values must be numbers; not those of tokens "
                                  f"{bad_values[:10]}", param="logit_bias")
    return {int(k): float(v) for k, v in bias.items()}
