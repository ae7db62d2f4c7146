"""Keywords xgrammar 0.2.8 ignores, said positively for schema_check (exactly or more strictly):
`not` (of types, required names, boolean or null values, anyOf of these) and if/then/else, whose
unions schema_check rewrites like anyOf's; contains and uniqueItems; multipleOf."""
from __future__ import annotations

import copy
import itertools
import math
from fractions import Fraction
from functools import lru_cache
from typing import Any

import numpy as np

from guided.fsm.schema_merge import (
    ANNOTATIONS,
    Unsatisfiable,
    as_list,
    json_text,
    refuse,
    value_key,
    where,
)

_TYPES = ("null", "boolean", "object", "array", "string", "number")
_NON_OBJECT = ["null", "boolean", "array", "string", "number"]


def if_union(node: dict) -> dict:
    """node's if/then/else as anyOf: (if and then) or (not if and else)."""
    node = dict(node)
    condition, then, otherwise = node.pop("if"), node.pop("then", True), node.pop("else", True)
    node["anyOf"] = [{"allOf": [condition, then]}, {"allOf": [{"not": condition}, otherwise]}]
    return node


def negation_union(node: dict) -> dict | None:
    """node with its `not` as anyOf branches where it negates an object's properties (or an anyOf
    holding one: the others stay negated in each branch); None otherwise."""
    branches = _negated_branches(node["not"])
    if branches is None:
        return None
    node = {k: v for k, v in node.items() if k != "not"}
    node["anyOf"] = branches
    return node


def _negated_branches(negated) -> list | None:
    if not isinstance(negated, dict):
        return None
    keys = set(negated) - ANNOTATIONS
    if keys == {"anyOf"}:
        members = negated["anyOf"]
        for k, member in enumerate(members):
            branches = _negated_branches(member) if isinstance(member, dict) and (
                "anyOf" not in member) else None
            if branches is not None:
                others = members[:k] + members[k + 1:]
                return [{"allOf": [b, {"not": {"anyOf": others}}]} if others else b
                        for b in branches]
        return None
    if "properties" not in keys or not keys <= {"properties", "required", "type"} or (
            negated.get("type", "object") != "object"):
        return None
    # properties and required hold of every non-object: only a type makes those fail it
    branches: list = [{"type": _NON_OBJECT}] if "type" in keys else []
    for name, schema in negated["properties"].items():
        if schema is not True and schema != {}:  # present, and failing its schema
            fails = {} if schema is False else {"properties": {name: {"not": schema}}}
            branches.append({"type": "object", "required": [name], **fails})
    branches += [{"type": "object", "not": {"required": [name]}}
                 for name in negated.get("required", [])]
    return branches


def rewrite_not(node: dict, pointer: str) -> None:
    """Replace node's `not` with positive keywords that admit only values it admits."""
    negated = node.pop("not")
    if negated is False:
        return
    if negated is True or negated == {}:
        raise Unsatisfiable(f"the not at {where(pointer)} admits no value")
    negated = {k: v for k, v in negated.items() if k not in ANNOTATIONS}
    keys = set(negated)
    if keys == {"anyOf"}:  # none of the branches: each excluded in turn
        for branch in negated["anyOf"]:
            node["not"] = branch
            rewrite_not(node, pointer)
    elif keys == {"type"}:
        _exclude_types(node, set(as_list(negated["type"])), pointer)
    elif keys == {"required"}:
        _forbid_one(node, list(negated["required"]), pointer)
    elif keys in ({"enum"}, {"const"}) and set(as_list(node.get("type", []))) <= {
            "boolean", "null"} and "type" in node:
        values = negated["enum"] if "enum" in negated else [negated["const"]]
        refused = {json_text(v) for v in values}
        left = [v for t in as_list(node.pop("type"))
                for v in ([True, False] if t == "boolean" else [None])
                if json_text(v) not in refused]
        if not left:
            raise Unsatisfiable(f"the not at {where(pointer)} admits no value")
        node["enum"] = left
    else:
        raise refuse("not", pointer, "only not of types, of required names, of boolean or "
                                     "null values, or of anyOf of these is supported")


def _exclude_types(node: dict, excluded: set, pointer: str) -> None:
    if "number" in excluded:
        excluded.add("integer")
    current = as_list(node["type"]) if "type" in node else list(_TYPES)
    # not integer leaves the numbers with a fraction, which no grammar here says: dropped
    kept = [t for t in current if t not in excluded
            and not (t == "number" and "integer" in excluded)]
    if not kept:
        raise Unsatisfiable(f"the not at {where(pointer)} leaves no type")
    node["type"] = kept[0] if len(kept) == 1 else kept


def _forbid_one(node: dict, names: list, pointer: str) -> None:
    """Objects lacking one of names: the first not required is made absent, the object closed
    (stricter where it was open)."""
    if "object" not in as_list(node.get("type", "object")):
        raise Unsatisfiable(f"the not at {where(pointer)} admits no value")
    node["type"] = "object"  # required holds of every non-object: the not refuses them
    if "patternProperties" in node or "propertyNames" in node:
        raise refuse("not", pointer, "not of required names beside patternProperties or "
                                     "propertyNames is not supported")
    free = [n for n in names if n not in node.get("required", [])]
    if not free:
        raise Unsatisfiable(f"the not at {where(pointer)} refuses every object the "
                              f"required names allow")
    node["properties"] = {**node.get("properties", {}), free[0]: False}
    node["additionalProperties"] = False


# the arrays a uniqueItems is enumerated into, at most
MAX_UNIQUE_ARRAYS = 512


def rewrite_contains(node: dict, pointer: str) -> None:
    """contains / minContains k / maxContains as prefixItems (the first k items match it:
    stricter) and item counts; maxContains only where maxItems makes it moot."""
    contains = node.pop("contains")
    least = node.pop("minContains", 1)
    most = node.pop("maxContains", None)
    top = node.get("maxItems", math.inf)
    if contains is True or contains == {}:  # every item matches: counts of items
        node["minItems"] = max(node.get("minItems", 0), least)
        if most is not None:
            node["maxItems"] = min(top, most)
        return
    if most is not None and most < top:
        raise refuse("maxContains", pointer, "maxContains is only supported where maxItems "
                                             "is no larger")
    if least == 0:
        return
    if contains is False or least > top:
        raise Unsatisfiable(f"the contains at {where(pointer)} admits no array")
    if "prefixItems" in node:
        raise refuse("contains", pointer, "contains beside prefixItems is not supported")
    items = node.get("items", True)
    match = contains if items is True or items == {} else {"allOf": [contains, items]}
    node["prefixItems"] = [copy.deepcopy(match) for _ in range(least)]
    node["minItems"] = max(node.get("minItems", 0), least)


def rewrite_unique_items(node: dict, pointer: str) -> None:
    """node (items already rewritten) with uniqueItems true: the enum of its distinct arrays
    where items have few values, or nothing to do (at most one item), or refused."""
    top = node.get("maxItems", math.inf)
    if top <= 1:
        return
    values = None if node.get("prefixItems") else _finite_values(node.get("items"))
    if values is None:
        raise refuse("uniqueItems", pointer, "unique items are only enforced where items have "
                                             "few possible values (const, enum, boolean)")
    firsts: dict[str, Any] = {}
    for value in values:
        firsts.setdefault(value_key(value), value)
    distinct = list(firsts.values())
    least = node.get("minItems", 0)
    lengths = range(least, int(min(top, len(distinct))) + 1)
    count = sum(math.perm(len(distinct), n) for n in lengths)
    if count == 0:
        raise Unsatisfiable(f"the uniqueItems at {where(pointer)} admits no array")
    if count > MAX_UNIQUE_ARRAYS:
        raise refuse("uniqueItems", pointer, f"{count} unique arrays are too many to list "
                                             f"(at most {MAX_UNIQUE_ARRAYS})")
    arrays = [list(p) for n in lengths for p in itertools.permutations(distinct, n)]
    node.clear()
    node["enum"] = arrays


def _finite_values(items: Any) -> list | None:
    if not isinstance(items, dict):
        return None
    if set(items) == {"const"}:
        return [items["const"]]
    if set(items) == {"enum"}:
        return list(items["enum"])
    if set(items) == {"type"} and set(as_list(items["type"])) <= {"boolean", "null"}:
        return [v for t in as_list(items["type"])
                for v in ([True, False] if t == "boolean" else [None])]
    return None


# the integers a decimal divisor's rewrite admits lie within +-MULTIPLE_RANGE: each was checked
# to pass jsonschema's floating-point division (2 x 10**6 divisions, once per divisor)
MULTIPLE_RANGE = 10**6


def rewrite_multiple_of(node: dict, types: list, pointer: str) -> None:
    """node's multipleOf as one xgrammar enforces (an integer divisor): node becomes an integer
    schema; a decimal p/q is met by the integers p divides (stricter)."""
    divisor = node["multipleOf"]
    if types not in (["integer"], ["number"]):
        raise refuse("multipleOf", pointer, "multipleOf beside non-numeric types")
    node["type"] = "integer"
    if float(divisor).is_integer():
        node["multipleOf"] = int(divisor)
        return
    step = Fraction(repr(float(divisor))).numerator
    if not _division_agrees(float(divisor), step):
        raise refuse("multipleOf", pointer, f"multipleOf {divisor} cannot be enforced exactly")
    if step > 1:
        node["multipleOf"] = step
    else:
        del node["multipleOf"]
    node["minimum"] = max(node.get("minimum", -MULTIPLE_RANGE), -MULTIPLE_RANGE)
    node["maximum"] = min(node.get("maximum", MULTIPLE_RANGE), MULTIPLE_RANGE)


@lru_cache(maxsize=256)
def _division_agrees(divisor: float, step: int) -> bool:
    """Whether every multiple of step within MULTIPLE_RANGE / divisor is integral in floating
    point, as jsonschema computes it."""
    top = MULTIPLE_RANGE - MULTIPLE_RANGE % step
    quotients = np.arange(-top, top + 1, step, dtype=np.float64) / divisor  # (n,)
    return bool(np.all(quotients == np.trunc(quotients)))


# a multipleOf within bounds is enumerated up to this many values (xgrammar ignores the pair)
MAX_ENUMERATED_MULTIPLES = 256


def bounded_multiples(node: dict, pointer: str) -> None:
    """An integer node with multipleOf and bounds (already integers): its values as an enum."""
    step = node.get("multipleOf")
    if step is None or not ("minimum" in node or "maximum" in node):
        return
    if "minimum" not in node or "maximum" not in node or (
            (node["maximum"] - node["minimum"]) // step > MAX_ENUMERATED_MULTIPLES):
        raise refuse("multipleOf", pointer, f"multipleOf beside bounds is only supported for "
                                            f"at most {MAX_ENUMERATED_MULTIPLES} values")
    first = -(-node["minimum"] // step) * step
    values = list(range(first, node["maximum"] + 1, step))
    if not values:
        raise refuse("multipleOf", pointer, "no multiple lies within the bounds")
    node.clear()
    node["enum"] = values
