"""multipleOf for schema_check: xgrammar enforces it on integers by an integer divisor only.

A decimal divisor p/q is met by the integers p divides (stricter: no fractions), checked against
jsonschema's floating-point division over every integer admitted (bounded for it). xgrammar
ignores multipleOf beside a range: a bounded one becomes the enum of its few values, or refused.
"""
from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

import numpy as np

from guided.fsm.schema_merge import refuse

# the integers a decimal divisor's rewrite admits lie within +-MULTIPLE_RANGE: each was checked
# to pass jsonschema's floating-point division (2 x 10**6 divisions, once per divisor)
MULTIPLE_RANGE = 10**6


def rewrite_multiple_of(node: dict, types: list, pointer: str) -> bool:
    """node's multipleOf as one xgrammar enforces: node becomes an integer schema (True)."""
    divisor = node["multipleOf"]
    if types not in (["integer"], ["number"]):
        raise refuse("multipleOf", pointer, "multipleOf beside non-numeric types")
    node["type"] = "integer"
    if float(divisor).is_integer():
        node["multipleOf"] = int(divisor)
        return True
    step = Fraction(repr(float(divisor))).numerator
    if not _division_agrees(float(divisor), step):
        raise refuse("multipleOf", pointer, f"multipleOf {divisor} cannot be enforced exactly")
    if step > 1:
        node["multipleOf"] = step
    else:
        del node["multipleOf"]
    node["minimum"] = max(node.get("minimum", -MULTIPLE_RANGE), -MULTIPLE_RANGE)
    node["maximum"] = min(node.get("maximum", MULTIPLE_RANGE), MULTIPLE_RANGE)
    return True


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
