"""Admission control: at most `capacity` engine requests (choices) in flight; the rest wait in a
FIFO here, each for at most QUEUE_TIMEOUT_S. What does not fit, by count or by expected wait
((choices queued ahead) x (mean time a choice holds its slot) / capacity), is a 429 with
Retry-After at once, never a request left to time out at its client. A 503 stays for an engine
that is down and compile timeouts."""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterator

from guided.errors import OverloadedError
from guided.fsm.settings import NUM_CPUS

QUEUE_TIMEOUT_S = 30.0  # the longest a request waits here for the engine
# On the CPU a step's forward pass is compute-bound past a few requests per core: more at once
# adds little throughput and only stretches every request (and /health)
CPU_REQUESTS_PER_CORE = 8
MAX_RETRY_AFTER_S = 60
# each finished slot moves the mean holding time this far towards its own
_HOLD_WEIGHT = 0.1


def capacity_for(device: str, max_num_seqs: int, num_cpus: int = NUM_CPUS) -> int:
    """Engine requests admitted at once: max_num_seqs, on the CPU at most CPU_REQUESTS_PER_CORE
    per core."""
    return min(max_num_seqs, CPU_REQUESTS_PER_CORE * num_cpus) if device == "cpu" \
        else max_num_seqs


class QueueFullError(OverloadedError):
    """A 429: the admission queue is full or its wait too long."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = max(1, min(MAX_RETRY_AFTER_S, math.ceil(retry_after_s)))


class Slot:
    """Room for `size` engine requests; release() (idempotent) gives it back."""

    def __init__(self, owner: Admission, size: int):
        self._owner, self.size = owner, size
        self._start = time.monotonic()
        self._released = False
        self._kept = False  # handed to a stream body, which releases it when it ends

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._owner._release(self.size, time.monotonic() - self._start)

    @contextlib.contextmanager
    def held(self) -> Iterator[Slot]:
        """Released on leaving the block, unless keep() handed it to a stream body."""
        try:
            yield self
        finally:
            if not self._kept:
                self.release()

    def keep(self, body: AsyncIterator[str]) -> AsyncIterator[str]:
        """body, holding this slot until it ends (or, never started, is collected)."""
        self._kept = True
        wrapped = _holding(body, self)
        weakref.finalize(wrapped, self.release)
        return wrapped


class Admission:
    """The server's gate in front of the engine (event loop only)."""

    def __init__(self, capacity: int, max_waiting: int, *,
                 queue_timeout_s: float = QUEUE_TIMEOUT_S):
        self.capacity = max(1, capacity)
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s
        self.in_flight = 0  # engine requests holding a slot
        self._queue: deque[tuple[int, asyncio.Future]] = deque()  # (size, woken when admitted)
        self.num_waiting = 0  # engine requests in the queue
        self._mean_hold_s: float | None = None

    def expected_wait_s(self, ahead: int) -> float:
        """A newcomer's wait behind `ahead` queued engine requests (0 before any finished)."""
        return (ahead + 1) * (self._mean_hold_s or 0.0) / self.capacity

    async def enter(self, size: int) -> Slot:
        """A slot for `size` engine requests, after queueing if need be (QueueFullError where the
        queue is full, its expected wait too long, or the wait timed out)."""
        if not self._queue and (not self.in_flight or self.in_flight + size <= self.capacity):
            return self._take(size)
        if self.num_waiting + size > self.max_waiting:
            raise QueueFullError(f"{self.num_waiting} requests are queued (the limit is "
                                 f"{self.max_waiting}); retry later",
                                 self.expected_wait_s(self.num_waiting))
        wait = self.expected_wait_s(self.num_waiting)
        if wait > self.queue_timeout_s:
            raise QueueFullError(f"the server is busy: the expected wait is ~{wait:.0f} s",
                                 wait)
        admitted = asyncio.get_running_loop().create_future()
        entry = (size, admitted)
        self._queue.append(entry)
        self.num_waiting += size
        try:
            await asyncio.wait_for(asyncio.shield(admitted), self.queue_timeout_s)
        except BaseException as e:  # timed out, or the caller was cancelled
            if admitted.done():  # admitted at the last moment: the slot goes back
                admitted.result().release()
            else:
                self._queue.remove(entry)
                self.num_waiting -= size
                admitted.cancel()
                self._wake()  # a large request at the head may have held up smaller ones
            if isinstance(e, asyncio.TimeoutError):
                raise QueueFullError(f"the request waited {self.queue_timeout_s:g} s for the "
                                     "engine; retry later", self.queue_timeout_s) from None
            raise
        return admitted.result()

    def _take(self, size: int) -> Slot:
        self.in_flight += size
        return Slot(self, size)

    def _release(self, size: int, held_s: float) -> None:
        self.in_flight -= size
        self._mean_hold_s = held_s if self._mean_hold_s is None else (
            self._mean_hold_s + _HOLD_WEIGHT * (held_s - self._mean_hold_s))
        self._wake()

    def _wake(self) -> None:
        """Admit from the head while there is room (FIFO: a large request is not overtaken; one
        larger than the capacity enters an empty engine)."""
        while self._queue:
            size, admitted = self._queue[0]
            if self.in_flight and self.in_flight + size > self.capacity:
                return
            self._queue.popleft()
            self.num_waiting -= size
            admitted.set_result(self._take(size))


async def _holding(body: AsyncIterator[str], slot: Slot) -> AsyncIterator[str]:
    try:
        async for chunk in body:
            yield chunk
    finally:
        slot.release()

