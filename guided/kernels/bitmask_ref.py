"""Torch references for the bitmask kernels (kernels/bitmask.py gives the layout and the
sampling function): what the CPU runs and what the kernels are tested against, bit for bit."""
from __future__ import annotations

import torch

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


def _row_keys(seeds: torch.Tensor) -> torch.Tensor:
    seeds = seeds.to(torch.int64)
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    return _fmix32(lo ^ _fmix32(hi ^ _GOLDEN))  # [B] int64 in [0, 2**32)


def gumbel_noise_ref(seeds: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Counter-based Gumbel noise g(seed_b, j): [B] int64 seeds -> [B, num_cols] float32."""
    keys = _row_keys(seeds)  # [B]
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
    """[num_rows, num_cols] bool (mask_rows None: row b uses bitmask row b)."""
    device = bitmask.device if bitmask is not None else "cpu"
    cols = torch.arange(num_cols, device=device)
    in_vocab = (cols < vocab_size)[None, :].expand(num_rows, num_cols)  # [B, V]
    if bitmask is None:
        return in_vocab.clone()
    if mask_rows is None:
        mask_rows = torch.arange(num_rows, device=device, dtype=torch.int32)
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
    if bitmask is None:
        mask_rows = None
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
    mask_rows: torch.Tensor | None = None,
    *,
    vocab_size: int,
) -> None:
    num_rows, num_cols = logits.shape
    allowed = allowed_mask_ref(bitmask, mask_rows, num_rows, num_cols, vocab_size=vocab_size)
    logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
