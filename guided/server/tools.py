"""tools / tool_choice -> a constraint and a prompt; the model's output -> OpenAI tool_calls.
JSON-first: a call is `{"name": <const>, "parameters": {...}}` under a JSON-schema constraint
("name" sorts first, so the function is chosen before its arguments); "auto" also admits
`{"content": <text>}`, unwrapped by the server. Under a chat template that teaches a tool-call
format (tool_output.py), "auto" is free text with calls in that format instead (a model without
tool training calls reliably only JSON-first)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from guided.errors import ConstraintError, InvalidRequestError
from guided.fsm.schema_check import check_schema
from guided.server.constraint_fields import response_format_constraint
from guided.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from guided.server.tool_output import ARGS_KEY, CONTENT_KEY, ToolFormat, auto_tag

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
CONTENT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {CONTENT_KEY: {"type": "string"}},
                                  "required": [CONTENT_KEY], "additionalProperties": False}

@dataclass(slots=True)
class ToolPlan:
    """How one request uses tools: the constraint to send and how to read the output."""

    mode: Literal["auto", "required", "named"]
    functions: list[dict[str, Any]]  # [{"name", "description", "parameters"}] offered
    parallel: bool
    constraint: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs
    legacy: bool = False  # the request sent `functions`: answer with message.function_call
    format: ToolFormat | None = None  # auto in a template's tool-call format (structural tag)


def plan_request_tools(req: ChatCompletionRequest, tool_format: ToolFormat | None = None
                       ) -> ToolPlan | None:
    """`tools` / `tool_choice`, or the legacy `functions` / `function_call` as tools (one call
    at a time); a `response_format` beside tools shapes auto's text answer, as OpenAI's does."""
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
    if tool_choice == "auto" and not tools:  # as OpenAI and vLLM refuse it
        raise InvalidRequestError('tool_choice "auto" needs tools', param="tool_choice")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    uses_tools = bool(tools) and tool_choice != "none"
    plan = plan_tools(tools, tool_choice, parallel, content_schema=_content_schema(
        req.response_format) if uses_tools else None, tool_format=tool_format)
    if plan is not None:
        plan.legacy = req.functions is not None
    return plan


def _content_schema(response_format) -> dict[str, Any] | None:
    if response_format is not None and response_format.type == "structural_tag":
        raise InvalidRequestError("a structural_tag response_format together with tools is not "
                                  "supported; send one of them", param="response_format")
    found = response_format_constraint(response_format)
    if not found:
        return None
    schema = found[0][1].get("json_schema", {"type": "object"})  # json_object: any object
    return schema if isinstance(schema, dict) else {}


def plan_tools(tools: list[Tool] | None, tool_choice, parallel_tool_calls: bool = True, *,
               content_schema: dict[str, Any] | None = None,
               tool_format: ToolFormat | None = None) -> ToolPlan | None:
    """None when no tool can be called. `content_schema`: auto's text answer's schema (else
    free text); `tool_format`: the template's tool-call format, which auto's calls then take."""
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
    names = [f["name"] for f in functions]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise InvalidRequestError(f"duplicate tool name {dup!r}", param="tools")
    if isinstance(tool_choice, NamedToolChoice):
        chosen = [f for f in functions if f["name"] == tool_choice.function.name]
        return ToolPlan("named", chosen, False,
                        {"json_schema": calls_schema(chosen, parallel=False)})
    if tool_choice == "required":
        return ToolPlan("required", functions, parallel_tool_calls,
                        {"json_schema": calls_schema(functions, parallel=parallel_tool_calls)})
    if tool_format is not None and content_schema is None:
        closed = [{**f, "parameters": closed_objects(f["parameters"])} for f in functions]
        return ToolPlan("auto", functions, parallel_tool_calls, {"structural_tag": auto_tag(
            tool_format, closed, parallel=parallel_tool_calls)}, format=tool_format)
    return ToolPlan("auto", functions, parallel_tool_calls, {"json_schema": calls_schema(
        functions, parallel=parallel_tool_calls, content_schema=content_schema,
        with_content=True)})


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
    """A copy where objects with declared properties admit no others (OpenAI's strict mode):
    never looser, and a small model cannot invent arguments until max_tokens."""
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


def call_schema(function: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One call object; `defs` collects the root `$defs` its parameters' references need."""
    params = moved_refs(closed_objects(function["parameters"]),
                        f"{function['name']}.parameters", defs)
    return {"type": "object",
            "properties": {"name": {"type": "string", "const": function["name"]},
                           ARGS_KEY: params},
            "required": ["name", ARGS_KEY], "additionalProperties": False}


def moved_refs(params: Any, key: str, defs: dict[str, Any]) -> Any:
    """params as a subschema of the request's schema: where it has local references (relative
    to params, as in a response_format), it is placed at the root's `$defs[key]` and each
    `#/<path>` becomes `#/$defs/<key>/<path>`; else unchanged."""
    prefix = "#/$defs/" + key.replace("~", "~0").replace("/", "~1")
    found = False

    def moved(node: Any) -> Any:
        nonlocal found
        if isinstance(node, list):
            return [moved(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: moved(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"], found = prefix + ref[1:], True
        return out

    out = moved(params)
    if not found:
        return params
    defs[key] = out
    return out


def calls_schema(functions: list[dict[str, Any]], *, parallel: bool,
                 content_schema: dict[str, Any] | None = None,
                 with_content: bool = False) -> dict[str, Any]:
    """One call of any of `functions`; parallel: also a non-empty array of calls (a lone call
    stays an option: forced to open an array, SmolLM2-135M repeated its call until max_tokens);
    with_content: also a text answer `{"content": ...}`, a string or (content_schema, a
    response_format) a JSON value."""
    defs: dict[str, Any] = {}
    options = [call_schema(f, defs) for f in functions]
    if parallel:
        items = options[0] if len(options) == 1 else {"anyOf": list(options)}
        options.append({"type": "array", "items": items, "minItems": 1})
    if with_content:
        content = CONTENT_SCHEMA
        if content_schema is not None:
            content = {**CONTENT_SCHEMA, "properties": {
                CONTENT_KEY: moved_refs(content_schema, "response_format", defs)}}
        options.append(content)
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs} if defs else schema


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
    """apply_chat_template's kwargs: the tools (templates that render them) and the client's
    chat_template_kwargs (e.g. enable_thinking; add_generation_prompt may be turned off)."""
    kwargs: dict[str, Any] = {"add_generation_prompt": req.add_generation_prompt}
    if req.continue_final_message:  # the last message stays open: the answer continues it
        if req.add_generation_prompt or req.messages[-1].role != "assistant":
            raise InvalidRequestError(
                "continue_final_message needs add_generation_prompt false and an assistant "
                "message last", param="continue_final_message")
        kwargs["continue_final_message"] = True
    if plan is not None and native_tools:
        kwargs["tools"] = [{"type": "function", "function": f} for f in plan.functions]
    for key, value in (req.chat_template_kwargs or {}).items():
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError(f"chat_template_kwargs may not set {key!r}",
                                      param=f"chat_template_kwargs.{key}")
        kwargs[key] = value
    return kwargs


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
