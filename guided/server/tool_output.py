"""Tool calls in the model's output: the formats of the model families we serve (chosen by the
chat template), and the calls found in (possibly partial) output text, whole or as stream
deltas: JSON-first output (tools.py) or text with calls in a template's format (FORMATS)."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from guided.server import protocol as P

if TYPE_CHECKING:
    from guided.server.tools import ToolPlan

ARGS_KEY = "parameters"  # a call's arguments in JSON-first output
CONTENT_KEY = "content"  # auto: a text answer


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    markers: tuple[str, ...]  # any of these in the chat template: the family's format
    trigger: str  # opens a call in free text; a prefix of begin
    begin: str  # a call's text before the function name
    args_field: str  # between the function name and the arguments
    end: str  # after the arguments (its first character closes the call object)


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
    parallel tool calls are off)."""
    tags = [{"type": "tag", "begin": fmt.begin + f["name"] + fmt.args_field,
             "content": {"type": "json_schema", "json_schema": f["parameters"]},
             "end": fmt.end} for f in functions]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
        "stop_after_first": not parallel}}, ensure_ascii=False)


@dataclass(slots=True)
class CallSpan:
    """One top-level JSON object found in the (possibly partial) output text."""

    first_key: str | None = None
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # exclusive; None while the arguments are incomplete
    content_start: int | None = None  # auto's {"content": ...}: the value's first character
    content_end: int | None = None
    complete: bool = False


def scan_calls(text: str) -> list[CallSpan]:
    """The top-level objects in text (calls or `{"content": ...}`); the last may be partial."""
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
        key_end = _value_end(text, i) if text[i] == '"' else None
        if key_end is None:
            return span, n
        key = json.loads(text[i:key_end])
        span.first_key = span.first_key or key
        i = _skip_ws(text, key_end)
        if i >= n or text[i] != ":":
            return span, n
        start = _skip_ws(text, i + 1)
        end = _value_end(text, start)
        if key in (ARGS_KEY, "arguments"):
            span.args_start, span.args_end = start, end
        elif key == CONTENT_KEY and start < n:
            span.content_start, span.content_end = start, end
        elif key == "name" and end is not None:
            span.name = json.loads(text[start:end])
        if end is None:
            return span, n
        i = end


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


_decode = json.JSONDecoder().raw_decode


def _value_end(text: str, i: int) -> int | None:
    """The end of the JSON value at text[i], or None while it is cut off."""
    try:
        return _decode(text, i)[1]
    except json.JSONDecodeError:
        return None


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


def tag_calls(fmt: ToolFormat, text: str, *, finished: bool = True
              ) -> tuple[str, list[CallSpan]]:
    """auto in a tag format: the text outside the calls, and the calls (the last maybe partial).
    While not finished, a tail that may start the trigger is held back from the text."""
    outside: list[str] = []
    spans: list[CallSpan] = []
    i = 0
    while True:
        at = text.find(fmt.trigger, i)
        if at < 0:
            tail = text[i:]
            if not finished:
                tail = tail[:len(tail) - partial_marker_len(tail, fmt.trigger)]
            outside.append(tail)
            break
        outside.append(text[i:at])
        start = text.find("{", at)
        if start < 0:
            break
        span, i = _scan_object(text, start)
        spans.append(span)
        if not span.complete:
            break
        rest = fmt.end[1:]  # the end's first character closed the object
        while rest and text.startswith(rest[0], i):
            i, rest = i + 1, rest[1:]
    return "".join(outside), spans


def partial_marker_len(text: str, marker: str) -> int:
    """The length of text's longest tail that may be the start of marker (held back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def output_kind(plan: ToolPlan, text: str) -> Literal["tools", "text"] | None:
    """Tool calls, a text answer (auto's {"content": ...}), or None: not known yet."""
    if plan.mode != "auto":  # required / named: the whole output is JSON calls
        return "tools"
    stripped = text.lstrip()
    if stripped.startswith("["):
        return "tools"
    spans = scan_calls(stripped[:200])
    if not spans or spans[0].first_key is None:
        return None
    return "text" if spans[0].first_key == CONTENT_KEY else "tools"


def content_text(text: str, span: CallSpan) -> str:
    """auto's text answer so far: a string decoded, or the JSON text of a response_format's."""
    if span.content_start is None:
        return ""
    if text[span.content_start] != '"':
        end = span.content_end if span.content_end is not None else len(text)
        return text[span.content_start:end].rstrip(" \t\r\n")
    raw_end = span.content_end - 1 if span.content_end is not None else len(text)
    return _partial_string(text[span.content_start + 1:raw_end])


def split_output(plan: ToolPlan, text: str, finished: bool = True
                 ) -> tuple[str, list[CallSpan]]:
    """(the text answer so far, the calls, the last maybe partial) of an output."""
    if plan.format is not None:
        return tag_calls(plan.format, text, finished=finished)
    kind = output_kind(plan, text)
    if kind == "text":
        return content_text(text, scan_calls(text)[0]), []
    return "", scan_calls(text) if kind == "tools" else []


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[P.ToolCallOut] | None]:
    """(content, tool calls) of a finished output. One cut by max_tokens gives its complete
    calls (content ""), or auto's text answer so far: never the call format's text."""
    content, spans = split_output(plan, text)
    calls = complete_calls(text, spans)
    return (content.strip() if calls else content), calls or None


def complete_calls(text: str, spans: list[CallSpan]) -> list[P.ToolCallOut]:
    """The calls up to the first one cut by max_tokens."""
    calls = []
    for s in spans:
        if not (s.complete and s.name is not None and s.args_end is not None):
            break
        raw = text[s.args_start:s.args_end]
        try:
            json.loads(raw)
        except json.JSONDecodeError:
            break
        calls.append(P.ToolCallOut(id=new_call_id(), function=P.FunctionCallOut(
            name=s.name, arguments=raw)))
    return calls


@dataclass(slots=True)
class StreamedCall:
    id: str
    name: str
    sent_args: int = 0  # characters of the arguments already streamed


class ToolCallStreamer:
    """A growing output text -> OpenAI deltas: content (auto's text answers, unwrapped) or tool
    calls: the first delta has the id and name (arguments ""), later ones new arguments."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.calls: list[StreamedCall] = []
        self.sent_content = 0

    def deltas(self, text: str, finished: bool = False) -> tuple[str, list[dict[str, Any]]]:
        content, spans = split_output(self.plan, text, finished)
        new = content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(content))
        return new, self._calls(text, spans)

    def _calls(self, text: str, spans: list[CallSpan]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for index, span in enumerate(spans):
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
