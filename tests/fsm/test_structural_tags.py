"""Structural tags: both forms checked (their schemas through schema_check, fail closed) and
compiled by xgrammar: free text, and inside a tag its schema's JSON."""
from __future__ import annotations

import json

import pytest

from guided.errors import ConstraintError
from guided.fsm.backends.xgrammar_backend import Recipe, grammar_of
from guided.fsm.structural_tags import checked_structural_tag

xgr = pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
LEGACY = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER,
                          "end": "</function>"}], "triggers": ["<function="]}
FORMAT = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<tool>"], "tags": [
        {"type": "tag", "begin": "<tool>", "content": {"type": "json_schema",
                                                       "json_schema": WEATHER}, "end": "</tool>"}]}}


def accepts(tag: dict, text: str) -> bool:
    grammar = grammar_of(Recipe("structural_tag", checked_structural_tag(json.dumps(tag))))
    return xgr.testing._is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("tag,begin,end", [(LEGACY, "<function=get_weather>", "</function>"),
                                           (FORMAT, "<tool>", "</tool>")])
def test_free_text_then_tagged_json(tag, begin, end):
    assert accepts(tag, "Just some text, no call.")
    assert accepts(tag, f'Let me look. {begin}{{"city": "Oslo"}}{end} Done.')
    assert not accepts(tag, f'{begin}{{"city": 5}}{end}')
    assert not accepts(tag, f'{begin}{{"city": "Oslo", "x": 1}}{end}')


@pytest.mark.parametrize("tag,begin,end", [(LEGACY, "<function=get_weather>", "</function>"),
                                           (FORMAT, "<tool>", "</tool>")])
def test_whitespace_inside_a_tag_is_bounded(tag, begin, end):
    """xgrammar's default inside a tag is any whitespace: SGLang's structural-tag test got
    indented JSON, where a small model can loop on newlines."""
    assert accepts(tag, f'{begin}{{\n "city": "Oslo"\n}}{end}')
    assert not accepts(tag, f'{begin}{{\n\n\n"city": "Oslo"}}{end}')
    own = {"type": "structural_tag", "format": {**FORMAT["format"], "tags": [{
        **FORMAT["format"]["tags"][0], "content": {"type": "json_schema", "json_schema": WEATHER,
                                                    "max_whitespace_cnt": 4}}]}}
    assert accepts(own, '<tool>{\n\n\n"city": "Oslo"}</tool>')  # the client's own bound wins


@pytest.mark.parametrize("tag,words", [
    ({"structures": [{"begin": "<a>", "schema": {"not": {"type": "string"}, "type": "integer",
                                                   "uniqueItems": True}, "end": "</a>"}],
      "triggers": ["<a>"]}, r"structures\[0\]: unsupported JSON Schema keyword 'uniqueItems'"),
    ({"structures": [], "triggers": ["<a>"]}, "non-empty"),
    ({"structures": [{"begin": "<b>", "schema": {}, "end": "</b>"}], "triggers": ["<a>"]},
     "none of the triggers"),
    ({"triggers": ["<a>"]}, "structures"),
    ([1], "object"),
])
def test_bad_tags_are_refused_naming_the_problem(tag, words):
    """Malformed tags, and schemas inside with a keyword xgrammar would ignore (fail closed)."""
    with pytest.raises(ConstraintError, match=words):
        checked_structural_tag(json.dumps(tag))
