"""The grammar's side of a multi-step decode call (num_scheduler_steps > 1) over a batch with
constrained requests: before each step's sampling, every constrained row's matcher takes the
token the step before sampled and fills the row of the step's mask, while the device runs the
step's forward pass. The host does no scheduling, input building or update between the steps,
only this; the tokens are appended once, after the call (Engine._update)."""
from __future__ import annotations

import torch

from guided.fsm.bitmask_fill import fill_bitmasks
from guided.scheduler.scheduler import SchedulerOutput


class DecodeStepMasks:
    def __init__(self, sched: SchedulerOutput, mask_rows: list[int], *, num_threads: int):
        """mask_rows: the bitmask row of each scheduled request's sampled row, -1 unconstrained
        (StepInputs.mask_rows: one sampled row a request in a decode batch)."""
        self.num_rows = sum(row >= 0 for row in mask_rows)
        self._rows = [(b, item.request, row) for b, (item, row)
                      in enumerate(zip(sched.scheduled, mask_rows)) if row >= 0]
        self._num_threads = num_threads
        self._accepted = {b: 0 for b, _, _ in self._rows}  # tokens each matcher took here
        self._refused: set[int] = set()  # rows whose grammar refused a token

    @property
    def accepted_rows(self) -> frozenset[int]:
        """Rows whose matchers hold every token of the call that counts: the update appends
        their tokens without feeding them again. A refused row was walked back to where the
        call began, so the update feeds it and ends the request at the refused token."""
        return frozenset(b for b, _, _ in self._rows if b not in self._refused)

    def fill(self, previous: list[int] | None, bitmask: torch.Tensor) -> None:
        """previous: the tokens the step before sampled (one per scheduled request; None
        before the first step). Rows that can take nothing more (ended, refused) allow every
        token: what they sample lies past their finish and is dropped."""
        if previous is not None:
            self.accept(previous)
        live = []
        for b, request, row in self._rows:
            if self._takes_more(b, request):
                live.append((request.matcher, row))
            else:
                bitmask[row].fill_(-1)
        fill_bitmasks(live, bitmask, num_threads=self._num_threads)

    def accept(self, tokens: list[int]) -> None:
        """Each live constrained row's matchers take its token (the last step's tokens too,
        once the call is done, so that every row's matchers stand where its tokens end)."""
        for b, request, _ in self._rows:
            if not self._takes_more(b, request):
                continue
            if request.accept_committed(tokens[b]):
                self._accepted[b] += 1
            else:  # a masked sample the grammar refuses: the update reports it
                self._refused.add(b)
                request.matcher.rollback(self._accepted[b])
                if request.draft_matcher not in (None, request.matcher):
                    request.draft_matcher.rollback(self._accepted[b])
                self._accepted[b] = 0

    def _takes_more(self, b: int, request) -> bool:
        """Whether row b's grammar can take another token (it neither ended nor refused)."""
        return b not in self._refused and not request.matcher.is_terminated()
