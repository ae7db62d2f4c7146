"""Request outputs as deltas between processes (guided/serving/engine_process.py): what a step adds to
each request's cumulative output, so that a step costs the pipe O(new tokens) per request, not
O(all tokens), as snapshots do between threads (guided/serving/snapshots.py).

A delta names where its token ids and logprobs start: where the receiver's lists end when they
only grew, 0 when the sender's list is a new one (jump-forward retokenized the tail); text is
sent from where the receiver's ends when it only grew, else whole. The prompt's token ids go
with the first delta only.
"""
from __future__ import annotations

from dataclasses import dataclass

from guided.outputs import RequestMetrics, RequestOutput
from guided.serving.messages import OutputDelta
from guided.serving.snapshots import History, on_history


@dataclass(slots=True)
class Sent:
    """What the receiver holds of one request (sender side)."""
    tokens: list | None = None  # the sender's list the receiver's copy follows
    num_tokens: int = 0
    logprobs: list | None = None
    num_logprobs: int = 0
    text: str = ""
    prompt_sent: bool = False


def _tokens_of(out: RequestOutput) -> tuple[list, int]:
    """The list out's token ids are a prefix of, and their number, without copying them (a
    snapshot's are its history's first entries)."""
    tokens = getattr(out, "_token_list", None)
    if tokens is not None:
        return tokens, out._num_tokens
    return out.token_ids, len(out.token_ids)


def _logprobs_of(out: RequestOutput) -> tuple[list | None, int]:
    logprobs = getattr(out, "_logprob_list", None)
    if logprobs is not None:
        return logprobs, out._num_logprobs
    return out.logprobs, len(out.logprobs) if out.logprobs is not None else 0


def _grown(items: list, count: int, known: list | None, num_known: int) -> tuple[int, list]:
    """(start, new entries): from num_known where items is the list the receiver follows and
    has not shrunk, else all of it."""
    start = num_known if items is known and count >= num_known else 0
    return start, items[start:count]


def encode(out: RequestOutput, sent: Sent) -> OutputDelta:
    """out as a delta against what the receiver holds (`sent`, updated here; the prompt goes
    with the first)."""
    first, sent.prompt_sent = not sent.prompt_sent, True
    tokens, num_tokens = _tokens_of(out)
    token_start, new_tokens = _grown(tokens, num_tokens, sent.tokens, sent.num_tokens)
    sent.tokens, sent.num_tokens = tokens, num_tokens
    logprobs, num_logprobs = _logprobs_of(out)
    lp_start, new_logprobs = (0, None) if logprobs is None else _grown(
        logprobs, num_logprobs, sent.logprobs, sent.num_logprobs)
    sent.logprobs, sent.num_logprobs = logprobs, num_logprobs
    text = out.text
    text_start = len(sent.text) if text.startswith(sent.text) else 0
    sent.text = text
    return OutputDelta(out.request_id, out.prompt_token_ids if first else None, token_start,
                       new_tokens, text_start, text[text_start:], lp_start, new_logprobs,
                       out.finished, out.finish_reason, out.stop_reason, out.error,
                       out.error_type, out.metrics)


@dataclass(slots=True)
class Received:
    """One request's cumulative output as rebuilt from its deltas (receiver side)."""
    prompt_token_ids: list
    history: History
    text: str = ""


def decode(delta: OutputDelta, received: Received | None) -> tuple[RequestOutput, Received]:
    """The cumulative output a delta brings `received` (None: the request's first) to; the
    output is a snapshot that later deltas leave alone."""
    d = delta
    if received is None:
        received = Received(d.prompt_token_ids if d.prompt_token_ids is not None else [],
                            History())
    history = received.history
    history.token_ids = _apply(history.token_ids, d.token_start, d.new_token_ids)
    if d.new_logprobs is not None:
        history.logprobs = _apply(history.logprobs or [], d.logprob_start, d.new_logprobs)
    received.text = (received.text[:d.text_start] + d.new_text if d.text_start
                     else d.new_text)
    out = RequestOutput(d.request_id, received.prompt_token_ids, history.token_ids,
                        received.text, d.finished, d.finish_reason, d.stop_reason, d.error,
                        d.error_type, history.logprobs,
                        d.metrics if d.metrics is not None else RequestMetrics())
    return on_history(out, history), received


def _apply(items: list, start: int, new: list) -> list:
    """items grown in place where new continues them (what snapshots of it read stays), else a
    new list."""
    if start == len(items):
        items += new
        return items
    return items[:start] + list(new)
