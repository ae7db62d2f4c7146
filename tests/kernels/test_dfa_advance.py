"""dfa_advance (Triton, in the interpreter on the CPU) against its torch reference, on random
tables: states below the offset, EOS, states without exceptions, long exception lists."""
from __future__ import annotations

import math

import torch

from guided.kernels.dfa_advance import AdvanceTables, dfa_advance, dfa_advance_ref


def random_tables(device: str, *, num_slots: int, offset: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 40, (num_slots,), generator=g, dtype=torch.int32)
    counts[0] = 0
    counts[1] = 300  # a long list: several search steps
    tokens, nexts = [], []
    for c in counts.tolist():
        tokens.append(torch.randperm(vocab, generator=g)[:c].sort().values)
        nexts.append(torch.randint(offset, offset + num_slots, (c,), generator=g))
    starts = torch.cumsum(counts, 0) - counts
    default = torch.randint(offset, offset + num_slots, (num_slots,), generator=g)
    default[2] = 0  # a state without transitions
    tables = AdvanceTables(offset, default.int().to(device), starts.int().to(device),
                           counts.to(device), torch.cat(tokens).int().to(device),
                           torch.cat(nexts).int().to(device),
                           math.ceil(math.log2(int(counts.max()) + 1)) + 1)
    return tables, tokens


def test_advance_matches_the_reference(device):
    offset, num_slots, vocab, eos = 9, 64, 1000, 999
    tables, tokens = random_tables(device, num_slots=num_slots, offset=offset, vocab=vocab,
                                   seed=0)
    g = torch.Generator().manual_seed(1)
    rows = 300
    slots = torch.randint(0, num_slots, (rows,), generator=g)
    states = (slots + offset).int()
    states[:6] = torch.tensor([-1, 0, 1, 5, 8, offset + 1])
    picks = torch.randint(0, vocab, (rows,), generator=g)
    for r in range(rows):  # half the rows take one of their state's exceptions
        s = int(slots[r])
        if r % 2 and len(tokens[s]):
            picks[r] = tokens[s][r % len(tokens[s])]
    picks[7] = eos
    states, picks = states.to(device), picks.to(device)
    got = dfa_advance(states, picks, tables, eos=eos)
    want = dfa_advance_ref(states, picks, tables, eos=eos)
    assert torch.equal(got.cpu(), want.cpu())
    assert got[:5].tolist() == [-1, 0, 1, 5, 8] and int(got[7]) == 0
    hits = sum(1 for r in range(8, rows) if r % 2 and len(tokens[int(slots[r])]))
    assert hits > 50
