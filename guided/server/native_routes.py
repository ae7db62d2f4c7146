"""The routes vLLM and SGLang clients call beside the OpenAI API: /tokenize, /detokenize,
/version, /get_model_info, GET /v1/models/{id}, and SGLang's POST /generate (one prompt or a
batch, SGLang's sampling_params and logprobs in meta_info, streamed as SSE)."""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from guided.errors import InvalidRequestError
from guided.outputs import RequestOutput
from guided.server import protocol as P
from guided.server.constraint_fields import ConstraintExtensions
from guided.server.jobs import Job, ModelNotFound, new_id
from guided.server.streaming import abort_all, merged, sse_response, unless_disconnected

if TYPE_CHECKING:
    from guided.server.app import Server


class TokenizeRequest(P._Request):
    """vLLM's /tokenize: a completion prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[P.Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(P._Request):
    model: str | None = None
    tokens: list[int]


def tokenize(server: Server, req: TokenizeRequest) -> dict[str, Any]:
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("send either prompt or messages", param="prompt")
    server.check_model(req.model)
    if req.messages is not None:
        kwargs = {**(req.chat_template_kwargs or {}),
                  "add_generation_prompt": req.add_generation_prompt}
        chat = P.ChatCompletionRequest(model=server.model_name, messages=req.messages,
                                       tools=req.tools, chat_template_kwargs=kwargs)
        ids, _plan = server.chat_prompt(chat)
        if req.add_special_tokens:
            ids = server.tokenizer.build_inputs_with_special_tokens(ids)
    else:
        ids = server.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens
                                      is not False)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": server.max_model_len,
                            "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = server.tokenizer.convert_ids_to_tokens(ids)
    return body


def detokenize(server: Server, req: DetokenizeRequest) -> dict[str, Any]:
    server.check_model(req.model)
    size = len(server.tokenizer)
    bad = [t for t in req.tokens if not 0 <= t < size]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{size - 1})",
                                  param="tokens")
    return {"prompt": server.tokenizer.decode(req.tokens)}


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


class GenerateRequest(P._Request):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    token_ids_logprob: list[int] | list[list[int]] | None = None

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
    try:  # unknown keys: SGLang-only knobs that do not change the output (custom_params...)
        sp, _unknown = P.parse_request(GenerateSamplingParams, dict(raw or {}))
    except InvalidRequestError as e:
        e.param = f"sampling_params.{e.param}" if e.param else "sampling_params"
        raise
    return sp.model_copy(update={"stream": req.stream})


@dataclass(frozen=True, slots=True)
class Returns:
    logprob: bool = False
    num_top: int = 0
    text_in_logprobs: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    input_start: int | None = None  # logprob_start_len: input token logprobs from there on


def _nth(value, k: int):
    return value[k] if isinstance(value, list) else value


def returns_for(req: GenerateRequest, k: int, sp: GenerateSamplingParams) -> Returns:
    """400 for logprobs of chosen ids: the engine does not compute them."""
    logprob = bool(_nth(req.return_logprob, k))
    num_top = _nth(req.top_logprobs_num, k) or 0
    start = _nth(req.logprob_start_len, k)
    if logprob and (not isinstance(start, int) or start < -1):
        raise InvalidRequestError("logprob_start_len must be -1 (output tokens only) or a prompt "
                                  "position", param="logprob_start_len")
    if logprob and req.token_ids_logprob is not None:
        raise InvalidRequestError("token_ids_logprob is not supported; use top_logprobs_num",
                                  param="token_ids_logprob")
    if not 0 <= num_top <= 20:
        raise InvalidRequestError("top_logprobs_num must lie in [0, 20]",
                                  param="top_logprobs_num")
    return Returns(logprob, num_top if logprob else 0, req.return_text_in_logprobs,
                   sp.no_stop_trim, sp.skip_special_tokens,
                   start if logprob and start != -1 else None)


def build_job(server: Server, req: GenerateRequest, k: int, prompt: str | list[int]
              ) -> tuple[Job, Returns]:
    sp = sampling_for(req, k)
    returns = returns_for(req, k, sp)
    if returns.input_start is not None:
        sp = sp.model_copy(update={"prompt_logprobs": returns.num_top})
    ids = server.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    job = Job(new_id("generate"), server.model_name, [ids], [], [], None, returns.num_top)
    logprobs = returns.num_top if returns.logprob else None
    try:
        server._add_choices(job, sp, 0, logprobs, {}, "input_ids" if req.input_ids else "text")
    except InvalidRequestError as e:
        if e.param in GenerateSamplingParams.model_fields:
            e.param = f"sampling_params.{e.param}"
        raise
    if job.constraint_param is not None:
        job.constraint_param = f"sampling_params.{job.constraint_param}"
    return job, returns


def meta_info(job: Job, out: RequestOutput, returns: Returns, server: Server) -> dict[str, Any]:
    info: dict[str, Any] = {"id": out.request_id, "prompt_tokens": len(job.prompts[0]),
                            "completion_tokens": len(out.token_ids),
                            "cached_tokens": out.metrics.prefix_cache_hit_tokens}
    if not out.finished:
        info["finish_reason"] = None
    elif out.finish_reason == "length":
        info["finish_reason"] = {"type": "length", "length": len(out.token_ids)}
    else:
        info["finish_reason"] = {"type": out.finish_reason, "matched": out.stop_reason}
    if returns.logprob:
        def entry(token_id: int, logprob: float | None) -> list:
            return [logprob, token_id,
                    server.texts.text(token_id) if returns.text_in_logprobs else None]

        entries, start = out.logprobs or [], returns.input_start
        # logprob_start_len -1: output tokens only; else the prompt's from there (None first)
        inputs = list(zip(job.prompts[0], out.prompt_logprobs or []))[start:] \
            if start is not None else []
        info["input_token_logprobs"] = [entry(t, e and e.logprob) for t, e in inputs]
        info["output_token_logprobs"] = [entry(e.token_id, e.logprob) for e in entries]
        if returns.num_top:
            info["input_top_logprobs"] = [e and [entry(t, lp) for t, lp in e.top[:returns.num_top]]
                                          for _, e in inputs]
            info["output_top_logprobs"] = [[entry(t, lp) for t, lp in e.top[:returns.num_top]]
                                           for e in entries]
    return info


def result(server: Server, job: Job, out: RequestOutput, returns: Returns,
           index: int | None = None) -> dict[str, Any]:
    text = out.text
    if returns.no_stop_trim and out.finished and out.finish_reason == "stop":
        # the stop string (or a stop token that is text) stays in, as SGLang returns it
        text = server.tokenizer.decode(out.token_ids,
                                       skip_special_tokens=returns.skip_special_tokens)
    body = {"text": text, "output_ids": list(out.token_ids),
            "meta_info": meta_info(job, out, returns, server)}
    if index is not None:
        body["index"] = index
    return body


async def _stream(server: Server, parts: list[tuple[Job, Returns, list]]) -> Any:
    """Cumulative results as SSE over every prompt of a batch and every choice of each, with
    its index (SGLang's: prompt-major) where there is more than one."""
    multi = len(parts) > 1 or len(parts[0][0].params) > 1
    queue: asyncio.Queue = asyncio.Queue()
    offsets = [sum(len(j.params) for j, _, _ in parts[:k]) for k in range(len(parts))]

    async def pump(k: int) -> None:
        job, returns, streams = parts[k]
        async for i, out in merged(job, streams):
            await queue.put((job, returns, offsets[k] + i, out))

    tasks = [asyncio.create_task(pump(k)) for k in range(len(parts))]
    left = sum(len(job.params) for job, _, _ in parts)
    try:
        while left:
            job, returns, index, out = await queue.get()
            if out.finish_reason == "error":
                yield f"data: {json.dumps({'error': {'message': out.error}})}\n\n"
                return
            left -= out.finished
            body = result(server, job, out, returns, index if multi else None)
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()


def add_native_routes(app: FastAPI, server: Server, handle) -> None:
    async def run_tokenize(request: Request, req: TokenizeRequest) -> Response:
        return JSONResponse(tokenize(server, req))

    async def run_detokenize(request: Request, req: DetokenizeRequest) -> Response:
        return JSONResponse(detokenize(server, req))

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await handle(request, TokenizeRequest, run_tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await handle(request, DetokenizeRequest, run_detokenize)

    @app.get("/version")
    async def version_route() -> Response:
        try:
            return JSONResponse({"version": importlib.metadata.version("guided")})
        except importlib.metadata.PackageNotFoundError:
            return JSONResponse({"version": "unknown"})

    @app.get("/get_model_info")
    async def model_info() -> Response:  # SGLang's
        return JSONResponse({"model_path": server.model_name, "tokenizer_path": server.model_name,
                             "is_generation": True, "max_model_len": server.max_model_len})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Response:
        try:
            server.check_model(model)
        except ModelNotFound as e:
            return JSONResponse(P.error_body(str(e), param="model", code="model_not_found"),
                                status_code=404)
        card = P.ModelCard(id=server.model_name, max_model_len=server.max_model_len)
        return JSONResponse(card.model_dump(exclude_none=True))

    async def run_generate(request: Request, req: GenerateRequest) -> Response:
        jobs = [build_job(server, req, k, p) for k, p in enumerate(req.prompts())]
        if req.stream:
            async def start_all() -> list[tuple[Job, Returns, list]]:
                parts: list[tuple[Job, Returns, list]] = []
                try:
                    for job, returns in jobs:
                        parts.append((job, returns, await server.start(job)))
                except BaseException:  # one bad prompt: the ones started are aborted
                    abort_all([s for _, _, streams in parts for s in streams])
                    raise
                return parts

            parts = await unless_disconnected(request, start_all())
            return sse_response(_stream(server, parts), [s for p in parts for s in p[2]])

        async def run_one(job: Job, returns: Returns) -> list[dict[str, Any]]:
            outs = await server.finals(job, await server.start(job))
            return [result(server, job, out, returns) for out in outs]

        results = await unless_disconnected(
            request, asyncio.gather(*(run_one(*j) for j in jobs)))
        flat = [r for rs in results for r in rs]
        single = not req.batched and len(flat) == 1
        return JSONResponse(flat[0] if single else flat)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await handle(request, GenerateRequest, run_generate)
