"""What the engine drives: a step goes in as two values and its tokens come back.

    launch(SchedulerOutput)   queue the step's forward pass (not waited for); the tokens its
                              placeholders stand for are the last sampled step's, on the device
    sample(StepMasks | None)  queue the launched step's masked sampling; a handle whose result()
                              is its RunnerOutput (one token per row)

One step is launched and not yet sampled at a time, so neither call names a step: the engine's
loop keeps the order (launch t+2 only after sampling t+1). LocalExecutor runs the one worker in
this process; an executor of several worker processes (tensor parallel ranks) takes the same
two values to each of them."""
from __future__ import annotations

import torch

from guided.scheduler.output import SchedulerOutput
from guided.worker.model_runner import ModelRunner
from guided.worker.step_io import LaunchedStep, SampledStep, StepMasks


class LocalExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._launched: LaunchedStep | None = None
        self._last_sampled: SampledStep | None = None  # its ids feed the next placeholders

    def launch(self, out: SchedulerOutput) -> None:
        if self._launched is not None:
            raise RuntimeError("a step is launched and not sampled yet")
        previous = None if self._last_sampled is None else self._last_sampled.token_ids
        with self.runner.times.phase("prepare"):
            inputs = self.runner.prepare(out)
        self._launched = self.runner.launch(inputs, previous if out.placeholder_index else None)

    def sample(self, masks: StepMasks | None) -> SampledStep:
        launched, self._launched = self._launched, None
        if launched is None:
            raise RuntimeError("nothing launched to sample")
        self._last_sampled = self.runner.sample(launched, masks)
        return self._last_sampled

    def new_bitmask(self, num_rows: int) -> torch.Tensor:
        return self.runner.new_bitmask(num_rows)

    def forget(self) -> None:
        """After a failed step: nothing in flight any more."""
        self._launched = self._last_sampled = None

    def shutdown(self) -> None:
        self.runner.shutdown()
