"""`not` for schema_check, in the forms a grammar can say positively: not of types, of required
names, of an enum over a boolean or null, and of anyOf of these. A not of an object's properties
is a union (negation_union), and so is if/then/else (if_union): schema_check rewrites their
branches like anyOf's.
"""
from __future__ import annotations

from guided.fsm.schema_merge import (
    ANNOTATIONS,
    Unsatisfiable,
    as_list,
    json_text,
    refuse,
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
