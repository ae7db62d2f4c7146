"""The engine in a process of its own (serving/client.py is the other end).

Why a process: an engine thread beside the server's event loop shares its GIL, which the engine
gives up at every torch and C++ matcher call, so its steps waited for HTTP work (py-spy: 38-41%
of its samples); vLLM's engine core and SGLang's scheduler run apart from the API server too.

    server process (EngineClient)                   engine process (this module)
    Add / Abort / Compile / Ping / Stop  -------->  reader thread -> EngineLoop's queue
    Accepted, Compiled, Outputs, Pong  <----------  outbox thread <- EngineLoop: steps while
                                                    there is work; a step's outputs as deltas,
                                                    one batch
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable

from guided.errors import EngineDeadError, InvalidRequestError, OverloadedError
from guided.serving import messages as m
from guided.serving.messages import Sent, encode, final_output
from guided.serving.stats_log import CompileCounts, StatsLogger

logger = logging.getLogger(__name__)

# When the engine has unfinished requests but a step made no progress (nothing runnable), the
# loop waits this long on the command queue instead of spinning on step().
_NO_PROGRESS_WAIT_S = 0.005
_STEP_FAILURE_BACKOFF_S = 0.5
_STATS_INTERVAL_S = 0.05  # stats on their own, between outputs that carry them


class EngineLoop:
    """Drives one engine: commands come from the reader thread (take), the loop's own thread
    (run) steps while there is work and sends each step's outputs down the pipe. Only that
    thread touches the engine, which is not thread-safe; `send` must be."""

    def __init__(self, engine, send: Callable[[object], None]):
        self.engine = engine
        self._send = send
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Sent] = {}  # what the server holds of each unfinished request
        self._batch: list[m.OutputDelta] = []
        self._stopped = False  # set as the loop stops taking commands
        self._stop_deadline: float | None = None
        self._stats = engine.stats()
        self._last_stats, self._last_stats_time = None, 0.0
        self._tickets: dict = {}  # compile id -> its compiler ticket, until settled
        self._counts_lock = threading.Lock()  # the reader and the compile threads count
        self._compiles = CompileCounts()
        config = getattr(engine, "config", None)
        self._stats_log = StatsLogger(getattr(config, "log_stats_interval_s", 0.0))

    # ---- reader thread ---------------------------------------------------------------------

    def take(self, command) -> None:
        """A command from the server."""
        match command:
            case m.Compile(compile_id, spec):
                self._compile(compile_id, spec)
            case m.Uncompile(compile_id):  # the server gave up on it (client gone, timed out)
                ticket = self._tickets.pop(compile_id, None)
                if ticket is not None:
                    ticket.cancel()
            case _:  # the loop's (Ping: proof that it turns)
                self._commands.put(command)
                if self._stopped:
                    self._reject_pending()

    def _compile(self, compile_id: int, spec) -> None:
        future = self.engine.compiler.submit(spec)
        hit = future.done()
        with self._counts_lock:
            c = self._compiles
            self._compiles = CompileCounts(c.queries + 1, c.hits + hit, c.pending + (not hit))

        def done(f) -> None:
            self._tickets.pop(compile_id, None)
            with self._counts_lock:
                c = self._compiles
                self._compiles = CompileCounts(c.queries, c.hits, c.pending - (not hit))
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
            self._refresh_stats()
            self._flush()  # this step's outputs, and finals of aborts handled within it

    def _drain_commands(self, *, block: bool, timeout: float | None = None) -> None:
        if block:
            self._flush()  # nothing may wait in the batch while the loop sleeps
        while True:
            try:
                command = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            match command:
                case m.Add():
                    self._add(command)
                case m.Abort(request_id):
                    self._abort(request_id)
                case m.Ping():
                    self._send(m.Pong())
                case m.Stop(drain_timeout):
                    self._stop_deadline = time.monotonic() + drain_timeout

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
                self._live[add.request_id] = Sent()
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

    def _abort(self, request_id: str, reason: str = "abort", *, error: str | None = None,
               error_type: str | None = None) -> None:
        sent = self._live.pop(request_id, None)
        if sent is None:
            return
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("engine.abort_request(%r) failed", request_id)
        self._batch.append(encode(final_output(request_id, sent.last, reason, error, error_type),
                                  sent))

    def _abort_all(self, reason: str, *, error: str | None = None,
                   error_type: str | None = None) -> None:
        for request_id in list(self._live):
            self._abort(request_id, reason, error=error, error_type=error_type)

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
            sent = self._live.get(out.request_id)
            if sent is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._live[out.request_id]
            self._batch.append(encode(out, sent))

    def _flush(self) -> None:
        # the stats go with the outputs; on their own when they changed, at most every
        # _STATS_INTERVAL_S while the engine works and the last before it idles
        if self._batch or (self._stats != self._last_stats and (
                time.monotonic() - self._last_stats_time > _STATS_INTERVAL_S
                or not self.engine.has_unfinished_requests())):
            batch, self._batch = self._batch, []
            self._last_stats, self._last_stats_time = self._stats, time.monotonic()
            self._send(m.Outputs(batch, self._stats))

    def _refresh_stats(self) -> None:
        try:
            self._stats = self.engine.stats()
            self._stats_log.maybe_log(self._stats, self._compiles,
                                      getattr(self.engine, "step_times", None))
        except Exception:
            logger.exception("engine.stats() failed")


class Outbox:
    """The pipe to the server, written by a thread of its own, in order: the step loop never
    waits on a server slow to read (its sends were 5% of the loop's py-spy samples on the 8B
    shape, 14% at TP 4), and pickling runs while the loop waits on the GPU."""

    _CLOSE = object()

    def __init__(self, events):
        self._events = events
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def send(self, message) -> None:
        self._queue.put(message)

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._queue.put(self._CLOSE)
        self._thread.join()

    def _run(self) -> None:
        while (message := self._queue.get()) is not self._CLOSE:
            try:
                self._events.send(message)
            except (OSError, ValueError):  # the server is gone: nobody listens any more
                pass
            except Exception:  # noqa: BLE001 - one message lost, not the pipe
                logger.exception("a %s message could not be sent", type(message).__name__)


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
    outbox = Outbox(events)
    send = outbox.send
    try:
        if build_engine is None:
            from guided.engine.core import Engine

            core = Engine(config)
            try:
                core.compiler.warm_up()  # not in the first constrained requests' time
            except Exception:  # noqa: BLE001 - free requests are served all the same
                logger.exception("warming the grammar compiler failed; constrained "
                                 "requests will say why")
        else:
            core = build_engine()
    except BaseException as e:
        logger.exception("the engine failed to start")
        send(m.Failed(f"{type(e).__name__}: {e}"))
        outbox.close()
        return
    executor = getattr(core, "executor", None)
    send(m.EngineInfo(
        model_name=core.model_name, config=core.config, max_model_len=core.max_model_len,
        tokenizer=core.tokenizer, initial_stats=core.stats(),
        device=str(getattr(executor, "device", core.config.device)),
        dtype=str(getattr(executor, "dtype", core.config.dtype))))
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
    outbox.close()
    logging.shutdown()
    os._exit(0)  # done: the interpreter's teardown has nothing left to do but report leaks
