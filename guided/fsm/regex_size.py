"""A regex's unrolled size: how many character positions its DFA has to tell apart, counted
without building it.

Building a token-level index walks the vocabulary from every DFA state, so its cost grows with
the states: ~0.35 ms a state on the CPU here, 11 s for a schema of 30k states against 6 ms for
xgrammar's grammar of it (benchmarks/bench_dfa_sizes.py). The compiler asks this first, so that
such a schema's requests need not wait for that (fsm/compiler.py). The count is an estimate, a
pure function of the text: every literal character or class counts 1, a sequence and the
branches of an alternation add up, and a repetition multiplies by its upper bound (its lower one
where it has none): the states of a JSON schema's regex are mostly its literal keys and its
counted repetitions unrolled.
"""
from __future__ import annotations


def regex_size(regex: str) -> float:
    """The unrolled size of a regex in the syntax schema_regex writes (groups, alternation,
    classes, escapes and the quantifiers ?, *, +, {n}, {m,}, {m,n}); infinite for one nested
    past Python's recursion limit (large by any measure)."""
    try:
        return _alternation(regex, 0)[0]
    except RecursionError:
        return float("inf")


def _alternation(regex: str, i: int) -> tuple[int, int]:
    total, i = _sequence(regex, i)
    while i < len(regex) and regex[i] == "|":
        branch, i = _sequence(regex, i + 1)
        total += branch
    return total, i


def _sequence(regex: str, i: int) -> tuple[int, int]:
    total = 0
    while i < len(regex) and regex[i] not in "|)":
        atom, i = _atom(regex, i)
        atom, i = _quantified(regex, i, atom)
        total += atom
    return total, i


def _atom(regex: str, i: int) -> tuple[int, int]:
    c = regex[i]
    if c == "(":
        i += 1
        if regex.startswith("?:", i):
            i += 2
        inner, i = _alternation(regex, i)
        return inner, i + 1  # past ")"
    if c == "[":
        i += 1
        if i < len(regex) and regex[i] == "^":
            i += 1
        if i < len(regex) and regex[i] == "]":  # a leading "]" is a member
            i += 1
        while i < len(regex) and regex[i] != "]":
            i += 2 if regex[i] == "\\" else 1
        return 1, i + 1
    if c == "\\":
        return 1, i + 2
    return 1, i + 1


def _quantified(regex: str, i: int, atom: int) -> tuple[int, int]:
    while i < len(regex):
        c = regex[i]
        if c in "?*+":
            i += 1
        elif c == "{" and (close := regex.find("}", i)) > i and _is_count(regex[i + 1:close]):
            low, _, high = regex[i + 1:close].partition(",")
            bound = high if high.strip() else low
            atom *= max(1, int(bound or 0))
            i = close + 1
        else:
            break
    return atom, i


def _is_count(body: str) -> bool:
    low, comma, high = body.partition(",")
    return low.strip().isdigit() and (not comma or not high.strip() or high.strip().isdigit())
