"""guided.kernels.bitmask: the Triton kernels against the torch references, bit for bit."""
from __future__ import annotations

import pytest
import torch

from guided.kernels import bitmask as bm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random_bitmask(num_rows: int, vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """[num_rows, W] int32 with varied densities and the awkward rows: one allowed token, only
    tokens >= 32 * k allowed, nothing allowed, everything allowed (garbage bits past vocab_size)."""
    num_words = (vocab_size + 31) // 32
    densities = torch.tensor([0.5, 0.05, 0.95, 0.3])
    rows = []
    for r in range(num_rows):
        kind = r % 8
        if kind < 4:
            bits = torch.rand(num_words * 32, generator=gen) < densities[kind]
        elif kind == 4:  # a single allowed token, placed randomly
            bits = torch.zeros(num_words * 32, dtype=torch.bool)
            bits[torch.randint(vocab_size, (1,), generator=gen)] = True
        elif kind == 5:  # only tokens >= 32 * k allowed, sparse
            k = int(torch.randint(1, num_words, (1,), generator=gen))
            bits = torch.rand(num_words * 32, generator=gen) < 0.2
            bits[: 32 * k] = False
        elif kind == 6:  # nothing allowed
            bits = torch.zeros(num_words * 32, dtype=torch.bool)
        else:  # every bit set, also the ones past vocab_size
            bits = torch.ones(num_words * 32, dtype=torch.bool)
        rows.append(bits)
    bits = torch.stack(rows).view(num_rows, num_words, 32).to(torch.int64)  # [M, W, 32]
    words = (bits << torch.arange(32)).sum(-1)  # [M, W] in [0, 2**32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _inputs(batch: int, vocab_size: int, pad: int, dtype: torch.dtype, device: str,
            strided: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    num_cols = vocab_size + pad
    row_stride = num_cols + (37 if strided else 0)
    storage = torch.randn(batch, row_stride, generator=gen) * 3  # [B, stride]
    logits = storage.to(dtype)[:, :num_cols]  # [B, V_logits], maybe non-contiguous rows
    num_mask_rows = batch + 3
    bitmask = _random_bitmask(num_mask_rows, vocab_size, gen)  # [M, W]
    mask_rows = torch.randperm(num_mask_rows, generator=gen)[:batch].to(torch.int32)  # [B]
    mask_rows[torch.rand(batch, generator=gen) < 0.25] = -1
    temperature = torch.rand(batch, generator=gen) * 1.5 + 0.1  # [B]
    temperature[torch.rand(batch, generator=gen) < 0.4] = 0.0
    temperature[0] = 1e-6  # counts as greedy
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen)  # [B] int64
    out = {"logits": logits, "bitmask": bitmask, "mask_rows": mask_rows,
           "temperature": temperature, "seeds": seeds}
    return {k: v.to(device) for k, v in out.items()}


def test_splits_are_reduced_a_block_at_a_time(device: str, monkeypatch) -> None:
    """More splits than one block of the reduction (a vocabulary past 128 K columns): chunks
    of 2 here, ties (flat rows) keep the first maximum, as the reference does."""
    monkeypatch.setattr(bm, "_SPLITS_BLOCK", 2)
    vocab_size = 5 * 1024 + 3
    x = _inputs(8, vocab_size, 0, torch.float32, device, False, seed=5)
    for row, mask_row in ((1, -1), (2, 0)):  # flat rows, unmasked and half masked: every
        x["logits"][row] = 0.5  # column a maximum, the first allowed one wins
        x["temperature"][row] = 0.0
        x["mask_rows"][row] = mask_row
    ref = bm.masked_sample_ref(**x, vocab_size=vocab_size)
    for num_splits in (5, 6):
        got = bm.masked_sample(**x, vocab_size=vocab_size, num_splits=num_splits)
        assert torch.equal(got, ref), (num_splits, got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab_size", [1000, 1001, 1024 + 7])
@pytest.mark.parametrize("pad", [0, 64])
@pytest.mark.parametrize("strided", [False, True])
def test_masked_sample_matches_ref(device: str, dtype: torch.dtype, vocab_size: int, pad: int,
                                   strided: bool) -> None:
    seed = vocab_size * 7 + pad + (1 if strided else 0) + DTYPES.index(dtype) * 1000
    x = _inputs(16, vocab_size, pad, dtype, device, strided, seed)
    before = x["logits"].clone()
    ref = bm.masked_sample_ref(**x, vocab_size=vocab_size)
    for num_splits in (None, 1, 3):
        got = bm.masked_sample(**x, vocab_size=vocab_size, num_splits=num_splits)
        assert got.dtype == torch.int64
        assert torch.equal(got, ref), (num_splits, got, ref)
    assert torch.equal(x["logits"], before)  # read only
    # every sampled token is allowed and inside the tokenizer's vocabulary
    allowed = bm.allowed_mask_ref(x["bitmask"], x["mask_rows"], 16, vocab_size + pad,
                                  vocab_size=vocab_size)
    picked = allowed.gather(1, ref[:, None])[:, 0]
    has_any = allowed.any(1)
    assert torch.equal(picked, has_any)
    assert bool((ref < vocab_size).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab_size", [1000, 1001, 1024 + 7])
@pytest.mark.parametrize("pad", [0, 64])
def test_apply_token_bitmask_matches_ref(device: str, dtype: torch.dtype, vocab_size: int,
                                         pad: int) -> None:
    x = _inputs(12, vocab_size, pad, dtype, device, True, vocab_size + pad)
    base = x["logits"]._base if x["logits"]._base is not None else x["logits"]
    got_buf, ref_buf = base.clone(), base.clone()  # [B, stride]: the tail must stay untouched
    num_cols = vocab_size + pad
    bm.apply_token_bitmask_(got_buf[:, :num_cols], x["bitmask"], x["mask_rows"],
                            vocab_size=vocab_size)
    bm.apply_token_bitmask_ref_(ref_buf[:, :num_cols], x["bitmask"], x["mask_rows"],
                                vocab_size=vocab_size)
    assert torch.equal(got_buf, ref_buf)
    assert torch.equal(got_buf[:, num_cols:], base[:, num_cols:])
    assert bool(torch.isinf(got_buf[:, vocab_size:num_cols]).all())


def test_unconstrained_rows_only_lose_padded_columns(device: str) -> None:
    x = _inputs(4, 1001, 64, torch.float32, device, False, 3)
    rows = torch.full((4,), -1, dtype=torch.int32, device=device)
    logits = x["logits"].clone()
    bm.apply_token_bitmask_(logits, x["bitmask"], rows, vocab_size=1001)
    assert torch.equal(logits[:, :1001], x["logits"][:, :1001])
    assert bool((logits[:, 1001:] == float("-inf")).all())
    # unconstrained sampling never returns a padded column, even when it has the best logit
    x["logits"][:, 1001:] = 100.0
    ids = bm.masked_sample(x["logits"], None, None, x["temperature"], x["seeds"], vocab_size=1001)
    assert torch.equal(ids, bm.masked_sample_ref(x["logits"], None, None, x["temperature"],
                                                 x["seeds"], vocab_size=1001))
    assert bool((ids < 1001).all())


def test_noise_only_rows_match(device: str) -> None:
    """Constant logits: the sample is the argmax of the noise alone, a direct check of the hash."""
    batch, vocab_size = 8, 1500
    logits = torch.full((batch, vocab_size), 0.25, device=device)
    temperature = torch.ones(batch, device=device)
    seeds = torch.arange(batch, dtype=torch.int64, device=device) - 3
    got = bm.masked_sample(logits, None, None, temperature, seeds, vocab_size=vocab_size)
    noise_argmax = bm.gumbel_noise_ref(seeds, vocab_size).argmax(-1)
    assert torch.equal(got, noise_argmax)
    assert len(set(got.tolist())) > batch // 2  # different seeds, different draws


def test_empty_and_minus_inf_rows_return_zero(device: str) -> None:
    vocab_size = 1001
    logits = torch.randn(3, vocab_size, device=device)
    logits[2] = float("-inf")
    bitmask = torch.zeros(2, 32, dtype=torch.int32, device=device)
    bitmask[1, 5] = 1 << 3  # token 163 only
    logits[1, 163] = float("-inf")
    rows = torch.tensor([0, 1, -1], dtype=torch.int32, device=device)
    for temp in (0.0, 1.0):
        temperature = torch.full((3,), temp, device=device)
        seeds = torch.tensor([1, 2, 3], device=device)
        got = bm.masked_sample(logits, bitmask, rows, temperature, seeds, vocab_size=vocab_size)
        assert got.tolist() == [0, 0, 0]
        ref = bm.masked_sample_ref(logits, bitmask, rows, temperature, seeds,
                                   vocab_size=vocab_size)
        assert ref.tolist() == [0, 0, 0]


def test_greedy_ties_pick_lowest_index(device: str) -> None:
    logits = torch.randn(2, 3000, device=device).to(torch.bfloat16)
    logits[:, [7, 1200, 2999]] = 50.0
    zeros = torch.zeros(2, device=device)
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    for num_splits in (1, 2):
        got = bm.masked_sample(logits, None, None, zeros, seeds, vocab_size=3000,
                               num_splits=num_splits)
        assert got.tolist() == [7, 7]


def test_hash_matches_docstring_pseudocode() -> None:
    def fmix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & 0xFFFFFFFF
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & 0xFFFFFFFF
        return x ^ (x >> 16)

    import math

    for seed in (0, 1, -1, 2**62 + 12345, -(2**40) - 7):
        s = seed & (2**64 - 1)
        key = fmix((s & 0xFFFFFFFF) ^ fmix((s >> 32) ^ 0x9E3779B9))
        noise = bm.gumbel_noise_ref(torch.tensor([seed]), 70)[0]
        for j in (0, 1, 31, 69):
            h = fmix((j * 0x9E3779B9 + key) & 0xFFFFFFFF)
            u = ((h >> 9) + 0.5) * 2.0**-23
            assert noise[j].item() == pytest.approx(-math.log(-math.log(u)), rel=1e-6)


@pytest.mark.parametrize("temp", [1.0, 0.5])
def test_ref_sampler_distribution(temp: float) -> None:
    """Over many seeds the Gumbel-max sampler draws from softmax(logits / T)."""
    num_draws = 40_000
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0]).expand(num_draws, 4)
    seeds = torch.arange(num_draws, dtype=torch.int64) * 1_000_003 + 17  # caller-mixed seeds
    ids = bm.masked_sample_ref(logits, None, None, torch.full((num_draws,), temp), seeds,
                               vocab_size=4)
    freq = torch.bincount(ids, minlength=4).double() / num_draws
    expected = torch.softmax(logits[0].double() / temp, 0)
    assert torch.allclose(freq, expected, atol=0.012), (freq, expected)
    g = bm.gumbel_noise_ref(torch.arange(64), 4096)
    assert abs(g.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni: the Gumbel mean
    assert abs(g.var().item() - torch.pi**2 / 6) < 0.03


def test_cpu_without_interpreter_uses_ref(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = _inputs(6, 1001, 64, torch.float32, "cpu", True, 11)
    assert torch.equal(bm.masked_sample(**x, vocab_size=1001),
                       bm.masked_sample_ref(**x, vocab_size=1001))


def test_launcher_rejects_bad_inputs(device: str) -> None:
    x = _inputs(4, 1001, 0, torch.float32, device, False, 5)
    with pytest.raises(ValueError, match="int32"):
        bm.masked_sample(x["logits"], x["bitmask"].float(), x["mask_rows"], x["temperature"],
                         x["seeds"], vocab_size=1001)
    with pytest.raises(ValueError, match="words per row"):
        bm.masked_sample(x["logits"], x["bitmask"][:, :10], x["mask_rows"], x["temperature"],
                         x["seeds"], vocab_size=1001)
    with pytest.raises(ValueError, match="seeds"):
        bm.masked_sample(x["logits"], x["bitmask"], x["mask_rows"], x["temperature"],
                         x["seeds"].int(), vocab_size=1001)
    with pytest.raises(ValueError, match="contiguous"):
        bm.apply_token_bitmask_(x["logits"].t(), x["bitmask"], x["mask_rows"], vocab_size=1001)
    with pytest.raises(ValueError, match="together"):
        bm.masked_sample(x["logits"], x["bitmask"], None, x["temperature"], x["seeds"],
                         vocab_size=1001)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab_size,pad", [(49152, 0), (128256, 0), (151665, 271)])
def test_gpu_realistic_sizes(vocab_size: int, pad: int) -> None:
    x = _inputs(256, vocab_size, pad, torch.bfloat16, "cuda", False, vocab_size)
    ref = bm.masked_sample_ref(**x, vocab_size=vocab_size)
    got = bm.masked_sample(**x, vocab_size=vocab_size)
    # libdevice's log vs torch's may differ by an ulp: only a near-tie could flip a sample
    assert (got != ref).sum().item() <= 1
    single = bm.masked_sample(**{k: v[:1] for k, v in x.items() if k != "bitmask"},
                              bitmask=x["bitmask"], vocab_size=vocab_size)
    assert single.item() == got[0].item()
    a, b = x["logits"].clone(), x["logits"].clone()
    bm.apply_token_bitmask_(a, x["bitmask"], x["mask_rows"], vocab_size=vocab_size)
    bm.apply_token_bitmask_ref_(b, x["bitmask"], x["mask_rows"], vocab_size=vocab_size)
    assert torch.equal(a, b)
    xgr = pytest.importorskip("xgrammar")
    rows = x["mask_rows"].clamp(min=0).long()
    c = x["logits"].clone()
    xgr.apply_token_bitmask_inplace(c, x["bitmask"][rows].contiguous(), vocab_size=vocab_size)
    d = x["logits"].clone()
    bm.apply_token_bitmask_(d, x["bitmask"], rows, vocab_size=vocab_size)
    assert torch.equal(c[:, :vocab_size], d[:, :vocab_size])


def test_kernel_path_is_exercised(device: str) -> None:
    """On the CPU these tests must run the Triton kernels (interpreter), not the references."""
    assert bm.use_triton(torch.empty(1, device=device))
    assert "Interpret" in type(bm._masked_sample_kernel).__name__ or device == "cuda"
