"""Admission: a FIFO in front of the engine, bounded by count, expected wait and a queue
timeout; every refusal a QueueFullError (a 429) with a Retry-After; no slot ever leaks."""
from __future__ import annotations

import asyncio

import pytest

from guided.server.admission import (
    CPU_REQUESTS_PER_CORE,
    MAX_RETRY_AFTER_S,
    Admission,
    QueueFullError,
    capacity_for,
)


def run(coro):
    return asyncio.run(coro)


def test_requests_within_capacity_enter_at_once_and_the_rest_wait_in_order():
    async def main():
        gate = Admission(2, max_waiting=10)
        a, b = await gate.enter(1), await gate.enter(1)
        order = []

        async def wait(name, size):
            slot = await gate.enter(size)
            order.append(name)
            return slot

        c = asyncio.create_task(wait("c", 2))
        await asyncio.sleep(0)
        d = asyncio.create_task(wait("d", 1))  # fits after a, but c is first in line
        await asyncio.sleep(0.01)
        assert gate.num_waiting == 3 and not order
        a.release()
        await asyncio.sleep(0.01)
        assert not order  # c needs 2: it waits for b too, and d waits behind it
        b.release()
        (await c).release()
        (await d).release()
        assert order == ["c", "d"] and gate.in_flight == 0 and gate.num_waiting == 0

    run(main())


def test_a_full_queue_is_refused_at_once_with_a_retry_after():
    async def main():
        gate = Admission(1, max_waiting=1)
        slot = await gate.enter(1)
        waiter = asyncio.create_task(gate.enter(1))
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError, match="queued") as error:
            await gate.enter(1)
        assert 1 <= error.value.retry_after_s <= MAX_RETRY_AFTER_S
        slot.release()
        (await waiter).release()
        assert gate.in_flight == 0

    run(main())


def test_an_expected_wait_past_the_queue_timeout_is_refused_at_once():
    async def main():
        gate = Admission(1, max_waiting=100, queue_timeout_s=10)
        gate._mean_hold_s = 4.0  # each request holds the engine ~4 s
        slot = await gate.enter(1)
        queued = [asyncio.create_task(gate.enter(1)) for _ in range(2)]  # ~4 s, ~8 s
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError, match="expected wait is ~12 s") as error:
            await gate.enter(1)
        assert error.value.retry_after_s == 12
        for task in queued:
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        slot.release()
        assert gate.num_waiting == 0 and gate.in_flight == 0

    run(main())


def test_a_request_that_waits_past_the_queue_timeout_is_refused_and_leaves_the_queue():
    async def main():
        gate = Admission(1, max_waiting=10, queue_timeout_s=0.1)
        slot = await gate.enter(1)
        with pytest.raises(QueueFullError, match="waited 0.1 s"):
            await gate.enter(1)
        assert gate.num_waiting == 0
        slot.release()
        (await gate.enter(1)).release()

    run(main())


def test_a_request_larger_than_the_capacity_enters_an_idle_engine():
    async def main():
        gate = Admission(2, max_waiting=10)
        slot = await gate.enter(5)
        assert gate.in_flight == 5
        slot.release()

    run(main())


def test_a_cancelled_waiter_leaves_and_a_kept_slot_is_released_by_its_stream():
    async def main():
        gate = Admission(1, max_waiting=10)
        slot = await gate.enter(1)
        waiter = asyncio.create_task(gate.enter(1))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert gate.num_waiting == 0

        async def body():
            yield "a"
            yield "b"

        with slot.held():
            stream = slot.keep(body())
        assert gate.in_flight == 1  # kept by the stream body
        assert [chunk async for chunk in stream] == ["a", "b"]
        assert gate.in_flight == 0

        never_started = await gate.enter(1)
        with never_started.held():
            dropped = never_started.keep(body())
        del dropped  # the client left before the body started: collected, released
        assert gate.in_flight == 0

    run(main())


def test_a_cpu_admits_a_few_requests_per_core_and_a_gpu_max_num_seqs():
    assert capacity_for("cpu", 256, num_cpus=2) == 2 * CPU_REQUESTS_PER_CORE
    assert capacity_for("cpu", 4, num_cpus=2) == 4  # a smaller max_num_seqs holds
    assert capacity_for("cuda:0", 256, num_cpus=2) == 256
