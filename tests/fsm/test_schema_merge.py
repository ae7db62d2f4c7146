from __future__ import annotations

import pytest
from grammar_oracle import Oracle

from guided.errors import ConstraintError
from guided.fsm.schema_check import check_schema


def test_one_of_with_required_keys_the_other_branch_cannot_have():
    oracle = Oracle({"oneOf": [
        {"type": "object", "properties": {"key": {"type": "string"}, "secret": {}},
         "required": ["key", "secret"]},
        {"type": "object", "properties": {"role": {"type": "string"}}, "required": ["role"]},
        {"type": "null"}]})
    oracle.assert_judges(valid=[{"key": "a", "secret": 1}, {"role": "r"}, None],
                         invalid=[{"key": "a"}, 3])
    # valid (its extra key matches no other branch) but not generated: objects are closed
    assert not oracle.admits_value({"role": "r", "key": "a"})
    assert oracle.assert_sound(walks=60) >= 30


def test_one_of_made_exclusive_by_a_discriminating_property():
    schema = {"type": "object", "properties": {"shape": {"type": "string"}, "side": {},
                                               "radius": {}},
              "oneOf": [{"properties": {"shape": {"enum": ["square"]}, "side": {}}},
                        {"properties": {"shape": {"const": "circle"}, "radius": {}}}]}
    oracle = Oracle(schema)
    oracle.assert_judges(valid=[{"shape": "square", "side": 2}, {"shape": "circle"}],
                         invalid=[{"shape": "triangle"}])
    assert not oracle.admits_value({})  # matches both branches: invalid, never generated
    assert oracle.assert_sound(walks=60) >= 30


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "integer"}, {"minimum": 3}]},
    # 1 and 1.0 are one value to JSON Schema
    {"type": "object", "oneOf": [{"properties": {"n": {"const": 1}}, "required": ["n"]},
                                 {"properties": {"n": {"const": 1.0}}, "required": ["n"]}]},
    # open objects: each branch's output may carry the other's key
    {"oneOf": [{"type": "object", "required": ["a"], "additionalProperties": True},
               {"type": "object", "required": ["b"]}]},
])
def test_one_of_refused_where_branches_may_overlap(schema):
    with pytest.raises(ConstraintError, match="oneOf"):
        check_schema(schema)


def test_all_of_merges_enums_multiples_tuples_and_closed_objects():
    oracle = Oracle({"allOf": [{"enum": ["a", "b", 1]}, {"enum": ["b", 1.0, "c"]}]})
    oracle.assert_judges(valid=["b", 1], invalid=["a", "c"])
    oracle = Oracle({"allOf": [{"type": "integer", "multipleOf": 4}, {"multipleOf": 6}]})
    oracle.assert_judges(valid=[12, 24], invalid=[8, 18])
    oracle = Oracle({"type": "array", "allOf": [
        {"prefixItems": [{"type": "integer"}, {"type": "string"}]},
        {"prefixItems": [{"minimum": 3}, {"maxLength": 2}]}]})
    oracle.assert_judges(valid=[[3, "ab"], [4]], invalid=[[2, "a"], [3, "abc"]])
    oracle.assert_sound()
    oracle = Oracle({"allOf": [
        {"type": "object", "properties": {"a": {}, "b": {}}, "additionalProperties": False},
        {"properties": {"a": {"type": "integer"}}, "required": ["a"],
         "additionalProperties": True}]})
    oracle.assert_judges(valid=[{"a": 1}, {"a": 1, "b": None}], invalid=[{"a": "x"}, {}])
    with pytest.raises(ConstraintError, match="allOf"):  # two patterns: no intersection
        check_schema({"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]})


def test_one_of_whose_branches_both_admit_null_leaves_null_out():
    """null satisfies both branches (properties say nothing of non-objects), so no branch
    alone: Github_medium/o81746's random walk once wrote null for such a oneOf. Each branch
    is served with the other negated, which only objects can be."""
    oracle = Oracle({"type": ["object", "null"], "required": ["type"],
                     "oneOf": [{"properties": {"type": {"enum": ["link"]}}},
                               {"properties": {"type": {"enum": ["name"]}}}]})
    oracle.assert_judges(valid=[{"type": "link"}, {"type": "name"}],
                         invalid=[None, {"type": "x"}])
    assert oracle.assert_sound() >= 20
