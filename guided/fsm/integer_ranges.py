"""The JSON integers within bounds as a regex (what a schema's minimum / maximum allow), for the
token-level DFA: canonical decimals (no leading zeros, no "-0"), split by digit count.

    integer_range_regex(7, 123)  ->  7..9 | 10..99 | 100..123, each a run of digit classes
"""
from __future__ import annotations


def integer_range_regex(lo: int | None, hi: int | None) -> str:
    """The integers n with lo <= n <= hi (None: unbounded on that side), as a grouped regex."""
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"empty integer range [{lo}, {hi}]")
    parts = []
    if hi is None or hi >= 0:
        parts.append(_naturals(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:  # negatives: magnitudes from max(1, -hi) up to -lo
        smallest = 1 if hi is None or hi >= 0 else -hi
        parts.append("-(" + _naturals(smallest, None if lo is None else -lo) + ")")
    return "(" + "|".join(f"({p})" for p in parts) + ")"


def _naturals(lo: int, hi: int | None) -> str:
    """lo <= n <= hi for n >= 0 (hi None: unbounded)."""
    parts = []
    top = len(str(hi)) if hi is not None else len(str(lo))
    for length in range(len(str(lo)), top + 1):
        first = lo if length == len(str(lo)) else 10 ** (length - 1)
        last = hi if hi is not None and length == len(str(hi)) else 10 ** length - 1
        parts.append(_same_length(str(first), str(last)))
    if hi is None:  # every number with more digits than lo
        parts.append(f"[1-9][0-9]{{{len(str(lo))},}}")
    return "|".join(f"({p})" for p in parts)


def _same_length(a: str, b: str) -> str:
    """The digit strings from a to b (equal lengths, a <= b) as a regex."""
    if a == b:
        return a
    if len(a) == 1:
        return f"[{a}-{b}]"
    if a[0] == b[0]:
        return a[0] + "(" + _same_length(a[1:], b[1:]) + ")"
    rest = len(a) - 1
    parts, low, high = [], int(a[0]), int(b[0])
    if a[1:] != "0" * rest:  # a's first digit, the tails from a's up
        parts.append(a[0] + "(" + _same_length(a[1:], "9" * rest) + ")")
        low += 1
    tail_of_b = None
    if b[1:] != "9" * rest:  # b's first digit, the tails up to b's
        tail_of_b = b[0] + "(" + _same_length("0" * rest, b[1:]) + ")"
        high -= 1
    if low <= high:
        digits = str(low) if low == high else f"[{low}-{high}]"
        parts.append(f"{digits}[0-9]{{{rest}}}")
    if tail_of_b is not None:
        parts.append(tail_of_b)
    return "|".join(f"({p})" for p in parts)
