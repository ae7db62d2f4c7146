"""Heavy mask rows, filled on side threads beside the step loop.

A row inside a long counted repetition (a string's maxLength of 1024 or 8192, which xgrammar
counts state by state) costs 0.2-8 ms, against ~0.1 ms for most JSON rows
(benchmarks/row_costs.py): one such request in a batch of 256 held a whole step's fill, in the
loop or in one mask shard. xgrammar fills without the GIL, so these rows go to threads of their
own as soon as a step's masks start, one task per request, and are filled during the rest of
the host's work on the step (drafts, scheduling and preparing the next one); the step samples
once they are in. Only heavy rows go here: for the ~0.1 ms rows the GIL round trips of a
thread cost more than they save (concurrent_masks, benchmarks/RESULTS.md session 5).

A heavy request's drafts are proposed on a second matcher (Request.draft_matcher), since the
side thread walks its mask matcher meanwhile.
"""
from __future__ import annotations

import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from guided.fsm.bitmask_fill import Bans, fill_draft_rows, merge_bans

SIDE_SWITCH_INTERVAL = 0.0005

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()
_in_flight = 0  # side fills started and not yet waited for
_loop_interval: float | None = None  # the switch interval to restore when none is


def _executor(num_threads: int) -> ThreadPoolExecutor:
    """Its own pool, not bitmask_fill's: a loop's parallel fill must not queue behind a heavy
    row that runs through the whole step."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="heavy-rows")
        return _pool


def start_side_fills(entries: list[tuple], bitmask: torch.Tensor, *,
                     num_threads: int) -> list[Future]:
    """entries: (matcher, drafts, first row). One task per entry; each task's result is the
    token bans its rows still need (raises RuntimeError for a draft its grammar rejects).
    Call finish_side_fills with the futures before the matchers are touched again."""
    global _in_flight, _loop_interval
    pool = _executor(num_threads)

    def fill(entry: tuple) -> Bans:
        bans: Bans = {}
        fill_draft_rows([entry], bitmask, num_threads=1, bans=bans)
        return bans

    with _lock:
        if _in_flight == 0:
            # a side thread waits for the GIL to start its fill, and again after it, while
            # the loop runs Python: up to the 5 ms default switch interval each time, most of
            # a step; shorter while side fills are in flight, restored once they are in
            _loop_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(_loop_interval, SIDE_SWITCH_INTERVAL))
        _in_flight += 1
    return [pool.submit(fill, entry) for entry in entries]


def finish_side_fills(futures: list[Future]) -> Bans:
    """Waits for every task of one start_side_fills; the merged bans, or the first task's
    error raised (after all of them ended)."""
    global _in_flight
    try:
        wait(futures)
    finally:
        with _lock:
            _in_flight -= 1
            if _in_flight == 0 and _loop_interval is not None:
                sys.setswitchinterval(_loop_interval)
    bans: Bans = {}
    for future in futures:
        problem = future.exception()
        if problem is not None:
            raise problem
        merge_bans(bans, future.result())
    return bans
