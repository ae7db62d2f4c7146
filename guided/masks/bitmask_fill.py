"""Fill a step's bitmask rows from many matchers at once.

An entry is (matcher, drafts, first row): its rows are the mask before each draft token, then
the one after the last. xgrammar matchers go depth by depth: one batched C++ fill of every row
at that depth (BatchGrammarMatcher, on several threads for a large batch), one batched accept of
the drafts there, and at the end one batched rollback. Other matchers (llguidance) walk their
drafts and back, on threads (they fill without the GIL) only when their measured cost says a
batch takes longer than the hand-offs. Matchers end where they began.

A draft its row does not allow (a proposal the grammar's mask disagrees with) is cut, as vLLM
truncates speculative tokens to the grammar's prefix: its own row forbids it, so verification
stops there, and the rows after it allow everything (their tokens are never kept).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from guided.fsm.matcher import Matcher
from guided.fsm.settings import NUM_CPUS

Entry = tuple[Matcher, list[int], int]  # (matcher, drafts, first row)

# an llguidance row costs ~30 us deep in a length-bounded string: threads only where a batch's
# estimate passes this (a random 8B's long strings went from 6.9 to 1.4 ms of fill a step at
# 64, results/paired_8b_s6.md)
PARALLEL_FILL_SECONDS = 2e-3
BATCH_THREADS_MIN_ROWS = 64  # xgrammar's batched fill uses several threads from this many rows

_pool: ThreadPoolExecutor | None = None
_batch_matchers: dict[int, object] = {}  # threads -> xgrammar.BatchGrammarMatcher
_row_seconds = 0.0  # running estimate of one llguidance row's fill


def fill_draft_rows(entries: list[Entry], bitmask: torch.Tensor, *, num_threads: int,
                    min_parallel_seconds: float = PARALLEL_FILL_SECONDS) -> list[int]:
    """bitmask: int32 (rows, ceil(vocab / 32)) on the CPU. Returns the indices of the entries
    whose drafts were cut."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
        raise ValueError("bitmask must be a 2-D int32 CPU tensor")
    from guided.fsm.backends.xgrammar_backend import XGrammarMatcher

    xgrammar, others = [], []
    for entry in entries:
        matcher, drafts, first = entry
        if matcher.is_terminated():  # nothing allowed: a draft after it is cut below
            bitmask[first:first + len(drafts) + 1] = 0
        else:
            (xgrammar if isinstance(matcher, XGrammarMatcher) else others).append(entry)
    _fill_by_depth(xgrammar, bitmask, num_threads)
    _fill_each(others, bitmask, num_threads, min_parallel_seconds)
    _apply_bans(xgrammar, bitmask)
    return cut_rejected_drafts(entries, bitmask)


def _fill_by_depth(entries: list[Entry], bitmask: torch.Tensor, num_threads: int) -> None:
    """xgrammar entries: the rows at depth d of every entry still going in one batched fill,
    then their drafts at d in one batched accept; a draft accept refuses is forbidden in its
    row (cut below), one that ends the grammar leaves nothing allowed after it."""
    import xgrammar as xgr

    matchers = [m.xgrammar_matcher for m, _, _ in entries]
    accepted = [0] * len(entries)
    try:
        going, depth = list(range(len(entries))), 0
        while going:
            _batch_matcher(len(going), num_threads).batch_fill_next_token_bitmask(
                [matchers[i] for i in going], bitmask,
                indices=[entries[i][2] + depth for i in going])
            going = [i for i in going if len(entries[i][1]) > depth]
            if not going:
                break
            tokens = [entries[i][1][depth] for i in going]
            verdicts = xgr.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in going],
                                                                  tokens)
            still = []
            for i, token, ok in zip(going, tokens, verdicts):
                matcher, drafts, first = entries[i]
                if not ok:
                    _forbid(bitmask, first + depth, token)
                    continue
                accepted[i] += 1
                if matcher.ended_with(token):
                    bitmask[first + depth + 1:first + len(drafts) + 1] = 0
                else:
                    still.append(i)
            going, depth = still, depth + 1
    finally:
        undo = [i for i, n in enumerate(accepted) if n]
        if undo:
            xgr.BatchGrammarMatcher.batch_rollback([matchers[i] for i in undo],
                                                   [accepted[i] for i in undo])


def _batch_matcher(num_rows: int, num_threads: int):
    import xgrammar as xgr

    threads = max(1, min(num_threads, NUM_CPUS)) if num_rows >= BATCH_THREADS_MIN_ROWS else 1
    matcher = _batch_matchers.get(threads)
    if matcher is None:
        matcher = _batch_matchers[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
    return matcher


def _forbid(bitmask: torch.Tensor, row: int, token: int) -> None:
    bitmask[row].numpy().view(np.uint32)[token >> 5] &= ~np.uint32(1 << (token & 31))


def _fill_each(entries: list[Entry], bitmask: torch.Tensor, num_threads: int,
               min_parallel_seconds: float) -> None:
    global _pool, _row_seconds
    if not entries:
        return
    num_rows = sum(len(drafts) + 1 for _, drafts, _ in entries)
    threads = min(num_threads, NUM_CPUS, len(entries))
    parallel = threads > 1 and num_rows * _row_seconds >= min_parallel_seconds
    start = time.perf_counter()
    if not parallel:
        _fill_rows(entries, bitmask)
    else:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=NUM_CPUS, thread_name_prefix="bitmask")
        for future in [_pool.submit(_fill_rows, entries[i::threads], bitmask)
                       for i in range(threads)]:
            future.result()
    seconds = (time.perf_counter() - start) * (threads if parallel else 1) / num_rows
    _row_seconds = 0.8 * _row_seconds + 0.2 * seconds


def _fill_rows(entries: list[Entry], bitmask: torch.Tensor) -> None:
    for matcher, drafts, first in entries:
        _walk(matcher, drafts, bitmask, first)


def _walk(matcher: Matcher, drafts: list[int], bitmask: torch.Tensor, first: int) -> None:
    accepted = 0
    try:
        for depth, token in enumerate(drafts):
            matcher.fill_bitmask(bitmask, first + depth)
            if not matcher.accept_token(token):  # forbidden in its row: cut below
                _forbid(bitmask, first + depth, token)
                return
            accepted += 1
        matcher.fill_bitmask(bitmask, first + len(drafts))
    finally:
        matcher.rollback(accepted)


def _apply_bans(entries: list[Entry], bitmask: torch.Tensor) -> None:
    """xgrammar's own fills know no bans: one AND per ban (every JSON row shares one), on the
    words it clears bits of only."""
    rows_of: dict[int, tuple[object, list[int]]] = {}
    for matcher, drafts, first in entries:
        if matcher.ban is not None:
            rows_of.setdefault(id(matcher.ban), (matcher.ban, []))[1].extend(
                range(first, first + len(drafts) + 1))
    words = bitmask.numpy()
    for ban, rows in rows_of.values():
        if len(rows) == bitmask.shape[0]:
            words[:, ban.columns] &= ban.column_words
        else:
            words[np.ix_(rows, ban.columns)] &= ban.column_words


def cut_rejected_drafts(entries: list[Entry], bitmask: torch.Tensor) -> list[int]:
    """One vectorized look at every draft's bit in the row before it; where a draft is not
    allowed, the rows after it allow everything. The indices of the entries cut."""
    rows: list[int] = []
    tokens: list[int] = []
    for _, drafts, first in entries:
        rows.extend(range(first, first + len(drafts)))
        tokens.extend(drafts)
    if not tokens:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    allowed = (bitmask.numpy()[rows, ids >> 5] >> (ids & 31)) & 1
    if allowed.all():
        return []
    cut, start = [], 0
    for i, (_, drafts, first) in enumerate(entries):
        ok = allowed[start:start + len(drafts)]
        start += len(drafts)
        if len(ok) and not ok.all():
            bitmask[first + int(np.argmin(ok)) + 1:first + len(drafts) + 1] = -1
            cut.append(i)
    return cut
