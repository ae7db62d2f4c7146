"""The engine <-> rank messages survive encode / decode whole (a step as the ranks see it)."""
from __future__ import annotations

import dataclasses

import numpy as np

from guided.config import EngineConfig
from guided.params import SamplingParams
from guided.scheduler.output import SchedulerOutput
from guided.scheduler.sampling_rows import RowSource, rows_for
from guided.worker.messages import (Failed, Forget, Launch, MaskSlot, Ready, Sample, Sampled,
                                    Stop, WorkerSpec, decode, encode)
from guided.worker.model_config import synthetic_config
from guided.worker.step_io import RunnerOutput


def decode_step(batch: int, context_len: int, *, block_size: int = 16) -> SchedulerOutput:
    """A decode step of `batch` requests `context_len` tokens long, the last half constrained
    and sampled with top-p (the slow path's per-row lists)."""
    blocks = -(-(context_len + 1) // block_size)
    sources = [RowSource(SamplingParams(temperature=0.7, top_p=0.9 if b % 2 else 1.0),
                         1, 1000 + b, context_len - 10, list(range(10))) for b in range(batch)]
    return SchedulerOutput(
        input_ids=[(7 * b) % 49152 for b in range(batch)],
        positions=[context_len] * batch,
        slot_mapping=[b * blocks * block_size + context_len for b in range(batch)],
        query_start_loc=list(range(batch + 1)),
        seq_lens=[context_len + 1] * batch,
        block_tables=[list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)],
        logits_indices=list(range(batch)),
        sampling=rows_for(sources),
        mask_rows=[-1 if b < batch // 2 else b - batch // 2 for b in range(batch)],
        num_mask_rows=batch - batch // 2, has_drafts=False,
        placeholder_index=list(range(batch)), placeholder_row=list(range(batch)))


def assert_same_output(a: SchedulerOutput, b: SchedulerOutput) -> None:
    for field in dataclasses.fields(SchedulerOutput):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name == "sampling":
            for row_field in dataclasses.fields(x):
                np.testing.assert_array_equal(getattr(x, row_field.name),
                                              getattr(y, row_field.name))
        else:
            assert x == y, field.name


def test_a_launch_comes_back_whole():
    out = decode_step(6, 40)
    back = decode(encode(Launch(3, out)))
    assert isinstance(back, Launch) and back.step == 3
    assert_same_output(back.out, out)
    assert back.out.sampling.needs_slow_path and back.out.query_lens == [1] * 6


def test_every_message_round_trips():
    spec = WorkerSpec(EngineConfig(tensor_parallel_size=2, device="cpu"),
                      synthetic_config("tiny"), 49152, 1, 2, "/dev/shm/x-consumed", 20)
    messages = [spec, Sample(4, MaskSlot(1, "/dev/shm/x-1-2", 3, [0, -1, 1, 2])), Sample(5, None),
                Forget(), Stop(), Ready(0, 128, 8192, 7, "cuda:0", "bfloat16"),
                Sampled(4, RunnerOutput([5, 6], [None, (-0.5, [(6, -0.5)])])),
                Failed(1, "OutOfMemoryError: CUDA out of memory")]
    for message in messages:
        back = decode(encode(message))
        assert type(back) is type(message) and back == message
