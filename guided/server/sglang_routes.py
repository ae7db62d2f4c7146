"""SGLang's native POST /generate, as its users call it: `text` or `input_ids` (one prompt or a
batch), `sampling_params` (SGLang's names, the constraint fields `json_schema`, `regex`, `ebnf`
included) and `stream` (SSE of the cumulative text, then `data: [DONE]`)."""
from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from guided.errors import InvalidRequestError
from guided.outputs import RequestOutput
from guided.server import protocol as P
from guided.server.constraint_fields import ConstraintExtensions
from guided.server.jobs import Job, new_id
from guided.server.streaming import merged, sse_response, unless_disconnected

if TYPE_CHECKING:
    from guided.server.app import Server


class GenerateSamplingParams(ConstraintExtensions):
    """SGLang's sampling_params; read by Server._add_choices like an OpenAI request's fields."""

    max_new_tokens: int | None = Field(default=128, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=16)
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream: bool = False  # set from the request, not from sampling_params

    @property
    def seed(self) -> int | None:
        return self.sampling_seed

    @property
    def response_format(self) -> None:
        return None


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False

    def prompts(self) -> list[str | list[int]]:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("send either text or input_ids", param="text")
        if self.text is not None:
            return [self.text] if isinstance(self.text, str) else list(self.text)
        ids = self.input_ids
        return [list(ids)] if not ids or isinstance(ids[0], int) else [list(p) for p in ids]

    @property
    def batched(self) -> bool:
        return isinstance(self.text, list) or bool(self.input_ids) and \
            isinstance(self.input_ids[0], list)


def sampling_for(req: GenerateRequest, k: int) -> GenerateSamplingParams:
    raw = req.sampling_params
    if isinstance(raw, list):
        if len(raw) <= k:
            raise InvalidRequestError("sampling_params is a list shorter than the batch",
                                      param="sampling_params")
        raw = raw[k]
    raw = dict(raw or {})
    param = "sampling_params"
    try:
        sp, unknown = P.parse_request(GenerateSamplingParams, raw)
    except InvalidRequestError as e:
        e.param = f"{param}.{e.param}" if e.param else param
        raise
    if sp.no_stop_trim:
        raise InvalidRequestError("no_stop_trim is not supported (stop strings are trimmed)",
                                  param=f"{param}.no_stop_trim")
    del unknown  # SGLang-only knobs that do not change the output's language (custom_params...)
    return sp.model_copy(update={"stream": req.stream})


def build_job(server: Server, req: GenerateRequest, k: int, prompt: str | list[int]) -> Job:
    sp = sampling_for(req, k)
    ids = server.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    job = Job(new_id("generate"), server.model_name, [ids], [], [], None, 0)
    try:
        server._add_choices(job, sp, 0, None, {}, "input_ids" if req.input_ids else "text")
    except InvalidRequestError as e:
        if e.param in GenerateSamplingParams.model_fields:
            e.param = f"sampling_params.{e.param}"
        raise
    if job.constraint_param is not None:
        job.constraint_param = f"sampling_params.{job.constraint_param}"
    return job


def meta_info(job: Job, out: RequestOutput) -> dict[str, Any]:
    info: dict[str, Any] = {"id": out.request_id, "prompt_tokens": len(job.prompts[0]),
                            "completion_tokens": len(out.token_ids), "cached_tokens": 0}
    if not out.finished:
        info["finish_reason"] = None
    elif out.finish_reason == "length":
        info["finish_reason"] = {"type": "length", "length": len(out.token_ids)}
    else:
        info["finish_reason"] = {"type": out.finish_reason, "matched": out.stop_reason}
    return info


def result(job: Job, out: RequestOutput, index: int | None = None) -> dict[str, Any]:
    body = {"text": out.text, "output_ids": list(out.token_ids), "meta_info": meta_info(job, out)}
    if index is not None:
        body["index"] = index
    return body


async def _stream(server: Server, job: Job, streams) -> Any:
    multi = len(job.params) > 1
    async for i, out in merged(job, streams):
        if out.finish_reason == "error":
            yield f"data: {json.dumps({'error': {'message': out.error}})}\n\n"
            return
        yield f"data: {json.dumps(result(job, out, i if multi else None))}\n\n"
    yield "data: [DONE]\n\n"


def add_sglang_routes(app: FastAPI, server: Server, handle) -> None:
    async def run_generate(request: Request, req: GenerateRequest) -> Response:
        if req.return_logprob not in (False, [False] * len(req.prompts())):
            raise InvalidRequestError("return_logprob is not supported on /generate; use "
                                      "/v1/completions with logprobs", param="return_logprob")
        jobs = [build_job(server, req, k, p) for k, p in enumerate(req.prompts())]
        if req.stream:
            if len(jobs) > 1:
                raise InvalidRequestError("stream one prompt at a time", param="stream")
            streams = await unless_disconnected(request, server.start(jobs[0]))
            return sse_response(_stream(server, jobs[0], streams), streams)

        async def run_one(job: Job) -> list[dict[str, Any]]:
            outs = await server.finals(job, await server.start(job))
            return [result(job, out) for out in outs]

        results = await unless_disconnected(request, asyncio.gather(*map(run_one, jobs)))
        flat = [r for rs in results for r in rs]
        single = not req.batched and len(flat) == 1
        return JSONResponse(flat[0] if single else flat)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await handle(request, GenerateRequest, run_generate)
