"""Prompt-lookup drafts: what followed the latest earlier occurrence of the last few tokens.

Jump-forward drafts the grammar's forced text; past it, constrained outputs are often copies:
a key or enum value the schema in the prompt spells out, or a run the output already contains
(small models repeat). Those tokens are drafted from the request's own tokens and verified like
the forced ones, so outputs do not change; a wrong guess costs only the slots it filled.

The index maps each token to the positions it occurs at, so a lookup touches only the
positions of the last token instead of scanning the whole context every step.
"""
from __future__ import annotations

MAX_CANDIDATES = 64  # earlier occurrences of the last token tried per lookup (latest first)


class NgramIndex:
    """The request's tokens (prompt then output), indexed for suffix matches."""

    __slots__ = ("tokens", "positions", "barrier")

    def __init__(self, barrier: frozenset[int] = frozenset()) -> None:
        self.tokens: list[int] = []
        self.positions: dict[int, list[int]] = {}
        self.barrier = barrier  # tokens a draft never contains (the chat template's specials)

    def extend(self, new_tokens: list[int]) -> None:
        for token in new_tokens:
            self.positions.setdefault(token, []).append(len(self.tokens))
            self.tokens.append(token)

    def sync(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Index the tokens appended since the last call (a request's tokens only grow)."""
        done = len(self.tokens)
        num_prompt = len(prompt_ids)
        if done < num_prompt:
            self.extend(prompt_ids[done:])
            done = num_prompt
        self.extend(output_ids[done - num_prompt:])

    def lookup(self, suffix: list[int], *, min_n: int, max_n: int, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the context's last n
        tokens, for the longest n in [min_n, max_n] that occurs. The context is the indexed
        tokens followed by `suffix` (tokens not committed yet: the forced drafts)."""
        if k <= 0:
            return []
        tokens = self.tokens
        suffix = list(suffix)
        context_len = len(tokens) + len(suffix)
        if context_len < min_n + 1:
            return []
        # the context's last max_n tokens, in one list: indexing it beats a per-position
        # closure over tokens and suffix, and copies a few tokens instead of the context
        tail = (tokens[-max_n:] + suffix)[-max_n:]
        last = context_len - 1
        best_n, best_end = 0, -1
        # the latest earlier occurrences of the last token first (positions index `tokens`)
        for end in reversed(self.positions.get(tail[-1], ())[-MAX_CANDIDATES:]):
            if end >= last:
                continue
            n = 1
            while n < max_n and end - n >= 0 and tokens[end - n] == tail[-1 - n]:
                n += 1
            if n > best_n:
                best_n, best_end = n, end
                if n == max_n:
                    break
        if best_n < min_n:
            return []
        start = best_end + 1  # <= len(tokens): the draft reads on into the suffix
        draft = []
        for token in (tokens[start:start + k] + suffix[:max(0, start + k - len(tokens))])[:k]:
            if token in self.barrier:
                break
            draft.append(token)
        return draft
