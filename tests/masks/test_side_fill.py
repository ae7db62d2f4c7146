"""Heavy rows: which grammars count long repetitions, and side-thread fills equal inline ones."""
from __future__ import annotations

import sys

import pytest
import torch

from guided.config import EngineConfig
from guided.masks.bitmask_fill import fill_draft_rows
from guided.fsm.compiler import GrammarCompiler
from guided.masks.side_fill import start_side_fill
from guided.params import ConstraintSpec

VOCAB = 49152
WORDS = VOCAB // 32


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=VOCAB, config=EngineConfig())
    yield c
    c.shutdown()


def matcher(compiler, spec: ConstraintSpec):
    return compiler.compile(spec, timeout=120).matcher()


@pytest.mark.parametrize("spec,heavy", [
    (ConstraintSpec.json_schema({"type": "string", "maxLength": 8192}), True),
    (ConstraintSpec.json_schema({"type": "string", "maxLength": 64}), False),  # our pattern
    (ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
     False),
    (ConstraintSpec("regex", "[a-z]{3,200}"), True),
    (ConstraintSpec("regex", "[a-z]{3,20}"), False),
])
def test_long_repetitions_are_heavy(compiler, spec, heavy):
    assert matcher(compiler, spec).heavy is heavy


def test_side_fills_equal_inline_fills(compiler, tokenizer):
    spec = ConstraintSpec.json_schema({"type": "object", "properties": {
        "note": {"type": "string", "maxLength": 500}}, "required": ["note"]})
    m = matcher(compiler, spec)
    assert m.heavy
    for token in tokenizer.encode('{"note": "a long', add_special_tokens=False):
        assert m.accept_token(token)
    drafts = tokenizer.encode(" day at", add_special_tokens=False)
    want = torch.zeros((len(drafts) + 1, WORDS), dtype=torch.int32)
    fill_draft_rows([(m, drafts, 0)], want, num_threads=1)  # bans applied here
    interval = sys.getswitchinterval()
    fill = start_side_fill(m, drafts, 7, WORDS, num_threads=2)
    assert sys.getswitchinterval() <= 0.0005 or fill.done  # side threads get the GIL back
    got = fill.rows()
    assert sys.getswitchinterval() == interval  # restored once they are in
    assert torch.equal(got, want)
    assert fill.serves(7, drafts) and not fill.serves(8, drafts) and not fill.serves(7, [])
    assert m.accept_token(tokenizer.encode(" day", add_special_tokens=False)[0])  # unchanged


def test_a_rejected_draft_fails_its_future(compiler, tokenizer):
    m = matcher(compiler, ConstraintSpec.json_schema({"type": "string", "maxLength": 300}))
    bad = tokenizer.encode("{", add_special_tokens=False)  # a string starts with a quote
    fill = start_side_fill(m, bad, 0, WORDS, num_threads=1)
    with pytest.raises(RuntimeError, match="rejected"):
        fill.rows()
