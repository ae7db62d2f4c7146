"""Masks filled ahead of their step: the same rows as filling in the step, and never reused
for drafts or matchers they were not filled for."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from guided.config import EngineConfig
from guided.masks.bitmask_fill import fill_draft_rows
from guided.masks.prefetch import MaskPrefetch
from guided.fsm.compiler import GrammarCompiler
from guided.params import ConstraintSpec

WORDS = (49216 + 31) // 32
SCHEMA = ConstraintSpec.json_schema({"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "bc"]}}},
    "required": ["name", "tags"], "additionalProperties": False})


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=49216, config=EngineConfig(dfa_masks=False))
    yield c
    c.shutdown()


def test_prefetched_rows_equal_rows_filled_in_the_step(compiler, tokenizer):
    grammar = compiler.compile(SCHEMA, timeout=60)
    prefix = tokenizer.encode('{"name": "x", "tags": [', add_special_tokens=False)
    requests = []
    for i, drafts_text in enumerate(['', '"a"', '"bc", "a"']):
        matcher = grammar.matcher()
        for t in prefix:
            assert matcher.accept_token(t)
        drafts = tokenizer.encode(drafts_text, add_special_tokens=False)
        requests.append(SimpleNamespace(request_id=f"r{i}", matcher=matcher,
                                        draft_token_ids=drafts))
    pool = ThreadPoolExecutor(1)
    try:
        prefetch = MaskPrefetch(pool.submit, WORDS, num_threads=2)
        prefetch.start(requests)
        firsts = pool.submit(lambda: [prefetch.take(r.request_id, r.matcher, r.draft_token_ids)
                                      for r in requests]).result()
        direct = torch.zeros(sum(len(r.draft_token_ids) + 1 for r in requests), WORDS,
                             dtype=torch.int32)
        entries, row = [], 0
        for r in requests:
            entries.append((r.matcher, r.draft_token_ids, row))
            row += len(r.draft_token_ids) + 1
        fill_draft_rows(entries, direct, num_threads=1)
        for (_, drafts, row), first in zip(entries, firsts):
            n = len(drafts) + 1
            assert torch.equal(prefetch.buffer[first:first + n], direct[row:row + n])
        # a prefix of the drafts (the scheduler cut them) is served; other drafts are not
        r = requests[2]
        assert pool.submit(prefetch.take, r.request_id, r.matcher,
                           r.draft_token_ids[:1]).result() == firsts[2]
        assert pool.submit(prefetch.take, r.request_id, r.matcher, [7]).result() is None
        assert pool.submit(prefetch.take, r.request_id, grammar.matcher(),
                           r.draft_token_ids).result() is None
        assert pool.submit(prefetch.take, "unknown", r.matcher, []).result() is None
        prefetch.clear()
        assert pool.submit(prefetch.take, r.request_id, r.matcher, []).result() is None
        # the matchers hold only their committed tokens afterwards
        for r in requests:
            assert r.matcher.accept_token(tokenizer.encode('"a"', add_special_tokens=False)[0])
    finally:
        pool.shutdown()


def test_a_rejected_draft_leaves_every_matcher_at_its_committed_tokens(compiler, tokenizer):
    """Drafts are accepted a depth at a time for all matchers at once; when one is rejected,
    the matchers that accepted theirs at that depth (before or after it) are walked back too."""
    grammar = compiler.compile(SCHEMA, timeout=60)
    prefix = tokenizer.encode('{"name": "x", "tags": [', add_special_tokens=False)
    a = tokenizer.encode('"a"', add_special_tokens=False)
    brace = tokenizer.encode("}", add_special_tokens=False)
    matchers = []
    for _ in range(3):
        m = grammar.matcher()
        assert all(m.accept_token(t) for t in prefix)
        matchers.append(m)
    entries = [(matchers[0], a, 0), (matchers[1], brace, 1 + len(a)),  # '}' is rejected here
               (matchers[2], a + a, 3 + len(a))]
    bitmask = torch.zeros(4 + 3 * len(a), WORDS, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="rejected"):
        fill_draft_rows(entries, bitmask, num_threads=1)
    for m in matchers:  # each accepts what follows its committed tokens, once
        assert all(m.accept_token(t) for t in a)
        m.rollback(len(a))


def test_draft_rows_split_over_threads_equal_one_thread(compiler, tokenizer, monkeypatch):
    """A costly batch of drafts is walked on several threads (traverse_draft_tree releases
    the GIL): the same rows, the matchers back at their committed tokens."""
    from guided.masks import bitmask_fill

    grammar = compiler.compile(SCHEMA, timeout=60)
    prefix = tokenizer.encode('{"name": "x", "tags": [', add_special_tokens=False)
    texts = ['"a"', '"bc", "a"', '"a", "a"', '"bc"', '', '"a", "bc", "bc"']
    entries, row = [], 0
    for text in texts:
        matcher = grammar.matcher()
        assert all(matcher.accept_token(t) for t in prefix)
        drafts = tokenizer.encode(text, add_special_tokens=False)
        entries.append((matcher, drafts, row))
        row += len(drafts) + 1
    serial = torch.zeros(row, WORDS, dtype=torch.int32)
    fill_draft_rows(entries, serial, num_threads=1)
    monkeypatch.setattr(bitmask_fill, "_row_seconds", 1.0)  # every batch "costly"
    calls = []
    monkeypatch.setattr(bitmask_fill, "_get_pool", lambda n: calls.append(n) or
                        ThreadPoolExecutor(n))
    threaded = torch.zeros(row, WORDS, dtype=torch.int32)
    fill_draft_rows(entries, threaded, num_threads=2)
    assert calls and torch.equal(serial, threaded)
    a = tokenizer.encode('"a"', add_special_tokens=False)
    for matcher, _, _ in entries:
        assert all(matcher.accept_token(t) for t in a)
