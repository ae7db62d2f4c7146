"""Jump-forward: the grammar's forced continuation as canonical tokens, proposed as drafts.

The engine verifies drafts like speculative tokens, so proposals aim to be the tokens the model
would pick: the forced text tokenized together with the last few generated tokens (never the
prompt; a merge that would rewrite a committed token is not drafted), cut at the last complete
UTF-8 character, and checked against the matcher.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

from guided.fsm.matcher import Matcher


class PromptLookup(Protocol):
    """A request's prompt-lookup index (engine/ngram.py)."""

    def lookup(self, suffix: list[int], *, min_n: int, max_n: int, k: int) -> list[int]: ...


MAX_BOUNDARY_TOKENS = 4
# the n-grams of the drafts' context looked up in the prompt, shortest and longest
LOOKUP_MIN_N, LOOKUP_MAX_N = 2, 4
# bytes of forced text retokenized per draft token wanted: more than any token holds, so a cut
# forced text still yields the drafts wanted and a long forced run costs no more than a short one
FORCED_BYTES_PER_DRAFT = 128


class CachedEncoder:
    """tokenizer.encode(text, add_special_tokens=False), memoized, and through the Rust tokenizer
    directly (the wrapper costs ~150 µs a call) where it agrees with the wrapper on probes."""

    PROBES = ("hello world", ' {"key": "', "héllo — 日本語", "  x\n\ty", '"},{"', "12.5e-3")

    def __init__(self, tokenizer):
        def slow(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        def fast(text: str) -> tuple[int, ...]:
            return tuple(backend.encode(text, add_special_tokens=False).ids)

        backend = getattr(tokenizer, "backend_tokenizer", None)
        use_fast = backend is not None and all(fast(p) == slow(p) for p in self.PROBES)
        self._encode = functools.lru_cache(maxsize=1 << 16)(fast if use_fast else slow)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._encode(text))


def _decodes(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def complete_utf8_prefix(data: bytes) -> bytes:
    """The longest prefix of data that ends on a UTF-8 character boundary."""
    for cut in range(len(data), max(len(data) - 4, 0) - 1, -1):
        if _decodes(data[:cut]) is not None:
            return data[:cut]
    return b""


def retokenize(tokenizer, token_bytes: list[bytes], output_ids: list[int], forced: bytes
               ) -> list[int]:
    """Canonical token ids for `forced` following the generated tokens `output_ids`."""
    forced_text = _decodes(complete_utf8_prefix(forced))
    if not forced_text:
        return []
    boundary = output_ids[-MAX_BOUNDARY_TOKENS:]
    for start in range(len(boundary)):  # the longest boundary that is whole characters
        context = _decodes(b"".join(token_bytes[t] for t in boundary[start:]))
        if context is None:
            continue
        ids = tokenizer.encode(context + forced_text, add_special_tokens=False)
        kept = boundary[start:]
        if ids[:len(kept)] == kept:
            return ids[len(kept):]
        break  # the forced text merges into committed tokens: tokenize it on its own
    if boundary and _decodes(b"".join(token_bytes[t] for t in boundary[-1:])) is None:
        return []  # the last token ends inside a character: wait for it to complete
    return tokenizer.encode(forced_text, add_special_tokens=False)


def grammatical_prefix(matcher: Matcher, draft_ids: list[int]) -> list[int]:
    """The longest prefix of draft_ids the matcher accepts; the matcher is left unchanged."""
    accepted = 0
    for token in draft_ids:
        if not matcher.accept_token(token):
            break
        accepted += 1
        if matcher.ended_with(token):
            break
    matcher.rollback(accepted)
    return draft_ids[:accepted]


def propose_draft_tokens(tokenizer, token_bytes: list[bytes], matcher: Matcher,
                         output_ids: list[int], *, max_tokens: int,
                         lookup: PromptLookup | None = None, lookup_tokens: int = 0,
                         unindexed: list[int] | tuple = ()) -> tuple[list[int], int]:
    """Drafts at the matcher's state and how many are forced text: the forced continuation,
    then up to lookup_tokens prompt-lookup tokens (after `unindexed`, the uncommitted last of
    output_ids); cut to what the grammar accepts."""
    if max_tokens <= 0:  # a terminated matcher forces nothing and accepts no draft
        return [], 0
    forced = matcher.forced_string()
    cut = FORCED_BYTES_PER_DRAFT * (max_tokens + 1)
    draft = retokenize(tokenizer, token_bytes, output_ids, forced[:cut]) if forced else []
    if len(forced) > cut:
        draft = draft[:-1]  # the last token may be cut short by the cut
    draft = draft[:max_tokens]
    num_forced = len(draft)
    if lookup is not None and lookup_tokens > 0 and len(draft) < max_tokens:
        draft += lookup.lookup([*unindexed, *draft], min_n=LOOKUP_MIN_N, max_n=LOOKUP_MAX_N,
                               k=min(lookup_tokens, max_tokens - len(draft)))
    draft = grammatical_prefix(matcher, draft) if draft else []
    return draft, min(num_forced, len(draft))


def propose_anchored_drafts(tokenizer, token_bytes: list[bytes], matcher: Matcher,
                            output_ids: list[int], assumed: list[int], *, max_tokens: int,
                            lookup: PromptLookup | None = None, lookup_tokens: int = 0
                            ) -> tuple[int | None, list[int], int]:
    """(anchor, drafts, how many are forced text) for a request whose next step is in flight:
    that step feeds `assumed` and samples one more token, guessed as the anchor (the first
    draft after `assumed`); (None, [], 0) without a guess. The matcher is left unchanged."""
    if max_tokens <= 0:
        return None, [], 0
    walked = 0
    try:
        for token in assumed:
            if not matcher.accept_token(token):
                return None, [], 0
            walked += 1
        tokens, num_forced = propose_draft_tokens(
            tokenizer, token_bytes, matcher, output_ids + assumed, max_tokens=max_tokens + 1,
            lookup=lookup, lookup_tokens=lookup_tokens, unindexed=assumed)
    finally:
        matcher.rollback(walked)
    if len(tokens) < 2:
        return None, [], 0
    return tokens[0], tokens[1:], max(0, num_forced - 1)


@dataclass(frozen=True, slots=True)
class DraftAsk:
    """A request's next proposal as the proposer's policy decided it."""
    room: int  # drafts at most
    lookup_tokens: int  # prompt-lookup guesses at most (0: none)
    assumed: tuple[int, ...] | None  # the in-flight step's drafts (anchored); None: unanchored


def make_drafts(tokenizer, token_bytes: list[bytes], matcher: Matcher, output_ids: list[int],
                ask: DraftAsk, lookup: PromptLookup | None) -> tuple[int | None, list[int], int]:
    """(anchor, drafts, how many drafts are forced text) for `ask` at the matcher's state."""
    lookup = lookup if ask.lookup_tokens else None
    if ask.assumed is not None:
        return propose_anchored_drafts(tokenizer, token_bytes, matcher, output_ids,
                                       list(ask.assumed), max_tokens=ask.room, lookup=lookup,
                                       lookup_tokens=ask.lookup_tokens)
    drafts, num_forced = propose_draft_tokens(tokenizer, token_bytes, matcher, output_ids,
                                              max_tokens=ask.room, lookup=lookup,
                                              lookup_tokens=ask.lookup_tokens)
    return None, drafts, num_forced
