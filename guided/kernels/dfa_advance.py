"""One step of token DFAs on the device: each row's state moves along the token it sampled.

A row's state is the index of its mask row in the device's row table (guided/worker/
device_dfa.py): DFA states sit at `offset` and above (offset + their pool slot), so the state
is also the row the sampler reads. Below `offset` lie rows the step does not move (0: allows
every token, for a row that ended; 1..: rows the host filled; -1: unconstrained). A DFA row
that samples EOS has ended and moves to 0.

Tables, per pool slot: the next state most tokens go to, where that state's exceptions start
and how many there are; the exceptions (token, next state) sorted by token within a state,
found by binary search (fsm/dfa_tables.py). Next states are stored as rows (offset added).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from guided.kernels.bitmask import _use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

_BLOCK = 128


@dataclass(frozen=True)
class AdvanceTables:
    """The device's transition tables (int32; the first three indexed by pool slot)."""
    offset: int
    default_next: torch.Tensor
    exc_start: torch.Tensor
    exc_count: torch.Tensor
    exc_token: torch.Tensor
    exc_next: torch.Tensor
    search_steps: int  # binary-search steps enough for the longest exception list


def dfa_advance_ref(states: torch.Tensor, tokens: torch.Tensor, tables: AdvanceTables, *,
                    eos: int) -> torch.Tensor:
    """The kernel's function in torch: [B] int32 states after [B] tokens."""
    t = tables
    tokens = tokens.to(torch.int32)
    moves = states >= t.offset
    slot = torch.where(moves, states - t.offset, 0).long()
    lo = t.exc_start[slot].long()
    end = lo + t.exc_count[slot].long()
    hi = end.clone()
    last = max(t.exc_token.numel() - 1, 0)
    for _ in range(t.search_steps):
        active = lo < hi
        mid = (lo + hi) // 2
        go = (t.exc_token[mid.clamp(max=last)] < tokens) if t.exc_token.numel() else active
        lo = torch.where(active & go, mid + 1, lo)
        hi = torch.where(active & ~go, mid, hi)
    if t.exc_token.numel():
        at = lo.clamp(max=last)
        found = (lo < end) & (t.exc_token[at] == tokens)
        nxt = torch.where(found, t.exc_next[at], t.default_next[slot])
    else:
        nxt = t.default_next[slot]
    nxt = torch.where(tokens == eos, 0, nxt)
    return torch.where(moves, nxt, states).to(torch.int32)


if triton is not None:
    # not specialized on the batch size, the tables' offset or their search depth, which
    # change mid-run: a new variant would compile (~0.1 s) inside a decode step
    @triton.jit(do_not_specialize=["num_rows", "eos", "offset", "search_steps"])
    def _dfa_advance_kernel(states_ptr, tokens_ptr, out_ptr, num_rows, eos, offset,
                            default_ptr, start_ptr, count_ptr, exc_token_ptr, exc_next_ptr,
                            search_steps, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = rows < num_rows
        state = tl.load(states_ptr + rows, mask=valid, other=-1)
        token = tl.load(tokens_ptr + rows, mask=valid, other=0).to(tl.int32)
        moves = valid & (state >= offset)
        slot = tl.where(moves, state - offset, 0)
        lo = tl.load(start_ptr + slot, mask=moves, other=0)
        end = lo + tl.load(count_ptr + slot, mask=moves, other=0)
        hi = end
        for _ in range(search_steps):
            active = lo < hi
            mid = (lo + hi) // 2
            probe = tl.load(exc_token_ptr + mid, mask=moves & active, other=0)
            go = probe < token
            lo = tl.where(active & go, mid + 1, lo)
            hi = tl.where(active & (probe >= token), mid, hi)
        hit = moves & (lo < end)
        found = hit & (tl.load(exc_token_ptr + lo, mask=hit, other=-1) == token)
        nxt = tl.where(found, tl.load(exc_next_ptr + lo, mask=found, other=0),
                       tl.load(default_ptr + slot, mask=moves, other=0))
        nxt = tl.where(token == eos, 0, nxt)
        tl.store(out_ptr + rows, tl.where(moves, nxt, state), mask=valid)


def dfa_advance(states: torch.Tensor, tokens: torch.Tensor, tables: AdvanceTables, *,
                eos: int) -> torch.Tensor:
    """states [B] int32 (see the module docstring), tokens [B] (any int dtype) on the same
    device: the states after each row takes its token."""
    if not _use_triton(states) or tables.exc_token.numel() == 0:
        return dfa_advance_ref(states, tokens, tables, eos=eos)
    out = torch.empty_like(states)
    num_rows = states.shape[0]
    if num_rows:
        _dfa_advance_kernel[(triton.cdiv(num_rows, _BLOCK),)](
            states, tokens, out, num_rows, eos, tables.offset, tables.default_next,
            tables.exc_start, tables.exc_count, tables.exc_token, tables.exc_next,
            tables.search_steps, BLOCK=_BLOCK)
    return out
