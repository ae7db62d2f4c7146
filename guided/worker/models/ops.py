"""The model's elementwise pieces as pure functions. On the GPU they are handed to
torch.compile, which fuses each into one Triton kernel (a decode step runs ~10 fewer tiny
kernels per layer); on the CPU, and as the reference, they run as written."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add fused with the next norm."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rope(positions: torch.Tensor, x: torch.Tensor, cos_table: torch.Tensor,
         sin_table: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated in HF's half-split layout at positions (T,)."""
    cos = cos_table[positions].unsqueeze(1)  # (T, 1, D/2)
    sin = sin_table[positions].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


EAGER = SimpleNamespace(rms_norm=rms_norm, add_rms_norm=add_rms_norm, rope=rope,
                        silu_mul=silu_mul)


def compiled_ops() -> SimpleNamespace:
    def c(fn):
        return torch.compile(fn, dynamic=True, fullgraph=True)

    return SimpleNamespace(rms_norm=c(rms_norm), add_rms_norm=c(add_rms_norm), rope=c(rope),
                           silu_mul=c(silu_mul))
