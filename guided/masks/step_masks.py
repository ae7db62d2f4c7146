"""A step's grammar masks: one row per sampled position of each constrained request (its row
before every draft, then the bonus row), in the order the scheduler's output numbered them
(scheduler/output.py build_output), filled from the requests' matchers and handed to the worker
as a value (StepMasks).

Rows whose tokens will be dropped allow everything (overlapped scheduling): those of requests
that finished since the step was scheduled, of voided entries, and of drafts anchored on a
token the previous step did not sample (only the first row stands)."""
from __future__ import annotations

import torch

from guided.masks.bitmask_fill import fill_draft_rows
from guided.scheduler.scheduler import StepPlan
from guided.worker.step_io import StepMasks
from guided.worker.step_times import StepTimes

MASK_THREADS = 8  # threads filling a large step's rows (capped by the CPUs)


def fill_step_masks(plan: StepPlan, bitmask: torch.Tensor, mask_rows: list[int], *,
                    times: StepTimes) -> StepMasks:
    """bitmask: (rows, words) int32 host buffer, one row per mask row of the step (its old
    contents are garbage). The matchers hold the committed tokens and are left there. Raises
    RuntimeError where the grammar rejects a draft (a jump-forward bug, never a user's)."""
    entries: list = []  # (matcher, drafts, first row) to fill
    row = 0
    for item in plan.scheduled:
        if not item.masked:
            continue
        request = item.request
        num_rows = item.num_draft_tokens + 1
        if request.is_finished or item.voided or request.matcher.is_terminated():
            bitmask[row:row + num_rows] = -1
        elif item.drafts_void:
            entries.append((request.matcher, [], row))
            bitmask[row + 1:row + num_rows] = -1
        else:
            entries.append((request.matcher, item.draft_token_ids, row))
        row += num_rows
    with times.phase("mask_fill"):
        fill_draft_rows(entries, bitmask, num_threads=MASK_THREADS, times=times)
    return StepMasks(bitmask[:row], mask_rows)
