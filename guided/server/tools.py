"""tools / tool_choice -> a constraint and a prompt; the model's output -> OpenAI tool_calls.

Output formats (all guaranteed by the constraint, so parsing cannot fail on a finished output):

- tool_choice "required" / named: the whole output is JSON, a call object
  `{"name": <const>, "arguments": <that tool's parameters schema>}` (anyOf over the tools), or a
  non-empty array of them when parallel_tool_calls is true and the choice is "required".
- tool_choice "auto": an EBNF grammar `root ::= free_text | tool_calls`, where free text is any
  text not starting with "<" or whitespace, and a tool call is (Hermes / Qwen format)
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several separated by "\\n"
  when parallel_tool_calls is true. The call object's EBNF comes from xgrammar's JSON-schema
  converter (compact separators), renamed into the grammar.

Chat templates without tool support (SmolLM2's) get the tools rendered into the system prompt
(`render_tools_prompt`), tool results as `<tool_response>` user turns and earlier assistant calls
as `<tool_call>` text; templates that mention `tools` get them natively.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from guided.errors import ConstraintError, InvalidRequestError
from guided.server.protocol import ChatMessage, NamedToolChoice, Tool

TOOL_OPEN = "<tool_call>\n"
TOOL_CLOSE = "\n</tool_call>"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

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
        return ToolPlan("named", functions, False,
                        {"json_schema": _calls_schema(chosen, parallel=False)})
    if tool_choice == "required":
        return ToolPlan("required", functions, parallel_tool_calls,
                        {"json_schema": _calls_schema(functions, parallel=parallel_tool_calls)})
    return ToolPlan("auto", functions, parallel_tool_calls,
                    {"grammar": auto_grammar(functions, parallel=parallel_tool_calls)})


def _function(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters
    if params is None or params == {}:
        params = EMPTY_PARAMETERS
    return {"name": tool.function.name, "description": tool.function.description or "",
            "parameters": params}


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"type": "string", "const": function["name"]},
                           "arguments": function["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def _calls_schema(functions: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
    calls = [call_schema(f) for f in functions]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


# ---- the "auto" grammar -------------------------------------------------------------------------

_FREE_TEXT = 'free_text ::= [^< \\t\\n\\r] [^]*'


def auto_grammar(functions: list[dict[str, Any]], *, parallel: bool) -> str:
    """EBNF: free text, or one (or, parallel, several) <tool_call> JSON call objects."""
    import xgrammar as xgr

    _check_schemas(functions)
    schema = _calls_schema(functions, parallel=False)
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError
        raise ConstraintError(f"tools: a parameters schema cannot be compiled: {e}",
                              param="tools") from None
    call_rules = _prefix_rules(str(grammar), "tc_")
    seq = 'tool_calls ::= tool_call ("\\n" tool_call)*' if parallel \
        else "tool_calls ::= tool_call"
    return "\n".join([
        "root ::= free_text | tool_calls",
        _FREE_TEXT,
        seq,
        f"tool_call ::= {json.dumps(TOOL_OPEN)} tc_root {json.dumps(TOOL_CLOSE)}",
        call_rules,
    ])


def _check_schemas(functions: list[dict[str, Any]]) -> None:
    """Fail closed on keywords the backend would ignore (guided.fsm.schema_check, when present):
    the auto path builds its grammar here, outside the engine's json_schema path."""
    try:
        from guided.fsm import schema_check
    except ImportError:
        return
    check = getattr(schema_check, "check_schema", None) or getattr(schema_check, "check", None)
    if check is None:
        return
    for f in functions:
        try:
            check(f["parameters"])
        except ConstraintError as e:
            raise ConstraintError(f"tools[{f['name']}].parameters: {e}", param="tools") from None


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|\s+|.',
                    re.DOTALL)


def _prefix_rules(ebnf: str, prefix: str) -> str:
    """Rename every rule of an EBNF text (outside string literals and character classes)."""
    names = set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)\s*::=", ebnf, re.MULTILINE))
    return "".join(prefix + t if t in names else t for t in _TOKEN.findall(ebnf))


# ---- prompt -------------------------------------------------------------------------------------

def render_tools_prompt(plan: ToolPlan) -> str:
    """The tools as a system-prompt section, for chat templates without tool support."""
    lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                      for f in plan.functions)
    if plan.json_output:
        how = ('Answer with only a JSON object {"name": <function-name>, "arguments": '
               "<args-json-object>} calling the function")
        if plan.mode == "required" and plan.parallel:
            how = "Answer with only a JSON list of one or more such objects, calling the functions"
        return (f"You are a function calling AI model. You are provided with function "
                f"signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n"
                f"{how} that answer the user's request, with argument values taken from it.")
    many = " You may call one or more functions." if plan.parallel else ""
    return ("You are a function calling AI model. You are provided with function signatures "
            f"within <tools></tools> XML tags.{many} Don't make assumptions about what values to "
            "plug into functions; if no function fits the request, answer in plain text.\n"
            f"<tools>\n{lines}\n</tools>\n"
            "For each function call return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags as follows:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")


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
            calls = "\n".join(
                TOOL_OPEN + json.dumps({"name": c.function.name,
                                        "arguments": _args_obj(c.function.arguments)},
                                       ensure_ascii=False) + TOOL_CLOSE for c in m.tool_calls)
            out.append({"role": "assistant", "content": (m.text() + "\n" + calls).lstrip("\n")})
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
    """One call object found in the (possibly partial) output text."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # exclusive; None while the arguments are incomplete
    complete: bool = False


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def scan_calls(text: str) -> list[CallSpan]:
    """Call objects `{"name": ..., "arguments": ...}` in text, in order; the last one may be
    partial. Anything outside the objects (tags, brackets, commas, whitespace) is skipped."""
    calls: list[CallSpan] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            end = _skip_string(text, i)
            if end is None:
                break
            i = end
        elif c == "{":
            span, i = _scan_call(text, i)
            calls.append(span)
            if not span.complete:
                break
        else:
            i += 1
    return calls


def _scan_call(text: str, i: int) -> tuple[CallSpan, int]:
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
        i = _skip_ws(text, key_end)
        if i >= n or text[i] != ":":
            return span, n
        start = _skip_ws(text, i + 1)
        end = _skip_value(text, start)
        if key == "arguments":
            span.args_start, span.args_end = start, end
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


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # the JSON text of the arguments, as the model wrote it


def is_tool_output(plan: ToolPlan, text: str) -> bool | None:
    """Whether the output is tool calls (True), text (False), or cannot tell yet (None)."""
    if plan.json_output:
        return True
    stripped = text.lstrip()
    if not stripped:
        return None
    return stripped.startswith("<")


def parse_tool_calls(plan: ToolPlan, text: str) -> list[ParsedCall] | None:
    """The calls of a finished output, or None when it is plain text or incomplete (cut by
    max_tokens): then the caller returns the text as content."""
    if not is_tool_output(plan, text):
        return None
    spans = scan_calls(text)
    if not spans or not all(s.complete and s.name is not None and s.args_end is not None
                            for s in spans):
        return None
    calls = []
    for s in spans:
        raw = text[s.args_start:s.args_end]
        try:
            json.loads(raw)
        except json.JSONDecodeError:
            return None
        calls.append(ParsedCall(new_call_id(), s.name, raw))
    return calls


@dataclass(slots=True)
class StreamedCall:
    id: str
    name: str
    sent_args: int = 0  # characters of the arguments already streamed


class ToolCallStreamer:
    """Turns a growing output text into OpenAI tool_call deltas: the first delta of a call has
    its id and name (arguments ""), later ones the new characters of its arguments."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.calls: list[StreamedCall] = []

    def deltas(self, text: str) -> list[dict[str, Any]]:
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
            end = span.args_end if span.args_end is not None else len(text)
            args = text[span.args_start:end].rstrip(" \t\r\n") if span.args_end is None \
                else text[span.args_start:end]
            if len(args) > call.sent_args:
                new = args[call.sent_args:]
                call.sent_args = len(args)
                if out and out[-1]["index"] == index:
                    out[-1]["function"]["arguments"] += new
                else:
                    out.append({"index": index, "function": {"arguments": new}})
        return out
