"""ChunkFrame's prebuilt chunks are byte for byte what the pydantic models serialize to."""
from __future__ import annotations

import json

import pytest

from guided.server import protocol as P
from guided.server.streaming import ChunkFrame, sse

TEXTS = ["", "a", "héllo wörld 😀", 'quote " backslash \\ slash /', "new\nline\ttab\r",
         "\x00\x01\x1f control", "\u2028\u2029 separators", "</script>", "{\"json\": [1, 2]}",
         "日本語のテキスト", "\ufffd"]


def reference(frame: ChunkFrame, model: type, choices: list) -> str:
    """What the stream sent before ChunkFrame: the models, then json.dumps (with the line
    breaks that str.splitlines() knows escaped: the httpx test below)."""
    payload = model(id=frame.request_id, model=frame.model, created=frame.created,
                    choices=choices)
    data = json.dumps(payload.model_dump(exclude_none=True), ensure_ascii=False)
    return "data: " + data.translate({0x85: "\\u0085", 0x2028: "\\u2028",
                                      0x2029: "\\u2029"}) + "\n\n"


@pytest.fixture(params=[("chatcmpl-abc123", "SmolLM2-135M-Instruct"),
                        ('id "quoted" é', "model/with\\odd\u00e9 name")])
def frame(request):
    return ChunkFrame(*request.param, "chat.completion.chunk")


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "stop", "tool_calls"])
def test_chat_text_matches_the_models(frame, text, finish, index=7):
    delta = P.ChatDelta(content=text or None)
    choices = [P.ChatChunkChoice(index=index, delta=delta, finish_reason=finish)]
    assert frame.chat_text(index, text, finish) == reference(frame, P.ChatCompletionChunk,
                                                             choices) == frame.chat(choices)


@pytest.mark.parametrize("index", [0, 3])
def test_chat_role_matches_the_models(frame, index):
    delta = P.ChatDelta(role="assistant", content="")
    choices = [P.ChatChunkChoice(index=index, delta=delta)]
    assert frame.chat_role(index) == reference(frame, P.ChatCompletionChunk, choices)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "stop", "length"])
def test_completion_text_matches_the_models(text, finish):
    frame = ChunkFrame("cmpl-xyz", "fake-model", "text_completion")
    choices = [P.CompletionChoice(index=2, text=text, finish_reason=finish)]
    assert frame.completion_text(2, text, finish) == reference(
        frame, P.CompletionResponse, choices) == frame.completion(choices)


def test_chunks_are_valid_sse_json():
    frame = ChunkFrame("chatcmpl-1", "m", "chat.completion.chunk")
    chunk = frame.chat_text(0, "hi \"there\"\n", "stop")
    assert chunk.startswith("data: ") and chunk.endswith("\n\n")
    body = json.loads(chunk[len("data: "):])
    assert body == {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                    "created": frame.created, "model": "m",
                    "choices": [{"index": 0, "delta": {"content": "hi \"there\"\n"},
                                 "finish_reason": "stop"}]}


def test_sse_of_a_dict_keeps_non_ascii():
    assert sse({"error": {"message": "é😀"}}) == 'data: {"error": {"message": "é😀"}}\n\n'


# every character str.splitlines() ends a line at: JSON escapes the control ones itself
SPLITLINES_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def test_events_survive_a_reader_that_splits_lines_like_httpx():
    from httpx._decoders import LineDecoder  # what httpx's Response.aiter_lines splits with

    text = "a" + "b".join(SPLITLINES_BREAKS) + "z é😀"
    frame = ChunkFrame("chatcmpl-1", "m", "chat.completion.chunk")
    for event in (frame.chat_text(0, text), frame.completion_text(0, text, "stop"),
                  sse({"error": {"message": text}})):
        lines = [line for line in LineDecoder().decode(event) if line]
        assert len(lines) == 1 and lines[0].startswith("data: ")
        body = json.loads(lines[0][len("data: "):])
        got = (body["error"]["message"] if "error" in body
               else body["choices"][0].get("text") or body["choices"][0]["delta"]["content"])
        assert got == text
