from __future__ import annotations

import pytest

from guided.errors import ConstraintError
from guided.fsm.schema_check import check_schema
from guided.fsm.schema_formats import FORMAT_PATTERNS, fix_optional_groups


@pytest.mark.parametrize("schema, keyword, pointer", [
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     "uniqueItems", "/properties/tags"),
    ({"not": {"type": "string", "minLength": 3}}, "not", "/"),
    ({"properties": {"a": {"if": {"minimum": 1}, "then": {"type": "integer"}}}}, "if",
     "/properties/a"),
    ({"type": "object", "dependentRequired": {k: ["z"] for k in "abcde"}},
     "dependentRequired", "/"),
    ({"type": "string", "pattern": "^(a|bc)+$", "maxLength": 3}, "maxLength", "/"),
    # jsonschema's floating-point division says 7 is no multiple of 0.7
    ({"type": "number", "multipleOf": 0.7}, "multipleOf", "/"),
    ({"type": "object", "patternProperties": {"^x": {}, "y": {"type": "integer"}, "^xy": {}}},
     "patternProperties", "/"),
    ({"type": "array", "contains": {"type": "integer"}, "prefixItems": [{}]}, "contains", "/"),
    ({"$ref": "http://example.com/schema"}, "$ref", "/"),
    ({"$ref": "#/$defs/missing"}, "$ref", "/"),
    ({"type": "string", "format": "idn-email"}, "format", "/"),
    ({"type": "string", "pattern": "^(?=a)."}, "pattern", "/"),
    ({"type": "string", "pattern": "^\\D+$"}, "pattern", "/"),
    ({"type": "string", "format": "uri", "minLength": 1}, "minLength", "/"),
    ({"type": "string", "contentMediaType": "application/json"}, "contentMediaType", "/"),
    ({"allOf": [{"prefixItems": [{"minimum": 3}]}], "items": {"minimum": 5}}, "allOf", "/"),
    ({"items": {"$defs": {}, "oneOf": [{"type": "integer"}, {"minimum": 3}]}}, "oneOf", "/items"),
])
def test_refusals_name_keyword_and_pointer(schema, keyword, pointer):
    with pytest.raises(ConstraintError) as info:
        check_schema(schema)
    message = str(info.value)
    assert f"'{keyword}'" in message and f"at {pointer}:" in message, message


def test_annotations_pass_and_are_dropped():
    out = check_schema({"title": "T", "description": "d", "type": "object", "examples": [{}],
                        "properties": {"a": {"type": "string", "default": "x",
                                             "deprecated": True}}})
    assert out == {"type": "object", "properties": {"a": {"type": "string"}}}


def test_rewrites():
    # uniqueItems over a single value: the arrays of at most one item
    out = check_schema({"type": "array", "items": {"const": 1}, "uniqueItems": True})
    assert out == {"enum": [[], [1]]}
    # enum filtered by its siblings
    assert check_schema({"type": "string", "enum": ["a", "bb", 3], "maxLength": 1}) == {
        "const": "a"}
    # allOf merged
    out = check_schema({"allOf": [{"type": "integer"}, {"minimum": 5}]})
    assert out == {"type": "integer", "minimum": 5}
    # untyped keywords get their type (xgrammar ignores them otherwise)
    assert check_schema({"minimum": 5})["type"] == "number"
    # required keys missing from properties become properties
    out = check_schema({"type": "object", "required": ["a"]})
    assert "a" in out["properties"]
    # sibling keywords move into anyOf branches
    out = check_schema({"type": "string", "anyOf": [{"maxLength": 2}, {"minLength": 5}]})
    assert all(b["type"] == "string" for b in out["anyOf"])
    # disjoint oneOf is accepted as anyOf
    out = check_schema({"oneOf": [{"type": "integer"}, {"type": "string"}]})
    assert "anyOf" in out
    # formats jsonschema checks become exact patterns
    assert check_schema({"type": "string", "format": "date"})["pattern"] == FORMAT_PATTERNS[
        "date"]


def test_format_patterns_match_jsonschema():
    import re

    from jsonschema import Draft202012Validator

    checker = Draft202012Validator.FORMAT_CHECKER
    samples = {
        "date": ["2020-02-29", "2021-02-29", "2000-02-29", "1900-02-29", "0000-01-01",
                 "2020-04-31", "2020-12-31", "2020-13-01", "٢٠٢٠-01-01"],
        "time": ["23:59:59Z", "24:00:00Z", "12:00:00+01:00", "12:00:00", "12:00:00.5Z"],
        "date-time": ["2020-01-01T00:00:00Z", "2021-02-29T00:00:00Z", "2020-01-01 00:00:00Z"],
        "ipv4": ["1.2.3.4", "01.2.3.4", "256.1.1.1", "255.255.255.255"],
        "uuid": ["123e4567-e89b-12d3-a456-426614174000", "123e4567e89b12d3a456426614174000"],
        "email": ["a@b.co", "nope", "a@b", ".a@b.co", "a..b@c.de"],
        "hostname": ["example.com", "xn--hello-txk", "a--b", "-a.com"],
    }
    for fmt, values in samples.items():
        for value in values:
            if re.search(FORMAT_PATTERNS[fmt], value):
                assert checker.conforms(value, fmt), (fmt, value)


def test_invalid_schema_is_refused():
    with pytest.raises(ConstraintError, match="invalid JSON schema"):
        check_schema({"type": "nonsense"})
    with pytest.raises(ConstraintError):
        check_schema(False)


def test_fix_optional_groups():
    assert fix_optional_groups(r"x(ab+)?[)?]\)?(c)??") == r"x(ab+){0,1}[)?]\)?(c){0,1}?"
    assert check_schema({"type": "string", "pattern": "^a(bc+)?$"})["pattern"] == \
        "^a(bc+){0,1}$"


def test_refs_are_not_given_type_defaults():
    out = check_schema({"$defs": {"a": {"type": "integer"}},
                        "properties": {"x": {"$ref": "#/$defs/a"}}, "type": "object"})
    assert out["properties"]["x"] == {"$ref": "#/$defs/a"}


def test_hostname_pattern_excludes_a_labels_and_long_labels():
    import re

    pattern = FORMAT_PATTERNS["hostname"]
    assert re.search(pattern, "api.example.com")
    for bad in ("xn--hello-txk", "a" * 64 + ".com", "-a.com", "a..b"):
        assert not re.search(pattern, bad), bad


def test_unsatisfiable_optional_property_is_dropped_required_is_refused():
    never = {"type": "array", "enum": ["x"]}
    out = check_schema({"type": "object", "properties": {"a": never, "b": {"type": "string"}}})
    assert out["properties"] == {"b": {"type": "string"}}
    with pytest.raises(ConstraintError, match="/properties/a"):
        check_schema({"type": "object", "properties": {"a": never}, "required": ["a"]})


def test_refs_outside_the_definitions_are_inlined_and_rewritten():
    """A $ref into a custom container (JSONSchemaBench's Azure schemas keep definitions under
    "resourceDefinitions") must be enforced like any subschema: its required name that is not
    among its properties was dropped by xgrammar, and the output then failed validation."""
    schema = {"resourceDefinitions": {"gw": {"type": "object",
                                             "properties": {"name": {"type": "string"}},
                                             "required": ["location", "name"]}},
              "type": "object", "properties": {"gw": {"$ref": "#/resourceDefinitions/gw"}},
              "required": ["gw"]}
    out = check_schema(schema)
    gw = out["properties"]["gw"]
    assert "$ref" not in gw and set(gw["properties"]) == {"name", "location"}
    assert check_schema({"$defs": {"a": {"type": "string"}}, "properties": {
        "x": {"$ref": "#/$defs/a"}}})["properties"]["x"] == {"$ref": "#/$defs/a"}  # kept
