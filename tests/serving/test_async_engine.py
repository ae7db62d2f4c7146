"""AsyncEngine: the engine thread, per-request streams, aborts, failures, shutdown.

Fast tests run on a scripted fake engine (tests/server/fake_engine.py); the last ones on the real
engine with the default model."""
from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from guided.errors import ConstraintError, InvalidRequestError, OverloadedError
from guided.params import SamplingParams
from guided.serving.async_engine import AsyncEngine

_spec = importlib.util.spec_from_file_location(
    "fake_engine", Path(__file__).parents[1] / "server" / "fake_engine.py")
fake_engine = importlib.util.module_from_spec(_spec)
sys.modules["fake_engine"] = fake_engine  # dataclasses look their module up
_spec.loader.exec_module(fake_engine)


@pytest.fixture
def fake():
    engine = AsyncEngine(fake_engine.FakeEngine())
    yield engine
    asyncio.run(engine.shutdown(drain_timeout=0))


async def collect(engine, request_id, prompt, **params):
    return [out async for out in engine.generate(request_id, prompt, SamplingParams(**params))]


def test_generate_streams_cumulative_outputs(fake):
    outs = asyncio.run(collect(fake, "r1", "ECHO:hello", max_tokens=100))
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].text == "hello"
    assert all(not o.finished for o in outs[:-1])
    assert [len(o.token_ids) for o in outs] == sorted(len(o.token_ids) for o in outs)


def test_many_concurrent_requests(fake):
    async def main():
        return await asyncio.gather(*(collect(fake, f"r{i}", f"ECHO:n{i}") for i in range(20)))

    results = asyncio.run(main())
    assert [r[-1].text for r in results] == [f"n{i}" for i in range(20)]


def test_rejections_raise_before_any_output(fake):
    async def main():
        with pytest.raises(InvalidRequestError):
            await fake.add_request("e", [], SamplingParams())
        with pytest.raises(ConstraintError):  # compiled before the engine sees it
            await fake.add_request("c", "x", SamplingParams(regex="[.*"))
        stream = await fake.add_request("d", "ECHO:SLOW", SamplingParams())
        with pytest.raises(InvalidRequestError):
            await fake.add_request("d", "x", SamplingParams())
        stream.abort()

    asyncio.run(main())
    assert fake.compile_queries == 1


def test_overload(fake):
    fake.engine.config = fake.engine.config.replace(max_waiting_requests=2)

    async def main():
        streams = [await fake.add_request(f"s{i}", "ECHO:SLOW", SamplingParams())
                   for i in range(2)]
        with pytest.raises(OverloadedError):
            await fake.add_request("s3", "ECHO:SLOW", SamplingParams())
        for s in streams:
            s.abort()

    asyncio.run(main())


def _wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_cancelling_the_consumer_aborts(fake):
    async def main():
        async def consume():
            async for _ in fake.generate("slow", "ECHO:SLOW", SamplingParams()):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        assert fake.engine.has_unfinished_requests()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert _wait_for(lambda: not fake.engine.has_unfinished_requests())
    assert _wait_for(lambda: fake.stats().kv_blocks_in_use == 0)


def test_abort_by_id_ends_the_stream(fake):
    async def main():
        stream = await fake.add_request("a", "ECHO:SLOW", SamplingParams())
        fake.abort("a")
        outs = [o async for o in stream]
        assert outs[-1].finished and outs[-1].finish_reason == "abort"

    asyncio.run(main())


def test_a_failing_step_fails_the_requests_not_the_thread(fake):
    async def main():
        boom = await collect(fake, "boom", "ECHO:RAISE")
        assert boom[-1].finish_reason == "error" and boom[-1].error_type == "internal"
        assert "boom" in boom[-1].error
        ok = await collect(fake, "after", "ECHO:fine")
        assert ok[-1].text == "fine"

    asyncio.run(main())
    assert fake.is_running


def test_a_dead_engine_fails_its_requests_and_stops_the_thread(fake):
    """EngineDeadError (a tensor-parallel worker died): no step can run again, so the thread
    ends (in the engine process: the process exits and the server starts a new one)."""
    async def main():
        dead = await collect(fake, "dead", "ECHO:DEAD")
        assert dead[-1].finish_reason == "error" and "rank 1" in dead[-1].error
        with pytest.raises(OverloadedError):
            await collect(fake, "after", "ECHO:fine")

    asyncio.run(main())
    assert not fake.is_running


def test_on_finished_hook_sees_every_finished_request():
    seen = []
    engine = AsyncEngine(fake_engine.FakeEngine(), on_finished=seen.append)
    asyncio.run(collect(engine, "h", "ECHO:hi"))
    asyncio.run(engine.shutdown(0))
    assert [o.request_id for o in seen] == ["h"]


def test_shutdown_drains_then_refuses():
    engine = AsyncEngine(fake_engine.FakeEngine())

    async def main():
        stream = await engine.add_request("d", "ECHO:" + "x" * 30, SamplingParams())
        slow = await engine.add_request("s", "ECHO:SLOW", SamplingParams())
        await engine.shutdown(drain_timeout=1.0)
        outs = [o async for o in stream]
        assert outs[-1].finish_reason == "stop" and outs[-1].text == "x" * 30
        assert [o async for o in slow][-1].finish_reason == "abort"
        with pytest.raises(OverloadedError):
            await engine.add_request("late", "x", SamplingParams())

    asyncio.run(main())
    assert not engine.is_running


def test_outputs_are_snapshots_that_the_engine_cannot_change(fake):
    # the fake hands out its live token list; every output must keep the length it had
    outs = asyncio.run(collect(fake, "snap", "ECHO:abcdefghij", max_tokens=100))
    lens = [len(o.token_ids) for o in outs]
    assert lens == sorted(set(lens)) and lens[-1] == 10
    assert all(o.text == "abcdefghij"[:len(o.token_ids)] for o in outs)


def test_snapshot_copies_every_field():
    from guided.outputs import RequestMetrics, RequestOutput, TokenLogprob
    from guided.serving.snapshots import History, snapshot

    out = RequestOutput("r", [1, 2], [3, 4], "ab", finished=True, finish_reason="stop",
                        stop_reason="x", error="e", error_type="internal",
                        logprobs=[TokenLogprob(3, -0.1)],
                        metrics=RequestMetrics(arrival_time=1.0, forward_passes=2))
    snap = snapshot(out, History())
    assert dataclasses.asdict(snap) == dataclasses.asdict(out)
    assert snap == out and out == snap and repr(snap) == repr(out)
    out.token_ids.append(5)
    out.logprobs.append(TokenLogprob(5, -0.2))
    out.metrics.forward_passes = 3
    assert snap.token_ids == [3, 4] and len(snap.logprobs) == 1
    assert snap.metrics.forward_passes == 2
    assert isinstance(snap.token_ids, list) and snap != out


def test_snapshots_share_a_history_that_only_grows():
    from guided.outputs import RequestOutput
    from guided.serving.snapshots import History, snapshot

    history, live = History(), []
    snaps = []
    for token in range(6):  # an engine that hands out its live list (as the fake does)
        live.append(token)
        snaps.append(snapshot(RequestOutput("r", [9], live, "x"), history))
    assert [s.token_ids for s in snaps] == [list(range(n)) for n in range(1, 7)]
    assert snaps[0].logprobs is None
    live[:] = [7, 7, 7]  # not an extension (never from Engine): a fresh history list
    rewritten = snapshot(RequestOutput("r", [9], live, "x"), history)
    live.append(8)
    assert rewritten.token_ids == [7, 7, 7] and snaps[-1].token_ids == list(range(6))
    assert dataclasses.replace(rewritten, text="y").token_ids == [7, 7, 7]


def test_one_hand_off_per_step_carries_all_its_outputs(fake, monkeypatch):
    from guided.serving import request_stream

    batches = []
    deliver_all = request_stream.deliver_all
    monkeypatch.setattr(request_stream, "deliver_all",
                        lambda batch: (batches.append(len(batch)), deliver_all(batch)))

    async def main():
        return await asyncio.gather(*(collect(fake, f"b{i}", "ECHO:abcdef") for i in range(16)))

    results = asyncio.run(main())
    assert [r[-1].text for r in results] == ["abcdef"] * 16
    assert sum(batches) == 16 * 6 and max(batches) > 1 and len(batches) < 16 * 6


def test_stream_keeps_only_the_latest_output_and_the_finished_one_last():
    from guided.outputs import RequestOutput
    from guided.serving.async_engine import RequestStream

    def output(n, finished=False):
        return RequestOutput("s", [1], list(range(n)), "x" * n, finished=finished)

    async def main():
        aborted = []
        owner = type("Owner", (), {"abort": lambda self, rid: aborted.append(rid)})()
        stream = RequestStream("s", owner, asyncio.get_running_loop())
        stream._deliver(output(1))
        stream._deliver(output(2))
        first = await stream.__anext__()
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        stream._deliver(output(3, finished=True))
        stream._deliver(output(4))  # nothing replaces a finished output
        rest = [await waiting] + [o async for o in stream]
        stream.abort()  # finished: a no-op
        return first, rest, aborted

    first, rest, aborted = asyncio.run(main())
    assert len(first.token_ids) == 2
    assert [len(o.token_ids) for o in rest] == [3] and rest[0].finished
    assert aborted == []


# ---- the real engine ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real():
    from guided.config import EngineConfig
    from guided.engine.core import Engine

    engine = AsyncEngine(Engine(EngineConfig(max_num_seqs=8, jump_forward=False)))
    yield engine
    asyncio.run(engine.shutdown(drain_timeout=0))


@pytest.mark.slow
def test_real_engine_generate_abort_and_no_leaks(real):
    async def main():
        done = asyncio.gather(*(collect(real, f"g{i}", f"Count to {i}:", max_tokens=6,
                                        temperature=0) for i in range(3)))
        gen = real.generate("cancel-me", "Tell me a long story.",
                            SamplingParams(max_tokens=500, ignore_eos=True))
        first = await gen.__anext__()
        await gen.aclose()
        results = await done
        return first, results

    first, results = asyncio.run(main())
    assert first.request_id == "cancel-me"
    assert all(r[-1].finished and len(r[-1].token_ids) == 6 for r in results)
    assert _wait_for(lambda: real.stats().kv_blocks_in_use == 0 and real.stats().num_running == 0,
                     timeout=30)


@pytest.mark.slow
def test_real_engine_constraint(real):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    outs = asyncio.run(collect(real, "j", "Answer in JSON:", json_schema=schema, max_tokens=20,
                               temperature=0))
    assert outs[-1].finish_reason == "stop"
    assert isinstance(json.loads(outs[-1].text)["ok"], bool)
    assert outs[-1].metrics.compile_seconds is not None

    async def bad():
        await real.add_request("bad", "x", SamplingParams(json_schema={"type": "nonsense"}))

    with pytest.raises(ConstraintError):
        asyncio.run(bad())
