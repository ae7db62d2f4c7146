"""Long counted repetitions of one character class, rewritten as character budgets.

Inside xgrammar 0.2.8's repeat state (counts past 128) every mask row walks the vocabulary
(mlc-ai/xgrammar#852); `c{m}` then a rule `c*` limited to n - m characters (`[max_chars=...]`)
is the same language, cheaply.
"""
from __future__ import annotations

import re

# xgrammar unrolls counted repetitions up to this many; beyond it the costly counted form
UNROLLED = 128

# xgrammar's rule names may hold '-' and '.'
_NAME = r"[\w.-]+"
# a rule whose whole body is one character class, as xgrammar prints it: name ::= (([...]))
_CLASS_RULE = re.compile(rf"^({_NAME}) ::= \(\((\[(?:\\.|[^\\\]])*\])\)\)$", re.MULTILINE)
# scanned left to right: a quoted literal (or a Regex("...") node's pattern) or a character
# class (which may hold a quote), passed over whole; or a bounded repetition of a rule,
# name{m, n} (n = -1 is unbounded: left alone)
_SCAN = re.compile(rf'(?P<opaque>"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\])'
                   rf"|(?<![\w.-])(?P<name>{_NAME})\{{(?P<low>\d+),\s*(?P<high>\d+)\}}")


def budget_long_repetitions(ebnf: str, *, above: int = UNROLLED) -> str | None:
    """The grammar text with each `c{m,n}` (c a one-class rule, n > above >= m) spelled as
    `c{m} budget`, budget being `c*` limited to n - m characters; None when nothing changes."""
    classes = {name for name, _ in _CLASS_RULE.findall(ebnf)}
    budgets: dict[str, str] = {}

    def spell(match: re.Match) -> str:
        if match.group("opaque"):
            return match.group(0)
        name, low, high = match.group("name"), int(match.group("low")), int(match.group("high"))
        if name not in classes or high <= above or low > above:
            return match.group(0)
        budget = f"{name}_budget_{high - low}"
        while re.search(rf"(?<![\w.-]){re.escape(budget)}(?![\w.-])", ebnf):
            budget += "_"  # a name the grammar already uses
        budgets[budget] = f"{budget}[max_chars={high - low}] ::= {name}*"
        return f"{name}{{{low}}} {budget}" if low else budget

    text = _SCAN.sub(spell, ebnf)
    if not budgets:
        return None
    return text.rstrip("\n") + "\n" + "\n".join(budgets.values()) + "\n"

