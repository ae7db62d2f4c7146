"""The engine in a process of its own, for the server (guided/serving/client.py is the other end).

Why a process: the engine thread and the server's event loop shared one GIL, and the engine
thread gives it up at every torch call and every C++ matcher call. py-spy on a cold serving run
(GPU, `benchmarks/gpu_suite.sh profile-serve`) found the engine thread waiting for the GIL in
38-41% of its samples, and the event loop (HTTP, SSE writes, prompt tokenization) holding it a
quarter to a third of the time. Here the engine's process has no event loop: the step loop
shares its GIL only with the compile and mask threads, and HTTP work cannot slow a step. vLLM
(its engine core) and SGLang (its scheduler) run their step loops apart from the API server for
the same reason.

    server process (EngineClient)                engine process (this module)
    -----------------------------                ----------------------------
    compile / add / abort / stop  -- commands -->  reader thread -> AsyncEngine's commands
    outputs, answers, stats  <----- events ------  engine thread (outputs as deltas, a batch a
                                                   step: guided/serving/output_wire.py)

The engine process is AsyncEngine's engine thread unchanged, with its outputs and answers
written to a pipe instead of handed to an event loop.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from guided.errors import OverloadedError
from guided.serving import messages as m
from guided.serving.async_engine import AsyncEngine, _Abort, _Add, _Stop
from guided.serving.output_wire import Sent, encode

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Ping:
    """The watchdog's ping, queued for the engine thread (answered between steps)."""


@dataclass(slots=True)
class _Handle:
    """A request's stand-in for AsyncEngine's RequestStream in this process."""
    request_id: str


class ProcessSideEngine(AsyncEngine):
    """AsyncEngine whose outputs and answers go down a pipe (`send(message)`, thread-safe)."""

    def __init__(self, engine, send):
        self._send = send
        self._sent: dict[str, Sent] = {}  # engine thread only
        self._batch: list[m.OutputDelta] = []  # engine thread only
        self._last_stats = None
        self._last_stats_time = 0.0
        self._counts_lock = threading.Lock()
        self._tickets: dict = {}  # compile id -> its compiler ticket, until settled
        super().__init__(engine)

    def _settle(self, accepted, error: BaseException | None) -> None:
        self._send(m.Accepted(accepted, m.ErrorInfo.of(error)))

    def _post(self, stream: _Handle, out) -> None:
        request_id = stream.request_id
        sent = self._sent.get(request_id)
        if sent is None:
            sent = self._sent[request_id] = Sent()
        self._batch.append(encode(out, sent))
        if out.finished:
            del self._sent[request_id]

    def _flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self._last_stats, self._last_stats_time = self._stats, time.monotonic()
            self._send(m.Outputs(batch, self._stats))

    def _refresh_stats(self) -> None:
        super()._refresh_stats()
        # the outputs carry the stats; a step without any, or the last before the engine
        # idles, sends them on their own (at most every 50 ms while it works)
        if self._stats != self._last_stats and (
                time.monotonic() - self._last_stats_time > 0.05
                or not self.engine.has_unfinished_requests()):
            self._last_stats, self._last_stats_time = self._stats, time.monotonic()
            self._send(m.Stats(self._stats))

    def take(self, command) -> None:
        """A command from the server (the reader thread)."""
        match command:
            case m.Add(request_id, prompt, params, arrival_time):
                self._commands.put(_Add(_Handle(request_id), prompt, params, arrival_time,
                                        request_id))
                if self._stopped:
                    self._reject_pending(OverloadedError("the engine is shutting down"))
            case m.Abort(request_id):
                self._commands.put(_Abort(request_id))
            case m.Compile(compile_id, spec):
                self._compile(compile_id, spec)
            case m.Ping():  # answered by the engine thread, between steps: a liveness proof
                self._commands.put(_Ping())
            case m.Uncompile(compile_id):  # the server gave up on it (client gone, timed out)
                ticket = self._tickets.pop(compile_id, None)
                if ticket is not None:
                    ticket.cancel()
            case m.Stop(drain_timeout):
                self._accepting = False
                self._commands.put(_Stop(time.monotonic() + drain_timeout))

    def _handle(self, command) -> None:
        if isinstance(command, _Ping):
            self._send(m.Pong())
        else:
            super()._handle(command)

    def _compile(self, compile_id: int, spec) -> None:
        future = self.engine.compiler.submit(spec)
        hit = future.done()
        with self._counts_lock:  # the stats log's counts: this thread and the compile threads
            self.compile_queries += 1
            self.compile_hits += hit
            self.compiles_pending += not hit

        def done(f) -> None:
            self._tickets.pop(compile_id, None)
            with self._counts_lock:
                self.compiles_pending -= not hit
            if not f.cancelled():
                self._send(m.Compiled(compile_id, hit, m.ErrorInfo.of(f.exception())))

        if not hit:
            self._tickets[compile_id] = future
        future.add_done_callback(done)


def main(config, commands, events, log_level: str = "info") -> None:
    """The engine process: build the engine, say it is ready (or why not), then serve commands
    until told to stop or the server goes away."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the server decides when this process stops (it drains it first): a Ctrl-C at a terminal
    # reaches the whole process group, and a server that dies closes the pipe (EOF: stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lock = threading.Lock()

    def send(message) -> None:
        with lock:
            try:
                events.send(message)
            except (OSError, ValueError):  # the server is gone: nobody listens any more
                pass

    try:
        from guided.engine.core import Engine

        core = Engine(config)
    except BaseException as e:
        logger.exception("the engine failed to start")
        send(m.Failed(f"{type(e).__name__}: {e}"))
        return
    send(m.Ready(engine_info(core)))
    engine = ProcessSideEngine(core, send)

    def read() -> None:
        while True:
            try:
                command = commands.recv()
            except (EOFError, OSError):  # the server went away: stop now
                engine.take(m.Stop(0.0))
                return
            engine.take(command)

    threading.Thread(target=read, name="engine-commands", daemon=True).start()
    engine._thread.join()
    send(m.Stopped())
    logging.shutdown()
    os._exit(0)  # done: the interpreter's teardown has nothing left to do but report leaks


def engine_info(core) -> m.EngineInfo:
    """What the server needs of the engine (guided/server/app.py Server, cli's startup log)."""
    executor = getattr(core, "executor", None)
    return m.EngineInfo(
        model_name=core.model_name, config=core.config, max_model_len=core.max_model_len,
        tokenizer=core.tokenizer, initial_stats=core.stats(),
        device=str(getattr(executor, "device", core.config.device)),
        dtype=str(getattr(executor, "dtype", core.config.dtype)))
