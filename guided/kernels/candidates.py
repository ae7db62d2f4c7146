"""A row's best K tokens in its Gumbel-max order: the candidates of a row sampled unmasked.

The sampler draws token_b = argmax_j (logit_bj + T_b * g_bj) on seeded noise g (bitmask.py).
Restricted to any allowed set S, the argmax over S is the first token of S in the descending
order of those scores: the exact sample of the masked distribution. So for a row sampled without
its grammar mask (guided/masks/lazy.py), the host can take the first of its K best tokens
the grammar accepts and need not run the position again; only where all K lie outside does it
(see the engine's update). Greedy rows (T <= 1e-5) order by the logits alone.

The kernel scores the rows as the fused sample kernel does (same hash, same fast log2), so a
row's first candidate is the token that kernel sampled; each program keeps the K best of one
block of the vocabulary, and a top-k over the blocks' picks orders the row.
"""
from __future__ import annotations

import torch

from guided.kernels import bitmask as _bitmask
from guided.kernels.bitmask import GREEDY_EPS, gumbel_noise_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

_BLOCK = 2048


def sample_candidates_ref(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                          seeds: torch.Tensor, *, k: int, vocab_size: int) -> torch.Tensor:
    """[R, k] int64: for logits row rows[r], its k best tokens by Gumbel-max score, best
    first. temperature / seeds are per logits row, like the sampler's."""
    num_cols = min(vocab_size, logits.shape[1])
    scores = logits[rows, :num_cols].float()
    temp = temperature[rows].to(torch.float32)
    noise = gumbel_noise_ref(seeds[rows].to(logits.device), num_cols)
    scores = torch.where((temp > GREEDY_EPS)[:, None], scores + temp[:, None] * noise, scores)
    return _best_first(scores, k)


def scores_candidates(scores: torch.Tensor, rows: torch.Tensor, *, k: int) -> torch.Tensor:
    """The same from scores already noised and filtered (the sampler's torch path)."""
    return _best_first(scores[rows], k)


def _best_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the columns of the k best scores; equal scores lowest column first, as the
    sampler's argmax breaks ties (greedy rows on bf16 logits tie often)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


if triton is not None:
    from guided.kernels.bitmask import _fmix32_tl

    @triton.jit
    def _candidates_kernel(logits_ptr, logits_row_stride, rows_ptr, temperature_ptr, seeds_ptr,
                           part_val_ptr, part_idx_ptr, num_cols, num_blocks,
                           K: tl.constexpr, BLOCK: tl.constexpr):
        """One program = one candidate row x one block of the vocabulary: its K best."""
        r = tl.program_id(0)
        block = tl.program_id(1)
        row = tl.load(rows_ptr + r)
        temp = tl.load(temperature_ptr + row)
        seed = tl.load(seeds_ptr + row)
        lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        key = _fmix32_tl(lo ^ _fmix32_tl(hi ^ 0x9E3779B9))
        cols = block * BLOCK + tl.arange(0, BLOCK)
        in_range = cols < num_cols
        x = tl.load(logits_ptr + row.to(tl.int64) * logits_row_stride + cols, mask=in_range,
                    other=float("-inf")).to(tl.float32)
        if temp > 1e-5:
            h = _fmix32_tl(cols.to(tl.uint32) * 0x9E3779B9 + key)
            u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
            e = -0.6931471805599453 * tl.log2(u)
            x = x + temp * (-0.6931471805599453 * tl.log2(e))
        x = tl.where(in_range, x, float("-inf"))
        out = (r * num_blocks + block) * K
        for i in tl.static_range(K):
            top = tl.max(x, axis=0)
            idx = tl.min(tl.where(x == top, cols, 2147483647), axis=0)
            tl.store(part_val_ptr + out + i, top)
            tl.store(part_idx_ptr + out + i, idx)
            x = tl.where(cols == idx, float("-inf"), x)


def sample_candidates(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                      seeds: torch.Tensor, *, k: int, vocab_size: int) -> torch.Tensor:
    """sample_candidates_ref, on the GPU (or in Triton's interpreter) where the kernels run."""
    if not _bitmask._use_triton(logits) or logits.stride(1) != 1:
        return sample_candidates_ref(logits, rows, temperature, seeds, k=k,
                                     vocab_size=vocab_size)
    num_cols = min(vocab_size, logits.shape[1])
    k = min(k, num_cols)
    num_rows = rows.shape[0]
    if num_rows == 0:
        return torch.empty(0, k, dtype=torch.int64, device=logits.device)
    num_blocks = triton.cdiv(num_cols, _BLOCK)
    part_val = torch.empty(num_rows, num_blocks * k, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(num_rows, num_blocks * k, dtype=torch.int32, device=logits.device)
    _candidates_kernel[(num_rows, num_blocks)](
        logits, logits.stride(0), rows, temperature, seeds, part_val, part_idx,
        num_cols, num_blocks, K=k, BLOCK=_BLOCK, num_warps=8)
    # a stable sort of the picks keeps equal scores in the order written, which is by column:
    # blocks in column order, and a block's equal scores picked lowest column first
    return torch.gather(part_idx, 1, _best_first(part_val, k)).to(torch.int64)
