"""Array keywords for schema_check that xgrammar 0.2.8 ignores: uniqueItems and contains.

- uniqueItems over items of few possible values (const, enum, boolean, null): the arrays of
  distinct values the bounds allow, listed as an enum of arrays (exact);
- contains (with minContains k): the first k items must match it (prefixItems): a subset of
  the arrays that contain k matches, never more; maxContains only where maxItems makes it moot.
"""
from __future__ import annotations

import copy
import itertools
import math
from typing import Any

from guided.fsm.schema_merge import Unsatisfiable, as_list, refuse, value_key, where

# the arrays a uniqueItems is enumerated into, at most
MAX_UNIQUE_ARRAYS = 512


def rewrite_contains(node: dict, pointer: str) -> None:
    """Replace contains / minContains / maxContains with prefixItems and item counts."""
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
    """node (items already rewritten) with uniqueItems true: the enum of its unique arrays, or
    nothing to do (at most one item), or refused."""
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
