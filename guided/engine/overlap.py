"""Overlapped scheduling: the order of device work when the host's work for step t runs while
the device runs step t+1.

On entry to step() step t is sampled (its tokens on their way to the host) and step t+1's
forward pass is queued behind it. While the device runs t+1 the host reads t's tokens and
updates its requests, fills t+1's masks and queues t+1's sampling, then makes t+2's drafts,
schedules and prepares t+2 and queues its forward pass, whose inputs include t+1's samples,
gathered on the device. The device waits for the host only when the host's work for a step
outlasts a forward pass. A request that finished at step t was already scheduled into t+1:
that row's token is dropped. What the requests make of their tokens is the engine's (update,
propose).

With mask shard processes (mask_processes) the loop first sends them t+2's draft asks (the
requests they mirror walk their drafts there: guided/fsm/shard_drafts.py), then t+1's rows, and
fills the rest; the shards work beside the loop's own drafts, scheduling and preparing, t+2 is
scheduled once their drafts are in and t+1 sampled once their rows are.

Heavy rows (fsm/side_fill.py) never hold the device: once it has finished t+1's forward pass
(an event recorded after the logits), the rows still filling are late. t+1 is sampled without
them, the update drops those requests' samples (their entries in t+2 are voided, as after a
rejected draft) and their positions run again, reading the rows the side threads went on
filling. Such a request loses two steps; the batch loses none (a 20 ms row used to idle the
device that long: benchmarks/RESULTS.md, session 21).

concurrent_masks moves the fill to the mask thread, beside the drafts (made on second
matchers), scheduling and preparing of t+2; t+1 is sampled once both are done. xgrammar fills
without the GIL, but the Python around the fills and the loop's own contend for it: measured
slower on an H200 (benchmarks/RESULTS.md, session 5), so it is off by default."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from concurrent.futures import wait

import torch

from guided.masks.step_masks import MaskFill
from guided.scheduler.scheduler import Scheduler, SchedulerOutput
from guided.engine.step_times import StepTimes
from guided.worker.model_runner import ModelRunner
from guided.worker.step_io import LaunchedStep, RunnerOutput, SampledStep, StepInputs

# starts filling a step's masks: filled here, or partly by mask shards still working
StartMasks = Callable[[SchedulerOutput, torch.Tensor], MaskFill]
Update = Callable[[SchedulerOutput, RunnerOutput], None]


class OverlappedSteps:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, times: StepTimes, *,
                 start_masks: StartMasks, update: Update, ask_drafts: Callable[[], None],
                 propose: Callable[[], None], concurrent_masks: bool = False):
        self._runner = runner
        self._scheduler = scheduler
        self._times = times
        self._start_masks = start_masks
        self._update = update
        self._ask_drafts = ask_drafts  # plans t+2's drafts; mask shards walk theirs meanwhile
        self._propose = propose  # t+2's drafts, from the requests' draft matchers
        self._concurrent_masks = concurrent_masks
        if concurrent_masks:
            # the mask thread comes back from each GIL-free fill needing the GIL; at Python's
            # 5 ms switch interval it waits that long beside the busy loop, at 0.5 ms much less
            # (benchmarks/bench_mask_gil.py)
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        self._launched: tuple[SchedulerOutput, LaunchedStep] | None = None  # masks not applied
        self._sampled: tuple[SchedulerOutput, SampledStep] | None = None  # tokens copying

    @property
    def in_flight(self) -> bool:
        return self._launched is not None or self._sampled is not None

    def step(self) -> None:
        try:
            self._step()
        except Exception:
            self.drop()
            raise

    def _step(self) -> None:
        times, runner = self._times, self._runner
        if self._sampled is not None:
            sched, sampled = self._sampled
            self._sampled = None
            with times.phase("sample_wait"):
                result = sampled.result()
            with times.phase("bookkeeping"):
                self._scheduler.landed(sched)
            with times.phase("update"):
                self._update(sched, result)
        self._ask_drafts()
        launched = self._launched
        self._launched = None
        bitmask = masks = fill = previous = None
        if launched is not None:
            with times.phase("bookkeeping"):
                bitmask = runner.new_bitmask(launched[1].inputs.num_mask_rows)
            if bitmask is None:  # nothing to wait for: t+1 samples while the host goes on
                previous = self._sample(launched, None)
            elif not self._concurrent_masks:
                with times.phase("mask_fill"):
                    fill = self._start_masks(launched[0], bitmask)
                if not fill.in_progress:  # all filled here: sample now
                    previous = self._sample(launched, bitmask, fill)
                    fill = None
                # else mask shards or side threads fill the rest beside the proposals,
                # scheduling, preparing
            else:  # filled beside the proposals, scheduling and preparing of t+2
                masks = runner.submit_host_job(lambda: self._timed_fill(launched[0], bitmask))
        try:
            self._propose()
            sched, inputs = self._schedule_and_prepare(launched)
        except BaseException:
            if masks is not None:
                wait([masks])  # the fill walks matchers: let it end before anyone else does
            if fill is not None:  # shards' replies taken, side threads done, before it fails
                with contextlib.suppress(Exception):  # the first fault is the one raised
                    fill.wait()
            raise
        if fill is not None:
            with times.phase("mask_wait"):
                fill.wait(give_up=self._late_rows_policy(launched[1]), times=times)
            previous = self._sample(launched, bitmask, fill)
        if masks is not None:
            with times.phase("mask_wait"):
                filled = masks.result()
            previous = self._sample(launched, bitmask, filled)
        if inputs is not None:
            self._launched = (sched, runner.launch(
                inputs, None if previous is None else previous.token_ids))
            with times.phase("bookkeeping"):
                self._scheduler.launched(sched)

    @staticmethod
    def _late_rows_policy(launched: LaunchedStep) -> Callable[[], bool] | None:
        """When the heavy rows still filling give up: once the device has finished the
        forward pass (its sampling would wait on them, and every step after it). On the CPU
        the forward pass ran within the launch: the rows are waited for."""
        return None if launched.forward_done is None else launched.device_waits

    def _sample(self, launched: tuple[SchedulerOutput, LaunchedStep],
                bitmask: torch.Tensor | None, masks: MaskFill | None = None) -> SampledStep:
        sampled = self._runner.sample(launched[1], bitmask, masks, launched[0])
        self._sampled = (launched[0], sampled)
        return sampled

    def _schedule_and_prepare(self, launched: tuple[SchedulerOutput, LaunchedStep] | None
                              ) -> tuple[SchedulerOutput, StepInputs | None]:
        times = self._times
        with times.phase("schedule"):
            sched = self._scheduler.schedule()
        inputs = None
        if sched.scheduled:
            times.count("steps")
            placeholders = {}
            if launched is not None:
                # the last row of each request in t+1: its drafts are assumed accepted
                rows = launched[1].inputs.row_of_request
                placeholders = {b: rows[item.request.request_id]
                                + item.request.inflight.num_live_drafts
                                for b, item in enumerate(sched.scheduled) if item.placeholder}
            with times.phase("prepare"):
                inputs = self._runner.prepare(
                    sched, [item.masked for item in sched.scheduled],
                    placeholders)
        return sched, inputs

    def _timed_fill(self, sched: SchedulerOutput, bitmask: torch.Tensor) -> MaskFill:
        with self._times.phase("mask_fill (thread)"):
            fill = self._start_masks(sched, bitmask)
            fill.wait()
            return fill

    def drop(self) -> None:
        """After a failed step: forget the steps in flight. Their requests go back to their
        committed tokens (whose K/V are in the cache) and recompute from there."""
        self._launched = self._sampled = None
        self._scheduler.forget_in_flight()
