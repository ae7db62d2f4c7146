"""The JSON string ban (guided/masks/string_ban.py): which token bytes break a JSON string, and
the property lazy rows rely on: at every position inside a JSON string at a character boundary
(as the request's tracker sees it), no token the grammar allows is banned. Checked on random
walks through real xgrammar matchers, on schemas of our own and, where ../shared/data is
present, on a sample of JSONSchemaBench."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from guided.config import EngineConfig
from guided.fsm.compiler import GrammarCompiler
from guided.masks.lazy import INSIDE, OUTSIDE, lazy_row_ban, note_json_token
from guided.masks.string_ban import breaks_json_string, json_string_banned, utf8_pending
from guided.params import SamplingParams
from guided.scheduler.request import Request

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / ".." / "shared" / "data"

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "tags": {
        "type": "array", "items": {"type": "string"}}}, "required": ["name", "tags"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"},
                                      "note": {"type": "string", "maxLength": 12}},
     "required": ["code", "note"]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                      "mail": {"type": "string", "format": "email"},
                                      "kind": {"enum": ["a\"b", "c\\d", "é"]}},
     "required": ["when", "mail", "kind"]},
    {"type": "object", "additionalProperties": {"type": "string", "minLength": 2}},
    {"type": "array", "items": {"type": "object", "properties": {
        "k": {"type": "string"}, "v": {"type": ["string", "number", "null"]}}}},
    {"type": "string"},
]


@pytest.mark.parametrize("data, broken", [
    (b"hello", False), (b" world", False), (b'"', False), (b'",', False), (b'": ', False),
    (b'"}', False), (b'"]}', False), (b'"\n', False), (b'" ,', False), (b"\\n", False),
    (b"\\u00e9x", False), (b"\\u00", False), (b"\\", False), (b"\xc3\xa9", False),
    (b"\xe2\x82", False),  # a character cut at the token's end: the next token ends it
    (b"", True), (None, True), (b"\n", True), (b"a\tb", True), (b'")', True), (b'"x', True),
    (b"\\q", True), (b"\\u0g", True), (b"\xa9", True), (b"\xc3(", True), (b"\xff", True),
    (b'"a', True),
])
def test_which_bytes_break_a_json_string(data, broken):
    assert breaks_json_string(data) is broken


def test_raw_controls_are_characters_where_json_lets_whitespace_through():
    assert breaks_json_string(b"a\nb") and not breaks_json_string(b"a\nb", b"\t\n\r")
    assert breaks_json_string(b"a\x01", b"\t\n\r")


def test_utf8_pending_counts_the_bytes_a_character_still_owes():
    assert utf8_pending(0, b"abc") == 0
    assert utf8_pending(0, b"\xe2") == 2 and utf8_pending(2, b"\x82") == 1
    assert utf8_pending(1, b"\xac ok") == 0
    assert utf8_pending(0, b"x\xf0\x9f") == 2


def test_only_a_single_row_at_a_character_boundary_inside_a_string_gets_the_string_ban():
    class Matcher:
        ban, string_ban = "json", "string"

    request = Request(request_id="r", prompt_token_ids=[1], params=SamplingParams(),
                      seed=0, eos_token_ids=(), max_tokens=8)
    request.matcher, request.json_string = Matcher(), OUTSIDE
    note_json_token(request, b'{"name": "Jo')
    assert request.json_string == INSIDE and lazy_row_ban(request, 1) == "string"
    assert lazy_row_ban(request, 3) is None  # rows after drafts are not scanned
    note_json_token(request, b"\xc3")
    assert lazy_row_ban(request, 1) is None  # mid-character
    note_json_token(request, b"\xa9\\")
    assert lazy_row_ban(request, 1) is None  # after a backslash
    note_json_token(request, b'n", ')
    assert lazy_row_ban(request, 1) is None  # outside


def _bits(words: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def _walk(compiler, spec, banned: np.ndarray, rng: random.Random, steps: int) -> int:
    """A random walk through the request's grammar; returns how many positions inside a
    string it checked. Quote tokens are picked often, so that walks leave strings."""
    grammar = compiler.compile(spec)
    matcher = grammar.matcher()
    vocab = compiler.vocab
    request = Request(request_id="w", prompt_token_ids=[1], params=SamplingParams(), seed=0,
                      eos_token_ids=(), max_tokens=steps)
    request.json_string = OUTSIDE
    bitmask = torch.zeros((1, -(-compiler.vocab.vocab_size // 32)), dtype=torch.int32)
    checked = 0
    for _ in range(steps):
        if matcher.is_terminated():
            break
        matcher.fill_bitmask(bitmask, 0)
        allowed = _bits(bitmask[0].numpy(), compiler.vocab.vocab_size)
        if matcher.ban is not None:
            allowed &= ~_bits(matcher.ban.keep_words.numpy() ^ -1, compiler.vocab.vocab_size)
        if request.json_string == INSIDE and not request.json_utf8:
            checked += 1
            wrong = np.flatnonzero(allowed & banned)
            assert not wrong.size, [vocab.token_bytes[i] for i in wrong[:8]]
        ids = np.flatnonzero(allowed)
        if not ids.size:
            break
        quoted = [i for i in ids if b'"' in (vocab.token_bytes[i] or b"")]
        token = int(rng.choice(quoted) if quoted and rng.random() < 0.3 else rng.choice(ids))
        assert matcher.accept_token(token)
        if token not in vocab.eos_token_ids:
            note_json_token(request, vocab.token_bytes[token])
    return checked


def _check(compiler, specs, *, walks: int, steps: int) -> int:
    ban = compiler._xgrammar.json_string_ban()
    banned = _bits(ban.keep_words.numpy() ^ -1, compiler.vocab.vocab_size)
    rng = random.Random(0)
    return sum(_walk(compiler, spec, banned, rng, steps) for spec in specs for _ in range(walks))


@pytest.mark.parametrize("any_whitespace", [False, True])
def test_no_allowed_token_is_banned_inside_strings(tokenizer, any_whitespace):
    compiler = GrammarCompiler(tokenizer, vocab_size=49152,
                               config=EngineConfig(any_whitespace=any_whitespace,
                                                   dfa_masks=False))
    try:
        specs = [SamplingParams(json_schema=s).constraint for s in SCHEMAS]
        specs.append(SamplingParams(json_object=True).constraint)
        assert _check(compiler, specs, walks=4, steps=60) > 300
    finally:
        compiler.shutdown()


@pytest.mark.skipif(not (DATA / "jsonschemabench").is_dir(), reason="shared data not present")
def test_no_allowed_token_is_banned_inside_strings_of_jsonschemabench(compiler):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    cases = common.sample_stratified(common.load_jsonschemabench(DATA, common.JSB_SUBSETS), 40,
                                     seed=11)
    specs = []
    for case in cases:
        try:
            spec = SamplingParams(json_schema=case.schema).constraint
            compiler.compile(spec)
        except Exception:  # noqa: BLE001, S112 - refused schemas have nothing to walk
            continue
        specs.append(spec)
    assert len(specs) >= 20
    assert _check(compiler, specs, walks=2, steps=50) > 500


def test_the_ban_is_a_small_share_of_the_vocabulary(vocab):
    banned = json_string_banned(vocab.token_bytes)
    assert 100 < len(banned) < 0.02 * len(vocab.token_bytes)
