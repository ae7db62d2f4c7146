"""Torch references for paged attention (kernels/attention.py gives the semantics): what the
CPU runs and what the kernels are tested against."""
from __future__ import annotations

import torch


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] -> cache slots (slot = block * block_size + offset), slot_mapping [T]."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """cache [N, bs, Hkv, D], block_table [..., max_blocks] -> [..., num_tokens, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    kv = cache[block_table[..., :num_blocks].long()]  # [..., nb, bs, Hkv, D]
    kv = kv.flatten(-4, -3)  # [..., nb * bs, Hkv, D]
    return kv[..., :num_tokens, :, :]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], allowed [B, Lq, Lk] bool -> [B, Lq, Hq, D] fp32 (fp64 in)."""
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    acc_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    qg = q.to(acc_dtype).view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    kf = k.to(acc_dtype).permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, Lk, D]
    # a key no query may see can hold anything (an unwritten slot, a padding block): zero its
    # value, or a NaN there would survive the zero softmax weight (0 * NaN = NaN)
    seen = allowed.any(dim=1)[:, :, None, None]  # [B, Lk, 1, 1]
    vf = v.to(acc_dtype).masked_fill(~seen, 0).permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, Lk, D]
    scores = (qg @ kf.transpose(-1, -2)) * scale  # [B, Hkv, G, Lq, Lk]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf  # [B, Hkv, G, Lq, D]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, head_dim)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D] in q's dtype."""
    num_reqs = block_tables.shape[0]
    out = torch.empty_like(q)  # [T, Hq, D]
    lens = seq_lens.tolist()
    if max_query_len == 1 and q.shape[0] == num_reqs:
        # all-decode fast path: one gather of [B, max_len] and one masked attention
        max_len = max(lens) if lens else 0
        k = _gather_kv(k_cache, block_tables, max_len)  # [B, L, Hkv, D]
        v = _gather_kv(v_cache, block_tables, max_len)  # [B, L, Hkv, D]
        pos = torch.arange(max_len, device=q.device)
        allowed = (pos[None, :] < seq_lens.to(q.device)[:, None].long())[:, None, :]  # [B, 1, L]
        out.copy_(_attend(q[:, None], k, v, allowed, scale)[:, 0])
        return out
    starts = query_start_loc.tolist()
    for b in range(num_reqs):
        q_len, seq_len = starts[b + 1] - starts[b], lens[b]
        if q_len == 0:
            continue
        k = _gather_kv(k_cache, block_tables[b], seq_len)  # [L, Hkv, D]
        v = _gather_kv(v_cache, block_tables[b], seq_len)  # [L, Hkv, D]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [Lq]
        allowed = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [Lq, L]
        qb = q[starts[b]:starts[b + 1]]
        out[starts[b]:starts[b + 1]] = _attend(qb[None], k[None], v[None], allowed[None],
                                               scale)[0]
    return out
