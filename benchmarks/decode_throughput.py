"""Decode tokens/s at several batch sizes, and the batch-1 decode step beside the HBM floor.

    python benchmarks/decode_throughput.py --model default --model synthetic:llama-3-8b \
        --batch 1,16,64,256 [--tensor-parallel-size 2]

Decode is timed after every request finished its prefill: B requests with short prompts and
ignore_eos, N decode steps (tokens per request) timed with a device sync at the end. The floor
is the bytes a decode step must read (weights once, plus the K/V of the batch) over the bandwidth of a measured
device-to-device copy (read + write counted).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

from guided import SamplingParams
from guided.config import EngineConfig
from guided.engine.core import Engine


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy, counting read + write."""
    n = 1 << 28  # 1 GiB of bf16... 512 MiB x 2 bytes
    src = torch.randn(n // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * src.numel() * src.element_size() / times[len(times) // 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(engine: Engine, batch: int, num_steps: int, prompt_len: int) -> dict:
    params = SamplingParams(max_tokens=num_steps + 64, temperature=0.0, ignore_eos=True)
    prompt = list(range(100, 100 + prompt_len))
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [t + i for t in prompt], params)
    # prefill everything, then a few warm-up decode steps
    while any(len(r.output_token_ids) < 3 for r in engine.requests.values()):
        engine.step()
    # above tensor parallel 1 the ranks own the GPUs: each step's tokens come back from rank 0,
    # so the engine's process never syncs (nor opens a CUDA context of its own)
    device = torch.device(engine.executor.device if engine.runner else "cpu")
    requests = list(engine.requests.values())
    start = min(len(r.output_token_ids) for r in requests)
    sync(device)
    t0 = time.perf_counter()
    while min(len(r.output_token_ids) for r in requests) - start < num_steps:
        engine.step()
    sync(device)
    elapsed = time.perf_counter() - t0
    num_steps = min(len(r.output_token_ids) for r in requests) - start
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    engine.step()
    kv_tokens = batch * (prompt_len + num_steps)
    return {"batch": batch, "step_ms": 1e3 * elapsed / num_steps,
            "tok_s": batch * num_steps / elapsed, "kv_tokens": kv_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", default=None)
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks (GPUs); above 1 the HBM floor is not computed")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    models = args.model or ["default"]
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    for model in models:
        config = EngineConfig(model=model, max_num_seqs=max(batches), max_model_len=2048,
                              cuda_graphs=not args.no_cuda_graphs,
                              tensor_parallel_size=args.tensor_parallel_size)
        engine = Engine(config)
        runner = engine.runner  # None above tensor parallel 1: the ranks hold the model
        device = torch.device(engine.executor.device)
        bw = copy_bandwidth(device) if device.type == "cuda" and runner else None
        weight_bytes = kv_per_token = 0
        if runner is not None:
            weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
            kv_per_token = runner.kv_bytes_per_block() / engine.config.block_size
        for batch in batches:
            r = measure(engine, batch, args.steps, args.prompt_len)
            floor_ms = None
            if bw:
                avg_kv = r["kv_tokens"] - batch * args.steps / 2
                floor_ms = 1e3 * (weight_bytes + avg_kv * kv_per_token) / bw
            r.update(model=model, dtype=engine.executor.dtype, tp=args.tensor_parallel_size,
                     floor_ms=floor_ms, weight_gb=weight_bytes / 1e9,
                     bw_tbs=bw / 1e12 if bw else None,
                     graphs=config.cuda_graphs and device.type == "cuda")
            rows.append(r)
            print(f"{model} batch {batch}: {r['tok_s']:.0f} tok/s, step {r['step_ms']:.2f} ms"
                  + (f" (floor {floor_ms:.2f} ms)" if floor_ms else ""), file=sys.stderr)
        engine.shutdown()
        del engine
        gc.collect()  # the engine's cycles hold its KV cache until collected (the next one OOMs)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\ndecode throughput on {gpu} (steps {args.steps}, prompt {args.prompt_len}, "
          f"CUDA graphs {'off' if args.no_cuda_graphs else 'on'})\n")
    print("| model | dtype | TP | batch | decode tok/s | step ms | HBM floor ms | step / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        floor = f"{r['floor_ms']:.2f}" if r["floor_ms"] else "-"
        ratio = f"{r['step_ms'] / r['floor_ms']:.2f}" if r["floor_ms"] else "-"
        print(f"| {r['model']} | {r['dtype']} | {r['tp']} | {r['batch']} | {r['tok_s']:.0f} | "
              f"{r['step_ms']:.2f} | {floor} | {ratio} |")
    if rows and rows[0]["bw_tbs"]:
        print(f"\ncopy bandwidth (read + write): {rows[0]['bw_tbs']:.2f} TB/s")
    out = args.json_out or (os.path.join(os.environ["OUT"], "decode.json")
                            if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
