"""regex_size: a regex's unrolled size, the compiler's estimate of its DFA's cost."""
from __future__ import annotations

import pytest

from guided.fsm.regex_size import regex_size


@pytest.mark.parametrize("regex,size", [
    ("abc", 3),
    ("a|bc", 3),  # branches add up
    ("(ab){2,5}", 10),  # a repetition counts to its upper bound
    ("(ab){3}", 6),
    ("(ab){2,}", 4),  # unbounded: its lower bound
    ("x+y*z?", 3),
    ("((ab){2}){3}", 12),  # nested repetitions multiply
    (r"[a-z]{8}", 8),  # a class is one position
    (r"[]a]b", 2),  # a leading ] is a class member
    (r"[^\]\\]c", 2),  # escapes inside a class
    (r"\{\}\d", 3),  # escaped braces are literals, not a count
    ("(?:ab|c)d", 4),
    ('"[^"\\\\]{0,64}"', 66),
    ("a{,3}", 5),  # not a count: five literals
])
def test_sizes(regex, size):
    assert regex_size(regex) == size


def test_large_repetitions_and_long_alternations_are_large():
    keys = "|".join(f'"key{i}":[0-9]+' for i in range(200))
    assert regex_size(f"\\{{({keys})\\}}") > 1000
    assert regex_size('"[a-z]{0,2048}"') > 1000
    assert regex_size('\\{"name":"[a-z]{0,32}","age":[0-9]{1,3}\\}') < 100


def test_a_regex_nested_past_the_recursion_limit_counts_as_large():
    deep = "(" * 5000 + "a" + ")" * 5000
    assert regex_size(deep) == float("inf")
    assert regex_size("(a){3}") == 3
