"""A step's grammar mask rows: one row per sampled position of each constrained request (its
row before every draft, then the bonus row), in the order the runner lays out sampled rows."""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from guided.fsm.bitmask_fill import Bans, fill_draft_rows, merge_bans
from guided.fsm.lazy_masks import mark_wide, samples_unmasked
from guided.fsm.mask_prefetch import MaskPrefetch
from guided.fsm.mask_shards import MaskShards, PendingFill
from guided.fsm.side_fill import finish_side_fills, start_side_fills
from guided.scheduler.request import Request
from guided.scheduler.scheduler import SchedulerOutput
from guided.step_times import StepTimes


@dataclass(eq=False)
class MaskFill:
    """A step's rows: filled, or partly still being filled by mask shards."""
    bitmask: torch.Tensor
    bans: Bans  # token bans still to apply to the rows (on the device, after the copy)
    pending: PendingFill | None  # shards' rows to wait for
    num_threads: int
    side: list[Future] | None = None  # heavy rows on side threads
    # lazy masks: (request, its last row) to measure once filled, and the share of the
    # vocabulary such a row must allow for the request's next rows to go unmasked
    last_rows: list[tuple[Request, int]] | None = None
    min_allowed: float = 0.5

    @property
    def in_progress(self) -> bool:
        return self.pending is not None or self.side is not None

    def wait(self) -> Bans:
        """Every row filled; raises RuntimeError where a draft is rejected by its grammar."""
        pending, self.pending = self.pending, None
        side, self.side = self.side, None
        error = None
        counted: dict[int, int] = {}
        try:
            if pending is not None:
                failed, error, counted = pending.wait()
                if failed:  # a shard failed: the engine's own matchers fill its rows
                    fill_draft_rows(failed, self.bitmask, num_threads=self.num_threads,
                                    bans=self.bans)
        finally:
            if side is not None:  # the side threads walk matchers: they end first
                merge_bans(self.bans, finish_side_fills(side))
        if error is not None:
            raise RuntimeError(error)
        self.measure_widths(counted)
        return self.bans

    def measure_widths(self, counted: dict[int, int] | None = None) -> None:
        """Once every row is filled (lazy masks); counted: rows the shards counted."""
        last_rows, self.last_rows = self.last_rows, None
        if last_rows:
            mark_wide(self.bitmask, last_rows, self.min_allowed, counted)


def start_step_masks(sched: SchedulerOutput, bitmask: torch.Tensor, *, num_threads: int,
                     times: StepTimes, prefetch: MaskPrefetch | None = None,
                     shards: MaskShards | None = None,
                     segment: tuple[str, int] | None = None,
                     lazy_min_allowed: float | None = None) -> MaskFill:
    """Rows filled ahead (prefetch) are copied, rows of requests mirrored in a mask shard sent
    to it (segment: the shared file bitmask lies in), the rest filled here from the matchers
    (which hold the committed tokens only). Rows whose tokens will be dropped allow everything
    (overlapped scheduling): those of requests that finished since the step was scheduled, of
    voided entries, and of drafts anchored on a token the previous step did not sample.
    lazy_min_allowed: with lazy masks (guided/fsm/lazy_masks.py), where each filled request's
    last row is measured; the rows of a request sampled unmasked allow everything."""
    started = time.perf_counter()
    entries: list = []  # (request, drafts, first row) still to fill
    last_rows: list[tuple[Request, int]] = []
    src: list[int] = []
    dst: list[int] = []
    row = 0
    # rows that allow everything are set by one fill of the whole buffer before any row is
    # filled: a slice assignment a row costs ~4 us (120 rows 0.45 ms on a CPU, 300 rows at
    # once 35 us; RESULTS, session 16)
    open_all = False
    for item in sched.scheduled:
        request = item.request
        if not item.masked:
            continue
        drafts = item.draft_token_ids
        num_rows = len(drafts) + 1
        if lazy_min_allowed is not None and samples_unmasked(item):
            item.lazy_mask = True  # sampled unmasked, checked by the update
            open_all = True
            times.count("mask_rows_lazy", num_rows)
            row += num_rows
            continue
        ahead = None if prefetch is None else prefetch.take(request.request_id,
                                                             request.matcher, drafts)
        if request.is_finished or item.voided or request.matcher.is_terminated():
            open_all = True
        elif item.drafts_void:
            open_all = open_all or num_rows > 1
            entries.append((request, [], row))
            last_rows.append((request, row))
        else:
            if ahead is not None:
                src.extend(range(ahead, ahead + num_rows))
                dst.extend(range(row, row + num_rows))
            else:
                entries.append((request, drafts, row))
            last_rows.append((request, row + num_rows - 1))
        row += num_rows
    if open_all:
        bitmask.fill_(-1)
    if src:
        bitmask[torch.tensor(dst)] = prefetch.buffer[torch.tensor(src)]
        times.count("mask_rows_ahead", len(src))
    # the walk over the rows (lazy and voided rows set, prefetched rows taken and copied),
    # timed by hand: a phase would indent the loop for a benchmark's sake
    times.seconds["mask_fill: row setup (part)"] += time.perf_counter() - started
    bans: Bans = {}
    heavy = []
    if any(request.matcher.heavy for request, _, _ in entries):
        heavy = [entry for entry in entries if entry[0].matcher.heavy]
        entries = [entry for entry in entries if not entry[0].matcher.heavy]
    side = None
    if heavy:
        side = start_side_fills([(r.matcher, drafts, first) for r, drafts, first in heavy],
                                bitmask, num_threads=num_threads)
        times.count("mask_rows_side", sum(len(d) + 1 for _, d, _ in heavy))
    pending = None
    if shards is not None and entries:  # a shard ANDs its rows' bans itself
        local, remote, pending = shards.dispatch(entries, segment)
        if remote:
            times.count("mask_rows_shards", sum(len(d) + 1 for _, d, _ in remote))
    else:
        local = [(request.matcher, drafts, first) for request, drafts, first in entries]
    fill = MaskFill(bitmask, bans, pending, num_threads, side,
                    last_rows if lazy_min_allowed is not None else None,
                    lazy_min_allowed or 0.0)
    if local:
        if shards is not None:
            times.count("mask_rows_local", sum(len(d) + 1 for _, d, _ in local))
        try:
            fill_draft_rows(local, bitmask, num_threads=num_threads, bans=bans, times=times)
        except BaseException:
            # the shards' replies taken, the side threads done, before it fails (first fault)
            with contextlib.suppress(Exception):
                fill.wait()
            raise
    if not fill.in_progress:  # nobody waits for it
        with times.phase("mask_fill: widths (part)"):
            fill.measure_widths()
    return fill


def fill_step_masks(sched: SchedulerOutput, bitmask: torch.Tensor, **kwargs) -> Bans:
    """start_step_masks, waited for: every row filled. Returns the bans left to apply."""
    return start_step_masks(sched, bitmask, **kwargs).wait()
