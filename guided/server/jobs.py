"""One HTTP request as engine requests (`Job`), and the small pure pieces around it: the one
constraint of a request, outputs of choices that need no engine, error payloads, ids."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from guided.errors import ConstraintError, InvalidRequestError, OverloadedError
from guided.outputs import RequestOutput
from guided.params import SamplingParams
from guided.server import protocol as P
from guided.server.constraint_fields import constraint_kwargs  # noqa: F401 - re-exported
from guided.server.reasoning import split_reasoning
from guided.server.tool_output import parse_output
from guided.server.tools import ToolPlan


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
    echo: list[str] = field(default_factory=list)  # completions: prompt text per prompt
    constraint_param: str | None = None  # the field the constraint came from (for 400s)
    reasoning: bool = False  # chat on a reasoning parser: <think> ... </think> comes first


def empty_output(job: Job, i: int) -> RequestOutput:
    """The output of choice i when it has max_tokens 0 (answered without the engine)."""
    return RequestOutput(request_id=f"{job.request_id}-{i}",
                         prompt_token_ids=job.prompts[job.prompt_of[i]], token_ids=[],
                         text="", finished=True, finish_reason="length", logprobs=[])


def visible(out: RequestOutput) -> str:
    """Text safe to send: a trailing U+FFFD is half a UTF-8 character still being decoded."""
    return out.text if out.finished else out.text.rstrip("\ufffd")


def finish_reason(out: RequestOutput, calls: bool) -> str | None:
    if not out.finished:
        return None
    return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason


def message_out(plan: ToolPlan | None, out: RequestOutput, *, reasoning: bool = False
                ) -> tuple[P.ChatMessageOut, str | None]:
    """The message of a finished chat choice and its finish_reason. Beside tool calls the
    content is "" (vLLM's clients read it as a string); a request with the legacy `functions`
    gets its call as message.function_call; on a reasoning parser the think section is
    reasoning_content."""
    thought, text = split_reasoning(out.text) if reasoning else (None, out.text)
    message, reason = _message(plan, out, text)
    if thought is not None:
        message.reasoning_content = message.reasoning = thought.strip("\n") or None
    return message, reason


def _message(plan: ToolPlan | None, out: RequestOutput, text: str
             ) -> tuple[P.ChatMessageOut, str | None]:
    content, calls = parse_output(plan, text) if plan else (text, None)
    reason = finish_reason(out, bool(calls))
    if calls and plan.legacy:
        return P.ChatMessageOut(content=content or "", function_call=calls[0].function), \
            "function_call" if reason == "tool_calls" else reason
    return P.ChatMessageOut(content=content, tool_calls=calls), reason


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
