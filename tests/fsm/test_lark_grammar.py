"""Lark grammars (vLLM's guided_grammar dialect) converted to the EBNF xgrammar compiles; what
is not converted is refused naming the dialect we take."""
from __future__ import annotations

import pytest

from guided.errors import ConstraintError
from guided.fsm.lark_grammar import is_lark, lark_to_ebnf

xgr = pytest.importorskip("xgrammar")

SQL = """
start: select_statement
select_statement: "SELECT " column " from " table " where " condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""
JSONISH = r"""
?start: value
?value: object
      | array
      | string
      | SIGNED_NUMBER -> number
      | "true" | "false" | "null"
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value  // a key and its value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
"""
TERMINALS = r"""
start: NAME "=" VALUE ("," NAME "=" VALUE)~0..2
NAME: ("a".."z")+
VALUE: /[0-9]+(\.[0-9]+)?/ | 'none'
"""


def accepts(ebnf: str, text: str) -> bool:
    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), text)


@pytest.mark.parametrize("grammar,good,bad", [
    (SQL, ["SELECT col_1 from table_2 where col_2=1"],
     ["SELECT col_3 from table_2 where col_2=1", "SELECT col_1 from table_2 where col_2=3"]),
    (JSONISH, ['{"a":[1,-2.5e3,"x\\"y"],"b":{}}', "[true,null]", "[]"],
     ['{"a" 1}', "[1,]", "tru"]),
    (TERMINALS, ["x=1", "ab=2.5,c=none,d=3"], ["x=1,a=2,b=3,c=4", "X=1", "x=1."]),
])
def test_lark_grammars_become_the_same_language(grammar, good, bad):
    assert is_lark(grammar)
    ebnf = lark_to_ebnf(grammar)
    assert not is_lark(ebnf) and ebnf.startswith("root ::= ")
    for text in good:
        assert accepts(ebnf, text), text
    for text in bad:
        assert not accepts(ebnf, text), text


@pytest.mark.parametrize("grammar,what", [
    ('start: "a" " "*\n%ignore " "', "%ignore"),
    ('start: "a"i', "flag"),
    ('start: /a+/i', "flag"),
    ("start: _sep{x, y}", "template"),
    ('rule: "a"', "no `start`"),
    ("start: x\n%import common.FROBNICATE", "FROBNICATE"),
    ('start: ("a"', "unclosed"),
])
def test_what_is_not_converted_is_refused_naming_the_dialect(grammar, what):
    with pytest.raises(ConstraintError, match=what) as e:
        lark_to_ebnf(grammar)
    assert "root ::=" in str(e.value)


def test_gbnf_is_not_taken_for_lark():
    assert not is_lark('root ::= "a" | b\nb ::= [0-9]+')
