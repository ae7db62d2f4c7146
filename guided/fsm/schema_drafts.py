"""Draft 4-7 spellings read as their 2020-12 equivalents before a schema is checked.

Each rewrite is of a spelling 2020-12 gives no other meaning to: `items` as a list (a tuple,
now prefixItems) with `additionalItems` (now items), `dependencies` (now dependentRequired
and dependentSchemas; 2020-12 ignores the old name, so enforcing it is only stricter there),
and draft 4's boolean exclusiveMinimum / exclusiveMaximum beside minimum / maximum.
"""
from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("additionalProperties", "additionalItems", "items", "not", "if", "then", "else",
            "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties")


def upgrade(schema: Any, depth: int = 0) -> Any:
    """A copy of schema with the old spellings replaced (deeper than 200: left as it is, the
    checker refuses it)."""
    if not isinstance(schema, dict) or depth > 200:
        return schema
    node = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {k: upgrade(v, depth + 1) for k, v in node[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [upgrade(v, depth + 1) for v in node[key]]
    for key in _SCHEMAS:
        if key in node:
            node[key] = upgrade(node[key], depth + 1)
    if isinstance(node.get("items"), list) and "prefixItems" not in node:
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    if isinstance(node.get("dependencies"), dict):
        for name, value in node.pop("dependencies").items():
            key = "dependentRequired" if isinstance(value, list) else "dependentSchemas"
            node.setdefault(key, {})
            if isinstance(node[key], dict) and name not in node[key]:
                node[key][name] = upgrade(value, depth + 1)
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(node.get(exclusive), bool):
            if node.pop(exclusive) and bound in node:
                node[exclusive] = node.pop(bound)
    return node
