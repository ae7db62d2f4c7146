"""Reasoning models (`guided serve --reasoning-parser think`): the output opens with a
`<think> ... </think>` section, free text, and the request's constraint applies after it; the
section comes back as `reasoning_content`, as vLLM's reasoning parsers return it.

The constraint is wrapped in a structural tag (a sequence: the think tag with any text inside,
then the constraint's own format), so the grammar itself lets the reasoning run free and then
holds the answer to the constraint."""
from __future__ import annotations

import json
from typing import Any

from guided.errors import InvalidRequestError

PARSERS = ("think", "deepseek_r1", "qwen3")  # vLLM's names for the <think> ... </think> format
THINK_START, THINK_END = "<think>", "</think>"


def _inner_format(kwargs: dict) -> dict[str, Any]:
    """SamplingParams constraint kwargs -> an xgrammar structural-tag format."""
    if "json_schema" in kwargs:
        schema = kwargs["json_schema"]
        schema = json.loads(schema) if isinstance(schema, str) else schema
        return {"type": "json_schema", "json_schema": schema}
    if kwargs.get("json_object"):
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if "regex" in kwargs:
        return {"type": "regex", "pattern": kwargs["regex"]}
    if "choice" in kwargs:
        from guided.fsm.backends.xgrammar_backend import choice_regex

        return {"type": "regex", "pattern": choice_regex(kwargs["choice"])}
    if "grammar" in kwargs:
        return {"type": "grammar", "grammar": kwargs["grammar"]}
    tag = kwargs.get("structural_tag")
    tag = json.loads(tag) if isinstance(tag, str) else tag
    if isinstance(tag, dict) and isinstance(tag.get("format"), dict):  # e.g. auto's tool calls
        return tag["format"]
    raise InvalidRequestError("a structural_tag cannot follow the reasoning section of a "
                              "reasoning parser", param="structural_tag")


def thinks(req) -> bool:
    """Whether a chat request reasons: `chat_template_kwargs: {"enable_thinking": false}` (the
    switch of Qwen3's template, which vLLM's and SGLang's parsers honour) turns it off, so the
    constraint applies from the first token."""
    return (req.chat_template_kwargs or {}).get("enable_thinking") is not False


def wrap_constraint(kwargs: dict, prompt_text: str) -> dict:
    """The constraint applied after the think section (no constraint: unchanged). A prompt
    that already opens the section (templates that end in `<think>`) leaves it out of the
    output."""
    if not kwargs:
        return kwargs
    opened = prompt_text.rstrip().endswith(THINK_START)
    think = {"type": "tag", "begin": "" if opened else THINK_START,
             "content": {"type": "any_text"}, "end": THINK_END}
    return {"structural_tag": {"type": "structural_tag", "format": {
        "type": "sequence", "elements": [think, _inner_format(kwargs)]}}}


def split_reasoning(text: str, *, finished: bool = True) -> tuple[str, str]:
    """(reasoning, content) of an output so far. Before the section ends everything is
    reasoning; a tail that may be the start of `</think>` is held back until it is known."""
    body = text.removeprefix(THINK_START) if text.startswith(THINK_START) else text
    end = body.find(THINK_END)
    if end >= 0:
        return body[:end], body[end + len(THINK_END):].lstrip()
    if not finished:
        for k in range(len(THINK_END) - 1, 0, -1):  # hold back a partial end tag
            if body.endswith(THINK_END[:k]):
                body = body[:-k]
                break
    return body, ""
