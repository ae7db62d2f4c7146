"""The server's one front end to the engine, which runs in a process of its own
(serving/engine_process.py says why): each call a message down a pipe, each answer and step's
outputs a message back, taken by a reader thread.

If the engine process dies, every open request ends with an error and every waiting call fails;
/health reports it and a fresh engine process is started in its place. A watchdog pings the
engine loop every second (answered between steps): one silent for UNRESPONSIVE_S is reported by
/health, and past HUNG_S killed and replaced, unless its process still uses CPU (a long step),
then only past BUSY_HUNG_S.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable

from guided.errors import OverloadedError
from guided.outputs import EngineStats, RequestOutput
from guided.params import ConstraintSpec, SamplingParams
from guided.serving import messages as m
from guided.serving.engine_process import main
from guided.serving.messages import EngineInfo, decode, final_output
from guided.serving.request_stream import RequestStream, hand_over

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 1.0
# a step never takes seconds on its own (a prefill chunk is bounded by max_num_batched_tokens,
# compiles run off the step loop)...
UNRESPONSIVE_S = 5.0
HUNG_S = 30.0
# ...unless its CPU is loaded: one step of 2048 tokens took 30-117 s on 2 cores (200 clients)
BUSY_HUNG_S = 600.0
START_TIMEOUT_S = 1800.0  # loading a large model from a cold disk


class EngineClient:
    """An engine process and its pipes. Construct before the event loop runs (it waits for the
    engine to load); then use from one asyncio event loop."""

    def __init__(self, config, *, log_level: str = "info",
                 build_engine: Callable[[], object] | None = None):
        # build_engine: a picklable callable that builds the engine in its process instead of
        # Engine(config) (the server tests' model-free engine)
        self._config, self._log_level, self._build_engine = config, log_level, build_engine
        # called on the reader thread for each finished output
        self.on_finished: Callable[[RequestOutput], None] | None = None
        self._send_lock = threading.Lock()
        self.engine = self._start_engine()
        self._stats = self.engine.initial_stats
        self._streams: dict[str, RequestStream] = {}
        self._last: dict[str, RequestOutput] = {}  # reader thread only: what deltas build on
        self._adds: dict[str, asyncio.Future] = {}
        self._compiles: dict[int, asyncio.Future] = {}
        self._compile_ids = itertools.count()
        self._accepting = True
        self._alive = True
        self._stopped: asyncio.Future | None = None
        self.compile_queries = 0
        self.compile_hits = 0
        self.restarts = 0  # engine processes replaced after they died or hung
        self._last_pong = time.monotonic()  # the engine loop's last answer to a ping
        threading.Thread(target=self._read, name="engine-events", daemon=True).start()
        threading.Thread(target=self._watch, name="engine-watchdog", daemon=True).start()

    def _start_engine(self) -> EngineInfo:
        """A fresh engine process, loaded (its pipes replace the old ones)."""
        context = multiprocessing.get_context("spawn")  # CUDA is never forked
        commands_in, commands = context.Pipe(duplex=False)
        events, events_out = context.Pipe(duplex=False)
        process = context.Process(target=main, name="guided-engine", daemon=True,
                                  args=(self._config, commands_in, events_out, self._log_level,
                                        self._build_engine))
        process.start()
        commands_in.close()  # the engine's ends: an exit of the engine is EOF here
        events_out.close()
        with self._send_lock:
            self._process, self._commands, self._events = process, commands, events
        deadline = time.monotonic() + START_TIMEOUT_S
        while not events.poll(0.5):
            if not process.is_alive():
                raise RuntimeError(f"the engine process exited ({process.exitcode}) while loading")
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the engine did not load within {START_TIMEOUT_S:.0f} s")
        message = events.recv()
        if isinstance(message, EngineInfo):
            return message
        process.join(10)
        raise RuntimeError(f"the engine failed to start: {getattr(message, 'reason', message)}")

    # ---- event-loop side -------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """Alive and answering (not silent for UNRESPONSIVE_S)."""
        return (self._alive and self._process.is_alive()
                and time.monotonic() - self._last_pong < UNRESPONSIVE_S)

    def stats(self) -> EngineStats:
        """The engine's stats as of its last message (never waits for the engine)."""
        return self._stats

    async def compile(self, spec: ConstraintSpec):
        """Compile a constraint in the engine process; raises ConstraintError for a bad one."""
        future = asyncio.get_running_loop().create_future()
        compile_id = next(self._compile_ids)
        self._compiles[compile_id] = future
        self.compile_queries += 1
        try:
            self._send(m.Compile(compile_id, spec))
            return await future
        finally:
            self._compiles.pop(compile_id, None)
            # the caller gave up (its cancellation cancelled the future): a compile nobody
            # waits for is dropped
            if future.cancelled() or not future.done():
                self._send(m.Uncompile(compile_id))

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          *, compiled: bool = False) -> RequestStream:
        """Hand a request to the engine; raises InvalidRequestError / ConstraintError /
        OverloadedError before any output, so a server can still answer with an error status,
        and returns its stream after. compiled: the caller compiled the constraint already (one
        compile per HTTP request, its choices sharing the cached grammar)."""
        if not self._accepting:
            raise OverloadedError("the engine is shutting down")
        # a slow step (a heavy prefill on a busy CPU) delays the pong; only a dead or
        # restarting engine refuses work (a hung one is killed and restarted by the watchdog)
        if not (self._alive and self._process.is_alive()):
            raise OverloadedError("the engine is not running (it is being restarted)")
        arrival_time = time.time()
        if params.constraint is not None and not compiled:
            await self.compile(params.constraint)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop)
        accepted = self._adds[request_id] = loop.create_future()
        self._streams[request_id] = stream
        try:
            self._send(m.Add(request_id, prompt, params, arrival_time))
            await accepted
        except BaseException:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            self.abort(request_id)  # it may have been added meanwhile: do not leak it
            raise
        finally:
            self._adds.pop(request_id, None)
        return stream

    def abort(self, request_id: str) -> None:
        self._send(m.Abort(request_id))

    async def shutdown(self, drain_timeout: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to drain_timeout seconds (the
        engine aborts the rest), and wait for the engine process to exit."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        if self._stopped is None:
            self._stopped = loop.create_future()
            if self._alive:
                self._send(m.Stop(drain_timeout))
            else:
                self._stopped.set_result(None)
        try:
            await asyncio.wait_for(asyncio.shield(self._stopped), drain_timeout + 60.0)
        except asyncio.TimeoutError:
            logger.error("the engine process did not stop: killing it")
        await asyncio.to_thread(self._join)

    def _join(self) -> None:
        self._process.join(30.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)

    def _send(self, message) -> None:
        with self._send_lock:
            try:
                self._commands.send(message)
            except (OSError, ValueError) as e:
                if isinstance(message, (m.Add, m.Compile)):  # the rest have nothing to end
                    raise OverloadedError("the engine process is not running") from e

    # ---- reader thread ---------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                try:
                    message = self._events.recv()
                except (EOFError, OSError):
                    break
                try:
                    if not self._take(message):
                        break
                except Exception:
                    logger.exception("handling the engine's %s message failed",
                                     type(message).__name__)
        finally:
            self._on_exit()

    def _take(self, message) -> bool:
        """Handle one message; False once the engine has stopped."""
        match message:
            case m.Outputs(deltas, stats):
                self._stats = stats
                if deltas:
                    hand_over([self._rebuild(delta) for delta in deltas])
            case m.Accepted(request_id, error):
                future = self._adds.get(request_id)
                if future is not None:
                    _resolve(future, None if error is None else error.exception())
            case m.Compiled(compile_id, hit, error):
                future = self._compiles.get(compile_id)
                self.compile_hits += hit
                if future is not None:
                    _resolve(future, None if error is None else error.exception())
            case m.Pong():
                self._last_pong = time.monotonic()
            case m.Stopped():
                return False
        return True

    def _rebuild(self, delta: m.OutputDelta) -> tuple[RequestStream | None, RequestOutput]:
        request_id = delta.request_id
        out = decode(delta, self._last.get(request_id))
        if out.finished:
            self._last.pop(request_id, None)
            stream = self._streams.pop(request_id, None)
            if self.on_finished is not None:
                try:
                    self.on_finished(out)
                except Exception:
                    logger.exception("on_finished hook failed")
        else:
            self._last[request_id] = out
            stream = self._streams.get(request_id)
        return stream, out

    def _on_exit(self) -> None:
        """The engine stopped (asked to, or died): end what still waits on it."""
        died = self._stopped is None
        self._alive = False
        if died:
            logger.error("the engine process exited (%s)", self._process.exitcode)
        error = OverloadedError("the engine process is not running")
        for future in list(self._adds.values()):
            _resolve(future, error)
        for future in list(self._compiles.values()):
            _resolve(future, error)
        streams, self._streams = self._streams, {}
        hand_over([(stream, final_output(request_id, self._last.get(request_id),
                                       "error" if died else "abort",
                                       "the engine process exited" if died else None,
                                       "unavailable" if died else None))
                       for request_id, stream in streams.items()])
        if self._stopped is not None:
            _resolve(self._stopped, None)
        elif died and self._accepting:
            self._restart()

    # ---- supervision -----------------------------------------------------------------------

    def _restart(self) -> None:
        """A fresh engine process in place of a dead one (this thread: the old reader's, which
        ends here); tried until one starts or the server stops."""
        self._stats = self.engine.initial_stats  # nothing runs: /metrics says so
        for attempt in itertools.count(1):
            if not self._accepting:
                return
            try:
                self.engine = self._start_engine()
                break
            except Exception:
                logger.exception("restarting the engine failed (attempt %d)", attempt)
                time.sleep(min(30.0, 2.0 * attempt))
        self._stats = self.engine.initial_stats
        self._last.clear()
        self.restarts += 1
        self._last_pong = time.monotonic()
        self._alive = True
        logger.warning("the engine process was restarted (%d restart(s) so far)", self.restarts)
        threading.Thread(target=self._read, name="engine-events", daemon=True).start()

    def _watch(self) -> None:
        """Ping the engine loop every PING_INTERVAL_S; one silent past HUNG_S is killed (its
        reader then restarts it)."""
        cpu, progress = None, time.monotonic()  # the process's CPU time; when it last grew
        while self._stopped is None:
            time.sleep(PING_INTERVAL_S)
            if not self._alive:
                continue
            self._send(m.Ping())
            now = time.monotonic()
            last, cpu = cpu, _cpu_seconds(self._process.pid)
            if cpu is not None and last is not None and cpu - last > 0.05 * PING_INTERVAL_S:
                progress = now
            silent = now - self._last_pong
            if self._process.is_alive() and (silent > BUSY_HUNG_S or (
                    silent > HUNG_S and now - progress > HUNG_S)):
                logger.error("the engine has not answered for %.0f s: killing it", silent)
                self._process.kill()


def _cpu_seconds(pid: int | None) -> float | None:
    """The CPU time a process has used (Linux /proc), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    """Settle an event loop's future from another thread (a closed loop: nobody listens)."""
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
