"""String keywords for schema_check: `format` -> exact regex patterns, and `pattern` checks."""
from __future__ import annotations

import re

from guided.fsm.schema_merge import as_list, refuse

_DATE = (r"(?:(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-(?:(?:0[13578]|1[02])-"
         r"(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|"
         r"2[0-8]))|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])"
         r"00)-02-29)")
_TIME = (r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?"
         r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
# a DNS label of <= 63 letters/digits with single inner hyphens (so never an "xn--" A-label,
# which would need IDNA validation); at most 3 labels keeps a name under 253 characters
_LABEL = r"[A-Za-z0-9](?:-?[A-Za-z0-9]){0,31}"
_HOSTNAME = rf"{_LABEL}(?:\.{_LABEL}){{0,2}}"
_LOCAL_PART = r"[A-Za-z0-9_%+-]{1,32}(?:\.[A-Za-z0-9_%+-]{1,32}){0,2}"
# Formats jsonschema's checker enforces here, mapped to patterns proven to admit only valid strings.
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "ipv4": rf"^(?:{_OCTET}\.){{3}}{_OCTET}$",
    "email": rf"^{_LOCAL_PART}@{_LABEL}(?:\.{_LABEL}){{1,2}}$",
    "hostname": f"^{_HOSTNAME}$",
}
# Formats jsonschema checks (with the packages installed here) that we cannot enforce exactly.
UNENFORCEABLE_FORMATS = frozenset({"ipv6", "regex", "idn-email", "idn-hostname", "json-pointer",
                                   "relative-json-pointer", "iri", "iri-reference",
                                   "uri-template"})
# Formats xgrammar enforces; jsonschema checks them when its [format] extras are installed.
XGRAMMAR_FORMATS = frozenset({"uri", "uri-reference", "duration"})
# Regex syntax whose meaning differs between xgrammar and Python's re (which jsonschema uses):
# lookaround is ignored by xgrammar; negated classes \D \W \S are ASCII-only there (so they
# admit e.g. Arabic digits that Python's \d matches); \b, \p, backreferences do not compile.
_BAD_REGEX = re.compile(r"\(\?[=!<]|\\[DWSbBpPk1-9]|\[\^[^\]]*\\[dws]")

# One string character that needs no escape. xgrammar 0.2.8 compiles minLength / maxLength into
# a counted repetition that costs 0.5-0.9 ms per mask inside the string on average (and admits
# raw control characters: the JSON token ban (json_ban) removes those); this class counted up
# to MAX_PATTERN_LENGTH costs 0.03-0.09 ms (benchmarks/bench_string_bounds.py), beyond it the
# pattern grows slow, so larger bounds keep xgrammar's keywords (counting in exact blocks of
# 64 was tried: cheaper masks, but compiles several times slower, a bad trade for cold
# requests). Strings so bounded are written without escapes (xgrammar admits no backslash in
# a pattern-constrained string).
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
        if _BAD_REGEX.search(pattern) or _misplaced_anchor(pattern):
            raise refuse("pattern", pointer, f"regex {pattern!r} uses syntax (lookaround, "
                         f"\\b, \\p, backreferences, or negated \\d \\w \\s classes) that "
                         f"cannot be enforced exactly")
        for kw in ("minLength", "maxLength"):
            if kw in node:
                raise refuse(kw, pointer, "length bounds together with 'pattern' are not "
                                          "enforced by the grammar backend")
        node["pattern"] = fix_optional_groups(pattern)
    if fmt is None or "string" not in as_list(node.get("type", "string")):
        node.pop("format", None)
        return
    if fmt in FORMAT_PATTERNS:
        for kw in ("pattern", "minLength", "maxLength"):
            if kw in node:
                raise refuse(kw, pointer, f"'{kw}' together with format '{fmt}' is not "
                                          f"supported")
        node["pattern"] = fix_optional_groups(FORMAT_PATTERNS[node.pop("format")])
    elif fmt in UNENFORCEABLE_FORMATS:
        raise refuse("format", pointer, f"format '{fmt}' cannot be enforced; supported: "
                     f"{sorted(FORMAT_PATTERNS) + sorted(XGRAMMAR_FORMATS)}")
    elif fmt in XGRAMMAR_FORMATS:
        # jsonschema[format] (rfc3987, fqdn, isoduration) checks these where installed:
        # keep xgrammar's check, which ignores pattern and length bounds beside a format
        for kw in ("pattern", "minLength", "maxLength"):
            if kw in node:
                raise refuse(kw, pointer, f"'{kw}' together with format '{fmt}' is not "
                                          f"supported")
    else:
        node.pop("format")  # a format no validator checks: dropping it is exact


def _regex_pieces(pattern: str):
    """(index, piece, outside_class) over a regex: an escape or a class's literal leading ']'
    is one piece, anything else one character; outside_class is False inside [...]."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            yield i, pattern[i:i + 2], False
            i += 2
            continue
        if in_class:
            in_class = c != "]"
            yield i, c, False
        elif c == "[":
            in_class = True
            skip = (2 if pattern[i + 1:i + 2] == "]" else 3 if pattern[i + 1:i + 3] == "^]"
                    else 1)
            yield i, pattern[i:i + skip], False
            i += skip
            continue
        else:
            yield i, c, True
        i += 1


def fix_optional_groups(pattern: str) -> str:
    """Rewrite a group's `?` quantifier as `{0,1}`. xgrammar 0.2.8 compiles `x(ab+)?` wrongly:
    it also admits "xb" (the group's elements before a trailing repetition become optional);
    `x(ab+){0,1}` compiles correctly. Same language, so the rewrite is exact."""
    out = []
    for i, piece, outside in _regex_pieces(pattern):
        if outside and piece == "?" and out and out[-1] == ")" and pattern[i - 1] == ")":
            out[-1] = "){0,1}"
        else:
            out.append(piece)
    return "".join(out)


def _misplaced_anchor(pattern: str) -> bool:
    """True if ^ or $ (outside classes) sits where it is not the start/end of an alternative:
    xgrammar drops such anchors, which would widen the language (e.g. 'a$b' matches nothing)."""
    for i, c, outside in _regex_pieces(pattern):
        if outside and (c == "^" and pattern[:i].rstrip("(")[-1:] not in ("", "|")
                        or c == "$" and pattern[i + 1:].lstrip(")")[:1] not in ("", "|")):
            return True
    return False
