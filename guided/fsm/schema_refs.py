"""References made local before a schema is checked: every $ref the document itself can resolve
(through $id base URIs, embedded resources, $anchor and draft-6/7 `"$id": "#name"` anchors,
draft 4's `id`) is rewritten as a JSON pointer into the document, and the identifiers are
dropped. A reference to a document that is not embedded stays as it is: the checker refuses it.

    {"$id": "http://x.com/root", "$defs": {"a": {"$id": "int.json", "type": "integer"}},
     "$ref": "int.json"}          ->  ... "$ref": "#/$defs/a"
"""
from __future__ import annotations

from typing import Any
from urllib.parse import urldefrag, urljoin

from guided.fsm.schema_merge import refuse

_ROOT_URI = "urn:guided:root"
_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas",
                "dependencies")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMAS = ("additionalProperties", "additionalItems", "items", "not", "if", "then", "else",
            "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
MAX_DEPTH = 200


def localize_refs(schema: Any) -> Any:
    """A copy of schema with its resolvable references local and its identifiers dropped (the
    schema itself where it declares none). Raises ConstraintError for a $ref whose target
    depends on the draft."""
    if not isinstance(schema, dict) or not _declares_ids(schema):
        return schema
    id_key = "id" if "draft-04" in str(schema.get("$schema", "")) else "$id"
    index = _Index(id_key)
    index.scan(schema, _ROOT_URI, "", 0)
    return index.rewrite(schema, _ROOT_URI, "", 0)


def _declares_ids(schema: Any) -> bool:
    """Whether any $id / $anchor / id appears (cheap: most schemas have none)."""
    text = str(schema)
    return "'$id'" in text or "'$anchor'" in text or "'id': '" in text


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

    def scan(self, node: Any, base: str, pointer: str, depth: int) -> None:
        if not isinstance(node, dict) or depth > MAX_DEPTH:
            return
        base = self._base(node, base)
        self.resources.setdefault(base, pointer)
        ident = node.get(self.id_key)
        if isinstance(ident, str) and "#" in ident and urldefrag(ident)[1]:
            self.anchors.setdefault(f"{base}#{urldefrag(ident)[1]}", pointer)
        if isinstance(node.get("$anchor"), str):
            self.anchors.setdefault(f"{base}#{node['$anchor']}", pointer)
        for child, at in _children(node, pointer):
            self.scan(child, base, at, depth + 1)

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
        for key in _SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {k: self.rewrite(v, base, f"{pointer}/{key}/{_escape(k)}", depth + 1)
                            for k, v in out[key].items()}
        for key in _SCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [self.rewrite(v, base, f"{pointer}/{key}/{i}", depth + 1)
                            for i, v in enumerate(out[key])]
        for key in _SCHEMAS:
            if isinstance(out.get(key), dict):
                out[key] = self.rewrite(out[key], base, f"{pointer}/{key}", depth + 1)
        return out

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


def _children(node: dict, pointer: str):
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, child in node[key].items():
                yield child, f"{pointer}/{_escape(key)}/{_escape(name)}"
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                yield child, f"{pointer}/{_escape(key)}/{i}"
    for key in _SCHEMAS:
        if isinstance(node.get(key), dict):
            yield node[key], f"{pointer}/{_escape(key)}"


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
