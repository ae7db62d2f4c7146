"""Fill many requests' bitmask rows at once.

xgrammar matchers go to xgrammar's BatchGrammarMatcher, which fills all rows in one C++ call
(no Python per row): on one thread below PARALLEL_THRESHOLD rows, where a thread hand-off
costs more than it saves, on several above it (measured: 4 rows 0.03 ms batched vs 0.04 ms in
a Python loop, 56 rows 0.28 vs 0.37 ms). Other matchers (llguidance) fill in a
Python loop, or in Python threads for large batches (see benchmarks/bench_grammar.py).
"""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from guided.fsm.matcher import Matcher
from guided.fsm.settings import NUM_CPUS
from guided.worker.step_times import StepTimes

PARALLEL_THRESHOLD = 64

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _get_pool(num_threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size != num_threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="bitmask")
            _pool_size = num_threads
        return _pool


Bans = dict[int, tuple[object, list[int]]]  # id(TokenBan) -> (ban, rows it applies to)


def fill_bitmasks(items: list[tuple[Matcher, int]], bitmask: torch.Tensor, *,
                  num_threads: int, min_parallel_rows: int = PARALLEL_THRESHOLD,
                  bans: Bans | None = None) -> None:
    """bitmask: int32 (N, ceil(vocab_size / 32)) on the CPU; items: (matcher, row) pairs.
    bans: where to collect the rows of batched matchers' token bans, for the caller to apply
    once (apply_bans); None: applied here."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
        raise ValueError("bitmask must be a 2-D int32 CPU tensor")
    # xgrammar rows: one batched C++ call (one thread for a few rows: a hand-off costs more)
    pending: Bans = {} if bans is None else bans
    items = _fill_xgrammar_batch(items, bitmask,
                                 num_threads if len(items) >= min_parallel_rows else 1, pending)
    if bans is None:
        apply_bans(bitmask, pending)
    if num_threads <= 1 or len(items) < max(2, min_parallel_rows):
        for matcher, row in items:
            matcher.fill_bitmask(bitmask, row)
        return
    # one contiguous chunk of rows per thread: fewer hand-offs than one task per row
    num_chunks = min(num_threads, len(items))
    chunks = [items[i::num_chunks] for i in range(num_chunks)]

    def fill(chunk: list[tuple[Matcher, int]]) -> None:
        for matcher, row in chunk:
            matcher.fill_bitmask(bitmask, row)

    for future in [_get_pool(num_threads).submit(fill, c) for c in chunks]:
        future.result()


_batch_matchers: dict[int, object] = {}  # threads -> xgrammar.BatchGrammarMatcher


def apply_bans(bitmask: torch.Tensor, bans: Bans) -> None:
    """One AND per ban (every JSON row shares one). On the host, on the words the ban clears
    bits of only; on the device (where the runner applies a step's bans: 0.6 ms of host time
    a step at concurrency 64 otherwise), a kernel or three."""
    if bitmask.device.type == "cpu":
        words = bitmask.numpy()
        for ban, rows in bans.values():
            if len(rows) == bitmask.shape[0]:
                words[:, ban.columns] &= ban.column_words
            else:
                words[np.ix_(rows, ban.columns)] &= ban.column_words
        return
    for ban, rows in bans.values():
        keep = _on_device(ban, bitmask.device)
        width = keep.shape[0]
        if len(rows) == bitmask.shape[0]:
            bitmask[:, :width] &= keep
        else:
            index = torch.tensor(rows, dtype=torch.int64).to(bitmask.device, non_blocking=True)
            bitmask[index, :width] &= keep


def note_ban(bans: Bans, matcher, rows) -> None:
    """Rows (an iterable) the matcher's token ban, if it has one, is still to be ANDed into."""
    if matcher.ban is not None:
        bans.setdefault(id(matcher.ban), (matcher.ban, []))[1].extend(rows)


def merge_bans(into: Bans, bans: Bans) -> None:
    for key, (ban, rows) in bans.items():
        into.setdefault(key, (ban, []))[1].extend(rows)


_device_bans: dict[tuple[int, torch.device], tuple[object, torch.Tensor]] = {}


def _on_device(ban, device: torch.device) -> torch.Tensor:
    cached = _device_bans.get((id(ban), device))
    if cached is None or cached[0] is not ban:  # the ban is kept: ids are not reused
        cached = _device_bans[(id(ban), device)] = (ban, ban.keep_words.to(device))
    return cached[1]


def _fill_xgrammar_batch(items: list[tuple[Matcher, int]], bitmask: torch.Tensor,
                         num_threads: int, bans: Bans) -> list[tuple[Matcher, int]]:
    """Fill the rows of live xgrammar matchers in one batched call (their bans' rows go to
    bans); returns the other items."""
    from guided.fsm.backends.xgrammar_backend import XGrammarMatcher

    batch = [(m, row) for m, row in items
             if isinstance(m, XGrammarMatcher) and not m.is_terminated()]
    if len(batch) < 2:
        return items
    import xgrammar as xgr

    threads = max(1, min(num_threads, NUM_CPUS))
    batch_matcher = _batch_matchers.get(threads)
    if batch_matcher is None:
        batch_matcher = _batch_matchers[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
    batch_matcher.batch_fill_next_token_bitmask(
        [m.xgrammar_matcher for m, _ in batch], bitmask, indices=[row for _, row in batch])
    for m, row in batch:
        note_ban(bans, m, (row,))
    if len(batch) == len(items):
        return []
    done = {id(m) for m, _ in batch}
    return [(m, row) for m, row in items if id(m) not in done]


def fill_draft_rows(entries: list[tuple[Matcher, list[int], int]], bitmask: torch.Tensor, *,
                    num_threads: int, bans: Bans | None = None,
                    times: StepTimes | None = None) -> None:
    """entries: (matcher, drafts, first row). A request with drafts gets a row per verified
    position: the mask before each draft token. Requests without drafts are one batched fill;
    an xgrammar matcher walks its drafts in one C++ call (traverse_draft_tree: 0.6 ms against
    2.2 ms for 64 requests of 8 drafts, walked depth by depth from Python, on the CPU); other
    matchers are walked depth by depth. The matchers end where they began, holding only
    committed tokens. A draft the grammar rejects raises RuntimeError. bans: where to leave
    the token bans for the caller (the runner ANDs them on the device); None: applied here.
    times: a StepTimes, to time the plain rows' and the drafts' rows' parts of a step's fill."""
    from guided.fsm.backends.xgrammar_backend import XGrammarMatcher

    part = times.phase if times is not None else _untimed
    pending: Bans = {} if bans is None else bans
    with part("mask_fill: plain rows (part)"):
        fill_bitmasks([(m, first) for m, drafts, first in entries if not drafts], bitmask,
                      num_threads=num_threads, bans=pending)
    with part("mask_fill: draft rows (part)"):
        chains = [entry for entry in entries if entry[1]]
        walked = [entry for entry in chains if not isinstance(entry[0], XGrammarMatcher)]
        _traverse_all([entry for entry in chains if isinstance(entry[0], XGrammarMatcher)],
                      bitmask, num_threads, pending)
        if walked:
            _walk_draft_rows(walked, bitmask, num_threads, pending)
        if bans is None:
            apply_bans(bitmask, pending)
        _check_drafts_allowed(chains, bitmask)


def _untimed(name: str) -> contextlib.nullcontext:
    return contextlib.nullcontext()


_chains: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # drafts -> (next, sibling) links

# traverse_draft_tree runs without the GIL, so a costly batch is split over threads. What a row
# costs depends on the grammar state (~3 us in JSON structure, ~30 us deep in a length-bounded
# string on the CPU; a random model's long strings cost 6-16 ms of fills a step): threads only
# where the rows' measured cost says a batch takes longer than hand-offs and GIL round trips
# (the default model's batches, ~1-1.5 ms at 64, stay on one thread; the random 8B's go out:
# its fills fell from 6.9 to 1.4 ms a step at 64, results/paired_8b_s6.md)
PARALLEL_FILL_SECONDS = 2e-3
_row_seconds = 0.0  # running estimate of one row's fill


def _traverse_all(chains: list, bitmask: torch.Tensor, num_threads: int, bans: Bans) -> None:
    global _row_seconds
    if not chains:
        return
    num_rows = sum(len(drafts) + 1 for _, drafts, _ in chains)
    threads = min(num_threads, NUM_CPUS, len(chains))
    parallel = threads > 1 and num_rows * _row_seconds > PARALLEL_FILL_SECONDS
    start = time.perf_counter()
    if not parallel:
        for matcher, drafts, first in chains:
            _traverse(matcher, drafts, bitmask, first, bans)
    else:
        def run(part: list) -> Bans:
            own: Bans = {}
            for matcher, drafts, first in part:
                _traverse(matcher, drafts, bitmask, first, own)
            return own

        pool = _get_pool(threads)
        for future in [pool.submit(run, chains[i::threads]) for i in range(threads)]:
            merge_bans(bans, future.result())
    seconds = (time.perf_counter() - start) * (threads if parallel else 1) / num_rows
    _row_seconds = 0.8 * _row_seconds + 0.2 * seconds


def _traverse(matcher, drafts: list[int], bitmask: torch.Tensor, first: int,
              bans: Bans) -> None:
    rows = bitmask[first:first + len(drafts) + 1]
    if matcher.is_terminated():
        rows.zero_()  # nothing allowed: the check below rejects the drafts
        return
    traverse_chain(matcher.xgrammar_matcher, drafts, rows)
    note_ban(bans, matcher, range(first, first + len(drafts) + 1))


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


def _check_drafts_allowed(chains: list[tuple[Matcher, list[int], int]],
                          bitmask: torch.Tensor) -> None:
    error = rejected_draft([(drafts, first) for _, drafts, first in chains], bitmask)
    if error is not None:
        raise RuntimeError(error)


def rejected_draft(chains: list[tuple[list[int], int]], bitmask: torch.Tensor) -> str | None:
    """Every draft allowed by the row before it (one vectorized look at the filled rows);
    chains: (drafts, first row). The error naming a rejected draft, else None."""
    if not chains:
        return None
    rows: list[int] = []
    tokens: list[int] = []
    for drafts, first in chains:
        rows.extend(range(first, first + len(drafts)))
        tokens.extend(drafts)
    ids = np.asarray(tokens, dtype=np.int64)
    allowed = (bitmask.numpy()[rows, ids >> 5] >> (ids & 31)) & 1
    if allowed.all():
        return None
    return f"jump-forward draft token {tokens[int(np.argmin(allowed))]} rejected by the grammar"


def _walk_draft_rows(entries: list[tuple[Matcher, list[int], int]], bitmask: torch.Tensor,
                     num_threads: int, bans: Bans) -> None:
    """Rows filled depth by depth (the row before every request's next draft, then all
    matchers advanced one draft, ...), each depth one batched fill; walked back at the end."""
    level = entries
    accepted: dict = {}  # matcher -> drafts it accepted here
    try:
        depth = 0
        while level:
            fill_bitmasks([(m, first + depth) for m, _, first in level], bitmask,
                          num_threads=num_threads, bans=bans)
            level = [entry for entry in level if depth < len(entry[1])]
            oks = accept_tokens([(m, drafts[depth]) for m, drafts, _ in level])
            # every acceptance counted before raising: the walk back covers all of them
            accepted.update((m, depth + 1) for (m, _, _), ok in zip(level, oks) if ok)
            rejected = [drafts[depth] for (_, drafts, _), ok in zip(level, oks) if not ok]
            if rejected:
                raise RuntimeError(f"jump-forward draft token {rejected[0]} rejected by the "
                                   "grammar")
            depth += 1
    finally:
        rollback_all(accepted)


def accept_tokens(pairs: list[tuple[Matcher, int]]) -> list[bool]:
    """Each matcher accepts its token (True where it did); all xgrammar's in one call. Only
    for tokens a matcher's own accept_token took before in this state (drafts): the batched
    call skips the wrapper's checks (token range, bans)."""
    if _all_xgrammar([m for m, _ in pairs]):
        import xgrammar as xgr

        oks = xgr.BatchGrammarMatcher.batch_accept_token(
            [m.xgrammar_matcher for m, _ in pairs], [token for _, token in pairs])
        for matcher, token in pairs:
            matcher.note_accepted(token)
        return [bool(ok) for ok in oks]
    return [matcher.accept_token(token) for matcher, token in pairs]


def rollback_all(counts: dict) -> None:
    """Walk each matcher back its count of tokens (matcher -> count > 0); xgrammar's batched."""
    if _all_xgrammar(list(counts)):
        import xgrammar as xgr

        xgr.BatchGrammarMatcher.batch_rollback([m.xgrammar_matcher for m in counts],
                                               list(counts.values()))
        return
    for matcher, count in counts.items():
        matcher.rollback(count)


def _all_xgrammar(matchers: list[Matcher]) -> bool:
    """Several matchers, all xgrammar's (a batched call pays off; mixed batches loop)."""
    from guided.fsm.backends.xgrammar_backend import XGrammarMatcher

    return len(matchers) > 1 and all(isinstance(m, XGrammarMatcher) for m in matchers)
