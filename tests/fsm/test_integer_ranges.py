"""integer_range_regex against Python's comparison, on bounds and numbers drawn at random."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guided.fsm.integer_ranges import integer_range_regex

bounds = st.one_of(st.none(), st.integers(-10**6, 10**6), st.integers(-50, 50))


@settings(max_examples=300, deadline=None)
@given(lo=bounds, hi=bounds, numbers=st.lists(st.integers(-10**7, 10**7) | st.integers(-120, 120),
                                               min_size=20, max_size=40))
def test_the_regex_admits_exactly_the_integers_in_range(lo, hi, numbers):
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    pattern = re.compile(integer_range_regex(lo, hi))
    for n in numbers + [x for x in (lo, hi) if x is not None] + [
            x + d for x in (lo, hi) if x is not None for d in (-1, 1)]:
        inside = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert bool(pattern.fullmatch(str(n))) == inside, (lo, hi, n, pattern.pattern)


@pytest.mark.parametrize("text", ["007", "-0", "00", "+5", "1.0", "", "-"])
def test_only_canonical_integers(text):
    assert not re.fullmatch(integer_range_regex(None, None), text)
    assert not re.fullmatch(integer_range_regex(-100, 100), text)


def test_an_empty_range_is_refused():
    with pytest.raises(ValueError):
        integer_range_regex(5, 4)
