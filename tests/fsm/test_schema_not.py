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
