"""guided.kernels.candidates: a row's K best tokens in Gumbel-max order, against the torch
reference; and the property the engine relies on: the first candidate an allowed set holds is
the token the masked sampler draws for that set."""
from __future__ import annotations

import pytest
import torch

from guided.kernels import bitmask as bm
from guided.kernels import candidates as cand

INTERPRET = not torch.cuda.is_available()  # as conftest.py: the interpreter on the CPU
DEVICE = "cpu" if INTERPRET else "cuda"


def _rows(batch: int, vocab: int, pad: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab + pad, generator=gen) * 3).to(dtype)
    temperature = torch.tensor([0.0 if b % 3 == 0 else 0.5 + 0.25 * b for b in range(batch)])
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    return logits.to(DEVICE), temperature.to(DEVICE), seeds.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,pad", [(5000, 0), (4100, 60), (300, 4)])
def test_kernel_matches_reference(dtype, vocab, pad):
    logits, temperature, seeds = _rows(7, vocab, pad, dtype, seed=vocab + pad)
    rows = torch.tensor([6, 0, 3, 4], device=DEVICE)
    got = cand.sample_candidates(logits, rows, temperature, seeds, k=8, vocab_size=vocab)
    want = cand.sample_candidates_ref(logits, rows, temperature, seeds, k=8, vocab_size=vocab)
    assert got.shape == (4, 8) and got.dtype == torch.int64
    if INTERPRET:  # the same log2 as the reference: bit for bit
        assert torch.equal(got.cpu(), want.cpu())
    else:  # the GPU's fast log2 may reorder two scores within an ulp
        assert (got.cpu() == want.cpu()).float().mean() > 0.95
    assert bool((got < vocab).all())  # padded columns are never tokens
    assert not INTERPRET or "Interpret" in type(cand._candidates_kernel).__name__


def test_first_candidate_is_the_sample_and_ties_go_to_the_lowest_column():
    logits, temperature, seeds = _rows(6, 3000, 8, torch.float32, seed=1)
    tied = [*range(2100, 2105), *range(100, 105)]  # a greedy row's tie across two blocks
    logits[0, tied] = 50.0
    rows = torch.arange(6, device=DEVICE)
    got = cand.sample_candidates(logits, rows, temperature, seeds, k=12, vocab_size=3000)
    sampled = bm.masked_sample(logits, None, None, temperature, seeds, vocab_size=3000)
    assert torch.equal(got[:, 0], sampled)
    assert got[0, :10].tolist() == sorted(tied)


@pytest.mark.parametrize("seed", range(4))
def test_first_allowed_candidate_is_the_masked_sample(seed):
    """The engine's use: for any allowed set, the masked sampler's token is the first of the
    row's candidates the set holds (when one of them is in it)."""
    vocab = 2000
    logits, temperature, seeds = _rows(9, vocab, 0, torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(100 + seed)
    allowed = torch.rand(9, vocab, generator=gen) < torch.linspace(0.02, 0.9, 9)[:, None]
    bits = torch.zeros(9, (vocab + 31) // 32 * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.to(torch.int64)
    words = (bits.view(9, -1, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).to(DEVICE)
    masked = bm.masked_sample(logits, bitmask, None, temperature, seeds, vocab_size=vocab)
    got = cand.sample_candidates(logits, torch.arange(9, device=DEVICE), temperature, seeds,
                                 k=64, vocab_size=vocab)
    found = 0
    for b in range(9):
        first = next((t for t in got[b].tolist() if allowed[b, t]), None)
        if first is not None:
            assert first == int(masked[b])
            found += 1
    assert found >= 7  # 64 candidates hold an allowed token on all but the sparsest rows


def test_scores_candidates_orders_given_scores():
    scores = torch.tensor([[1.0, 3.0, 3.0, -1.0, 2.0], [0.0, 0.0, 5.0, 0.0, 0.0]])
    got = cand.scores_candidates(scores, torch.tensor([1, 0]), k=3)
    assert got.tolist() == [[2, 0, 1], [1, 2, 4]]
