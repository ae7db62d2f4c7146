"""xgrammar backend: JSON schema, json_object, EBNF grammar and regex constraints."""
from __future__ import annotations

import json
import threading
from typing import NamedTuple

import numpy as np
import torch
import xgrammar as xgr

from guided.errors import ConstraintError
from guided.fsm.grammar_bounds import check_grammar_bounds
from guided.fsm.grammar_text import budget_long_repetitions, exact_utf8
from guided.fsm.matcher import Matcher
from guided.fsm.schema_formats import fix_optional_groups
from guided.fsm.settings import CompileSettings
from guided.fsm.vocab import TokenVocab


class TokenBan(NamedTuple):
    """Tokens a grammar must never allow, whatever its own masks say."""
    keep_words: torch.Tensor  # int32 bitmask words, bits of the banned tokens cleared
    ids: frozenset[int]  # the banned token ids (accept_token's check)
    # the words with a cleared bit, and those words: a batch's rows are ANDed there only
    # (125 of 1536 words for SmolLM2's JSON ban; the whole width cost ~0.5 ms a step at 64)
    columns: np.ndarray
    column_words: np.ndarray


_REGEX_META = frozenset(r"\.+*?()|[]{}^$")


def choice_regex(options: list[str]) -> str:
    """The regex that matches exactly one of the options (a `choice` constraint)."""
    return "(" + "|".join("".join("\\" + c if c in _REGEX_META else c for c in option)
                          for option in options) + ")"


class Recipe(NamedTuple):
    """What an xgrammar grammar is compiled from."""
    kind: str  # "json_schema" (checked) | "json_object" | "regex" | "grammar" | "structural_tag"
    source: str  # the schema as JSON, the regex or the EBNF ("" for json_object)
    any_whitespace: bool = False
    max_whitespace: int = 2


def grammar_of(recipe: Recipe) -> xgr.Grammar:
    """The recipe's grammar, its classes admitting valid UTF-8 only and long counted strings
    spelled as character budgets (grammar_text.py). Raises xgrammar's errors."""
    if recipe.any_whitespace:
        options = {"any_whitespace": True, "max_whitespace_cnt": recipe.max_whitespace}
    else:
        options = {"any_whitespace": False}  # compact separators ", " and ": "
    if recipe.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **options)
    if recipe.kind == "json_schema":
        grammar = xgr.Grammar.from_json_schema(recipe.source, strict_mode=True, **options)
    elif recipe.kind == "regex":
        grammar = xgr.Grammar.from_regex(fix_optional_groups(recipe.source))
    elif recipe.kind == "grammar":
        grammar = xgr.Grammar.from_ebnf(recipe.source, root_rule_name="root")
    elif recipe.kind == "structural_tag":  # checked by fsm/structural_tags.py
        grammar = xgr.Grammar.from_structural_tag(json.loads(recipe.source))
    else:
        raise ValueError(f"no xgrammar recipe for {recipe.kind!r}")
    text = str(grammar)
    exact = exact_utf8(text)
    budgeted = budget_long_repetitions(exact) or exact
    if budgeted != text:
        try:
            grammar = xgr.Grammar.from_ebnf(budgeted)
        except Exception as e:  # noqa: BLE001 - an unreadable rewrite: never served as is
            raise ValueError(f"the grammar rewritten (grammar_text) does not parse: {e}") from None
    return grammar


def _detail(error: Exception) -> str:
    """The first line of xgrammar's message, without its "[time] file.cc:line:" head."""
    detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return detail.split(": ", 1)[-1] if detail.startswith("[") and "]" in detail else detail


class XGrammarBackend:
    """One thread-safe xgrammar GrammarCompiler (its cache off: GrammarCompiler keeps an LRU)."""

    def __init__(self, vocab: TokenVocab, config: CompileSettings):
        self.vocab = vocab
        self.config = config
        self.tokenizer_info = xgr.TokenizerInfo(
            vocab.token_bytes, xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
            stop_token_ids=list(vocab.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info,
                                            max_threads=config.xgrammar_threads,
                                            cache_enabled=False)
        self._json_ban: TokenBan | None = None
        # the ban is a Python loop over the vocabulary (~0.1 s): once, not once a thread
        self._bans_lock = threading.Lock()

    def json_ban(self) -> TokenBan:
        """Tokens with a raw control byte (whitespace aside where it is free): xgrammar 0.2.8's
        minLength / maxLength strings admit them, JSON never does."""
        with self._bans_lock:
            if self._json_ban is None:
                allowed = b"\t\n\r" if self.config.any_whitespace else b""
                banned = frozenset(i for i, data in enumerate(self.vocab.token_bytes)
                                   if data and min(data) < 0x20
                                   and any(c < 0x20 and c not in allowed for c in data))
                keep = np.ones(-(-self.vocab.vocab_size // 32) * 32, dtype=bool)
                keep[sorted(banned)] = False
                words = np.packbits(keep, bitorder="little").view(np.int32)  # (num_words,)
                columns = np.flatnonzero(words != -1)
                self._json_ban = TokenBan(torch.from_numpy(words), banned, columns,
                                          words[columns])
            return self._json_ban

    def recipe(self, kind: str, source: str = "") -> Recipe:
        return Recipe(kind, source, self.config.any_whitespace, self.config.max_whitespace)

    def compile(self, recipe: Recipe) -> xgr.CompiledGrammar:
        """ConstraintError where the grammar does not parse, fails its bounds or compile."""
        try:
            grammar = grammar_of(recipe)
        except Exception as e:  # noqa: BLE001 - xgrammar's RuntimeError / ValueError
            raise ConstraintError(f"cannot compile {recipe.kind}: {_detail(e)}") from None
        check_grammar_bounds(grammar.serialize_json(), kind=recipe.kind)
        try:
            return self.compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar's RuntimeError / ValueError
            raise ConstraintError(f"cannot compile {recipe.kind}: {_detail(e)}") from None


class XGrammarMatcher(Matcher):
    __slots__ = ("_eos", "_handle", "_matcher", "_num_tokens", "_stopped", "ban", "compiled",
                 "xgrammar_matcher")

    def __init__(self, compiled: xgr.CompiledGrammar, vocab: TokenVocab, *,
                 ban: TokenBan | None = None):
        self._matcher = self.xgrammar_matcher = xgr.GrammarMatcher(compiled)  # unlimited rollback
        # the C++ matcher itself for the step loop's per-token calls, past the Python wrappers
        self._handle = self._matcher._handle
        self.compiled = compiled  # shared by the request's grammar
        self._num_tokens = len(vocab.token_bytes)
        self._eos = vocab.eos_token_ids
        self.ban = ban  # tokens never allowed, whatever the grammar says (json_ban), or None
        # whether a stop token was ever accepted: only then can it be terminated (each call into
        # xgrammar lets go of the GIL, which the mask threads then hold for a while)
        self._stopped = False

    def accept_token(self, token_id: int) -> bool:
        # xgrammar's own accept answers False once terminated: no is_terminated call first
        if not 0 <= token_id < self._num_tokens:
            return False
        if self.ban is not None and token_id in self.ban.ids:
            return False
        accepted = self._handle.accept_token(token_id, False)
        if accepted and token_id in self._eos:  # a rejected EOS (a lazy row's) ends nothing
            self._stopped = True
        return accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.is_terminated():
            bitmask[row].zero_()
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self.ban is not None:
            bitmask[row, :self.ban.keep_words.shape[0]] &= self.ban.keep_words

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._handle.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._stopped and self._handle.is_terminated()

    def ended_with(self, token_id: int) -> bool:
        return token_id in self._eos and self._handle.is_terminated()

    def forced_string(self) -> bytes:
        if self.is_terminated():  # find_jump_forward_string raises once terminated
            return b""
        try:
            return self._matcher.find_jump_forward_string().encode("utf-8", "surrogatepass")
        except Exception:  # noqa: BLE001 - never raises, by the interface
            return b""

    def accept_bytes(self, data: bytes) -> bool:
        if self.is_terminated():
            return False
        return self._matcher.accept_string(data)
