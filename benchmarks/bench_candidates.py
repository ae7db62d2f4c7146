"""What a step's candidates cost (guided/kernels/candidates.py): every row sampled unmasked
brings back its 8 best tokens. GPU time per call against the fused sample kernel on the same
rows, and the host's time to queue each (the loop is host-bound where lazy rows pay). One table:

    python benchmarks/bench_candidates.py
"""
from __future__ import annotations

import argparse
import time

import torch
from common import ROOT  # noqa: F401  (puts the checkout on sys.path)

from guided.kernels.bitmask import masked_sample
from guided.kernels.candidates import sample_candidates


def gpu_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def host_us(fn, reps: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    took = time.perf_counter() - start
    torch.cuda.synchronize()
    return took / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_candidates.py needs a GPU")
    print(f"{torch.cuda.get_device_name()}, k={args.k}, fp32 logits, temperature 0.7")
    print("| rows | vocab | sample GPU us | candidates GPU us | sample host us | "
          "candidates host us |")
    print("|---|---|---|---|---|---|")
    for rows in (64, 256):
        for vocab in (49152, 128256):
            logits = torch.randn(rows, vocab, device="cuda")
            temperature = torch.full((rows,), 0.7, device="cuda")
            seeds = torch.arange(rows, device="cuda", dtype=torch.int64) * 7919
            picked = torch.arange(rows, device="cuda")

            def draw():
                return masked_sample(logits, None, None, temperature, seeds, vocab_size=vocab)

            def best():
                return sample_candidates(logits, picked, temperature, seeds, k=args.k,
                                         vocab_size=vocab)

            differ = int((best()[:, 0] != draw()).sum())  # the sampled token comes first
            print(f"| {rows} | {vocab} | {gpu_us(draw):.1f} | {gpu_us(best):.1f} | "
                  f"{host_us(draw):.1f} | {host_us(best):.1f} |"
                  + (f" first != sampled in {differ} rows" if differ else ""), flush=True)


if __name__ == "__main__":
    main()
