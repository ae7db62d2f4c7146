"""guided.kernels.attention: Triton paged attention against the torch reference, and the reference
against dense causal SDPA on contiguous K/V."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from guided.kernels import attention as attn

TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _batch(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
           head_dim: int, block_size: int, dtype: torch.dtype, device: str, seed: int) -> dict:
    """Random q and caches; each request's blocks are distinct, shuffled, non-contiguous ids."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 7
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)  # [B, max_blocks]
    used = 0
    for b, n in enumerate(blocks_per_req):
        block_tables[b, :n] = perm[used:used + n]
        block_tables[b, n:] = perm[-1]  # junk past the end must never be read into the result
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)  # [N, bs, Hkv, D]
    v_cache = torch.randn(shape, generator=gen).to(dtype)  # [N, bs, Hkv, D]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)  # [T, Hq, D]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
           "query_start_loc": qsl, "seq_lens": torch.tensor(seq_lens, dtype=torch.int32)}
    out = {k: v.to(device) for k, v in out.items()}
    out.update(scale=head_dim**-0.5, max_query_len=max(q_lens))
    return out


SHAPES = [(4, 2, 64, 16), (6, 3, 64, 8), (8, 1, 128, 32)]  # (Hq, Hkv, D, block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_ref(device: str, dtype: torch.dtype, shape: tuple) -> None:
    num_heads, num_kv_heads, head_dim, block_size = shape
    seq_lens = [1, 37, 300, 129, 64]
    x = _batch([1] * 5, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
               seed=sum(shape))
    ref = attn.paged_attention_ref(**x)
    for num_splits in (None, 1, 3):
        out = attn.paged_attention(**x, num_splits=num_splits)
        assert out.dtype == dtype and out.shape == x["q"].shape
        assert _rel_err(out, ref) < TOL[dtype], num_splits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_varlen_matches_ref(device: str, dtype: torch.dtype, shape: tuple) -> None:
    """Mixed batch: prefill from scratch, prefill after a prefix-cache hit, decode, verification."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    q_lens = [70, 1, 5, 33, 17]
    seq_lens = [70, 90, 48, 100, 17 + 40]
    x = _batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
               seed=sum(shape) + 1)
    out = attn.paged_attention(**x)
    ref = attn.paged_attention_ref(**x)
    assert _rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_tiles_around_empty_requests(device: str, dtype: torch.dtype) -> None:
    """As a CUDA graph lays a prefill out: queries over several tiles, ending mid-tile and on a
    tile's edge, between request slots with no tokens (their seq_len 1)."""
    q_lens = [130, 0, 3, 0, 64, 65, 0]
    seq_lens = [130, 1, 40, 1, 64 + 50, 65, 1]
    x = _batch(q_lens, seq_lens, 4, 2, 64, 16, dtype, device, seed=11)
    assert _rel_err(attn.paged_attention(**x), attn.paged_attention_ref(**x)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_short_queries_match_ref(device: str, dtype: torch.dtype, shape: tuple) -> None:
    """Verification steps (the sampled token plus drafts) and short chunks on the split-K kernel:
    several query tiles per request, splits that hold none of a row's visible positions."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    q_lens = [1, 5, 8, 3, attn.MAX_SHORT_QUERY_LEN, 2]
    seq_lens = [37, 300, 129, 8, 100, 64]
    x = _batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
               seed=sum(shape) + 2)
    ref = attn.paged_attention_ref(**x)
    for num_splits in (None, 1, 5):
        out = attn.paged_attention(**x, num_splits=num_splits)
        assert _rel_err(out, ref) < TOL[dtype], num_splits


@pytest.mark.parametrize("q_lens,seq_lens", [([1, 1, 1], [5, 40, 17]), ([9, 3], [9, 30])])
def test_ref_matches_dense_causal_sdpa(q_lens: list[int], seq_lens: list[int]) -> None:
    x = _batch(q_lens, seq_lens, 6, 2, 64, 8, torch.float64, "cpu", seed=5)
    out = attn.paged_attention_ref(**x)
    group = 3
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        # the same K/V laid out contiguously, by walking the block table by hand
        slots = [(int(x["block_tables"][b, t // 8]), t % 8) for t in range(seq_len)]
        k = torch.stack([x["k_cache"][blk, off] for blk, off in slots])  # [L, Hkv, D]
        v = torch.stack([x["v_cache"][blk, off] for blk, off in slots])  # [L, Hkv, D]
        start = int(x["query_start_loc"][b])
        q = x["q"][start:start + q_len]  # [Lq, Hq, D]
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
        dense = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
            v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask, scale=x["scale"],
        ).transpose(0, 1)  # [Lq, Hq, D]
        torch.testing.assert_close(out[start:start + q_len], dense)


def test_kernel_path_is_exercised(device: str) -> None:
    assert attn.use_triton(torch.empty(1, device=device))


def test_launcher_rejects_bad_inputs(device: str) -> None:
    x = _batch([1, 1], [5, 9], 4, 2, 64, 16, torch.float32, device, seed=2)
    with pytest.raises(ValueError, match="k_cache"):
        attn.paged_attention(**{**x, "k_cache": x["k_cache"].half()})
    with pytest.raises(ValueError, match="seq_lens"):
        attn.paged_attention(**{**x, "seq_lens": x["seq_lens"].long()})
    with pytest.raises(ValueError, match="multiple"):
        attn.paged_attention(**{**x, "q": x["q"][:, :3]})
    with pytest.raises(ValueError, match="query_start_loc"):
        attn.paged_attention(**{**x, "query_start_loc": x["query_start_loc"][:2]})


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (28, 4, 128),
                                                             (9, 3, 64)])
def test_gpu_decode_realistic(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1, 2049, (64,), generator=gen).tolist()
    seq_lens[0] = 2048
    x = _batch([1] * 64, seq_lens, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, "cuda",
               seed=1)
    assert _rel_err(attn.paged_attention(**x), attn.paged_attention_ref(**x)) < 1e-2


@pytest.mark.gpu
def test_gpu_verify_realistic() -> None:
    gen = torch.Generator().manual_seed(4)
    q_lens = torch.randint(1, 9, (128,), generator=gen).tolist()
    seq_lens = [n + int(c) for n, c in zip(q_lens, torch.randint(0, 2000, (128,), generator=gen))]
    x = _batch(q_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=5)
    assert _rel_err(attn.paged_attention(**x), attn.paged_attention_ref(**x)) < 1e-2


@pytest.mark.gpu
def test_gpu_varlen_realistic() -> None:
    q_lens = [2048, 1, 1, 17, 33, 500] + [1] * 58
    seq_lens = [2048, 2000, 7, 1024, 1500, 2048] + [1000] * 58
    x = _batch(q_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=3)
    assert _rel_err(attn.paged_attention(**x), attn.paged_attention_ref(**x)) < 1e-2
