"""The OpenAI-compatible FastAPI app: /v1/chat/completions, /v1/completions, /v1/models, /health,
/metrics. Every request is validated, templated, tokenized and its constraint compiled before
anything reaches the engine, so bad input is a 4xx before any 200 or stream header."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from guided.async_engine import AsyncEngine, RequestStream
from guided.errors import ConstraintError, InvalidRequestError, OverloadedError
from guided.metrics import CONTENT_TYPE, ServerMetrics
from guided.outputs import RequestOutput
from guided.params import SamplingParams
from guided.server import protocol as P
from guided.server.tools import (
    ParsedCall,
    ToolCallStreamer,
    ToolPlan,
    build_messages,
    parse_output,
    plan_tools,
    template_supports_tools,
)

logger = logging.getLogger("guided.server")


class ModelNotFound(Exception):
    pass


class ClientGone(Exception):
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


def error_response(status: int, message: str, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type=type, param=param, code=code),
                        status_code=status)


def _sse(payload: P._Response | dict) -> str:
    data = payload if isinstance(payload, dict) else payload.model_dump(exclude_none=True)
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _visible(out: RequestOutput) -> str:
    """Text safe to send: a trailing U+FFFD is half a UTF-8 character still being decoded."""
    return out.text if out.finished else out.text.rstrip("\ufffd")


def _finish_reason(out: RequestOutput, calls: bool) -> str | None:
    if not out.finished:
        return None
    return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason


class Server:
    def __init__(self, engine: AsyncEngine, *, served_model_name: str | None = None):
        self.engine = engine
        core = engine.engine
        self.model_name = served_model_name or _model_id(core.model_name)
        self.accepted_models = {self.model_name, "default", str(core.config.model),
                                str(core.model_name)}
        self.max_model_len = core.max_model_len
        try:  # a private copy: the engine thread decodes with the original concurrently
            self.tokenizer = copy.deepcopy(core.tokenizer)
        except Exception:  # noqa: BLE001
            self.tokenizer = core.tokenizer
        self.texts = P.TokenTexts(self.tokenizer)
        self.native_tools = template_supports_tools(getattr(self.tokenizer, "chat_template", None))
        self.compile_timeout_s = core.config.compile_timeout_s
        self.metrics = ServerMetrics(engine.stats,
                                     lambda: (engine.compile_queries, engine.compile_hits))
        engine.on_finished = self.metrics.observe_finished

    # ---- building jobs ---------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model not in self.accepted_models:
            raise ModelNotFound(f"The model `{model}` does not exist; this server serves "
                                f"`{self.model_name}` (also reachable as `default`).")

    def chat_job(self, req: P.ChatCompletionRequest) -> Job:
        self.check_model(req.model)
        tool_choice = req.tool_choice if req.tool_choice is not None else (
            "auto" if req.tools else "none")
        plan = plan_tools(req.tools, tool_choice, req.parallel_tool_calls)
        messages = build_messages(req.messages, plan, native_tools=self.native_tools)
        kwargs = {"tools": [{"type": "function", "function": f} for f in plan.functions]} \
            if plan is not None and self.native_tools else {}
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False, **kwargs)
        except Exception as e:  # noqa: BLE001 - jinja errors: the messages do not fit the template
            raise InvalidRequestError(f"messages cannot be rendered by the chat template: {e}",
                                      param="messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        num_top = (req.top_logprobs or 0) if req.logprobs else 0
        logprobs = num_top if req.logprobs else None
        job = Job(_new_id("chatcmpl"), self.model_name, [ids], [], [], plan, num_top)
        self._add_choices(job, req, 0, logprobs, plan.constraint if plan else {}, "messages")
        return job

    def completion_job(self, req: P.CompletionRequest) -> Job:
        self.check_model(req.model)
        if req.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        num_top = req.logprobs or 0
        job = Job(_new_id("cmpl"), self.model_name, [], [], [], None, num_top)
        for k, prompt in enumerate(req.prompts()):
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
                job.echo.append(prompt)
            else:
                ids = list(prompt)
                job.echo.append(self._decode(ids) if req.echo else "")
            job.prompts.append(ids)
            self._add_choices(job, req, k, req.logprobs, {}, "prompt")
        return job

    def _decode(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids)
        except Exception:  # noqa: BLE001 - out-of-vocab ids: the engine rejects them next
            return ""

    def _add_choices(self, job: Job, req, k: int, logprobs: int | None, tool_constraint: dict,
                     prompt_param: str) -> None:
        ids = job.prompts[k]
        if not ids:
            raise InvalidRequestError("the prompt is empty", param=prompt_param)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(ids)} tokens.", param=prompt_param)
        max_tokens = req.max_new_tokens
        room = self.max_model_len - len(ids)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} in the completion).", param="max_tokens")
        job.constraint_param, constraint = _constraint(req, tool_constraint)
        for i in range(req.n):
            job.params.append(SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=req.min_p or 0.0,
                seed=None if req.seed is None else req.seed + i,
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                **constraint))
            job.prompt_of.append(k)

    # ---- running jobs ----------------------------------------------------------------------

    async def start(self, job: Job) -> list[RequestStream]:
        """Compile the constraint (a bad one: ConstraintError, a 400) and add every choice."""
        try:
            spec = job.params[0].constraint
            if spec is not None:
                await asyncio.wait_for(self.engine.compile(spec), self.compile_timeout_s + 5.0)
        except asyncio.TimeoutError:
            raise ConstraintError("compiling the constraint timed out",
                                  param=job.constraint_param) from None
        except ConstraintError as e:
            if e.param is None:
                e.param = job.constraint_param
            raise
        streams: list[RequestStream] = []
        try:
            for i, params in enumerate(job.params):
                if params.max_tokens == 0:
                    continue  # nothing to generate: answered without the engine
                streams.append(await self.engine.add_request(
                    f"{job.request_id}-{i}", job.prompts[job.prompt_of[i]], params))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        logger.debug("%s: %d choice(s), prompt tokens %s", job.request_id, len(job.params),
                     [len(p) for p in job.prompts])
        return streams

    def _empty_output(self, job: Job, i: int) -> RequestOutput:
        return RequestOutput(request_id=f"{job.request_id}-{i}",
                             prompt_token_ids=job.prompts[job.prompt_of[i]], token_ids=[],
                             text="", finished=True, finish_reason="length", logprobs=[])

    async def finals(self, job: Job, streams: list[RequestStream]) -> list[RequestOutput]:
        """The finished output of every choice (choices with max_tokens 0 have no stream)."""
        async def last(stream: RequestStream) -> RequestOutput:
            out = None
            try:
                async for out in stream:
                    pass
            finally:
                stream.abort()
            return out

        results = iter(await asyncio.gather(*(last(s) for s in streams)))
        outs = [self._empty_output(job, i) if p.max_tokens == 0 else next(results)
                for i, p in enumerate(job.params)]
        for out in outs:
            _raise_if_error(out)
        return outs

    async def merged(self, job: Job, streams: list[RequestStream]
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, cumulative output) as they come, over all choices."""
        queue: asyncio.Queue = asyncio.Queue()
        live = [i for i, p in enumerate(job.params) if p.max_tokens != 0]
        for i, p in enumerate(job.params):
            if p.max_tokens == 0:
                queue.put_nowait((i, self._empty_output(job, i)))

        async def pump(i: int, stream: RequestStream) -> None:
            async for out in stream:
                await queue.put((i, out))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in zip(live, streams)]
        try:
            for _ in range(len(job.params)):
                while True:
                    i, out = await queue.get()
                    yield i, out
                    if out.finished:
                        break
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.abort()

    def usage(self, job: Job, outs: list[RequestOutput]) -> P.UsageInfo:
        prompt = sum(len(p) for p in job.prompts)
        completion = sum(len(o.token_ids) for o in outs)
        return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                           total_tokens=prompt + completion)

    # ---- chat ------------------------------------------------------------------------------

    def chat_response(self, job: Job, outs: list[RequestOutput]) -> P.ChatCompletionResponse:
        choices = []
        for i, out in enumerate(outs):
            content, calls = parse_output(job.plan, out.text) if job.plan else (out.text, None)
            message = P.ChatMessageOut(content=content,
                                       tool_calls=_tool_calls_out(calls) if calls else None)
            logprobs = P.chat_logprobs(out.logprobs or [], self.texts, job.num_top) \
                if job.params[i].logprobs is not None else None
            choices.append(P.ChatChoice(index=i, message=message, logprobs=logprobs,
                                        finish_reason=_finish_reason(out, bool(calls))))
        return P.ChatCompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                        usage=self.usage(job, outs))

    async def chat_stream(self, job: Job, streams: list[RequestStream],
                          include_usage: bool) -> AsyncIterator[str]:
        n = len(job.params)
        sent_text, sent_tokens = [0] * n, [0] * n
        streamers = [ToolCallStreamer(job.plan) if job.plan else None for _ in range(n)]
        finals: dict[int, RequestOutput] = {}

        def chunk(i: int, delta: P.ChatDelta, logprobs=None, finish=None) -> str:
            return _sse(P.ChatCompletionChunk(id=job.request_id, model=job.model, choices=[
                P.ChatChunkChoice(index=i, delta=delta, logprobs=logprobs,
                                  finish_reason=finish)]))

        for i in range(n):  # the body runs in merged(), which aborts the requests at its end
            yield chunk(i, P.ChatDelta(role="assistant", content=""))
        async for i, out in self.merged(job, streams):
            if out.finish_reason == "error":
                yield _sse(_error_payload(out))
                return
            text, delta = _visible(out), P.ChatDelta()
            if streamers[i] is not None:
                content, tool_deltas = streamers[i].deltas(text)
                delta.content = content or None
                delta.tool_calls = [P.ToolCallDelta.model_validate(d)
                                    for d in tool_deltas] or None
            else:
                delta.content = text[sent_text[i]:] or None
                sent_text[i] = len(text)
            new_entries = (out.logprobs or [])[sent_tokens[i]:]
            logprobs = None
            if job.params[i].logprobs is not None and new_entries:
                logprobs = P.chat_logprobs(new_entries, self.texts, job.num_top)
                sent_tokens[i] += len(new_entries)
            calls = bool(streamers[i] and streamers[i].calls)
            finish = _finish_reason(out, calls)
            if delta.content or delta.tool_calls or logprobs or finish:
                yield chunk(i, delta, logprobs, finish)
            if out.finished:
                finals[i] = out
        if include_usage:
            yield _sse(P.ChatCompletionChunk(id=job.request_id, model=job.model, choices=[],
                                             usage=self.usage(job, list(finals.values()))))
        yield "data: [DONE]\n\n"

    # ---- completions -----------------------------------------------------------------------

    def completion_response(self, job: Job, outs: list[RequestOutput], echo: bool
                            ) -> P.CompletionResponse:
        choices = []
        for i, out in enumerate(outs):
            prefix = job.echo[job.prompt_of[i]] if echo else ""
            logprobs = P.completion_logprobs(out.logprobs or [], self.texts, job.num_top,
                                             len(prefix)) \
                if job.params[i].logprobs is not None else None
            choices.append(P.CompletionChoice(index=i, text=prefix + out.text, logprobs=logprobs,
                                              finish_reason=out.finish_reason))
        return P.CompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                    usage=self.usage(job, outs))

    async def completion_stream(self, job: Job, streams: list[RequestStream], echo: bool,
                                include_usage: bool) -> AsyncIterator[str]:
        n = len(job.params)
        sent_text, sent_tokens = [0] * n, [0] * n
        offsets = [len(job.echo[job.prompt_of[i]]) if echo else 0 for i in range(n)]
        finals: dict[int, RequestOutput] = {}
        if echo:
            for i in range(n):
                yield _sse(P.CompletionResponse(id=job.request_id, model=job.model, choices=[
                    P.CompletionChoice(index=i, text=job.echo[job.prompt_of[i]])]))
        async for i, out in self.merged(job, streams):
            if out.finish_reason == "error":
                yield _sse(_error_payload(out))
                return
            text = _visible(out)
            new_text = text[sent_text[i]:]
            sent_text[i] = len(text)
            new_entries = (out.logprobs or [])[sent_tokens[i]:]
            logprobs = None
            if job.params[i].logprobs is not None and new_entries:
                logprobs = P.completion_logprobs(new_entries, self.texts, job.num_top,
                                                 offsets[i] + len(text) - len(new_text))
                sent_tokens[i] += len(new_entries)
            if new_text or logprobs or out.finished:
                yield _sse(P.CompletionResponse(id=job.request_id, model=job.model, choices=[
                    P.CompletionChoice(index=i, text=new_text, logprobs=logprobs,
                                       finish_reason=out.finish_reason if out.finished
                                       else None)]))
            if out.finished:
                finals[i] = out
        if include_usage:
            yield _sse(P.CompletionResponse(id=job.request_id, model=job.model, choices=[],
                                            usage=self.usage(job, list(finals.values()))))
        yield "data: [DONE]\n\n"


# ---- helpers ------------------------------------------------------------------------------------

def _model_id(name: str) -> str:
    """The id /v1/models shows: the embedded default model by its own name."""
    if name in ("default", ""):
        try:
            from guided.worker.loader import DEFAULT_GGUF_NAME
        except ImportError:
            return "default"
        return DEFAULT_GGUF_NAME.split(".")[0]
    return name.rstrip("/").rsplit("/", 1)[-1]


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _constraint(req, tool_constraint: dict) -> tuple[str | None, dict]:
    """The one constraint of a request as SamplingParams kwargs; more than one: a 400."""
    found: list[tuple[str, dict]] = []
    if tool_constraint:
        found.append(("tools", tool_constraint))
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                      param="response_format.json_schema.schema")
        found.append(("response_format", {"json_schema": rf.json_schema.schema_}))
    for name in ("json_schema", "regex", "choice", "grammar"):
        if getattr(req, name) is not None:
            found.append((name, {name: getattr(req, name)}))
    if len(found) > 1:
        raise InvalidRequestError(
            f"at most one constraint per request; got {[name for name, _ in found]}",
            param=found[1][0])
    return found[0] if found else (None, {})


def _tool_calls_out(calls: list[ParsedCall]) -> list[P.ToolCallOut]:
    return [P.ToolCallOut(id=c.id, function=P.FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls]


def _raise_if_error(out: RequestOutput) -> None:
    if out.finish_reason != "error":
        return
    if out.error_type == "constraint":
        raise ConstraintError(out.error or "the constraint cannot be compiled")
    if out.error_type == "invalid_request":
        raise InvalidRequestError(out.error or "invalid request")
    raise RuntimeError(out.error or "internal engine error")


def _error_payload(out: RequestOutput) -> dict:
    internal = out.error_type not in ("constraint", "invalid_request")
    return P.error_body(out.error or "generation failed",
                        type="internal_error" if internal else "invalid_request_error",
                        code=500 if internal else 400)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro):
    """Run coro; if the client goes away first, cancel it (its requests are aborted)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone


def _abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


def _sse_response(body: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    # The body aborts its requests when it ends or is closed; this also covers a body that is
    # dropped without ever being started (the client left before the response began).
    weakref.finalize(body, _abort_all, streams)
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# ---- the app ------------------------------------------------------------------------------------

def create_app(engine: AsyncEngine, *, served_model_name: str | None = None,
               drain_timeout: float = 10.0) -> FastAPI:
    server = Server(engine, served_model_name=served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown(drain_timeout)

    app = FastAPI(title="guided", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail),
                              code=exc.status_code)

    async def handle(request: Request, model: type, run) -> Response:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None
            req, unknown = P.parse_request(model, body)
            if unknown:
                logger.debug("ignoring unknown field(s) %s", unknown)
            return await run(request, req)
        except ModelNotFound as e:
            return error_response(404, str(e), param="model", code="model_not_found")
        except InvalidRequestError as e:
            code = "invalid_constraint" if isinstance(e, ConstraintError) else None
            return error_response(400, str(e), param=e.param, code=code)
        except OverloadedError as e:
            return error_response(503, str(e), type="server_error", code="overloaded")
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            logger.exception("internal error while serving %s", request.url.path)
            return error_response(500, f"internal error: {type(e).__name__}: {e}",
                                  type="internal_error", code=500)

    async def run_chat(request: Request, req: P.ChatCompletionRequest) -> Response:
        job = server.chat_job(req)
        if req.stream:
            streams = await server.start(job)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse_response(server.chat_stream(job, streams, include_usage), streams)

        async def run():
            streams = await server.start(job)
            return server.chat_response(job, await server.finals(job, streams))

        response = await _unless_disconnected(request, run())
        return JSONResponse(response.model_dump(exclude_none=True))

    async def run_completion(request: Request, req: P.CompletionRequest) -> Response:
        job = server.completion_job(req)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            streams = await server.start(job)
            return _sse_response(
                server.completion_stream(job, streams, req.echo, include_usage), streams)

        async def run():
            streams = await server.start(job)
            return server.completion_response(job, await server.finals(job, streams), req.echo)

        response = await _unless_disconnected(request, run())
        return JSONResponse(response.model_dump(exclude_none=True))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, P.ChatCompletionRequest, run_chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, P.CompletionRequest, run_completion)

    @app.get("/v1/models")
    async def models() -> Response:
        card = P.ModelCard(id=server.model_name, max_model_len=server.max_model_len)
        return JSONResponse(P.ModelList(data=[card]).model_dump(exclude_none=True))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, "the engine thread is not running", type="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app
