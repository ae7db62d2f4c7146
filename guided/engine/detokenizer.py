"""Incremental detokenization: new text per token without re-decoding the whole output, and
never half a UTF-8 character (a trailing U+FFFD waits for the next token)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from guided.scheduler.request import Request


Decode = Callable[..., str]  # decode(ids, skip_special_tokens=...) -> text


def fast_decode(tokenizer) -> Decode:
    """The Rust tokenizer's decode where it equals the wrapper's (no clean-up of spaces): two
    calls per token on the engine's hot path, ~0.7 µs each instead of ~2.4 µs."""
    rust = getattr(tokenizer, "_tokenizer", None)
    if rust is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return rust.decode


def detokenize_step(decode: Decode, request: Request, skip_special_tokens: bool,
                    end: int | None = None) -> str:
    """Append the text of the request's new output tokens (up to `end`, else all) to
    request.text; returns the delta."""
    ids = request.output_token_ids
    end = len(ids) if end is None else end
    prefix = decode(ids[request.prefix_offset:request.read_offset],
                    skip_special_tokens=skip_special_tokens)
    full = decode(ids[request.prefix_offset:end], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix):]
    request.prefix_offset = request.read_offset
    request.read_offset = end
    request.text += delta
    return delta


def detokenize_rest(decode: Decode, request: Request, skip_special_tokens: bool,
                    end: int | None = None) -> None:
    """The text of all the tokens not decoded yet, at once (a request that only wants its
    final output), as steps of a token each would leave it: half a UTF-8 character at the end
    (a byte-level token holds at least a byte of it, so at most 3 tokens) left out, not the
    text before it. end: decode the output ids before it only (a stop token is never text)."""
    num = len(request.output_token_ids) if end is None else end
    for end in range(num, max(request.read_offset, num - 4), -1):
        if detokenize_step(decode, request, skip_special_tokens, end):
            return


def detokenize_final(decode: Decode, request: Request) -> None:
    """A finished request that wants only its final output: the text of its tokens not
    decoded yet, the stop token that ended it left out (it is never text)."""
    end = len(request.output_token_ids)
    if request.finish_reason == "stop" and isinstance(request.stop_reason, int):
        end -= 1
    detokenize_rest(decode, request, request.params.skip_special_tokens, end)


def find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """Earliest stop string in text that ends after `start` (text before it was checked)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, start - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of text that may be the start of a stop string: not shown yet."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold
