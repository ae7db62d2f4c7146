"""References and combining for schema_check: $ref resolution, allOf merging, oneOf disjointness."""
from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

from guided.errors import ConstraintError

# no effect on validation
ANNOTATIONS = frozenset({
    "title", "description", "examples", "example", "default", "$comment", "deprecated", "readOnly",
    "writeOnly", "$schema", "$vocabulary", "$anchor", "nullable", "discriminator", "xml",
    "externalDocs", "markdownDescription"})


class Unsatisfiable(ConstraintError):
    """A subschema no value satisfies (an optional property with one is left out)."""


def where(pointer: str) -> str:
    return pointer or "/"


def refuse(keyword: str, pointer: str, why: str) -> ConstraintError:
    return ConstraintError(
        f"unsupported JSON Schema keyword '{keyword}' at {where(pointer)}: {why}")


class SchemaCombiner:
    """Resolves local references and merges subschemas against one root schema."""

    def __init__(self, root: dict):
        self.root = root

    def resolve(self, ref: str, pointer: str) -> Any:
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            raise refuse("$ref", pointer, f"only local references ('#/...') are supported, "
                                          f"got {ref!r}")
        node: Any = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            part = re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), part)
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise refuse("$ref", pointer, f"reference {ref!r} does not resolve")
        return node

    def deref(self, node: Any, pointer: str) -> Any:
        """Follow a chain of pure references ({"$ref": ...} with annotations only)."""
        for _ in range(32):
            if not (isinstance(node, dict) and "$ref" in node) or validation_keys(
                    node, exclude=("$ref",)):
                return node
            node = self.resolve(node["$ref"], pointer)
        raise refuse("$ref", pointer, "reference chain too long or cyclic")

    def merge(self, schemas: list, pointer: str, keyword: str) -> dict:
        out: dict = {}
        for schema in schemas:
            schema = self.deref(schema, pointer)
            if schema is True:
                continue
            if schema is False:
                raise ConstraintError(f"the {keyword} at {where(pointer)} contains `false`")
            schema = {k: v for k, v in schema.items() if k not in ANNOTATIONS}
            if "$ref" in schema and validation_keys(schema, exclude=("$ref",)):
                schema = self.merge([self.resolve(schema.pop("$ref"), pointer), schema],
                                    pointer, "$ref")
            elif "$ref" in schema:
                schema = self.deref(schema, pointer)
            if "allOf" in schema:
                schema = self.merge([schema, *schema.pop("allOf")], pointer, "allOf")
            for key, value in schema.items():
                out[key] = (_merge_value(key, out[key], value, pointer, keyword) if key in out
                            else copy.deepcopy(value))
        dicts = [self.deref(s, pointer) for s in schemas]
        dicts = [s for s in dicts if isinstance(s, dict)]
        for kw in ("unevaluatedProperties", "unevaluatedItems"):
            if any(kw in d for d in dicts) and sum(bool(validation_keys(d)) for d in dicts) > 1:
                raise refuse(kw, pointer, f"{kw} inside a combined schema (allOf, $ref, a "
                                          f"union's branch) is not supported")
        for owner in dicts:  # items applies after the prefixItems of its own schema only
            if "items" in owner and any(o is not owner and "prefixItems" in o
                                        and o.get("prefixItems") != owner.get("prefixItems")
                                        for o in dicts):
                raise refuse(keyword, pointer, "'items' and 'prefixItems' in different "
                                               "combined schemas cannot be merged")
        for closed in dicts:
            if closed.get("additionalProperties", True) is True:
                continue
            own = set(closed.get("properties", {}))
            for other in dicts:
                if set(other.get("properties", {})) - own:
                    raise refuse(keyword, pointer, "additionalProperties inside a combined "
                                 "schema also rejects its siblings' properties")
        return out

    def disjoint(self, a: Any, b: Any, pointer: str) -> bool:
        a, b = self.deref(a, pointer), self.deref(b, pointer)
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        ta, tb = _types_of(a), _types_of(b)
        if ta is not None and tb is not None and not ta & tb:
            return True
        va, vb = self.known_values(a, pointer), self.known_values(b, pointer)
        if va is not None and vb is not None and not (va & vb):
            return True
        if not (_object_only(a) and _object_only(b)):
            return False  # required keys say nothing of the values that are no objects
        for key in set(a.get("required", [])) & set(b.get("required", [])):
            xa = self.known_values(a.get("properties", {}).get(key, True), pointer)
            xb = self.known_values(b.get("properties", {}).get(key, True), pointer)
            if xa is not None and xb is not None and not (xa & xb):
                return True
        for x, y in ((a, b), (b, a)):
            if y.get("additionalProperties") is False and (
                    set(x.get("required", [])) - set(y.get("properties", {}))):
                return True
        return False

    def known_values(self, node: Any, pointer: str, depth: int = 0) -> set[str] | None:
        """The values node admits, as normalized JSON texts, where it lists them (a const or
        enum, or an allOf with one); None where it does not (any value, as far as known)."""
        node = self.deref(node, pointer)
        if not isinstance(node, dict) or depth > 16:
            return None
        if "const" in node or "enum" in node:
            values = [node["const"]] if "const" in node else node["enum"]
            return {value_key(v) for v in values}
        known = [self.known_values(s, pointer, depth + 1) for s in node.get("allOf", [])]
        known = [k for k in known if k is not None]
        return set.intersection(*known) if known else None

    def exclusive(self, a: Any, b: Any, pointer: str) -> bool:
        """Whether no output generated for either branch of a oneOf matches the other: they
        are disjoint, or each one's outputs (strict mode closes their objects) lack a key the
        other requires."""
        return self.disjoint(a, b, pointer) or (self._outputs_miss(a, b, pointer)
                                                and self._outputs_miss(b, a, pointer))

    def _outputs_miss(self, x: Any, y: Any, pointer: str) -> bool:
        x, y = self.deref(x, pointer), self.deref(y, pointer)
        if not isinstance(x, dict) or not isinstance(y, dict):
            return False
        keys = _closed_keys(x)
        return keys is not None and bool(set(y.get("required", [])) - keys)

    def discriminate(self, branches: list, pointer: str) -> list | None:
        """Branches made exclusive by a property each declares with listed values, disjoint
        from branch to branch: required in each (outputs lacking it are not generated:
        stricter), so an output matches its own branch only. None: no such property."""
        dicts = [self.deref(b, pointer) for b in branches]
        if not all(isinstance(d, dict) and _object_only(d) for d in dicts):
            return None
        common = set.intersection(*(set(d.get("properties", {})) for d in dicts))
        for key in sorted(common):
            values = [self.known_values(d["properties"][key], pointer) for d in dicts]
            if any(v is None for v in values):
                continue
            if all(not (values[i] & values[j]) for i in range(len(values))
                   for j in range(i + 1, len(values))):
                return [{**d, "required": list(dict.fromkeys([*d.get("required", []), key]))}
                        for d in dicts]
        return None


# keywords of the other types than object: a branch with one may generate non-objects
_NOT_OBJECT = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                         "multipleOf", "minLength", "maxLength", "pattern", "format", "items",
                         "prefixItems", "minItems", "maxItems", "uniqueItems", "contains",
                         "enum", "const"})
# keywords that make an object schema's keys more than its properties
_OPENING = frozenset({"anyOf", "oneOf", "allOf", "$ref", "not", "if", "patternProperties",
                      "propertyNames", "dependentSchemas", "dependentRequired", "dependencies"})


def _object_only(node: dict) -> bool:
    """Whether every value node admits is an object (as schema_check rewrites it)."""
    if "type" in node:
        return as_list(node["type"]) == ["object"]
    return "properties" in node and not _NOT_OBJECT & node.keys()


def _closed_keys(node: dict) -> set[str] | None:
    """The keys a generated object may have (strict mode: its properties and required names),
    or None where more may come (open, combined, or not an object)."""
    if _OPENING & node.keys() or not _object_only(node):
        return None
    extra = node.get("additionalProperties")
    if extra is not None and extra is not False:
        return None
    if "properties" not in node and extra is None:
        return None
    return set(node.get("properties", {})) | set(node.get("required", []))


def _normal_number(value: Any) -> Any:
    """1.0 as 1 (JSON Schema equality), deeply."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_normal_number(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal_number(v) for k, v in value.items()}
    return value


def _merge_value(key: str, a: Any, b: Any, pointer: str, keyword: str) -> Any:
    if json_text(a) == json_text(b):
        return a
    if key == "required":
        return list(dict.fromkeys([*a, *b]))
    if key == "properties":
        out = dict(a)
        for name, sub in b.items():
            if name not in out:
                out[name] = sub
            elif out[name] is False or sub is False:
                out[name] = False  # absent, whatever else is said of it
            else:
                out[name] = {"allOf": [out[name], sub]}
        return out
    if key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties",
               "minContains"):
        return max(a, b)
    if key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties",
               "maxContains"):
        return min(a, b)
    if key == "type":
        ta, tb = as_list(a), as_list(b)
        both = [t for t in ta if t in tb or (t == "integer" and "number" in tb)]
        both += [t for t in tb if t == "integer" and "number" in ta and t not in both]
        if not both:
            raise Unsatisfiable(f"the {keyword} at {where(pointer)} combines disjoint types")
        return both[0] if len(both) == 1 else both
    if key in ("$defs", "definitions"):
        return {**a, **b}
    if key in ("items", "additionalProperties", "contains", "propertyNames", "not"):
        return _merge_schemas(key, a, b)
    if key == "enum":  # jsonschema's equality: 1 == 1.0, not true
        return [v for v in a if any(value_key(v) == value_key(w) for w in b)]
    if key == "const":
        if value_key(a) != value_key(b):
            raise Unsatisfiable(f"the {keyword} at {where(pointer)} combines different consts")
        return a
    if key == "multipleOf" and all(isinstance(v, int) for v in (a, b)):
        return math.lcm(a, b)
    if key == "prefixItems" and len(a) == len(b):
        return [{"allOf": [x, y]} for x, y in zip(a, b)]
    if key == "uniqueItems":
        return bool(a or b)
    raise refuse(keyword, pointer, f"cannot combine two different '{key}' constraints")


def _merge_schemas(key: str, a: Any, b: Any) -> Any:
    """Two subschemas that must both hold (`false` absorbs, `true` gives way); two `not`s
    refuse what either refuses."""
    if key == "not":
        return {"anyOf": [a, b]}
    if a is False or b is False:
        return False
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    return {"allOf": [a, b]}


def value_key(value: Any) -> str:
    """Equal keys for values JSON Schema takes as equal (1 and 1.0; not 1 and true)."""
    return json_text(_normal_number(value))


def escape(name: str) -> str:
    """name as a JSON pointer token."""
    return str(name).replace("~", "~0").replace("/", "~1")


def validation_keys(node: dict, exclude: tuple = ()) -> list[str]:
    return [k for k in node if k not in ANNOTATIONS and k not in exclude
            and k not in ("$defs", "definitions", "$id")]


def _types_of(node: dict) -> set[str] | None:
    """The types node admits ("number" widened by "integer"), or None: any."""
    if "type" in node:
        types = set(as_list(node["type"]))
    elif "const" in node or "enum" in node:
        types = {_json_type(v) for v in ([node["const"]] if "const" in node else node["enum"])}
    else:
        return None
    return types | ({"integer"} if "number" in types else set())


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def json_text(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def as_list(value: Any) -> list:
    return list(value) if isinstance(value, list) else [value]
