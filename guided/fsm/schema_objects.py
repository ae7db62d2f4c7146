"""Object keywords for schema_check that xgrammar 0.2.8 enforces only in some forms.

Probed (strict mode): a patternProperties / propertyNames pattern is matched whole (a subset of
JSON Schema's match-anywhere); a declared name a pattern admits gets the pattern's schema only,
and additionalProperties beside patterns admits any key: such overlaps are refused and
additionalProperties dropped; undeclared keys may repeat, so minProperties counts distinct ones.
"""
from __future__ import annotations

import copy
import re
from typing import Any

import interegular

from guided.errors import ConstraintError
from guided.fsm.schema_formats import (
    MAX_PATTERN_LENGTH,
    bounded_pattern,
    check_pattern,
    fix_optional_groups,
    length_pattern,
    whole_match_body,
)
from guided.fsm.schema_merge import ANNOTATIONS, json_text, refuse, where

# keywords whose subschemas apply to the instance itself: their evaluated properties and items
# count for unevaluated* (a `not`'s do not)
_IN_PLACE = ("allOf", "anyOf", "oneOf", "if", "then", "else", "$ref", "$dynamicRef",
             "$recursiveRef", "dependentSchemas")


def rewrite_unevaluated(node: dict) -> None:
    """unevaluatedProperties / unevaluatedItems beside no in-place applicator are
    additionalProperties / items (nothing where those are given); else they stay, refused."""
    if any(k in node for k in _IN_PLACE):
        return
    if "unevaluatedProperties" in node:
        rest = node.pop("unevaluatedProperties")
        node.setdefault("additionalProperties", rest)
    if "unevaluatedItems" in node and "contains" not in node:  # contains evaluates items too
        rest = node.pop("unevaluatedItems")
        node.setdefault("items", rest)


def rewrite_pattern_properties(node: dict, pointer: str) -> None:
    """Declared names a pattern matches get its schema too (allOf); overlaps with different
    schemas are refused; additionalProperties is dropped."""
    patterns = node.get("patternProperties")
    if not patterns:
        return
    if "propertyNames" in node:
        raise refuse("propertyNames", pointer, "propertyNames beside patternProperties is not "
                                               "supported")
    for pattern in patterns:
        check_pattern(pattern, "patternProperties", pointer)
    extra = node.pop("additionalProperties", True)
    props = dict(node.get("properties", {}))
    required = node.get("required", [])
    for name in required:
        if name not in props:
            props[name] = ({} if any(re.search(p, name) for p in patterns)
                           else undeclared_schema(name, extra, pointer))
    for name in list(props):
        original = props[name]
        matched = [patterns[p] for p in patterns if re.search(p, name)]
        if any(s is False for s in matched):
            if name in required:
                raise ConstraintError(f"required property {name!r} at {where(pointer)} is "
                                      f"forbidden by a patternProperties `false`")
            del props[name]
            continue
        if matched:
            props[name] = {"allOf": [props[name], *matched]}
        needed = [s for s in (original, *matched) if not _same(s, {})]
        for p, schema in patterns.items():
            if re.fullmatch(whole_match_body(p), name) and not all(_same(s, schema)
                                                                   for s in needed):
                raise refuse("patternProperties", pointer, f"pattern {p!r} also admits the "
                             f"declared property {name!r}, whose schema differs")
    _refuse_overlaps(patterns, pointer)
    node["properties"] = props
    node["patternProperties"] = {fix_optional_groups(p): s for p, s in patterns.items()
                                 if s is not False}
    if not node["patternProperties"]:
        del node["patternProperties"]


def undeclared_schema(name: str, extra: Any, pointer: str) -> Any:
    """The schema of a required name no property declares: additionalProperties'."""
    if extra is False:
        raise ConstraintError(f"required property {name!r} at {where(pointer)} is forbidden by "
                              f"additionalProperties false")
    return copy.deepcopy(extra) if isinstance(extra, dict) else {}


def rewrite_property_names(node: dict, pointer: str, validator) -> None:
    """Declared names propertyNames refuses are dropped (refused if required); undeclared keys
    get its pattern or enum."""
    names = node.pop("propertyNames", None)
    if names is None or names is True:
        return
    at = f"{pointer}/propertyNames"
    if names is False:
        raise refuse("propertyNames", pointer, "propertyNames `false` is not supported")
    names = {k: v for k, v in names.items() if k not in ANNOTATIONS}
    if names.get("type") == "string":
        names.pop("type")
    check = validator.evolve(schema=names)
    for name in node.get("required", []):
        if not check.is_valid(name):
            raise ConstraintError(f"required property {name!r} at {where(pointer)} is not a "
                                  f"name propertyNames admits")
    props = node.get("properties")
    for name in list(props or {}):
        if not check.is_valid(name):
            del props[name]
    extra = node.get("additionalProperties", not props)
    if extra is False:
        return  # no undeclared key is generated
    keys = _undeclared_keys(names, check, props or {}, extra, at)
    if keys is None:
        node["additionalProperties"] = False
        node.setdefault("properties", {})
    else:
        node["propertyNames"] = keys


def _undeclared_keys(names: dict, check, props: dict, extra: Any, at: str) -> dict | None:
    """The propertyNames xgrammar gets for undeclared keys (None: no key is left)."""
    if not set(names) <= {"pattern", "enum", "const", "minLength", "maxLength"}:
        raise refuse("propertyNames", at, "only a pattern, an enum or length bounds are "
                                          "supported")
    if "enum" in names or "const" in names:
        values = names["enum"] if "enum" in names else [names["const"]]
        keys = [v for v in values if isinstance(v, str) and check.is_valid(v) and v not in props]
        return {"enum": list(dict.fromkeys(keys))} if keys else None
    pattern = names.get("pattern")
    low, high = names.get("minLength", 0), names.get("maxLength")
    if pattern is None:
        if high is not None and high > MAX_PATTERN_LENGTH:
            raise refuse("propertyNames", at, f"a maxLength over {MAX_PATTERN_LENGTH} is not "
                                              f"supported")
        pattern = length_pattern(low, high)
    else:
        check_pattern(pattern, "propertyNames", at)
        if "minLength" in names or "maxLength" in names:
            pattern = bounded_pattern(pattern, low, high, at)
    for name, schema in props.items():
        if re.fullmatch(whole_match_body(pattern), name) and not _same(schema, extra):
            raise refuse("propertyNames", at, f"its pattern admits the declared property "
                                              f"{name!r}, whose schema differs")
    return {"pattern": fix_optional_groups(pattern)}


def check_min_properties(node: dict, pointer: str) -> None:
    """Refuse a minProperties that repeated undeclared keys could meet without distinct keys."""
    least = node.get("minProperties", 0)
    open_keys = ("patternProperties" in node or "propertyNames" in node
                 or node.get("additionalProperties", False) is not False)
    if open_keys and least > max(1, len(set(node.get("required", [])))):
        raise refuse("minProperties", pointer, "beside undeclared keys (which may repeat), "
                                               "only as many as the required properties")


def _same(a: Any, b: Any) -> bool:
    """Whether two subschemas are the same constraint (`true` and `{}` alike)."""
    return json_text({} if a is True else a) == json_text({} if b is True else b)


def _refuse_overlaps(patterns: dict, pointer: str) -> None:
    """A key one pattern admits whole and another matches anywhere must have one schema."""
    items = list(patterns.items())
    for i, (p, ps) in enumerate(items):
        for q, qs in items[i + 1:]:
            if _same(ps, qs):
                continue
            if not (_never_both(p, q) and _never_both(q, p)):
                raise refuse("patternProperties", pointer, f"patterns {p!r} and {q!r} may "
                             f"match one key and their schemas differ")


def _never_both(whole: str, anywhere: str) -> bool:
    """True if no key matches `whole` whole and `anywhere` somewhere (False if unsure)."""
    body = whole_match_body(anywhere)
    search = ("" if anywhere.startswith("^") else "(.|\n)*") + f"({body})" + (
        "" if body != anywhere.removeprefix("^") else "(.|\n)*")
    try:
        fsm = interegular.parse_pattern(whole_match_body(whole)).to_fsm()
        return (fsm & interegular.parse_pattern(search).to_fsm()).empty()
    except Exception:  # noqa: BLE001 - syntax interegular does not know: unsure
        return False


# optional properties whose dependencies split an object schema in two (2**n branches at most)
MAX_DEPENDENCY_SPLITS = 4


def split_dependencies(node: dict, pointer: str) -> dict:
    """dependentRequired / dependentSchemas as plain keywords: a required trigger's dependencies
    become required (its schema merged); an optional one splits the object in two (anyOf):
    without it, and with it and its dependencies."""
    node = dict(node)
    needs = dict(node.pop("dependentRequired", {}) or {})
    schemas = dict(node.pop("dependentSchemas", {}) or {})
    required = list(node.get("required", []))
    merged: list = []
    changed = True
    while changed:  # a sure trigger's dependencies may make another trigger sure
        changed = False
        for name in [t for t in [*needs, *schemas] if t in required]:
            added = [d for d in needs.pop(name, []) if d not in required]
            required += added
            if name in schemas:
                merged.append(schemas.pop(name))
            changed = True
    if required:
        node["required"] = required
    pending = [t for t in dict.fromkeys([*needs, *schemas]) if _may_have(node, t)]
    if len(pending) > MAX_DEPENDENCY_SPLITS:
        raise refuse("dependentRequired", pointer, f"more than {MAX_DEPENDENCY_SPLITS} optional "
                                                   f"properties with dependencies")
    if pending:
        trigger = pending[0]
        rest_needs = {t: d for t, d in needs.items() if t in pending[1:]}
        rest_schemas = {t: s for t, s in schemas.items() if t in pending[1:]}
        out = _dependency_branches(node, trigger, needs.get(trigger, []), schemas.get(trigger),
                                   rest_needs, rest_schemas)
    else:
        out = node
    return {"allOf": [out, *merged]} if merged else out


def _dependency_branches(node: dict, trigger: str, needs: list, schema, rest_needs: dict,
                         rest_schemas: dict) -> dict:
    defs = {k: node.pop(k) for k in ("$defs", "definitions") if k in node}
    rest = {}
    if rest_needs:
        rest["dependentRequired"] = rest_needs
    if rest_schemas:
        rest["dependentSchemas"] = rest_schemas
    without = {**copy.deepcopy(node), **copy.deepcopy(rest)}
    # `false` survives schemas merged in later; closed, the trigger cannot come as an
    # undeclared key either (stricter where the object was open)
    without["properties"] = {**node.get("properties", {}), trigger: False}
    without["additionalProperties"] = False
    branches = [without]
    if all(_may_have(node, name) for name in needs):
        present = {**copy.deepcopy(node), **copy.deepcopy(rest)}
        present["required"] = list(dict.fromkeys([*node.get("required", []), trigger, *needs]))
        branches.append({"allOf": [present, schema]} if schema is not None else present)
    return {"anyOf": branches, **defs}


def _may_have(node: dict, name: str) -> bool:
    """Whether name may be generated: declared, or undeclared keys may be (as schema_check
    leaves the object)."""
    if name in node.get("properties", {}) or "patternProperties" in node or (
            "propertyNames" in node):
        return True
    extra = node.get("additionalProperties")
    return extra is not False and (extra is not None or "properties" not in node)
