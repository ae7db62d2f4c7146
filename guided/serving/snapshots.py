"""Snapshots of the engine's outputs: copies the engine cannot change afterwards, made without
O(tokens) work per step (the engine loop encodes them as deltas after the engine moved on;
the server's streams hold them while later deltas arrive).

Outputs are cumulative, so copying a request's token ids (and logprobs) at every step cost the
engine thread O(tokens) per request per step, O(tokens^2) over a request: with cold int objects
about 11 us per output at 1000 tokens, which the event loop then waits for through the GIL.
Instead each request keeps a `History`, lists that only ever grow by the new entries, and a
snapshot stores how long they were: its lists are sliced out on first read (a server reads them
once, at the end, if at all). A list that a snapshot refers to is only ever appended to, so what
the snapshot reads cannot change.
"""
from __future__ import annotations

import dataclasses
import operator

from guided.outputs import RequestMetrics, RequestOutput

_TAIL = 4  # entries compared to tell that an engine's list extends the history


def _copier(cls):
    """A shallow copy of a dataclass instance: one C-level read of all fields, then the
    constructor; about 3x cheaper than dataclasses.replace."""
    fields = dataclasses.fields(cls)
    if not all(f.init and not f.kw_only for f in fields):
        raise TypeError(f"{cls.__name__}: a field the constructor does not take positionally")
    read = operator.attrgetter(*(f.name for f in fields))
    return lambda obj: cls(*read(obj)), read


copy_output, _read_output = _copier(RequestOutput)
copy_metrics, _ = _copier(RequestMetrics)


def _extend(seen: list, current: list) -> list:
    """`seen` grown in place to `current` when current extends it (outputs are cumulative),
    else a new copy of current, so that a list that snapshots refer to never changes below
    their lengths."""
    k = len(seen)
    if len(current) >= k and current[max(k - _TAIL, 0):k] == seen[max(k - _TAIL, 0):k]:
        seen += current[k:]
        return seen
    return list(current)


class History:
    """One request's token ids and logprobs as handed out so far (engine thread)."""

    __slots__ = ("logprobs", "token_ids")

    def __init__(self):
        self.token_ids: list[int] = []
        self.logprobs: list | None = None

    def update(self, out: RequestOutput) -> None:
        self.token_ids = _extend(self.token_ids, out.token_ids)
        if out.logprobs is not None:
            self.logprobs = _extend(self.logprobs or [], out.logprobs)


_TOKENS = RequestOutput.__dict__["token_ids"]  # the dataclass's slots
_LOGPROBS = RequestOutput.__dict__["logprobs"]
_UNREAD = object()  # in a slot of a _Snapshot: slice the history on first read


def _sliced_on_read(slot, source: str, count: str) -> property:
    """A field whose value is self.<source>[:self.<count>] until first read (then a list)."""
    def get(self):
        value = slot.__get__(self)
        if value is _UNREAD:
            value = getattr(self, source)[:getattr(self, count)]
            slot.__set__(self, value)
        return value

    def put(self, value) -> None:
        slot.__set__(self, value)

    return property(get, put)


class _Snapshot(RequestOutput):
    """A RequestOutput whose token_ids / logprobs are the first entries of a History, made
    lists when first read; otherwise a RequestOutput in every respect (fields, ==, repr)."""

    # the history's lists themselves, not the history: one that is replaced (a retokenized
    # tail) is left as it was, so what a snapshot reads never changes
    __slots__ = ("_logprob_list", "_num_logprobs", "_num_tokens", "_token_list")

    token_ids = _sliced_on_read(_TOKENS, "_token_list", "_num_tokens")
    logprobs = _sliced_on_read(_LOGPROBS, "_logprob_list", "_num_logprobs")

    def __eq__(self, other) -> bool:
        if not isinstance(other, RequestOutput):
            return NotImplemented
        return _read_output(self) == _read_output(other)

    def __repr__(self) -> str:
        return repr(copy_output(self))


def snapshot(out: RequestOutput, history: History) -> RequestOutput:
    """`out` as a copy that the engine cannot change after it was handed to another thread;
    `history` is its request's, updated here with what is new in out (engine thread)."""
    history.update(out)
    return on_history(out, history)


def on_history(out: RequestOutput, history: History) -> RequestOutput:
    """`out` with its token ids and logprobs read from `history` as it is now (which holds
    them already): a snapshot that later growth of the history leaves alone."""
    snap = _Snapshot(*_read_output(out))
    snap._token_list = history.token_ids
    snap._num_tokens = len(history.token_ids)
    snap.token_ids = _UNREAD
    if history.logprobs is not None:
        snap._logprob_list = history.logprobs
        snap._num_logprobs = len(history.logprobs)
        snap.logprobs = _UNREAD
    snap.metrics = copy_metrics(out.metrics)
    return snap


def final_output(request_id: str, last: RequestOutput | None, reason: str,
                 error: str | None = None, error_type: str | None = None) -> RequestOutput:
    """The finished output of a request ended from outside the engine (aborted, or its engine
    died): its last output, if any, finished with `reason`."""
    final = copy_output(last) if last is not None else RequestOutput(
        request_id=request_id, prompt_token_ids=[], token_ids=[], text="")
    final.finished, final.finish_reason = True, reason
    final.error, final.error_type = error, error_type
    final.metrics = copy_metrics(final.metrics)
    return final
