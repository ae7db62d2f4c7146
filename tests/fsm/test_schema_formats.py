from __future__ import annotations

import pytest
from grammar_oracle import Oracle

from guided.errors import ConstraintError
from guided.fsm.schema_check import check_schema
from guided.fsm.schema_formats import bounded_pattern


@pytest.mark.parametrize("pattern, low, high, expected", [
    ("^[a-z]+$", 0, 8, "^[a-z]{1,8}$"),
    ("^[0-9a-f]{24}$", 24, 24, "^[0-9a-f]{24}$"),  # the bounds already hold: unchanged
    ("^[A-Z]{2}-[0-9]*$", 3, 6, "^[A-Z]{2}-[0-9]{0,3}$"),
    ("^a(b|c)+$", 0, 5, "^a(b|c){1,4}$"),
    ("[a-z]+", 2, None, "[a-z]{2,}"),
    (r"^\d+\.\d+\.\d+$", 7, 10, r"^\d{3,4}\.\d{1,2}\.\d{1,2}$"),  # shared: a subset
])
def test_bounded_pattern(pattern, low, high, expected):
    assert bounded_pattern(pattern, low, high, "/") == expected


@pytest.mark.parametrize("pattern, low, high", [
    ("^(a|bc)+$", 0, 3),  # a repeated piece of varying width
    ("^x{3}$", 5, None),  # never that long
    ("^a|b+$", 0, 2),  # alternation at the top
])
def test_bounded_pattern_refusals(pattern, low, high):
    with pytest.raises(ConstraintError):
        bounded_pattern(pattern, low, high, "/")


def test_length_bounds_beside_a_pattern_are_enforced():
    oracle = Oracle({"type": "string", "pattern": r"^\d+\.\d+$", "minLength": 4,
                     "maxLength": 6})
    oracle.assert_judges(valid=["12.3", "123.45"], invalid=["1.2", "1234.567", "1.2345a"])
    assert oracle.assert_sound() >= 20
    oracle = Oracle({"type": "string", "format": "date", "maxLength": 10})
    oracle.assert_judges(valid=["2020-01-31"], invalid=["2020-13-01"])


def test_ipv6_full_form_and_wide_integer_bounds():
    oracle = Oracle({"type": "string", "format": "ipv6"})
    oracle.assert_judges(valid=["1:2:3:4:5:6:7:ff"], invalid=["1:2:3", "g::1"])
    assert oracle.assert_sound() >= 10
    out = check_schema({"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1})
    assert out["minimum"] == -2**53 and out["maximum"] == 2**53
    with pytest.raises(ConstraintError):
        check_schema({"type": "integer", "minimum": 2**60})


def test_decimal_multiple_of_becomes_integer_multiples():
    oracle = Oracle({"type": "number", "multipleOf": 1.5, "minimum": -10, "maximum": 100})
    oracle.assert_judges(valid=[3, 0, -6, 99], invalid=[4, 102, -12])
    assert not oracle.admits_value(4.5)  # fractions are not generated: stricter
    assert oracle.assert_sound() >= 20
    out = check_schema({"type": "number", "multipleOf": 0.01})
    assert out["type"] == "integer" and "multipleOf" not in out
    with pytest.raises(ConstraintError, match="multipleOf"):  # xgrammar ignores the pair
        check_schema({"type": "integer", "multipleOf": 5, "minimum": 0})


def test_long_bounds_beside_a_class_that_admits_a_backslash():
    """A long count is compiled as a character budget, which wrote `[^,"]`'s backslash raw
    (`"a\\ b"`, invalid JSON; Github_medium/o37613 in a random walk): such classes lose it."""
    oracle = Oracle({"type": "string", "pattern": '^[^,"]+$', "maxLength": 255})
    assert not oracle.admits('"a\\ b"') and oracle.admits('"ab"')
    assert oracle.assert_sound(walks=30) >= 20


def test_pointer_and_regex_formats():
    oracle = Oracle({"type": "string", "format": "json-pointer"})
    oracle.assert_judges(valid=["", "/a/b~1c", "/~0"], invalid=["a", "/~2"])
    assert oracle.assert_sound() >= 20
    oracle = Oracle({"type": "string", "format": "relative-json-pointer"})
    oracle.assert_judges(valid=["0", "1#", "12/a"], invalid=["01", "/a", "a"])
    assert oracle.assert_sound() >= 20
    oracle = Oracle({"type": "string", "format": "regex"})  # literal text only: a subset
    oracle.assert_judges(valid=["^ab.c$"], invalid=["(a", "a**"])
    assert oracle.assert_sound() >= 20
