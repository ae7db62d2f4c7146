"""Fill a step's bitmask rows from many matchers at once.

An entry is (matcher, drafts, first row): its rows are the mask before each draft token, then
the one after the last. xgrammar matchers without drafts fill in one batched C++ call
(BatchGrammarMatcher); with drafts, in one traverse_draft_tree call each. Other matchers
(llguidance) walk their drafts and back. Matchers end where they began. Entries other than the
batched ones go out to threads (both backends fill without the GIL) only when their measured
cost says a batch takes longer than the hand-offs.

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

# a row costs ~3 us in JSON structure and ~30 us deep in a length-bounded string: threads only
# where a batch's estimate passes this (the default model's batches stay on one thread; a
# random 8B's long strings went from 6.9 to 1.4 ms of fill a step at 64, results/paired_8b_s6.md)
PARALLEL_FILL_SECONDS = 2e-3
BATCH_THREADS_MIN_ROWS = 64  # xgrammar's batched fill uses several threads from this many rows

_pool: ThreadPoolExecutor | None = None
_batch_matchers: dict[int, object] = {}  # threads -> xgrammar.BatchGrammarMatcher
_chains: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # drafts -> (next, sibling) links
_row_seconds = 0.0  # running estimate of one row's fill


def fill_draft_rows(entries: list[Entry], bitmask: torch.Tensor, *, num_threads: int,
                    min_parallel_seconds: float = PARALLEL_FILL_SECONDS) -> list[int]:
    """bitmask: int32 (rows, ceil(vocab / 32)) on the CPU. Returns the indices of the entries
    whose drafts were cut."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
        raise ValueError("bitmask must be a 2-D int32 CPU tensor")
    from guided.fsm.backends.xgrammar_backend import XGrammarMatcher

    live = []
    for entry in entries:
        matcher, drafts, first = entry
        if matcher.is_terminated():  # nothing allowed: a draft after it is cut below
            bitmask[first:first + len(drafts) + 1] = 0
        else:
            live.append(entry)
    xgrammar = [e for e in live if isinstance(e[0], XGrammarMatcher)]
    plain = [e for e in xgrammar if not e[1]]
    if len(plain) > 1:
        _fill_batch(plain, bitmask, num_threads)
        live = [e for e in live if e[1] or not isinstance(e[0], XGrammarMatcher)]
    _fill_each(live, bitmask, num_threads, min_parallel_seconds)
    _apply_bans(xgrammar, bitmask)
    return cut_rejected_drafts(entries, bitmask)


def _fill_batch(batch: list[Entry], bitmask: torch.Tensor, num_threads: int) -> None:
    import xgrammar as xgr

    threads = max(1, min(num_threads, NUM_CPUS)) if len(batch) >= BATCH_THREADS_MIN_ROWS else 1
    matcher = _batch_matchers.get(threads)
    if matcher is None:
        matcher = _batch_matchers[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
    matcher.batch_fill_next_token_bitmask([m.xgrammar_matcher for m, _, _ in batch], bitmask,
                                          indices=[first for _, _, first in batch])


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
    from guided.fsm.backends.xgrammar_backend import XGrammarMatcher

    for matcher, drafts, first in entries:
        if isinstance(matcher, XGrammarMatcher) and not drafts:
            matcher.xgrammar_matcher.fill_next_token_bitmask(bitmask, first)
        elif isinstance(matcher, XGrammarMatcher):
            traverse_chain(matcher.xgrammar_matcher, drafts,
                           bitmask[first:first + len(drafts) + 1])
        else:
            _walk(matcher, drafts, bitmask, first)


def traverse_chain(xgrammar_matcher, drafts: list[int], rows: torch.Tensor) -> None:
    """The rows of one live xgrammar matcher's drafts: a draft tree that is a chain (node 0 is
    the matcher's state, node i the state after drafts[:i]); the matcher is left as it was."""
    links = _chains.get(len(drafts))
    if links is None:
        n = len(drafts)
        links = _chains[n] = (torch.tensor([*range(1, n + 1), -1], dtype=torch.int64),
                              torch.full((n + 1,), -1, dtype=torch.int64))
    xgrammar_matcher.traverse_draft_tree(
        links[0], links[1], torch.tensor([0, *drafts], dtype=torch.int64), rows)


def _walk(matcher: Matcher, drafts: list[int], bitmask: torch.Tensor, first: int) -> None:
    accepted = 0
    try:
        for depth, token in enumerate(drafts):
            matcher.fill_bitmask(bitmask, first + depth)
            if not matcher.accept_token(token):  # forbidden in its row: cut below
                bitmask[first + depth].numpy().view(np.uint32)[token >> 5] &= \
                    ~np.uint32(1 << (token & 31))
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
