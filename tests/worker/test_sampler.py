"""guided.worker.sampler and scheduler/sampling_rows.py: seeded rows, the fused path and the
torch path (filters, penalties) draw the same Gumbel noise; list_tensor equals torch.tensor."""
from __future__ import annotations

import pytest
import torch

from guided.scheduler.sampling_rows import SamplingRows

VOCAB = 500


def _rows(n: int, *, penalty: float = 0.0) -> SamplingRows:
    return SamplingRows(
        temperature=[0.0, 0.7, 1.0, 0.9][:n], seeds=[11, 12, 13, 14][:n], top_k=[0] * n,
        top_p=[1.0] * n, min_p=[0.0] * n, presence_penalty=[penalty] * n,
        frequency_penalty=[0.0] * n, repetition_penalty=[1.0] * n,
        history=[[1, 2, 3]] * n, prompt_ids=[[4]] * n, num_logprobs=[-1] * n,
        needs_slow_path=bool(penalty))


def position_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position), folded to a non-negative int64: position_seeds' oracle."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def test_position_seeds_equal_position_seed():
    import random

    import numpy as np

    from guided.scheduler.sampling_rows import position_seeds

    rng = random.Random(5)
    seeds = [rng.getrandbits(63) for _ in range(300)] + [0, (1 << 63) - 1]
    positions = [rng.randrange(1 << 20) for _ in range(300)] + [0, 1 << 40]
    got = position_seeds(np.array(seeds, np.uint64), np.array(positions, np.uint64))
    assert got.tolist() == [position_seed(s, p) for s, p in zip(seeds, positions)]


@pytest.mark.parametrize("slow", [False, True])
def test_rows_for_repeats_each_request_over_its_rows(slow):
    from guided.params import SamplingParams
    from guided.scheduler.sampling_rows import RowSource, rows_for

    plain = SamplingParams(temperature=0.5)
    other = SamplingParams(temperature=0.9, top_k=5 if slow else -1, logprobs=2)
    sources = [RowSource(plain, 3, 7, 10, [1, 2]),
               RowSource(other, 1, 8, 0, [3], [[4]] if slow else None),
               RowSource(plain, 2, 9, 4, [5])]
    rows = rows_for(sources)
    assert rows.needs_slow_path == slow
    assert list(rows.seeds) == [position_seed(7, 10), position_seed(7, 11), position_seed(7, 12),
                                position_seed(8, 0), position_seed(9, 4), position_seed(9, 5)]
    assert [round(float(t), 3) for t in rows.temperature] == [0.5, 0.5, 0.5, 0.9, 0.5, 0.5]
    assert rows.num_logprobs == [-1, -1, -1, 2, -1, -1]
    if slow:
        assert rows.top_k == [-1, -1, -1, 5, -1, -1]
        assert rows.prompt_ids == [[1, 2]] * 3 + [[3]] + [[5]] * 2
        assert rows.history == [[], [], [], [4], [], []]


def test_logit_bias_moves_its_tokens_and_min_tokens_bans_stops_unless_nothing_else_is_left():
    from guided.worker.sampler import apply_logit_bias_, ban_stops_

    logits = torch.zeros(3, 8)
    rows = SimpleRows(logit_bias=[{5: 100.0}, None, {1: -100.0, 99: 3.0}],
                      banned=[(), (2, 3), (2,)])
    apply_logit_bias_(logits, rows)
    assert logits[0, 5] == 100.0 and logits[2, 1] == -100.0 and logits[1].abs().sum() == 0
    ban_stops_(logits, rows)
    assert torch.isinf(logits[1, [2, 3]]).all() and torch.isinf(logits[2, 2])
    only_stop = torch.full((1, 8), float("-inf"))
    only_stop[0, 2] = 0.0  # the grammar allows EOS alone: the constraint wins
    ban_stops_(only_stop, SimpleRows(logit_bias=None, banned=[(2,)]))
    assert only_stop[0, 2] == 0.0


class SimpleRows:
    def __init__(self, logit_bias, banned):
        self.logit_bias, self.banned = logit_bias, banned


@pytest.mark.parametrize("values, dtype", [
    ([0, 5, 2**63 - 1, 17], torch.int64),
    ([[1, 2, 0], [3, 0, 0]], torch.int32),
    ([0.0, 0.7, 1.5], torch.float32),
    ([], torch.int64),
])
def test_list_tensor_equals_torch_tensor(values, dtype):
    from guided.worker.sampler import list_tensor

    ours, theirs = list_tensor(values, dtype), torch.tensor(values, dtype=dtype)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert torch.equal(ours, theirs)
    with pytest.raises(OverflowError):
        list_tensor([2**63], torch.int64)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab_size, num_cols", [(49152, 49152), (128256, 128256)])
def test_no_sampling_kernel_compiles_mid_run_after_the_warm_up(vocab_size, num_cols):
    from guided.kernels import bitmask as kernels
    from guided.worker.sampler import warm_sampling_kernels

    device = torch.device("cuda")
    warm_sampling_kernels(num_cols, vocab_size=vocab_size, dtype=torch.bfloat16, device=device)

    def compiled() -> int:  # variants compiled so far, over the sampling kernels
        return sum(len(k.device_caches[torch.cuda.current_device()][0]) for k in (
            kernels._masked_sample_kernel, kernels._argmax_splits_kernel,
            kernels._apply_bitmask_kernel))

    before = compiled()
    words = -(-vocab_size // 32)
    for num_rows in (1, 7, 64, 1024):  # several vocab splits a row, then one
        logits = torch.randn(num_rows, num_cols, dtype=torch.bfloat16, device=device)
        bitmask = torch.randint(-2**31, 2**31 - 1, (num_rows, words), dtype=torch.int32,
                                device=device)
        mask_rows = torch.arange(num_rows, dtype=torch.int32, device=device)
        temperature = torch.rand(num_rows, device=device)
        seeds = torch.arange(num_rows, dtype=torch.int64, device=device)
        for mask, rows in ((None, None), (bitmask, mask_rows)):
            kernels.masked_sample(logits, mask, rows, temperature, seeds, vocab_size=vocab_size)
        kernels.apply_token_bitmask_(logits.float(), bitmask, mask_rows, vocab_size=vocab_size)
    torch.cuda.synchronize()
    assert compiled() == before
