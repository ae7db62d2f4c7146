"""A checked JSON schema as a regex, where its language is regular and the regex is exact: the
token-level DFA's input (guided/fsm/backends/dfa_backend.py).

The schema comes from schema_check.check_schema, rewritten into what the grammar must admit
(formats and short length bounds are patterns by then). outlines-core writes the regex, with
xgrammar's compact separators (", " and ": ") so that outputs read the same whichever backend
serves a request; a schema with a keyword its regex would not enforce exactly raises NotRegular
and stays on xgrammar.
"""
from __future__ import annotations

import json
import math

from outlines_core import json_schema as outlines_json
from outlines_core.json_schema import build_regex_from_schema

from guided.errors import ConstraintError
from guided.fsm.integer_ranges import integer_range_regex
from guided.fsm.schema_check import (
    ARRAY_KEYWORDS,
    NUMBER_KEYWORDS,
    OBJECT_KEYWORDS,
    STRING_KEYWORDS,
    TYPE_KEYWORDS,
)

# the assertion keywords whose outlines-core regex admits only values that validate (after
# schema_check's rewrite: formats and short length bounds are patterns by then)
EXACT_KEYWORDS = frozenset({"type", "properties", "required", "items", "enum", "const",
                            "minItems", "maxItems", "pattern", "anyOf", "oneOf",
                            "additionalProperties", "$ref", "$defs", "definitions"})
# every other assertion or applicator of the JSON Schema vocabularies keeps a schema on xgrammar
# (numeric bounds, for one, are dropped by outlines-core); keywords of no vocabulary are
# annotations (2020-12 ignores them, and so does outlines-core)
OTHER_KEYWORDS = (NUMBER_KEYWORDS | STRING_KEYWORDS | OBJECT_KEYWORDS | ARRAY_KEYWORDS | {
    "allOf", "not", "if", "then", "else", "format", "$dynamicRef", "$recursiveRef",
    "$dynamicAnchor", "$recursiveAnchor", "contentMediaType", "contentEncoding",
    "contentSchema"}) - EXACT_KEYWORDS
# larger regexes build indexes of seconds: xgrammar serves them. Smaller ones may still take a
# second or more (a 17.9k-character regex: 1.6 s; any-value subschemas, 13k: 1.1-1.5 s, against
# 0.2-0.3 s at 5-9k) where xgrammar takes milliseconds: the price of cheap rows
MAX_REGEX_CHARS = 32_000
_WS = "{WS}"  # a marker outlines-core cannot emit for a literal (it escapes braces)


class NotRegular(ConstraintError):
    """The schema has a part the DFA path would not enforce exactly: xgrammar serves it (the
    compiler catches this; it never reaches a client)."""


def schema_regex(schema: dict) -> str:
    """The regex of an already rewritten schema (schema_check.check_schema), with xgrammar's
    compact separators; raises NotRegular naming the first part it cannot serve exactly."""
    ranges: dict[str, str] = {}
    prepared = _prepared(schema, True, ranges)
    _ExactCheck(prepared).check(prepared, "")
    try:
        regex = build_regex_from_schema(json.dumps(prepared), whitespace_pattern=_WS)
    except BaseException as e:  # noqa: BLE001 - outlines-core raises (and panics, a
        # BaseException) on what it does not support
        raise NotRegular(f"outlines-core: {str(e)[:200]}") from None
    regex = (regex.replace(_WS + ":" + _WS, ": ").replace(_WS + "," + _WS, ", ")
             .replace("," + _WS, ", ").replace(_WS, ""))
    regex = _xgrammar_values(regex)
    for placeholder, integers in ranges.items():
        if regex.count(f'"{placeholder}"') < 1:
            raise NotRegular("an integer range was not written where expected")
        regex = regex.replace(f'"{placeholder}"', integers)
    if len(regex) > MAX_REGEX_CHARS:
        raise NotRegular(f"its regex has {len(regex)} characters (limit {MAX_REGEX_CHARS})")
    return regex


# outlines-core's value regexes -> xgrammar's JSON grammar's (any_whitespace off), so that the
# DFA and xgrammar admit the same strings: a request's output must not depend on which backend
# (or cache state: xgrammar serves a large schema while its DFA builds) served it
_XGRAMMAR_NUMBER = r"((-)?(0|[1-9][0-9]*))(\.[0-9]+)?([eE][+-]?[0-9]+)?"  # e5 as well as e+5
_XGRAMMAR_INTEGER = r"(0|-?[1-9][0-9]*)"  # no -0
# \u escapes and U+007F-U+009F raw, as JSON (and xgrammar) allow
_XGRAMMAR_STRING = r'"([^"\\\x00-\x1F]|\\["\\/bfnrt]|\\u[0-9A-Fa-f]{4})*"'
_NUMBER_MARK = "\0GUIDEDNUMBER\0"


def _xgrammar_values(regex: str) -> str:
    """outlines-core's numbers, integers and strings written as xgrammar admits them; a string
    regex of another shape (not expected here) keeps the schema on xgrammar."""
    regex = regex.replace(outlines_json.NUMBER, _NUMBER_MARK)  # it holds the integer's text
    regex = regex.replace(outlines_json.INTEGER, _XGRAMMAR_INTEGER)
    regex = regex.replace(_NUMBER_MARK, _XGRAMMAR_NUMBER)
    regex = regex.replace(outlines_json.STRING, _XGRAMMAR_STRING)
    if "\\x7F-\\x9F" in regex:
        raise NotRegular("a string regex outlines-core wrote in a form not aligned with xgrammar")
    return regex


# what makes a schema more than "any value"; without any of these outlines-core writes the
# any-value regex as a bare alternation, which binds past the property it is the value of
_SHAPING = frozenset({"type", "enum", "const", "$ref", "anyOf", "oneOf", "properties", "items",
                      "pattern", "additionalProperties", "minItems", "maxItems", "required"})
_ANY_TYPE = {"type": ["boolean", "null", "number", "string", "array", "object"]}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _prepared(node, is_schema: bool, ranges: dict[str, str]):
    """A copy for outlines-core: each any-value subschema (`true`, or one of annotations only)
    lists every type instead (the same language, written as a grouped alternation), and each
    bounded integer becomes a placeholder constant whose text `ranges` maps to its regex."""
    if not is_schema:
        return node
    if node is True or isinstance(node, dict) and (_SHAPING | OTHER_KEYWORDS).isdisjoint(node):
        return dict(_ANY_TYPE)  # annotations only: an assertion stays, for the check to see
    if not isinstance(node, dict):
        return node
    vacuous = _vacuous_keywords(node)
    if vacuous:
        node = {key: value for key, value in node.items() if key not in vacuous}
    bounded = _integer_placeholder(node, ranges)
    if bounded is not None:
        return bounded
    out = {}
    for key, value in node.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = _grouped_pattern(value)
        elif key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: _prepared(child, True, ranges) for name, child in value.items()}
        elif key in ("anyOf", "oneOf") and isinstance(value, list):
            out[key] = [_prepared(child, True, ranges) for child in value]
        elif key == "items" or key == "additionalProperties" and not isinstance(value, bool):
            out[key] = _prepared(value, True, ranges)  # additionalProperties: true is a flag
        else:
            out[key] = value
    return out


def _vacuous_keywords(node: dict) -> frozenset[str]:
    """The keywords of the types an explicit `type` excludes: they assert nothing, and
    outlines-core would build on them (`"type": "array"` beside `properties` came out as an
    object, which the type refuses)."""
    types = node.get("type")
    if isinstance(types, str):
        types = [types]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        return frozenset()
    allowed = set(types) | ({"number"} if "integer" in types else set())
    return frozenset().union(*(keywords for name, keywords in TYPE_KEYWORDS.items()
                               if name not in allowed))


def _grouped_pattern(pattern: str) -> str:
    """A pattern as outlines-core must get it: the whole-string match it stands for here (as
    for xgrammar) with its edge anchors dropped, in a group of its own (outlines-core writes it
    between the quotes as it is, so a top-level `|` split the quotes apart). An anchor anywhere
    else (Rust's regex takes it as an assertion no JSON string can meet) is refused."""
    body = pattern.removeprefix("^")
    if body.endswith("$") and not _escaped(body, len(body) - 1):
        body = body[:-1]
    in_class = False
    for i, char in enumerate(body):
        if _escaped(body, i):
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class and body[i - 1] != "[":
            in_class = False
        elif char in "^$" and not in_class:
            raise NotRegular(f"an anchor inside pattern {pattern!r}")
    return f"(?:{body})"


def _escaped(text: str, i: int) -> bool:
    """Whether text[i] follows an odd run of backslashes."""
    run = 0
    while i - run - 1 >= 0 and text[i - run - 1] == "\\":
        run += 1
    return run % 2 == 1


def _integer_placeholder(node: dict, ranges: dict[str, str]) -> dict | None:
    """{"type": "integer"} with numeric bounds and no other assertion: a placeholder constant
    for its range (None: not such a node, left as it is for the check)."""
    if node.get("type") != "integer" or node.keys().isdisjoint(_BOUNDS) or (
            _SHAPING - {"type"}) & node.keys() or any(
            key in OTHER_KEYWORDS and key not in _BOUNDS for key in node):
        return None
    values = {key: node[key] for key in _BOUNDS if key in node}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               for v in values.values()):
        return None
    lows = [math.ceil(values["minimum"])] if "minimum" in values else []
    lows += [math.floor(values["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in values else []
    highs = [math.floor(values["maximum"])] if "maximum" in values else []
    highs += [math.ceil(values["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in values else []
    lo, hi = max(lows, default=None), min(highs, default=None)
    if lo is not None and hi is not None and lo > hi:
        raise NotRegular("an integer range admits no value")
    placeholder = f"GUIDEDINTEGERRANGE{len(ranges)}X"
    ranges[placeholder] = integer_range_regex(lo, hi)
    return {"const": placeholder}


def _open_ended(node: dict) -> str | None:
    """What of a subschema admits any JSON value inside it (an object of any properties, an
    array of any items), which outlines-core writes only a few levels deep."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if "object" in types and ("properties" not in node
                              or node.get("additionalProperties") is True):
        return "an object of any properties"
    if "array" in types and not isinstance(node.get("items"), (dict, bool)):
        return "an array of any items"
    return None


class _ExactCheck:
    """Walks every subschema the regex is built from, the targets of local $refs included
    (wherever they live: a rewriter leaves refs into unusual places as they are)."""

    def __init__(self, root: dict):
        self.root = root
        self.seen: set[str] = set()
        self.active: list[str] = []  # pointers of the subschemas being walked, outermost first

    def check(self, node, pointer: str) -> None:
        self.active.append(pointer)
        try:
            self._check(node, pointer)
        finally:
            self.active.pop()

    def _check(self, node, pointer: str) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise NotRegular(f"{pointer or '/'} is not a schema")
        for key in node:
            if key in OTHER_KEYWORDS:
                raise NotRegular(f"keyword {key!r} at {pointer or '/'}")
        if "pattern" in node and ("minLength" in node or "maxLength" in node):
            raise NotRegular(f"pattern with length bounds at {pointer or '/'}")
        properties = node.get("properties", {})
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and not properties:
            raise NotRegular(f"additionalProperties schema without properties at {pointer or '/'}")
        open_ended = _open_ended(node)
        if open_ended:
            # outlines-core nests any-values 3 deep, xgrammar without a limit: not one language
            raise NotRegular(f"{open_ended} at {pointer or '/'}")
        if not set(node.get("required", ())) <= set(properties):
            raise NotRegular(f"required names a property not declared at {pointer or '/'}")
        if "$ref" in node:
            self._check_ref(node["$ref"], pointer)
        for name, child in properties.items():
            self.check(child, f"{pointer}/properties/{name}")
        for key in ("$defs", "definitions"):
            for name, child in node.get(key, {}).items():
                self.check(child, f"{pointer}/{key}/{name}")
        for key in ("anyOf", "oneOf"):
            for i, child in enumerate(node.get(key, ())):
                self.check(child, f"{pointer}/{key}/{i}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                self.check(node[key], f"{pointer}/{key}")

    def _check_ref(self, ref, pointer: str) -> None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise NotRegular(f"a $ref that is not local at {pointer or '/'}")
        target_pointer = ref[1:]
        if any(p == target_pointer or p.startswith(target_pointer + "/") for p in self.active):
            # outlines-core unrolls recursion to a fixed depth and closes it with `{}`, which
            # a required recursive property does not admit: xgrammar serves it exactly
            raise NotRegular(f"recursive $ref {ref!r} at {pointer or '/'}")
        if ref in self.seen:
            return
        self.seen.add(ref)
        target = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise NotRegular(f"$ref {ref!r} at {pointer or '/'} does not resolve")
            target = target[part]
        self.check(target, ref[1:])
