"""Grammar bitmask on the logits: fused mask + temperature + Gumbel-max sample, and in-place mask.

Bitmask layout (as xgrammar): int32 ``[num_mask_rows, ceil(vocab_size / 32)]``; bit ``j`` of word
``w`` set means token ``32 * w + j`` is allowed. Columns ``>= vocab_size`` (padded embeddings) are
never allowed, on constrained and unconstrained rows alike.

Sampling is Gumbel-max with counter-based noise, so a (seed, column) pair always draws the same
noise, on the GPU and in the torch reference, with no device sync and no generator state::

    key_b    = fmix32(lo32(seed_b) ^ fmix32(hi32(seed_b) ^ 0x9E3779B9))
    h_bj     = fmix32(j * 0x9E3779B9 + key_b)            # uint32 arithmetic, wrapping
    u_bj     = ((h_bj >> 9) + 0.5) * 2**-23                # exactly representable, in (0, 1)
    g_bj     = -LN2 * log2(-LN2 * log2(u_bj))              # standard Gumbel, -ln(-ln u)
    score_bj = logit_bj + T_b * g_bj   if T_b > 1e-5        # = T_b * (logit/T_b + g): same argmax
               logit_bj                otherwise            # greedy
    token_b  = argmax_j over allowed j of score_bj, ties -> lowest j

A row with no allowed finite score returns token 0. The hash is bit-identical between torch and
Triton; ``log2`` may differ by an ulp, which can only flip a near-tie within ~1e-6.
"""
from __future__ import annotations

import torch

from guided.kernels import FLOAT_DTYPES, tl, triton, use_triton

GREEDY_EPS = 1e-5
_GOLDEN = 0x9E3779B9
_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35
_MASK32 = 0xFFFFFFFF
_LN2 = 0.6931471805599453


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without int64 overflow (c split in halves)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 lanes holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 13)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def gumbel_noise_ref(seeds: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Counter-based Gumbel noise g(seed_b, j): [B] int64 seeds -> [B, num_cols] float32."""
    seeds = seeds.to(torch.int64)
    keys = _fmix32((seeds & _MASK32) ^ _fmix32(((seeds >> 32) & _MASK32) ^ _GOLDEN))  # [B]
    cols = torch.arange(num_cols, dtype=torch.int64, device=seeds.device)  # [V]
    h = _fmix32((_mul32(cols, _GOLDEN)[None, :] + keys[:, None]) & _MASK32)  # [B, V]
    u = ((h >> 9).to(torch.float32) + 0.5) * (2.0**-23)  # [B, V] in (0, 1)
    e = -_LN2 * torch.log2(u)  # [B, V] standard exponential, as the kernel computes it
    return -_LN2 * torch.log2(e)


def allowed_mask_ref(
    bitmask: torch.Tensor | None,
    mask_rows: torch.Tensor | None,
    num_rows: int,
    num_cols: int,
    *,
    vocab_size: int,
) -> torch.Tensor:
    """[num_rows, num_cols] bool."""
    device = bitmask.device if bitmask is not None else "cpu"
    cols = torch.arange(num_cols, device=device)
    in_vocab = (cols < vocab_size)[None, :].expand(num_rows, num_cols)  # [B, V]
    if bitmask is None:
        return in_vocab.clone()
    mask_rows = mask_rows.to(device=device, dtype=torch.int64)
    words = bitmask[mask_rows.clamp(min=0)]  # [B, W] int32
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    bits = ((words[:, :, None] >> shifts) & 1).reshape(num_rows, -1).bool()  # [B, 32W]
    n = min(bits.shape[1], num_cols)
    allowed = torch.zeros(num_rows, num_cols, dtype=torch.bool, device=device)
    allowed[:, :n] = bits[:, :n]
    allowed = torch.where((mask_rows < 0)[:, None], True, allowed)
    return allowed & in_vocab


def masked_sample_ref(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    mask_rows: torch.Tensor | None,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    *,
    vocab_size: int,
) -> torch.Tensor:
    num_rows, num_cols = logits.shape
    allowed = allowed_mask_ref(bitmask, mask_rows, num_rows, num_cols, vocab_size=vocab_size)
    scores = logits.float()  # [B, V]
    temperature = temperature.to(device=logits.device, dtype=torch.float32)
    sample = temperature > GREEDY_EPS  # [B]
    if bool(sample.any()):
        noise = gumbel_noise_ref(seeds.to(logits.device), num_cols)  # [B, V]
        noisy = scores + temperature[:, None] * noise
        scores = torch.where(sample[:, None], noisy, scores)
    scores = scores.masked_fill(~allowed.to(logits.device), float("-inf"))
    return torch.argmax(scores, dim=-1)  # first maximum on ties; all -inf -> 0


def apply_token_bitmask_ref_(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    mask_rows: torch.Tensor,
    *,
    vocab_size: int,
) -> None:
    num_rows, num_cols = logits.shape
    allowed = allowed_mask_ref(bitmask, mask_rows, num_rows, num_cols, vocab_size=vocab_size)
    logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


if triton is not None:

    @triton.jit
    def _fmix32_tl(x):
        x = x ^ (x >> 16)
        x = x * 0x85EBCA6B
        x = x ^ (x >> 13)
        x = x * 0xC2B2AE35
        return x ^ (x >> 16)

    # num_splits follows the batch size: specialized on it, a batch size first seen mid-run
    # would compile a variant inside a decode step
    @triton.jit(do_not_specialize=["num_splits"])
    def _masked_sample_kernel(
        logits_ptr, logits_row_stride, bitmask_ptr, bitmask_row_stride, mask_rows_ptr,
        temperature_ptr, seeds_ptr, part_val_ptr, part_idx_ptr, out_ptr,
        num_cols, cols_per_split, num_splits,
        HAS_BITMASK: tl.constexpr, BLOCK: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    ):
        """One program = one row x one contiguous vocab chunk; running per-lane (max, argmax)."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        start = split * cols_per_split
        end = tl.minimum(start + cols_per_split, num_cols)
        temp = tl.load(temperature_ptr + row)
        seed = tl.load(seeds_ptr + row)
        lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        key = _fmix32_tl(lo ^ _fmix32_tl(hi ^ 0x9E3779B9))
        mask_row = -1
        if HAS_BITMASK:
            mask_row = tl.load(mask_rows_ptr + row).to(tl.int64)
        row_ptr = logits_ptr + row.to(tl.int64) * logits_row_stride
        offs = tl.arange(0, BLOCK)
        best_val = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = start + offs
        for s in range(start, end, BLOCK):
            cols = s + offs
            in_range = cols < end
            x = tl.load(row_ptr + cols, mask=in_range, other=float("-inf")).to(tl.float32)
            if temp > 1e-5:
                h = _fmix32_tl(cols.to(tl.uint32) * 0x9E3779B9 + key)
                u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
                # g = -ln(-ln u) via log2 (one fast MUFU op each): ln x = LN2 * log2 x
                e = -0.6931471805599453 * tl.log2(u)
                x = x + temp * (-0.6931471805599453 * tl.log2(e))
            if HAS_BITMASK:  # noqa: SIM102 - static branch around a runtime one
                if mask_row >= 0:
                    word = tl.load(bitmask_ptr + mask_row * bitmask_row_stride + (cols >> 5),
                                   mask=in_range, other=0)
                    x = tl.where(((word >> (cols & 31)) & 1) != 0, x, float("-inf"))
            better = x > best_val  # strict: a lane keeps its first maximum
            best_val = tl.where(better, x, best_val)
            best_idx = tl.where(better, cols, best_idx)
        top = tl.max(best_val, axis=0)
        idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)
        if SINGLE_SPLIT:
            tl.store(out_ptr + row, idx.to(tl.int64))
        else:
            tl.store(part_val_ptr + row * num_splits + split, top)
            tl.store(part_idx_ptr + row * num_splits + split, idx)

    @triton.jit(do_not_specialize=["num_splits"])
    def _argmax_splits_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_splits,
                              BLOCK_S: tl.constexpr):
        """The first maximum over a row's splits (increasing columns: a tie keeps the earlier)."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_S)
        best = tl.full([], float("-inf"), tl.float32)
        idx = tl.full([], 2147483647, tl.int32)  # none yet: the first block's stands, even -inf
        for s in range(0, num_splits, BLOCK_S):
            valid = s + offs < num_splits
            vals = tl.load(part_val_ptr + row * num_splits + s + offs, mask=valid,
                           other=float("-inf"))
            idxs = tl.load(part_idx_ptr + row * num_splits + s + offs, mask=valid,
                           other=2147483647)
            top = tl.max(vals, axis=0)
            first = tl.min(tl.where(vals == top, idxs, 2147483647), axis=0)
            idx = tl.where((top > best) | (idx == 2147483647), first, idx)
            best = tl.maximum(best, top)
        tl.store(out_ptr + row, idx.to(tl.int64))

    @triton.jit
    def _apply_bitmask_kernel(
        logits_ptr, logits_row_stride, bitmask_ptr, bitmask_row_stride, mask_rows_ptr,
        num_cols, vocab_size, bitmask_cols,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask_row = tl.load(mask_rows_ptr + row).to(tl.int64)
        in_range = cols < num_cols
        if mask_row >= 0:
            has_word = cols < bitmask_cols
            word = tl.load(bitmask_ptr + mask_row * bitmask_row_stride + (cols >> 5),
                           mask=has_word, other=0)
            allowed = (((word >> (cols & 31)) & 1) != 0) & (cols < vocab_size)
        else:
            allowed = cols < vocab_size
        row_ptr = logits_ptr + row.to(tl.int64) * logits_row_stride
        # read + full-width write: scattered masked stores measured ~3x slower
        x = tl.load(row_ptr + cols, mask=in_range)
        tl.store(row_ptr + cols, tl.where(allowed, x, float("-inf")), mask=in_range)


_SAMPLE_BLOCK = 1024
_SPLITS_BLOCK = 128  # splits reduced at a time (_argmax_splits_kernel)
_APPLY_BLOCK = 2048


def _check(logits: torch.Tensor, bitmask: torch.Tensor | None, mask_rows: torch.Tensor | None,
           vocab_size: int) -> None:
    if logits.dim() != 2 or logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"logits must be a 2-D float32/bfloat16/float16 tensor, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous (stride(1) == 1)")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if bitmask is not None:
        if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
            raise ValueError(f"bitmask must be a 2-D int32 tensor, got {tuple(bitmask.shape)} "
                             f"{bitmask.dtype}")
        if bitmask.stride(1) != 1:
            raise ValueError("bitmask rows must be contiguous (stride(1) == 1)")
        needed = (min(vocab_size, logits.shape[1]) + 31) // 32
        if bitmask.shape[1] < needed:
            raise ValueError(f"bitmask has {bitmask.shape[1]} words per row; vocab_size "
                             f"{vocab_size} needs {needed}")
        if bitmask.device != logits.device:
            raise ValueError(f"bitmask is on {bitmask.device}, logits on {logits.device}")
    if (bitmask is None) != (mask_rows is None):
        raise ValueError("bitmask and mask_rows are given together, or neither")
    if mask_rows is not None:
        if mask_rows.shape != (logits.shape[0],) or mask_rows.dtype not in (torch.int32,
                                                                            torch.int64):
            raise ValueError(f"mask_rows must be an int32 tensor of shape [{logits.shape[0]}], "
                             f"got {tuple(mask_rows.shape)} {mask_rows.dtype}")
        if mask_rows.device != logits.device:
            raise ValueError(f"mask_rows is on {mask_rows.device}, logits on {logits.device}")


def _default_num_splits(num_rows: int, num_cols: int, device: torch.device) -> int:
    """Enough programs to fill the GPU at batch 1; one program per row at large batch."""
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, (4 * num_sms) // max(num_rows, 1))
    return max(1, min(want, triton.cdiv(num_cols, 2 * _SAMPLE_BLOCK)))


def masked_sample(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    mask_rows: torch.Tensor | None,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    *,
    vocab_size: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Mask + temperature + Gumbel-max sample in one pass over the logits; [B] int64 token ids.

    logits [B, V_logits] float (read only); bitmask [M, W] int32 or None; mask_rows [B] int32:
    bitmask row for logits row b or -1 (unconstrained), None with no bitmask; temperature [B]
    float32 (<= 1e-5: greedy); seeds [B] int64. num_splits: vocab chunks per row (None: chosen to
    fill the GPU).
    """
    _check(logits, bitmask, mask_rows, vocab_size)
    num_rows = logits.shape[0]
    for name, t, dtype in (("temperature", temperature, torch.float32),
                           ("seeds", seeds, torch.int64)):
        if t.shape != (num_rows,) or t.dtype != dtype or t.device != logits.device:
            raise ValueError(f"{name} must be a {dtype} tensor of shape [{num_rows}] on "
                             f"{logits.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    if not use_triton(logits):
        return masked_sample_ref(logits, bitmask, mask_rows, temperature, seeds,
                                 vocab_size=vocab_size)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)  # [B]
    if num_rows == 0:
        return out
    num_cols = min(vocab_size, logits.shape[1])
    if num_splits is None:
        num_splits = _default_num_splits(num_rows, num_cols, logits.device)
    cols_per_split = triton.cdiv(triton.cdiv(num_cols, num_splits), _SAMPLE_BLOCK) * _SAMPLE_BLOCK
    num_splits = triton.cdiv(num_cols, cols_per_split)
    single = num_splits == 1
    part_val = out if single else torch.empty(num_rows, num_splits, dtype=torch.float32,
                                              device=logits.device)  # [B, S]
    part_idx = out if single else torch.empty(num_rows, num_splits, dtype=torch.int32,
                                              device=logits.device)  # [B, S]
    has_bitmask = bitmask is not None
    _masked_sample_kernel[(num_rows, num_splits)](
        logits, logits.stride(0),
        bitmask if has_bitmask else logits, bitmask.stride(0) if has_bitmask else 0,
        mask_rows if has_bitmask else out, temperature, seeds, part_val, part_idx, out,
        num_cols, cols_per_split, num_splits,
        HAS_BITMASK=has_bitmask, BLOCK=_SAMPLE_BLOCK, SINGLE_SPLIT=single, num_warps=4,
    )
    if not single:
        _argmax_splits_kernel[(num_rows,)](
            part_val, part_idx, out, num_splits, BLOCK_S=_SPLITS_BLOCK, num_warps=1,
        )
    return out


def apply_token_bitmask_(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    mask_rows: torch.Tensor,
    *,
    vocab_size: int,
) -> None:
    """In place: logits[b, j] = -inf where token j is disallowed by bitmask row mask_rows[b] or
    j >= vocab_size; rows with mask_rows -1 get only the padded columns masked."""
    _check(logits, bitmask, mask_rows, vocab_size)
    num_rows, num_cols = logits.shape
    if not use_triton(logits):
        apply_token_bitmask_ref_(logits, bitmask, mask_rows, vocab_size=vocab_size)
        return
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(num_cols, _APPLY_BLOCK))
    _apply_bitmask_kernel[grid](
        logits, logits.stride(0), bitmask, bitmask.stride(0), mask_rows,
        num_cols, vocab_size, 32 * bitmask.shape[1], BLOCK=_APPLY_BLOCK, num_warps=8,
    )
