"""advance_decode_inputs_ (Triton, in the interpreter on the CPU) against its torch reference:
rows that move on and rows that sit a step out, a block boundary crossed, padding rows past the
batch left alone."""
from __future__ import annotations

import pytest
import torch

from guided.kernels.decode_inputs import advance_decode_inputs_, advance_decode_inputs_ref_


def _inputs(device: str, *, rows: int, padded: int, block_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    width = 6
    tables = torch.randint(0, 500, (padded, width), generator=g, dtype=torch.int32)
    positions = torch.randint(0, block_size * (width - 1), (padded,), generator=g)
    positions[0] = block_size - 1  # its next token starts a new block
    seq_lens = (positions + 1).int()
    slots = (tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1).long()
             * block_size + positions % block_size)
    ids = torch.randint(0, 1000, (padded,), generator=g)
    sampled = torch.randint(0, 1000, (rows,), generator=g)
    return [t.to(device) for t in (ids, positions, seq_lens, slots, tables, sampled)]


@pytest.mark.parametrize("with_moves", [False, True])
def test_advance_matches_the_reference(device, with_moves):
    rows, padded, bs = 37, 48, 16
    got = _inputs(device, rows=rows, padded=padded, block_size=bs, seed=3)
    want = [t.clone() for t in got]
    before = [t.clone() for t in got]
    moves = None
    if with_moves:
        moves = torch.ones(rows, dtype=torch.int64)
        moves[[1, 5, 36]] = 0
        moves = moves.to(device)
    advance_decode_inputs_(*got[:5], got[5], moves, block_size=bs)
    advance_decode_inputs_ref_(*want[:5], want[5], moves, block_size=bs)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b.cpu())
    ids, positions, seq_lens, slots, tables, sampled = (t.cpu() for t in got)
    ids0, positions0, seq_lens0, slots0 = (t.cpu() for t in before[:4])
    moved = [b for b in range(rows) if not with_moves or b not in (1, 5, 36)]
    stayed = [b for b in range(rows) if b not in moved]
    assert torch.equal(ids[moved], sampled[moved])
    assert torch.equal(positions[moved], positions0[moved] + 1)
    assert torch.equal(seq_lens[moved], seq_lens0[moved] + 1)
    assert int(slots[0]) == int(tables[0, 1]) * bs  # crossed into its second block
    for new, old in ((ids, ids0), (positions, positions0), (seq_lens, seq_lens0),
                     (slots, slots0)):
        assert torch.equal(new[stayed], old[stayed])  # a late row keeps everything
        assert torch.equal(new[rows:], old[rows:])  # padding untouched
