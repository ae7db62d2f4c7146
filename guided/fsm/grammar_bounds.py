"""Grammars that can never end, or whose forced text is unbounded, refused before they compile.

xgrammar walks a forced continuation (`find_jump_forward_string`) in C++ without limit and
uninterruptibly: `root ::= "a" root` never returns, `"a"{1000000000}` walks a gigabyte. So,
from the structure `Grammar.serialize_json` gives (grammar_impl.h), every reachable expression
must match some finite text, and its shortest text be at most MAX_SHORTEST_BYTES (a forced
string is a prefix of the shortest completion): a 400 naming the rule, not a hung engine.
"""
from __future__ import annotations

import heapq
import json
from typing import Any

from guided.errors import ConstraintError
from guided.fsm.grammar_text import SURROGATES, complement
from guided.fsm.schema_merge import SchemaCombiner

# a forced walk of 32 KiB costs ~5 ms in xgrammar 0.2.8 on the CPU (1 MB: 0.33 s)
MAX_SHORTEST_BYTES = 1 << 15

# GrammarExprType of xgrammar's grammar_impl.h, in its order
BYTE_STRING, CHAR_CLASS, CHAR_CLASS_STAR, EMPTY, RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, \
    REPEAT = range(9)
_INF = float("inf")
_WHAT = {"regex": "the regex", "json_schema": "the JSON schema", "json_object": "the JSON grammar"}


class _Grammar:

    def __init__(self, data: dict):
        self.rule_names = [rule[0] for rule in data["rules"]]
        self.rule_bodies = [rule[1] for rule in data["rules"]]
        self.root = data["root_rule_id"]
        flat, indptr = data["grammar_expr_data"], data["grammar_expr_indptr"]
        self.kinds = [flat[start] for start in indptr]
        self.args = [flat[start + 2:start + 2 + flat[start + 1]] for start in indptr]

    def children(self, expr_id: int) -> tuple[list[int], list[int]]:
        """(sub-expression ids, rule ids) an expression refers to."""
        kind, args = self.kinds[expr_id], self.args[expr_id]
        if kind in (SEQUENCE, CHOICES):
            return list(args), []
        if kind in (RULE_REF, REPEAT):
            return [], [args[0]]
        if kind == TAG_DISPATCH:  # [tag0, rule0, tag1, rule1, ..., loop, excludes]
            return [], list(args[1:-2:2])
        return [], []


def char_class_matches(args: list[int]) -> bool:
    """Whether a character class [is_negated, lo0, hi0, ...] matches any character."""
    negated, ranges = args[0], list(zip(args[1::2], args[2::2]))
    if negated:
        return bool(complement([*ranges, SURROGATES]))
    return any(lo <= hi and not (SURROGATES[0] <= lo and hi <= SURROGATES[1])
               for lo, hi in ranges)


def shortest_texts(grammar: _Grammar) -> tuple[list[float], list[float]]:
    """(shortest text of every expression, of every rule) in bytes (a character counts 1; inf:
    none). Knuth's generalization of Dijkstra: values are finalized smallest first, sound as a
    sequence's value is at least each part's and a repetition's at least its rule's. (Runs in a
    compile thread holding the GIL the step loop needs: the grammar's lists are read directly.)"""
    kinds, args_of = grammar.kinds, grammar.args
    num_exprs, num_rules = len(kinds), len(grammar.rule_bodies)
    # node ids: expressions 0..num_exprs-1, rules num_exprs..num_exprs+num_rules-1
    value = [_INF] * (num_exprs + num_rules)
    parents: list[list[int]] = [[] for _ in range(num_exprs + num_rules)]
    pending = [0] * num_exprs  # a sequence's parts not final yet
    heap: list[tuple[float, int]] = []
    for expr_id, kind in enumerate(kinds):
        args = args_of[expr_id]
        if kind == SEQUENCE or kind == CHOICES:
            for child in args:
                parents[child].append(expr_id)
            pending[expr_id] = len(args)
            if kind == SEQUENCE and not args:
                heap.append((0.0, expr_id))
        elif kind == RULE_REF or (kind == REPEAT and args[1] > 0):
            parents[num_exprs + args[0]].append(expr_id)
        elif kind == BYTE_STRING:
            heap.append((float(len(args)), expr_id))
        elif kind == CHAR_CLASS:
            if char_class_matches(args):  # else it matches no character: never final
                heap.append((1.0, expr_id))
        else:  # empty string, class star, tag dispatch (free text), a repetition of none, newer
            heap.append((0.0, expr_id))
    for rule, body in enumerate(grammar.rule_bodies):
        parents[body].append(num_exprs + rule)
    heapq.heapify(heap)
    final = [False] * (num_exprs + num_rules)
    sums = [0.0] * num_exprs
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        node_value, node = pop(heap)
        if final[node]:
            continue
        final[node], value[node] = True, node_value
        for parent in parents[node]:
            if final[parent]:
                continue
            if parent >= num_exprs:  # a rule: its body's value
                push(heap, (node_value, parent))
                continue
            kind = kinds[parent]
            if kind == SEQUENCE:
                sums[parent] += node_value
                pending[parent] -= 1
                if pending[parent] == 0:
                    push(heap, (sums[parent], parent))
            elif kind == REPEAT:
                push(heap, (args_of[parent][1] * node_value, parent))
            else:  # choices (the first part final is the shortest) or a rule reference
                push(heap, (node_value, parent))
    return value[:num_exprs], value[num_exprs:]


def check_grammar_bounds(serialized: str, *, kind: str = "grammar") -> None:
    """Raise ConstraintError where the grammar (serialize_json) matches no finite text, reaches
    an expression that can never end, or one whose shortest text exceeds MAX_SHORTEST_BYTES."""
    grammar = _Grammar(json.loads(serialized))
    expr_min, rule_min = shortest_texts(grammar)
    if rule_min[grammar.root] == _INF:
        raise ConstraintError(_never_ends(kind))
    if max(expr_min, default=0.0) <= MAX_SHORTEST_BYTES:
        return  # no expression at all is endless or too long: none reachable is (the usual case)
    seen_rules, seen_exprs = {grammar.root}, set()
    stack = [(grammar.rule_bodies[grammar.root], grammar.root)]
    while stack:
        expr_id, rule = stack.pop()
        if expr_id in seen_exprs:
            continue
        seen_exprs.add(expr_id)
        value = expr_min[expr_id]
        if value == _INF:
            raise ConstraintError(_dead_end(kind, grammar.rule_names[
                _dead_rule(grammar, expr_id, rule, expr_min, rule_min)]))
        if value > MAX_SHORTEST_BYTES:
            raise ConstraintError(
                f"{_WHAT.get(kind, 'the grammar')} forces at least {int(value)} bytes of text in rule "
                f"`{grammar.rule_names[rule]}`; the limit is {MAX_SHORTEST_BYTES}")
        sub, refs = grammar.children(expr_id)
        stack.extend((e, rule) for e in sub)
        for ref in refs:
            if ref not in seen_rules:
                seen_rules.add(ref)
                stack.append((grammar.rule_bodies[ref], ref))


def _dead_rule(grammar: _Grammar, expr_id: int, rule: int, expr_min: list[float],
               rule_min: list[float]) -> int:
    """The rule to name for a never-ending expression: the first such rule it refers to, else
    its own."""
    stack = [expr_id]
    while stack:
        sub, refs = grammar.children(stack.pop())
        for ref in refs:
            if rule_min[ref] == _INF:
                return ref
        stack.extend(e for e in sub if expr_min[e] == _INF)
    return rule


def _dead_end(kind: str, rule_name: str) -> str:
    if kind == "regex":
        return ("the regex has a branch that can never match to its end (e.g. an empty "
                "character class such as [^\\s\\S])")
    if kind in ("json_schema", "json_object"):
        return ("the JSON schema has a part no finite value satisfies (e.g. a required "
                "property that refers back to its own object)")
    return (f"the grammar can never end once it enters rule `{rule_name}`: no finite text "
            "completes it (a rule that only recurses into itself, or a character class that "
            "matches nothing)")


def _never_ends(kind: str) -> str:
    if kind == "regex":
        return "the regex matches no text at all (its language is empty)"
    if kind == "json_schema":
        return ("no finite JSON value satisfies the schema (e.g. a required property refers "
                "back to its own object)")
    return ("the grammar can never end: no finite text matches its root rule (e.g. "
            "`root ::= \"a\" root` forces \"a\" forever)")


def schema_problem(text: str) -> str | None:
    """Why no finite JSON value satisfies a schema (required properties or items recursing
    without end), read from the schema in milliseconds; else None. A superset reading (keywords
    that only narrow are ignored, an unresolved $ref admits anything): a refusal is sure."""
    try:
        schema = json.loads(text)
    except ValueError:
        return None  # the compile says why
    nodes, stack = [], [schema]
    while stack:  # every object in the document: the subschemas, and what $refs point to
        item = stack.pop()
        if isinstance(item, dict):
            nodes.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    finite: set[int] = set()  # ids of the nodes some finite value satisfies: a least fixpoint
    grown = True
    while grown:
        new = [id(n) for n in reversed(nodes)
               if id(n) not in finite and _can_end(n, schema, finite)]
        finite.update(new)
        grown = bool(new)
    return _never_ends("json_schema") if not _ends(schema, finite) else None


def _ends(schema: Any, finite: set[int]) -> bool:
    return id(schema) in finite if isinstance(schema, dict) else schema is not False


def _can_end(node: dict, root: Any, finite: set[int]) -> bool:
    """Whether some finite value satisfies node, given the nodes known to end."""
    ref = node.get("$ref")
    if isinstance(ref, str) and not _ends(_resolve(root, ref), finite):
        return False
    branches = [node.get(key) for key in ("anyOf", "oneOf") if isinstance(node.get(key), list)]
    if not all(any(_ends(s, finite) for s in b) for b in branches) or not all(
            _ends(s, finite) for s in _as_list(node.get("allOf"))):
        return False
    types = node.get("type", "any")
    types = {t if isinstance(t, str) else "any"
             for t in (types if isinstance(types, list) else [types])}
    if "enum" in node or "const" in node or types - {"object", "array"}:
        return True
    if "object" in types:
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = True if "patternProperties" in node else node.get("additionalProperties", True)
        if all(_ends(props.get(name, extra), finite) for name in _as_list(node.get("required"))
               if isinstance(name, str)):
            return True
    if "array" in types:
        least = node.get("minItems") if isinstance(node.get("minItems"), int) else 0
        items = node.get("items", True)
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        if isinstance(items, list):  # draft 4-7 tuples
            prefix, items = items, node.get("additionalItems", True)
        needed = prefix[:least] + ([items] if least > len(prefix) else [])
        return all(_ends(s, finite) for s in needed)
    return False


def _resolve(root: Any, ref: str) -> Any:
    """A local ref's target; None where it is none."""
    try:
        return SchemaCombiner(root).resolve(ref, "")
    except ConstraintError:
        return None


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else []
