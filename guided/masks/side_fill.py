"""Heavy mask rows, filled on side threads beside the step loop, into rows of their own.

A row inside a long counted repetition (a string's maxLength of 1024 or 8192, which xgrammar
counts state by state) costs 0.2-8 ms, against ~0.1 ms for most JSON rows, and the last
tokens of a character budget (char_budgets.py) 5-30 ms (benchmarks/row_costs.py): one such
request in a batch of 256 held a whole step's fill, in the loop or in one mask shard. xgrammar
fills without the GIL, so these rows go to threads of their own as soon as a step's masks
start, one task per request, and are filled during the rest of the host's work on the step
(drafts, scheduling and preparing the next one). Only heavy rows go here: for the ~0.1 ms
rows the GIL round trips of a thread cost more than they save (concurrent_masks,
benchmarks/RESULTS.md session 5).

Each task fills rows of its own (its bans applied there), copied into the step's bitmask once
it is in. A task still running when the device would wait for it is late (step_masks.MaskFill):
the step samples without it, and the task's rows are kept on the request for the step that
runs the same position again (its matcher has not moved: same state, same rows).

A heavy request's drafts are proposed on a second matcher (Request.draft_matcher), since the
side thread walks its mask matcher meanwhile.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from guided.masks.bitmask_fill import fill_draft_rows

SIDE_SWITCH_INTERVAL = 0.0005
GIVE_UP_POLL = 2e-4  # seconds between looks at the device while side fills run

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()
_in_flight = 0  # side fills started and not yet ended
_loop_interval: float | None = None  # the switch interval to restore when none is


def _executor(num_threads: int) -> ThreadPoolExecutor:
    """Its own pool, not bitmask_fill's: a loop's parallel fill must not queue behind a heavy
    row that runs through the whole step."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="heavy-rows")
        return _pool


@dataclass(eq=False)
class SideFill:
    """One request's rows (the mask before each draft, then the bonus row) being filled on a
    side thread from its matcher, which nobody else may touch until `done`."""
    future: Future  # -> int32 rows (1 + len(drafts), words), bans applied
    num_tokens: int  # the committed tokens its matcher held: the rows hold for that state only
    drafts: tuple[int, ...]

    @property
    def done(self) -> bool:
        return self.future.done()

    def rows(self) -> torch.Tensor:
        """Waits; raises RuntimeError for a draft its grammar rejects."""
        return self.future.result()

    def serves(self, num_tokens: int, drafts: list[int]) -> bool:
        return self.num_tokens == num_tokens and self.drafts == tuple(drafts)


def start_side_fill(matcher, drafts: list[int], num_tokens: int, words: int, *,
                    num_threads: int) -> SideFill:
    """A task filling matcher's rows for `drafts` (its state: num_tokens committed tokens)."""
    pool = _executor(num_threads)

    def fill() -> torch.Tensor:
        try:  # left before the result is set: whoever waits finds the interval restored
            rows = torch.empty((len(drafts) + 1, words), dtype=torch.int32)
            fill_draft_rows([(matcher, list(drafts), 0)], rows, num_threads=1)
            return rows
        finally:
            _leave()

    _enter()
    return SideFill(pool.submit(fill), num_tokens, tuple(drafts))


def side_fill_for(request, drafts: list[int], num_tokens: int, words: int, *,
                  num_threads: int) -> SideFill:
    """The request's side fill for this state (its matcher holding num_tokens committed
    tokens, these drafts): the one kept from a step or call that gave up on it, where it
    serves that state, else a new one (a stale one walks the matcher: it ends first)."""
    fill = request.side_fill
    if fill is not None and not fill.serves(num_tokens, drafts):
        fill.future.exception()
        fill = None
    if fill is None:
        fill = request.side_fill = start_side_fill(request.matcher, drafts, num_tokens, words,
                                                   num_threads=num_threads)
    return fill


def wait_fills(fills: list[SideFill], give_up: Callable[[], bool] | None) -> None:
    """Until every fill is done or give_up (polled; None: never) says to stop waiting."""
    running = [fill.future for fill in fills if not fill.done]
    while running and not (give_up is not None and give_up()):
        wait(running, timeout=None if give_up is None else GIVE_UP_POLL,
             return_when=FIRST_COMPLETED)
        running = [future for future in running if not future.done()]


def _enter() -> None:
    global _in_flight, _loop_interval
    with _lock:
        if _in_flight == 0:
            # a side thread waits for the GIL to start its fill, and again after it, while
            # the loop runs Python: up to the 5 ms default switch interval each time, most of
            # a step; shorter while side fills are in flight, restored once none is
            _loop_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(_loop_interval, SIDE_SWITCH_INTERVAL))
        _in_flight += 1


def _leave() -> None:
    global _in_flight
    with _lock:
        _in_flight -= 1
        if _in_flight == 0 and _loop_interval is not None:
            sys.setswitchinterval(_loop_interval)
