"""masks/bitmask_fill.py: every entry's rows equal its matcher's own rows after the drafts
before them, whichever path fills them (xgrammar's batch, its draft traversal, the llguidance
walk, threads or not); matchers are left where they began; a rejected draft raises."""
from __future__ import annotations

import pytest
import torch

from guided.fsm.compiler import GrammarCompiler
from guided.masks.bitmask_fill import fill_draft_rows
from guided.params import ConstraintSpec

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
# a string bound past xgrammar's cheap range: served by llguidance
LONG = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 500}},
        "required": ["text"]}
TEXT = '{"name": "abc", "n": 12}'


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=len(tokenizer))
    yield c
    c.shutdown()


def _own_rows(matcher, drafts: list[int], words: int) -> torch.Tensor:
    rows = torch.zeros(len(drafts) + 1, words, dtype=torch.int32)
    for i, token in enumerate(drafts):
        matcher.fill_bitmask(rows, i)
        assert matcher.accept_token(token)
    matcher.fill_bitmask(rows, len(drafts))
    matcher.rollback(len(drafts))
    return rows


def _entries(compiler, tokenizer, schema: dict, text: str, count: int):
    grammar = compiler.compile(ConstraintSpec.json_schema(schema), timeout=60)
    ids = tokenizer.encode(text, add_special_tokens=False)
    entries, row = [], 0
    for i in range(count):
        matcher = grammar.matcher()
        start = i % (len(ids) - 3)
        assert all(matcher.accept_token(t) for t in ids[:start])
        drafts = ids[start:start + i % 3]  # none, one or two drafts
        entries.append((matcher, drafts, row))
        row += len(drafts) + 1
    return grammar, entries, row


@pytest.mark.parametrize("schema, text", [(SCHEMA, TEXT), (LONG, '{"text": "hello there"}')],
                         ids=["xgrammar", "llguidance"])
def test_rows_equal_each_matchers_own(compiler, tokenizer, schema, text):
    grammar, entries, num_rows = _entries(compiler, tokenizer, schema, text, 24)
    assert grammar.backend == ("xgrammar" if schema is SCHEMA else "llguidance")
    words = -(-len(tokenizer) // 32)
    serial = torch.full((num_rows, words), 7, dtype=torch.int32)
    threaded = torch.full((num_rows, words), 7, dtype=torch.int32)
    fill_draft_rows(entries, serial, num_threads=1)
    fill_draft_rows(entries, threaded, num_threads=4, min_parallel_seconds=0)
    assert torch.equal(serial, threaded)
    for matcher, drafts, first in entries:
        assert torch.equal(serial[first:first + len(drafts) + 1],
                           _own_rows(matcher, drafts, words))


def test_a_rejected_draft_raises_and_leaves_the_matcher(compiler, tokenizer):
    for schema in (SCHEMA, LONG):
        grammar = compiler.compile(ConstraintSpec.json_schema(schema), timeout=60)
        matcher = grammar.matcher()
        bad = tokenizer.encode("]]", add_special_tokens=False)
        rows = torch.zeros(len(bad) + 1, -(-len(tokenizer) // 32), dtype=torch.int32)
        with pytest.raises(RuntimeError, match="rejected by the grammar"):
            fill_draft_rows([(matcher, bad, 0)], rows, num_threads=1)
        assert matcher.accept_token(tokenizer.encode("{", add_special_tokens=False)[0])
