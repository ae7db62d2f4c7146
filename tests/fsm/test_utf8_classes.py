from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
import xgrammar as xgr
from jsonschema import Draft202012Validator

from guided.fsm.backends.xgrammar_backend import Recipe, grammar_of
from guided.fsm.utf8_classes import exact_pattern, exact_utf8
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
