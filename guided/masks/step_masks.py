"""A step's grammar mask rows: one row per sampled position of each constrained request (its
row before every draft, then the bonus row), in the order the runner lays out sampled rows."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from guided.masks.bitmask_fill import Bans, fill_draft_rows
from guided.masks.lazy import lazy_row_ban, mark_wide, samples_unmasked
from guided.masks.prefetch import MaskPrefetch
from guided.fsm.mask_shards import MaskShards, PendingFill
from guided.masks.side_fill import SideFill, side_fill_for, wait_fills
from guided.scheduler.request import Request
from guided.scheduler.scheduler import ScheduledRequest, SchedulerOutput
from guided.engine.step_times import StepTimes


@dataclass(slots=True)
class RowLayout:
    """Which bitmask row each of the runner's mask rows was filled in."""
    packed: list[int]  # the runner's mask row -> its filled row; -1: allows everything
    num_rows: int  # rows filled, at the buffer's front

    def mask_rows(self, runner_rows: list[int]) -> list[int]:
        """Per sampled row (the runner's mask row, -1: unconstrained): the row to read."""
        packed = self.packed
        return [packed[r] if r >= 0 else -1 for r in runner_rows]


@dataclass(slots=True)
class SideRows:
    """A heavy request's rows of this step, filled by a side thread (fsm/side_fill.py)."""
    fill: SideFill
    item: ScheduledRequest
    first: int  # its first row in the step's bitmask
    num_rows: int


@dataclass(eq=False)
class MaskFill:
    """A step's rows: filled, or partly still being filled by mask shards."""
    bitmask: torch.Tensor
    bans: Bans  # token bans still to apply to the rows (on the device, after the copy)
    pending: PendingFill | None  # shards' rows to wait for
    num_threads: int
    layout: RowLayout
    side: list[SideRows] | None = None  # heavy rows on side threads
    # lazy masks: (request, its last row) to measure once filled, and the share of the
    # vocabulary such a row must allow for the request's next rows to go unmasked
    last_rows: list[tuple[Request, int]] | None = None
    min_allowed: float = 0.5

    @property
    def in_progress(self) -> bool:
        return self.pending is not None or self.side is not None

    def wait(self, give_up: Callable[[], bool] | None = None,
             times: StepTimes | None = None) -> Bans:
        """Every row filled; raises RuntimeError where a draft is rejected by its grammar.
        give_up: polled while heavy rows are still being filled; once it says so, those rows
        are late: their requests are sampled without them (item.late_mask; the update drops
        the sample and the position runs again, reading the rows then). Overlapped scheduling
        gives up once the device has finished the forward pass and would wait on the host.
        times: where the wait for heavy rows goes ("mask_wait: side rows (part)"), apart: with
        give_up it never holds the device, so it is no cost of the fill (LazyGate)."""
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
            if side is not None:
                started = time.perf_counter()
                side_error = self._take_side_rows(side, give_up)
                error = error or side_error
                if times is not None:
                    times.seconds["mask_wait: side rows (part)"] += time.perf_counter() - started
        if error is not None:
            raise RuntimeError(error)
        self.measure_widths(counted)
        return self.bans

    def _take_side_rows(self, side: list[SideRows], give_up: Callable[[], bool] | None
                        ) -> str | None:
        """Copies in the heavy rows filled; marks the rest late (with give_up); the first
        error of a fill taken. A late fill runs on, kept on its request for the position's
        next run (nothing else walks that matcher meanwhile)."""
        wait_fills([s.fill for s in side], give_up)
        error = None
        late: set[int] = set()
        for s in side:
            if not s.fill.done:
                s.item.late_mask = True
                late.update(range(s.first, s.first + s.num_rows))
                continue
            s.item.request.side_fill = None  # its rows are used now
            problem = s.fill.future.exception()
            if problem is not None:
                error = error or str(problem)
                continue
            self.bitmask[s.first:s.first + s.num_rows] = s.fill.rows()
        if late:  # sampled unconstrained; the update drops those samples
            self.layout.packed = [-1 if r in late else r for r in self.layout.packed]
            if self.last_rows:
                self.last_rows = [(req, row) for req, row in self.last_rows if row not in late]
        return error

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
    lazy_min_allowed: with lazy masks (guided/masks/lazy.py), where each filled request's
    last row is measured; the rows of a request sampled unmasked allow everything.

    Rows that allow everything take no bitmask row: the sampler reads them as unconstrained
    (fill.layout), and the rows filled are packed at the buffer's front, so a step with many
    lazy rows neither sets nor copies theirs (a 128k vocabulary's row is 16 KB). Lazy rows
    inside a JSON string all read one row, the string ban's (lazy_masks.lazy_row_ban)."""
    started = time.perf_counter()
    entries: list = []  # (request, drafts, first row) still to fill
    last_rows: list[tuple[Request, int]] = []
    src: list[int] = []
    dst: list[int] = []
    packed: list[int] = []  # the runner's row -> the row filled for it, -1: allows everything
    ban_rows: dict[int, tuple[int, object]] = {}  # lazy rows' bans: id -> (its row, the ban)
    row = 0  # the next packed row
    for item in sched.scheduled:
        request = item.request
        if not item.masked:
            continue
        drafts = item.draft_token_ids
        num_rows = len(drafts) + 1
        if lazy_min_allowed is not None and samples_unmasked(item):
            item.lazy_mask = True  # sampled unmasked, checked by the update
            times.count("mask_rows_lazy", num_rows)
            ban = lazy_row_ban(request, num_rows)
            if ban is None:
                packed.extend([-1] * num_rows)
                continue
            if id(ban) not in ban_rows:  # one row per ban, shared by the rows that carry it
                ban_rows[id(ban)] = (row, ban)
                row += 1
            packed.append(ban_rows[id(ban)][0])
            times.count("mask_rows_banned")
            continue
        ahead = None if prefetch is None else prefetch.take(request.request_id,
                                                             request.matcher, drafts)
        if request.is_finished or item.voided or request.matcher.is_terminated():
            packed.extend([-1] * num_rows)
            continue
        if item.drafts_void:  # only its first row stands
            entries.append((request, [], row))
            last_rows.append((request, row))
            packed.append(row)
            packed.extend([-1] * (num_rows - 1))
            row += 1
            continue
        if ahead is not None:
            src.extend(range(ahead, ahead + num_rows))
            dst.extend(range(row, row + num_rows))
        else:
            entries.append((request, drafts, row))
        last_rows.append((request, row + num_rows - 1))
        packed.extend(range(row, row + num_rows))
        row += num_rows
    for ban_row, ban in ban_rows.values():
        words = ban.keep_words.shape[0]
        bitmask[ban_row, :words] = ban.keep_words
        bitmask[ban_row, words:] = -1
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
        side = side_rows(sched, heavy, bitmask.shape[1], num_threads)
        times.count("mask_rows_side", sum(len(d) + 1 for _, d, _ in heavy))
    pending = None
    if shards is not None and entries:  # a shard ANDs its rows' bans itself
        local, remote, pending = shards.dispatch(entries, segment)
        if remote:
            times.count("mask_rows_shards", sum(len(d) + 1 for _, d, _ in remote))
    else:
        local = [(request.matcher, drafts, first) for request, drafts, first in entries]
    fill = MaskFill(bitmask, bans, pending, num_threads, RowLayout(packed, row), side,
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


def side_rows(sched: SchedulerOutput, heavy: list[tuple[Request, list[int], int]], words: int,
              num_threads: int) -> list[SideRows]:
    """Side fills for the heavy entries: started now, or the one still kept from a step that
    gave up on it, where it serves the same state (its rows are those this step needs)."""
    items = {id(item.request): item for item in sched.scheduled}
    out = []
    for request, drafts, first in heavy:
        # the matcher holds the committed tokens
        fill = side_fill_for(request, drafts, len(request.output_token_ids), words,
                             num_threads=num_threads)
        out.append(SideRows(fill, items[id(request)], first, len(drafts) + 1))
    return out


def fill_step_masks(sched: SchedulerOutput, bitmask: torch.Tensor, **kwargs) -> MaskFill:
    """start_step_masks, waited for: every row filled."""
    fill = start_step_masks(sched, bitmask, **kwargs)
    fill.wait()
    return fill
