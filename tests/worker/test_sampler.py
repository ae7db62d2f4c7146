"""guided.worker.sampler: rows sampled unmasked bring back their candidates, the sampled token
first, on the fused path and on the torch path (penalties), and none for other rows."""
from __future__ import annotations

import pytest
import torch

from guided.worker.sampler import SamplingRows, sample

VOCAB = 500


def _rows(n: int, *, penalty: float = 0.0) -> SamplingRows:
    return SamplingRows(
        temperature=[0.0, 0.7, 1.0, 0.9][:n], seeds=[11, 12, 13, 14][:n], top_k=[0] * n,
        top_p=[1.0] * n, min_p=[0.0] * n, presence_penalty=[penalty] * n,
        frequency_penalty=[0.0] * n, repetition_penalty=[1.0] * n,
        history=[[1, 2, 3]] * n, prompt_ids=[[4]] * n, num_logprobs=[-1] * n)


@pytest.mark.parametrize("penalty", [0.0, 1.5])
def test_unmasked_rows_bring_back_their_candidates(penalty):
    logits = torch.randn(4, VOCAB + 12, generator=torch.Generator().manual_seed(3))
    rows = _rows(4, penalty=penalty)
    assert rows.needs_slow_path == bool(penalty)
    out = sample(logits, rows, None, None, vocab_size=VOCAB, candidate_rows=[1, 3],
                 num_candidates=6)
    assert sorted(out.candidates) == [1, 3]
    for row, best in out.candidates.items():
        assert len(best) == len(set(best)) == 6 and max(best) < VOCAB
        assert best[0] == out.token_ids[row]
    assert sample(logits, rows, None, None, vocab_size=VOCAB).candidates is None
