"""The grammar's side of a multi-step decode call (num_scheduler_steps > 1) over a batch with
constrained requests: before each step's sampling, every constrained row's matcher takes the
token the step before sampled and fills the row of the step's mask, while the device runs the
step's forward pass. The host does no scheduling, input building or update between the steps,
only this; the tokens are appended once, after the call (Engine._update). Rows of DFA grammars
whose tables are on the device (guided/worker/device_dfa.py) are masked and stepped there: the
host fills none of their rows, and their matchers take the tokens only to follow along, while
the device runs the next forward pass.

Heavy rows (a long counted repetition: milliseconds a row, fsm/side_fill.py) fill on side
threads beside the others. In a batch larger than policy.waits_for_late_rows waits in, one not
filled by the time the device has finished the step's forward pass is late: fill() names it,
and its request sits the step out (the device feeds it the same token at the same position
again, decode_steps.py, and its sample is dropped); its fill runs on and serves the next step,
or the next call, which finds the matcher in the same state. So one heavy request in a batch
of 256 neither holds every step nor keeps the batch out of multi-step calls; it decodes at the
pace its rows are filled, losing a step where one is late, not the rest of the call."""
from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from guided.masks.bitmask_fill import fill_bitmasks
from guided.masks.side_fill import SideFill, side_fill_for, wait_fills
from guided.scheduler.request import Request
from guided.scheduler.scheduler import SchedulerOutput


class DecodeStepMasks:
    def __init__(self, sched: SchedulerOutput, mask_rows: list[int], *, num_threads: int,
                 device_rows: Collection[int] = ()):
        """mask_rows: the bitmask row of each scheduled request's sampled row, -1 unconstrained
        (StepInputs.mask_rows: one sampled row a request in a decode batch). device_rows:
        constrained requests (scheduled index) the device masks and steps
        (guided/worker/device_dfa.py): their matchers take their tokens here, no rows filled;
        the host's rows are renumbered 0.. in the order of the others."""
        device = set(device_rows)
        self.host_rows = [-1] * len(mask_rows)  # scheduled index -> its row in fill's bitmask
        self._host: list[tuple[int, Request, int]] = []  # (b, request, its row)
        self._device: list[tuple[int, Request, int]] = []  # (b, request, -1)
        for b, (item, row) in enumerate(zip(sched.scheduled, mask_rows)):
            if row < 0:
                continue
            if b in device:
                self._device.append((b, item.request, -1))
            else:
                self.host_rows[b] = len(self._host)
                self._host.append((b, item.request, len(self._host)))
        self.num_rows = len(self._host)  # the host's
        self._rows = self._host + self._device
        self._num_threads = num_threads
        # the call's steps whose tokens the host's rows, the device's rows, took
        self.host_steps_accepted = self.device_steps_accepted = 0
        self._accepted = {b: 0 for b, _, _ in self._rows}  # tokens each matcher took here
        self._refused: set[int] = set()  # rows whose grammar refused a token
        self._late: set[int] = set()  # heavy rows the last step's fill gave up on

    @property
    def accepted_rows(self) -> frozenset[int]:
        """Rows whose matchers hold every token of the call that counts: the update appends
        their tokens without feeding them again. A refused row was walked back to where the
        call began, so the update feeds it and ends the request at the refused token."""
        return frozenset(b for b, _, _ in self._rows if b not in self._refused)

    def fill(self, previous: list[int] | None, bitmask: torch.Tensor,
             give_up: Callable[[], bool] | None = None) -> frozenset[int]:
        """previous: the tokens the step before sampled (one per scheduled request; None
        before the first step). Rows that can take nothing more (ended, refused) allow every
        token: what they sample lies past where they stop and is dropped. give_up: whether
        the device has finished the step's forward pass, so that waiting longer for a heavy
        row would hold it (None: heavy rows are waited for). Returns the late rows: they
        allow every token too, and their samples of this step do not count (the next accept
        passes them over)."""
        filling = set(self._late)  # their matchers are their side threads' until done
        if previous is not None:
            self.accept(previous, device=False)
        live, heavy = [], []
        for b, request, row in self._host:
            if b not in filling and not self._takes_more(b, request):
                bitmask[row].fill_(-1)
            elif request.matcher.heavy:  # started first: they fill beside the others
                heavy.append((b, request, row,
                              self._side_fill(b, request, bitmask.shape[1])))
            else:
                live.append((request.matcher, row))
        fill_bitmasks(live, bitmask, num_threads=self._num_threads)
        if heavy:
            self._take_heavy(heavy, bitmask, give_up)
        return frozenset(self._late)

    def accept(self, tokens: list[int], *, device: bool | None = None) -> None:
        """Each live constrained row's matchers take its token (the last step's tokens too,
        once the call is done, so that every row's matchers stand where its tokens end).
        device: only the device's rows (True), only the host's (False), both (None). The
        host's rows take a step's tokens before their next rows are filled, but for the rows
        late at that step; the device's take them while the device runs the next step, off
        the path its steps wait on."""
        if device is not False:
            self.device_steps_accepted += 1
        if device is not True:
            self.host_steps_accepted += 1
        rows = self._rows if device is None else self._device if device else self._host
        late, self._late = (self._late, set()) if device is not True else (set(), self._late)
        for b, request, _ in rows:
            if b in late or not self._takes_more(b, request):
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

    def _side_fill(self, b: int, request, words: int) -> SideFill:
        """The fill of a heavy row's next mask, for the committed tokens and those its
        matcher took in this call."""
        return side_fill_for(request, [], len(request.output_token_ids) + self._accepted[b],
                             words, num_threads=self._num_threads)

    def _take_heavy(self, heavy: list[tuple[int, Request, int, SideFill]], bitmask: torch.Tensor,
                    give_up: Callable[[], bool] | None) -> None:
        """Copies in the heavy rows filled by the time the device would wait; the rest are
        late (their fills run on, kept on their requests)."""
        wait_fills([fill for *_, fill in heavy], give_up)
        for b, request, row, fill in heavy:
            if fill.done:
                request.side_fill = None
                bitmask[row] = fill.rows()[0]
            else:
                self._late.add(b)
                bitmask[row].fill_(-1)
