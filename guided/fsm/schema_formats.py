"""String keywords for schema_check: `format` -> exact regex patterns, and `pattern` checks."""
from __future__ import annotations

import math
import re
import re._parser as sre_parse

from guided.errors import ConstraintError
from guided.fsm.schema_merge import as_list, refuse, where

_DATE = (r"(?:(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-(?:(?:0[13578]|1[02])-"
         r"(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|"
         r"2[0-8]))|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])"
         r"00)-02-29)")
_TIME = (r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?"
         r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
# a DNS label with single inner hyphens (never an "xn--" A-label, which needs IDNA validation);
# at most 3 labels keeps a name under 253 characters
_LABEL = r"[A-Za-z0-9](?:-?[A-Za-z0-9]){0,31}"
_HOSTNAME = rf"{_LABEL}(?:\.{_LABEL}){{0,2}}"
_LOCAL_PART = r"[A-Za-z0-9_%+-]{1,32}(?:\.[A-Za-z0-9_%+-]{1,32}){0,2}"
# RFC 6901: "/"-separated tokens, "~" only as ~0 or ~1
_POINTER = r'(?:/(?:[^/~"\\\x00-\x1f]|~[01])*)*'
# formats jsonschema's checker enforces, as patterns that admit only valid strings
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "ipv4": rf"^(?:{_OCTET}\.){{3}}{_OCTET}$",
    "email": rf"^{_LOCAL_PART}@{_LABEL}(?:\.{_LABEL}){{1,2}}$",
    "hostname": f"^{_HOSTNAME}$",
    # the full form only (eight groups, no "::" and no zone): a subset of the format
    "ipv6": r"^[0-9a-fA-F]{1,4}(?::[0-9a-fA-F]{1,4}){7}$",
    "json-pointer": f"^{_POINTER}$",
    # jsonschema refuses a 0 after any digit (it reads "10" as a leading zero): none then
    "relative-json-pointer": f"^(?:0|[1-9]+)(?:#|{_POINTER})$",
    # text without regex syntax: always a valid regex, a subset of the format
    "regex": r'^[^\\\[\](){}*+?|"\x00-\x1f]*$',
}
# formats jsonschema checks here that we cannot enforce exactly
UNENFORCEABLE_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference",
                                   "uri-template"})
# formats xgrammar enforces (jsonschema checks them with its [format] extras)
XGRAMMAR_FORMATS = frozenset({"uri", "uri-reference", "duration"})
# regex syntax whose meaning differs between xgrammar and Python's re: lookaround (ignored),
# negated classes \D \W \S (ASCII-only there), \b, \p, backreferences (do not compile)
_BAD_REGEX = re.compile(r"\(\?[=!<]|\\[DWSbBpPk1-9]|\[\^[^\]]*\\[dws]")
# a class (a leading ']' is a member); over a regex, one atom: an escape, a class or a character
_CLASS = r"\[\^?\]?(?:\\.|[^\]\\])*\]"
REGEX_ATOM = re.compile(rf"\\.|{_CLASS}|.", re.DOTALL)

# one string character that needs no escape (xgrammar admits none in a pattern's string): counted
# up to MAX_PATTERN_LENGTH it masks ~10x faster than xgrammar's minLength / maxLength
_PLAIN_CHAR = r'[^"\\\x00-\x1f]'
MAX_PATTERN_LENGTH = 64


def length_pattern(min_length: int, max_length: int | None) -> str:
    """A pattern for strings of min_length..max_length characters, none of them escaped."""
    return f"^{_PLAIN_CHAR}{{{min_length},{'' if max_length is None else max_length}}}$"


def rewrite_string(node: dict, pointer: str) -> None:
    pattern, fmt = node.get("pattern"), node.get("format")
    bounds = [node[k] for k in ("minLength", "maxLength") if isinstance(node.get(k), int)]
    if (pattern is None and fmt is None and bounds and max(bounds) <= MAX_PATTERN_LENGTH
            and "string" in as_list(node.get("type", "string"))):
        node["pattern"] = length_pattern(node.pop("minLength", 0), node.pop("maxLength", None))
        return
    if pattern is not None:
        check_pattern(pattern, "pattern", pointer)
        _set_pattern(node, pattern, pointer)
    if fmt is None or "string" not in as_list(node.get("type", "string")):
        node.pop("format", None)
        return
    if fmt in FORMAT_PATTERNS:
        if "pattern" in node:
            raise refuse("pattern", pointer, f"'pattern' together with format '{fmt}' is not "
                                             f"supported")
        _set_pattern(node, FORMAT_PATTERNS[node.pop("format")], pointer)
    elif fmt in UNENFORCEABLE_FORMATS:
        raise refuse("format", pointer, f"format '{fmt}' cannot be enforced; supported: "
                     f"{sorted(FORMAT_PATTERNS) + sorted(XGRAMMAR_FORMATS)}")
    elif fmt in XGRAMMAR_FORMATS:
        # xgrammar ignores pattern and length bounds beside a format
        for kw in ("pattern", "minLength", "maxLength"):
            if kw in node:
                raise refuse(kw, pointer, f"'{kw}' together with format '{fmt}' is not "
                                          f"supported")
    else:
        node.pop("format")  # a format no validator checks: dropping it is exact


def _set_pattern(node: dict, pattern: str, pointer: str) -> None:
    """node's pattern, its length bounds folded in (kept where the pattern's lengths fit)."""
    if "minLength" in node or "maxLength" in node:
        pattern = bounded_pattern(pattern, node.pop("minLength", 0), node.pop("maxLength", None),
                                  pointer)
    node["pattern"] = fix_optional_groups(pattern)


def whole_match_body(pattern: str) -> str:
    """The pattern as the grammar matches it, whole: its edge anchors dropped."""
    body = pattern.removeprefix("^")
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    return body


def check_pattern(pattern: str, keyword: str, pointer: str) -> None:
    """Refuse a regex whose meaning differs between the grammar backend and Python's re."""
    if _BAD_REGEX.search(pattern) or _misplaced_anchor(pattern):
        raise refuse(keyword, pointer, f"regex {pattern!r} uses syntax (lookaround, \\b, \\p, "
                     f"backreferences, or negated \\d \\w \\s classes) that cannot be "
                     f"enforced exactly")


def fix_optional_groups(pattern: str) -> str:
    """A group's `?` as `{0,1}` (the same language): xgrammar 0.2.8 compiles `x(ab+)?` to also
    admit "xb", `x(ab+){0,1}` correctly."""
    out: list[str] = []
    for atom in REGEX_ATOM.findall(pattern):
        if atom == "?" and out and out[-1] == ")":
            out[-1] = "){0,1}"
        else:
            out.append(atom)
    return "".join(out)


def _misplaced_anchor(pattern: str) -> bool:
    """True if ^ or $ sits where it is not the start/end of an alternative: xgrammar drops such
    anchors, which would widen the language (e.g. 'a$b' matches nothing)."""
    for match in REGEX_ATOM.finditer(pattern):
        i, c = match.start(), match.group()
        if (c == "^" and pattern[:i].rstrip("(")[-1:] not in ("", "|")
                or c == "$" and pattern[i + 1:].lstrip(")")[:1] not in ("", "|")):
            return True
    return False


# a top-level piece of a pattern: a class, an escape, a group or one character, and its
# quantifier (greedy or lazy)
_PIECE = re.compile(rf"({_CLASS}|\\.|\((?:\\.|{_CLASS}|[^()])*\)|[^|()])"
                    r"((?:[?*+]|\{\d+(?:,\d*)?\})\??)?")


def bounded_pattern(pattern: str, min_length: int, max_length: int | None, pointer: str) -> str:
    """`pattern` with minLength / maxLength folded in (the grammar matches it whole): bounds its
    whole matches meet are dropped; repetitions beside fixed-width pieces get their counts
    narrowed (`^[a-z]+$`, maxLength 8 -> `^[a-z]{1,8}$`); anything else is refused."""
    keyword = "maxLength" if max_length is not None else "minLength"
    body = whole_match_body(pattern)
    head = "^" if pattern.startswith("^") else ""
    tail = "$" if len(head) + len(body) < len(pattern) else ""
    top = max_length if max_length is not None else math.inf
    try:
        low, high = sre_parse.parse(body).getwidth()
    except (re.error, RecursionError, OverflowError):
        raise refuse(keyword, pointer, "length bounds beside a pattern it cannot analyse") from None
    if low >= min_length and high <= top:
        return pattern
    pieces = _pieces(body)
    while pieces is not None and len(pieces) == 1 and not pieces[0][1] and (
            pieces[0][0].startswith("(")):  # one group, as a whole: its own pieces
        inner = pieces[0][0][1:-1]
        pieces = _pieces(inner.removeprefix("?:"))
    if pieces is None:
        raise refuse(keyword, pointer, "length bounds beside this pattern cannot be enforced "
                                       "exactly (only beside one repetition of fixed width)")
    fixed, variable = 0, []
    for i, (atom, quantifier) in enumerate(pieces):
        width = sre_parse.parse(atom).getwidth()
        counts = _counts(quantifier)
        if width[0] != width[1] or width[0] == 0:
            raise refuse(keyword, pointer, "length bounds beside a pattern piece of varying "
                                           "width cannot be enforced exactly")
        if counts[0] == counts[1]:
            fixed += width[0] * counts[0]
        else:
            variable.append((i, width[0], counts))
    if not variable:
        raise refuse(keyword, pointer, "the pattern's whole matches never have these lengths")
    counts = _share_lengths(variable, min_length - fixed, top - fixed)
    if counts is None:
        raise ConstraintError(f"the pattern {pattern!r} and the length bounds at "
                              f"{where(pointer)} admit no string together")
    for (i, _, _), (least, most) in zip(variable, counts):
        span = str(least) if least == most else f"{least},{'' if most == math.inf else most}"
        atom = pieces[i][0]
        if most != math.inf and most > MAX_PATTERN_LENGTH and re.fullmatch(atom, "\\"):
            # a long count is compiled as a character budget (grammar_text.py), which lets a
            # class that admits a backslash write it raw (invalid JSON): such classes lose it
            atom = _without_escapes(atom, keyword, pointer)
        pieces[i] = (atom, f"{{{span}}}")
    return head + "".join(atom + quantifier for atom, quantifier in pieces) + tail


def _without_escapes(atom: str, keyword: str, pointer: str) -> str:
    """The class `atom` less the backslash, the quote and control characters (stricter)."""
    if atom == ".":
        return _PLAIN_CHAR
    if atom.startswith("[^") and atom.endswith("]"):
        return '[^"\\\\\\x00-\\x1f' + atom[2:]
    raise refuse(keyword, pointer, "length bounds past 64 beside this pattern cannot be "
                                   "enforced exactly")


def _pieces(body: str) -> list[tuple[str, str]] | None:
    """The top-level pieces of a pattern without alternation, or None."""
    pieces, at = [], 0
    while at < len(body):
        match = _PIECE.match(body, at)
        if match is None:
            return None
        quantifier = match.group(2) or ""
        if quantifier.endswith("?") and len(quantifier) > 1:
            quantifier = quantifier[:-1]  # laziness does not change the language
        pieces.append((match.group(1), quantifier))
        at = match.end()
    return pieces


def _counts(quantifier: str) -> tuple[int, float]:
    simple = {"": (1, 1), "?": (0, 1), "*": (0, math.inf), "+": (1, math.inf)}
    if quantifier in simple:
        return simple[quantifier]
    low, _, high = quantifier[1:-1].partition(",")
    if not _:
        return int(low), int(low)
    return int(low), int(high) if high else math.inf


def _share_lengths(variable: list, need: float, room: float) -> list | None:
    """Counts (least, most) for repetitions [(index, width, (least, most))] adding up to `need`
    ..`room` characters: minima raised in order, the rest of `room` shared (None: none fit)."""
    counts = [list(c) for _, _, c in variable]
    widths = [w for _, w, _ in variable]
    for k, width in enumerate(widths):
        short = need - sum(c[0] * w for c, w in zip(counts, widths))
        if short <= 0:
            break
        counts[k][0] = min(counts[k][1], counts[k][0] + -(-short // width))
    if need - sum(c[0] * w for c, w in zip(counts, widths)) > 0:
        return None
    spare = room - sum(c[0] * w for c, w in zip(counts, widths))
    if spare < 0:
        return None
    if spare != math.inf:
        share = spare // len(counts)
        for c, width in zip(counts, widths):
            c[1] = min(c[1], c[0] + share // width)
    return [tuple(c) for c in counts]
