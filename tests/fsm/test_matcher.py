from __future__ import annotations

import string

import pytest
import torch

from guided.fsm.compiler import GrammarCompiler
from guided.fsm.settings import CompileSettings
from guided.params import ConstraintSpec

EOS = 2


@pytest.fixture(scope="module", params=[False, True], ids=["compact", "any_ws"])
def compiler(request, tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=49216,
                        config=CompileSettings(any_whitespace=request.param, max_whitespace=2))
    yield c
    c.shutdown()


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32)) & 1  # (words, 32)
    return set(torch.nonzero(bits.flatten()).flatten().tolist())


def feed(matcher, tokenizer, text: str) -> bool:
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


CASES = [
    (ConstraintSpec.json_schema({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["age", "name"]}),
     '{"name": "Ann", "age": 3}', '{"name": "Ann", "age": "3"}'),  # keys in schema order
    (ConstraintSpec("json_object", ""), '{"k": [1, 2.5, null]}', '{"k": }'),
    (ConstraintSpec("regex", "(héllo|日本)[0-9]{2}"), "日本42", "日本4x"),
    (ConstraintSpec("regex", "[a-z]+@[a-z]+\\.com"), "bob@mail.com", "bob@@mail.com"),
    (ConstraintSpec.choice(["Paris", "London", "日本語"]), "日本語", "Pari"),
    (ConstraintSpec("grammar", 'root ::= "[" num ("," num)* "]"\nnum ::= [0-9]+'), "[1,22]",
     "[1,,2]"),
]


@pytest.mark.parametrize("spec, good, bad", CASES, ids=lambda x: getattr(x, "kind", None))
def test_accepts_valid_rejects_invalid(compiler, tokenizer, spec, good, bad):
    grammar = compiler.compile(spec, timeout=60)
    m = grammar.matcher()
    bitmask = torch.zeros(2, (49216 + 31) // 32, dtype=torch.int32)
    for token in tokenizer.encode(good, add_special_tokens=False):
        m.fill_bitmask(bitmask, 1)
        ok = allowed(bitmask, 1)
        assert token in ok  # the next token of a valid output is allowed
        assert max(ok) < 49152 and not (ok & set(range(3, 17)))  # no padding, no specials
        assert m.accept_token(token)
    m.fill_bitmask(bitmask, 1)
    assert EOS in allowed(bitmask, 1)
    assert m.accept_token(EOS) and m.is_terminated() and m.forced_string() == b""
    assert not m.accept_token(EOS)
    bad_matcher = grammar.matcher()
    assert not (feed(bad_matcher, tokenizer, bad) and bad_matcher.accept_token(EOS))
    assert grammar.matcher().accept_bytes(good.encode())


def test_eos_not_allowed_mid_grammar(compiler, tokenizer):
    m = compiler.compile(ConstraintSpec("regex", "abc"), timeout=60).matcher()
    bitmask = torch.zeros(1, (49216 + 31) // 32, dtype=torch.int32)
    assert feed(m, tokenizer, "ab")
    m.fill_bitmask(bitmask, 0)
    assert EOS not in allowed(bitmask, 0)
    assert not m.accept_token(EOS) and not m.accept_token(99999)


@pytest.mark.parametrize("spec, text", [(c[0], c[1]) for c in CASES], ids=lambda x: getattr(
    x, "kind", None))
def test_rollback_restores_state(compiler, tokenizer, spec, text):
    m = compiler.compile(spec, timeout=60).matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    bitmask = torch.zeros(2, (49216 + 31) // 32, dtype=torch.int32)
    m.fill_bitmask(bitmask, 0)
    for t in ids:
        assert m.accept_token(t)
    assert m.accept_token(EOS)
    m.rollback(len(ids) + 1)
    assert not m.is_terminated()
    m.fill_bitmask(bitmask, 1)
    assert torch.equal(bitmask[0], bitmask[1])
    assert all(m.accept_token(t) for t in ids) and m.accept_token(EOS)


def test_forced_strings_compact(tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=49152, config=CompileSettings(any_whitespace=False))
    try:
        schema = {"type": "object", "properties": {"name": {"type": "string"},
                                                   "role": {"enum": ["admin", "user"]}},
                  "required": ["name", "role"]}
        m = c.compile(ConstraintSpec.json_schema(schema), timeout=60).matcher()
        assert m.forced_string() == b'{"name": "'
        assert m.accept_bytes(b'{"name": "x')
        assert m.accept_bytes(b'"')
        assert m.forced_string() == b', "role": "'
    finally:
        c.shutdown()


def test_choice_options_with_regex_syntax_match_literally(compiler):
    options = [string.punctuation, "a.b", "x(y)?", "日本 語"]
    grammar = compiler.compile(ConstraintSpec.choice(options), timeout=60)
    for option in options:
        m = grammar.matcher()
        assert m.accept_bytes(option.encode()) and m.accept_token(EOS), option
    for near in ("a-b", "x(y)", "xy", string.punctuation[:-1]):
        m = grammar.matcher()
        assert not (m.accept_bytes(near.encode()) and m.accept_token(EOS)), near


def test_forced_strings_choice_and_regex_multibyte(compiler, tokenizer, vocab):
    m = compiler.compile(ConstraintSpec.choice(["Paris", "London", "日本語"]), timeout=60).matcher()
    assert m.forced_string() == b""
    assert feed(m, tokenizer, "Lon")
    assert m.forced_string() == b"don"
    # a token that ends inside a UTF-8 character: nothing is forced mid-character (jump-forward
    # drafts whole characters only), the rest is still accepted
    m = compiler.compile(ConstraintSpec.choice(["日本語", "x"]), timeout=60).matcher()
    partial = [i for i, t in enumerate(vocab.token_bytes) if t == "日".encode()[:2]]
    if partial:
        assert m.accept_token(partial[0]) and m.forced_string() == b""
        assert m.accept_bytes("日本語".encode()[2:]) and m.accept_token(EOS)
    m = compiler.compile(ConstraintSpec("regex", "(héllo|日本)"), timeout=60).matcher()
    assert feed(m, tokenizer, "h") and m.forced_string() == "éllo".encode()


def test_optional_group_with_trailing_repetition(compiler, tokenizer):
    # xgrammar 0.2.8 alone admits "xb" for x(ab+)? ; the compiler rewrites ? as {0,1}
    grammar = compiler.compile(ConstraintSpec("regex", "x(ab+)?"), timeout=60)
    for text, ok in (("x", True), ("xabb", True), ("xb", False), ("xbb", False)):
        m = grammar.matcher()
        assert (m.accept_bytes(text.encode()) and m.accept_token(EOS)) == ok, text
    schema = {"type": "string", "format": "date-time"}
    m = compiler.compile(ConstraintSpec.json_schema(schema), timeout=60).matcher()
    assert not (m.accept_bytes(b'"2022-01-01T12:00:001Z"') and m.accept_token(EOS))


def test_allows_a_token_is_false_only_at_a_dead_end(compiler, tokenizer):
    # SmolLM2's vocabulary has no token for the UTF-8 lead byte F1 (U+40000 starts with it)
    dead = compiler.compile(ConstraintSpec("regex", "a\U00040000")).matcher()
    assert dead.allows_a_token(49216)
    assert feed(dead, tokenizer, "a")
    assert not dead.allows_a_token(49216)
    banned = compiler.compile(ConstraintSpec.json_schema({"type": "string"})).matcher()
    assert banned.ban is not None and banned.allows_a_token(49216)
