"""The engine process's side of the pipe: errors cross it as the classes the server maps to
HTTP statuses, and compiles the server gave up on are dropped (the loop's end-to-end behaviour:
tests/serving/test_client.py)."""
from __future__ import annotations

import multiprocessing
import threading
import time

from guided.errors import (
    CompileTimeoutError,
    ConstraintError,
    InvalidRequestError,
    OverloadedError,
)
from guided.fsm.compiler import GrammarCompiler
from guided.fsm.schema_check import Unsatisfiable
from guided.fsm.settings import CompileSettings
from guided.outputs import EngineStats
from guided.params import ConstraintSpec
from guided.serving import messages as m
from guided.serving.engine_process import EngineLoop, Outbox


def roundtrip(error):
    info = m.ErrorInfo.of(error)
    return None if info is None else info.exception()


def test_errors_cross_as_their_nearest_known_class():
    error = roundtrip((Unsatisfiable("no value", param="response_format")))
    assert type(error) is ConstraintError and error.param == "response_format"
    assert type(roundtrip((InvalidRequestError("bad")))) is InvalidRequestError
    assert type(roundtrip((OverloadedError("full")))) is OverloadedError
    assert isinstance(roundtrip((KeyError("x"))), RuntimeError)
    assert roundtrip(None) is None


def test_a_compile_timeout_crosses_as_itself_with_its_retry_after():
    error = roundtrip((CompileTimeoutError("timed out")))
    assert type(error) is CompileTimeoutError and error.retry_after_s > 0


class _CompilerOnly:
    """An engine with no requests, only its grammar compiler (what a compile command uses)."""

    def __init__(self, compiler):
        self.compiler = compiler

    def stats(self) -> EngineStats:
        return EngineStats()

    def has_unfinished_requests(self) -> bool:
        return False


def test_a_compile_the_server_gave_up_on_is_dropped(tokenizer):
    """"uncompile" cancels the compile's ticket: queued behind a stuck one, it never runs."""
    compiler = GrammarCompiler(tokenizer, vocab_size=49152,
                               config=CompileSettings(compile_threads=1, compile_timeout_s=30))
    release, started = threading.Event(), []
    real = compiler._compile_sync

    def compile_sync(spec):
        started.append(spec.value)
        release.wait(10)
        return real(spec)

    compiler._compile_sync = compile_sync
    sent = []
    engine = EngineLoop(_CompilerOnly(compiler), sent.append)
    try:
        engine.take(m.Compile(1, ConstraintSpec("regex", "a+")))  # runs, held
        while not started:
            time.sleep(0.01)
        engine.take(m.Compile(2, ConstraintSpec("regex", "b+")))  # queued
        engine.take(m.Uncompile(2))
        assert compiler._pool.num_queued == 0
        release.set()
        deadline = time.monotonic() + 30
        while not any(isinstance(msg, m.Compiled) for msg in sent):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert started == ["a+"]
        assert [msg.compile_id for msg in sent if isinstance(msg, m.Compiled)] == [1]
    finally:
        release.set()
        engine.take(m.Stop(0.0))
        compiler.shutdown()


def test_the_outbox_sends_in_order_and_a_bad_message_loses_only_itself(caplog):
    receiver, sender = multiprocessing.Pipe(duplex=False)
    outbox = Outbox(sender)
    outbox.send(m.Pong())
    outbox.send(threading.Lock())  # cannot be pickled: logged and dropped
    for i in range(200):
        outbox.send(m.Accepted(f"r{i}", None))
    outbox.close()
    assert isinstance(receiver.recv(), m.Pong)
    assert [receiver.recv().request_id for _ in range(200)] == [f"r{i}" for i in range(200)]
    assert not receiver.poll()
    assert "a lock message could not be sent" in caplog.text


def test_the_outbox_outlives_a_server_that_went_away():
    receiver, sender = multiprocessing.Pipe(duplex=False)
    receiver.close()
    outbox = Outbox(sender)
    outbox.send(m.Pong())
    outbox.send(m.Pong())
    outbox.close()  # returns: nothing raised, nothing left waiting
