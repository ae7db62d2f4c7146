"""The next decode step's inputs from the last one's samples, in place, in one launch.

Inside a multi-step decode call (guided/worker/decode_steps.py) each step's inputs are the
previous step's: a row that moved on takes the token it sampled at the next position (its
sequence one longer, its new KV slot looked up in its block table); a row that sat the step out
(a late heavy row) keeps its token, position and slot, so its KV entry is written again. Built
from torch ops this was a dozen launches a step, on the host's critical path between a step's
masked sample and the next forward pass whenever the host fills masks until the forward ends
(the device waits for every one of them); this kernel is one, writing straight into the CUDA
graph's input buffers.

Per row b < B (rows past B, a graph's padding, are not touched)::

    if moves[b]:  input_ids[b] = sampled[b];  positions[b] += 1;  seq_lens[b] += 1
                  slot_mapping[b] = block_tables[b, positions[b] // bs] * bs + positions[b] % bs
"""
from __future__ import annotations

import torch

from guided.kernels.bitmask import _use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

_BLOCK = 256


def advance_decode_inputs_ref_(input_ids: torch.Tensor, positions: torch.Tensor,
                               seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                               block_tables: torch.Tensor, sampled: torch.Tensor,
                               moves: torch.Tensor | None, *, block_size: int) -> None:
    """The kernel's function in torch (see the module docstring)."""
    b = sampled.shape[0]
    step = (torch.ones(b, dtype=torch.int64, device=sampled.device) if moves is None
            else moves.to(torch.int64))
    input_ids[:b] = torch.where(step.bool(), sampled.to(input_ids.dtype), input_ids[:b])
    positions[:b] += step.to(positions.dtype)
    seq_lens[:b] += step.to(seq_lens.dtype)
    pos = positions[:b].long()
    block = block_tables[:b].gather(1, (pos // block_size).unsqueeze(1)).squeeze(1).long()
    slot_mapping[:b] = (block * block_size + pos % block_size).to(slot_mapping.dtype)


if triton is not None:
    @triton.jit(do_not_specialize=["num_rows", "table_stride", "block_size"])
    def _advance_kernel(ids_ptr, pos_ptr, lens_ptr, slots_ptr, tables_ptr, table_stride,
                        sampled_ptr, moves_ptr, num_rows, block_size,
                        HAS_MOVES: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = rows < num_rows
        go = valid
        if HAS_MOVES:
            go = valid & (tl.load(moves_ptr + rows, mask=valid, other=0) != 0)
        token = tl.load(sampled_ptr + rows, mask=go, other=0)
        pos = tl.load(pos_ptr + rows, mask=go, other=0) + 1
        length = tl.load(lens_ptr + rows, mask=go, other=0) + 1
        block = tl.load(tables_ptr + rows.to(tl.int64) * table_stride + pos // block_size,
                        mask=go, other=0).to(tl.int64)
        tl.store(ids_ptr + rows, token.to(ids_ptr.dtype.element_ty), mask=go)
        tl.store(pos_ptr + rows, pos, mask=go)
        tl.store(lens_ptr + rows, length, mask=go)
        tl.store(slots_ptr + rows, (block * block_size + pos % block_size).to(
            slots_ptr.dtype.element_ty), mask=go)


def advance_decode_inputs_(input_ids: torch.Tensor, positions: torch.Tensor,
                           seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                           block_tables: torch.Tensor, sampled: torch.Tensor,
                           moves: torch.Tensor | None, *, block_size: int) -> None:
    """In place over the first B = len(sampled) rows: input_ids, positions, slot_mapping int64
    (T >= B,), seq_lens int32 (>= B,), block_tables int32 (>= B, W) with contiguous rows,
    sampled [B] int64, moves [B] int (1: the row moved on, 0: it sat the step out) or None
    (every row moved on); all on one device."""
    num_rows = sampled.shape[0]
    for name, t in (("input_ids", input_ids), ("positions", positions),
                    ("slot_mapping", slot_mapping), ("seq_lens", seq_lens),
                    ("block_tables", block_tables)):
        if t.shape[0] < num_rows or t.device != sampled.device:
            raise ValueError(f"{name} must hold {num_rows} rows on {sampled.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    if moves is not None and moves.shape != (num_rows,):
        raise ValueError(f"moves must have shape [{num_rows}], got {tuple(moves.shape)}")
    if not _use_triton(sampled):
        advance_decode_inputs_ref_(input_ids, positions, seq_lens, slot_mapping, block_tables,
                                   sampled, moves, block_size=block_size)
        return
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if num_rows:
        _advance_kernel[(triton.cdiv(num_rows, _BLOCK),)](
            input_ids, positions, seq_lens, slot_mapping, block_tables, block_tables.stride(0),
            sampled, sampled if moves is None else moves, num_rows, block_size,
            HAS_MOVES=moves is not None, BLOCK=_BLOCK)
