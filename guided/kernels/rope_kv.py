"""Rotary embedding of q and k, and k, v written to their cache slots, in one launch per layer.

Read straight out of the qkv projection's output ``[T, (Hq + 2 * Hkv) * D]``: q rotated into a
new ``[T, Hq, D]``, k rotated and v as it is into ``k_cache``, ``v_cache`` ``[num_blocks,
block_size, Hkv, D]`` at ``slot_mapping[t]`` (= block * block_size + offset): one launch where
torch ops take four, each in decode too small to be more than its launch. Rotation in HF's
half-split layout, in fp32."""
from __future__ import annotations

import torch

from guided.kernels import tl, triton, use_triton


def rope_ref(positions: torch.Tensor, x: torch.Tensor, cos_table: torch.Tensor,
             sin_table: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated at positions [T]; cos/sin tables [max_pos, D/2] fp32."""
    cos = cos_table[positions].unsqueeze(1)  # [T, 1, D/2]
    sin = sin_table[positions].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_write_kv_ref(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                      sin_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, num_heads: int) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D]; k and v into the caches' slots."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q = rope_ref(positions, q.view(num_tokens, num_heads, head_dim), cos_table, sin_table)
    k = rope_ref(positions, k.view(num_tokens, num_kv_heads, head_dim), cos_table, sin_table)
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k  # slot: block * block_size + offset
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v.view(k.shape)
    return q


if triton is not None:

    @triton.jit
    def _rotate(x_ptr, heads, num_heads, cos, sin, half, HALF: tl.constexpr):
        """Rows heads [H] of HEAD_DIM = 2 * HALF at x_ptr + head * 2 * HALF, rotated: fp32."""
        mask = (heads < num_heads)[:, None] & (half < HALF)[None, :]
        first = x_ptr + heads[:, None] * (2 * HALF) + half[None, :]
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin, mask

    @triton.jit
    def _rope_write_kv_kernel(
        qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_qkv, stride_q, stride_slot, stride_cos, num_heads, num_kv_heads,
        HALF: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    ):
        """Program t: token t's q heads rotated to q, its k heads rotated and v heads copied to
        its cache slot."""
        t = tl.program_id(0).to(tl.int64)
        half = tl.arange(0, HALF)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + half)[None, :]  # [1, HALF]
        sin = tl.load(sin_ptr + pos * stride_cos + half)[None, :]
        row = qkv_ptr + t * stride_qkv
        head_dim = 2 * HALF

        hq = tl.arange(0, HQ_PAD)
        a, b, mask = _rotate(row, hq, num_heads, cos, sin, half, HALF)
        out = q_ptr + t * stride_q + hq[:, None] * head_dim + half[None, :]
        tl.store(out, a.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, b.to(q_ptr.dtype.element_ty), mask=mask)

        slot = tl.load(slot_ptr + t).to(tl.int64)
        hkv = tl.arange(0, HKV_PAD)
        k_row = row + num_heads * head_dim
        a, b, mask = _rotate(k_row, hkv, num_kv_heads, cos, sin, half, HALF)
        out = k_cache_ptr + slot * stride_slot + hkv[:, None] * head_dim + half[None, :]
        tl.store(out, a.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, b.to(k_cache_ptr.dtype.element_ty), mask=mask)

        d = tl.arange(0, 2 * HALF)
        v_mask = (hkv < num_kv_heads)[:, None] & (d < head_dim)[None, :]
        v = tl.load(k_row + num_kv_heads * head_dim + hkv[:, None] * head_dim + d[None, :],
                    mask=v_mask, other=0.0)
        tl.store(v_cache_ptr + slot * stride_slot + hkv[:, None] * head_dim + d[None, :], v,
                 mask=v_mask)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                  sin_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, num_heads: int) -> torch.Tensor:
    """As rope_write_kv_ref, in one kernel where Triton runs (the reference elsewhere)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {width}] with a contiguous last dim, got "
                         f"{tuple(qkv.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous() or cache.dtype != qkv.dtype:
            raise ValueError(f"{name} must be contiguous {qkv.dtype}, got {cache.dtype}")
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if not use_triton(qkv):
        return rope_write_kv_ref(qkv, positions, cos_table, sin_table, k_cache, v_cache,
                                 slot_mapping, num_heads)
    num_tokens = qkv.shape[0]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    _rope_write_kv_kernel[(num_tokens,)](
        qkv, positions, cos_table, sin_table, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), q.stride(0), k_cache.stride(1), cos_table.stride(0), num_heads,
        num_kv_heads, HALF=head_dim // 2, HQ_PAD=triton.next_power_of_2(num_heads),
        HKV_PAD=triton.next_power_of_2(num_kv_heads), num_warps=4,
    )
    return q
