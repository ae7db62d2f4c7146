"""What crosses the pipes between the server (serving/client.py) and the engine process
(serving/engine_process.py): one dataclass per message, each side matching on the type.

    server -> engine   Add, Abort, Compile, Uncompile, Ping, Stop
    engine -> server   Ready | Failed (once), then Accepted, Compiled, Outputs, Stats, Pong,
                       and Stopped last
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from guided.errors import CompileTimeoutError, ConstraintError, InvalidRequestError, OverloadedError
from guided.outputs import EngineStats, RequestMetrics
from guided.params import ConstraintSpec, SamplingParams

# errors that keep their type across the pipe (a bad request stays a 400, a timeout a 503)
ERRORS = {cls.__name__: cls for cls in (InvalidRequestError, ConstraintError, OverloadedError,
                                        CompileTimeoutError)}


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """An exception on the pipe, named by its nearest class in ERRORS."""
    kind: str
    message: str
    param: str | None = None

    @classmethod
    def of(cls, error: BaseException | None) -> ErrorInfo | None:
        if error is None:
            return None
        name = next((c.__name__ for c in type(error).__mro__ if c.__name__ in ERRORS),
                    type(error).__name__)
        return cls(name, str(error), getattr(error, "param", None))

    def exception(self) -> BaseException:
        """guided's own errors by their type; anything else a RuntimeError naming it."""
        cls = ERRORS.get(self.kind)
        if cls is None:
            return RuntimeError(f"{self.kind}: {self.message}")
        return (cls(self.message) if issubclass(cls, OverloadedError)
                else cls(self.message, param=self.param))


# -- server -> engine ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Compile:
    compile_id: int
    spec: ConstraintSpec


@dataclass(frozen=True, slots=True)
class Uncompile:
    """The server gave up on a compile (its client went away, or timed out)."""
    compile_id: int


@dataclass(frozen=True, slots=True)
class Ping:
    """The server's watchdog asks whether the engine loop still turns."""


@dataclass(frozen=True, slots=True)
class Stop:
    drain_timeout: float


# -- engine -> server ---------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineInfo:
    """What the server reads of the engine at start (Server, the startup log)."""
    model_name: str
    config: Any
    max_model_len: int
    tokenizer: Any
    device: str
    dtype: str
    initial_stats: EngineStats

    def stats(self) -> EngineStats:
        return self.initial_stats


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str


@dataclass(frozen=True, slots=True)
class Accepted:
    request_id: str
    error: ErrorInfo | None


@dataclass(frozen=True, slots=True)
class Compiled:
    compile_id: int
    cache_hit: bool
    error: ErrorInfo | None


@dataclass(slots=True)
class OutputDelta:
    """What a step adds to one request's cumulative output (serving/output_wire.py)."""
    request_id: str
    prompt_token_ids: list[int] | None  # with the first delta only
    token_start: int
    new_token_ids: list[int]
    text_start: int
    new_text: str
    logprob_start: int
    new_logprobs: list | None
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    error: str | None
    error_type: str | None
    metrics: RequestMetrics | None


@dataclass(frozen=True, slots=True)
class Outputs:
    deltas: list[OutputDelta]
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class Stats:
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class Pong:
    pass


@dataclass(frozen=True, slots=True)
class Stopped:
    pass
