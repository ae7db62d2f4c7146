"""The step loop's list -> tensor conversions: torch.tensor against list_tensor (numpy), on the
shapes of a step at 256 requests (CPU, one table):

    python benchmarks/bench_host_lists.py [--repeats 200]
"""
from __future__ import annotations

import argparse

import torch

from common import per_call_us

from guided.worker.host_lists import list_tensor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    cases = [
        ("block table 256 x 48 (int32)", [list(range(i, i + 48)) for i in range(256)], torch.int32),
        ("slots / ids / positions, 700 (int64)", list(range(700)), torch.int64),
        ("seeds, 640 (int64)", [(1 << 62) + i for i in range(640)], torch.int64),
        ("temperatures, 640 (float32)", [0.7] * 640, torch.float32),
    ]
    print("| list | torch.tensor µs | list_tensor µs | ratio |")
    print("|---|---|---|---|")
    for name, values, dtype in cases:
        theirs = per_call_us(lambda: torch.tensor(values, dtype=dtype), args.repeats)
        ours = per_call_us(lambda: list_tensor(values, dtype), args.repeats)
        print(f"| {name} | {theirs:.1f} | {ours:.1f} | {theirs / ours:.2f}x |")


if __name__ == "__main__":
    main()
