"""Prompt work off the event loop: the character check refuses only what cannot fit, and the
template and tokenizer run on their own thread while the loop keeps serving."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from guided.errors import InvalidRequestError
from guided.server.door import PromptWork


@pytest.fixture(scope="module")
def work(tokenizer):
    w = PromptWork(tokenizer, max_model_len=8192)
    yield w
    w.shutdown()


def test_the_character_bound_never_refuses_a_prompt_that_fits(work, tokenizer):
    for text in ("a" * 40_000, "日本語" * 5000, " " * 60_000, "hello world " * 3000):
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        if num_tokens < work.max_model_len:
            work.check_chars(len(text), "prompt")  # fits: must pass


def test_a_prompt_of_ten_megabytes_is_refused_by_its_length_alone(work):
    with pytest.raises(InvalidRequestError, match="maximum context length") as error:
        work.check_chars(10 * 2 ** 20, "messages")
    assert error.value.param == "messages"


def test_tokenizing_runs_on_its_thread_and_the_loop_runs_meanwhile(work, tokenizer):
    text = "hello world, this is some text. " * 20_000

    async def main():
        gaps, done = [], asyncio.Event()

        async def tick():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        names = []
        ids = await work.run(lambda: (names.append(threading.current_thread().name),
                                      tokenizer.encode(text, add_special_tokens=False))[1])
        done.set()
        await ticker
        return ids, names, gaps

    ids, names, gaps = asyncio.run(main())
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert names[0].startswith("guided-tokenize")
    assert len(gaps) > 10  # the loop ticked while the thread tokenized
