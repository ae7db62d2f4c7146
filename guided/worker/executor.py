"""What the engine drives: a step goes in as two values and its tokens come back.

    launch(SchedulerOutput)   queue the step's forward pass (not waited for); the tokens its
                              placeholders stand for are the last sampled step's, on the device
    sample(StepMasks | None)  queue the launched step's masked sampling; a handle whose result()
                              is its RunnerOutput (one token per row)

One step is launched and not yet sampled at a time, so neither call names a step: the engine's
loop keeps the order (launch t+2 only after sampling t+1). LocalExecutor runs the one worker in
this process (tensor_parallel_size 1: no process hop on the step's path); MultiprocExecutor
(worker/multiproc.py) takes the same two values to each of its worker processes, one per
tensor-parallel rank. Both say what the engine sizes itself by: num_blocks, max_model_len,
max_draft_tokens, device, dtype."""
from __future__ import annotations

import torch

from guided.config import EngineConfig
from guided.scheduler.output import SchedulerOutput
from guided.worker import loader
from guided.worker.model_config import ModelConfig
from guided.worker.model_runner import ModelRunner
from guided.worker.step_io import LaunchedStep, SampledStep, StepMasks
from guided.worker.step_times import StepTimes


def make_executor(config: EngineConfig, model_config: ModelConfig, *, vocab_size: int,
                  step_times: StepTimes):
    """LocalExecutor at tensor_parallel_size 1, else one worker process per rank."""
    if config.tensor_parallel_size == 1:
        reader = loader.weight_reader(config.model, config.seed)
        return LocalExecutor(ModelRunner(config, model_config, reader, vocab_size=vocab_size,
                                         step_times=step_times))
    from guided.worker.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, model_config, vocab_size=vocab_size, step_times=step_times)


class LocalExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.num_blocks, self.max_model_len = runner.num_blocks, runner.max_model_len
        self.max_draft_tokens = runner.max_draft_tokens
        self.device, self.dtype = str(runner.device), str(runner.dtype).removeprefix("torch.")
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
