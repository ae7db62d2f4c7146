"""A checked schema's grammar over a one-character vocabulary: what it admits, and random
outputs drawn from its own masks, each judged by jsonschema (Draft 2020-12, formats checked).

The schema tests use it to show a rewrite is sound (every output validates) and useful (the
instances it should keep are still admitted)."""
from __future__ import annotations

import json
import random

import numpy as np
import xgrammar as xgr
from jsonschema import Draft202012Validator

from guided.fsm.backends.xgrammar_backend import Recipe, grammar_of
from guided.fsm.schema_check import check_schema

# printable ASCII plus a few characters outside it, one token each; the last is the stop token
_CHARS = [chr(i) for i in range(32, 127)] + ["é", "\n"]
_EOS = len(_CHARS)
_INFO = xgr.TokenizerInfo(_CHARS + ["<eos>"], stop_token_ids=[_EOS])
_COMPILER = xgr.GrammarCompiler(_INFO, cache_enabled=False)


class Oracle:
    def __init__(self, schema):
        self.schema = schema
        self.checked = check_schema(schema)
        # as the engine compiles it (compact separators, character budgets)
        recipe = Recipe("json_schema", json.dumps(self.checked))
        self.grammar = _COMPILER.compile_grammar(grammar_of(recipe))
        self.validator = Draft202012Validator(
            schema, format_checker=Draft202012Validator.FORMAT_CHECKER)

    def admits(self, text: str) -> bool:
        matcher = xgr.GrammarMatcher(self.grammar)
        return (matcher.accept_string(text) and matcher.accept_token(_EOS)
                and matcher.is_terminated())

    def admits_value(self, value) -> bool:
        """In the engine's separators, or compact (xgrammar writes enum values compact)."""
        return any(self.admits(json.dumps(value, separators=separators))
                   for separators in ((", ", ": "), (",", ":")))

    def walk(self, rng: random.Random, steps: int = 300) -> str | None:
        """One output drawn at random from the grammar's masks (None: it did not end)."""
        matcher = xgr.GrammarMatcher(self.grammar)
        row = xgr.allocate_token_bitmask(1, _INFO.vocab_size)
        out = []
        for step in range(steps):
            matcher.fill_next_token_bitmask(row)
            bits = np.unpackbits(row[0].numpy().view(np.uint8), bitorder="little")
            ids = [int(i) for i in np.flatnonzero(bits[:_INFO.vocab_size])]
            if not ids:
                return None
            if _EOS in ids and (len(ids) == 1 or rng.random() < 0.3 or step > steps // 2):
                return "".join(out)
            closers = [i for i in ids if _CHARS[i] in '"]}'] if step > steps // 3 else []
            token = rng.choice(closers or [i for i in ids if i != _EOS])
            assert matcher.accept_token(token)
            out.append(_CHARS[token])
        return None

    def assert_sound(self, *, walks: int = 40, seed: int = 0) -> int:
        """Every random output parses and validates; returns how many were drawn."""
        rng = random.Random(seed)
        drawn = 0
        for _ in range(walks):
            text = self.walk(rng)
            if text is None:
                continue
            drawn += 1
            errors = list(self.validator.iter_errors(json.loads(text)))
            assert not errors, (text, errors[0].message, self.checked)
        return drawn

    def assert_judges(self, valid: list, invalid: list) -> None:
        """Each valid instance admitted, each invalid one refused."""
        for value in valid:
            assert self.validator.is_valid(value), value
            assert self.admits_value(value), (value, self.checked)
        for value in invalid:
            assert not self.validator.is_valid(value), value
            assert not self.admits_value(value), (value, self.checked)
