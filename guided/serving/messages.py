"""What crosses the pipes between the server (serving/client.py) and the engine process
(serving/engine_process.py): one dataclass per message, each side matching on the type.

    server -> engine   Add, Abort, Compile, Uncompile, Ping, Stop
    engine -> server   EngineInfo | Failed (once), then Accepted, Compiled, Outputs, Pong,
                       and Stopped last

Outputs go as deltas, so that a step costs the pipe O(new tokens) per request: a delta's token
ids and logprobs start where the receiver's lists end when the sender's only grew, at 0 when
they did not (jump-forward retokenized the tail); text likewise; the prompt goes once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from guided.errors import CompileTimeoutError, ConstraintError, InvalidRequestError, OverloadedError
from guided.outputs import EngineStats, RequestMetrics, RequestOutput
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
    """The engine is ready: what the server reads of it (Server, the startup log)."""
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
    """What a step adds to one request's cumulative output."""
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
    metrics: RequestMetrics
    prompt_logprobs: list | None = None  # with the first delta only (complete by then)


@dataclass(frozen=True, slots=True)
class Outputs:
    deltas: list[OutputDelta]  # empty: the stats alone
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class Pong:
    pass


@dataclass(frozen=True, slots=True)
class Stopped:
    pass


# -- outputs as deltas --------------------------------------------------------------------------
_TAIL = 4  # entries compared to tell that a list extends what was sent before


@dataclass(slots=True)
class Sent:
    """What the receiver holds of one request (sender side), and the last output sent."""
    num_tokens: int = 0
    token_tail: list = field(default_factory=list)
    num_logprobs: int = 0
    logprob_tail: list = field(default_factory=list)
    text: str = ""
    last: RequestOutput | None = None


def _grown(items: list, num_sent: int, tail: list) -> int:
    """Where the entries the receiver lacks start: num_sent when items extends what was sent
    (its last _TAIL entries there unchanged), else 0 (all of it)."""
    extends = len(items) >= num_sent and items[max(num_sent - _TAIL, 0):num_sent] == tail
    return num_sent if extends else 0


def encode(out: RequestOutput, sent: Sent) -> OutputDelta:
    """out as a delta against what the receiver holds (`sent`, updated here)."""
    first, sent.last = sent.last is None, out
    tokens = out.token_ids
    token_start = _grown(tokens, sent.num_tokens, sent.token_tail)
    sent.num_tokens, sent.token_tail = len(tokens), tokens[-_TAIL:]
    logprobs, lp_start = out.logprobs, 0
    if logprobs is not None:
        lp_start = _grown(logprobs, sent.num_logprobs, sent.logprob_tail)
        sent.num_logprobs, sent.logprob_tail = len(logprobs), logprobs[-_TAIL:]
    text = out.text
    text_start = len(sent.text) if text.startswith(sent.text) else 0
    sent.text = text
    return OutputDelta(out.request_id, out.prompt_token_ids if first else None, token_start,
                       tokens[token_start:], text_start, text[text_start:], lp_start,
                       None if logprobs is None else logprobs[lp_start:], out.finished,
                       out.finish_reason, out.stop_reason, out.error, out.error_type,
                       out.metrics, out.prompt_logprobs if first else None)


def decode(d: OutputDelta, last: RequestOutput | None) -> RequestOutput:
    """The cumulative output a delta brings the request's last one (None: its first) to. Each
    output owns its lists: a stream may hold it while later deltas arrive."""
    if last is None:
        last = RequestOutput(d.request_id, d.prompt_token_ids or [], [], "",
                             prompt_logprobs=d.prompt_logprobs)
    return RequestOutput(
        d.request_id, last.prompt_token_ids, last.token_ids[:d.token_start] + d.new_token_ids,
        last.text[:d.text_start] + d.new_text, d.finished, d.finish_reason, d.stop_reason,
        d.error, d.error_type, None if d.new_logprobs is None
        else (last.logprobs or [])[:d.logprob_start] + d.new_logprobs, d.metrics,
        last.prompt_logprobs)


def final_output(request_id: str, last: RequestOutput | None, reason: str,
                 error: str | None = None, error_type: str | None = None) -> RequestOutput:
    """The finished output of a request ended from outside the engine (aborted, or its engine
    died): its last output, if any, finished with `reason`."""
    if last is None:
        return RequestOutput(request_id, [], [], "", True, reason, error=error,
                             error_type=error_type)
    return dataclasses.replace(last, finished=True, finish_reason=reason, error=error,
                               error_type=error_type, metrics=dataclasses.replace(last.metrics))
