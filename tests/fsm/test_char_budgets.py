"""Long counted strings as character budgets: the text rewrite, and that the budgeted grammar's
mask rows equal xgrammar's own counted form's along random walks (exactness)."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from guided.fsm.backends.xgrammar_backend import XGrammarMatcher
from guided.fsm.char_budgets import budget_long_repetitions
from guided.params import ConstraintSpec

VOCAB = 49152
WORDS = VOCAB // 32
CLASS = 'c ::= (([^\\"\\\\\\r\\n]))'


def test_rewrites_long_counts_of_one_class():
    text = f'root ::= (("\\"" c{{0, 1024}} "\\""))\n{CLASS}\n'
    budgeted = budget_long_repetitions(text)
    assert 'root ::= (("\\"" c_budget_1024 "\\""))' in budgeted
    assert "c_budget_1024[max_chars=1024] ::= c*" in budgeted
    low = budget_long_repetitions(f'root ::= ((c{{2, 500}}))\n{CLASS}\n')
    assert "root ::= ((c{2} c_budget_498))" in low


@pytest.mark.parametrize("text", [
    f'root ::= ((c{{0, 128}}))\n{CLASS}\n',  # unrolled by xgrammar: cheap already
    f'root ::= ((c{{300, 1000}}))\n{CLASS}\n',  # a large minimum has no budget spelling
    f'root ::= ((c{{300, -1}}))\n{CLASS}\n',  # unbounded
    'root ::= ((item{0, 500}))\nitem ::= (("a" "b"))\n',  # not one character class
    f'root ::= (("c{{0, 500}}" c))\n{CLASS}\n',  # inside a literal
])
def test_leaves_other_repetitions(text):
    assert budget_long_repetitions(text) is None


def test_rule_names_with_dashes_and_taken_budget_names(compiler):
    """xgrammar's names may hold '-': the whole name is the repeated rule; a budget's name
    never takes one the grammar already uses (the language stays the same)."""
    ebnf = ('root ::= x-c{0,300}\nx-c ::= [0-9]\nc ::= [a-z]\n'
            'x-c_budget_300 ::= "zzz"\nunused ::= x-c_budget_300\n')
    budgeted = budget_long_repetitions(str(xgr.Grammar.from_ebnf(ebnf)))
    assert "x-c_budget_300_[max_chars=300] ::= x-c*" in budgeted
    grammar = compiler.compile(ConstraintSpec("grammar", ebnf), timeout=120)
    eos = compiler.vocab.eos_token_ids[0]
    for text, ok in [(b"1" * 300, True), (b"1" * 301, False), (b"zzz", False), (b"abc", False)]:
        matcher = grammar.matcher()
        assert (matcher.accept_bytes(text) and matcher.accept_token(eos)) is ok, text


def test_budgeted_text_compiles_as_ebnf():
    text = f'root ::= (("\\"" c{{3, 300}} "\\""))\n{CLASS}\n'
    grammar = xgr.Grammar.from_ebnf(budget_long_repetitions(text))
    assert "[max_chars=297]" in str(grammar)


def allowed_tokens(bitmask: torch.Tensor) -> list[int]:
    bits = bitmask[0].numpy().view("uint32")
    return [32 * w + b for w in bits.nonzero()[0] for b in range(32) if bits[w] >> b & 1]


# an optional property before a bounded string: the shape whose counted rows cost most
SCHEMAS = [
    {"type": "object", "properties": {
        "a": {"type": ["string", "null"], "maxLength": 150},
        "b": {"type": "string", "minLength": 2, "maxLength": 300}},
     "required": ["b"], "additionalProperties": False},
    {"type": "string", "maxLength": 200},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_budgeted_masks_equal_counted_masks(compiler, schema):
    """Random walks (strings run to their bounds: a quote is one token of ~49k) through both
    grammars: every row equal, and the output valid."""
    backend = compiler._xgrammar
    assert not backend.config.any_whitespace  # compact separators, as the budgeted grammar's
    counted = backend.compiler.compile_grammar(xgr.Grammar.from_json_schema(
        json.dumps(schema), strict_mode=True, any_whitespace=False))
    budgeted = compiler.compile(ConstraintSpec.json_schema(schema), timeout=120)
    assert "[max_chars=" in str(budgeted.matcher().compiled.grammar)
    ban = backend.json_ban()
    for seed in range(3):
        rng = random.Random(seed)
        pair = [XGrammarMatcher(counted, compiler.vocab, ban=ban), budgeted.matcher()]
        masks = [torch.zeros((1, WORDS), dtype=torch.int32) for _ in pair]
        text = b""
        for _ in range(400):
            if pair[0].is_terminated():
                break
            for matcher, mask in zip(pair, masks):
                matcher.fill_bitmask(mask, 0)
            assert torch.equal(masks[0], masks[1])
            token = rng.choice(allowed_tokens(masks[0]))
            assert [m.accept_token(token) for m in pair] == [True, True]
            text += compiler.vocab.token_bytes[token]
        assert pair[1].is_terminated()
        jsonschema.validate(json.loads(text.rstrip(b"\0").decode().rstrip()), schema)


def test_regex_bound_is_exact(compiler):
    pattern = r"[a-z]{2,300}@x\.com"
    compiled = compiler.compile(ConstraintSpec("regex", pattern), timeout=120)
    assert "[max_chars=298]" in str(compiled.matcher().compiled.grammar)
    eos = compiler.vocab.eos_token_ids[0]
    for n, ok in [(1, False), (2, True), (300, True), (301, False)]:
        matcher = compiled.matcher()
        accepted = matcher.accept_bytes(b"q" * n + b"@x.com") and matcher.accept_token(eos)
        assert accepted is ok, n
        assert bool(re.fullmatch(pattern, "q" * n + "@x.com")) is ok
