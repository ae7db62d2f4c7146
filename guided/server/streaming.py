"""Server-sent events: the chunk streams of /v1/chat/completions and /v1/completions, and the
watch on the client's connection (a client that leaves aborts its requests at every stage).
Chunks built from pydantic models took more of the event loop than anything else, so `ChunkFrame`
writes the common ones directly, in exactly the bytes the models would give (tests check this)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from guided.outputs import RequestOutput
from guided.server import protocol as P
from guided.server.jobs import (
    Job,
    chat_logprobs,
    completion_logprobs,
    empty_output,
    error_payload,
    finish_reason,
    split_reasoning,
    usage,
    visible,
)
from guided.server.tool_output import ToolCallStreamer
from guided.serving.request_stream import RequestStream

if TYPE_CHECKING:
    from guided.server.app import Server

T = TypeVar("T")
DONE = "data: [DONE]\n\n"
logger = logging.getLogger("guided.server")

# json.dumps(..., ensure_ascii=False) builds a new encoder on every call; same output.
_encode = json.JSONEncoder(ensure_ascii=False).encode
# the characters besides CR and LF that str.splitlines() ends a line at and JSON leaves raw:
# escaped, or a client reading the stream by splitlines (httpx's aiter_lines) cuts an event in two
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
_END = "}]}\n\n"


def _json(value) -> str:
    return _encode(value).translate(_LINE_BREAKS)


def sse(payload: BaseModel | dict) -> str:
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
        return f'{self._head}{index}, "text": {_json(text)}{self._finish(finish)}'

    @staticmethod
    def _finish(finish: str | None) -> str:
        return _END if finish is None else f', "finish_reason": {_json(finish)}{_END}'

    def chat(self, choices: list[P.ChatChunkChoice], usage: P.UsageInfo | None = None,
             prompt_token_ids: list[int] | None = None) -> str:
        """Any chat chunk (tool-call deltas, logprobs, usage) through the pydantic models."""
        return sse(P.ChatCompletionChunk(id=self.request_id, model=self.model,
                                         created=self.created, choices=choices, usage=usage,
                                         prompt_token_ids=prompt_token_ids))

    def completion(self, choices: list[P.CompletionChoice],
                   usage: P.UsageInfo | None = None) -> str:
        """Any completion chunk (logprobs, usage) through the pydantic models."""
        return sse(P.CompletionResponse(id=self.request_id, model=self.model,
                                        created=self.created, choices=choices, usage=usage))


class ClientGone(Exception):
    """The client closed the connection before the response started."""


async def merged(job: Job, streams: list[RequestStream]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, cumulative output) as they come, over all choices; aborts every request
    when it ends or is closed."""
    try:
        if len(streams) == 1 and len(job.params) == 1:
            # One choice (nearly every stream): read it directly; a pump task and a queue in
            # between cost the event loop two more task switches per token.
            async for out in streams[0]:
                yield 0, out
            return
        async with contextlib.aclosing(_merged_choices(job, streams)) as choices:
            async for item in choices:  # closed with this one: its pumps stop at once
                yield item
    finally:
        abort_all(streams)


async def _merged_choices(job: Job, streams: list[RequestStream]
                          ) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue = asyncio.Queue()
    live = [i for i, p in enumerate(job.params) if p.runs_model]
    for i, p in enumerate(job.params):
        if not p.runs_model:
            queue.put_nowait((i, empty_output(job, i)))

    async def pump(i: int, stream: RequestStream) -> None:
        async for out in stream:
            await queue.put((i, out))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in zip(live, streams)]
    try:
        for _ in range(len(job.params)):
            while True:
                i, out = await queue.get()
                yield i, out
                if out.finished:
                    break
    finally:
        for t in tasks:
            t.cancel()


class _Sent:
    """What a stream has sent of each choice so far (text, logprob entries, token ids), and
    the latest output of each (usage in every chunk counts them)."""

    def __init__(self, job: Job):
        n = len(job.params)
        self.job = job
        self.text, self.entries, self.ids = [0] * n, [0] * n, [0] * n
        self.latest: dict[int, RequestOutput] = {}

    def new_text(self, i: int, text: str) -> str:
        new, self.text[i] = text[self.text[i]:], len(text)
        return new

    def new_entries(self, i: int, out: RequestOutput) -> list:
        new = (out.logprobs or [])[self.entries[i]:]  # out.logprobs: None unless asked
        self.entries[i] += len(new)
        return new

    def new_ids(self, i: int, out: RequestOutput) -> list[int] | None:
        """This chunk's token ids, where the request asked for them (return_token_ids)."""
        if not self.job.returns.token_ids:
            return None
        new, self.ids[i] = list(out.token_ids[self.ids[i]:]), len(out.token_ids)
        return new

    def usage(self) -> P.UsageInfo | None:
        """Usage so far, where the request asked for it in every chunk."""
        if not self.job.returns.usage_every_chunk:
            return None
        return usage(self.job, self.latest)


async def chat_stream(server: Server, job: Job, streams: list[RequestStream]
                      ) -> AsyncIterator[str]:
    n, returns = len(job.params), job.returns
    frame = ChunkFrame(job.request_id, job.model, "chat.completion.chunk")
    sent, sent_thought = _Sent(job), [0] * n
    streamers = [ToolCallStreamer(job.plan) if job.plan else None for _ in range(n)]
    legacy = job.plan is not None and job.plan.legacy
    slow = returns.token_ids or returns.usage_every_chunk  # every chunk through the models

    for i in range(n):  # the body runs in merged(), which aborts the requests at its end
        if slow:
            yield frame.chat([P.ChatChunkChoice(index=i, delta=P.ChatDelta(
                role="assistant", content=""))], usage=sent.usage(),
                prompt_token_ids=job.prompts[0] if returns.token_ids and i == 0 else None)
        else:
            yield frame.chat_role(i)
        if job.echo:  # chat echo: the last message's text first
            yield frame.chat_text(i, job.echo[0])
    async for i, out in merged(job, streams):
        if out.finish_reason == "error":  # the choice ends, then the stream (clients wait
            yield frame.chat_text(i, None, "error")  # for both)
            yield sse(error_payload(out))
            yield DONE
            return
        sent.latest[i] = out
        text, tool_deltas = visible(out), None
        if job.reasoning:  # the think section streams as reasoning_content, the rest as usual
            thought, text = split_reasoning(text, finished=out.finished)
            if len(thought) > sent_thought[i]:
                new = thought[sent_thought[i]:]
                delta = P.ChatDelta(reasoning_content=new, reasoning=new)
                sent_thought[i] = len(thought)
                yield frame.chat([P.ChatChunkChoice(index=i, delta=delta)], usage=sent.usage())
        if streamers[i] is not None:
            content, tool_deltas = streamers[i].deltas(text, out.finished)
        else:
            content = sent.new_text(i, text)
        new_entries, new_ids = sent.new_entries(i, out), sent.new_ids(i, out)
        logprobs = chat_logprobs(new_entries, server.texts, job.num_top,
                                 returns.tokens_as_ids) if new_entries else None
        finish = finish_reason(out, bool(streamers[i] and streamers[i].calls), legacy)
        if tool_deltas or logprobs or (slow and (content or finish or new_ids)):
            delta = P.ChatDelta(content=content or None, tool_calls=[
                P.ToolCallDelta.model_validate(d) for d in tool_deltas or ()] or None)
            yield frame.chat([P.ChatChunkChoice(index=i, delta=legacy_delta(delta) if legacy
                                                else delta, logprobs=logprobs,
                                                finish_reason=finish, token_ids=new_ids)],
                             usage=sent.usage())
        elif content or finish:
            yield frame.chat_text(i, content, finish)
    if returns.usage_at_end:
        yield frame.chat([], usage=usage(job, sent.latest))
    yield DONE


def legacy_delta(delta: P.ChatDelta) -> P.ChatDelta:
    """A delta of tool calls as the legacy `functions` stream it: function_call (one call)."""
    if not delta.tool_calls:
        return delta
    name = next((c.function.name for c in delta.tool_calls if c.function.name), None)
    arguments = "".join(c.function.arguments or "" for c in delta.tool_calls)
    return P.ChatDelta(content=delta.content, function_call=P.FunctionCallDelta(
        name=name, arguments=arguments))


async def completion_stream(server: Server, job: Job, streams: list[RequestStream]
                            ) -> AsyncIterator[str]:
    """Text chunks; where logprobs are asked, every chunk has a logprobs object (empty where
    the chunk adds no token), and return_token_ids puts prompt_token_ids on each choice's
    first chunk."""
    n, returns, echo = len(job.params), job.returns, bool(job.echo)
    frame = ChunkFrame(job.request_id, job.model, "text_completion")
    sent = _Sent(job)
    offsets = [len(job.echo[job.prompt_of[i]]) if echo else 0 for i in range(n)]
    first = set(range(n))  # choices whose first chunk is still to come
    slow = returns.token_ids or returns.usage_every_chunk or job.params[0].logprobs is not None

    def prompt_ids(i: int) -> list[int] | None:
        if not returns.token_ids or i not in first:
            return None
        first.discard(i)
        return job.prompts[job.prompt_of[i]]

    # echo with logprobs: the prompt's text goes with its logprobs, in the choice's first output
    waiting = {i for i in range(n) if echo and job.params[i].prompt_logprobs is not None}

    def echoed(i: int, out: RequestOutput | None) -> str:
        text, logprobs = job.echo[job.prompt_of[i]], None
        if out is not None:
            first_id = job.prompts[job.prompt_of[i]][0]
            logprobs = completion_logprobs(out.prompt_logprobs or [], server.texts, job.num_top,
                                           0, returns.tokens_as_ids, first_id)
        return frame.completion([P.CompletionChoice(
            index=i, text=text, logprobs=logprobs, prompt_token_ids=prompt_ids(i))]) if slow \
            else frame.completion_text(i, text)

    for i in range(n):
        if echo and i not in waiting:
            yield echoed(i, None)
    async for i, out in merged(job, streams):
        if out.finish_reason == "error":
            yield frame.completion_text(i, "", "error")
            yield sse(error_payload(out))
            yield DONE
            return
        if i in waiting:
            waiting.discard(i)
            yield echoed(i, out)
        sent.latest[i] = out
        text = visible(out)
        new_text = sent.new_text(i, text)
        new_entries, new_ids = sent.new_entries(i, out), sent.new_ids(i, out)
        finish = out.finish_reason if out.finished else None
        if not (new_text or finish or new_entries or new_ids):
            continue
        if slow:
            logprobs = None if job.params[i].logprobs is None else completion_logprobs(
                new_entries, server.texts, job.num_top,
                offsets[i] + len(text) - len(new_text), returns.tokens_as_ids)
            yield frame.completion([P.CompletionChoice(
                index=i, text=new_text, logprobs=logprobs, finish_reason=finish,
                token_ids=new_ids, prompt_token_ids=prompt_ids(i))], usage=sent.usage())
        else:
            yield frame.completion_text(i, new_text, finish)
    if returns.usage_at_end:
        yield frame.completion([], usage=usage(job, sent.latest))
    yield DONE


def abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


def sse_response(body: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    # The body aborts its requests when it ends or is closed; this also covers a body that is
    # dropped without ever being started (the client left before the response began).
    weakref.finalize(body, abort_all, streams)
    return StreamingResponse(_ended(body), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _ended(body: AsyncIterator[str]) -> AsyncIterator[str]:
    """body, ended properly even where it raises: an error event and `data: [DONE]` (a stream
    cut without them leaves clients waiting or guessing)."""
    try:
        async for chunk in body:
            yield chunk
    except Exception as e:  # a bug while streaming: the client still gets an end
        logger.exception("a stream failed")
        yield sse(P.error_body(f"internal error while streaming: {type(e).__name__}",
                               type="internal_error", code=500))
        yield DONE
    finally:
        await body.aclose()  # type: ignore[attr-defined]


# ---- the client's connection --------------------------------------------------------------------

async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, coro: Awaitable[T]) -> T:
    """Run coro; if the client goes away first, cancel it (its requests are aborted) and raise
    ClientGone. Covers the stages before a response starts: queued, compiling, prefilling."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone
