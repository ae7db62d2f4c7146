"""The llguidance backend: what it is given, and that its outputs validate (random walks drawn
from its own masks with the default model's tokenizer, judged by jsonschema)."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from jsonschema import Draft202012Validator

from guided.fsm.backends.llguidance_backend import llguidance_schema, prefers_llguidance
from guided.fsm.schema_check import check_schema
from guided.params import ConstraintSpec


@pytest.fixture(scope="module")
def compiler(tokenizer):
    from guided.fsm.compiler import GrammarCompiler
    from guided.fsm.settings import CompileSettings

    c = GrammarCompiler(tokenizer, vocab_size=49152, config=CompileSettings())
    yield c
    c.shutdown()


def test_restated_for_llguidance():
    out = llguidance_schema({"type": "object", "self": {"format": "x"},
                             "properties": {"a": {"type": "string", "pattern": "[a-z]{1,3}"}},
                             "patternProperties": {"^x": {"type": "integer"}},
                             "required": ["a"]})
    assert "self" not in out and out["additionalProperties"] is False
    assert out["properties"]["a"]["pattern"] == "^(?:[a-z]{1,3})$"
    assert list(out["patternProperties"]) == ["^(?:x)$"]
    assert llguidance_schema({"type": "array", "prefixItems": [{}]})["items"] is False
    for ineligible in ({"type": "string", "format": "uri"}, {"$ref": "#"},
                       {"type": "object", "propertyNames": {"pattern": "^a"}},
                       {"type": "array", "uniqueItems": True}):
        assert llguidance_schema(ineligible) is None
    assert prefers_llguidance({"properties": {"a": {"maxLength": 65}}})
    assert not prefers_llguidance({"properties": {"a": {"maxLength": 64}}})


def _walk(grammar, vocab, rng, steps=200) -> str | None:
    matcher = grammar.matcher()
    row = torch.zeros((1, (vocab.vocab_size + 31) // 32), dtype=torch.int32)
    out = b""
    for step in range(steps):
        matcher.fill_bitmask(row, 0)
        ids = np.flatnonzero(np.unpackbits(row[0].numpy().view(np.uint8), bitorder="little"))
        eos = [i for i in ids if i in vocab.eos_token_ids]
        if eos and (len(ids) == 1 or rng.random() < 0.3 or step > steps // 2):
            assert matcher.accept_token(int(eos[0])) and matcher.is_terminated()
            return out.decode("utf-8")
        if step > steps // 2:  # close strings and containers
            closers = [i for i in ids if vocab.token_bytes[i] in (b'"', b"}", b"]", b'"}')]
            ids = closers or ids
        token = int(rng.choice([i for i in ids if i not in vocab.eos_token_ids]))
        assert matcher.accept_token(token)
        out += vocab.token_bytes[token]
    return None


SCHEMAS = [
    {"type": "object", "properties": {"note": {"type": "string", "maxLength": 100},
                                      "code": {"type": "string", "pattern": "^[A-Z]+$",
                                               "minLength": 2, "maxLength": 80},
                                      "n": {"type": "integer", "minimum": -3, "maximum": 70},
                                      "kind": {"enum": ["a", "b", 1]}},
     "required": ["note", "code"]},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 2,
                                               "items": {"type": "string", "maxLength": 70}}},
     "patternProperties": {"^x-": {"type": "boolean"}}},
    {"anyOf": [{"type": "string", "minLength": 66, "maxLength": 68}, {"type": "null"}]},
    {"type": "object", "additionalProperties": {"type": "string", "maxLength": 90}},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_random_outputs_validate(schema, compiler):
    grammar = compiler.compile(ConstraintSpec.json_schema(schema))
    assert grammar.backend == "llguidance"
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    rng = random.Random(0)
    outputs = [t for t in (_walk(grammar, compiler.vocab, rng) for _ in range(15)) if t]
    assert len(outputs) >= 8
    for text in outputs:
        assert validator.is_valid(json.loads(text)), (text, check_schema(schema))


def test_instances_judged_and_the_matcher_interface(compiler):
    grammar = compiler.compile(ConstraintSpec.json_schema(SCHEMAS[0]))
    eos = compiler.vocab.eos_token_ids[0]

    def admits(value) -> bool:
        matcher = grammar.matcher()
        text = json.dumps(value, separators=(", ", ": "))
        return matcher.accept_bytes(text.encode()) and matcher.accept_token(eos)

    assert admits({"note": "hi", "code": "AB"})
    assert admits({"note": "", "code": "XYZ", "n": 70, "kind": 1})
    for bad in ({"note": "hi", "code": "A"}, {"note": "hi", "code": "ab"},
                {"note": "x" * 101, "code": "AB"}, {"note": "hi", "code": "AB", "n": 71},
                {"note": "hi", "code": "AB", "extra": 1}, {"code": "AB"}):
        assert not admits(bad), bad
    matcher = grammar.matcher()
    assert matcher.forced_string() == b'{"note": "'
    assert matcher.accept_bytes(b'{"note": "a", "code": "QQ"}')
    assert not matcher.accept_token(eos + 10**6)  # out of range: refused, state unchanged
    assert matcher.accept_token(eos) and matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated() and matcher.accept_token(eos)


def test_llguidance_reads_our_token_table(compiler):
    """llguidance's tokenizer is built from fsm/vocab's bytes, not from its own reading of the
    tokenizer's JSON (which depends on the installed `tokenizers`: wrong under the GPU image's)."""
    grammar = compiler.compile(ConstraintSpec.json_schema(SCHEMAS[0]))
    assert grammar.backend == "llguidance"
    backend, vocab = compiler._llguidance, compiler.vocab
    ours = [i for i in range(len(vocab.token_bytes)) if i not in vocab.special_ids]
    assert all(backend.tokenizer.decode_bytes([i]) == vocab.token_bytes[i] for i in ours)


def test_every_token_a_mask_allows_is_accepted(compiler):
    """The property that failed on the GPU host: a mask allowed `:` after `{"key":` and the
    matcher then refused it. Along random walks, every allowed token (up to 40 a step) is one
    the matcher accepts."""
    grammar = compiler.compile(ConstraintSpec.json_schema(SCHEMAS[0]))
    rng = random.Random(1)
    row = torch.zeros(1, -(-len(compiler.vocab.token_bytes) // 32), dtype=torch.int32)
    for _ in range(3):
        matcher = grammar.matcher()
        for _ in range(30):
            matcher.fill_bitmask(row, 0)
            words = row[0].numpy().view(np.uint32)
            allowed = [i for i in range(len(compiler.vocab.token_bytes))
                       if (int(words[i >> 5]) >> (i & 31)) & 1]
            if not allowed or matcher.is_terminated():
                break
            for token in rng.sample(allowed, min(40, len(allowed))):
                assert matcher.accept_token(token), (token, compiler.vocab.token_bytes[token])
                matcher.rollback(1)
            assert matcher.accept_token(rng.choice(allowed))


@pytest.mark.slow
def test_the_engine_serves_an_llguidance_schema(compiler):
    """The real default model, offline: a schema with long string bounds (llguidance's) gives
    outputs that validate."""
    from guided import LLM, SamplingParams

    schema = {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 120},
        "code": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 70},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True}},
        "required": ["title", "code", "tags"]}
    assert compiler.compile(ConstraintSpec.json_schema(schema)).backend == "llguidance"
    llm = LLM(device="cpu", dtype="float32")
    prompt = [{"role": "user", "content": "Describe a book as JSON: " + json.dumps(schema)}]
    outs = llm.chat([prompt] * 2, SamplingParams(max_tokens=120, temperature=0.8, seed=1,
                                                  json_schema=schema))
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished
    for out in finished:
        assert validator.is_valid(json.loads(out.text)), out.text
