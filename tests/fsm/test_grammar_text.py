"""grammar_text: exact UTF-8 classes (every 1- to 4-byte form offered to the rewritten grammar),
and long counted strings as character budgets (the text rewrite, and mask rows equal to
xgrammar's own counted form's along random walks)."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from jsonschema import Draft202012Validator

from guided.fsm.backends.xgrammar_backend import Recipe, XGrammarMatcher, grammar_of
from guided.fsm.grammar_text import budget_long_repetitions, exact_pattern, exact_utf8
from guided.params import ConstraintSpec

# a vocabulary of the 256 bytes: every byte sequence can be offered to the grammar
_BYTES = xgr.GrammarCompiler(xgr.TokenizerInfo([bytes([b]) for b in range(256)],
                                               xgr.VocabType.RAW, vocab_size=256),
                             cache_enabled=False)
# inside a string: every lead byte with each second byte (and a fixed tail), and the singles
_FORMS = ([bytes([a]) for a in range(0x20, 0x100)]
          + [bytes([a, b]) for a in range(0xC0, 0xE0) for b in range(0x80, 0xC0)]
          + [bytes([a, b, 0x80]) for a in range(0xE0, 0xF0) for b in range(0x80, 0xC0)]
          + [bytes([a, b, 0x80, 0xBF]) for a in range(0xF0, 0xF8) for b in range(0x80, 0xC0)])


def _text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _admitted(recipe: Recipe, head: bytes, tail: bytes) -> list[bytes]:
    grammar = _BYTES.compile_grammar(grammar_of(recipe))
    return [form for form in _FORMS
            if xgr.GrammarMatcher(grammar).accept_string(head + form + tail)]


@pytest.mark.parametrize("pattern", [
    '^[^"\\\\\\x00-\\x1f]{1,}$',  # a string with minLength (schema_formats.length_pattern)
    "^.*$", "^[^a]+$", "^x[^y]$", "^[\\u0100-\\u1000]+$", "^[a-zé]+[^ ]$",
])
def test_pattern_strings_admit_valid_utf8_and_all_of_it(pattern):
    """Every form of one character is admitted exactly when it is UTF-8 the pattern matches
    (xgrammar alone admitted overlong forms and surrogates here)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}},
              "required": ["s"], "additionalProperties": False}
    head = b'{"s": "' + (b"x" if pattern.startswith("^x") else b"")
    admitted = set(_admitted(Recipe("json_schema", json.dumps(schema)), head, b'"}'))
    prefix = "x" if pattern.startswith("^x") else ""
    for form in _FORMS:
        text = _text(form)
        want = (text is not None and '"' not in text and "\\" not in text
                and re.search(pattern, prefix + text) is not None)
        assert (form in admitted) == want, form


@pytest.mark.parametrize("recipe", [
    Recipe("json_schema", json.dumps({"type": "string"})),
    Recipe("regex", "a.+"),
    Recipe("grammar", 'root ::= "a" [^b]+'),
])
def test_other_classes_admit_no_invalid_utf8(recipe):
    head, tail = (b'"', b'"') if recipe.kind == "json_schema" else (b"a", b"z")
    for form in _admitted(recipe, head, tail):
        assert _text(form) is not None, form


def test_rewrites_leave_ascii_and_literals_alone():
    assert exact_pattern("^[a-z0-9_]{2,8}\\.[A-F]$") == "^[a-z0-9_]{2,8}\\.[A-F]$"
    assert exact_pattern("^[^a]$") == ("^([\\x00-\\x60\\x62-\\x7f]|[\x80-\u07ff]|"
                                       "[\u0800-\ud7ff\ue000-\uffff]|[\U00010000-\U0010ffff])$")
    assert exact_utf8('r ::= "[^a]" [a-z]') == 'r ::= "[^a]" [a-z]'
    assert exact_utf8("r ::= [^a]") == "r ::= [^\\uD800-\\uDFFFa]"


@pytest.fixture(scope="module")
def walk_compiler(tokenizer):
    """As the engine compiles, but xgrammar for every schema (llguidance had no such defect)."""
    from guided.fsm.compiler import GrammarCompiler
    from guided.fsm.settings import CompileSettings

    c = GrammarCompiler(tokenizer, vocab_size=49152,
                        config=CompileSettings(llguidance=False))
    yield c
    c.shutdown()


# Github_easy/o12209 and o12220 of JSONSchemaBench, where random walks wrote invalid UTF-8
_SCHEMAS = [
    {"properties": {"group": {"minLength": 1, "type": "string"}, "name": {"type": "string"},
                    "status": {"enum": ["offline", "online"], "type": "string"}},
     "required": ["group"], "type": "object"},
    {"type": "object", "additionalProperties": False, "required": ["name", "url"],
     "properties": {"name": {"type": "string", "minLength": 1},
                    "url": {"type": "string", "minLength": 1}}},
]


@pytest.mark.parametrize("schema", _SCHEMAS)
def test_walks_through_multibyte_tokens_stay_utf8(walk_compiler, schema):
    """Random outputs that favour tokens of partial characters: at every step each such token
    the mask allows keeps the output valid UTF-8, and every output decodes and validates."""
    grammar = walk_compiler.compile(ConstraintSpec.json_schema(schema))
    vocab = walk_compiler.vocab
    eos = vocab.eos_token_ids[0]
    partial = np.array([i for i, data in enumerate(vocab.token_bytes)
                        if data and max(data) >= 0x80 and _text(data) is None])
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    rng = random.Random(0)
    row = torch.zeros((1, (vocab.vocab_size + 31) // 32), dtype=torch.int32)
    for _ in range(6):
        matcher, out = grammar.matcher(), b""
        for step in range(200):
            matcher.fill_bitmask(row, 0)
            bits = np.unpackbits(row[0].numpy().view(np.uint8), bitorder="little")
            allowed = partial[bits[partial] == 1]
            for token in allowed:
                assert _utf8_prefix(out + vocab.token_bytes[token]), (out, token)
            ids = np.flatnonzero(bits[:vocab.vocab_size])
            if eos in ids:
                break
            forced = matcher.forced_string()
            closers = [i for i in ids if vocab.token_bytes[i] in (b'"', b"}")]
            if forced:
                assert matcher.accept_bytes(forced)
                out += forced
                continue
            choices = (closers if step > 30 and closers
                       else allowed if len(allowed) and rng.random() < 0.7 else ids)
            token = int(rng.choice(choices))
            assert matcher.accept_token(token)
            out += vocab.token_bytes[token]
        assert eos in ids, out
        assert not list(validator.iter_errors(json.loads(out.decode("utf-8")))), out


def _utf8_prefix(data: bytes) -> bool:
    import codecs

    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return True


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
