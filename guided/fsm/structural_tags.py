"""Structural tags (vLLM's and SGLang's `structural_tag`): free text until a trigger opens a tag
whose content follows its JSON schema. The legacy form (`{"structures": [{"begin", "schema",
"end"}], "triggers"}`) becomes xgrammar's newer one (`{"type": "structural_tag", "format"}`);
every schema inside is checked like a response_format's, its whitespace runs bounded unless
the tag bounds them itself (xgrammar's default is unbounded)."""
from __future__ import annotations

import json
from typing import Any

from guided.errors import ConstraintError
from guided.fsm.schema_check import check_schema
from guided.fsm.settings import CompileSettings

MAX_WHITESPACE = CompileSettings().max_whitespace  # as the JSON of any_whitespace schemas


def checked_structural_tag(value: str) -> str:
    """The tag as canonical JSON with its schemas checked; ConstraintError naming the problem."""
    try:
        tag = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConstraintError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ConstraintError("structural_tag must be a JSON object")
    if "structures" in tag:
        tag = _legacy(tag)
    elif isinstance(tag.get("format"), dict):
        tag = {**tag, "type": "structural_tag", "format": _checked_formats(tag["format"])}
    else:
        raise ConstraintError('structural_tag needs "structures" and "triggers" (or a "format")')
    return json.dumps(tag, ensure_ascii=False, separators=(",", ":"))


def _legacy(tag: dict) -> dict:
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ConstraintError("structural_tag.structures must be a non-empty list")
    if not isinstance(triggers, list) or not triggers or not all(
            isinstance(t, str) and t for t in triggers):
        raise ConstraintError("structural_tag.triggers must be a non-empty list of strings")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            raise ConstraintError(f"structural_tag.structures[{i}] needs begin and end strings")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ConstraintError(f"structural_tag.structures[{i}].begin {s['begin']!r} starts "
                                  f"with none of the triggers {triggers}")
        schema = s.get("schema", s.get("parameters", {}))
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"], "content": {
            "type": "json_schema", "json_schema": _checked(schema, f"structures[{i}]"),
            "max_whitespace_cnt": MAX_WHITESPACE}})
    return {"type": "structural_tag", "format": {"type": "triggered_tags",
                                                 "triggers": triggers, "tags": tags}}


def _checked_formats(node: Any) -> Any:
    if isinstance(node, list):
        return [_checked_formats(v) for v in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        return {"max_whitespace_cnt": MAX_WHITESPACE, **node,
                "json_schema": _checked(node["json_schema"], "format")}
    return {k: _checked_formats(v) for k, v in node.items()}


def _checked(schema: Any, where: str) -> Any:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"structural_tag {where}: the schema is not JSON: {e}") from None
    try:
        return check_schema(schema)
    except ConstraintError as e:
        raise ConstraintError(f"structural_tag {where}: {e}") from None
