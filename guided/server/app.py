"""The OpenAI-compatible FastAPI app: /v1/chat/completions, /v1/completions, /v1/models, /health,
/metrics. Every request is validated, templated, tokenized and its constraint compiled before
anything reaches the engine, so bad input is a 4xx before any 200 or stream header."""
from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from guided.errors import (
    CompileTimeoutError,
    ConstraintError,
    InvalidRequestError,
    OverloadedError,
)
from guided.fsm.compiler import quick_problem
from guided.outputs import RequestOutput
from guided.params import ConstraintSpec, SamplingParams
from guided.server import door, jobs, streaming
from guided.server import protocol as P
from guided.server.admission import Admission, QueueFullError, capacity_for
from guided.server.constraint_fields import constraint_kwargs, sampling_extras
from guided.server.metrics import ServerMetrics
from guided.server.native_routes import add_native_routes
from guided.server.tool_output import detect_format
from guided.server.tools import (
    ToolPlan,
    build_messages,
    plan_request_tools,
    template_kwargs,
)
from guided.serving.client import EngineClient
from guided.serving.request_stream import RequestStream

logger = logging.getLogger("guided.server")


def error_response(status: int, message: str, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None,
                   retry_after_s: int | None = None) -> JSONResponse:
    body = P.error_body(door.clip(message), type=type, param=param and door.clip(param, 200),
                        code=code)
    return JSONResponse(body, status_code=status,
                        headers={"Retry-After": str(retry_after_s)} if retry_after_s else None)


class Server:
    def __init__(self, engine: EngineClient, *, served_model_name: str | None = None,
                 reasoning_parser: str | None = None, chat_template: str | None = None,
                 cache_report: bool = False):
        self.engine = engine
        self.cache_report = cache_report  # usage.prompt_tokens_details.cached_tokens
        if reasoning_parser is not None and reasoning_parser not in jobs.PARSERS:
            raise ValueError(f"reasoning_parser must be one of {jobs.PARSERS}")
        self.reasoning = reasoning_parser is not None
        core = engine.engine
        self.model_name = served_model_name or jobs.model_id(core.model_name)
        self.accepted_models = {self.model_name, "default", str(core.config.model),
                                str(core.model_name)}
        self.max_model_len = core.max_model_len
        # One HTTP request may not fan out into more engine requests than the waiting queue
        # holds: it could never be admitted whole (a 400, not a 503 to retry).
        self.max_choices = core.config.max_waiting_requests
        self.tokenizer = core.tokenizer  # the server's own: it came over the engine's pipe
        self.texts = jobs.TokenTexts(self.tokenizer)
        self.prompts = door.PromptWork(self.tokenizer, self.max_model_len)  # templates, tokenizes
        # the engine runs max_num_seqs at once: more would only share its steps thinner
        capacity = capacity_for(core.device, core.config.max_num_seqs)
        self.admission = Admission(capacity, max_waiting=min(self.max_choices, 4 * capacity))
        if chat_template is not None:  # guided serve --chat-template
            self.tokenizer.chat_template = chat_template
        template = getattr(self.tokenizer, "chat_template", None)
        self.native_tools = bool(template) and "tools" in template
        self.tool_format = detect_format(template)
        self.compile_timeout_s = core.config.compile_timeout_s
        # imports xgrammar now: imported at the first door check, it held the GIL for seconds
        quick_problem(ConstraintSpec("regex", "a"))
        self.metrics = ServerMetrics(engine, self.admission)
        engine.on_finished = self.metrics.observe_finished

    # ---- building jobs ---------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_models:
            raise jobs.ModelNotFound(f"The model `{model}` does not exist; this server serves "
                                     f"`{self.model_name}` (also reachable as `default`).")

    def chat_prompt(self, req: P.ChatCompletionRequest) -> tuple[list[int], ToolPlan | None]:
        """The chat template applied to the request (tools, chat_template_kwargs): token ids."""
        plan = plan_request_tools(req, self.tool_format)
        messages = build_messages(req.messages, plan, native_tools=self.native_tools)
        kwargs = template_kwargs(req, plan, native_tools=self.native_tools)
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # noqa: BLE001 - jinja errors: the messages do not fit the template
            raise InvalidRequestError(f"messages cannot be rendered by the chat template: {e}",
                                      param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False), plan

    def chat_job(self, req: P.ChatCompletionRequest) -> jobs.Job:
        self.check_model(req.model)
        ids, plan = self.chat_prompt(req)
        num_top = (req.top_logprobs or 0) if req.logprobs else 0
        logprobs = num_top if req.logprobs else None
        # {"enable_thinking": false} (Qwen3's template's switch, honoured by vLLM's and SGLang's
        # parsers) turns reasoning off: the constraint applies at once
        thinks = (req.chat_template_kwargs or {}).get("enable_thinking") is not False
        job = jobs.Job(jobs.new_id("chatcmpl"), self.model_name, [ids], [], [], plan, num_top,
                       reasoning=self.reasoning and thinks)
        self._check_openai_fields(job, req)
        if req.echo and req.messages[-1].role == "assistant":
            job.echo.append(req.messages[-1].text())
        self._add_choices(job, req, 0, logprobs, plan.constraint if plan else {}, "messages")
        self._quick_check(job)
        return job

    def completion_job(self, req: P.CompletionRequest) -> jobs.Job:
        self.check_model(req.model)
        if req.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        prompts = req.prompts()
        if len(prompts) * req.n > self.max_choices:
            raise InvalidRequestError(
                f"{len(prompts)} prompts x n={req.n} is more than the {self.max_choices} "
                "requests this server queues at once (max_waiting_requests)", param="prompt")
        num_top = req.logprobs or 0
        job = jobs.Job(jobs.new_id("cmpl"), self.model_name, [], [], [], None, num_top)
        self._check_openai_fields(job, req)
        for k, prompt in enumerate(prompts):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if req.echo:
                job.echo.append(prompt if isinstance(prompt, str) else self._decode(ids))
            job.prompts.append(ids)
            self._add_choices(job, req, k, req.logprobs, {}, "prompt")
        self._quick_check(job)
        return job

    def _check_openai_fields(self, job: jobs.Job, req) -> None:
        door.check_openai_fields(req, len(self.tokenizer))
        job.returns = jobs.Returns.of(req, self.cache_report)

    @staticmethod
    def _quick_check(job: jobs.Job) -> None:
        """A short regex or grammar that can never end (or matches nothing) is a 400 here, on
        the prompt thread, before the request queues for admission and the engine."""
        spec = job.params[0].constraint if job.params else None
        problem = spec and quick_problem(spec)
        if problem:
            raise ConstraintError(problem, param=job.constraint_param)

    def _decode(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids)
        except Exception:  # noqa: BLE001 - out-of-vocab ids: the engine rejects them next
            return ""

    def _add_choices(self, job: jobs.Job, req, k: int, logprobs: int | None,
                     tool_constraint: dict, prompt_param: str) -> None:
        ids = job.prompts[k] = door.truncated(job.prompts[k], req, self.max_model_len)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param=prompt_param)
        if len(ids) >= self.max_model_len:  # both vLLM's and SGLang's words, which clients match
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(ids)} tokens: the input is longer than the model's context "
                "length.", param=prompt_param)
        max_tokens = req.max_new_tokens
        room = self.max_model_len - len(ids)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} in the completion). Requested token count exceeds the model's "
                "maximum context length.", param="max_tokens")
        if len(job.params) + req.n > self.max_choices:
            raise InvalidRequestError(
                f"n={req.n} is more than the {self.max_choices} requests this server queues at "
                "once (max_waiting_requests)", param="n")
        job.constraint_param, constraint = constraint_kwargs(req, tool_constraint)
        if job.reasoning:  # the constraint holds after the think section
            constraint = jobs.wrap_constraint(constraint, self._decode(ids[-8:]))
        for i in range(req.n):
            job.params.append(SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=req.min_p or 0.0,
                seed=None if req.seed is None else req.seed + i,
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=getattr(req, "include_stop_str_in_output", False),
                logprobs=logprobs,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                output_kind="cumulative" if req.stream else "final",
                **sampling_extras(req), **constraint))
            job.prompt_of.append(k)

    # ---- running jobs ----------------------------------------------------------------------

    async def start(self, job: jobs.Job) -> list[RequestStream]:
        """Compile the constraint (a bad one: ConstraintError, a 400) and add every choice."""
        try:
            spec = job.params[0].constraint
            if spec is not None:
                await asyncio.wait_for(self.engine.compile(spec), self.compile_timeout_s + 5.0)
        except asyncio.TimeoutError:
            raise CompileTimeoutError(
                f"the constraint did not compile within {self.compile_timeout_s + 5.0:g} s "
                "(compile queue and compile); retry later") from None
        except ConstraintError as e:
            if e.param is None:
                e.param = job.constraint_param
            raise
        # All choices at once: the engine loop takes them in one pass over its commands.
        adds = [asyncio.ensure_future(self.engine.add_request(
            f"{job.request_id}-{i}", job.prompts[job.prompt_of[i]], params, compiled=True))
            for i, params in enumerate(job.params) if params.runs_model]
        try:
            results = await asyncio.gather(*adds, return_exceptions=True)
        except BaseException:  # cancelled: the client left; add_request aborts its own
            for add in adds:
                add.cancel()
            raise
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            streaming.abort_all(streams)
            raise errors[0]
        logger.debug("%s: %d choice(s), prompt tokens %s", job.request_id, len(job.params),
                     [len(p) for p in job.prompts])
        return streams

    async def finals(self, job: jobs.Job, streams: list[RequestStream]) -> list[RequestOutput]:
        """The finished output of every choice (choices with max_tokens 0 have no stream)."""
        async def last(stream: RequestStream) -> RequestOutput:
            out = None
            async for out in stream:
                pass
            return out

        try:  # every stream is aborted however gather ends (an error, the client leaving)
            results = iter(await asyncio.gather(*(last(s) for s in streams)))
        finally:
            streaming.abort_all(streams)
        outs = [next(results) if p.runs_model else jobs.empty_output(job, i)
                for i, p in enumerate(job.params)]
        for out in outs:
            jobs.raise_if_error(out)
        return outs


# ---- the app ------------------------------------------------------------------------------------

def create_app(engine: EngineClient, *, served_model_name: str | None = None,
               drain_timeout: float = 10.0, api_key: str | None = None,
               reasoning_parser: str | None = None, chat_template: str | None = None,
               cache_report: bool = False) -> FastAPI:
    server = Server(engine, served_model_name=served_model_name,
                    reasoning_parser=reasoning_parser, chat_template=chat_template,
                    cache_report=cache_report)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown(drain_timeout)
        server.prompts.shutdown()

    app = FastAPI(title="guided", lifespan=lifespan)
    app.state.server = server
    if api_key:
        app.add_middleware(door.ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), code=exc.status_code)

    async def handle(request: Request, model: type | None, run) -> Response:
        try:
            body = await door.read_json(request)
            if model is None:  # /invocations: chat or completion by the body
                chat = isinstance(body, dict) and "messages" in body
                model, run = (P.ChatCompletionRequest, run_chat) if chat else \
                    (P.CompletionRequest, run_completion)
            req, unknown = P.parse_request(model, body)
            if unknown:
                logger.debug("ignoring unknown field(s) %s", unknown)
            return await run(request, req)
        except jobs.ModelNotFound as e:
            return error_response(404, str(e), param="model", code="model_not_found")
        except InvalidRequestError as e:
            code = "invalid_constraint" if isinstance(e, ConstraintError) else None
            return error_response(400, str(e), param=e.param, code=code)
        except door.BodyTooLarge:
            return error_response(
                413, f"Payload Too Large: the request body is larger than {door.MAX_BODY_BYTES} "
                "bytes", code=413)
        except RecursionError:  # a pathologically nested value inside a valid body
            return error_response(400, "the request is nested too deeply")
        except QueueFullError as e:  # what OpenAI and vLLM clients retry as rate limiting
            return error_response(429, str(e), type="rate_limit_error",
                                  code="rate_limit_exceeded", retry_after_s=e.retry_after_s)
        except OverloadedError as e:  # the engine restarting, a compile timeout
            return error_response(503, str(e), type="server_error", code="overloaded",
                                  retry_after_s=e.retry_after_s)
        except streaming.ClientGone:
            return Response(status_code=499)
        except Exception as e:
            logger.exception("internal error while serving %s", request.url.path)
            return error_response(500, f"internal error: {type(e).__name__}: {e}",
                                  type="internal_error", code=500)

    async def run(request: Request, req, job: jobs.Job, stream, respond) -> Response:
        """Admit the job, then a stream (`stream(streams)`) or a body (`respond(outputs)`)."""
        slot = await streaming.unless_disconnected(request, server.admission.enter(len(job.params)))
        with slot.held():
            if req.stream:
                streams = await streaming.unless_disconnected(request, server.start(job))
                return streaming.sse_response(slot.keep(stream(streams)), streams)

            async def finish():
                return respond(await server.finals(job, await server.start(job)))

            response = await streaming.unless_disconnected(request, finish())
        return JSONResponse(jobs.response_body(response))

    async def run_chat(request: Request, req: P.ChatCompletionRequest) -> Response:
        server.prompts.check_chars(door.chat_chars(req), "messages")
        job = await server.prompts.run(server.chat_job, req)
        return await run(request, req, job, lambda s: streaming.chat_stream(server, job, s),
                         lambda outs: jobs.chat_response(job, outs, server.texts))

    async def run_completion(request: Request, req: P.CompletionRequest) -> Response:
        server.prompts.check_chars(door.completion_chars(req), "prompt")
        job = await server.prompts.run(server.completion_job, req)
        return await run(request, req, job, lambda s: streaming.completion_stream(server, job, s),
                         lambda outs: jobs.completion_response(job, outs, server.texts))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, P.ChatCompletionRequest, run_chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, P.CompletionRequest, run_completion)

    @app.post("/invocations")  # vLLM's (SageMaker's) one route: chat or completion by its body
    async def invocations(request: Request) -> Response:
        return await handle(request, None, None)

    add_native_routes(app, server, handle)

    @app.get("/v1/models")
    async def models() -> Response:
        card = P.ModelCard(id=server.model_name, max_model_len=server.max_model_len)
        return JSONResponse({"object": "list", "data": [card.model_dump(exclude_none=True)]})

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, "the engine is not running", type="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
