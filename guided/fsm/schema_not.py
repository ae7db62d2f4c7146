"""`not` for schema_check, in the forms a grammar can say positively: not of types (the
other types), of required names (one of them absent), of an enum over a boolean or null
(the other values), and of anyOf of these (each in turn). A not beside an enum or const is
no concern here: schema_check filters the values with jsonschema, `not` included.
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
    """Objects lacking one of names: the first that is not required is made absent, and
    undeclared keys are no longer generated (stricter where the object was open)."""
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
