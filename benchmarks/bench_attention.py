"""Decode attention over the paged KV cache: our split-K Triton kernel vs the torch reference and
dense SDPA on contiguous K/V, against the HBM floor. Prints one markdown table (also
$OUT/bench_attention.md when OUT is set).

    python benchmarks/bench_attention.py [--smoke]

Llama-3-8B head shape (Hq 32, Hkv 8, D 128), bf16, block size 16, every request at the same kv
length, block tables shuffled; caches rotated where one set would fit in L2.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_bitmask import copy_bandwidth, rotating, time_graph_us, time_us

from guided.kernels import attention as attn

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def make_inputs(batch: int, kv_len: int, dtype: torch.dtype, device: str) -> dict:
    blocks_per_req = kv_len // BLOCK_SIZE
    num_blocks = batch * blocks_per_req
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    return {
        "q": torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype),  # [B, Hq, D]
        "k_cache": torch.randn(shape, device=device, dtype=dtype),  # [N, bs, Hkv, D]
        "v_cache": torch.randn(shape, device=device, dtype=dtype),  # [N, bs, Hkv, D]
        "block_tables": perm.view(batch, blocks_per_req),  # [B, nb]
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device=device),
        "seq_lens": torch.full((batch,), kv_len, dtype=torch.int32, device=device),
        "scale": HEAD_DIM**-0.5,
        "max_query_len": 1,
    }


def dense_sdpa(x: dict) -> tuple:
    """The same K/V laid out contiguously [B, Hkv, L, D], for SDPA (not timed: the layout)."""
    batch = x["block_tables"].shape[0]
    k = x["k_cache"][x["block_tables"].long()].view(batch, -1, NUM_KV_HEADS, HEAD_DIM)
    v = x["v_cache"][x["block_tables"].long()].view(batch, -1, NUM_KV_HEADS, HEAD_DIM)
    q = x["q"][:, :, None]  # [B, Hq, 1, D]
    return q, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def bench_case(batch: int, kv_len: int, dtype: torch.dtype, device: str, bw: float) -> dict:
    kv_bytes = 2 * batch * kv_len * NUM_KV_HEADS * HEAD_DIM * (torch.finfo(dtype).bits // 8)
    nxt = rotating(lambda: make_inputs(batch, kv_len, dtype, device), kv_bytes)
    x = nxt()
    out = attn.paged_attention(**x)
    ref = attn.paged_attention_ref(**x)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    row = {"batch": batch, "kv len": kv_len,
           "ours (Triton split-K)": time_us(lambda: attn.paged_attention(**nxt()), device),
           "ours, CUDA graph": time_graph_us(lambda s: attn.paged_attention(**s), nxt.sets,
                                             device),
           "ours, no split": time_us(lambda: attn.paged_attention(**nxt(), num_splits=1),
                                     device)}
    row["torch ref (gather)"] = time_us(lambda: attn.paged_attention_ref(**x), device)
    q, k, v = dense_sdpa(x)
    try:
        row["SDPA dense (gqa)"] = time_us(
            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), device)
    except (TypeError, RuntimeError):
        row["SDPA dense (gqa)"] = None
    row["HBM floor"] = kv_bytes / bw * 1e6
    row["rel err vs ref"] = err
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    cases = [(1, 64), (2, 128)] if args.smoke else [(b, n) for n in (1024, 4096)
                                                    for b in (1, 64, 256)]
    bw = copy_bandwidth(device)
    rows = [bench_case(b, n, dtype, device, bw) for b, n in cases]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    title = (f"decode attention on {name}: Llama-3-8B heads (Hq {NUM_HEADS}, Hkv {NUM_KV_HEADS}, "
             f"D {HEAD_DIM}), bf16, block {BLOCK_SIZE}; median µs (triton do_bench); floor = K+V "
             f"read once at {bw / 1e12:.2f} TB/s copy bandwidth (read + write)")
    lines = [title, ""]
    cols = list(rows[0])
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            if c in ("batch", "kv len"):
                cells.append(str(r[c]))
            elif r[c] is None:
                cells.append("n/a")
            else:
                cells.append(f"{r[c]:.1e}" if c == "rel err vs ref" else f"{r[c]:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_attention.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
