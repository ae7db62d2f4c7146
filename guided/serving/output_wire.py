"""Request outputs as deltas between processes (guided/serving/engine_process.py): what a step
adds to each request's cumulative output, so that a step costs the pipe O(new tokens) per
request, not O(all tokens).

A delta names where its token ids and logprobs start: where the receiver's lists end when the
sender's only grew, 0 when they did not (jump-forward retokenized the tail); text is sent from
where the receiver's ends when it only grew, else whole. The prompt's token ids go with the
first delta only. Each output the receiver rebuilds owns its lists: a stream may hold it while
later deltas arrive.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from guided.outputs import RequestMetrics, RequestOutput
from guided.serving.messages import OutputDelta

_TAIL = 4  # entries compared to tell that a list extends what was sent before


@dataclass(slots=True)
class Sent:
    """What the receiver holds of one request (sender side)."""
    num_tokens: int = 0
    token_tail: list = field(default_factory=list)
    num_logprobs: int = 0
    logprob_tail: list = field(default_factory=list)
    text: str = ""
    prompt_sent: bool = False


def _grown(items: list, num_sent: int, tail: list) -> int:
    """Where the entries the receiver lacks start: num_sent when items extends what was sent
    (its last _TAIL entries there unchanged), else 0 (all of it)."""
    extends = len(items) >= num_sent and items[max(num_sent - _TAIL, 0):num_sent] == tail
    return num_sent if extends else 0


def encode(out: RequestOutput, sent: Sent) -> OutputDelta:
    """out as a delta against what the receiver holds (`sent`, updated here)."""
    first, sent.prompt_sent = not sent.prompt_sent, True
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
                       out.metrics)


@dataclass(slots=True)
class Received:
    """One request's cumulative output as rebuilt from its deltas (receiver side)."""
    prompt_token_ids: list
    token_ids: list = field(default_factory=list)
    logprobs: list | None = None
    text: str = ""


def decode(delta: OutputDelta, received: Received | None) -> tuple[RequestOutput, Received]:
    """The cumulative output a delta brings `received` (None: the request's first) to."""
    d = delta
    if received is None:
        received = Received(d.prompt_token_ids if d.prompt_token_ids is not None else [])
    received.token_ids[d.token_start:] = d.new_token_ids
    if d.new_logprobs is not None:
        if received.logprobs is None:
            received.logprobs = []
        received.logprobs[d.logprob_start:] = d.new_logprobs
    received.text = received.text[:d.text_start] + d.new_text
    out = RequestOutput(d.request_id, received.prompt_token_ids, list(received.token_ids),
                        received.text, d.finished, d.finish_reason, d.stop_reason, d.error,
                        d.error_type,
                        None if received.logprobs is None else list(received.logprobs),
                        d.metrics if d.metrics is not None else RequestMetrics())
    return out, received


def final_output(request_id: str, last: RequestOutput | None, reason: str,
                 error: str | None = None, error_type: str | None = None) -> RequestOutput:
    """The finished output of a request ended from outside the engine (aborted, or its engine
    died): its last output, if any, finished with `reason`."""
    if last is None:
        return RequestOutput(request_id=request_id, prompt_token_ids=[], token_ids=[], text="",
                             finished=True, finish_reason=reason, error=error,
                             error_type=error_type)
    return dataclasses.replace(last, finished=True, finish_reason=reason, error=error,
                               error_type=error_type,
                               metrics=dataclasses.replace(last.metrics))
