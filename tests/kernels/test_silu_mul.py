"""guided.kernels.silu_mul: the kernel against its torch reference, and the reference against
silu written out per element."""
from __future__ import annotations

import math

import pytest
import torch

from guided.kernels import silu_mul


def _gate_up(num_tokens: int, width: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_tokens * 7919 + width)
    return (4 * torch.randn(num_tokens, 2 * width, generator=gen)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (5, 1000), (3, 1024), (2, 2500)])
def test_matches_ref(device: str, dtype: torch.dtype, shape: tuple) -> None:
    x = _gate_up(*shape, dtype, device)
    out = silu_mul.silu_mul(x)
    assert out.shape == (shape[0], shape[1]) and out.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, silu_mul.silu_mul_ref(x), **tol)


def test_reads_rows_by_their_stride(device: str) -> None:
    wide = _gate_up(4, 48, torch.float32, device)
    rows = wide[:, :64]  # [4, 64] with a row stride of 96: gate 32 columns, up 32
    torch.testing.assert_close(silu_mul.silu_mul(rows), silu_mul.silu_mul_ref(rows))


def test_no_rows(device: str) -> None:
    assert silu_mul.silu_mul(torch.empty(0, 16, device=device)).shape == (0, 8)


def test_ref_is_silu_of_gate_times_up() -> None:
    x = _gate_up(3, 5, torch.float64, "cpu")
    out = silu_mul.silu_mul_ref(x)
    for t in range(3):
        for i in range(5):
            g, u = x[t, i].item(), x[t, 5 + i].item()
            assert out[t, i].item() == pytest.approx(g / (1 + math.exp(-g)) * u, rel=1e-12)


def test_launcher_rejects_bad_inputs(device: str) -> None:
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul.silu_mul(torch.randn(3, 7, device=device))
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul.silu_mul(torch.randn(8, 4, device=device).t())


@pytest.mark.gpu
def test_gpu_llama_3_8b_prefill() -> None:
    x = _gate_up(2048, 14336, torch.bfloat16, "cuda")
    torch.testing.assert_close(silu_mul.silu_mul(x), silu_mul.silu_mul_ref(x), atol=2e-2,
                               rtol=2e-2)
