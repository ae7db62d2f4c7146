"""masks/bitmask_fill.py: every entry's rows equal its matcher's own rows after the drafts
before them, whichever path fills them (xgrammar's batch, its draft traversal, the llguidance
walk, threads or not); matchers are left where they began; a draft the grammar does not allow
is cut: its row forbids it, the rows after it allow everything."""
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


@pytest.mark.parametrize("schema, text, count", [
    (SCHEMA, TEXT, 24), (SCHEMA, TEXT, 70), (LONG, '{"text": "hello there"}', 24)],
    ids=["xgrammar", "xgrammar-threads", "llguidance"])  # 70: a batch large enough for threads
def test_rows_equal_each_matchers_own(compiler, tokenizer, schema, text, count):
    grammar, entries, num_rows = _entries(compiler, tokenizer, schema, text, count)
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


def _allows(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


@pytest.mark.parametrize("schema", [SCHEMA, LONG], ids=["xgrammar", "llguidance"])
def test_a_draft_the_grammar_rejects_is_cut(compiler, tokenizer, schema):
    grammar = compiler.compile(ConstraintSpec.json_schema(schema), timeout=60)
    good, bad = grammar.matcher(), grammar.matcher()
    words = -(-len(tokenizer) // 32)
    start_row = _own_rows(bad, [], words)[0]
    first = next(t for t in range(len(tokenizer)) if _allows(start_row, t))
    wrong = [first, tokenizer.encode("]]", add_special_tokens=False)[0]]
    rows = torch.zeros(1 + len(wrong) + 1, words, dtype=torch.int32)
    cut = fill_draft_rows([(good, [], 0), (bad, wrong, 1)], rows, num_threads=1)
    assert cut == [1]
    assert torch.equal(rows[1], start_row)  # the rows up to the rejected draft: its grammar's
    assert not _allows(rows[2], wrong[1])  # its own row forbids it: verification stops there
    assert bool((rows[3:] == -1).all())  # the rows after it are never kept
    assert torch.equal(rows[0], start_row)
    assert bad.accept_token(first)  # left at its start


def test_nothing_is_allowed_after_a_draft_that_ends_the_grammar(compiler, tokenizer):
    grammar = compiler.compile(ConstraintSpec.json_schema({"type": "integer"}), timeout=60)
    matcher = grammar.matcher()
    digit = tokenizer.encode("7", add_special_tokens=False)[0]
    eos = compiler.vocab.eos_token_ids[0]
    words = -(-len(tokenizer) // 32)
    rows = torch.full((4, words), 7, dtype=torch.int32)
    cut = fill_draft_rows([(matcher, [digit, eos, digit], 0)], rows, num_threads=1)
    assert _allows(rows[0], digit) and _allows(rows[1], eos)
    assert cut == [0] and bool((rows[2] == 0).all())  # the draft after the end is cut
    assert bool((rows[3] == -1).all())
    assert not matcher.is_terminated() and matcher.accept_token(digit)  # left at its start
