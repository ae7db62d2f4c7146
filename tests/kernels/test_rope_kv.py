"""guided.kernels.rope_kv: the fused rotation + cache write against its torch reference, and the
reference against a rotation written out per element."""
from __future__ import annotations

import math

import pytest
import torch

from guided.kernels import rope_kv


def _tables(max_pos: int, head_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq.float())
    return freqs.cos().to(device), freqs.sin().to(device)


def _inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
            dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size = num_tokens // 4 + 3, 8
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    cos, sin = _tables(4096, head_dim, device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]  # distinct
    return {
        "qkv": torch.randn(num_tokens, width, generator=gen).to(dtype).to(device),
        "positions": torch.randint(0, 4096, (num_tokens,), generator=gen).to(device),
        "cos_table": cos, "sin_table": sin,
        "k_cache": torch.randn(cache_shape, generator=gen).to(dtype).to(device),
        "v_cache": torch.randn(cache_shape, generator=gen).to(dtype).to(device),
        "slot_mapping": slots.to(device), "num_heads": num_heads,
    }


def _run(fn, x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    q = fn(**x)
    return q, x["k_cache"], x["v_cache"]


def test_ref_writes_rotated_k_and_v_to_each_token_slot() -> None:
    x = _inputs(5, 2, 2, 64, torch.float32, "cpu")  # cache blocks of 8 slots
    _, k_cache, v_cache = _run(rope_kv.rope_write_kv_ref, x)
    k, v = x["qkv"][:, 128:].view(5, 2, 2, 64).unbind(1)  # (T, Hkv, D) each
    k = rope_kv.rope_ref(x["positions"], k, x["cos_table"], x["sin_table"])
    for i, s in enumerate(x["slot_mapping"].tolist()):
        assert torch.equal(k_cache[s // 8, s % 8], k[i])
        assert torch.equal(v_cache[s // 8, s % 8], v[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 2, 64), (9, 3, 64), (8, 1, 16), (6, 6, 32)])
def test_matches_ref(device: str, dtype: torch.dtype, shape: tuple) -> None:
    x = _inputs(13, *shape, dtype, device, seed=sum(shape))
    q, k_cache, v_cache = _run(rope_kv.rope_write_kv, x)
    q_ref, k_ref, v_ref = _run(rope_kv.rope_write_kv_ref, x)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k_cache, k_ref, **tol)
    assert torch.equal(v_cache, v_ref)  # a copy, bit for bit
    untouched = torch.ones(k_cache.shape[:2], dtype=torch.bool)
    untouched.view(-1)[x["slot_mapping"].cpu()] = False
    assert torch.equal(k_cache[untouched.to(device)], x["k_cache"][untouched.to(device)])


def test_ref_rotates_pairs_by_position() -> None:
    num_heads, head_dim = 2, 8
    x = _inputs(5, num_heads, 1, head_dim, torch.float64, "cpu", seed=3)
    x["cos_table"], x["sin_table"] = x["cos_table"].double(), x["sin_table"].double()
    q, k_cache, _ = _run(rope_kv.rope_write_kv_ref, x)
    half = head_dim // 2  # the tables are fp32: an angle at position p is off by ~p * 2**-24
    for t, pos in enumerate(x["positions"].tolist()):
        for h in range(num_heads):
            row = x["qkv"][t, h * head_dim:(h + 1) * head_dim].tolist()
            for i in range(half):
                angle = pos / 10000.0 ** (2 * i / head_dim)
                c, s = math.cos(angle), math.sin(angle)
                assert q[t, h, i].item() == pytest.approx(row[i] * c - row[i + half] * s, abs=2e-3)
                assert q[t, h, i + half].item() == pytest.approx(row[i + half] * c + row[i] * s,
                                                                 abs=2e-3)
        slot = x["slot_mapping"][t].item()
        k_row = x["qkv"][t, num_heads * head_dim:(num_heads + 1) * head_dim].tolist()
        assert k_cache.view(-1, 1, head_dim)[slot, 0, 0].item() == pytest.approx(
            k_row[0] * math.cos(pos) - k_row[half] * math.sin(pos), abs=2e-3)


def test_launcher_rejects_bad_inputs(device: str) -> None:
    x = _inputs(3, 4, 2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="qkv"):
        rope_kv.rope_write_kv(**{**x, "qkv": x["qkv"][:, 64:]})
    with pytest.raises(ValueError, match="v_cache"):
        rope_kv.rope_write_kv(**{**x, "v_cache": x["v_cache"].half()})


@pytest.mark.gpu
def test_gpu_realistic() -> None:
    x = _inputs(2048, 32, 8, 128, torch.bfloat16, "cuda", seed=7)
    q, k_cache, v_cache = _run(rope_kv.rope_write_kv, x)
    q_ref, k_ref, v_ref = _run(rope_kv.rope_write_kv_ref, x)
    torch.testing.assert_close(q, q_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k_cache, k_ref, atol=1e-2, rtol=1e-2)
    assert torch.equal(v_cache, v_ref)
