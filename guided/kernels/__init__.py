"""Triton kernels, each beside its torch reference (<op>_ref), which the CPU runs."""
from __future__ import annotations

import os

import torch

try:  # CPU-only installs may lack triton: the references still work
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_triton(t: torch.Tensor) -> bool:
    """The kernel on a GPU or in Triton's interpreter (TRITON_INTERPRET=1); else the reference."""
    if t.device.type == "cpu":
        return triton is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"
    if triton is None:
        raise RuntimeError(f"triton is not installed: the kernels need it on {t.device}")
    return True
