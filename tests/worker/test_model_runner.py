"""worker/model_runner.py: host mask buffers reused in turn, each only after its copy ran; a step
launched and sampled on synthetic:tiny."""
from __future__ import annotations

import pytest
import torch

from guided.config import EngineConfig
from guided.params import SamplingParams
from guided.scheduler.output import SchedulerOutput
from guided.scheduler.sampling_rows import RowSource, rows_for
from guided.worker.model_config import synthetic_config
from guided.worker.model_runner import MIN_MASK_ROWS, ModelRunner
from guided.worker.models.weights import RandomWeights
from guided.worker.step_io import StepMasks


def tiny_runner(device: str) -> ModelRunner:
    config = EngineConfig(model="synthetic:tiny", device=device, num_kv_blocks=8)
    return ModelRunner(config, synthetic_config("tiny"), RandomWeights(0), vocab_size=224)


def test_mask_buffers_are_reused_in_turn_and_grow():
    runner = tiny_runner("cpu")
    a, b = runner.new_bitmask(3), runner.new_bitmask(5)
    assert a.shape == (3, 7) and b.shape == (5, 7) and a.dtype == torch.int32
    assert a.is_contiguous() and b.is_contiguous()
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    again = runner.new_bitmask(MIN_MASK_ROWS)  # the first buffer again, no new allocation
    assert again.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    bigger = runner.new_bitmask(MIN_MASK_ROWS + 1)  # the second buffer, grown
    assert bigger.shape == (MIN_MASK_ROWS + 1, 7)
    assert runner._masks.to_device(bigger) is bigger  # on the CPU the rows are used where they are


@pytest.mark.gpu
def test_a_mask_buffer_is_taken_again_only_after_its_copy_ran():
    runner = tiny_runner("cuda")
    first = runner.new_bitmask(256)
    assert first.is_pinned()
    first.fill_(7)
    torch.cuda._sleep(50_000_000)  # keep the stream busy so the copy is still queued
    on_device = runner._masks.to_device(first)
    runner.new_bitmask(256)
    reused = runner.new_bitmask(256)  # waits for the copy out of `first`
    assert reused.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    reused.fill_(0)
    torch.cuda.synchronize()
    assert (on_device == 7).all()


def one_request_step(input_ids: list[int], start: int, **placeholders) -> SchedulerOutput:
    """A step of one request (block 0) feeding input_ids at positions start..., sampled once."""
    n = len(input_ids)
    return SchedulerOutput(
        input_ids=input_ids, positions=list(range(start, start + n)),
        slot_mapping=list(range(start, start + n)), query_start_loc=[0, n],
        seq_lens=[start + n], block_tables=[[0]], logits_indices=[n - 1],
        sampling=rows_for([RowSource(SamplingParams(temperature=0.8), 1, 5, start + n,
                                     [1, 2, 3, 4])]),
        mask_rows=[0], num_mask_rows=1, has_drafts=False, **placeholders)


def allowing(runner: ModelRunner, token: int) -> StepMasks:
    bitmask = runner.new_bitmask(1)
    bitmask.zero_()
    bitmask[0, token // 32] = 1 << (token % 32)
    return StepMasks(bitmask, [0])


def test_steps_are_launched_then_sampled_one_at_a_time():
    runner = tiny_runner("cpu")
    with pytest.raises(RuntimeError, match="nothing launched"):
        runner.sample(None)
    runner.launch(one_request_step([1, 2, 3, 4], 0))
    with pytest.raises(RuntimeError, match="not sampled yet"):
        runner.launch(one_request_step([5], 4))
    assert runner.sample(allowing(runner, 9)).result().token_ids == [9]
    # the next step's input is a placeholder: the token just sampled, read on the device
    runner.launch(one_request_step([0], 4, placeholder_index=[0], placeholder_row=[0]))
    assert runner.sample(allowing(runner, 11)).result().token_ids == [11]
    runner.launch(one_request_step([5], 5))
    runner.forget()  # a failed step: nothing in flight
    with pytest.raises(RuntimeError, match="nothing launched"):
        runner.sample(None)
