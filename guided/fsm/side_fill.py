"""Heavy mask rows, filled on side threads beside the step loop.

A row inside a long counted repetition (a string's maxLength of 1024 or 8192, which xgrammar
counts state by state) costs 0.2-8 ms, against ~0.1 ms for most JSON rows
(benchmarks/row_costs.py): one such request in a batch of 256 held a whole step's fill, in the
loop or in one mask shard. xgrammar fills without the GIL, so these rows go to threads of their
own as soon as a step's masks start, one task per request, and are filled during the rest of
the host's work on the step (drafts, scheduling and preparing the next one); the step samples
once they are in. Only heavy rows go here: for the ~0.1 ms rows the GIL round trips of a thread cost
more than they save (concurrent_masks, benchmarks/RESULTS.md session 5).

A heavy request's drafts are proposed on a second matcher (Request.draft_matcher), since the
side thread walks its mask matcher meanwhile.
"""
from __future__ import annotations

import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from guided.fsm.bitmask_fill import Bans, fill_draft_rows

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _executor(num_threads: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="heavy-rows")
            # a side thread back from its GIL-free fill waits for the GIL while the loop runs
            # Python: at the default 5 ms switch interval that wait is most of a step
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        return _pool


def start_side_fills(entries: list[tuple], bitmask: torch.Tensor, *,
                     num_threads: int) -> list[Future]:
    """entries: (matcher, drafts, first row). One task per entry; each task's result is the
    token bans its rows still need (raises RuntimeError for a draft its grammar rejects)."""
    pool = _executor(num_threads)

    def fill(entry: tuple) -> Bans:
        bans: Bans = {}
        fill_draft_rows([entry], bitmask, num_threads=1, bans=bans)
        return bans

    return [pool.submit(fill, entry) for entry in entries]
