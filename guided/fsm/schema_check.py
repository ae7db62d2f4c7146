"""Fail closed: rewrite a JSON schema into the subset xgrammar 0.2.8 enforces, or refuse it.

Compiled in xgrammar's strict mode (objects that declare properties admit no others: a subset,
and a far faster grammar). A keyword xgrammar would silently ignore (probed) is rewritten into an
equivalent or stricter form it enforces, or refused naming the keyword and its JSON pointer:
every string the grammar admits validates against the client's schema (Draft 2020-12, formats).
"""
from __future__ import annotations

import copy
import math
import re
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from guided.errors import ConstraintError
from guided.fsm.schema_formats import rewrite_string
from guided.fsm.schema_keywords import (
    bounded_multiples,
    if_union,
    negation_union,
    rewrite_contains,
    rewrite_multiple_of,
    rewrite_not,
    rewrite_unique_items,
)
from guided.fsm.schema_merge import (
    ANNOTATIONS,
    SchemaCombiner,
    Unsatisfiable,
    as_list,
    escape,
    json_text,
    refuse,
    validation_keys,
    where,
)
from guided.fsm.schema_objects import (
    check_min_properties,
    rewrite_pattern_properties,
    rewrite_property_names,
    rewrite_unevaluated,
    split_dependencies,
    undeclared_schema,
)
from guided.fsm.schema_refs import localize_refs, upgrade

NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                             "multipleOf"})
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "minProperties",
                             "maxProperties", "patternProperties", "propertyNames",
                             "dependentRequired", "dependentSchemas", "dependencies",
                             "unevaluatedProperties"})
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems",
                            "contains", "minContains", "maxContains", "additionalItems",
                            "unevaluatedItems"})
TYPE_KEYWORDS = {"number": NUMBER_KEYWORDS, "string": STRING_KEYWORDS, "object": OBJECT_KEYWORDS,
                 "array": ARRAY_KEYWORDS}
# keywords xgrammar 0.2.8 ignores (probed): refused unless trivially true
IGNORED_BY_XGRAMMAR = ("dependencies", "unevaluatedProperties",
                       "unevaluatedItems", "$dynamicRef", "$recursiveRef",
                       # annotations in 2020-12 but assertions in draft 7 (and its test suite)
                       "contentMediaType", "contentEncoding", "contentSchema")
INTEGER_LIMIT = 2**53
# references the walk rewrites in place: the root, and $defs / definitions (nested) from it
_REWRITTEN_REF = re.compile(r"#(/(\$defs|definitions)/[^/]+)*$")


def check_schema(schema: Any) -> Any:
    """A schema xgrammar enforces exactly (or more strictly); ConstraintError otherwise."""
    if isinstance(schema, bool):
        if not schema:
            raise ConstraintError("the schema `false` admits no value")
        return {}
    if not isinstance(schema, dict):
        raise ConstraintError("a JSON schema must be an object or a boolean")
    schema = localize_refs(upgrade(schema))
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        at = "/" + "/".join(str(p) for p in e.absolute_path)
        raise ConstraintError(f"invalid JSON schema at {at}: {e.message}") from None
    return _Rewriter(schema).rewrite(schema, "")


class _Rewriter(SchemaCombiner):
    def __init__(self, root: dict):
        super().__init__(root)
        self.validator = Draft202012Validator(
            root, format_checker=Draft202012Validator.FORMAT_CHECKER)
        self.depth = 0

    def rewrite(self, node: Any, pointer: str) -> Any:
        self.depth += 1
        try:
            if self.depth > 200:
                raise ConstraintError(f"schema nested too deeply at {where(pointer)}")
            if node is True:
                return {}
            if node is False:
                raise ConstraintError(f"the subschema `false` at {where(pointer)} admits no "
                                      f"value and is not supported there")
            return self._rewrite_dict(dict(node), pointer)
        finally:
            self.depth -= 1

    def _rewrite_dict(self, node: dict, pointer: str) -> dict:
        if pointer and "$id" in node:
            raise refuse("$id", pointer, "embedded schema resources are not supported")
        node = {k: v for k, v in node.items() if k not in ANNOTATIONS or k == "$schema"
                and not pointer}
        node.pop("$schema", None)
        _drop_trivial(node)
        rewrite_unevaluated(node)
        if "enum" in node or "const" in node:
            return self._rewrite_enum(node, pointer)
        if "$ref" in node:
            target = self.deref(self.resolve(node["$ref"], pointer), pointer)  # remote: refused
            if validation_keys(node, exclude=("$ref",)):
                del node["$ref"]
                return self.rewrite(self.merge([copy.deepcopy(target), node], pointer, "$ref"),
                                    pointer)
            if not _REWRITTEN_REF.match(node["$ref"]):
                # a target outside the walk would reach xgrammar unrewritten: inline its rewrite
                return self.rewrite(copy.deepcopy(target), pointer)
        if "allOf" in node:
            branches = node.pop("allOf")
            return self.rewrite(self.merge([node, *branches], pointer, "allOf"), pointer)
        for kw in ("anyOf", "oneOf"):
            if kw in node:
                return self._rewrite_union(node, kw, pointer)
        if "dependentRequired" in node or "dependentSchemas" in node:
            return self.rewrite(split_dependencies(node, pointer), pointer)
        if "if" in node:
            return self._rewrite_union(if_union(node), "anyOf", pointer, negating="if")
        if "not" in node and (union := negation_union(node)) is not None:
            return self._rewrite_union(union, "anyOf", pointer, negating="not")
        if "not" in node:
            rewrite_not(node, pointer)
        for kw in IGNORED_BY_XGRAMMAR:
            if kw in node:
                raise refuse(kw, pointer, "the grammar backend would ignore it")
        node = _infer_type(node)
        if isinstance(node.get("type"), list) and validation_keys(node, exclude=("type",)):
            # xgrammar applies type-specific keywords unreliably to type lists: split by type
            types = node.pop("type")
            return self.rewrite({"anyOf": [_only_type(node, t) for t in types]}, pointer)
        rewrite_string(node, pointer)
        _rewrite_number(node, pointer)
        rewrite_pattern_properties(node, pointer)
        rewrite_property_names(node, pointer, self.validator)
        self._rewrite_object(node, pointer)
        self._rewrite_array(node, pointer)
        for container in ("$defs", "definitions"):
            if isinstance(node.get(container), dict):
                node[container] = {k: self.rewrite(v, f"{pointer}/{container}/{escape(k)}")
                                   if v is not False else v
                                   for k, v in node[container].items()}
        return node

    def _rewrite_enum(self, node: dict, pointer: str) -> dict:
        values = [node["const"]] if "const" in node else list(node["enum"])
        check = self.validator.evolve(schema=node)
        kept = []
        for value in values:
            # jsonschema treats 1 == 1.0 == True differently from JSON text: keep distinct texts
            if check.is_valid(value) and all(json_text(value) != json_text(k) for k in kept):
                kept.append(value)
        if not kept:
            raise Unsatisfiable(f"the enum/const at {where(pointer)} admits no value that "
                                  f"satisfies its sibling keywords")
        return {"const": kept[0]} if len(kept) == 1 else {"enum": kept}

    def _rewrite_union(self, node: dict, kw: str, pointer: str,
                       negating: str | None = None) -> dict:
        """anyOf / oneOf, and the unions of if and of some nots (`negating`: the keyword to
        refuse where a branch's negation cannot be said). Unsatisfiable branches are left out."""
        branches = node.pop(kw)
        defs = {k: node.pop(k) for k in ("$defs", "definitions") if k in node}
        live, originals = [], []
        for branch in (b for b in branches if b is not False):
            try:
                merged = (self.merge([copy.deepcopy(node), branch], f"{pointer}/{kw}", kw)
                          if validation_keys(node) else branch)
            except Unsatisfiable:
                continue
            live.append(merged)
            originals.append(branch)
        if kw == "oneOf" and len(live) > 1:
            live, negating = self._exclusive_branches(live, originals, pointer)
        rewritten = []
        for i, branch in enumerate(live):
            try:
                rewritten.append(self.rewrite(branch, f"{pointer}/{kw}/{i}"))
            except Unsatisfiable:
                continue
            except ConstraintError as e:
                if negating is None or "keyword 'not'" not in str(e):
                    raise
                raise refuse(negating, pointer, f"a branch's negation cannot be enforced "
                             f"({e})") from None
        if not rewritten:
            raise Unsatisfiable(f"no branch of the {kw} at {where(pointer)} admits a value")
        out = rewritten[0] if len(rewritten) == 1 else {"anyOf": rewritten}
        for k, v in defs.items():
            out[k] = {name: self.rewrite(s, f"{pointer}/{k}/{escape(name)}")
                      for name, s in v.items()}
        return out

    def _exclusive_branches(self, live: list, originals: list, pointer: str
                            ) -> tuple[list, str | None]:
        """oneOf branches made exclusive (then it is their anyOf): as they are, by a
        discriminating property, or else each with the others negated."""
        pairs = [(i, j) for i in range(len(live)) for j in range(i + 1, len(live))]
        if all(self.exclusive(live[i], live[j], pointer) for i, j in pairs):
            return live, None
        tagged = self.discriminate(live, pointer)
        if tagged is not None:
            return tagged, None
        return [{"allOf": [b, {"not": {"anyOf": originals[:i] + originals[i + 1:]}}]}
                for i, b in enumerate(live)], "oneOf"

    def _rewrite_object(self, node: dict, pointer: str) -> None:
        props = node.get("properties")
        if props is not None:
            props = dict(props)
            for name, sub in list(props.items()):
                if sub is False:
                    if node.get("additionalProperties") is False:
                        del props[name]  # cannot appear anyway
                    else:
                        raise refuse("properties", f"{pointer}/properties/{escape(name)}",
                                     "a `false` property schema is only supported with "
                                     "additionalProperties false")
        extra = node.get("additionalProperties", True)
        for name in node.get("required", []):
            if props is None or name not in props:
                props = props if props is not None else {}
                props[name] = undeclared_schema(name, extra, pointer)
        if props is not None:
            rewritten = {}
            for name, sub in props.items():
                try:
                    rewritten[name] = self.rewrite(sub, f"{pointer}/properties/{escape(name)}")
                except Unsatisfiable:
                    # an optional property no value satisfies must be absent; the strict-mode
                    # grammar omits undeclared keys unless additionalProperties admits them
                    closed = node.get("additionalProperties", False) is False
                    if name in node.get("required", []) or not closed:
                        raise
            node["properties"] = rewritten
        if isinstance(extra, dict):
            node["additionalProperties"] = self.rewrite(extra, f"{pointer}/additionalProperties")
        elif (props is None and "additionalProperties" not in node and _may_be(node, "object")
              and "patternProperties" not in node):
            # strict mode closes objects by default; one without properties stays free-form
            node["additionalProperties"] = True

        if "patternProperties" in node:
            node["patternProperties"] = {
                p: self.rewrite(s, f"{pointer}/patternProperties/{escape(p)}")
                for p, s in node["patternProperties"].items()}
        check_min_properties(node, pointer)

    def _rewrite_array(self, node: dict, pointer: str) -> None:
        items = node.get("items")
        if isinstance(items, list):
            raise refuse("items", pointer, "the array form of 'items' (draft 7 tuples) is not "
                                           "supported; use prefixItems")
        node.pop("additionalItems", None)  # not a 2020-12 keyword: no effect without tuple items
        if "contains" in node:
            rewrite_contains(node, pointer)
        unique = node.pop("uniqueItems", False)
        items = node.get("items")
        if isinstance(items, dict):
            node["items"] = self.rewrite(items, f"{pointer}/items")
        elif items is None and "prefixItems" not in node and _may_be(node, "array"):
            node["items"] = True  # strict mode would otherwise admit only []
        if "prefixItems" in node:
            node["prefixItems"] = [self.rewrite(s, f"{pointer}/prefixItems/{i}")
                                   for i, s in enumerate(node["prefixItems"])]
        if unique:
            rewrite_unique_items(node, pointer)


def _may_be(node: dict, type_name: str) -> bool:
    return type_name in as_list(node.get("type", []))


def _rewrite_number(node: dict, pointer: str) -> None:
    for kw in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(kw), bool):
            raise refuse(kw, pointer, "boolean exclusive bounds (draft 4) are not supported")
    if "multipleOf" in node:
        rewrite_multiple_of(node, as_list(node.get("type", [])), pointer)
    if as_list(node.get("type", [])) == ["integer"]:
        # xgrammar wants integer bounds: round inward (exact for integer values)
        lo = [math.ceil(node.pop("minimum"))] if "minimum" in node else []
        if "exclusiveMinimum" in node:
            lo.append(math.floor(node.pop("exclusiveMinimum")) + 1)
        hi = [math.floor(node.pop("maximum"))] if "maximum" in node else []
        if "exclusiveMaximum" in node:
            hi.append(math.ceil(node.pop("exclusiveMaximum")) - 1)
        # xgrammar's bounds are doubles: one past 2**53 is clamped inward (stricter, exact
        # for every integer a double holds); a range wholly beyond it is refused
        lo = [max(bound, -INTEGER_LIMIT) for bound in lo]
        hi = [min(bound, INTEGER_LIMIT) for bound in hi]
        if any(abs(bound) > INTEGER_LIMIT for bound in lo + hi):
            raise ConstraintError(f"the integer range at {where(pointer)} lies beyond 2**53")
        if lo:
            node["minimum"] = max(lo)
        if hi:
            node["maximum"] = min(hi)
        if lo and hi and max(lo) > min(hi):
            raise ConstraintError(f"the integer range at {where(pointer)} is empty")
        bounded_multiples(node, pointer)


def _drop_trivial(node: dict) -> None:
    """Drop keywords that validate everything (not to be refused for nothing)."""
    if "if" in node and "then" not in node and "else" not in node:
        node.pop("if")
    if "if" not in node:
        node.pop("then", None)
        node.pop("else", None)
    for kw in ("unevaluatedProperties", "unevaluatedItems"):
        if node.get(kw) is True:
            node.pop(kw)
    if node.get("uniqueItems") is False:
        node.pop("uniqueItems")
    if node.get("propertyNames") in (True, {}):
        node.pop("propertyNames")
    for kw in ("dependentRequired", "dependentSchemas", "dependencies", "patternProperties",
               "allOf"):
        if node.get(kw) in ({}, []):
            node.pop(kw)
    if "additionalItems" in node and not isinstance(node.get("items"), list):
        node.pop("additionalItems")
    if "contains" not in node:
        node.pop("minContains", None)
        node.pop("maxContains", None)


def _infer_type(node: dict) -> dict:
    """xgrammar ignores type-specific keywords without an explicit type: restrict an untyped
    schema to the types its keywords constrain (stricter)."""
    if "type" in node:
        return node
    families = [t for t, kws in TYPE_KEYWORDS.items() if any(k in node for k in kws)]
    if families:
        node["type"] = families[0] if len(families) == 1 else families
    return node


def _only_type(node: dict, type_name: str) -> dict:
    family = "number" if type_name == "integer" else type_name
    keep = {k: v for k, v in node.items()
            if not any(k in kws for t, kws in TYPE_KEYWORDS.items() if t != family)}
    keep["type"] = type_name
    return keep
