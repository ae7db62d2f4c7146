"""Pydantic models of the OpenAI wire format (+ guided's extensions) and the OpenAI error body.
Requests ignore unknown fields (like OpenAI), except misspelt constraint fields (a 400)."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from guided.errors import InvalidRequestError
from guided.server.constraint_fields import ConstraintExtensions, check_unknown_fields


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# ---- shared request pieces ----------------------------------------------------------------------

class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag (vLLM / SGLang): structures + triggers, or xgrammar's format
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class _SamplingFields(ConstraintExtensions):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI's and vLLM's; the
    constraint fields of vLLM and SGLang come from ConstraintExtensions)."""

    model: str
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM-style sampling extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the last k tokens
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>"

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v


# ---- chat ---------------------------------------------------------------------------------------

class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    # any role, as vLLM takes it: the chat template renders it (system, developer, user,
    # assistant, tool and function have their OpenAI meanings)
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # legacy: an assistant's call of `functions`
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # legacy function calling: served as tools (guided/server/tools.py plan_request_tools)
    functions: list[FunctionDef] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables of the chat template
    # vLLM's: the template's own switches (chat_template_kwargs may set them too), and echo:
    # the last (assistant) message's text opens the answer
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else \
            self.max_completion_tokens


# ---- completions --------------------------------------------------------------------------------

class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or all(isinstance(x, int) for x in p) else list(p)


# ---- responses ----------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # serve --enable-cache-report


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one entry of a prompt position's {token id: entry}."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    function_call: FunctionCallOut | None = None  # requests with legacy `functions`
    reasoning_content: str | None = None  # a reasoning parser's think section (SGLang's name)
    reasoning: str | None = None  # the same, under vLLM's newer name


# sent even when null in a whole (not streamed) response: SGLang's clients read matched_stop
# and OpenAI's send logprobs and finish_reason
NULL_CHOICE_FIELDS = ("logprobs", "finish_reason", "stop_reason", "matched_stop")


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_ids entry
    matched_stop: str | int | None = None  # SGLang's: the stop string or token (EOS too)
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # return_token_ids
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's (jobs.py)


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    function_call: FunctionCallDelta | None = None  # requests with legacy `functions`
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: the first chunk's


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # echo: None for the first prompt token
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    matched_stop: str | int | None = None
    token_ids: list[int] | None = None  # return_token_ids (in a stream: this chunk's)
    prompt_token_ids: list[int] | None = None  # return_token_ids (in a stream: the first chunk)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's (jobs.py)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "guided"
    max_model_len: int | None = None


# ---- errors -------------------------------------------------------------------------------------

def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(e: ValidationError) -> InvalidRequestError:
    """The first pydantic error as an InvalidRequestError naming the offending field."""
    err = e.errors()[0]
    # pydantic reports union members as loc entries ("str", "list[TextPart]", "function-..."):
    # without them `param` reads like OpenAI's ("messages.0.content")
    loc = [str(p) for p in err.get("loc", ()) if not str(p).startswith("function-")
           and not any(c in str(p) for c in "[]") and str(p) not in ("str", "int", "dict")]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    return InvalidRequestError(f"{param}: {msg}" if param else msg, param=param)


def parse_request(model: type[_Request], body: Any) -> tuple[Any, list[str]]:
    """Validate a JSON body; returns (request, names of ignored unknown top-level fields)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    unknown = sorted(set(body) - known)
    check_unknown_fields(unknown)
    return request, unknown
