"""Grammar bounds: grammars that can never end, or force unbounded text, are refused from
xgrammar's own serialized grammar; every grammar that can end passes, and its forced walk is
then bounded (the matcher answers at once where it used to hang)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import xgrammar as xgr

from guided.errors import ConstraintError
from guided.fsm.grammar_bounds import (
    MAX_SHORTEST_BYTES,
    _Grammar,
    char_class_matches,
    check_grammar_bounds,
    schema_problem,
    shortest_texts,
)
from guided.params import ConstraintSpec

# ../shared/data beside the checkout (a worktree's is further up)
DATA = next((p / "shared" / "data" for p in Path(__file__).resolve().parents
             if (p / "shared" / "data").is_dir()), Path("/nonexistent"))


def ebnf(text: str) -> str:
    return xgr.Grammar.from_ebnf(text).serialize_json()


def regex(pattern: str) -> str:
    return xgr.Grammar.from_regex(pattern).serialize_json()


def schema(value: dict) -> str:
    return xgr.Grammar.from_json_schema(json.dumps(value), strict_mode=True,
                                        any_whitespace=False).serialize_json()


NEVER_ENDS = [
    ("grammar", 'root ::= "a" root', "no finite text matches its root rule"),
    ("grammar", 'root ::= "a" x\nx ::= "b" x "c"', "no finite text matches its root rule"),
    ("grammar", 'root ::= "b" | "a" x\nx ::= "c" x', "rule `x`"),
    ("grammar", 'root ::= "b" | "a" [^\\0-\\U0010ffff]', "rule `root`"),
    ("grammar", 'root ::= ("a" x)* "b"\nx ::= "q" x', "rule `x`"),
    ("regex", "[^\\s\\S]", "its language is empty"),
    ("regex", "a|b[^\\s\\S]c", "a branch that can never match"),
]


@pytest.mark.parametrize("kind,text,message", NEVER_ENDS, ids=[t for _, t, _ in NEVER_ENDS])
def test_grammars_that_can_never_end_are_refused(kind, text, message):
    serialized = ebnf(text) if kind == "grammar" else regex(text)
    with pytest.raises(ConstraintError, match=re.escape(message)):
        check_grammar_bounds(serialized, kind=kind)


def test_a_schema_that_requires_an_infinite_value_is_refused():
    infinite = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
    with pytest.raises(ConstraintError, match="no finite JSON value"):
        check_grammar_bounds(schema(infinite), kind="json_schema")
    finite = {"type": "object", "properties": {"next": {"$ref": "#"}}}  # {} ends it
    check_grammar_bounds(schema(finite), kind="json_schema")
    assert shortest(schema(finite))[0] == 2


def shortest(serialized: str) -> tuple[int, int]:
    """(the grammar's shortest text, the largest shortest text of any expression)."""
    grammar = _Grammar(json.loads(serialized))
    exprs, rules = shortest_texts(grammar)
    return int(rules[grammar.root]), int(max(e for e in exprs if e != float("inf")))


OBJ = {"type": "object"}
INFINITE_SCHEMAS = [
    {**OBJ, "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$ref": "#/$defs/n", "$defs": {"n": {**OBJ, "properties": {"m": {"$ref": "#/$defs/m"}},
                                          "required": ["m"]},
                                    "m": {"anyOf": [{"$ref": "#/$defs/n"}, False]}}},
    {"type": "array", "minItems": 2, "items": {"$ref": "#"}},
    {**OBJ, "required": ["x"], "additionalProperties": {"$ref": "#"}},
    {"allOf": [{"type": "integer"}, {"$ref": "#/definitions/a"}],
     "definitions": {"a": {"type": "array", "prefixItems": [{"$ref": "#/definitions/a"}],
                           "minItems": 1}}},
]
FINITE_SCHEMAS = [
    {**OBJ, "properties": {"a": {"$ref": "#"}}},  # {}
    {**OBJ, "properties": {"a": {"$ref": "#"}}, "required": ["a"], "type": ["object", "null"]},
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: 1 satisfies it
    {**OBJ, "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "string"}]}},
     "required": ["a"]},
    {**OBJ, "properties": {"a": {"$ref": "#"}}, "required": ["a"], "enum": [{"a": 1}]},
    {**OBJ, "properties": {"a": {"$ref": "other.json"}}, "required": ["a"]},
    {"type": "array", "minItems": 1, "items": [{"type": "integer"}], "additionalItems": False},
    {"type": "array", "items": {"$ref": "#"}},  # []
]


@pytest.mark.parametrize("value", INFINITE_SCHEMAS)
def test_schemas_no_finite_value_satisfies_are_refused_unbuilt(value):
    assert "no finite JSON value" in schema_problem(json.dumps(value))


@pytest.mark.parametrize("value", FINITE_SCHEMAS)
def test_schemas_a_finite_value_satisfies_pass(value):
    assert schema_problem(json.dumps(value)) is None


@pytest.mark.parametrize("text", ['root ::= "a"{1000000000}',
                                  'root ::= x{1000}\nx ::= "ab"{1000}',
                                  'root ::= "x" | "y" "a"{40000}'])
def test_unbounded_forced_text_is_refused(text):
    with pytest.raises(ConstraintError, match=f"the limit is {MAX_SHORTEST_BYTES}"):
        check_grammar_bounds(ebnf(text))


def test_a_long_minimum_array_is_refused_naming_its_size():
    long_array = {"type": "array", "items": {"type": "integer"}, "minItems": 20000}  # "[0, 0, ..."
    with pytest.raises(ConstraintError, match="at least 60000 bytes"):
        check_grammar_bounds(schema(long_array), kind="json_schema")


@pytest.mark.parametrize("text,shortest_bytes,longest", [
    ('root ::= "(" root ")" | "x"', 1, 3),  # recursion that can end
    ('root ::= [a-z]* "b" | x+\nx ::= "q"{2,100}', 1, 4),
    ('root ::= "a"{30000}', 30000, 30000),  # long, within the limit
    ('root ::= "" | "a" root', 0, 1),
    ('root ::= "b" | "a" y\ny ::= "q"\nunused ::= "c" unused', 1, 2),  # endless, not reached
])
def test_grammars_that_can_end_pass_with_their_bounds(text, shortest_bytes, longest):
    check_grammar_bounds(ebnf(text))
    assert shortest(ebnf(text)) == (shortest_bytes, longest)


@pytest.mark.parametrize("args,matches", [
    ([0, 97, 99], True), ([0], False), ([1], True), ([0, 99, 97], False),
    ([1, 0, 0x10FFFF], False), ([1, 0, 0xD7FF, 0xE000, 0x10FFFF], False),  # only surrogates
    ([1, 0, 0xD7FF, 0xE000, 0x10FFFE], True), ([0, 0xD800, 0xDFFF], False),
])
def test_character_classes(args, matches):
    assert char_class_matches(args) is matches


def test_no_schema_of_the_benchmark_corpus_is_refused():
    """The check refuses only what cannot end: real-world schemas all pass."""
    from guided.fsm.schema_worker import check

    path = DATA / "jsonschemabench" / "Github_medium.jsonl"
    if not path.exists():
        pytest.skip("no ../shared/data here")
    checked = 0
    for line in path.read_text().splitlines()[:80]:
        try:
            text = json.dumps(json.loads(line)["schema"])
        except ValueError:  # a line cut short in the corpus
            continue
        assert schema_problem(text) is None
        try:
            rewritten = check(text)
            serialized = schema(rewritten)
        except Exception:  # noqa: BLE001, S112 - schemas refused earlier are not this test's
            continue
        check_grammar_bounds(serialized, kind="json_schema")
        checked += 1
    assert checked >= 40


# ---- through the compiler, and the matcher's walk -----------------------------------------------

@pytest.mark.parametrize("spec", [
    ConstraintSpec("grammar", 'root ::= "a" root'),
    ConstraintSpec("regex", "[^\\s\\S]"),
    ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"$ref": "#"}},
                                "required": ["a"]}),
], ids=["grammar", "regex", "json_schema"])
def test_the_compiler_refuses_them_at_once(compiler, spec):
    future = compiler.submit(spec)
    assert future.done()  # checked on the submitting thread: no queue to wait in
    with pytest.raises(ConstraintError, match="never end|no finite|language is empty"):
        future.result(timeout=10)


def test_a_long_forced_run_is_walked_and_drafted_within_its_bound(compiler, tokenizer, vocab):
    from guided.fsm.jump_forward import propose_draft_tokens

    matcher = compiler.compile(ConstraintSpec("grammar", 'root ::= "a"{30000} "b"'),
                               timeout=30).matcher()
    assert matcher.forced_string() == b"a" * 30000 + b"b"
    drafts, num_forced = propose_draft_tokens(tokenizer, vocab.token_bytes, matcher, [],
                                              max_tokens=8)
    assert drafts == tokenizer.encode("a" * 30000, add_special_tokens=False)[:8]
    assert num_forced == 8
