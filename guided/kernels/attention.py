"""Paged attention over a block table: varlen prefill / verification and split-K decode.

Cache layout, per layer: ``k_cache``, ``v_cache`` ``[num_blocks, block_size, num_kv_heads, D]``.
Token t of request b lives at ``(block_tables[b, t // block_size], t % block_size)``. Semantics::

    for each request b, with q_len = query_start_loc[b+1] - query_start_loc[b], ctx = seq_lens[b] - q_len:
      for query token i < q_len (row query_start_loc[b] + i, at position ctx + i), head h:
        kvh    = h // (Hq // Hkv)                                   # GQA
        s_t    = scale * <q[i, h], K_b[t, kvh]>   for t <= ctx + i  # causal with the offset
        out    = sum_t softmax(s)_t * V_b[t, kvh]                    # softmax in fp32

The split-K kernel (short queries) splits each context across programs and a second launch
merges the partial (max, sum, acc); the prefill kernel is flash attention over the block table.
"""
from __future__ import annotations

import torch

from guided.kernels import FLOAT_DTYPES, tl, triton, use_triton


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


if triton is not None:

    @triton.jit
    def _load_kv_tile(cache_ptr, bt_row_ptr, t, t_mask, kv_head, d, stride_b, stride_t, stride_h,
                      BLOCK_SIZE: tl.constexpr):
        block = tl.load(bt_row_ptr + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        ptrs = (cache_ptr + block[:, None] * stride_b + (t % BLOCK_SIZE)[:, None] * stride_t
                + kv_head * stride_h + d[None, :])
        return tl.load(ptrs, mask=t_mask[:, None], other=0.0)

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        scale, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
        stride_vh, stride_bt, stride_ot, stride_oh, part_len, num_splits, num_tiles,
        GROUP: tl.constexpr, QTILE: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
        PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ):
        """Program (request b and its query tile, kv head, split): the tile's QTILE query tokens
        times the GROUP query heads of that kv head, as the rows of one dot, over kv positions
        [split * part_len, (split + 1) * part_len), online softmax: each K/V tile is read once."""
        b = tl.program_id(0) // num_tiles
        tile = tl.program_id(0) % num_tiles
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        if tile * QTILE >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + b)
        ctx_len = seq_len - q_len
        r = tl.arange(0, ROWS)
        i = tile * QTILE + r // GROUP  # query token of the row
        valid = (r < QTILE * GROUP) & (i < q_len)
        tokens = (q_start + i).to(tl.int64)
        heads = kv_head * GROUP + r % GROUP
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=valid[:, None], other=0.0).to(DOT_DTYPE)  # [R, D]
        q_pos = ctx_len + i
        start = split * part_len
        end = tl.minimum(tl.minimum(start + part_len, seq_len), ctx_len + (tile + 1) * QTILE)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        for t0 in range(start, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_mask = t < end
            k = _load_kv_tile(k_ptr, bt_row, t, t_mask, kv_head, d, stride_kb, stride_kt,
                              stride_kh, BLOCK_SIZE)  # [N, D]
            v = _load_kv_tile(v_ptr, bt_row, t, t_mask, kv_head, d, stride_vb, stride_vt,
                              stride_vh, BLOCK_SIZE)  # [N, D]
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * scale  # [R, N]
            s = tl.where((t[None, :] <= q_pos[:, None]) & t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # a split may hold no position a row may see (a draft's own future): keep it 0, not NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                                input_precision=PRECISION)
            m_i = m_new
        if SINGLE_SPLIT:
            o = acc / l_i[:, None]
            tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
                     + d[None, :], o.to(out_ptr.dtype.element_ty), mask=valid[:, None])
        else:
            row = (tokens * tl.num_programs(1) * GROUP + heads) * num_splits + split
            tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc,
                     mask=valid[:, None])
            tl.store(part_ml_ptr + row * 2, m_i, mask=valid)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=valid)

    @triton.jit
    def _decode_reduce_kernel(
        part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, num_splits,
        HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):
        """Program (query token, query head h): merge the partial (max, sum, acc) of all splits."""
        token = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM)
        s_mask = s < num_splits
        row = (token * tl.num_programs(1) + h) * num_splits + s
        m_s = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
        acc_s = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
                        mask=s_mask[:, None], other=0.0)  # [S, D]
        m = tl.max(m_s, axis=0)  # split 0 always holds position 0, so m is finite
        w = tl.exp(m_s - m)  # splits a row sees nothing of: exp(-inf) = 0
        o = tl.sum(w[:, None] * acc_s, axis=0) / tl.sum(w * l_s, axis=0)
        tl.store(out_ptr + token * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _prefill_tile(q, acc, m_i, l_i, t0, bt_row, k_ptr, v_ptr, kv_head, d, q_pos, kv_end,
                      qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                      stride_vh, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      MASKED: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr):
        """One K/V tile into the online softmax (base 2); MASKED: the causal diagonal or the
        context's end cross the tile."""
        t = t0 + tl.arange(0, BLOCK_N)
        t_mask = t < kv_end
        k = _load_kv_tile(k_ptr, bt_row, t, t_mask, kv_head, d, stride_kb, stride_kt,
                          stride_kh, BLOCK_SIZE)  # [N, D]
        v = _load_kv_tile(v_ptr, bt_row, t, t_mask, kv_head, d, stride_vb, stride_vt,
                          stride_vh, BLOCK_SIZE)  # [N, D]
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale  # [M, N]
        if MASKED:
            s = tl.where((t[None, :] <= q_pos[:, None]) & t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: position 0 is in tile 0
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                            input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
        scale, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
        stride_vh, stride_bt, stride_ot, stride_oh, num_reqs,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
    ):
        """Program (query tile, query head h): causal flash attention with offset. Request b's
        tiles start at program qsl[b] // BLOCK_M + b: a grid of num_tokens // BLOCK_M + num_reqs
        (few programs that exit, even in a CUDA graph). Tiles every row sees whole run unmasked."""
        tile = tl.program_id(0)
        h = tl.program_id(1)
        lo = 0  # b: the last request whose first tile is at or before this one
        hi = num_reqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(qsl_ptr + mid) // BLOCK_M + mid <= tile:
                lo = mid
            else:
                hi = mid - 1
        b = lo
        q_start = tl.load(qsl_ptr + b)
        m_blk = tile - (q_start // BLOCK_M + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        if m_blk * BLOCK_M >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + b)
        ctx_len = seq_len - q_len
        i = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        i_mask = i < q_len
        d = tl.arange(0, HEAD_DIM)
        rows = (q_start + i).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=i_mask[:, None], other=0.0).to(DOT_DTYPE)  # [M, D]
        q_pos = ctx_len + i  # [M]
        qk_scale = scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
        kv_head = h // GROUP
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        kv_end = tl.minimum(seq_len, ctx_len + (m_blk + 1) * BLOCK_M)  # causal upper bound
        full_end = (ctx_len + m_blk * BLOCK_M + 1) // BLOCK_N * BLOCK_N  # seen by every row
        for t0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(
                q, acc, m_i, l_i, t0, bt_row, k_ptr, v_ptr, kv_head, d, q_pos, kv_end,
                qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                BLOCK_SIZE, BLOCK_N, False, PRECISION, DOT_DTYPE)
        for t0 in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(
                q, acc, m_i, l_i, t0, bt_row, k_ptr, v_ptr, kv_head, d, q_pos, kv_end,
                qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                BLOCK_SIZE, BLOCK_N, True, PRECISION, DOT_DTYPE)
        o = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=i_mask[:, None])


# longest queries up to this (decode, verification, short chunks) run on the split-K kernel,
# which reads each K/V tile once for all of a request's query tokens; longer ones on flash
MAX_SHORT_QUERY_LEN = 32
MAX_DECODE_ROWS = 64  # query tokens x query heads in one program of the split-K kernel
# the flash kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit and fp32 inputs
PREFILL_TILES = {False: (64, 64, 4, 3), True: (32, 32, 4, 3)}


_TL_DTYPES = ({torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
              if triton is not None else {})


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, query_start_loc: torch.Tensor,
           seq_lens: torch.Tensor) -> None:
    if q.dim() != 3 or q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be [T, Hq, D] float32/bfloat16/float16, got {tuple(q.shape)} "
                         f"{q.dtype}")
    head_dim = q.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.dtype != q.dtype or cache.shape[3] != head_dim:
            raise ValueError(f"{name} must be [num_blocks, block_size, Hkv, {head_dim}] "
                             f"{q.dtype}, got {tuple(cache.shape)} {cache.dtype}")
        if cache.stride(3) != 1 or cache.device != q.device:
            raise ValueError(f"{name} must have a contiguous last dim and live on {q.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_q_heads {q.shape[1]} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if q.stride(2) != 1:
        raise ValueError("q must have a contiguous last dim")
    num_reqs = block_tables.shape[0]
    for name, t, shape in (("block_tables", block_tables, None),
                           ("query_start_loc", query_start_loc, (num_reqs + 1,)),
                           ("seq_lens", seq_lens, (num_reqs,))):
        if t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(f"{name} must be int32 on {q.device}, got {t.dtype} on {t.device}")
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be [B, max_blocks] with contiguous rows")


def _num_decode_splits(num_programs: int, max_seq_len: int, block_n: int,
                       device: torch.device) -> int:
    num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 1)
    want = -(-2 * num_sms // max(num_programs, 1))
    return max(1, min(want, -(-max_seq_len // (4 * block_n))))


def paged_attention(
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
    num_splits: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] over the paged cache -> out [T, Hq, D]. max_seq_len bounds seq_lens (None:
    the block table's width); num_splits forces the split-K partitions (None: fill the GPU)."""
    _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    if not use_triton(q):
        return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                   scale=scale, max_query_len=max_query_len)
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = block_tables.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)  # [T, Hq, D]
    if num_reqs == 0 or num_tokens == 0:
        return out
    # The interpreter's tl.dot mishandles 16-bit floats: there, dot in fp32 (exact products).
    interpret = q.device.type == "cpu"
    precision = "ieee" if q.dtype == torch.float32 or interpret else "tf32"
    dot_dtype = _TL_DTYPES[torch.float32 if interpret else q.dtype]
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    common = (scale, q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
              block_tables.stride(0))
    if max_query_len <= MAX_SHORT_QUERY_LEN:
        block_n = 64
        # rows of one dot: a tile's query tokens times a kv head's query heads
        qtile = min(max_query_len, max(1, MAX_DECODE_ROWS // group))
        rows = max(16, triton.next_power_of_2(qtile * group))
        num_tiles = triton.cdiv(max_query_len, qtile)
        if num_splits is None:
            num_splits = _num_decode_splits(num_reqs * num_tiles * num_kv_heads, max_seq_len,
                                            block_n, q.device)
        part_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
        num_splits = max(1, triton.cdiv(max_seq_len, part_len))
        single = num_splits == 1
        part_acc = torch.empty(num_tokens * num_heads * num_splits * (0 if single else head_dim),
                               dtype=torch.float32, device=q.device)  # [T, Hq, S, D]
        part_ml = torch.empty(num_tokens * num_heads * num_splits * (0 if single else 2),
                              dtype=torch.float32, device=q.device)  # [T, Hq, S, 2]
        _decode_kernel[(num_reqs * num_tiles, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, part_acc, part_ml,
            *common, out.stride(0), out.stride(1), part_len, num_splits, num_tiles,
            GROUP=group, QTILE=qtile, ROWS=rows, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            BLOCK_N=block_n, SINGLE_SPLIT=single, PRECISION=precision, DOT_DTYPE=dot_dtype,
            num_warps=4,
        )
        if not single:
            _decode_reduce_kernel[(num_tokens, num_heads)](
                part_acc, part_ml, out, out.stride(0), out.stride(1), num_splits,
                HEAD_DIM=head_dim, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
                num_warps=4,
            )
        return out
    block_m, block_n, warps, stages = PREFILL_TILES[q.dtype == torch.float32]
    _prefill_kernel[(num_tokens // block_m + num_reqs, num_heads)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        *common, out.stride(0), out.stride(1), num_reqs,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION=precision, DOT_DTYPE=dot_dtype, num_warps=warps, num_stages=stages,
    )
    return out
