"""A step's grammar mask rows: one row per sampled position of each constrained request (its
row before every draft, then the bonus row), in the order the runner lays out sampled rows."""
from __future__ import annotations

import torch

from guided.fsm.bitmask_fill import Bans, fill_draft_rows
from guided.fsm.mask_prefetch import MaskPrefetch
from guided.scheduler.scheduler import SchedulerOutput
from guided.step_times import StepTimes


def fill_step_masks(sched: SchedulerOutput, bitmask: torch.Tensor, *, num_threads: int,
                    times: StepTimes, prefetch: MaskPrefetch | None = None) -> Bans:
    """Rows filled ahead (prefetch) are copied, the rest filled from the matchers (which hold
    the committed tokens only). Rows whose tokens will be dropped allow everything (overlapped
    scheduling): those of requests that finished since the step was scheduled, of voided
    entries, and of drafts anchored on a token the previous step did not sample. Returns the
    token bans still to apply to the rows (on the device, after the copy)."""
    entries: list = []  # (matcher, drafts, first row) still to fill
    src: list[int] = []
    dst: list[int] = []
    row = 0
    for item in sched.scheduled:
        request = item.request
        if request.matcher is None or not item.sample:
            continue
        drafts = item.draft_token_ids
        num_rows = len(drafts) + 1
        ahead = None if prefetch is None else prefetch.take(request.request_id,
                                                             request.matcher, drafts)
        if request.is_finished or item.voided or request.matcher.is_terminated():
            bitmask[row:row + num_rows] = -1
        elif item.drafts_void:
            bitmask[row + 1:row + num_rows] = -1
            entries.append((request.matcher, [], row))
        elif ahead is not None:
            src.extend(range(ahead, ahead + num_rows))
            dst.extend(range(row, row + num_rows))
        else:
            entries.append((request.matcher, drafts, row))
        row += num_rows
    if src:
        bitmask[torch.tensor(dst)] = prefetch.buffer[torch.tensor(src)]
        times.count("mask_rows_ahead", len(src))
    bans: Bans = {}
    if entries:
        fill_draft_rows(entries, bitmask, num_threads=num_threads, bans=bans)
    return bans
