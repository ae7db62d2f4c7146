"""GPU time of one forward pass at each captured CUDA-graph size around a batch: what a verify
step's padding costs (a decode batch of N requests with a few drafts replays the verify graph
of the next size up). The graphs replay on their capture-time inputs (short sequences), so this
is the layers' matmuls over the padding, not long attention. The engine's log line says how
long it took to capture them all. GPU only; one table:

    python benchmarks/bench_graph_sizes.py --model synthetic:llama-3-8b --batch 256
"""
from __future__ import annotations

import argparse
import logging

import torch
from common import ROOT  # noqa: F401  (puts the checkout on sys.path)

from guided.config import EngineConfig
from guided.engine.core import Engine


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:llama-3-8b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_graph_sizes.py needs a GPU")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("guided.worker.cuda_graphs").setLevel(logging.INFO)  # the capture time
    engine = Engine(EngineConfig(model=args.model, max_num_seqs=args.batch))
    graphs = engine.runner.graphs.graphs
    decode = graphs[("decode", args.batch)]
    base = replay_ms(decode, args.reps)
    print(f"\n{args.model}, {torch.cuda.get_device_name()}: one replay of each graph "
          f"(ms, mean of {args.reps})\n")
    print("| graph | tokens | ms | against decode |")
    print("|---|---|---|---|")
    print(f"| decode | {args.batch} | {base:.2f} | 1.00 |")
    for kind, n in sorted(k for k in graphs if k[0] == "verify"
                          and args.batch <= k[1] <= 2 * args.batch):
        ms = replay_ms(graphs[(kind, n)], args.reps)
        print(f"| {kind} | {n} | {ms:.2f} | {ms / base:.2f} |", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
