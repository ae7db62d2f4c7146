"""Checks at the door: a request body's bad input is a 400 naming the field before it can raise
deep inside templating or a step; error messages echo the input cut to a bounded size; the
--api-key check; a deadline for a connection's request headers; prompt work on its thread."""
from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from guided.errors import InvalidRequestError
from guided.server.streaming import ClientGone

MAX_BODY_BYTES = 32 * 1024 * 1024  # far above any prompt that fits a context; a 413 past it
MAX_ERROR_CHARS = 1000  # an error message quotes at most this much of the input
# a lone surrogate can only arrive as a JSON escape (\ud800): raw bytes of one are not UTF-8
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def clip(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """The message, cut in the middle past `limit` characters (both ends say what it is)."""
    if len(message) <= limit:
        return message
    half = limit // 2
    return f"{message[:half]}... [{len(message) - 2 * half} characters cut] ...{message[-half:]}"


def check_unicode(raw: bytes, value: Any) -> None:
    """Raise InvalidRequestError naming the field where a string of the parsed body `value`
    holds a lone UTF-16 surrogate ("\\ud800" without its pair): no tokenizer or template can
    encode it. `raw` is the body it was parsed from (only bodies with such escapes are walked)."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise InvalidRequestError(
                    f"{path or 'the body'} holds a lone UTF-16 surrogate (an unpaired \\ud800-"
                    "\\udfff escape): text must be valid Unicode", param=path or None)
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    raise InvalidRequestError(f"a key of {path or 'the body'} holds a lone "
                                              "UTF-16 surrogate", param=path or None)
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))


class BodyTooLarge(Exception):
    pass


async def read_json(request: Request):
    """The body as JSON; InvalidRequestError for anything that is not (BodyTooLarge past
    MAX_BODY_BYTES)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise BodyTooLarge
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise BodyTooLarge
            chunks.append(chunk)
    except ClientDisconnect:  # gone while sending its body: nobody to answer
        raise ClientGone from None
    raw = b"".join(chunks)
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequestError("the request body is nested too deeply") from None
    check_unicode(raw, value)
    return value


OPEN_PATHS = frozenset({"/health"})  # load balancers and supervisors probe it without a key


class ApiKeyMiddleware:
    """--api-key: `Authorization: Bearer <key>` or a 401 with OpenAI's error body. A pure ASGI
    middleware (no per-request task or body copy, so streams are untouched)."""

    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {
            "message": "a valid API key is required: send `Authorization: Bearer <key>`",
            "type": "authentication_error", "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # the key compared in constant time: its length and bytes leak nothing
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(),
                                                                           self._key)
        return False


# uvicorn's keep-alive timer is cancelled by any byte received: a client trickling its headers a
# byte at a time (slowloris) held a connection, and its memory, forever
HEADER_TIMEOUT_S = 10.0


class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol (httptools' or h11's) with a header-read deadline."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and self._in_request():
            self._header_timer.cancel()  # the request's headers are in
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self._in_request():
            self._arm_header_timer()  # the next request's headers have a deadline too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        """Headers of a request were read and its response is not complete yet."""
        cycle = getattr(self, "cycle", None)
        return cycle is not None and not cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self._in_request() and not self.transport.is_closing():
            self.transport.close()


# Prompt work runs on a thread of its own (a huge prompt tokenized on the event loop stalled
# /health and every stream), after a free check: one too many characters to fit is refused first.
T = TypeVar("T")
# a token covers at most max_token_chars characters of text; halved again for normalizers that
# might shorten text before it is split (a bound that must never refuse a prompt that fits)
_SAFETY = 2


class PromptWork:
    """One tokenizer, one thread: the transformers tokenizer wraps a Rust tokenizer that is
    not meant to be entered from several threads at once, and one thread is enough (its
    encode releases the GIL: the event loop runs on meanwhile)."""

    def __init__(self, tokenizer, max_model_len: int):
        self.max_model_len = max_model_len
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.max_token_chars = max((len(token) for token in vocab), default=1) or 1
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="guided-tokenize")

    def check_chars(self, num_chars: int, param: str) -> None:
        """InvalidRequestError where num_chars of text must be more tokens than the context
        holds (a lower bound: at most max_token_chars characters per token)."""
        at_least = num_chars // (_SAFETY * self.max_token_chars)
        if at_least >= self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"{param} has {num_chars} characters, at least {at_least} tokens.", param=param)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def check_openai_fields(req, vocab_size: int) -> None:
    """The /v1 routes' checks beyond the fields' own, as OpenAI and vLLM make them."""
    if getattr(req, "top_logprobs", None) and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs true", param="top_logprobs")
    if req.stream and req.prompt_logprobs is not None:  # vLLM's rule (echo's are streamed)
        raise InvalidRequestError("prompt_logprobs are not available when stream is true",
                                  param="prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true",
                                  param="stream_options")
    bad = [t for t in req.stop_token_ids or () if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary "
                                  f"(vocabulary size {vocab_size})", param="stop_token_ids")


def truncated(ids: list[int], req, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as the context
    holds with room for one output token)."""
    keep = getattr(req, "truncate_prompt_tokens", None)
    if keep is None:
        return ids
    if keep == 0:
        raise InvalidRequestError("truncate_prompt_tokens must be -1 or at least 1",
                                  param="truncate_prompt_tokens")
    return ids[-(max_model_len - 1 if keep == -1 else keep):]


def chat_chars(req) -> int:
    """Characters of a chat request's text: its messages and the tool definitions that the
    template may render into the prompt."""
    total = sum(len(m.text()) for m in req.messages)
    for tool in req.tools or ():
        total += len(tool.function.description or "")
    return total


def completion_chars(req) -> int:
    """Characters of a completion request's longest text prompt (each must fit on its own)."""
    return max((len(p) for p in req.prompts() if isinstance(p, str)), default=0)
