"""The tool-call formats of the model families we serve, chosen by the chat template, and
tool_choice "auto" in them as a structural tag: free text until the format's trigger opens a
call; inside it the function name is one of the tools' and the arguments follow its schema.

| family            | a call in the model's output                                    |
|-------------------|-----------------------------------------------------------------|
| Hermes (Qwen, ..) | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`  |
| Llama 3.1+ JSON   | `{"name": "f", "parameters": {...}}`                            |
| Mistral           | `[TOOL_CALLS][{"name": "f", "arguments": {...}}]`               |

A template that renders none of them (SmolLM2-135M's has no tools at all) keeps the JSON-first
output of guided/server/tools.py, which an untrained model follows far more often."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    markers: tuple[str, ...]  # any of these in the chat template: the family's format
    trigger: str  # opens a call in free text; a prefix of begin
    begin: str  # a call's text before the function name
    args_field: str  # between the function name and the arguments
    end: str  # after the arguments (its first character closes the call object)

    def call_tag(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": self.begin + name + self.args_field,
                "content": {"type": "json_schema", "json_schema": parameters},
                "end": self.end}


FORMATS = (  # the first whose marker is in the template wins: Mistral's mention <tool_call> too
    ToolFormat("mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS]", '[TOOL_CALLS][{"name": "',
               '", "arguments": ', "}]"),
    ToolFormat("hermes", ("<tool_call>",), "<tool_call>", '<tool_call>\n{"name": "',
               '", "arguments": ', "}\n</tool_call>"),
    ToolFormat("llama3", ("<|python_tag|>", '"parameters": '), '{"name": ', '{"name": "',
               '", "parameters": ', "}"),
)


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches its model; None: no known one."""
    if not chat_template or "tools" not in chat_template:
        return None
    return next((f for f in FORMATS if any(m in chat_template for m in f.markers)), None)


def auto_tag(fmt: ToolFormat, functions: list[dict[str, Any]], *, parallel: bool) -> str:
    """The structural tag of tool_choice "auto": text, and calls in fmt (one call at most when
    parallel tool calls are off). `functions[i]["parameters"]` are the schemas to follow."""
    tags = [fmt.call_tag(f["name"], f["parameters"]) for f in functions]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
        "stop_after_first": not parallel}}, ensure_ascii=False)
