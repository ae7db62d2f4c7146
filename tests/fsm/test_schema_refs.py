from __future__ import annotations

import pytest
from grammar_oracle import Oracle

from guided.errors import ConstraintError
from guided.fsm.schema_check import check_schema
from guided.fsm.schema_refs import localize_refs


def test_embedded_resources_and_anchors_become_pointers():
    schema = {"$id": "http://example.com/root.json",
              "$defs": {"a": {"$id": "int.json", "type": "integer"},
                        "b": {"$id": "urn:uuid:1234", "$defs": {"c": {"type": "string"}},
                              "properties": {"c": {"$ref": "#/$defs/c"}}, "type": "string"},
                        "d": {"$anchor": "named", "type": "boolean"},
                        "e": {"$id": "#old-anchor", "type": "null"}},
              "properties": {"i": {"$ref": "int.json"}, "s": {"$ref": "urn:uuid:1234"},
                             "t": {"$ref": "urn:uuid:1234#/$defs/c"},
                             "n": {"$ref": "#named"}, "o": {"$ref": "#old-anchor"},
                             "r": {"$ref": "http://example.com/root.json#/$defs/a"}}}
    out = localize_refs(schema)
    refs = {k: v["$ref"] for k, v in out["properties"].items()}
    assert refs == {"i": "#/$defs/a", "s": "#/$defs/b", "t": "#/$defs/b/$defs/c",
                    "n": "#/$defs/d", "o": "#/$defs/e", "r": "#/$defs/a"}
    # relative to its own resource
    assert out["$defs"]["b"]["properties"]["c"]["$ref"] == "#/$defs/b/$defs/c"
    assert "$id" not in str(out)
    # jsonschema reads 2020-12, where "$id": "#name" is no anchor: judged without it
    del schema["$defs"]["e"], schema["properties"]["o"]
    oracle = Oracle({**schema, "type": "object", "additionalProperties": False})
    oracle.assert_judges(valid=[{"i": 1, "s": "x", "n": True}],
                         invalid=[{"i": "x"}, {"s": 1}, {"t": 2}, {"n": 1}, {"r": ""}])
    oracle.assert_sound()


def test_draft4_ids_and_recursion():
    schema = {"$schema": "http://json-schema.org/draft-04/schema#",
              "id": "http://example.com/tree", "type": "object",
              "properties": {"value": {"type": "integer"},
                             "children": {"type": "array", "items": {"$ref": "#"},
                                          "maxItems": 2}},
              "required": ["value"], "definitions": {"x": {"id": "#x", "type": "string"}}}
    assert localize_refs(schema)["properties"]["children"]["items"] == {"$ref": "#"}
    oracle = Oracle(schema)
    oracle.assert_judges(valid=[{"value": 1, "children": [{"value": 2}]}],
                         invalid=[{"value": 1, "children": [{"value": "2"}]}])
    oracle.assert_sound()


def test_references_to_documents_not_embedded_are_refused():
    with pytest.raises(ConstraintError, match=r"\$ref"):
        check_schema({"$id": "http://example.com/a", "$ref": "other.json"})


def test_a_ref_beside_an_id_is_refused_drafts_disagree_on_its_base():
    with pytest.raises(ConstraintError, match=r"\$ref"):
        check_schema({"$id": "http://x.com/base/",
                      "definitions": {"a": {"$id": "http://x.com/foo.json", "type": "string"},
                                      "b": {"$id": "foo.json", "type": "number"}},
                      "allOf": [{"$id": "http://x.com/", "$ref": "foo.json"}]})
