"""The passes before a schema is checked: draft 4-7 spellings read as their 2020-12 equivalents
(upgrade: only spellings 2020-12 gives no other meaning to), and every $ref the document can
resolve itself ($id bases, $anchor, draft 4's `id`) made a local JSON pointer (localize_refs);
a reference to a document not embedded stays, for the checker to refuse.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urldefrag, urljoin

from guided.fsm.schema_merge import escape, refuse

_ROOT_URI = "urn:guided:root"
_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas",
                "dependencies")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMAS = ("additionalProperties", "additionalItems", "items", "not", "if", "then", "else",
            "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
MAX_DEPTH = 200


def _map_children(node: dict, fn: Callable[[Any, str], Any]) -> dict:
    """A copy of node with each subschema replaced by fn(subschema, its relative pointer)."""
    out = dict(node)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: fn(v, f"{key}/{escape(k)}") for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [fn(v, f"{key}/{i}") for i, v in enumerate(out[key])]
    for key in _SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = fn(out[key], key)
    return out


def upgrade(schema: Any, depth: int = 0) -> Any:
    """A copy of schema with the old spellings replaced (past MAX_DEPTH left for the checker)."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return schema
    node = _map_children(schema, lambda child, _: upgrade(child, depth + 1))
    if isinstance(node.get("items"), list) and "prefixItems" not in node:
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    if isinstance(node.get("dependencies"), dict):
        for name, value in node.pop("dependencies").items():
            key = "dependentRequired" if isinstance(value, list) else "dependentSchemas"
            node.setdefault(key, {})
            if isinstance(node[key], dict) and name not in node[key]:
                node[key][name] = value
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(node.get(exclusive), bool) and node.pop(exclusive) and bound in node:
            node[exclusive] = node.pop(bound)
    return node


def localize_refs(schema: Any) -> Any:
    """A copy of schema with its resolvable references local and its identifiers dropped;
    ConstraintError for a $ref whose target depends on the draft."""
    text = str(schema)
    if not isinstance(schema, dict) or not ("'$id'" in text or "'$anchor'" in text
                                            or "'id': '" in text):
        return schema
    index = _Index("id" if "draft-04" in str(schema.get("$schema", "")) else "$id")
    index.scan(schema, _ROOT_URI, "", 0)
    return index.rewrite(schema, _ROOT_URI, "", 0)


class _Index:
    def __init__(self, id_key: str):
        self.id_key = id_key
        self.resources: dict[str, str] = {}  # absolute URI (no fragment) -> JSON pointer
        self.anchors: dict[str, str] = {}  # absolute URI#anchor -> JSON pointer

    def _base(self, node: dict, base: str) -> str:
        ident = node.get(self.id_key)
        if isinstance(ident, str) and not ident.startswith("#"):
            return urldefrag(_join(base, ident))[0]
        return base

    def scan(self, node: Any, base: str, pointer: str, depth: int) -> Any:
        if not isinstance(node, dict) or depth > MAX_DEPTH:
            return node
        base = self._base(node, base)
        self.resources.setdefault(base, pointer)
        ident = node.get(self.id_key)
        if isinstance(ident, str) and "#" in ident and urldefrag(ident)[1]:
            self.anchors.setdefault(f"{base}#{urldefrag(ident)[1]}", pointer)
        if isinstance(node.get("$anchor"), str):
            self.anchors.setdefault(f"{base}#{node['$anchor']}", pointer)
        _map_children(node, lambda child, at: self.scan(child, base, f"{pointer}/{at}",
                                                        depth + 1))
        return node

    def rewrite(self, node: Any, outer: str, pointer: str, depth: int) -> Any:
        if not isinstance(node, dict) or depth > MAX_DEPTH:
            return node
        base = self._base(node, outer)
        out = {k: v for k, v in node.items()
               if not (k in (self.id_key, "$anchor") and isinstance(v, str))}
        if isinstance(out.get("$ref"), str):
            out["$ref"] = self._local(out["$ref"], base)
            if out["$ref"] != self._local(node["$ref"], outer):
                # draft 7 resolves a $ref against the outer base (a sibling $id is ignored),
                # 2020-12 against the $id: where the two disagree, neither is safe
                raise refuse("$ref", pointer, "beside an $id, drafts disagree on what it "
                                              "refers to")
        return _map_children(out, lambda child, at: self.rewrite(child, base, f"{pointer}/{at}",
                                                                 depth + 1))

    def _local(self, ref: str, base: str) -> str:
        target, fragment = urldefrag(_join(base, ref))
        if target not in self.resources:
            return ref
        if fragment.startswith("/") or not fragment:
            return "#" + self.resources[target] + fragment
        found = self.anchors.get(f"{target}#{fragment}")
        return "#" + found if found is not None else ref


def _join(base: str, ref: str) -> str:
    """ref resolved against base (urljoin drops a urn: base before a bare fragment)."""
    if ref.startswith("#"):
        return base + ref
    return urljoin(base, ref)
