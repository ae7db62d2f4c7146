"""Checks at the door: what a request body brings is refused with a 400 naming the field before
it can raise deep inside templating, tokenizing or a step, and what an error message echoes of
the input is cut to a bounded size."""
from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from guided.errors import InvalidRequestError
from guided.server.streaming import ClientGone

MAX_BODY_BYTES = 32 * 1024 * 1024  # far above any prompt that fits a context; a 413 past it
# an error message quotes at most this much (a 1 MB model name used to come back whole)
MAX_ERROR_CHARS = 1000
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
    except ClientDisconnect:  # gone while sending its body: nobody to answer (was a 500)
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
