"""EngineClient: the engine in its own process (default model, CPU), driven as the server drives
AsyncEngine: constrained generation whose outputs validate, errors that come back as the same
exceptions, aborts, stats, a drained shutdown, and an engine process that dies under its
requests (they end with an error, nothing hangs)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import jsonschema
import pytest

from guided.config import EngineConfig
from guided.errors import ConstraintError, InvalidRequestError, OverloadedError
from guided.params import SamplingParams
from guided.serving import client as client_module
from guided.serving.client import EngineClient

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


def _config() -> EngineConfig:
    return EngineConfig.from_kwargs(model="default", device="cpu", max_num_seqs=8,
                                    log_stats_interval_s=0.0)


@pytest.fixture(scope="module")
def client():
    finished = []
    engine = EngineClient(_config(), log_level="warning", on_finished=finished.append)
    engine.finished = finished
    yield engine
    asyncio.run(engine.shutdown(drain_timeout=0))


async def _collect(engine, request_id, prompt, **params):
    return [out async for out in engine.generate(request_id, prompt, SamplingParams(**params))]


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


def test_an_abort_ends_the_stream_early(client):
    async def main():
        outs = []
        async for out in client.generate("long", "Tell a long story.",
                                         SamplingParams(max_tokens=400, ignore_eos=True)):
            outs.append(out)
            if len(out.token_ids) >= 5:
                break  # closing the generator aborts the request
        await asyncio.sleep(0.5)
        return outs

    outs = asyncio.run(main())
    assert 5 <= len(outs[-1].token_ids) < 400
    assert client.stats().num_running == 0


async def _until(condition, timeout_s: float) -> float:
    """Seconds until condition() held (polled every 0.1 s); fails past timeout_s."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s
        await asyncio.sleep(0.1)
    return time.monotonic() - start


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
