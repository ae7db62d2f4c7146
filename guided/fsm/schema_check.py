"""Fail closed: rewrite a JSON schema into the subset xgrammar 0.2.8 enforces, or refuse it.

The grammar is compiled in xgrammar's strict mode: objects that declare properties admit no
others (a subset of the schema's language, and a much smaller, faster grammar: the largest
Kubernetes schemas compile in 0.1 s strict and > 10 s non-strict). Every rule below comes from a
probe of xgrammar 0.2.8: keywords it silently
ignores would let the grammar admit outputs the client's schema rejects. Such keywords are either
rewritten into an equivalent (or stricter) form xgrammar does enforce, or refused with a
ConstraintError naming the keyword and its JSON pointer. The invariant: every string the compiled
grammar admits validates against the client's schema (Draft 2020-12, format checking on).
Stricter is allowed (it costs false rejects, never false accepts).
"""
from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from guided.errors import ConstraintError

# Annotations: no effect on validation.
ANNOTATIONS = frozenset({
    "title", "description", "examples", "example", "default", "$comment", "deprecated", "readOnly",
    "writeOnly", "$schema", "$vocabulary",
    "$anchor", "nullable", "discriminator", "xml", "externalDocs", "markdownDescription",
})
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                             "multipleOf"})
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "minProperties",
                             "maxProperties", "patternProperties", "propertyNames",
                             "dependentRequired", "dependentSchemas", "dependencies",
                             "unevaluatedProperties"})
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems",
                            "contains", "minContains", "maxContains", "additionalItems",
                            "unevaluatedItems"})
TYPE_KEYWORDS = {"number": NUMBER_KEYWORDS, "string": STRING_KEYWORDS, "object": OBJECT_KEYWORDS,
                 "array": ARRAY_KEYWORDS}
# Keywords xgrammar 0.2.8 ignores (probed): refused unless trivially true (see _refuse_ignored).
IGNORED_BY_XGRAMMAR = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                       "dependencies", "patternProperties", "propertyNames",
                       "unevaluatedProperties", "unevaluatedItems", "contains", "minContains",
                       "maxContains", "$dynamicRef", "$recursiveRef",
                       # annotations in 2020-12 but assertions in draft 7 (and its test suite)
                       "contentMediaType", "contentEncoding", "contentSchema")
APPLICATORS_DONE = frozenset({"allOf", "anyOf", "oneOf", "$ref"})

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


def check_schema(schema: Any) -> Any:
    """Return a schema xgrammar enforces exactly (or more strictly), or raise ConstraintError."""
    if isinstance(schema, bool):
        if not schema:
            raise ConstraintError("the schema `false` admits no value")
        return {}
    if not isinstance(schema, dict):
        raise ConstraintError("a JSON schema must be an object or a boolean")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "/" + "/".join(str(p) for p in e.absolute_path)
        raise ConstraintError(f"invalid JSON schema at {where}: {e.message}") from None
    return _Rewriter(schema).rewrite(schema, "")


class Unsatisfiable(ConstraintError):
    """A subschema no value satisfies."""


def _where(pointer: str) -> str:
    return pointer or "/"


def _refuse(keyword: str, pointer: str, why: str) -> ConstraintError:
    return ConstraintError(
        f"unsupported JSON Schema keyword '{keyword}' at {_where(pointer)}: {why}")


class _Rewriter:
    def __init__(self, root: dict):
        self.root = root
        self.validator = Draft202012Validator(
            root, format_checker=Draft202012Validator.FORMAT_CHECKER)
        self.depth = 0

    # ---- references -------------------------------------------------------------------
    def resolve(self, ref: str, pointer: str) -> Any:
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            raise _refuse("$ref", pointer, f"only local references ('#/...') are supported, "
                                           f"got {ref!r}")
        node: Any = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            part = re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), part)
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise _refuse("$ref", pointer, f"reference {ref!r} does not resolve")
        return node

    def deref(self, node: Any, pointer: str) -> Any:
        """Follow a chain of pure references ({"$ref": ...} with annotations only)."""
        for _ in range(32):
            if not (isinstance(node, dict) and "$ref" in node):
                return node
            if any(k not in ANNOTATIONS and k not in ("$ref", "$defs", "definitions", "$id")
                   for k in node):
                return node
            node = self.resolve(node["$ref"], pointer)
        raise _refuse("$ref", pointer, "reference chain too long or cyclic")

    # ---- the walk -----------------------------------------------------------------------
    def rewrite(self, node: Any, pointer: str) -> Any:
        self.depth += 1
        try:
            if self.depth > 200:
                raise ConstraintError(f"schema nested too deeply at {_where(pointer)}")
            if node is True:
                return {}
            if node is False:
                raise ConstraintError(f"the subschema `false` at {_where(pointer)} admits no "
                                      f"value and is not supported there")
            return self._rewrite_dict(dict(node), pointer)
        finally:
            self.depth -= 1

    def _rewrite_dict(self, node: dict, pointer: str) -> dict:
        if pointer and "$id" in node:
            raise _refuse("$id", pointer, "embedded schema resources are not supported")
        node = {k: v for k, v in node.items() if k not in ANNOTATIONS or k == "$schema"
                and not pointer}
        node.pop("$schema", None)
        _drop_trivial(node)
        if "enum" in node or "const" in node:
            return self._rewrite_enum(node, pointer)
        if "$ref" in node:
            self.deref(self.resolve(node["$ref"], pointer), pointer)  # remote/dangling: refuse
        if "$ref" in node and _validation_keys(node, exclude=("$ref",)):
            target = copy.deepcopy(self.deref(self.resolve(node.pop("$ref"), pointer), pointer))
            return self.rewrite(self.merge([target, node], pointer, "$ref"), pointer)
        if "allOf" in node:
            branches = node.pop("allOf")
            return self.rewrite(self.merge([node, *branches], pointer, "allOf"), pointer)
        for kw in ("anyOf", "oneOf"):
            if kw in node:
                return self._rewrite_union(node, kw, pointer)
        _refuse_ignored(node, pointer)
        node = _infer_type(node, pointer)
        if isinstance(node.get("type"), list) and _validation_keys(node, exclude=("type",)):
            # xgrammar applies type-specific keywords unreliably to type lists: split by type
            types = node.pop("type")
            return self.rewrite({"anyOf": [_only_type(node, t) for t in types]}, pointer)
        self._rewrite_string(node, pointer)
        _rewrite_number(node, pointer)
        self._rewrite_object(node, pointer)
        self._rewrite_array(node, pointer)
        for container in ("$defs", "definitions"):
            if isinstance(node.get(container), dict):
                node[container] = {k: self.rewrite(v, f"{pointer}/{container}/{_esc(k)}")
                                   if v is not False else v
                                   for k, v in node[container].items()}
        return node

    def _rewrite_enum(self, node: dict, pointer: str) -> dict:
        values = [node["const"]] if "const" in node else list(node["enum"])
        check = self.validator.evolve(schema=node)
        kept = []
        for value in values:
            # jsonschema treats 1 == 1.0 == True differently from JSON text: keep distinct texts
            if check.is_valid(value) and all(_json(value) != _json(k) for k in kept):
                kept.append(value)
        if not kept:
            raise Unsatisfiable(f"the enum/const at {_where(pointer)} admits no value that "
                                  f"satisfies its sibling keywords")
        return {"const": kept[0]} if len(kept) == 1 else {"enum": kept}

    def _rewrite_union(self, node: dict, kw: str, pointer: str) -> dict:
        branches = node.pop(kw)
        rest = node
        defs = {k: rest.pop(k) for k in ("$defs", "definitions") if k in rest}
        live = [b for b in branches if b is not False]
        if not live:
            raise ConstraintError(f"every branch of the {kw} at {_where(pointer)} is `false`")
        if _validation_keys(rest):
            live = [self.merge([copy.deepcopy(rest), b], f"{pointer}/{kw}", kw) for b in live]
        if kw == "oneOf" and len(live) > 1:
            for i in range(len(live)):
                for j in range(i + 1, len(live)):
                    if not self.disjoint(live[i], live[j], pointer):
                        raise _refuse("oneOf", pointer, f"branches {i} and {j} may both match "
                                      f"a value; only provably exclusive branches (different "
                                      f"types, or different const/enum values) are supported")
        out: dict = {"anyOf": [self.rewrite(b, f"{pointer}/{kw}/{i}")
                               for i, b in enumerate(live)]}
        if len(out["anyOf"]) == 1:
            out = out["anyOf"][0]
        for k, v in defs.items():
            out[k] = {name: self.rewrite(s, f"{pointer}/{k}/{_esc(name)}")
                      for name, s in v.items()}
        return out

    # ---- merging (allOf, $ref with siblings, union siblings) -----------------------------
    def merge(self, schemas: list, pointer: str, keyword: str) -> dict:
        out: dict = {}
        for schema in schemas:
            schema = self.deref(schema, pointer)
            if schema is True:
                continue
            if schema is False:
                raise ConstraintError(f"the {keyword} at {_where(pointer)} contains `false`")
            schema = {k: v for k, v in schema.items() if k not in ANNOTATIONS}
            if "$ref" in schema and _validation_keys(schema, exclude=("$ref",)):
                schema = self.merge([self.resolve(schema.pop("$ref"), pointer), schema],
                                    pointer, "$ref")
            elif "$ref" in schema:
                schema = self.deref(schema, pointer)
            if "allOf" in schema:
                inner = schema.pop("allOf")
                schema = self.merge([schema, *inner], pointer, "allOf")
            for key, value in schema.items():
                if key not in out:
                    out[key] = copy.deepcopy(value)
                else:
                    out[key] = _merge_value(key, out[key], value, pointer, keyword)
        dicts = [self.deref(s, pointer) for s in schemas]
        dicts = [s for s in dicts if isinstance(s, dict)]
        for owner in dicts:  # items applies after the prefixItems of its own schema only
            if "items" in owner and any(o is not owner and "prefixItems" in o
                                        and o.get("prefixItems") != owner.get("prefixItems")
                                        for o in dicts):
                raise _refuse(keyword, pointer, "'items' and 'prefixItems' in different "
                                                "combined schemas cannot be merged")
        for closed in dicts:
            if closed.get("additionalProperties", True) is True:
                continue
            own = set(closed.get("properties", {}))
            for other in dicts:
                if set(other.get("properties", {})) - own:
                    raise _refuse(keyword, pointer, "additionalProperties inside a combined "
                                  "schema also rejects its siblings' properties")
        return out

    def disjoint(self, a: Any, b: Any, pointer: str) -> bool:
        a, b = self.deref(a, pointer), self.deref(b, pointer)
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        ta, tb = _types_of(a), _types_of(b)
        if ta is not None and tb is not None and not _types_overlap(ta, tb):
            return True
        va, vb = _values_of(a), _values_of(b)
        if va is not None and vb is not None and not (set(va) & set(vb)):
            return True
        for key in set(a.get("required", [])) & set(b.get("required", [])):
            pa = self.deref(a.get("properties", {}).get(key, True), pointer)
            pb = self.deref(b.get("properties", {}).get(key, True), pointer)
            if isinstance(pa, dict) and isinstance(pb, dict):
                xa, xb = _values_of(pa), _values_of(pb)
                if xa is not None and xb is not None and not (set(xa) & set(xb)):
                    return True
        for x, y in ((a, b), (b, a)):
            if y.get("additionalProperties") is False and "object" in (_types_of(y) or {"object"}):
                if set(x.get("required", [])) - set(y.get("properties", {})):
                    return True
        return False

    # ---- per-type rewrites ----------------------------------------------------------------
    def _rewrite_string(self, node: dict, pointer: str) -> None:
        pattern, fmt = node.get("pattern"), node.get("format")
        if pattern is not None:
            if _BAD_REGEX.search(pattern) or _misplaced_anchor(pattern):
                raise _refuse("pattern", pointer, f"regex {pattern!r} uses syntax (lookaround, "
                              f"\\b, \\p, backreferences, or negated \\d \\w \\s classes) that "
                              f"cannot be enforced exactly")
            for kw in ("minLength", "maxLength"):
                if kw in node:
                    raise _refuse(kw, pointer, "length bounds together with 'pattern' are not "
                                               "enforced by the grammar backend")
            node["pattern"] = fix_optional_groups(pattern)
        if fmt is None or "string" not in _as_list(node.get("type", "string")):
            node.pop("format", None)
            return
        if fmt in FORMAT_PATTERNS:
            for kw in ("pattern", "minLength", "maxLength"):
                if kw in node:
                    raise _refuse(kw, pointer, f"'{kw}' together with format '{fmt}' is not "
                                               f"supported")
            node["pattern"] = fix_optional_groups(FORMAT_PATTERNS[node.pop("format")])
        elif fmt in UNENFORCEABLE_FORMATS:
            raise _refuse("format", pointer, f"format '{fmt}' cannot be enforced; supported: "
                          f"{sorted(FORMAT_PATTERNS) + sorted(XGRAMMAR_FORMATS)}")
        elif fmt in XGRAMMAR_FORMATS:
            # jsonschema[format] (rfc3987, fqdn, isoduration) checks these where installed:
            # keep xgrammar's check, which ignores pattern and length bounds beside a format
            for kw in ("pattern", "minLength", "maxLength"):
                if kw in node:
                    raise _refuse(kw, pointer, f"'{kw}' together with format '{fmt}' is not "
                                               f"supported")
        else:
            node.pop("format")  # a format no validator checks: dropping it is exact

    def _rewrite_object(self, node: dict, pointer: str) -> None:
        props = node.get("properties")
        if props is not None:
            props = dict(props)
            for name, sub in list(props.items()):
                if sub is False:
                    if node.get("additionalProperties") is False:
                        del props[name]  # cannot appear anyway
                    else:
                        raise _refuse("properties", f"{pointer}/properties/{_esc(name)}",
                                      "a `false` property schema is only supported with "
                                      "additionalProperties false")
        extra = node.get("additionalProperties", True)
        for name in node.get("required", []):
            if props is None or name not in props:
                if extra is False:
                    raise ConstraintError(f"required property {name!r} at {_where(pointer)} is "
                                          f"forbidden by additionalProperties false")
                props = props if props is not None else {}
                props[name] = copy.deepcopy(extra) if isinstance(extra, dict) else {}
        if props is not None:
            rewritten = {}
            for name, sub in props.items():
                try:
                    rewritten[name] = self.rewrite(sub, f"{pointer}/properties/{_esc(name)}")
                except Unsatisfiable:
                    # an optional property no value satisfies must be absent; the strict-mode
                    # grammar omits undeclared keys unless additionalProperties admits them
                    closed = node.get("additionalProperties", False) is False
                    if name in node.get("required", []) or not closed:
                        raise
            node["properties"] = rewritten
        if isinstance(extra, dict):
            node["additionalProperties"] = self.rewrite(extra, f"{pointer}/additionalProperties")
        elif props is None and "additionalProperties" not in node and _may_be(node, "object"):
            # strict mode closes objects by default; one without properties stays free-form
            node["additionalProperties"] = True

    def _rewrite_array(self, node: dict, pointer: str) -> None:
        items = node.get("items")
        if isinstance(items, list):
            raise _refuse("items", pointer, "the array form of 'items' (draft 7 tuples) is not "
                                            "supported; use prefixItems")
        node.pop("additionalItems", None)  # not a 2020-12 keyword: no effect without tuple items
        if node.pop("uniqueItems", False):
            values = _values_of(self.deref(items, pointer)) if isinstance(items, dict) else None
            if node.get("maxItems", math.inf) <= 1:
                pass
            elif values is not None and len(values) == 1 and not node.get("prefixItems"):
                node["maxItems"] = 1
            else:
                raise _refuse("uniqueItems", pointer, "unique array items cannot be enforced "
                                                      "by the grammar")
        if isinstance(items, dict):
            node["items"] = self.rewrite(items, f"{pointer}/items")
        elif items is None and "prefixItems" not in node and _may_be(node, "array"):
            node["items"] = True  # strict mode would otherwise admit only []
        if "prefixItems" in node:
            node["prefixItems"] = [self.rewrite(s, f"{pointer}/prefixItems/{i}")
                                   for i, s in enumerate(node["prefixItems"])]


def fix_optional_groups(pattern: str) -> str:
    """Rewrite a group's `?` quantifier as `{0,1}`. xgrammar 0.2.8 compiles `x(ab+)?` wrongly:
    it also admits "xb" (the group's elements before a trailing repetition become optional);
    `x(ab+){0,1}` compiles correctly. Same language, so the rewrite is exact."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]" or pattern[i + 1:i + 3] == "^]":
                skip = 2 if pattern[i + 1] == "]" else 3
                out.append(pattern[i:i + skip])
                i += skip
                continue
        elif c == ")" and pattern[i + 1:i + 2] == "?":
            out.append("){0,1}")
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _misplaced_anchor(pattern: str) -> bool:
    """True if ^ or $ (outside classes) sits where it is not the start/end of an alternative:
    xgrammar drops such anchors, which would widen the language (e.g. 'a$b' matches nothing)."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]" or pattern[i + 1:i + 3] == "^]":
                i += 2 if pattern[i + 1] == "]" else 3
                continue
        elif c == "^" and pattern[:i].rstrip("(")[-1:] not in ("", "|") or c == "$" and pattern[i + 1:].lstrip(")")[:1] not in ("", "|"):
            return True
        i += 1
    return False


def _may_be(node: dict, type_name: str) -> bool:
    return type_name in _as_list(node.get("type", []))


def _rewrite_number(node: dict, pointer: str) -> None:
    types = _as_list(node.get("type", []))
    integer_only = types == ["integer"]
    for kw in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(kw), bool):
            raise _refuse(kw, pointer, "boolean exclusive bounds (draft 4) are not supported")
    if "multipleOf" in node:
        m = node["multipleOf"]
        if not (integer_only and float(m).is_integer()):
            raise _refuse("multipleOf", pointer, "multipleOf is only enforced on integers by "
                                                 "an integer divisor")
        node["multipleOf"] = int(m)
    if integer_only:
        # xgrammar wants integer bounds: round inward (exact for integer values)
        lo = [math.floor(node.pop("minimum")) if float(node["minimum"]).is_integer() else
              math.ceil(node.pop("minimum"))] if "minimum" in node else []
        if "exclusiveMinimum" in node:
            lo.append(math.floor(node.pop("exclusiveMinimum")) + 1)
        hi = [math.ceil(node.pop("maximum")) if float(node["maximum"]).is_integer() else
              math.floor(node.pop("maximum"))] if "maximum" in node else []
        if "exclusiveMaximum" in node:
            hi.append(math.ceil(node.pop("exclusiveMaximum")) - 1)
        for bound in lo + hi:
            if abs(bound) > 2**53:
                raise ConstraintError(f"integer bound {bound} at {_where(pointer)} is too large "
                                      f"(at most 2**53)")
        if lo:
            node["minimum"] = max(lo)
        if hi:
            node["maximum"] = min(hi)
        if lo and hi and max(lo) > min(hi):
            raise ConstraintError(f"the integer range at {_where(pointer)} is empty")


def _refuse_ignored(node: dict, pointer: str) -> None:
    for kw in IGNORED_BY_XGRAMMAR:
        if kw in node:
            raise _refuse(kw, pointer, "the grammar backend would ignore it")


def _drop_trivial(node: dict) -> None:
    """Drop keywords that validate everything (so they are not refused for nothing)."""
    if "if" in node and "then" not in node and "else" not in node:
        node.pop("if")
    if "if" not in node:
        node.pop("then", None)
        node.pop("else", None)
    for kw in ("unevaluatedProperties", "unevaluatedItems", "not"):
        if node.get(kw) is True and kw != "not":
            node.pop(kw)
    for kw in ("dependentRequired", "dependentSchemas", "dependencies", "patternProperties"):
        if node.get(kw) == {}:
            node.pop(kw)
    if node.get("uniqueItems") is False:
        node.pop("uniqueItems")
    if node.get("minContains") == 0 and "contains" not in node:
        node.pop("minContains")
    if node.get("propertyNames") in (True, {}):
        node.pop("propertyNames")
    if node.get("allOf") == []:
        node.pop("allOf")
    if "additionalItems" in node and not isinstance(node.get("items"), list):
        node.pop("additionalItems")
    if "maxContains" in node and "contains" not in node:
        node.pop("maxContains")
    if "minContains" in node and "contains" not in node:
        node.pop("minContains")


def _infer_type(node: dict, pointer: str) -> dict:
    """An untyped schema with type-specific keywords: xgrammar ignores those keywords unless the
    type is explicit, so restrict it to the types they constrain (stricter, never looser)."""
    if "type" in node:
        return node
    families = [t for t, kws in TYPE_KEYWORDS.items() if any(k in node for k in kws)]
    if families:
        node["type"] = families[0] if len(families) == 1 else families
    return node


def _only_type(node: dict, type_name: str) -> dict:
    family = "number" if type_name == "integer" else type_name
    keep = {k: v for k, v in node.items()
            if not any(k in kws for t, kws in TYPE_KEYWORDS.items() if t != family)}
    keep["type"] = type_name
    return keep


def _merge_value(key: str, a: Any, b: Any, pointer: str, keyword: str) -> Any:
    if _json(a) == _json(b):
        return a
    if key == "required":
        return list(dict.fromkeys([*a, *b]))
    if key == "properties":
        out = dict(a)
        for name, sub in b.items():
            out[name] = {"allOf": [out[name], sub]} if name in out else sub
        return out
    if key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
        return max(a, b)
    if key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
        return min(a, b)
    if key == "type":
        ta, tb = _as_list(a), _as_list(b)
        both = [t for t in ta if t in tb or (t == "integer" and "number" in tb)]
        both += [t for t in tb if t == "integer" and "number" in ta and t not in both]
        if not both:
            raise ConstraintError(f"the {keyword} at {_where(pointer)} combines disjoint types")
        return both[0] if len(both) == 1 else both
    if key in ("$defs", "definitions"):
        return {**a, **b}
    if key in ("items", "additionalProperties") and isinstance(a, dict) and isinstance(b, dict):
        return {"allOf": [a, b]}
    raise _refuse(keyword, pointer, f"cannot combine two different '{key}' constraints")


def _validation_keys(node: dict, exclude: tuple = ()) -> list[str]:
    return [k for k in node if k not in ANNOTATIONS and k not in exclude
            and k not in ("$defs", "definitions", "$id")]


def _types_of(node: dict) -> set[str] | None:
    if "type" in node:
        return set(_as_list(node["type"]))
    values = _values_of(node)
    if values is not None:
        return {_json_type(json.loads(v)) for v in values}
    return None


def _types_overlap(a: set[str], b: set[str]) -> bool:
    def widen(s: set[str]) -> set[str]:
        return s | ({"integer"} if "number" in s else set())

    return bool(widen(a) & widen(b))


def _values_of(node: dict) -> list[str] | None:
    if "const" in node:
        return [_json(node["const"])]
    if "enum" in node:
        return [_json(v) for v in node["enum"]]
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, list) else [value]


def _esc(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
