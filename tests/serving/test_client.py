"""EngineClient, the server's front end, and the engine loop behind it in its own process.

On the scripted fake engine (tests/fake_engine.py): cumulative streams, many requests, errors
before any output, overload, aborts, a failing step, a dead engine, the finished hook,
outputs the engine cannot change afterwards, one hand-off a step, a drained shutdown. On the real engine (default model, CPU):
constrained generation whose outputs validate, errors that come back as the same exceptions,
aborts, stats, and an engine process that dies or hangs under its requests (they end with an
error, nothing hangs, it is replaced)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import jsonschema
import pytest
from fake_engine import fake_client  # tests/ is on sys.path (its rootdir-less conftest)

from guided.config import EngineConfig
from guided.errors import ConstraintError, InvalidRequestError, OverloadedError
from guided.params import SamplingParams
from guided.serving import client as client_module
from guided.serving import messages as m
from guided.serving.client import EngineClient

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


# ---- the scripted fake engine ---------------------------------------------------------------

@pytest.fixture(scope="module")
def fake():
    engine = fake_client()
    yield engine
    asyncio.run(engine.shutdown(drain_timeout=0))


async def generate(engine, request_id, prompt, params):
    """The request's outputs as they come; closing or cancelling the consumer aborts it (as the
    server's streams do)."""
    stream = await engine.add_request(request_id, prompt, params)
    try:
        async for out in stream:
            yield out
    finally:
        stream.abort()


async def collect(engine, request_id, prompt, **params):
    return [out async for out in generate(engine, request_id, prompt, SamplingParams(**params))]


async def _until(condition, timeout_s: float) -> float:
    """Seconds until condition() held (polled every 0.1 s); fails past timeout_s."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s
        await asyncio.sleep(0.1)
    return time.monotonic() - start


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


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
    queries = fake.compile_queries

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
    assert fake.compile_queries == queries + 1


def test_overload():
    engine = fake_client(max_waiting=2)

    async def main():
        streams = [await engine.add_request(f"s{i}", "ECHO:SLOW", SamplingParams())
                   for i in range(2)]
        with pytest.raises(OverloadedError):
            await engine.add_request("s3", "ECHO:SLOW", SamplingParams())
        for s in streams:
            s.abort()
        await engine.shutdown(drain_timeout=0)

    asyncio.run(main())


def test_cancelling_the_consumer_aborts(fake):
    async def main():
        async def consume():
            async for _ in generate(fake, "slow", "ECHO:SLOW", SamplingParams()):
                pass

        task = asyncio.create_task(consume())
        await _until(lambda: fake.stats().num_running == 1, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert _wait_for(lambda: fake.stats().num_running == 0 and fake.stats().kv_blocks_in_use == 0)


def test_abort_by_id_ends_the_stream(fake):
    async def main():
        stream = await fake.add_request("a", "ECHO:SLOW", SamplingParams())
        fake.abort("a")
        outs = [o async for o in stream]
        assert outs[-1].finished and outs[-1].finish_reason == "abort"

    asyncio.run(main())


def test_a_failing_step_fails_the_requests_not_the_engine(fake):
    async def main():
        boom = await collect(fake, "boom", "ECHO:RAISE")
        assert boom[-1].finish_reason == "error" and boom[-1].error_type == "internal"
        assert "boom" in boom[-1].error
        ok = await collect(fake, "after", "ECHO:fine")
        assert ok[-1].text == "fine"

    asyncio.run(main())
    assert fake.is_running and fake.restarts == 0


def test_a_dead_engine_fails_its_requests_and_is_replaced():
    """EngineDeadError (a tensor-parallel worker died): no step can run again, so the engine
    process exits, and the client starts a new one."""
    engine = fake_client()

    async def main():
        dead = await collect(engine, "dead", "ECHO:DEAD")
        assert dead[-1].finish_reason == "error" and "rank 1" in dead[-1].error
        await _until(lambda: engine.restarts == 1 and engine.is_running, 60)
        after = await collect(engine, "after", "ECHO:fine")
        assert after[-1].text == "fine"
        await engine.shutdown(drain_timeout=0)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_on_finished_hook_sees_every_finished_request(fake):
    seen = []
    fake.on_finished = seen.append
    try:
        asyncio.run(collect(fake, "h", "ECHO:hi"))
    finally:
        fake.on_finished = None
    assert [o.request_id for o in seen] == ["h"] and seen[0].text == "hi"


def test_shutdown_drains_then_refuses():
    engine = fake_client()

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
    assert not engine.is_running and engine.restarts == 0


def test_outputs_keep_what_they_had_while_the_engine_goes_on(fake):
    # the fake hands out its live token list; every output must keep the length it had
    outs = asyncio.run(collect(fake, "snap", "ECHO:abcdefghij", max_tokens=100))
    lens = [len(o.token_ids) for o in outs]
    assert lens == sorted(set(lens)) and lens[-1] == 10
    assert all(o.text == "abcdefghij"[:len(o.token_ids)] for o in outs)


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
    assert max(batches) > 1 and len(batches) < 16 * 6


# ---- the real engine --------------------------------------------------------------------------

def _config() -> EngineConfig:
    return EngineConfig.from_kwargs(model="default", device="cpu", max_num_seqs=8,
                                    log_stats_interval_s=0.0)


@pytest.fixture(scope="module")
def client():
    finished = []
    engine = EngineClient(_config(), log_level="warning")
    engine.on_finished = finished.append
    engine.finished = finished
    yield engine
    asyncio.run(engine.shutdown(drain_timeout=0))


async def _collect(engine, request_id, prompt, **params):
    return [out async for out in generate(engine, request_id, prompt, SamplingParams(**params))]


def test_constrained_outputs_validate_and_grow(client):
    async def main():
        return await asyncio.gather(*(_collect(
            client, f"j{i}", f"Describe person number {i} as JSON.", max_tokens=60,
            json_schema=SCHEMA, seed=i, temperature=1.0) for i in range(4)))

    for outs in asyncio.run(main()):
        final = outs[-1]
        assert final.finished and final.finish_reason == "stop"
        jsonschema.validate(json.loads(final.text), SCHEMA)
        assert [len(o.token_ids) for o in outs] == sorted(len(o.token_ids) for o in outs)
        assert final.prompt_token_ids and final.metrics.first_token_time is not None
    assert client.stats().generation_tokens_total > 0
    assert {o.request_id for o in client.finished} >= {f"j{i}" for i in range(4)}
    hits = client.compile_hits
    asyncio.run(client.compile(SamplingParams(json_schema=SCHEMA).constraint))
    assert client.compile_queries >= 5 and client.compile_hits == hits + 1  # compiled before


def test_errors_come_back_as_the_engines_exceptions(client):
    async def main():
        with pytest.raises(ConstraintError):
            await client.add_request("bad", "x", SamplingParams(json_schema={
                "type": "string", "pattern": "(unclosed"}))
        with pytest.raises(InvalidRequestError):
            await client.add_request("empty", [], SamplingParams())
        first = await client.add_request("dup", "Count to fifty:", SamplingParams(max_tokens=200))
        with pytest.raises(InvalidRequestError, match="duplicate"):
            await client.add_request("dup", "again", SamplingParams(max_tokens=5))
        first.abort()
        outs = [out async for out in first]
        return outs

    outs = asyncio.run(main())
    assert not outs or outs[-1].finish_reason in ("abort", "length", "stop")


def test_a_compile_the_caller_gives_up_on_is_dropped_in_the_engine(client, monkeypatch):
    """The caller's timeout cancels the awaited future: the engine must still be told."""
    sent = []
    send = client._send
    monkeypatch.setattr(client, "_send", lambda message: (sent.append(message), send(message)))
    slow = SamplingParams(json_schema={"type": "string", "pattern": "^[a-z]{0,8000}$"})

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.compile(slow.constraint), 0.01)

    asyncio.run(main())
    compiles = [msg.compile_id for msg in sent if isinstance(msg, m.Compile)]
    assert [msg.compile_id for msg in sent if isinstance(msg, m.Uncompile)] == compiles


def test_an_abort_ends_the_stream_early(client):
    async def main():
        outs = []
        async for out in generate(client, "long", "Tell a long story.",
                                  SamplingParams(max_tokens=400, ignore_eos=True)):
            outs.append(out)
            if len(out.token_ids) >= 5:
                break  # closing the generator aborts the request
        await asyncio.sleep(0.5)
        return outs

    outs = asyncio.run(main())
    assert 5 <= len(outs[-1].token_ids) < 400
    assert client.stats().num_running == 0


def test_a_killed_engine_fails_its_requests_and_is_replaced():
    engine = EngineClient(_config(), log_level="error")

    async def main():
        stream = await engine.add_request("r", "Tell a long story.",
                                          SamplingParams(max_tokens=2000, ignore_eos=True))
        old_pid = engine._process.pid
        os.kill(old_pid, signal.SIGKILL)
        outs = [out async for out in stream]
        assert outs[-1].finished and outs[-1].finish_reason == "error"
        assert not engine.is_running
        with pytest.raises(OverloadedError, match="restarted"):
            await engine.add_request("s", "hi", SamplingParams(max_tokens=2))
        await _until(lambda: engine.is_running, 240)
        assert engine._process.pid != old_pid and engine.restarts == 1
        stats = engine.stats()
        assert stats.num_running == 0 and stats.kv_blocks_in_use == 0  # honest after it
        outs = await _collect(engine, "t", "hi", max_tokens=3, temperature=0)
        assert outs[-1].finish_reason == "length"
        await engine.shutdown(drain_timeout=0)

    asyncio.run(asyncio.wait_for(main(), 300))


def test_a_long_step_that_uses_the_cpu_is_not_taken_for_a_hang(monkeypatch):
    monkeypatch.setattr(client_module, "HUNG_S", 3.0)  # the fake's busy step takes 8 s
    engine = fake_client()

    async def main():
        outs = await collect(engine, "busy", "ECHO:BUSY")
        assert outs[-1].text == "BUSY" and engine.restarts == 0
        await engine.shutdown(drain_timeout=0)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_hung_engine_is_reported_at_once_then_killed_and_replaced(monkeypatch):
    monkeypatch.setattr(client_module, "HUNG_S", 4.0)
    engine = EngineClient(_config(), log_level="error")

    async def main():
        await _until(lambda: engine.is_running, 10)
        old_pid = engine._process.pid
        os.kill(old_pid, signal.SIGSTOP)  # a step that never ends, as far as anyone can tell
        try:
            reported = await _until(lambda: not engine.is_running, 10)
            assert reported <= client_module.UNRESPONSIVE_S + 2 * client_module.PING_INTERVAL_S
            await _until(lambda: engine.restarts == 1 and engine.is_running, 240)
        finally:
            try:
                os.kill(old_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        outs = await _collect(engine, "t", "hi", max_tokens=3, temperature=0)
        assert outs[-1].finish_reason == "length"
        await engine.shutdown(drain_timeout=0)

    asyncio.run(asyncio.wait_for(main(), 300))


def test_shutdown_lets_running_requests_finish():
    engine = EngineClient(_config(), log_level="error")

    async def main():
        stream = await engine.add_request("r", "Say hello.", SamplingParams(max_tokens=16,
                                                                           ignore_eos=True))
        await engine.shutdown(drain_timeout=60)
        outs = [out async for out in stream]
        return outs[-1]

    final = asyncio.run(asyncio.wait_for(main(), 120))
    assert final.finished and final.finish_reason == "length" and len(final.token_ids) == 16
    assert not engine.is_running and engine._process.exitcode == 0
