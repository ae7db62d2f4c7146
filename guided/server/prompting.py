"""Prompt work off the event loop: the chat template and the tokenizer run on one thread of
their own (a 10 MB prompt tokenized on the event loop held /health for 48 s and paused every
stream), after a check that costs nothing: a prompt whose character count alone shows it
cannot fit the context is refused before it is templated or tokenized."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from guided.errors import InvalidRequestError

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
        """fn(*args) on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


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
