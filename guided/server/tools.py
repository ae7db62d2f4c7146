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
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from guided.errors import InvalidRequestError
from guided.server.protocol import ChatMessage, NamedToolChoice, Tool

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
ARGS_KEY = "parameters"  # a call's arguments in the model's output (see the module docstring)
CONTENT_KEY = "content"  # auto: a text answer
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


# ---- output -------------------------------------------------------------------------------------

@dataclass(slots=True)
class CallSpan:
    """One top-level JSON object found in the (possibly partial) output text."""

    first_key: str | None = None
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # exclusive; None while the arguments are incomplete
    content_start: int | None = None  # auto's {"content": "..."}: the string's opening quote
    content_end: int | None = None
    complete: bool = False


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def scan_calls(text: str) -> list[CallSpan]:
    """The objects `{"name": ..., "parameters": ...}` (or `{"content": ...}`) in text, in order;
    the last one may be partial. Array brackets, commas and whitespace between them are skipped."""
    calls: list[CallSpan] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] == "{":
            span, i = _scan_object(text, i)
            calls.append(span)
            if not span.complete:
                break
        else:
            i += 1
    return calls


def _scan_object(text: str, i: int) -> tuple[CallSpan, int]:
    span, n = CallSpan(), len(text)
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= n:
            return span, n
        if text[i] == "}":
            span.complete = True
            return span, i + 1
        if text[i] == ",":
            i += 1
            continue
        key_end = _skip_string(text, i) if text[i] == '"' else None
        if key_end is None:
            return span, n
        key = json.loads(text[i:key_end])
        span.first_key = span.first_key or key
        i = _skip_ws(text, key_end)
        if i >= n or text[i] != ":":
            return span, n
        start = _skip_ws(text, i + 1)
        end = _skip_value(text, start)
        if key in (ARGS_KEY, "arguments"):
            span.args_start, span.args_end = start, end
        elif key == CONTENT_KEY and start < n and text[start] == '"':
            span.content_start, span.content_end = start, end
        elif key == "name" and end is not None:
            span.name = json.loads(text[start:end])
        if end is None:
            return span, n
        i = end


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _skip_string(text: str, i: int) -> int | None:
    j, n = i + 1, len(text)
    while j < n:
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _skip_value(text: str, i: int) -> int | None:
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        return _skip_string(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < n:
            ch = text[j]
            if ch == '"':
                end = _skip_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < n and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < n else None


def _partial_string(raw: str) -> str:
    """The decoded longest prefix of a JSON string body that may end inside an escape sequence
    (at most 12 characters: a surrogate pair), never ending in half a surrogate pair."""
    for cut in range(len(raw), max(len(raw) - 13, -1), -1):
        try:
            text = json.loads('"' + raw[:cut] + '"')
        except json.JSONDecodeError:
            continue
        if not text or not "\ud800" <= text[-1] <= "\udbff":
            return text
    return ""


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # the JSON text of the arguments, as the model wrote it


def output_kind(plan: ToolPlan, text: str) -> Literal["tools", "text"] | None:
    """Whether the output is tool calls, a text answer (auto's {"content": ...}), or unknown yet."""
    if plan.json_output:
        return "tools"
    stripped = text.lstrip()
    if stripped.startswith("["):
        return "tools"
    spans = scan_calls(stripped[:200])
    if not spans or spans[0].first_key is None:
        return None
    return "text" if spans[0].first_key == CONTENT_KEY else "tools"


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall] | None]:
    """(content, tool calls) of a finished output. An output cut by max_tokens is returned as
    its raw text (auto text answers: the decoded part of the content)."""
    kind = output_kind(plan, text)
    if kind == "text":
        span = scan_calls(text)[0]
        raw_end = span.content_end - 1 if span.content_end is not None else len(text)
        return _partial_string(text[span.content_start + 1:raw_end]), None
    if kind is None:
        return text, None
    spans = scan_calls(text)
    if not spans or not all(s.complete and s.name is not None and s.args_end is not None
                            for s in spans):
        return text, None
    calls = []
    for s in spans:
        raw = text[s.args_start:s.args_end]
        try:
            json.loads(raw)
        except json.JSONDecodeError:
            return text, None
        calls.append(ParsedCall(new_call_id(), s.name, raw))
    return None, calls


@dataclass(slots=True)
class StreamedCall:
    id: str
    name: str
    sent_args: int = 0  # characters of the arguments already streamed


class ToolCallStreamer:
    """Turns a growing output text into OpenAI deltas: content (auto's text answers, unwrapped)
    or tool calls, whose first delta has the id and name (arguments "") and later ones the new
    characters of the arguments."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.calls: list[StreamedCall] = []
        self.sent_content = 0

    def deltas(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        kind = output_kind(self.plan, text)
        if kind == "text":
            return self._content(text), []
        if kind == "tools":
            return "", self._calls(text)
        return "", []

    def _content(self, text: str) -> str:
        span = scan_calls(text)[0]
        if span.content_start is None:
            return ""
        raw_end = span.content_end - 1 if span.content_end is not None else len(text)
        content = _partial_string(text[span.content_start + 1:raw_end])
        new = content[self.sent_content:]
        self.sent_content = len(content)
        return new

    def _calls(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for index, span in enumerate(scan_calls(text)):
            if span.name is None:
                break
            if index == len(self.calls):
                self.calls.append(StreamedCall(new_call_id(), span.name))
                out.append({"index": index, "id": self.calls[index].id, "type": "function",
                            "function": {"name": span.name, "arguments": ""}})
            call = self.calls[index]
            if span.args_start is None:
                continue
            if span.args_end is None:  # trailing whitespace may turn out to be outside them
                args = text[span.args_start:].rstrip(" \t\r\n")
            else:
                args = text[span.args_start:span.args_end]
            if len(args) > call.sent_args:
                new = args[call.sent_args:]
                call.sent_args = len(args)
                if out and out[-1]["index"] == index:
                    out[-1]["function"]["arguments"] += new
                else:
                    out.append({"index": index, "function": {"arguments": new}})
        return out
