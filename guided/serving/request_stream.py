"""One request's outputs on the event loop side of EngineClient: a slot holding the newest
cumulative output (not a queue), filled by deliver_all, one batch per engine step."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from guided.outputs import RequestOutput

if TYPE_CHECKING:
    from guided.serving.client import EngineClient


class RequestStream:
    """Async iterator over one request's cumulative outputs; coalesces what piled up, so a slow
    consumer always sees the latest state. Ends after the finished output."""

    def __init__(self, request_id: str, owner: EngineClient, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._owner = owner
        self._loop = loop
        self._pending: RequestOutput | None = None  # the newest output not yet taken
        self._waiter: asyncio.Future | None = None  # the consumer waiting for _pending
        self._done = False  # consumer side: finished output seen, or aborted

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while self._pending is None:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out, self._pending = self._pending, None
        self._done = out.finished
        return out

    def abort(self) -> None:
        """Stop the request (frees its KV blocks); a no-op once it finished. Idempotent."""
        if not self._done:
            self._done = True
            self._owner.abort(self.request_id)

    def _deliver(self, out: RequestOutput) -> None:  # event loop
        if self._pending is not None and self._pending.finished:
            return  # nothing replaces the last word
        self._pending = out
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def deliver_all(batch: list[tuple[RequestStream, RequestOutput]]) -> None:  # event loop
    for stream, out in batch:
        stream._deliver(out)


def hand_over(batch: list[tuple[RequestStream | None, RequestOutput]]) -> None:
    """Each event loop its share of a step's outputs in one call_soon_threadsafe (from another
    thread: each such call writes to the loop's self-pipe, so one a step, not one an output)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, out in batch:
        if stream is not None:
            by_loop.setdefault(stream._loop, []).append((stream, out))
    for loop, outs in by_loop.items():
        try:
            loop.call_soon_threadsafe(deliver_all, outs)
        except RuntimeError:  # a closed loop has nobody left to listen
            pass
