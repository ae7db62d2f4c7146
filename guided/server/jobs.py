"""One HTTP request as engine requests (`Job`) and its answer in OpenAI's formats. Under
`--reasoning-parser` the output opens with a free `<think> ... </think>` section, returned as
`reasoning_content`; the request's constraint applies after it (a structural tag)."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from guided.errors import ConstraintError, InvalidRequestError, OverloadedError
from guided.fsm.vocab import gpt2_byte_decoder
from guided.outputs import RequestOutput
from guided.params import SamplingParams
from guided.server import protocol as P
from guided.server.tool_output import parse_output, partial_marker_len
from guided.server.tools import ToolPlan

MIN_LOGPROB = -9999.0  # what -inf is sent as (JSON has no infinity; OpenAI's and vLLM's value)
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


def wrap_constraint(kwargs: dict, prompt_text: str) -> dict:
    """The constraint applied after the think section (none: unchanged); a prompt that opens
    the section (templates ending in `<think>`) leaves it out of the output."""
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
        body = body[:len(body) - partial_marker_len(body, THINK_END)]
    return body, ""


class ModelNotFound(Exception):
    pass


@dataclass(slots=True)
class Job:
    """One HTTP request as engine requests: choice i runs prompts[prompt_of[i]] with params[i]."""

    request_id: str
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    prompt_of: list[int]
    plan: ToolPlan | None = None
    num_top: int = 0
    # echo: each prompt's text (completions), the last message's text (chat)
    echo: list[str] = field(default_factory=list)
    constraint_param: str | None = None  # the field the constraint came from (for 400s)
    reasoning: bool = False  # chat on a reasoning parser: <think> ... </think> comes first
    returns: Returns = field(default_factory=lambda: Returns())


@dataclass(frozen=True, slots=True)
class Returns:
    """What a request asks to see beside the text (vLLM's extensions)."""

    token_ids: bool = False  # return_token_ids: prompt_token_ids and each choice's token_ids
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs say "token_id:<id>"
    usage_every_chunk: bool = False  # stream_options.continuous_usage_stats
    cached_tokens: bool = False  # usage.prompt_tokens_details (serve --enable-cache-report)
    usage_at_end: bool = False  # stream_options.include_usage: a last chunk with the usage

    @classmethod
    def of(cls, req, cached_tokens: bool) -> Returns:
        options = req.stream_options
        usage = bool(options and options.include_usage)
        return cls(req.return_token_ids, req.return_tokens_as_token_ids,
                   usage and bool(options.continuous_usage_stats), cached_tokens, usage)


def empty_output(job: Job, i: int) -> RequestOutput:
    """The output of choice i when it has max_tokens 0 (answered without the engine)."""
    return RequestOutput(request_id=f"{job.request_id}-{i}",
                         prompt_token_ids=job.prompts[job.prompt_of[i]], token_ids=[],
                         text="", finished=True, finish_reason="length", logprobs=[])


def visible(out: RequestOutput) -> str:
    """Text safe to send: a trailing U+FFFD is half a UTF-8 character still being decoded."""
    return out.text if out.finished else out.text.rstrip("\ufffd")


def finish_reason(out: RequestOutput, calls: bool, legacy: bool) -> str | None:
    if not out.finished:
        return None
    if calls and out.finish_reason == "stop":
        return "function_call" if legacy else "tool_calls"
    return out.finish_reason


def message_out(plan: ToolPlan | None, out: RequestOutput, *, reasoning: bool = False
                ) -> tuple[P.ChatMessageOut, str | None]:
    """The message of a finished chat choice and its finish_reason. Beside tool calls the
    content is "" (vLLM's clients read it as a string); the legacy `functions` get their call as
    message.function_call; the think section of a reasoning parser is reasoning_content."""
    thought, text = split_reasoning(out.text) if reasoning else (None, out.text)
    content, calls = parse_output(plan, text) if plan else (text, None)
    reason = finish_reason(out, bool(calls), bool(plan and plan.legacy))
    if calls and plan.legacy:
        message = P.ChatMessageOut(content=content or "", function_call=calls[0].function)
    else:
        message = P.ChatMessageOut(content=content, tool_calls=calls)
    if thought is not None:
        message.reasoning_content = message.reasoning = thought.strip("\n") or None
    return message, reason


def raise_if_error(out: RequestOutput) -> None:
    if out.finish_reason != "error":
        return
    if out.error_type == "constraint":
        raise ConstraintError(out.error or "the constraint cannot be compiled")
    if out.error_type == "invalid_request":
        raise InvalidRequestError(out.error or "invalid request")
    if out.error_type == "unavailable":  # a 503 to retry: the engine is being restarted
        raise OverloadedError(out.error or "the engine is being restarted")
    raise RuntimeError(out.error or "internal engine error")


def error_payload(out: RequestOutput) -> dict:
    """The error event of a stream whose request failed after its 200 was sent."""
    internal = out.error_type not in ("constraint", "invalid_request")
    return P.error_body(out.error or "generation failed",
                        type="internal_error" if internal else "invalid_request_error",
                        code=500 if internal else 400)


def model_id(name: str) -> str:
    """The id /v1/models shows: the embedded default model by its own name."""
    if name in ("default", ""):
        try:
            from guided.worker.loader import DEFAULT_GGUF_NAME
        except ImportError:
            return "default"
        return DEFAULT_GGUF_NAME.split(".")[0]
    return name.rstrip("/").rsplit("/", 1)[-1]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class TokenTexts:
    """Token id -> its bytes and text, as OpenAI's logprobs show them (cached per id)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._byte_of = gpt2_byte_decoder()
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            data = b""
        elif token_id in self._special or not all(c in self._byte_of for c in piece):
            data = self._tokenizer.decode([token_id]).encode("utf-8")
        else:
            data = bytes(self._byte_of[c] for c in piece)
        self._cache[token_id] = data
        return data

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def _namer(texts: TokenTexts, as_ids: bool):
    return (lambda t: f"token_id:{t}") if as_ids else texts.text


def chat_logprobs(entries, texts: TokenTexts, num_top: int, as_ids: bool = False
                  ) -> P.ChatLogprobs:
    """`entries`: guided.outputs.TokenLogprob list -> choices[i].logprobs of a chat response;
    as_ids (return_tokens_as_token_ids): tokens named "token_id:<id>", as vLLM names them."""
    name = _namer(texts, as_ids)
    content = []
    for e in entries:
        top = [P.TopLogprob(token=name(t), logprob=lp, bytes=list(texts.bytes(t)))
               for t, lp in e.top[:num_top]]
        content.append(P.ChatTokenLogprob(token=name(e.token_id), logprob=e.logprob,
                                          bytes=list(texts.bytes(e.token_id)),
                                          top_logprobs=top))
    return P.ChatLogprobs(content=content)


def completion_logprobs(entries, texts: TokenTexts, num_top: int, offset: int,
                        as_ids: bool = False, first_id: int | None = None
                        ) -> P.CompletionLogprobs:
    """The legacy format: each position's top_logprobs also holds the sampled token (as
    OpenAI's and vLLM's do: logprobs=0 gives it alone). An echoed prompt's entries come first,
    the first of them None (token first_id, which has no logprob), as vLLM's."""
    name = _namer(texts, as_ids)
    out = P.CompletionLogprobs()
    for e in entries:
        token_id = first_id if e is None else e.token_id
        token = name(token_id)
        out.tokens.append(token)
        out.token_logprobs.append(None if e is None else max(e.logprob, MIN_LOGPROB))
        top = None
        if e is not None:
            top = {name(t): max(lp, MIN_LOGPROB) for t, lp in e.top[:num_top]}
            top.setdefault(token, out.token_logprobs[-1])
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(texts.text(token_id))
    return out


def prompt_logprobs(entries, texts: TokenTexts) -> list[dict[str, P.PromptLogprob] | None] | None:
    """RequestOutput.prompt_logprobs as vLLM's responses carry them: per prompt token None (the
    first) or {token id: logprob, rank, decoded_token}, the prompt token's first, then the top."""
    if entries is None:
        return None
    out: list[dict[str, P.PromptLogprob] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranked = [(e.token_id, e.logprob, e.rank)] + [(t, lp, r) for r, (t, lp)
                                                        in enumerate(e.top, 1)]
        position: dict[str, P.PromptLogprob] = {}
        for t, lp, rank in ranked:
            position.setdefault(str(t), P.PromptLogprob(logprob=max(lp, MIN_LOGPROB), rank=rank,
                                                        decoded_token=texts.text(t)))
        out.append(position)
    return out


def stop_reasons(job: Job, i: int, out: RequestOutput) -> tuple[str | int | None, str | int | None]:
    """(vLLM's stop_reason, SGLang's matched_stop) of a finished choice: the stop string, or the
    stop token (vLLM names only those of stop_token_ids, SGLang EOS too)."""
    if not out.finished or out.finish_reason != "stop" or out.stop_reason is None:
        return None, None
    reason = out.stop_reason
    if isinstance(reason, int) and reason not in (job.params[i].stop_token_ids or ()):
        return None, reason
    return reason, reason


def usage(job: Job, outs: dict[int, RequestOutput]) -> P.UsageInfo:
    """Usage of the choices so far (choice index -> output); each prompt counts once, its
    cached tokens those of its first choice."""
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(o.token_ids) for o in outs.values())
    info = P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                       total_tokens=prompt + completion)
    if job.returns.cached_tokens:
        first: dict[int, int] = {}
        for i, out in sorted(outs.items()):
            first.setdefault(job.prompt_of[i], out.metrics.prefix_cache_hit_tokens)
        info.prompt_tokens_details = P.PromptTokensDetails(cached_tokens=sum(first.values()))
    return info


def chat_response(job: Job, outs: list[RequestOutput], texts: TokenTexts
                  ) -> P.ChatCompletionResponse:
    choices = []
    as_ids, ids = job.returns.tokens_as_ids, job.returns.token_ids
    for i, out in enumerate(outs):
        message, reason = message_out(job.plan, out, reasoning=job.reasoning)
        if job.echo and not message.tool_calls:  # chat echo: the last message's text first
            message.content = job.echo[0] + (message.content or "")
        logprobs = chat_logprobs(out.logprobs or [], texts, job.num_top, as_ids) \
            if job.params[i].logprobs is not None else None
        stop, matched = stop_reasons(job, i, out)
        choices.append(P.ChatChoice(index=i, message=message, logprobs=logprobs,
                                    finish_reason=reason, stop_reason=stop, matched_stop=matched,
                                    token_ids=list(out.token_ids) if ids else None))
    return P.ChatCompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                    usage=usage(job, dict(enumerate(outs))),
                                    prompt_token_ids=job.prompts[0] if ids else None,
                                    prompt_logprobs=prompt_logprobs(outs[0].prompt_logprobs,
                                                                    texts) if outs else None)


def completion_response(job: Job, outs: list[RequestOutput], texts: TokenTexts
                        ) -> P.CompletionResponse:
    choices = []
    as_ids, ids, echo = job.returns.tokens_as_ids, job.returns.token_ids, bool(job.echo)
    for i, out in enumerate(outs):
        prefix = job.echo[job.prompt_of[i]] if echo else ""
        logprobs = None
        if job.params[i].logprobs is not None:
            entries, offset, first = out.logprobs or [], len(prefix), None
            if echo and out.prompt_logprobs:  # the prompt's entries first, offsets from 0
                entries, offset = out.prompt_logprobs + entries, 0
                first = job.prompts[job.prompt_of[i]][0]
            logprobs = completion_logprobs(entries, texts, job.num_top, offset, as_ids, first)
        stop, matched = stop_reasons(job, i, out)
        choices.append(P.CompletionChoice(
            index=i, text=prefix + out.text, logprobs=logprobs, finish_reason=out.finish_reason,
            stop_reason=stop, matched_stop=matched,
            token_ids=list(out.token_ids) if ids else None,
            prompt_token_ids=job.prompts[job.prompt_of[i]] if ids else None,
            prompt_logprobs=prompt_logprobs(out.prompt_logprobs, texts)))
    return P.CompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                usage=usage(job, dict(enumerate(outs))))


def response_body(response: P.ChatCompletionResponse | P.CompletionResponse) -> dict:
    """A whole response as JSON: None left out, but for the choice fields sent as null."""
    body = response.model_dump(exclude_none=True)
    for choice in body["choices"]:
        for name in P.NULL_CHOICE_FIELDS:
            choice.setdefault(name, None)
    return body
