"""Lark grammars (vLLM's guided_grammar takes them) converted to xgrammar's EBNF: rules and
terminals, literals, /regex/, "a".."z", ( ) [ ] ? * + ~ n, aliases, %import of common terminals.
Anything else (%ignore, templates, flags) is refused naming the dialect we take."""
from __future__ import annotations

import ast
import json
import re

from guided.errors import ConstraintError

_HEADER = re.compile(r"^\s*[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?\s*:(?!:)\s*(.*)$")
_TOKEN = re.compile(r"""
    (?P<ws>\s+|//[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')(?P<sflags>[a-z]*)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/)(?P<rflags>[a-z]*)
  | (?P<alias>->\s*\w+)
  | (?P<range>\.\.)
  | (?P<name>[A-Za-z_]\w*)
  | (?P<number>\d+)
  | (?P<op>[()\[\]|?*+~,{}])
""", re.VERBOSE)
# lark's common.lark terminals people %import, as EBNF
_COMMON = {
    "DIGIT": "[0-9]", "HEXDIGIT": "[a-fA-F0-9]", "INT": "[0-9]+",
    "SIGNED_INT": '[+\\-]? [0-9]+', "DECIMAL": '[0-9]+ "." [0-9]* | "." [0-9]+',
    "NUMBER": 'Regex("[0-9]+(\\\\.[0-9]*)?([eE][+-]?[0-9]+)?|\\\\.[0-9]+([eE][+-]?[0-9]+)?")',
    "SIGNED_NUMBER": 'Regex("[+-]?([0-9]+(\\\\.[0-9]*)?([eE][+-]?[0-9]+)?|\\\\.[0-9]+'
                     '([eE][+-]?[0-9]+)?)")',
    "LCASE_LETTER": "[a-z]", "UCASE_LETTER": "[A-Z]", "LETTER": "[a-zA-Z]",
    "WORD": "[a-zA-Z]+", "CNAME": "[a-zA-Z_] [a-zA-Z0-9_]*",
    "WS_INLINE": "[ \\t]+", "WS": "[ \\t\\f\\r\\n]+", "NEWLINE": '("\\r"? "\\n")+',
    "ESCAPED_STRING": 'Regex("\\"([^\\"\\\\\\\\]|\\\\\\\\.)*\\"")',
}
DIALECT = ("this server compiles GBNF-style EBNF (xgrammar's dialect: `root ::= \"a\" rule`, "
           "rules `name ::= ...`)")


def is_lark(text: str) -> bool:
    """Lark rather than GBNF: no `::=`, and a line that starts a `name:` rule."""
    return "::=" not in text and any(_HEADER.match(line) for line in text.splitlines())


def _refuse(what: str) -> ConstraintError:
    return ConstraintError(f"the Lark grammar uses {what}, which guided does not convert; "
                           f"{DIALECT}")


def lark_to_ebnf(text: str) -> str:
    rules: list[tuple[str, list[str]]] = []
    imports: list[str] = []
    for line in text.splitlines():
        stripped = line.split("//", 1)[0].strip() if not line.strip().startswith("/") else ""
        if not stripped:
            continue
        if stripped.startswith("%"):
            imports.append(_directive(stripped))
            continue
        header = _HEADER.match(line)
        if header and not stripped.startswith("|"):
            rules.append((header.group(1), [header.group(2)]))
        elif rules:
            rules[-1][1].append(stripped)
        else:
            raise _refuse(f"a line that is no rule: {stripped[:40]!r}")
    if not any(name == "start" for name, _ in rules):
        raise ConstraintError(f"the Lark grammar has no `start` rule; {DIALECT}")
    out = [f"{_name(name)} ::= {_body(' '.join(parts))}" for name, parts in rules]
    defined = {name for name, _ in rules}
    out += [f"{name} ::= {_COMMON[name]}" for name in imports if name not in defined]
    return "\n".join(out)


def _directive(line: str) -> str:
    match = re.fullmatch(r"%import\s+common\.([A-Z_]+)", line)
    if match is None:
        raise _refuse(f"the directive {line.split()[0]!r} ({line[:40]!r})")
    if match.group(1) not in _COMMON:
        raise _refuse(f"%import common.{match.group(1)}")
    return match.group(1)


def _name(name: str) -> str:
    return "root" if name == "start" else "root_" if name == "root" else name


def _body(body: str) -> str:
    out: list[str] = []
    closers: list[str] = []
    pos = 0
    while pos < len(body):
        m = _TOKEN.match(body, pos)
        if m is None:
            raise _refuse(f"the text {body[pos:pos + 20]!r}")
        pos = m.end()
        kind = m.lastgroup if m.lastgroup not in ("sflags", "rflags") else (
            "string" if m.group("string") else "regex")
        if kind in ("ws", "alias"):
            continue
        if kind == "string":
            if m.group("sflags"):
                raise _refuse(f"the literal flag {m.group('sflags')!r}")
            out.append(json.dumps(ast.literal_eval(m.group("string")), ensure_ascii=False))
        elif kind == "regex":
            if m.group("rflags"):
                raise _refuse(f"the regex flag {m.group('rflags')!r}")
            pattern = m.group("regex")[1:-1].replace("\\/", "/")
            out.append(f"Regex({json.dumps(pattern)})")
        elif kind == "range":
            out.append(_char_range(out.pop() if out else "", body, pos))
            pos = _TOKEN.match(body, _skip_ws(body, pos)).end()
        elif kind == "name":
            out.append(_name(m.group("name")))
        else:
            pos = _operator(m.group(0), body, pos, out, closers)
    if closers:
        raise _refuse("an unclosed bracket")
    return " ".join(out)


def _skip_ws(body: str, pos: int) -> int:
    while pos < len(body) and body[pos].isspace():
        pos += 1
    return pos


def _char_range(left: str, body: str, pos: int) -> str:
    m = _TOKEN.match(body, _skip_ws(body, pos))
    low = json.loads(left) if left.startswith('"') else None
    high = ast.literal_eval(m.group("string")) if m and m.group("string") else None
    if not (isinstance(low, str) and isinstance(high, str) and len(low) == len(high) == 1):
        raise _refuse('a range that is not "a".."z"')

    def char(c: str) -> str:  # characters that end or open a class are escaped
        return "\\" + c if c in "]\\-^" else c

    return f"[{char(low)}-{char(high)}]"


def _operator(op: str, body: str, pos: int, out: list[str], closers: list[str]) -> int:
    if op in "([":
        closers.append(")" if op == "(" else ")?")
        out.append("(")
    elif op in ")]":
        if not closers or (op == "]") != (closers[-1] == ")?"):
            raise _refuse("unbalanced brackets")
        out.append(closers.pop())
    elif op == "~":
        m = re.compile(r"\s*(\d+)(?:\s*\.\.\s*(\d+))?").match(body, pos)
        if m is None:
            raise _refuse("a ~ without a count")
        low, high = m.group(1), m.group(2) or m.group(1)
        out.append(f"{{{low},{high}}}")
        return m.end()
    elif op in "{},":
        raise _refuse("rule templates ({...})")
    else:  # | ? * +
        out.append(op)
    return pos
