"""llguidance backend: checked JSON schemas whose xgrammar compile is slow (long string bounds).

A checked schema is restated so that llguidance admits the same language: patterns anchored
(whole matches), strict mode's closed objects and tuples said explicitly, and only keywords
probed to be enforced by llguidance passed (any other keeps the schema on xgrammar).
"""
from __future__ import annotations

from typing import Any

import torch

from guided.errors import ConstraintError
from guided.fsm.matcher import Matcher
from guided.fsm.schema_formats import MAX_PATTERN_LENGTH, whole_match_body
from guided.fsm.vocab import TokenVocab

# the keywords a checked schema may keep and llguidance enforces exactly (tests/fsm/
# test_llguidance_backend.py walks each); annotations are gone after schema_check
_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties",
                       "patternProperties", "items", "prefixItems", "minItems",
                       "maxItems", "minLength", "maxLength", "pattern", "enum", "const",
                       "anyOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                       "multipleOf", "minProperties", "maxProperties", "$defs",
                       "definitions"})
# every keyword of the JSON Schema vocabularies: a key outside it is an annotation (dropped); a
# keyword outside _KEYWORDS keeps the schema on xgrammar
_VOCABULARY = _KEYWORDS | {
    "$ref", "$dynamicRef", "$recursiveRef", "$id", "$anchor", "$schema", "propertyNames",
    "not", "if", "then",
    "else", "allOf", "oneOf", "format", "uniqueItems", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedItems",
    "unevaluatedProperties", "additionalItems", "contentMediaType", "contentEncoding",
    "contentSchema"}
# compact separators, as the xgrammar grammars write them (outputs read the same)
_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class _Ineligible(Exception):
    pass


def prefers_llguidance(node: Any) -> bool:
    """Whether xgrammar's compile of this checked schema is slow: a string bound past what
    schema_check writes as a short pattern."""
    if isinstance(node, dict):
        return any(isinstance(node.get(key), int) and node[key] > MAX_PATTERN_LENGTH
                   for key in ("maxLength", "minLength")) or any(
            prefers_llguidance(v) for v in node.values())
    return isinstance(node, list) and any(prefers_llguidance(v) for v in node)


def llguidance_schema(schema: Any) -> dict | None:
    """The checked schema restated for llguidance (module docstring), or None: ineligible."""
    try:
        return _restate(schema, 0)
    except _Ineligible:
        return None


def _restate(node: Any, depth: int) -> Any:
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict) or depth > 100:
        raise _Ineligible
    out = {k: v for k, v in node.items() if k in _VOCABULARY}
    if not out.keys() <= _KEYWORDS:
        raise _Ineligible
    if isinstance(out.get("pattern"), str):
        out["pattern"] = _anchored(out["pattern"])
    for key in ("properties", "$defs", "definitions"):
        if key in out:
            out[key] = {k: _restate(v, depth + 1) for k, v in out[key].items()}
    if "patternProperties" in out:
        out["patternProperties"] = {_anchored(k): _restate(v, depth + 1)
                                    for k, v in out["patternProperties"].items()}
    for key in ("additionalProperties", "items"):
        if isinstance(out.get(key), dict):
            out[key] = _restate(out[key], depth + 1)
    for key in ("prefixItems", "anyOf"):
        if key in out:
            out[key] = [_restate(v, depth + 1) for v in out[key]]
    if ("properties" in out or "patternProperties" in out) and (
            "additionalProperties" not in out):
        out["additionalProperties"] = False  # strict mode's closed object
    if "prefixItems" in out and "items" not in out:
        out["items"] = False  # strict mode's closed tuple
    return out


def _anchored(pattern: str) -> str:
    return f"^(?:{whole_match_body(pattern)})$"


class _OwnTokens:
    """What llguidance's TokenizerWrapper reads: our token table and the tokenizer's encoding
    (llguidance.hf.from_tokenizer misread tokenizers 0.23.2's JSON: rejected tokens)."""

    def __init__(self, tokenizer, vocab: TokenVocab):
        special = vocab.special_ids
        self.tokens = [tokenizer.convert_ids_to_tokens(i).encode() if i in special else piece
                       for i, piece in enumerate(vocab.token_bytes)]
        self.eos_token_id = vocab.eos_token_ids[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(special)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


class LLGuidanceBackend:
    """One llguidance tokenizer (built once, ~0.25 s) for a compiler's vocabulary."""

    def __init__(self, tokenizer, vocab: TokenVocab):
        from llguidance import LLTokenizer, TokenizerWrapper

        self.vocab = vocab
        self.tokenizer = LLTokenizer(TokenizerWrapper(_OwnTokens(tokenizer, vocab)),
                                     n_vocab=vocab.vocab_size,
                                     eos_token=list(vocab.eos_token_ids))

    def start(self, schema: dict):
        """A matcher at the start of a restated schema's grammar, to copy for each request
        (LLGuidanceMatcher); ConstraintError where llguidance refuses the schema."""
        from llguidance import LLMatcher

        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=_OPTIONS)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error or messages:  # a warning may be a keyword it did not enforce
            raise ConstraintError(f"llguidance: {'; '.join(messages)[:300]}")
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"llguidance: {matcher.get_error()[:300]}")
        return matcher


class LLGuidanceMatcher(Matcher):
    """llguidance stops by itself once nothing may follow: EOS is allowed and counted there, so
    that it ends like xgrammar's."""

    __slots__ = ("_ended", "_eos", "_eos_in_llg", "_matcher", "_num_bytes", "_num_tokens",
                 "_tokenizer")

    def __init__(self, start, backend: LLGuidanceBackend):
        self._matcher = start.deep_copy()
        self._tokenizer = backend.tokenizer
        self._num_tokens = backend.vocab.vocab_size
        self._num_bytes = -(-backend.tokenizer.vocab_size // 32) * 4
        self._eos = frozenset(backend.vocab.eos_token_ids)
        self._ended = False  # EOS accepted
        self._eos_in_llg = False  # ... and consumed by llguidance (it had not stopped)

    def accept_token(self, token_id: int) -> bool:
        if self._ended or not 0 <= token_id < self._num_tokens:
            return False
        if token_id in self._eos:
            if self._matcher.is_stopped():
                self._ended = True
                return True
            if not self._matcher.is_accepting():
                return False
            self._ended = self._eos_in_llg = self._matcher.consume_token(token_id)
            return self._ended
        # a refused token would put llguidance's matcher in its error state for good: asked first
        if self._matcher.is_stopped() or self._matcher.validate_tokens([token_id]) != 1:
            return False
        return self._matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]  # (num_words,) int32, contiguous
        words.zero_()  # ids past the tokenizer's (padded logits) stay disallowed
        if self._ended:
            return
        if self._matcher.is_stopped():  # nothing may follow: EOS only
            for eos in self._eos:  # bit 31 of an int32 word is its sign
                words[eos // 32] |= (1 << eos % 32) - (1 << 32 if eos % 32 == 31 else 0)
            return
        if words.numel() * 4 < self._num_bytes or not words.is_contiguous():
            raise ValueError("the bitmask row is narrower than the vocabulary")
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), self._num_bytes)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self._ended:
            if self._eos_in_llg:
                self._matcher.rollback(1)
            self._ended = self._eos_in_llg = False
            num_tokens -= 1
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._ended

    def forced_string(self) -> bytes:
        if self._ended or self._matcher.is_stopped():
            return b""
        try:
            return self._matcher.compute_ff_bytes()
        except Exception:  # noqa: BLE001 - never raises, by the interface
            return b""

    def accept_bytes(self, data: bytes) -> bool:
        if self._ended or self._matcher.is_stopped():
            return not data and not self._ended
        ids = self._tokenizer.tokenize_bytes(data)
        if self._matcher.validate_tokens(ids) != len(ids):
            return False
        return self._matcher.consume_tokens(ids)

