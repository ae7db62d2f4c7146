"""Lazy masks: which constrained rows are sampled without their grammar mask.

With Gumbel-max sampling on the same noise, an unmasked argmax that the grammar allows is the
masked argmax, so such a row's token is the masked row's token; the engine checks it against
the grammar and, where it lies outside, runs that position again, masked (a request's step or
two). That pays where the grammar allows most of the vocabulary, inside a JSON string, where
the rows also cost the most to fill. A request goes lazy once a filled row of it allowed at
least `min_allowed` of the vocabulary, and stays so until a sample falls outside or, for JSON,
until its text crosses a string's edge (an unescaped quote): the next row is filled, and
measured, again. The step's rows are decided when they are filled, after the tokens before
them were read, so a string that just closed is never sampled past unmasked. Under overlapped
scheduling all this runs only while the host bounds the step (LazyGate)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from guided.masks.bitmask_fill import allowed_counts
from guided.masks.string_ban import utf8_pending
from guided.scheduler import policy
from guided.scheduler.request import Request
from guided.scheduler.scheduler import ScheduledRequest
from guided.engine.step_times import StepTimes

OUTSIDE, INSIDE, ESCAPED = 0, 1, 2  # a JSON text's position: outside a string, in one, after \


@dataclass
class LazyGate:
    """Overlapped scheduling: lazy masks on while the host, not the device, bounds a step
    (policy.lazy_masks_pay), judged from running means (weight 1/16) of a step's wait for the
    device's tokens and of its mask fill, read off the step loop's phase times."""
    wait_ms: float = 0.0
    fill_ms: float = 0.0
    last_wait: float = 0.0  # the phase totals at the last look (seconds)
    last_fill: float = 0.0

    def observe(self, times: StepTimes) -> bool:
        """After a step: whether the next ones sample wide rows unmasked."""
        wait = times.seconds.get("sample_wait", 0.0)
        # the wait for heavy rows is left out: it ends before the device would wait on it
        # (late rows, step_masks.MaskFill.wait)
        fill = (times.seconds.get("mask_fill", 0.0) + times.seconds.get("mask_wait", 0.0)
                - times.seconds.get("mask_wait: side rows (part)", 0.0))
        d_wait, d_fill = wait - self.last_wait, fill - self.last_fill
        self.last_wait, self.last_fill = wait, fill
        if d_wait >= 0 and d_fill >= 0:  # else the totals were reset: skip this step
            self.wait_ms += (d_wait * 1e3 - self.wait_ms) / 16
            self.fill_ms += (d_fill * 1e3 - self.fill_ms) / 16
        return policy.lazy_masks_pay(device_wait_ms=self.wait_ms, fill_ms=self.fill_ms)


def samples_unmasked(item: ScheduledRequest) -> bool:
    """Decided as the step's rows are filled (item.lazy_mask is what the update reads)."""
    return _unmasked(item.request, item.num_forced_drafts)


def may_sample_unmasked(request: Request) -> bool:
    """Before its drafts are known (the synchronous path's prefetch skips such requests)."""
    return _unmasked(request, 0)


def _unmasked(request: Request, num_forced_drafts: int) -> bool:
    p = request.params
    return policy.samples_unmasked(wide=request.mask_wide, num_forced_drafts=num_forced_drafts,
                                   greedy=p.greedy, filtered=p.filters_tokens)


def mark_wide(bitmask: torch.Tensor, last_rows: list[tuple[Request, int]],
              min_allowed: float, counted: dict[int, int] | None = None) -> None:
    """A request whose last filled row allows at least min_allowed of the vocabulary samples
    its next rows unmasked. counted: rows whose allowed tokens were counted already (by the
    mask shards that filled them); the rest are counted here, in one vectorized count. Bans
    clear a handful of bits: counted before they are applied."""
    threshold = min_allowed * bitmask.shape[1] * 32
    counted = counted or {}
    uncounted = [(request, row) for request, row in last_rows if row not in counted]
    if uncounted:
        allowed = allowed_counts(bitmask, [row for _, row in uncounted])
        counted = {**counted, **{row: n for (_, row), n in zip(uncounted, allowed.tolist())}}
    for request, row in last_rows:
        # a row that costs a copy (a DFA's memo) is never worth a sample run again
        request.mask_wide = (counted[row] >= threshold
                             and not getattr(request.matcher, "cheap_rows", False))


def json_string_state(state: int, text: bytes) -> int:
    """The position after `text` in a JSON text (OUTSIDE, INSIDE a string, or ESCAPED: inside,
    after a backslash)."""
    return _scan(state, text)[0]


def _scan(state: int, text: bytes) -> tuple[int, bool]:
    """(the position after text, whether an unescaped quote in it opened or closed a string)"""
    if b'"' not in text and b"\\" not in text:
        return (INSIDE if state == ESCAPED and text else state), False
    crossed = False
    for byte in text:
        if state == ESCAPED:
            state = INSIDE
        elif byte == 0x22:  # "
            state = INSIDE if state == OUTSIDE else OUTSIDE
            crossed = True
        elif byte == 0x5C and state == INSIDE:  # backslash
            state = ESCAPED
    return state, crossed


def note_json_token(request: Request, token_bytes: bytes) -> None:
    """A JSON request's committed token: one that opens or closes a string (even one that
    closes a string and opens the next, as `", "` does) ends its lazy run."""
    request.json_string, crossed = _scan(request.json_string, token_bytes)
    request.json_utf8 = utf8_pending(request.json_utf8, token_bytes)
    if crossed:
        request.mask_wide = False


def lazy_row_ban(request: Request, num_rows: int):
    """The ban a lazy row of the request carries, or None (it allows everything): inside a
    JSON string, at a character boundary, the string ban (guided/masks/string_ban.py: far fewer
    samples outside the grammar). Rows after drafts are not scanned."""
    if num_rows == 1 and request.json_string == INSIDE and not request.json_utf8:
        return request.matcher.string_ban
    return None


@dataclass(slots=True)
class CheckedRow:
    """A row sampled unmasked, checked against the grammar (accept_unmasked_row)."""
    tokens: list[int]  # the sampled tokens, the one outside replaced by its candidate
    stand: int  # how many of them stand (were accepted)
    missed: bool = False  # a token lay outside and none of its candidates was allowed
    replaced: bool = False  # a token lay outside and a candidate took its place


def accept_unmasked_row(request: Request, tokens: list[int], stand: int,
                        candidates: dict[int, list[int]] | None) -> CheckedRow:
    """Feeds the matchers a lazy row's tokens, up to `stand` (those after matched drafts) and
    no further than one that ends the grammar. A token outside the grammar is replaced by the
    first of its candidates the grammar takes, the masked sample (kernels/candidates.py); the
    tokens after it were conditioned on the one replaced and do not stand."""
    for j in range(stand):
        token = tokens[j]
        if not request.accept_committed(token):
            token = next((t for t in (candidates or {}).get(j, ())
                          if t != tokens[j] and request.accept_committed(t)), None)
            if token is None:
                return CheckedRow(tokens, j, missed=True)
            return CheckedRow([*tokens[:j], token], j + 1, replaced=True)
        if request.matcher.ended_with(token):  # nothing after it is fed
            return CheckedRow(tokens, j + 1)
    return CheckedRow(tokens, stand)
