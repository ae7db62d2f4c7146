"""The routes vLLM and SGLang clients call beside the OpenAI API: /tokenize, /detokenize,
/version, /get_model_info, and GET /v1/models/{id} (the served name and its alias `default`)."""
from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from guided.errors import InvalidRequestError
from guided.server import protocol as P
from guided.server.jobs import ModelNotFound

if TYPE_CHECKING:
    from guided.server.app import Server


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[P.Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def version() -> str:
    try:
        return importlib.metadata.version("guided")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def tokenize(server: Server, req: TokenizeRequest) -> dict[str, Any]:
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("send either prompt or messages", param="prompt")
    if req.model is not None:
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
    if req.model is not None:
        server.check_model(req.model)
    size = len(server.tokenizer)
    bad = [t for t in req.tokens if not 0 <= t < size]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{size - 1})",
                                  param="tokens")
    return {"prompt": server.tokenizer.decode(req.tokens)}


def add_native_routes(app: FastAPI, server: Server, handle) -> None:
    """`handle(request, model, run)`: the app's parse-and-map-errors wrapper."""

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
        return JSONResponse({"version": version()})

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
