"""The MLP's activation: silu(gate) * up, read from the gate_up projection's ``[T, 2W]`` output
(gate the first W columns, up the last W) into a new ``[T, W]``. One pass over memory, each
program one row's BLOCK columns: torch.compile's dynamic-shape kernel for it was memory-bound far
below the GPU's bandwidth (benchmarks/RESULTS.md, "The forward pass")."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from guided.kernels import tl, triton, use_triton

BLOCK = 1024


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        gate_ptr = x_ptr + row * stride_x + cols
        gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptr + width, mask=mask, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """As silu_mul_ref, in one kernel where Triton runs (the reference elsewhere)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2W] with a contiguous last dim, got "
                         f"{tuple(gate_up.shape)}")
    if not use_triton(gate_up):
        return silu_mul_ref(gate_up)
    num_tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        _silu_mul_kernel[(num_tokens, triton.cdiv(width, BLOCK))](
            gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out
