"""One request's outputs on the event loop side of EngineClient: a slot holding the newest
cumulative output (not a queue), filled by deliver_all, one batch per engine step."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
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
        # Outputs are cumulative: only the newest one not yet taken matters (a slot, not a queue).
        self._pending: RequestOutput | None = None
        self._waiter: asyncio.Future | None = None  # the consumer waiting for _pending
        self._done = False  # consumer side: finished output seen, or aborted
        self.last: RequestOutput | None = None

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
        self.last = out
        if out.finished:
            self._done = True
        return out

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Stop the request (frees its KV blocks); a no-op once it finished. Idempotent."""
        if not self._done:
            self._done = True
            self._owner.abort(self.request_id)

    def _deliver(self, out: RequestOutput) -> None:  # event loop
        pending = self._pending
        if pending is not None and pending.finished:
            return  # nothing replaces the last word
        self._pending = out
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


async def stream_outputs(owner, request_id: str, prompt, params) -> AsyncIterator[RequestOutput]:
    """owner.add_request's outputs as they come; closing or cancelling the consumer aborts the
    request (EngineClient's generate)."""
    stream = await owner.add_request(request_id, prompt, params)
    try:
        async for out in stream:
            yield out
    finally:
        stream.abort()


def deliver_all(batch: list[tuple[RequestStream, RequestOutput]]) -> None:  # event loop
    for stream, out in batch:
        stream._deliver(out)


def hand_over(outbox: dict[asyncio.AbstractEventLoop, list]) -> None:
    """Each event loop its batch of (stream, output), in one call_soon_threadsafe (from another
    thread; a closed loop has nobody left to listen)."""
    for loop, batch in outbox.items():
        try:
            loop.call_soon_threadsafe(deliver_all, batch)
        except RuntimeError:
            pass
