"""Decode attention over the paged KV cache: our split-K Triton kernel vs the torch reference and
dense SDPA on contiguous K/V, against the HBM floor. Prints one markdown table (also
$OUT/bench_attention.md when OUT is set).

    python benchmarks/bench_attention.py [--smoke] [--verify] [--prefill]

--verify adds a second table: verification steps (each request's sampled token plus drafts, q
tokens at the end of its context) on the split-K kernel against the flash (prefill) kernel that
ran them before session 8. --prefill adds prefill chunks (a step's prompt tokens) on the flash
kernel against dense causal SDPA (flash attention on contiguous K/V), in TFLOP/s.

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


def make_inputs(batch: int, kv_len: int, dtype: torch.dtype, device: str, q_len: int = 1) -> dict:
    blocks_per_req = kv_len // BLOCK_SIZE
    num_blocks = batch * blocks_per_req
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    return {
        "q": torch.randn(batch * q_len, NUM_HEADS, HEAD_DIM, device=device,
                         dtype=dtype),  # [B * q, Hq, D]
        "k_cache": torch.randn(shape, device=device, dtype=dtype),  # [N, bs, Hkv, D]
        "v_cache": torch.randn(shape, device=device, dtype=dtype),  # [N, bs, Hkv, D]
        "block_tables": perm.view(batch, blocks_per_req),  # [B, nb]
        "query_start_loc": torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32,
                                        device=device),
        "seq_lens": torch.full((batch,), kv_len, dtype=torch.int32, device=device),
        "scale": HEAD_DIM**-0.5,
        "max_query_len": q_len,
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


def bench_verify_case(batch: int, kv_len: int, q_len: int, dtype: torch.dtype, device: str,
                      bw: float) -> dict:
    kv_bytes = 2 * batch * kv_len * NUM_KV_HEADS * HEAD_DIM * (torch.finfo(dtype).bits // 8)
    nxt = rotating(lambda: make_inputs(batch, kv_len, dtype, device, q_len), kv_bytes)
    x = nxt()
    ref = attn.paged_attention_ref(**x)
    short = attn.MAX_SHORT_QUERY_LEN
    row = {"batch": batch, "kv len": kv_len, "query tokens": q_len}
    for name, limit in (("split-K (ours)", short), ("flash kernel", 0)):
        attn.MAX_SHORT_QUERY_LEN = limit
        try:
            out = attn.paged_attention(**x)
            row[name] = time_us(lambda: attn.paged_attention(**nxt()), device)
            row[f"rel err {name.split()[0]}"] = (
                (out.float() - ref.float()).norm() / ref.float().norm()).item()
        finally:
            attn.MAX_SHORT_QUERY_LEN = short
    row["HBM floor"] = kv_bytes / bw * 1e6
    return row


def bench_prefill_case(q_lens: list[int], ctx: int, dtype: torch.dtype, device: str) -> dict:
    """Requests of q_lens new tokens after ctx cached ones each (one step's prefill chunks)."""
    seq_lens = [q + ctx for q in q_lens]
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    shape = (sum(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    tables = torch.zeros(len(q_lens), max(blocks), dtype=torch.int32, device=device)
    perm = torch.randperm(sum(blocks), device=device).to(torch.int32)
    for b, start in enumerate([0, *torch.tensor(blocks).cumsum(0).tolist()[:-1]]):
        tables[b, :blocks[b]] = perm[start:start + blocks[b]]
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    x = {"q": torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, device=device, dtype=dtype),
         "k_cache": torch.randn(shape, device=device, dtype=dtype),
         "v_cache": torch.randn(shape, device=device, dtype=dtype), "block_tables": tables,
         "query_start_loc": torch.tensor(starts, dtype=torch.int32, device=device),
         "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
         "scale": HEAD_DIM**-0.5, "max_query_len": max(q_lens)}
    # QK^T and PV over the causal half of the new tokens plus all of the context
    flops = sum(4 * NUM_HEADS * HEAD_DIM * q * (ctx + (q + 1) / 2) for q in q_lens)
    row = {"requests": len(q_lens), "new tokens each": q_lens[0], "context": ctx}
    ours = time_us(lambda: attn.paged_attention(**x), device)
    row["ours µs"], row["ours TFLOP/s"] = ours, flops / ours / 1e6
    if ctx == 0 and len(set(q_lens)) == 1:
        q = x["q"].view(len(q_lens), q_lens[0], NUM_HEADS, HEAD_DIM).transpose(1, 2)
        k = torch.randn(len(q_lens), NUM_KV_HEADS, q_lens[0], HEAD_DIM, device=device,
                        dtype=dtype)
        sdpa = time_us(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True,
                                                              enable_gqa=True), device)
        row["SDPA µs"], row["SDPA TFLOP/s"] = sdpa, flops / sdpa / 1e6
    else:
        row["SDPA µs"] = row["SDPA TFLOP/s"] = None
    ref = attn.paged_attention_ref(**x)
    out = attn.paged_attention(**x)
    row["rel err vs ref"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return row


def markdown(title: str, rows: list[dict]) -> str:
    lines = [title, ""]
    cols = list(rows[0])
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            if isinstance(r[c], int):
                cells.append(str(r[c]))
            elif r[c] is None:
                cells.append("n/a")
            else:
                cells.append(f"{r[c]:.1e}" if c.startswith("rel err") else f"{r[c]:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device")
    parser.add_argument("--verify", action="store_true",
                        help="also verification steps: split-K against the flash kernel")
    parser.add_argument("--prefill", action="store_true",
                        help="also prefill chunks on the flash kernel against dense SDPA")
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
    table = markdown(title, rows)
    if args.verify:
        cases = [(2, 64, 4)] if args.smoke else [(b, n, q) for n in (1024, 4096)
                                                 for b in (64, 256) for q in (2, 4, 8)]
        verify = [bench_verify_case(b, n, q, dtype, device, bw) for b, n, q in cases]
        table += "\n\n" + markdown(
            f"verification steps on {name}: the same heads, q query tokens per request at the "
            "end of its kv length (the sampled token plus q - 1 drafts); median µs", verify)
    if args.prefill:
        cases = [([64, 64], 0)] if args.smoke else [
            ([2048], 0), ([2048], 2048), ([512] * 4, 0), ([300] * 7, 0), ([256] * 8, 1024)]
        rows = [bench_prefill_case(q, c, dtype, device) for q, c in cases]
        table += "\n\n" + markdown(
            f"prefill chunks on {name}: the same heads, each request's new tokens after its "
            "cached context; median µs; SDPA on contiguous K/V (no context)", rows)
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_attention.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
