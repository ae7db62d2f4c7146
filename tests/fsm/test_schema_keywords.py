from __future__ import annotations

import pytest
from grammar_oracle import Oracle

from guided.errors import ConstraintError
from guided.fsm.schema_check import check_schema


def test_not_of_types_and_booleans():
    oracle = Oracle({"not": {"type": ["string", "object"]}})
    oracle.assert_judges(valid=[1, None, [1], True], invalid=["a", {}])
    oracle.assert_sound()
    oracle = Oracle({"type": ["integer", "string"], "minLength": 2, "not": {"type": "integer"}})
    oracle.assert_judges(valid=["ab"], invalid=[3, "a"])
    oracle = Oracle({"type": "boolean", "not": {"const": True}})
    oracle.assert_judges(valid=[False], invalid=[True])
    oracle = Oracle({"not": {"anyOf": [{"type": "null"}, {"type": "number"}]}})
    oracle.assert_judges(valid=["x", False], invalid=[None, 1.5, 2])


def test_not_of_required_names():
    oracle = Oracle({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"],
                     "not": {"required": ["a", "b"]}})
    oracle.assert_judges(valid=[{"a": 1}], invalid=[{"a": 1, "b": 2}, {}])
    assert oracle.assert_sound() >= 20


@pytest.mark.parametrize("schema", [
    {"not": {"type": "string", "minLength": 3}},
    {"type": "string", "not": {"enum": ["a"]}},
    {"type": "object", "required": ["a"], "not": {"required": ["a"]}},
])
def test_not_refused_or_unsatisfiable(schema):
    with pytest.raises(ConstraintError, match="not"):
        check_schema(schema)


def test_not_of_properties_is_a_union():
    """Objects where a property fails its schema (non-objects too where the not names the
    object type); a property of a list of values filtered against the not."""
    oracle = Oracle({"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]}},
                     "required": ["kind"], "not": {"properties": {"kind": {"const": "a"}}}})
    oracle.assert_judges(valid=[{"kind": "b"}, {"kind": "c"}], invalid=[{"kind": "a"}])
    assert oracle.assert_sound() >= 20
    oracle = Oracle({"not": {"type": "object", "properties": {"x": {"type": "string"}},
                             "required": ["x"]}})
    oracle.assert_judges(valid=[1, {"x": 2}, {}], invalid=[{"x": "s"}])
    assert oracle.assert_sound() >= 20


def test_if_then_else_as_a_union():
    """JME_37 of JSONSchemaBench: if a boolean is true, then one length, else another."""
    oracle = Oracle({
        "type": "object", "required": ["isMember"],
        "properties": {"isMember": {"type": "boolean"}, "number": {"type": "string"}},
        "if": {"properties": {"isMember": {"const": True}}},
        "then": {"properties": {"number": {"minLength": 3, "maxLength": 3}}},
        "else": {"properties": {"number": {"minLength": 5}}}})
    oracle.assert_judges(valid=[{"isMember": True, "number": "abc"},
                                {"isMember": False, "number": "abcde"}],
                         invalid=[{"isMember": True, "number": "abcde"},
                                  {"isMember": False, "number": "abc"}])
    assert oracle.assert_sound() >= 20
    oracle = Oracle({"if": {"type": "integer"}, "then": {"minimum": 3},
                     "else": {"type": "string"}})
    oracle.assert_judges(valid=[3, "x"], invalid=[2, None, 1.5])
    with pytest.raises(ConstraintError, match="'if'"):  # not minimum: no positive form
        check_schema({"if": {"minimum": 3}, "then": {"type": "integer"}})


def test_one_of_with_overlapping_branches_negates_the_others():
    """Glaiveai2K's calculate_area: exactly one of the shapes' required keys."""
    oracle = Oracle({"type": "object", "properties": {"radius": {"type": "number"},
                                                      "side": {"type": "number"}},
                     "oneOf": [{"required": ["radius"]}, {"required": ["side"]}]})
    oracle.assert_judges(valid=[{"radius": 1}, {"side": 2}],
                         invalid=[{"radius": 1, "side": 2}, {}])
    assert oracle.assert_sound() >= 20


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
