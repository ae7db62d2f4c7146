"""Rewrites of xgrammar 0.2.8's printed grammar text, the language the same or stricter.

- exact_utf8: xgrammar admits non-UTF-8 bytes in two encodings of a class (random walks found
  both): a `Regex("...")` node's range that crosses a UTF-8 length boundary (overlong forms and
  surrogates pass), and an EBNF class holding U+D800-U+DFFF. EBNF classes lose the surrogates;
  a pattern's classes and `.` become one class per UTF-8 length, less the surrogates.
- budget_long_repetitions: inside xgrammar's repeat state (counts past 128) every mask row walks
  the vocabulary (mlc-ai/xgrammar#852); `c{m}` then a rule `c*` limited to n - m characters
  (`[max_chars=...]`) is the same language, cheaply.
"""
from __future__ import annotations

import functools
import json
import re
import re._constants as sre
import re._parser as sre_parse

from guided.fsm.schema_formats import REGEX_ATOM

SURROGATES = (0xD800, 0xDFFF)  # not characters: a class left with only these matches nothing
_LENGTHS = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, 0x10FFFF))
# the class escapes as xgrammar reads them (ASCII), as code point ranges
_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_CATEGORIES = {sre.CATEGORY_DIGIT: (_DIGIT, False), sre.CATEGORY_NOT_DIGIT: (_DIGIT, True),
               sre.CATEGORY_WORD: (_WORD, False), sre.CATEGORY_NOT_WORD: (_WORD, True),
               sre.CATEGORY_SPACE: (_SPACE, False), sre.CATEGORY_NOT_SPACE: (_SPACE, True)}
# a grammar's quoted literal (or a Regex node's pattern), and its character class
_QUOTED = r'"(?:\\.|[^"\\])*"'
_EBNF_CLASS = r"\[(?:\\.|[^\]\\])*\]"
# over a grammar's text: a Regex node's pattern, a quoted literal (left alone), a class
_GRAMMAR_PIECE = re.compile(rf"Regex\((?P<pattern>{_QUOTED})|{_QUOTED}|(?P<cls>{_EBNF_CLASS})")
# the escapes xgrammar prints in a quoted pattern
_QUOTED_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)")
_NAMED = {"0": "\0", "t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v", "b": "\b"}
# xgrammar unrolls counted repetitions up to this many; beyond it the costly counted form
UNROLLED = 128
# xgrammar's rule names may hold '-' and '.'
_NAME = r"[\w.-]+"
_WORD_RUN = re.compile(_NAME)  # greedy: each match is a whole word, as a name is
# a rule whose whole body is one character class, as xgrammar prints it: name ::= (([...]))
_CLASS_RULE = re.compile(rf"^({_NAME}) ::= \(\(({_EBNF_CLASS})\)\)$", re.MULTILINE)
# scanned left to right: a quoted literal or a class (which may hold a quote), passed over
# whole; or a bounded repetition of a rule, name{m, n} (n = -1 is unbounded: left alone)
_SCAN = re.compile(rf"(?P<opaque>{_QUOTED}|{_EBNF_CLASS})"
                   rf"|(?<![\w.-])(?P<name>{_NAME})\{{(?P<low>\d+),\s*(?P<high>\d+)\}}")


def exact_utf8(grammar: str) -> str:
    """xgrammar's printed grammar with every class (and a pattern's `.`) matching valid UTF-8
    only; a class it cannot read stays."""
    def piece(match: re.Match) -> str:
        if match.group("pattern"):
            pattern = _QUOTED_ESCAPE.sub(_unescape, match.group("pattern")[1:-1])
            return "Regex(" + json.dumps(exact_pattern(pattern), ensure_ascii=False)
        if match.group("cls"):
            return _ebnf_class(match.group("cls"))
        return match.group(0)

    return _GRAMMAR_PIECE.sub(piece, grammar)


# a workload's grammars share a few classes and patterns (a JSON string's, whitespace, digits),
# and a compile holds the GIL the step loop needs while it rewrites them: each is read once
@functools.lru_cache(maxsize=4096)
def exact_pattern(pattern: str) -> str:
    """The regex with each class reaching past ASCII, and `.`, as (a|b|..): one class per UTF-8
    length, none holding a surrogate."""
    out = []
    for text in REGEX_ATOM.findall(pattern):
        if text == ".":
            text = "[^\\n]"
        elif text in ("\\D", "\\W", "\\S"):
            text = f"[{text}]"
        if text.startswith("["):
            ranges = _class_ranges(text)
            if ranges is not None and ranges[-1][1] > 0x7F:
                classes = [_pattern_class(part) for part in _by_length(ranges)]
                text = classes[0] if len(classes) == 1 else "(" + "|".join(classes) + ")"
        out.append(text)
    return "".join(out)


def budget_long_repetitions(ebnf: str) -> str | None:
    """The grammar text with each `c{m,n}` (c a one-class rule, n > UNROLLED >= m) spelled as
    `c{m} budget`, budget being `c*` limited to n - m characters; None when nothing changes."""
    classes = {name for name, _ in _CLASS_RULE.findall(ebnf)}
    budgets: dict[str, str] = {}
    taken: set[str] = set()  # every name-like word of the text, read at the first budget

    def spell(match: re.Match) -> str:
        if match.group("opaque"):
            return match.group(0)
        name, low, high = match.group("name"), int(match.group("low")), int(match.group("high"))
        if name not in classes or high <= UNROLLED or low > UNROLLED:
            return match.group(0)
        budget = f"{name}_budget_{high - low}"
        if not taken:
            taken.update(_WORD_RUN.findall(ebnf))
        while budget in taken:
            budget += "_"  # a name the grammar already uses
        budgets[budget] = f"{budget}[max_chars={high - low}] ::= {name}*"
        return f"{name}{{{low}}} {budget}" if low else budget

    text = _SCAN.sub(spell, ebnf)
    if not budgets:
        return None
    return text.rstrip("\n") + "\n" + "\n".join(budgets.values()) + "\n"


@functools.lru_cache(maxsize=4096)
def _ebnf_class(text: str) -> str:
    ranges = _class_ranges(text)
    if ranges is None or not any(lo <= SURROGATES[1] and hi >= SURROGATES[0]
                                 for lo, hi in ranges):
        return text
    if text.startswith("[^"):  # the shortest spelling: one more range left out
        return "[^\\uD800-\\uDFFF" + text[2:]
    return "[" + "".join(_ebnf_range(lo, hi) for part in _by_length(ranges)
                         for lo, hi in part) + "]"


def _class_ranges(text: str) -> list[tuple[int, int]] | None:
    """The code points a class admits, as sorted disjoint ranges (None: not read)."""
    try:
        parsed = sre_parse.parse(text)
    except (re.error, RecursionError, OverflowError):
        return None
    if len(parsed) != 1:
        return None
    op, arg = parsed[0]
    if op in (sre.LITERAL, sre.NOT_LITERAL):
        items, negated = [(sre.LITERAL, arg)], op is sre.NOT_LITERAL
    elif op is sre.IN:
        negated = bool(arg) and arg[0][0] is sre.NEGATE
        items = arg[negated:]
    else:
        return None
    ranges = []
    for kind, value in items:
        if kind is sre.LITERAL:
            ranges.append((value, value))
        elif kind is sre.RANGE:
            ranges.append(value)
        elif kind is sre.CATEGORY and value in _CATEGORIES:
            members, inverted = _CATEGORIES[value]
            ranges += complement(members) if inverted else members
        else:
            return None
    ranges = _merged(ranges)
    return complement(ranges) if negated else ranges


def _merged(ranges: list) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def complement(ranges: list) -> list[tuple[int, int]]:
    """The code points up to U+10FFFF outside ranges, as sorted disjoint ranges."""
    out, at = [], 0
    for lo, hi in _merged(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    return out + ([(at, 0x10FFFF)] if at <= 0x10FFFF else [])


def _by_length(ranges: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The ranges less the surrogates, split by UTF-8 length (the non-empty lengths only)."""
    allowed = complement([SURROGATES])
    parts = []
    for first, last in _LENGTHS:
        part = [(max(lo, a, first), min(hi, b, last)) for lo, hi in ranges for a, b in allowed]
        part = [(lo, hi) for lo, hi in part if lo <= hi]
        if part:
            parts.append(part)
    return parts


def _pattern_class(ranges: list[tuple[int, int]]) -> str:
    def char(c: int) -> str:  # escaped where ASCII (any may be special), literal beyond
        return f"\\x{c:02x}" if c < 0x80 else chr(c)

    return "[" + "".join(char(lo) if lo == hi else f"{char(lo)}-{char(hi)}"
                         for lo, hi in ranges) + "]"


def _ebnf_range(lo: int, hi: int) -> str:
    def char(c: int) -> str:
        return f"\\x{c:02x}" if c < 0x80 else f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}"

    return char(lo) if lo == hi else f"{char(lo)}-{char(hi)}"


def _unescape(match: re.Match) -> str:
    code = match.group(1)
    if len(code) > 1:
        return chr(int(code[1:], 16))
    return _NAMED.get(code, code)
