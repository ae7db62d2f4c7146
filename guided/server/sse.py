"""Server-sent event framing. A streamed token costs the event loop one chunk; building it from
three pydantic models and a fresh JSON encoder took more of the loop's time (which the engine
thread waits for, through the GIL) than anything else in the server. `ChunkFrame` serializes
the parts fixed for a whole stream once, so a plain text delta is two string joins and the JSON
of its text, in exactly the bytes that the pydantic models would give (tests check this)."""
from __future__ import annotations

import json
import time

from guided.server import protocol as P

# json.dumps(..., ensure_ascii=False) builds a new encoder on every call; same output.
_json = json.JSONEncoder(ensure_ascii=False).encode
_END = "}]}\n\n"


def sse(payload: P._Response | dict) -> str:
    data = payload if isinstance(payload, dict) else payload.model_dump(exclude_none=True)
    return f"data: {_json(data)}\n\n"


class ChunkFrame:
    """The chunks of one streamed response (`object`: "chat.completion.chunk" or
    "text_completion"); one `created` for all of them, as OpenAI's streams have."""

    def __init__(self, request_id: str, model: str, object_type: str):
        self.request_id, self.model = request_id, model
        self.created = int(time.time())
        # the head of a one-choice chunk, up to the choice's index
        self._head = (f'data: {{"id": {_json(request_id)}, "object": {_json(object_type)}, '
                      f'"created": {self.created}, "model": {_json(model)}, '
                      f'"choices": [{{"index": ')

    def chat_role(self, index: int) -> str:
        """The first chunk of a chat choice: the assistant's role and empty content."""
        return f'{self._head}{index}, "delta": {{"role": "assistant", "content": ""}}{_END}'

    def chat_text(self, index: int, content: str | None, finish: str | None = None) -> str:
        """A chat chunk whose delta is only text (none: an empty delta) and maybe the end."""
        delta = f'{{"content": {_json(content)}}}' if content else "{}"
        return f'{self._head}{index}, "delta": {delta}{self._finish(finish)}'

    def completion_text(self, index: int, text: str, finish: str | None = None) -> str:
        """A completion chunk with text only (no logprobs)."""
        return f'{self._head}{index}, "text": {_json(text)}{self._finish(finish)}'

    @staticmethod
    def _finish(finish: str | None) -> str:
        return _END if finish is None else f', "finish_reason": {_json(finish)}{_END}'

    def chat(self, choices: list[P.ChatChunkChoice], usage: P.UsageInfo | None = None) -> str:
        """Any chat chunk (tool-call deltas, logprobs, usage) through the pydantic models."""
        return sse(P.ChatCompletionChunk(id=self.request_id, model=self.model,
                                         created=self.created, choices=choices, usage=usage))

    def completion(self, choices: list[P.CompletionChoice],
                   usage: P.UsageInfo | None = None) -> str:
        """Any completion chunk (logprobs, usage) through the pydantic models."""
        return sse(P.CompletionResponse(id=self.request_id, model=self.model,
                                        created=self.created, choices=choices, usage=usage))
