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


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {}, "b": {"type": "integer"}}, "required": ["a", "b"]},
    {"type": "array", "items": True, "maxItems": 2},
    {"type": "object", "properties": {"a": {"type": "object"}}},
    {"type": "object", "properties": {"a": {"type": "array"}}},
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
])
def test_any_values_stay_on_xgrammar(schema):
    """outlines-core writes an any-value only 3 levels deep, xgrammar without a limit: the same
    request's output would depend on the backend that served it."""
    with pytest.raises(NotRegular, match="any"):
        schema_regex(check_schema(schema))


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
    ({"type": "array", "items": {"type": "string"}, "required": ["standalone"]}, '["a"]',
     '{"standalone": 1}'),
    ({"type": "string", "minItems": 2, "properties": {"a": {"type": "integer"}}}, '"x"', '{"a": 1}'),
    ({"type": ["integer", "null"], "maximum": 9, "items": {"type": "string"}}, "9", "10"),
])
def test_keywords_of_types_the_type_excludes_are_dropped(schema, good, bad):
    """Seen in serving (JSONSchemaBench): `"type": "array"` beside object keywords came out of
    outlines-core as an object, which the type refuses."""
    import re

    regex = schema_regex(check_schema(schema))
    assert re.fullmatch(regex, good) and not re.fullmatch(regex, bad)


LANGUAGE_SCHEMAS = [
    {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "number"},
                                      "i": {"type": "integer"}, "b": {"type": "boolean"}},
     "required": ["s", "n", "i", "b"]},
    {"type": "array", "items": {"type": "object", "properties": {
        "tag": {"enum": ["a", "b"]}, "v": {"type": ["number", "null"]}}, "required": ["tag"]},
     "maxItems": 3},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": -5, "maximum": 300},
                                      "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]+$"}},
     "required": ["age"]},
]
_BASE = {"s": '"plain"', "n": "1.5", "i": "7", "b": "true"}
_VARIANTS = {"s": ['"\\u00e9t\\u00E9"', '"tab\\tnew\\nline \\/ \\" \\\\"', '"c1 \x85 del \x7f"',
                   '"raw \x01"', '"\\u12"', '"\\x41"'],
             "n": ["1e5", "-0.0e+3", "2E-2", "01", "1.e5", "-0", ".5"],
             "i": ["-0", "-12", "0", "01", "1.0"]}
PROBES = [  # each differs from a valid text in one place, so a disagreement has one cause
    "{" + ", ".join(f'"{k}": {variant if k == slot else v}' for k, v in _BASE.items()) + "}"
    for slot, variants in _VARIANTS.items() for variant in variants
] + ['{"s": "plain", "n": 1.5, "i": 7, "b": true}', '{"s":"compact","n":1,"i":1,"b":true}',
     '[{"tag": "a", "v": 1e9}, {"tag": "b"}, {"tag": "a", "v": null}]',
     '[{"tag": "a", "v": -0}, {"tag": "b", "v": 3E+2}]', '[{"tag":"a"}]', "[]", '[{"tag": "c"}]',
     '{"age": -5, "code": "AB12"}', '{"age": -0}', '{"age": 300}', '{"age": 301}', '{"age": -6}',
     '{"age": 0, "code": "ab1"}', '{"age": 007}']


@pytest.mark.parametrize("schema", LANGUAGE_SCHEMAS)
def test_the_dfa_regex_admits_what_xgrammar_admits(schema):
    """One language per constraint: the DFA path's regex and xgrammar's grammar (compact
    separators) accept exactly the same texts: numbers (e5, -0), strings (\\u escapes,
    U+007F-U+009F raw), bounded integers, separators."""
    import json
    import re

    xgr = pytest.importorskip("xgrammar")
    checked = check_schema(schema)
    regex = schema_regex(checked)
    grammar = xgr.Grammar.from_json_schema(json.dumps(checked), strict_mode=True,
                                           any_whitespace=False)
    accepts = xgr.testing._is_grammar_accept_string
    agreed = 0
    for text in PROBES:
        dfa = re.fullmatch(regex, text) is not None
        assert dfa == accepts(grammar, text), (text, dfa)
        agreed += dfa
    assert agreed >= 2  # the probes reach each schema's language
