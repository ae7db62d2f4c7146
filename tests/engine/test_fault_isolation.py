"""A fault that belongs to one request inside a step fails that request only (issue 41): the
rest of the batch runs on, token for token (a matcher that raises in its accept, mid-batch)."""
from __future__ import annotations

import pytest

from guided import LLM, SamplingParams
from guided.fsm.matcher import Matcher
from guided.params import ConstraintSpec


class FaultyMatcher(Matcher):
    """A real matcher that raises on its `fail_at`-th accepted token: a backend bug that hits
    one request in the middle of a running batch."""

    def __init__(self, inner: Matcher, fail_at: int):
        self._inner, self._left = inner, fail_at

    def accept_token(self, token_id: int) -> bool:
        self._left -= 1
        if self._left <= 0:
            raise RuntimeError("injected fault in one request's matcher")
        return self._inner.accept_token(token_id)

    def fill_bitmask(self, bitmask, row: int) -> None:
        self._inner.fill_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def forced_string(self) -> bytes:
        return self._inner.forced_string()

    def accept_bytes(self, data: bytes) -> bool:
        return self._inner.accept_bytes(data)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=96, max_num_seqs=8, jump_forward=False)


def test_a_fault_in_one_request_fails_only_that_request(llm):
    engine = llm.engine
    spec = ConstraintSpec("regex", "[a-z ]{1,40}")
    grammar = engine.compiler.compile(spec, timeout=60)
    real = grammar.matcher
    grammar.matcher = lambda: FaultyMatcher(real(), fail_at=3)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        engine.add_request("a", "Tell me a story.", params)
        engine.add_request("bad", "Tell me a story.", SamplingParams(
            max_tokens=8, temperature=0, regex=spec.value))
        engine.add_request("b", "Name a colour.", params)
        finished = {}
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
    finally:
        grammar.matcher = real
        for request_id in ("a", "b", "bad"):
            engine.abort_request(request_id)
    assert finished["bad"].finish_reason == "error"
    assert finished["a"].finish_reason == finished["b"].finish_reason == "length"
    assert len(finished["a"].token_ids) == len(finished["b"].token_ids) == 8
