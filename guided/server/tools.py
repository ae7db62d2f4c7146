"""tools / tool_choice -> a constraint and a prompt; the model's output -> OpenAI tool_calls.

The output is always JSON, guaranteed by a JSON-schema constraint (so a finished output always
parses; only max_tokens can cut it):

- a call is `{"name": <const>, "parameters": <that tool's parameters schema>}` (Llama 3.1's JSON
  tool-call format: "name" sorts before "parameters", so the function is chosen before its
  arguments even when the engine canonicalizes the schema with sorted keys);
- tool_choice named: one call of that tool; "required": one call (anyOf over the tools), or a
  non-empty array of calls when parallel_tool_calls is true;
- tool_choice "auto": anyOf [a call, (parallel: an array of calls,) `{"content": <text>}`]: the
  model answers in text through the "content" object, which the server unwraps.

Why JSON-first rather than free text with `<tool_call>` tags for "auto": measured with
SmolLM2-135M-Instruct (no tool training), the tag grammar gave 0 of 6 calls on BFCL
simple_python (the model always starts in prose), JSON-first 6 of 6 calls with the right
function. The price: text answers are generated inside a JSON string.

Chat templates without tool support (SmolLM2's) get the tools rendered into the system prompt
(`render_tools_prompt`), tool results as `<tool_response>` user turns and earlier assistant calls
as their JSON; templates that mention `tools` get them natively.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from guided.errors import InvalidRequestError
from guided.server.protocol import ChatMessage, NamedToolChoice, Tool
from guided.server.tool_output import (  # noqa: F401 - the output half, re-exported
    ARGS_KEY,
    CONTENT_KEY,
    CallSpan,
    ParsedCall,
    ToolCallStreamer,
    new_call_id,
    output_kind,
    parse_output,
    scan_calls,
)

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
CONTENT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {CONTENT_KEY: {"type": "string"}},
                                  "required": [CONTENT_KEY], "additionalProperties": False}

Mode = Literal["auto", "required", "named"]


@dataclass(slots=True)
class ToolPlan:
    """How one request uses tools: the constraint to send and how to read the output."""

    mode: Mode
    functions: list[dict[str, Any]]  # [{"name", "description", "parameters"}] offered
    parallel: bool
    constraint: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs

    @property
    def json_output(self) -> bool:
        """required / named: the whole output is JSON (no tags)."""
        return self.mode != "auto"


def plan_tools(tools: list[Tool] | None, tool_choice, parallel_tool_calls: bool = True
               ) -> ToolPlan | None:
    """None when no tool can be called (no tools, or tool_choice "none")."""
    if isinstance(tool_choice, NamedToolChoice):
        if not tools:
            raise InvalidRequestError("tool_choice names a function but no tools were given",
                                      param="tool_choice")
        names = [t.function.name for t in tools]
        if tool_choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names unknown function {tool_choice.function.name!r}; "
                f"tools: {names}", param="tool_choice")
    if tool_choice == "required" and not tools:
        raise InvalidRequestError('tool_choice "required" needs at least one tool',
                                  param="tool_choice")
    if not tools or tool_choice == "none":
        return None
    functions = [_function(t) for t in tools]
    seen: set[str] = set()
    for f in functions:
        if f["name"] in seen:
            raise InvalidRequestError(f"duplicate tool name {f['name']!r}", param="tools")
        seen.add(f["name"])
    if isinstance(tool_choice, NamedToolChoice):
        chosen = [f for f in functions if f["name"] == tool_choice.function.name]
        return ToolPlan("named", chosen, False,
                        {"json_schema": _calls_schema(chosen, parallel=False)})
    if tool_choice == "required":
        return ToolPlan("required", functions, parallel_tool_calls,
                        {"json_schema": _calls_schema(functions, parallel=parallel_tool_calls)})
    return ToolPlan("auto", functions, parallel_tool_calls,
                    {"json_schema": auto_schema(functions, parallel=parallel_tool_calls)})


def _function(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters
    if params is None or params == {}:
        params = EMPTY_PARAMETERS
    return {"name": tool.function.name, "description": tool.function.description or "",
            "parameters": params}


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def closed_objects(schema: Any) -> Any:
    """A copy where objects with declared properties admit no others (OpenAI's strict function
    calling). Stricter than the tool's schema, never looser: every call still validates, and a
    small model cannot wander off into invented arguments until max_tokens."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(v) for v in out[key]]
    if isinstance(out.get("items"), dict):
        out["items"] = closed_objects(out["items"])
    return out


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"type": "string", "const": function["name"]},
                           ARGS_KEY: closed_objects(function["parameters"])},
            "required": ["name", ARGS_KEY], "additionalProperties": False}


def _calls_schema(functions: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
    calls = [call_schema(f) for f in functions]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


def auto_schema(functions: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
    options = [call_schema(f) for f in functions]
    if parallel:
        options.append(_calls_schema(functions, parallel=True))
    return {"anyOf": [*options, CONTENT_SCHEMA]}


# ---- prompt -------------------------------------------------------------------------------------

def render_tools_prompt(plan: ToolPlan) -> str:
    """The tools as a system-prompt section, for chat templates without tool support."""
    functions = "\n".join(json.dumps(f, ensure_ascii=False) for f in plan.functions)
    call = f'{{"name": <function-name>, "{ARGS_KEY}": <arguments>}}'
    lines = ["You are a helpful assistant with access to functions. Respond with a JSON object."]
    if plan.mode == "named":
        lines.append(f"Call the function {plan.functions[0]['name']}: {call}.")
    else:
        lines.append(f"To call a function: {call}.")
    if plan.parallel:
        lines.append("To call several functions: a JSON list of such objects.")
    if plan.mode == "auto":
        lines.append(f'If no function can answer the question: {{"{CONTENT_KEY}": <your answer>}}.')
    lines.append("Take argument values from the user's request. Functions:")
    return "\n".join(lines) + "\n" + functions


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def build_messages(messages: list[ChatMessage], plan: ToolPlan | None, *,
                   native_tools: bool) -> list[dict[str, Any]]:
    """Messages as dicts for tokenizer.apply_chat_template (content flattened to text)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if native_tools:
            d: dict[str, Any] = {"role": role, "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [{"type": "function", "id": c.id, "function": {
                    "name": c.function.name, "arguments": _args_obj(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        elif role == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
        elif role == "assistant" and m.tool_calls:
            calls = [{"name": c.function.name, ARGS_KEY: _args_obj(c.function.arguments)}
                     for c in m.tool_calls]
            out.append({"role": "assistant", "content": json.dumps(
                calls[0] if len(calls) == 1 else calls, ensure_ascii=False)})
        else:
            out.append({"role": role, "content": m.text()})
    if plan is not None and not native_tools:
        section = render_tools_prompt(plan)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _args_obj(arguments: str | dict) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
