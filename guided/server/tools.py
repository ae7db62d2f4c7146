"""tools / tool_choice -> a constraint and a prompt; the model's output -> OpenAI tool_calls.

The output is always JSON, guaranteed by a JSON-schema constraint (so a finished output always
parses; only max_tokens can cut it):

- a call is `{"name": <const>, "parameters": <that tool's parameters schema>}` (Llama 3.1's JSON
  tool-call format: "name" sorts before "parameters", so the function is chosen before its
  arguments even when the engine canonicalizes the schema with sorted keys);
- tool_choice named: one call of that tool; "required": one call (anyOf over the tools), or
  also a non-empty array of calls when parallel_tool_calls is true;
- tool_choice "auto": anyOf [a call, (parallel: an array of calls,) `{"content": <text>}`]: the
  model answers in text through the "content" object, which the server unwraps.

Except tool_choice "auto" under a chat template that teaches a tool-call format (Hermes,
Llama 3 JSON, Mistral: guided/server/tool_formats.py): free text, and calls in that format,
constrained by a structural tag. JSON-first stays for templates without one (and beside a
response_format): measured with SmolLM2-135M-Instruct (no tool training), free text with
`<tool_call>` tags gave 0 of 6 calls on BFCL simple_python (the model always starts in prose),
JSON-first 6 of 6 calls with the right function.

Chat templates without tool support (SmolLM2's) get the tools rendered into the system prompt
(`render_tools_prompt`), tool results as `<tool_response>` user turns and earlier assistant calls
as their JSON; templates that mention `tools` get them natively.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from guided.errors import ConstraintError, InvalidRequestError
from guided.fsm.schema_check import check_schema
from guided.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from guided.server.tool_formats import ToolFormat, auto_tag
from guided.server.tool_output import ARGS_KEY, CONTENT_KEY

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
    legacy: bool = False  # the request sent `functions`: answer with message.function_call
    format: ToolFormat | None = None  # auto in a template's tool-call format (structural tag)

    @property
    def json_output(self) -> bool:
        """required / named: the whole output is JSON (no tags)."""
        return self.mode != "auto"


def plan_request_tools(req: ChatCompletionRequest, tool_format: ToolFormat | None = None
                       ) -> ToolPlan | None:
    """The tool plan of a chat request: `tools` / `tool_choice`, or the legacy `functions` /
    `function_call` served as tools (one call at a time); a `response_format` beside tools
    shapes auto's text answer (OpenAI accepts both: the model calls a tool or answers in that
    format)."""
    tools, tool_choice, parallel = req.tools, req.tool_choice, req.parallel_tool_calls
    if req.functions is not None:
        if tools:
            raise InvalidRequestError("send tools or the legacy functions, not both",
                                      param="functions")
        tools = [Tool(function=f) for f in req.functions]
        if tool_choice is None and isinstance(req.function_call, NamedFunction):
            tool_choice = NamedToolChoice(function=req.function_call)
        elif tool_choice is None:
            tool_choice = req.function_call
        parallel = False
    elif req.function_call is not None:
        raise InvalidRequestError("function_call needs functions", param="function_call")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    uses_tools = bool(tools) and tool_choice != "none"
    plan = plan_tools(tools, tool_choice, parallel, content_schema=_content_schema(
        req.response_format) if uses_tools else None, tool_format=tool_format)
    if plan is not None:
        plan.legacy = req.functions is not None
    return plan


def _content_schema(response_format) -> dict[str, Any] | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    if response_format.type == "structural_tag":
        raise InvalidRequestError("a structural_tag response_format together with tools is not "
                                  "supported; send one of them", param="response_format")
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                  param="response_format.json_schema.schema")
    schema = response_format.json_schema.schema_
    return schema if isinstance(schema, dict) else {}


def plan_tools(tools: list[Tool] | None, tool_choice, parallel_tool_calls: bool = True, *,
               content_schema: dict[str, Any] | None = None,
               tool_format: ToolFormat | None = None) -> ToolPlan | None:
    """None when no tool can be called (no tools, or tool_choice "none"). `content_schema`:
    the JSON schema of auto's text answer (a response_format), else free text. `tool_format`:
    the chat template's tool-call format, which auto's calls then take."""
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
    functions = [_function(t, i) for i, t in enumerate(tools)]
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
                        {"json_schema": required_schema(functions, parallel=parallel_tool_calls)})
    if tool_format is not None and content_schema is None:
        closed = [{**f, "parameters": closed_objects(f["parameters"])} for f in functions]
        return ToolPlan("auto", functions, parallel_tool_calls, {"structural_tag": auto_tag(
            tool_format, closed, parallel=parallel_tool_calls)}, format=tool_format)
    return ToolPlan("auto", functions, parallel_tool_calls, {"json_schema": auto_schema(
        functions, parallel=parallel_tool_calls, content_schema=content_schema)})


def _function(tool: Tool, index: int) -> dict[str, Any]:
    params = tool.function.parameters
    if params is None or params == {}:
        params = EMPTY_PARAMETERS
    kind = params.get("type", "object")
    if kind != "object" and kind != ["object"]:
        # arguments are a JSON object (OpenAI's function calling); a string schema would come
        # back as a JSON string in `arguments`, which no client parses as arguments
        raise InvalidRequestError(
            f'a function\'s parameters must be a JSON schema of type "object"; got type '
            f"{json.dumps(kind)[:100]}", param=f"tools[{index}].function.parameters")
    problem = _schema_problem(json.dumps(params, sort_keys=True))
    if problem:  # here, so that the 400 names the tool and a pointer into its own parameters
        raise InvalidRequestError(problem, param=f"tools[{index}].function.parameters")
    return {"name": tool.function.name, "description": tool.function.description or "",
            "parameters": params}


@lru_cache(maxsize=256)  # clients send the same tools request after request (ms per schema)
def _schema_problem(parameters_json: str) -> str | None:
    try:
        check_schema(json.loads(parameters_json))
    except ConstraintError as e:
        return str(e)
    return None


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


def call_schema(function: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One call object; `defs` collects the root `$defs` that its parameters' references need
    (see `parameters_schema`)."""
    params = closed_objects(function["parameters"])
    if defs is not None and _has_ref(params):
        params = parameters_schema(params, f"{function['name']}.parameters", defs)
    return {"type": "object",
            "properties": {"name": {"type": "string", "const": function["name"]},
                           ARGS_KEY: params},
            "required": ["name", ARGS_KEY], "additionalProperties": False}


def _has_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "$ref" in schema or any(_has_ref(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_ref(v) for v in schema)
    return False


def parameters_schema(params: dict[str, Any], key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters with their `$ref`s made to resolve where they now sit, inside a call
    inside the request's schema: a reference of the parameters is relative to the parameters
    object (as when the same schema is a response_format), so `#/<path>` becomes
    `#/$defs/<key>/<path>` and the parameters are also placed at the root's `$defs[key]`."""
    prefix = "#/$defs/" + key.replace("~", "~0").replace("/", "~1")

    def moved(node: Any) -> Any:
        if isinstance(node, list):
            return [moved(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: moved(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = prefix + ref[1:]
        return out

    rewritten = moved(params)
    defs[key] = rewritten
    return rewritten


def _with_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "$defs": defs} if defs else schema


def _calls_schema(functions: list[dict[str, Any]], *, parallel: bool,
                  defs: dict[str, Any] | None = None) -> dict[str, Any]:
    own = {} if defs is None else defs
    calls = [call_schema(f, own) for f in functions]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": one, "minItems": 1} if parallel else one
    return schema if defs is not None else _with_defs(schema, own)


def required_schema(functions: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
    """One call, or (parallel) also an array of calls. A lone call stays an option beside the
    array: forced to open an array, SmolLM2-135M repeated its call until max_tokens (up to the
    whole context) where, given the choice, it writes one call and stops."""
    if not parallel:
        return _calls_schema(functions, parallel=False)
    defs: dict[str, Any] = {}
    return _with_defs({"anyOf": _call_options(functions, parallel=True, defs=defs)}, defs)


def _call_options(functions: list[dict[str, Any]], *, parallel: bool,
                  defs: dict[str, Any]) -> list[dict[str, Any]]:
    options = [call_schema(f, defs) for f in functions]
    if parallel:
        options.append(_calls_schema(functions, parallel=True, defs=defs))
    return options


def auto_schema(functions: list[dict[str, Any]], *, parallel: bool,
                content_schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """Calls or a text answer `{"content": ...}`: a string, or a JSON value following
    content_schema (a response_format: the server returns its JSON text as the content)."""
    defs: dict[str, Any] = {}
    options = _call_options(functions, parallel=parallel, defs=defs)
    content = CONTENT_SCHEMA
    if content_schema is not None:
        if _has_ref(content_schema):
            content_schema = parameters_schema(content_schema, "response_format", defs)
        content = {**CONTENT_SCHEMA, "properties": {CONTENT_KEY: content_schema}}
    return _with_defs({"anyOf": [*options, content]}, defs)


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


# apply_chat_template's own arguments: chat_template_kwargs may not set them
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "tokenize",
                                       "return_dict", "return_tensors", "documents"})


def template_kwargs(req: ChatCompletionRequest, plan: ToolPlan | None, *,
                    native_tools: bool) -> dict[str, Any]:
    """Keyword arguments of tokenizer.apply_chat_template: the tools (templates that render
    them) and the client's chat_template_kwargs (e.g. enable_thinking), which may also turn
    add_generation_prompt off."""
    kwargs: dict[str, Any] = {"add_generation_prompt": True}
    if plan is not None and native_tools:
        kwargs["tools"] = [{"type": "function", "function": f} for f in plan.functions]
    for key, value in (req.chat_template_kwargs or {}).items():
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError(f"chat_template_kwargs may not set {key!r}",
                                      param=f"chat_template_kwargs.{key}")
        kwargs[key] = value
    return kwargs


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def build_messages(messages: list[ChatMessage], plan: ToolPlan | None, *,
                   native_tools: bool) -> list[dict[str, Any]]:
    """Messages as dicts for tokenizer.apply_chat_template (content flattened to text)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        if m.function_call is not None and not m.tool_calls:  # legacy: one call
            m = m.model_copy(update={"tool_calls": [ToolCall(function=m.function_call)]})
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
