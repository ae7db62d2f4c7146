from __future__ import annotations

import pytest
from grammar_oracle import Oracle

from guided.errors import ConstraintError
from guided.fsm.schema_check import check_schema


def test_pattern_properties_are_enforced():
    oracle = Oracle({"type": "object", "properties": {"name": {"type": "string"}},
                     "required": ["name"],
                     "patternProperties": {"^x-": {"type": "integer"}, "^y": {"type": "boolean"}},
                     "additionalProperties": {"type": "null"}})
    oracle.assert_judges(valid=[{"name": "a"}, {"name": "a", "x-": 1}, {"name": "b", "y": True}],
                         invalid=[{"name": "a", "x-": "s"}, {"name": "a", "y": 1}, {}])
    assert not oracle.admits_value({"name": "a", "other": None})  # additional keys: dropped
    assert oracle.assert_sound() >= 20


def test_pattern_properties_apply_to_declared_names():
    oracle = Oracle({"type": "object", "properties": {"xa": {"minimum": 3}},
                     "patternProperties": {"^x": {"type": "integer"}}})
    oracle.assert_judges(valid=[{"xa": 3}, {}], invalid=[{"xa": 3.5}, {"xa": 1}, {"xa": "s"}])
    oracle.assert_sound()


@pytest.mark.parametrize("schema", [
    # the pattern admits the declared name "a" with another schema
    {"type": "object", "properties": {"a": {"type": "string"}},
     "patternProperties": {"^[a-z]$": {"type": "integer"}}},
    # a key may match both patterns, whose schemas differ
    {"type": "object", "patternProperties": {"^a.*": {"type": "integer"}, "b": {"minimum": 5}}},
    # undeclared keys may repeat: two distinct keys are not sure
    {"type": "object", "patternProperties": {"^x": {}}, "minProperties": 2},
])
def test_pattern_properties_refused_where_not_exact(schema):
    with pytest.raises(ConstraintError):
        check_schema(schema)


def test_property_names():
    oracle = Oracle({"type": "object", "properties": {"a": {"type": "integer"},
                                                      "BAD": {"type": "string"}},
                     "propertyNames": {"pattern": "^[a-z]+$"},
                     "additionalProperties": {"type": "integer"}})
    oracle.assert_judges(valid=[{"a": 1}, {"b": 2}, {"a": 1, "bc": 3}],
                         invalid=[{"BAD": "s"}, {"B": 1}, {"b": "s"}])
    oracle.assert_sound()
    oracle = Oracle({"type": "object", "propertyNames": {"enum": ["a", "b", 3]}})
    oracle.assert_judges(valid=[{"a": 1}, {"b": [1]}], invalid=[{"c": 1}])
    oracle.assert_sound()
    oracle = Oracle({"type": "object", "propertyNames": {"maxLength": 2}})
    oracle.assert_judges(valid=[{"ab": 1}], invalid=[{"abc": 1}])
    oracle.assert_sound()
    with pytest.raises(ConstraintError, match="propertyNames"):
        check_schema({"type": "object", "properties": {"a": {"type": "string"}},
                      "required": ["a"], "propertyNames": {"pattern": "^b"}})


def test_dependent_required_and_schemas():
    oracle = Oracle({"type": "object", "properties": {"card": {"type": "string"},
                                                      "billing": {"type": "string"},
                                                      "n": {"type": "integer"}},
                     "dependentRequired": {"card": ["billing"]},
                     "dependentSchemas": {"n": {"properties": {"card": {"const": "x"}}}}})
    oracle.assert_judges(valid=[{}, {"billing": "b"}, {"card": "c", "billing": "b"},
                                {"card": "x", "billing": "b", "n": 1}, {"n": 1}],
                         invalid=[{"card": "c"}, {"n": 1, "card": "y", "billing": "b"}])
    assert oracle.assert_sound(walks=60) >= 30


def test_draft7_spellings_are_read_as_2020_12():
    # draft 7: a tuple with additionalItems, dependencies in both forms, a boolean bound
    oracle = Oracle({"type": "array", "items": [{"type": "integer"}, {"type": "string"}],
                     "additionalItems": False})
    assert oracle.admits_value([1, "a"]) and not oracle.admits_value([1, "a", 2])
    assert not oracle.admits_value(["a"])
    out = check_schema({"type": "object", "properties": {"a": {}, "b": {}},
                        "required": ["a"], "dependencies": {"a": ["b"]}})
    assert set(out["required"]) == {"a", "b"}
    out = check_schema({"type": "integer", "minimum": 3, "exclusiveMinimum": True})
    assert out["minimum"] == 4


def test_unevaluated_keywords_beside_no_applicator_close_the_node():
    oracle = Oracle({"type": "object", "properties": {"a": {"type": "integer"}},
                     "patternProperties": {"^x": {"type": "string"}},
                     "unevaluatedProperties": False})
    oracle.assert_judges(valid=[{"a": 1}, {"x": "s"}], invalid=[{"b": 1}, {"x": 1}])
    assert oracle.assert_sound() >= 20
    oracle = Oracle({"prefixItems": [{"type": "integer"}], "unevaluatedItems": {"type": "null"}})
    oracle.assert_judges(valid=[[1], [1, None]], invalid=[[1, 2]])
    # beside an applicator the siblings' properties count as evaluated: refused there
    with pytest.raises(ConstraintError, match="unevaluatedProperties"):
        check_schema({"allOf": [{"properties": {"a": {}}, "unevaluatedProperties": False}],
                      "properties": {"b": {}}})


def test_dependencies_of_an_undeclared_trigger_on_an_open_object():
    """Without the trigger the object is closed (it cannot come as an undeclared key)."""
    oracle = Oracle({"type": "object", "additionalProperties": {"type": "string"},
                     "dependentRequired": {"a": ["b"]}})
    oracle.assert_judges(valid=[{}, {"a": "x", "b": "y"}], invalid=[{"a": "x"}, {"a": 1, "b": "y"}])
    assert oracle.assert_sound() >= 20
