"""Grammar bitmask on the GPU: fused mask+temperature+sample and in-place mask vs xgrammar, argmax
and the bytes floor. Prints one markdown table (also $OUT/bench_bitmask.md when OUT is set).

    python benchmarks/bench_bitmask.py [--dtype bfloat16] [--smoke]

Logits are random normal (bf16 by default), the bitmask ~50% dense random, every row
constrained, sampling rows at temperature 0.7; inputs are rotated so that L2 does not serve them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from guided.kernels import bitmask as bm


def time_us(fn: Callable[[], object], device: str) -> float:
    """Median microseconds per call (triton's do_bench on the GPU, a wall clock elsewhere)."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    fn()
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = (1 << 28) if device == "cuda" else (1 << 22)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * n / (time_us(lambda: dst.copy_(src), device) * 1e-6)


def rotating(make: Callable[[], tuple], bytes_per_set: int) -> Callable[[], tuple]:
    """Cycle through enough input sets (>= 2, ~256 MB in all) that L2 cannot hold them."""
    num_sets = max(2, min(8, (256 << 20) // max(bytes_per_set, 1)))
    sets = [make() for _ in range(num_sets)]
    state = {"i": 0}

    def next_set() -> tuple:
        state["i"] = (state["i"] + 1) % num_sets
        return sets[state["i"]]

    next_set.sets = sets  # type: ignore[attr-defined]
    return next_set


def time_graph_us(fn: Callable[[object], object], sets: list, device: str) -> float | None:
    """Median µs of fn(set) replayed from CUDA graphs (one per input set): GPU time without the
    Python launch overhead, as the engine's CUDA-graph decode would see it."""
    if device != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in sets:
            fn(x)  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for x in sets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(x)
        graphs.append(graph)
    state = {"i": 0}

    def replay() -> None:
        state["i"] = (state["i"] + 1) % len(graphs)
        graphs[state["i"]].replay()

    return time_us(replay, device)


def xgrammar_apply(backend: str) -> Callable | None:
    try:
        import xgrammar
    except ImportError:
        return None

    def apply(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size,
                                             backend=backend)

    return apply


def bench_case(batch: int, vocab: int, dtype: torch.dtype, device: str, bw: float) -> dict:
    num_words = (vocab + 31) // 32

    def make() -> tuple:
        logits = torch.randn(batch, vocab, device=device).to(dtype)  # [B, V]
        bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, num_words), dtype=torch.int32,
                                device=device)  # [B, W], ~50% of bits set
        return logits, bitmask

    bytes_moved = batch * vocab * torch.finfo(dtype).bits // 8 + batch * num_words * 4
    nxt = rotating(make, bytes_moved)
    rows = torch.arange(batch, dtype=torch.int32, device=device)  # [B] all constrained
    temp = torch.full((batch,), 0.7, device=device)  # [B]
    greedy = torch.zeros(batch, device=device)  # [B]
    seeds = torch.randint(0, 2**62, (batch,), device=device)  # [B]

    def sample(t: torch.Tensor) -> Callable[[], object]:
        return lambda: bm.masked_sample(*nxt(), rows, t, seeds, vocab_size=vocab)

    row = {
        "batch": batch, "vocab": vocab,
        "masked_sample T=0.7": time_us(sample(temp), device),
        "masked_sample T=0.7 graph": time_graph_us(
            lambda x: bm.masked_sample(*x, rows, temp, seeds, vocab_size=vocab), nxt.sets, device),
        "masked_sample greedy": time_us(sample(greedy), device),
        "apply_token_bitmask_": time_us(
            lambda: bm.apply_token_bitmask_(*nxt(), rows, vocab_size=vocab), device),
    }
    for backend in ("cuda", "triton"):
        apply = xgrammar_apply(backend) if device == "cuda" else None
        name = f"xgr {backend}"
        try:
            row[name] = None if apply is None else time_us(
                lambda apply=apply: apply(*nxt(), vocab), device)
        except Exception as exc:  # noqa: BLE001 - an xgrammar build without this backend
            print(f"xgrammar backend={backend} failed: {type(exc).__name__}: {exc}")
            row[name] = None
    row["torch.argmax"] = time_us(lambda: torch.argmax(nxt()[0], dim=-1), device)
    row["bytes floor"] = bytes_moved / bw * 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    batches, vocabs = ([1, 4], [1000]) if args.smoke else ([1, 64, 256, 1024],
                                                            [49152, 128256, 151936])
    bw = copy_bandwidth(device)
    rows = []
    for vocab in vocabs:
        for batch in batches:
            rows.append(bench_case(batch, vocab, dtype, device, bw))
            print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in rows[-1].items()},
                  flush=True)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    title = (f"bitmask kernels on {name}, {args.dtype} logits, ~50% dense bitmask, all rows "
             f"constrained; median µs (triton do_bench); copy bandwidth {bw / 1e12:.2f} TB/s "
             f"(read + write); floor = logits + bitmask read once")
    lines = [title, ""]
    cols = list(rows[0])
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        cells = [str(r[c]) if c in ("batch", "vocab") else
                 ("n/a" if r[c] is None else f"{r[c]:.1f}") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_bitmask.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
