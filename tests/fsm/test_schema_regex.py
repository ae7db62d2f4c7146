"""Which checked schemas have an exact regex (the token-level DFA's input), and how it reads."""
from __future__ import annotations

import pytest

from guided.fsm.schema_check import check_schema
from guided.fsm.schema_regex import NotRegular, schema_regex


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "number", "minimum": 3}, "minimum"),
    ({"type": "integer", "multipleOf": 2}, "multipleOf"),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "prefixItems"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1},
     "minProperties"),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, "additionalProperties"),
])
def test_schemas_it_cannot_serve_exactly_are_refused_with_the_reason(schema, keyword):
    with pytest.raises(NotRegular, match=keyword):
        schema_regex(check_schema(schema))


def test_the_regex_writes_xgrammars_compact_separators():
    regex = schema_regex(check_schema({"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "boolean"}}},
        "required": ["a", "b"]}))
    assert '"a": ' in regex and ', "b": ' in regex and "{WS}" not in regex


def test_an_any_value_property_is_a_grouped_alternation():
    """outlines-core wrote `{}` as a bare alternation, which bound past its property."""
    import re

    regex = schema_regex({"type": "object", "properties": {"a": {}, "b": {"type": "integer"}},
                          "required": ["a", "b"]})
    assert re.fullmatch(regex, '{"a": [1, "x"], "b": 2}')
    assert re.fullmatch(regex, '{"a": null, "b": 2}')
    assert not re.fullmatch(regex, "null") and not re.fullmatch(regex, '{"a": 1}')


def test_a_ref_is_checked_where_it_points():
    schema = {"somewhere": {"x": {"type": "integer", "minimum": 1}},
              "type": "object", "properties": {"a": {"$ref": "#/somewhere/x"}}}
    with pytest.raises(NotRegular, match="minimum"):
        schema_regex(schema)
    with pytest.raises(NotRegular, match="resolve"):
        schema_regex({"properties": {"a": {"$ref": "#/nowhere"}}})


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}},
               "b": {"type": "array", "items": {"$ref": "#/$defs/a"}}}, "$ref": "#/$defs/a"},
])
def test_recursive_refs_stay_on_xgrammar(schema):
    """outlines-core cuts recursion at a fixed depth with `{}`, which a required recursive
    property does not admit (the regex would accept what the schema refuses)."""
    with pytest.raises(NotRegular, match="recursive"):
        schema_regex(schema)


def test_a_ref_used_twice_is_no_recursion():
    import re
    schema = {"$defs": {"x": {"type": "integer"}}, "type": "object",
              "properties": {"p": {"$ref": "#/$defs/x"}, "q": {"$ref": "#/$defs/x"}},
              "required": ["p", "q"]}
    assert re.fullmatch(schema_regex(schema), '{"p": 1, "q": 2}')


def test_items_true_admits_any_item():
    import re

    regex = schema_regex({"type": "array", "items": True, "maxItems": 2})
    assert re.fullmatch(regex, '[1, {"a": "b"}]') and re.fullmatch(regex, "[]")
    assert not re.fullmatch(regex, "[1, 2, 3]")


def test_bounded_integers_are_written_as_ranges():
    import re

    regex = schema_regex(check_schema({"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "delta": {"type": "integer", "exclusiveMinimum": -5.5, "exclusiveMaximum": 3},
        "big": {"type": "integer", "minimum": 1000}},
        "required": ["age", "delta", "big"]}))
    assert "GUIDEDINTEGERRANGE" not in regex
    for age, delta, big, ok in [(0, -5, 1000, True), (120, 2, 10**9, True), (121, 0, 1000, False),
                                (5, -6, 1000, False), (5, 3, 1000, False), (5, 0, 999, False)]:
        text = f'{{"age": {age}, "delta": {delta}, "big": {big}}}'
        assert bool(re.fullmatch(regex, text)) == ok, text
    with pytest.raises(NotRegular, match="no value"):
        schema_regex({"type": "integer", "minimum": 3, "maximum": 2})


@pytest.mark.parametrize("pattern, good, bad", [
    ("ab|cd", ["ab", "cd"], ["abcd", "ab|cd"]),
    ("^[0-9]+$", ["42"], ["4a"]),
    (r"a\$", ["a$"], ["a"]),
])
def test_patterns_are_grouped_whole_string_matches(pattern, good, bad):
    """outlines-core wrote a pattern between the quotes as it was: a top-level `|` split them."""
    import json
    import re

    regex = schema_regex({"type": "object", "properties": {"x": {"type": "string",
                          "pattern": pattern}}, "required": ["x"]})
    for value, ok in [(v, True) for v in good] + [(v, False) for v in bad]:
        text = json.dumps({"x": value})
        assert bool(re.fullmatch(regex, text)) == ok, (pattern, text)


@pytest.mark.parametrize("pattern", ["(^a$)", "^a$|^b$", "a^b"])
def test_anchors_inside_a_pattern_stay_on_xgrammar(pattern):
    with pytest.raises(NotRegular, match="anchor"):
        schema_regex({"type": "string", "pattern": pattern})


@pytest.mark.parametrize("child", [{"minimum": 3}, {"minLength": 2}, {"not": {"type": "null"}},
                                   {"allOf": [{"type": "string"}]}])
def test_a_subschema_of_assertions_without_a_type_is_no_any_value(child):
    """Only annotations make an any-value subschema: assertions stay for the check to see."""
    with pytest.raises(NotRegular):
        schema_regex({"type": "object", "properties": {"a": child}, "required": ["a"]})


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "array", "items": {"type": "integer"}, "properties": {},
      "additionalProperties": False}, "[1, 2]", "{}"),
    ({"type": "array", "required": ["standalone"]}, '["a"]', '{"standalone": 1}'),
    ({"type": "string", "minItems": 2, "properties": {"a": {"type": "integer"}}}, '"x"', '{"a": 1}'),
    ({"type": ["integer", "null"], "maximum": 9, "items": {"type": "string"}}, "9", "10"),
])
def test_keywords_of_types_the_type_excludes_are_dropped(schema, good, bad):
    """Seen in serving (JSONSchemaBench): `"type": "array"` beside object keywords came out of
    outlines-core as an object, which the type refuses."""
    import re

    regex = schema_regex(check_schema(schema))
    assert re.fullmatch(regex, good) and not re.fullmatch(regex, bad)
