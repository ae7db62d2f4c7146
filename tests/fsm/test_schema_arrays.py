from __future__ import annotations

import pytest
from grammar_oracle import Oracle

from guided.errors import ConstraintError
from guided.fsm.schema_check import check_schema


def test_unique_items_over_few_values_are_listed():
    oracle = Oracle({"type": "array", "items": {"enum": ["a", "b", "c", 1, 1.0]},
                     "uniqueItems": True, "minItems": 1})
    oracle.assert_judges(valid=[["a"], ["c", "a", 1], ["b", "a"]],
                         invalid=[[], ["a", "a"], [1, 1.0], ["d"]])
    assert oracle.assert_sound() >= 20
    oracle = Oracle({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True})
    oracle.assert_judges(valid=[[], [True, False]], invalid=[[True, True]])


def test_unique_items_refused_where_values_are_many():
    with pytest.raises(ConstraintError, match="uniqueItems"):
        check_schema({"type": "array", "items": {"type": "string"}, "uniqueItems": True})
    with pytest.raises(ConstraintError, match="uniqueItems"):
        check_schema({"type": "array", "items": {"enum": list(range(10))}, "uniqueItems": True})


def test_contains_requires_its_first_items_to_match():
    oracle = Oracle({"type": "array", "items": {"type": ["integer", "string"]},
                     "contains": {"type": "integer"}, "minContains": 2, "maxItems": 4})
    oracle.assert_judges(valid=[[1, 2], [1, 2, "a"]], invalid=[[1], ["a", "b", 3], [1, 2, None]])
    assert not oracle.admits_value(["a", 1, 2])  # matches elsewhere: not generated (stricter)
    assert oracle.assert_sound() >= 20
    oracle = Oracle({"type": "array", "contains": True, "maxContains": 2})
    oracle.assert_judges(valid=[[1], [1, "x"]], invalid=[[], [1, 2, 3]])
    with pytest.raises(ConstraintError, match="maxContains"):
        check_schema({"type": "array", "contains": {"type": "integer"}, "maxContains": 1})
