"""The token-level DFA: memoized rows equal to outlines-core's own,
random walks whose every output validates, rollback, forced strings, and the compiler's choice."""
from __future__ import annotations

import json
import random

import numpy as np
import outlines_core as oc
import pytest
import torch
from jsonschema import Draft202012Validator

from guided.fsm.backends.dfa_backend import DfaMatcher, DfaVocab, TokenDfa, fill_dfa_rows
from guided.fsm.compiler import GrammarCompiler
from guided.fsm.schema_check import check_schema
from guided.fsm.schema_regex import schema_regex
from guided.fsm.settings import CompileSettings
from guided.masks.bitmask_fill import fill_bitmasks
from guided.params import ConstraintSpec

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "[a-z]{1,6}"},
             "minItems": 1, "maxItems": 3},
    "active": {"type": "boolean"},
    "score": {"type": ["number", "null"]}},
    "required": ["name", "role", "tags"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {
    "when": {"type": "string", "format": "date"},
    "kind": {"anyOf": [{"const": "meeting"}, {"type": "integer"}]},
    "note": {"description": "free text", "x-unknown-annotation": 1, "type": "string"}},
    "required": ["when", "kind"]}
SCHEMAS = [PERSON, EVENT, {"type": "array", "items": {"type": "integer"}, "maxItems": 4}]


@pytest.fixture(scope="module")
def dfa_vocab(vocab):
    return DfaVocab(vocab)


def make_dfa(schema: dict, dfa_vocab) -> TokenDfa:
    return TokenDfa(schema_regex(check_schema(schema)), dfa_vocab)


def allowed_ids(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "event", "array"])
def test_random_walks_end_in_valid_instances(schema, vocab, dfa_vocab):
    """Tokens drawn at random from each memoized row until EOS: every output validates, and
    each row equals the one outlines-core writes for the same state."""
    dfa = make_dfa(schema, dfa_vocab)
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    rng = random.Random(0)
    words = dfa_vocab.num_words
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    reference = torch.zeros(words, dtype=torch.int32)
    eos = vocab.eos_token_ids[0]
    quote = vocab.token_bytes.index(b'"')
    for walk in range(12):
        matcher, guide, out = DfaMatcher(dfa, vocab), oc.Guide(dfa.index), b""
        for step in range(400):
            matcher.fill_bitmask(bitmask, 0)
            guide.write_mask_into(reference.data_ptr(), words, 4)
            assert torch.equal(bitmask[0], reference)
            ids = allowed_ids(bitmask[0].numpy())
            assert len(ids) and ids.max() < len(vocab.token_bytes)
            # end as soon as allowed after a while; short tokens keep strings short
            if eos in ids and (len(ids) == 1 or step > 20 or rng.random() < 0.3):
                token = eos
            elif step > 20 and quote in ids and rng.random() < 0.3:
                token = quote  # a free string ends after a while too (random tokens rarely end it)
            else:
                ids = [i for i in ids if i != eos]
                token = min(rng.sample(ids, min(8, len(ids))),
                            key=lambda i: len(vocab.token_bytes[i]))
            assert matcher.accept_token(token)
            if token == eos:
                break
            guide.advance(token, return_tokens=False)
            out += vocab.token_bytes[token]
        assert matcher.is_terminated(), out
        errors = list(validator.iter_errors(json.loads(out)))
        assert not errors, (out, errors[0].message)
    assert 0 < dfa.num_rows


def test_refused_tokens_leave_the_state_and_rollback_restores_it(vocab, dfa_vocab):
    dfa = make_dfa(PERSON, dfa_vocab)
    matcher = DfaMatcher(dfa, vocab)
    start = torch.zeros((1, dfa_vocab.num_words), dtype=torch.int32)
    matcher.fill_bitmask(start, 0)
    assert not matcher.accept_token(vocab.eos_token_ids[0])  # not final yet
    assert not matcher.accept_token(-1) and not matcher.accept_token(10**9)
    assert not matcher.accept_bytes(b"[")
    assert matcher.accept_bytes(b'{"name": "Al')
    text = '", "role": "admin", "tags": ["x"]}'
    ids = [i for i in range(len(vocab.token_bytes)) if vocab.token_bytes[i] == b'"']
    assert matcher.accept_token(ids[0])
    matcher.rollback(1)
    for byte in text.encode():
        assert matcher.accept_bytes(bytes([byte]))
    assert matcher.accept_token(vocab.eos_token_ids[0]) and matcher.is_terminated()
    assert matcher.ended_with(vocab.eos_token_ids[0])
    assert not matcher.accept_token(ids[0])
    matcher.rollback(2)  # the EOS and the closing brace
    assert not matcher.is_terminated()
    again, fresh = torch.zeros_like(start), DfaMatcher(dfa, vocab)
    assert fresh.accept_bytes(b'{"name": "Al' + text.encode()[:-1])
    matcher.fill_bitmask(again, 0)
    fresh.fill_bitmask(start, 0)
    assert torch.equal(again, start)
    assert matcher.accept_bytes(b"}") and matcher.accept_token(vocab.eos_token_ids[0])


def test_forced_strings_follow_the_single_byte_chains(vocab, dfa_vocab):
    dfa = make_dfa(PERSON, dfa_vocab)
    matcher = DfaMatcher(dfa, vocab)
    assert matcher.forced_string() == b'{"name": "'
    assert matcher.accept_bytes(b'{"name": "Bo"')
    assert matcher.forced_string() == b', "role": "'
    assert matcher.accept_bytes(b', "role": "g')
    assert matcher.forced_string() == b'uest", "tags": ["'  # minItems 1: a string
    assert dfa.forced(dfa.index.get_initial_state()) == b'{"name": "'


def test_forced_strings_stop_before_an_incomplete_character(vocab, dfa_vocab):
    dfa = make_dfa({"enum": ["é1", "è2"]}, dfa_vocab)
    # both start with the byte 0xC3: forced, but alone it is no character
    assert DfaMatcher(dfa, vocab).forced_string() == b'"'


def test_batched_fill_copies_rows_and_zeroes_terminated(vocab, dfa_vocab):
    dfa = make_dfa(PERSON, dfa_vocab)
    a, b = DfaMatcher(dfa, vocab), DfaMatcher(dfa, vocab)
    assert b.accept_bytes(b'{"name": "x", "role": "user", "tags": ["a"]}')
    assert b.accept_token(vocab.eos_token_ids[0])
    bitmask = torch.full((3, dfa_vocab.num_words), -1, dtype=torch.int32)
    fill_dfa_rows([(a, 0), (b, 2)], bitmask)
    expected = torch.zeros(dfa_vocab.num_words, dtype=torch.int32)
    a.fill_bitmask(expected.view(1, -1), 0)
    assert torch.equal(bitmask[0], expected)
    assert torch.equal(bitmask[1], torch.full_like(expected, -1))  # not listed: untouched
    assert not bitmask[2].any()
    again = torch.zeros_like(bitmask)
    fill_bitmasks([(a, 1), (b, 0)], again, num_threads=2)
    assert torch.equal(again[1], expected) and not again[0].any()


def test_rows_written_by_many_threads_grow_the_table_safely(vocab, dfa_vocab):
    from concurrent.futures import ThreadPoolExecutor

    dfa = make_dfa(PERSON, dfa_vocab)
    prefixes = [b'{"name": "' + b"x" * n for n in range(13)] + [b'{"name": "a", "role": "']
    matchers = []
    for prefix in prefixes:
        m = DfaMatcher(dfa, vocab)
        assert m.accept_bytes(prefix)
        matchers.append(m)
    with ThreadPoolExecutor(4) as pool:
        slots = list(pool.map(lambda m: m.row_slot(), matchers * 4))
    assert dfa.num_rows == len(set(slots))
    for m in matchers:
        row = torch.zeros((1, dfa_vocab.num_words), dtype=torch.int32)
        m.fill_bitmask(row, 0)
        assert torch.equal(row[0], torch.from_numpy(dfa.pool.rows[m.row_slot()]))


def test_a_dfa_gone_frees_its_rows_for_the_next(vocab, dfa_vocab):
    import gc

    before = dfa_vocab.pool.num_rows
    dfa = make_dfa(PERSON, dfa_vocab)
    matcher = DfaMatcher(dfa, vocab)
    for byte in b'{"name": "abc", "role": "user", "tags": ["x"]}':
        matcher.row_slot()
        assert matcher.accept_bytes(bytes([byte]))
    written = dfa.num_rows
    assert written > 10 and dfa_vocab.pool.num_rows == before + written
    del dfa, matcher
    gc.collect()
    assert dfa_vocab.pool.num_rows == before
    again = DfaMatcher(make_dfa(EVENT, dfa_vocab), vocab)
    row = torch.zeros((1, dfa_vocab.num_words), dtype=torch.int32)
    again.fill_bitmask(row, 0)  # a reused slot holds the new grammar's row
    assert allowed_ids(row[0].numpy()).tolist() == [
        i for i in range(len(vocab.token_bytes)) if vocab.token_bytes[i] in (b"{", b'{"')]


def test_the_compiler_serves_regular_schemas_with_the_dfa(tokenizer):
    on = GrammarCompiler(tokenizer, vocab_size=49152, config=CompileSettings())
    off = GrammarCompiler(tokenizer, vocab_size=49152, config=CompileSettings(dfa_masks=False))
    try:
        assert on.compile(ConstraintSpec.json_schema(PERSON), timeout=60).backend == "dfa"
        grammar = on.compile(ConstraintSpec.json_schema({"type": "number", "maximum": 9}),
                             timeout=60)
        assert grammar.backend == "xgrammar"
        assert isinstance(on.compile(ConstraintSpec.json_schema(PERSON)).matcher(), DfaMatcher)
        assert off.compile(ConstraintSpec.json_schema(PERSON), timeout=60).backend == "xgrammar"
    finally:
        on.shutdown()
        off.shutdown()


def test_past_dfa_max_size_a_schema_is_xgrammars_in_the_same_language(tokenizer):
    """dfa_max_size 0 (a GPU host): no schema waits for or is served by a DFA; xgrammar's
    grammar admits what the DFA admits (one language whichever backend serves it)."""
    big = GrammarCompiler(tokenizer, vocab_size=49152, config=CompileSettings(dfa_max_size=0))
    small = GrammarCompiler(tokenizer, vocab_size=49152, config=CompileSettings())
    try:
        xgrammar = big.compile(ConstraintSpec.json_schema(PERSON), timeout=60)
        dfa = small.compile(ConstraintSpec.json_schema(PERSON), timeout=60)
        assert (xgrammar.backend, dfa.backend) == ("xgrammar", "dfa")
        for text, ok in [(b'{"name": "Ann", "role": "user", "tags": ["ab"]}', True),
                         (b'{"name":"Ann","role":"user","tags":["ab"]}', False), (b"x", False)]:
            assert xgrammar.matcher().accept_bytes(text) is ok
            assert dfa.matcher().accept_bytes(text) is ok
    finally:
        big.shutdown()
        small.shutdown()
