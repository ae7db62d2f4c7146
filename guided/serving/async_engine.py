"""The synchronous Engine in its own thread, with one asyncio stream of outputs per request.

    event loop (server)                         engine thread
    -------------------                         -------------
    add_request() --- _Add --> commands ----->  engine.add_request()  -- accepted / error -->
    RequestStreams <-- call_soon_threadsafe --  engine.step() outputs (copied), one batch a step
    stream.abort() -- _Abort --> commands --->  engine.abort_request()

Only the engine thread touches the Engine (it is not thread-safe). The thread blocks on the
command queue when it has no work, and steps back to back while it has some. Constraints are
compiled (awaited on the event loop) before a request reaches the engine, so the step loop
never waits on a compile and a bad constraint fails before a stream starts.

The two threads share the GIL, so every microsecond either spends per output is taken from the
other. Hence one cross-thread hand-off per step carrying all its outputs (each
call_soon_threadsafe writes to the loop's self-pipe: a syscall that releases the GIL and wakes
the loop), snapshots that cost O(new tokens) rather than O(all tokens) (guided.serving.snapshots), and
streams that keep only the latest output instead of queueing them.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from guided.errors import EngineDeadError, InvalidRequestError, OverloadedError
from guided.outputs import EngineStats, RequestOutput
from guided.params import ConstraintSpec, SamplingParams
from guided.serving.request_stream import RequestStream, hand_over, stream_outputs
from guided.serving.snapshots import History, copy_metrics, copy_output, snapshot
from guided.serving.stats_log import CompileCounts, StatsLogger

logger = logging.getLogger(__name__)

# When the engine has unfinished requests but a step made no progress (nothing runnable), the
# thread waits this long on the command queue instead of spinning on step().
_NO_PROGRESS_WAIT_S = 0.005
_STEP_FAILURE_BACKOFF_S = 0.5


@dataclass(slots=True)
class _Add:
    stream: RequestStream
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    accepted: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Stop:
    deadline: float


def _final(request_id: str, last: RequestOutput | None, reason: str, error: str | None = None,
           error_type: str | None = None) -> RequestOutput:
    final = copy_output(last) if last is not None else RequestOutput(
        request_id=request_id, prompt_token_ids=[], token_ids=[], text="")
    final.finished, final.finish_reason = True, reason
    final.error, final.error_type = error, error_type
    final.metrics = copy_metrics(final.metrics)
    return final


class AsyncEngine:
    """Owns an Engine and the thread that drives it. Use from one asyncio event loop."""

    def __init__(self, engine, *, on_finished: Callable[[RequestOutput], None] | None = None):
        self.engine = engine
        self.on_finished = on_finished  # called on the engine thread for each finished output
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, RequestStream] = {}  # engine thread only
        self._last: dict[str, RequestOutput] = {}  # engine thread only
        self._histories: dict[str, History] = {}  # engine thread only: what snapshots share
        # Outputs not yet handed to their event loop, by loop (engine thread only); _flush()
        # sends each loop its batch with one call_soon_threadsafe.
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}
        self._accepting = True
        self._stopped = False  # set by the engine thread as it stops taking commands
        self._stopping: asyncio.Future | None = None  # shutdown()'s join of the thread
        self._stop_deadline: float | None = None
        self._stats: EngineStats = engine.stats()
        self.compile_queries = 0
        self.compile_hits = 0  # grammar ready at submit time (the compiler's cache had it)
        self.compiles_pending = 0  # requests awaiting their constraint's compile
        config = getattr(engine, "config", None)
        self._stats_log = StatsLogger(getattr(config, "log_stats_interval_s", 0.0))
        self._thread = threading.Thread(target=self._run, name="guided-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config, **kwargs) -> AsyncEngine:
        from guided.engine.core import Engine

        return cls(Engine(config), **kwargs)

    # ---- event-loop side -------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step (a snapshot; never blocks on the engine)."""
        return self._stats

    async def compile(self, spec: ConstraintSpec):
        """Compile a constraint off the event loop; raises ConstraintError for a bad one."""
        future = self.engine.compiler.submit(spec)
        self.compile_queries += 1
        if future.done():
            self.compile_hits += 1
            return future.result()
        self.compiles_pending += 1
        try:
            return await asyncio.wrap_future(future)
        finally:
            self.compiles_pending -= 1

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          *, arrival_time: float | None = None,
                          compiled: bool = False) -> RequestStream:
        """Hand a request to the engine; raises InvalidRequestError / ConstraintError /
        OverloadedError before any output, so a server can still answer with an error status.
        compiled: the caller compiled the constraint already (one compile per HTTP request,
        its choices sharing the cached grammar)."""
        if not self._accepting or not self._thread.is_alive():
            raise OverloadedError("the engine is shutting down")
        arrival_time = time.time() if arrival_time is None else arrival_time
        spec = params.constraint
        if spec is not None and not compiled:
            await self.compile(spec)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop)
        accepted = loop.create_future()
        self._commands.put(_Add(stream, prompt, params, arrival_time, accepted))
        if self._stopped:  # the thread stopped after the check above: nobody else answers
            self._reject_pending(OverloadedError("the engine is shutting down"))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added meanwhile: do not leak it
            raise
        return stream

    def generate(self, request_id: str, prompt: str | list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; closing or cancelling the consumer aborts it."""
        return stream_outputs(self, request_id, prompt, params)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def shutdown(self, drain_timeout: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to drain_timeout seconds, abort
        the rest, and join the engine thread."""
        self._accepting = False
        if self._stopping is None:  # the first call sets the deadline; later ones wait for it
            if self._thread.is_alive():
                self._commands.put(_Stop(time.monotonic() + drain_timeout))
            self._stopping = asyncio.ensure_future(asyncio.to_thread(self._thread.join))
        await asyncio.shield(self._stopping)

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug outside step(): fail everyone rather than hang them
            logger.exception("the engine thread died")
            self._accepting = False
            self._stopped = True
            self._abort_all("error", error=f"the engine thread died: {type(e).__name__}: {e}",
                            error_type="internal")
            self._flush()
            self._reject_pending(OverloadedError("the engine thread is not running"))
            return
        finally:
            self._stats_log.close()
        self._stopped = True
        self._reject_pending(OverloadedError("the engine is shutting down"))
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()  # compile pool and runner threads
            except Exception:
                logger.exception("engine.shutdown() failed")

    def _loop(self) -> None:
        while True:
            has_work = self.engine.has_unfinished_requests()
            self._drain_commands(block=not has_work and self._stop_deadline is None)
            self._flush()  # finals of the aborts just handled
            has_work = self.engine.has_unfinished_requests()
            if self._stop_deadline is not None and (
                    not has_work or time.monotonic() >= self._stop_deadline):
                self._abort_all("abort")
                self._flush()
                self._refresh_stats()
                return
            if has_work:
                self._step()
            self._flush()  # this step's outputs, and finals of aborts handled within it
            self._refresh_stats()

    def _reject_pending(self, error: Exception) -> None:
        """Answer the commands left in the queue once the thread stops taking them."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._settle(command.accepted, error)

    def _drain_commands(self, *, block: bool) -> None:
        timeout = None
        if block:
            self._flush()  # nothing may wait in the outbox while the thread sleeps
        while True:
            try:
                command = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            self._handle(command)
            block = False

    def _wait_for_command(self, timeout: float) -> None:
        self._flush()  # nothing may wait in the outbox while the thread sleeps
        try:
            command = self._commands.get(timeout=timeout)
        except queue.Empty:
            return
        self._handle(command)

    def _handle(self, command) -> None:
        if isinstance(command, _Add):
            self._handle_add(command)
        elif isinstance(command, _Abort):
            self._handle_abort(command.request_id)
        elif isinstance(command, _Stop):
            self._stop_deadline = command.deadline

    def _handle_add(self, command: _Add) -> None:
        stream, error = command.stream, None
        if self._stop_deadline is not None:
            error = OverloadedError("the engine is shutting down")
        elif stream.request_id in self._live:
            error = InvalidRequestError(f"duplicate request id {stream.request_id!r}")
        else:
            try:
                self.engine.add_request(stream.request_id, command.prompt, command.params,
                                        arrival_time=command.arrival_time)
                self._live[stream.request_id] = stream
            except Exception as e:  # noqa: BLE001 - any rejection goes back to the caller
                error = e
        self._settle(command.accepted, error)

    def _handle_abort(self, request_id: str) -> None:
        stream = self._live.pop(request_id, None)
        if stream is None:
            return
        self._histories.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("engine.abort_request(%r) failed", request_id)
        self._post(stream, _final(request_id, self._last.pop(request_id, None), "abort"))
        logger.debug("aborted request %s", request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine.step() failed; failing %d in-flight request(s)",
                             len(self._live))
            self._abort_all("error", error=f"internal engine error: {type(e).__name__}: {e}",
                            error_type="internal")
            if isinstance(e, EngineDeadError):  # no step can run again: the thread ends (the
                self._flush()  # engine process exits and the server starts a new one)
                raise
            if self.engine.has_unfinished_requests():
                self._wait_for_command(_STEP_FAILURE_BACKOFF_S)
            return
        if not outputs and self._stats.num_running == 0:
            self._wait_for_command(_NO_PROGRESS_WAIT_S)
        for out in outputs:
            self._dispatch(out)

    def _dispatch(self, out: RequestOutput) -> None:
        request_id = out.request_id
        history = self._histories.get(request_id)
        if history is None:
            history = self._histories[request_id] = History()
        out = snapshot(out, history)
        if out.finished and self.on_finished is not None:
            try:
                self.on_finished(out)
            except Exception:
                logger.exception("on_finished hook failed")
        stream = self._live.get(request_id)
        if stream is None or out.finished:
            self._histories.pop(request_id, None)
        if stream is None:
            return  # aborted meanwhile
        if out.finished:
            del self._live[request_id]
            self._last.pop(request_id, None)
        else:
            self._last[request_id] = out
        self._post(stream, out)

    def _abort_all(self, reason: str, *, error: str | None = None,
                   error_type: str | None = None) -> None:
        for request_id, stream in list(self._live.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("engine.abort_request(%r) failed", request_id)
            self._post(stream, _final(request_id, self._last.pop(request_id, None), reason,
                                      error, error_type))
        self._live.clear()
        self._histories.clear()

    def _settle(self, accepted, error: BaseException | None) -> None:
        """Answer an _Add: accepted (error None) or refused (engine thread)."""
        _resolve(accepted, error)

    def _post(self, stream: RequestStream, out: RequestOutput) -> None:
        batch = self._outbox.get(stream._loop)
        if batch is None:
            batch = self._outbox[stream._loop] = []
        batch.append((stream, out))

    def _flush(self) -> None:
        """Hand the outbox over: one call_soon_threadsafe per event loop (one in a server)."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        hand_over(outbox)

    def _refresh_stats(self) -> None:
        try:
            self._stats = self.engine.stats()
            self._stats_log.maybe_log(
                self._stats, CompileCounts(self.compile_queries, self.compile_hits,
                                           self.compiles_pending),
                getattr(self.engine, "step_times", None))
        except Exception:
            logger.exception("engine.stats() failed")


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:
        pass
