"""The engine in a process of its own, the server's one way to run it (serving/client.py is the
other end).

Why a process: an engine thread beside the server's event loop shared one GIL with it, and the
engine gives the GIL up at every torch call and every C++ matcher call. py-spy on a cold serving
run (GPU) found the engine thread waiting for the GIL in 38-41% of its samples, and the event loop
(HTTP, SSE writes, prompt tokenization) holding it a quarter to a third of the time. Here the
engine's process has no event loop: the step loop shares its GIL only with the compile and mask
threads, and HTTP work cannot slow a step. vLLM (its engine core) and SGLang (its scheduler) run
their step loops apart from the API server for the same reason.

    server process (EngineClient)                   engine process (this module)
    -----------------------------                   ----------------------------
    Add / Abort / Compile / Ping / Stop  -------->  reader thread -> EngineLoop's queue
    Accepted, Compiled, Outputs, Stats, Pong  <---  EngineLoop: steps while there is work;
                                                    a step's outputs as deltas, one batch
                                                    (serving/output_wire.py)
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from guided.errors import EngineDeadError, InvalidRequestError, OverloadedError
from guided.outputs import RequestOutput
from guided.serving import messages as m
from guided.serving.output_wire import Sent, encode, final_output
from guided.serving.stats_log import CompileCounts, StatsLogger

logger = logging.getLogger(__name__)

# When the engine has unfinished requests but a step made no progress (nothing runnable), the
# loop waits this long on the command queue instead of spinning on step().
_NO_PROGRESS_WAIT_S = 0.005
_STEP_FAILURE_BACKOFF_S = 0.5
_STATS_INTERVAL_S = 0.05  # stats on their own, between outputs that carry them


@dataclass(slots=True)
class _StopBy:
    """A Stop as queued for the loop: its drain's deadline (time.monotonic())."""
    deadline: float


class EngineLoop:
    """Drives one engine: commands come from the reader thread (take), the loop's own thread
    (run) steps while there is work and sends each step's outputs down the pipe. Only that
    thread touches the engine, which is not thread-safe; `send` must be."""

    def __init__(self, engine, send: Callable[[object], None]):
        self.engine = engine
        self._send = send
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, RequestOutput | None] = {}  # request id -> its last output
        self._sent: dict[str, Sent] = {}  # what the server holds of each request
        self._batch: list[m.OutputDelta] = []
        self._stopped = False  # set as the loop stops taking commands
        self._stop_deadline: float | None = None
        self._stats = engine.stats()
        self._last_stats, self._last_stats_time = None, 0.0
        self._tickets: dict = {}  # compile id -> its compiler ticket, until settled
        self._counts_lock = threading.Lock()  # the reader and the compile threads count
        self.compile_queries = self.compile_hits = self.compiles_pending = 0
        config = getattr(engine, "config", None)
        self._stats_log = StatsLogger(getattr(config, "log_stats_interval_s", 0.0))

    # ---- reader thread ---------------------------------------------------------------------

    def take(self, command) -> None:
        """A command from the server."""
        match command:
            case m.Add() | m.Abort() | m.Ping():  # the loop's (Ping: proof that it turns)
                self._commands.put(command)
                if self._stopped:
                    self._reject_pending()
            case m.Compile(compile_id, spec):
                self._compile(compile_id, spec)
            case m.Uncompile(compile_id):  # the server gave up on it (client gone, timed out)
                ticket = self._tickets.pop(compile_id, None)
                if ticket is not None:
                    ticket.cancel()
            case m.Stop(drain_timeout):
                self._commands.put(_StopBy(time.monotonic() + drain_timeout))

    def _compile(self, compile_id: int, spec) -> None:
        future = self.engine.compiler.submit(spec)
        hit = future.done()
        with self._counts_lock:
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

    # ---- the loop's thread -----------------------------------------------------------------

    def run(self) -> None:
        """Serve commands and step until stopped (or the engine dies); then shut it down."""
        try:
            self._loop()
        except BaseException as e:  # a dead engine, or a bug outside step(): fail everyone
            if not isinstance(e, EngineDeadError):
                logger.exception("the engine loop died")
            self._abort_all("error", error=f"the engine died: {type(e).__name__}: {e}",
                            error_type="internal")
            self._flush()
        finally:
            self._stopped = True
            self._reject_pending()
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()  # compile pool and worker processes
            except Exception:
                logger.exception("engine.shutdown() failed")

    def _loop(self) -> None:
        while True:
            has_work = self.engine.has_unfinished_requests()
            self._drain_commands(block=not has_work and self._stop_deadline is None)
            has_work = self.engine.has_unfinished_requests()
            if self._stop_deadline is not None and (
                    not has_work or time.monotonic() >= self._stop_deadline):
                self._abort_all("abort")
                self._flush()
                return
            if has_work:
                self._step()
            self._flush()  # this step's outputs, and finals of aborts handled within it
            self._refresh_stats()

    def _drain_commands(self, *, block: bool, timeout: float | None = None) -> None:
        if block:
            self._flush()  # nothing may wait in the batch while the loop sleeps
        while True:
            try:
                command = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            self._handle(command)
            block = False

    def _handle(self, command) -> None:
        match command:
            case m.Add():
                self._add(command)
            case m.Abort(request_id):
                self._abort(request_id)
            case m.Ping():
                self._send(m.Pong())
            case _StopBy(deadline):
                self._stop_deadline = deadline

    def _add(self, add: m.Add) -> None:
        error = None
        if self._stop_deadline is not None:
            error = OverloadedError("the engine is shutting down")
        elif add.request_id in self._live:
            error = InvalidRequestError(f"duplicate request id {add.request_id!r}")
        else:
            try:
                self.engine.add_request(add.request_id, add.prompt, add.params,
                                        arrival_time=add.arrival_time)
                self._live[add.request_id] = None
            except Exception as e:  # noqa: BLE001 - any rejection goes back to the caller
                error = e
        self._send(m.Accepted(add.request_id, m.ErrorInfo.of(error)))

    def _reject_pending(self) -> None:
        """Answer the adds left in the queue once the loop stops taking commands."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, m.Add):
                self._send(m.Accepted(command.request_id, m.ErrorInfo.of(
                    OverloadedError("the engine is shutting down"))))

    def _abort(self, request_id: str) -> None:
        if request_id not in self._live:
            return
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("engine.abort_request(%r) failed", request_id)
        self._post(final_output(request_id, self._live.pop(request_id), "abort"))
        logger.debug("aborted request %s", request_id)

    def _abort_all(self, reason: str, *, error: str | None = None,
                   error_type: str | None = None) -> None:
        for request_id, last in list(self._live.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("engine.abort_request(%r) failed", request_id)
            self._post(final_output(request_id, last, reason, error, error_type))
        self._live.clear()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine.step() failed; failing %d in-flight request(s)",
                             len(self._live))
            self._abort_all("error", error=f"internal engine error: {type(e).__name__}: {e}",
                            error_type="internal")
            if isinstance(e, EngineDeadError):  # no step can run again: the process exits and
                raise  # the server starts a new one
            if self.engine.has_unfinished_requests():
                self._drain_commands(block=True, timeout=_STEP_FAILURE_BACKOFF_S)
            return
        if not outputs and self._stats.num_running == 0:
            self._drain_commands(block=True, timeout=_NO_PROGRESS_WAIT_S)
        for out in outputs:
            self._dispatch(out)

    def _dispatch(self, out: RequestOutput) -> None:
        request_id = out.request_id
        if request_id not in self._live:
            return  # aborted meanwhile
        if out.finished:
            del self._live[request_id]
        else:
            self._live[request_id] = out
        self._post(out)

    def _post(self, out: RequestOutput) -> None:
        sent = self._sent.get(out.request_id)
        if sent is None:
            sent = self._sent[out.request_id] = Sent()
        self._batch.append(encode(out, sent))
        if out.finished:
            del self._sent[out.request_id]

    def _flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self._last_stats, self._last_stats_time = self._stats, time.monotonic()
            self._send(m.Outputs(batch, self._stats))

    def _refresh_stats(self) -> None:
        try:
            self._stats = self.engine.stats()
            with self._counts_lock:
                counts = CompileCounts(self.compile_queries, self.compile_hits,
                                       self.compiles_pending)
            self._stats_log.maybe_log(self._stats, counts, getattr(self.engine, "step_times", None))
        except Exception:
            logger.exception("engine.stats() failed")
            return
        # outputs carry the stats; a step without any, or the last before the engine idles,
        # sends them on their own (at most every _STATS_INTERVAL_S while it works)
        if self._stats != self._last_stats and (
                time.monotonic() - self._last_stats_time > _STATS_INTERVAL_S
                or not self.engine.has_unfinished_requests()):
            self._last_stats, self._last_stats_time = self._stats, time.monotonic()
            self._send(m.Stats(self._stats))


def main(config, commands, events, log_level: str = "info",
         build_engine: Callable[[], object] | None = None) -> None:
    """The engine process: build the engine (the real one for `config`, or build_engine's: the
    server tests' model-free one), say it is ready (or why not), then serve commands until told
    to stop or the server goes away."""
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
        if build_engine is None:
            from guided.engine.core import Engine

            core = Engine(config)
        else:
            core = build_engine()
    except BaseException as e:
        logger.exception("the engine failed to start")
        send(m.Failed(f"{type(e).__name__}: {e}"))
        return
    send(m.Ready(engine_info(core)))
    loop = EngineLoop(core, send)

    def read() -> None:
        while True:
            try:
                command = commands.recv()
            except (EOFError, OSError):  # the server went away: stop now
                loop.take(m.Stop(0.0))
                return
            loop.take(command)

    threading.Thread(target=read, name="engine-commands", daemon=True).start()
    loop.run()
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
