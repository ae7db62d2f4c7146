"""A step's grammar masks: one row per sampled position of each constrained request (its row
before every draft, then the bonus row), in the order the scheduler's output numbered them
(scheduler/output.py build_output), filled from the requests' matchers and handed to the worker
as a value (StepMasks).

Rows whose tokens will be dropped allow everything (overlapped scheduling): those of requests
that finished since the step was scheduled, of voided entries, of drafts anchored on a token
the previous step did not sample (only the first row stands), and past a draft the grammar's
mask does not allow (bitmask_fill cuts it: verification stops there)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from guided.masks.bitmask_fill import fill_draft_rows
from guided.scheduler.request import Request
from guided.scheduler.scheduler import StepPlan
from guided.worker.step_io import StepMasks
from guided.worker.step_times import StepTimes

log = logging.getLogger(__name__)

MASK_THREADS = 8  # threads filling a large step's rows (capped by the CPUs)


@dataclass(slots=True)
class FilledMasks:
    masks: StepMasks
    # requests whose rows could not be filled (their matcher raised): their rows allow
    # everything, and the engine fails them alone
    failed: list[tuple[Request, str]] = field(default_factory=list)


def fill_step_masks(plan: StepPlan, bitmask: torch.Tensor, mask_rows: list[int], *,
                    times: StepTimes) -> FilledMasks:
    """bitmask: (rows, words) int32 host buffer, one row per mask row of the step (its old
    contents are garbage). The matchers hold the committed tokens and are left there. One
    batched fill; where it fails, each request's rows again on their own, so that a fault of
    one request's grammar fails that request only."""
    entries: list = []  # (matcher, drafts, first row) to fill
    owners: list[Request] = []
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
            owners.append(request)
            bitmask[row + 1:row + num_rows] = -1
        else:
            entries.append((request.matcher, item.draft_token_ids, row))
            owners.append(request)
        row += num_rows
    failed: list[tuple[Request, str]] = []
    with times.phase("mask_fill"):
        try:
            cut = fill_draft_rows(entries, bitmask, num_threads=MASK_THREADS)
        except Exception:  # noqa: BLE001 - found below, request by request
            cut = []
            for i, (entry, request) in enumerate(zip(entries, owners)):
                try:
                    if fill_draft_rows([entry], bitmask, num_threads=1):
                        cut.append(i)
                except Exception as e:  # noqa: BLE001 - this request's alone
                    first, num = entry[2], len(entry[1]) + 1
                    bitmask[first:first + num] = -1
                    failed.append((request, f"grammar mask failed: {e}"))
    for i in cut:  # a proposal the grammar disagrees with: worth knowing, harmless
        times.count("drafts_cut")
        log.warning("request %s: a jump-forward draft its grammar's mask does not allow; the "
                    "drafts from it on are dropped", owners[i].request_id)
    return FilledMasks(StepMasks(bitmask[:row], mask_rows), failed)
