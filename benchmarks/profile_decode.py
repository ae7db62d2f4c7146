"""Where a batch-1 decode step's time goes: graph replay, logits, sampling, host work, GEMVs.

    python benchmarks/profile_decode.py --model synthetic:llama-3-8b
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from guided import SamplingParams
from guided.config import EngineConfig
from guided.engine.core import Engine


def cuda_time(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama-3-8b")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=args.model, max_num_seqs=max(8, args.batch),
                                 max_model_len=2048))
    runner = engine.runner
    for i in range(args.batch):
        engine.add_request(f"r{i}", list(range(100 + i, 164 + i)),
                           SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    while any(len(r.output_token_ids) < 3 for r in engine.requests.values()):
        engine.step()
    sched = engine.scheduler.schedule()
    inputs = runner.prepare(sched, [False] * len(sched.scheduled))
    rows = []
    key = runner.graphs.pick(inputs.meta, inputs.input_ids.shape[0], has_drafts=False)

    def replay() -> torch.Tensor:
        return runner.graphs.run(key, inputs.input_ids, inputs.positions, inputs.meta,
                                 inputs.query_lens)

    with torch.inference_mode():
        rows.append(("graph replay (forward)", cuda_time(replay)))
        rows.append(("eager forward", cuda_time(
            lambda: runner.model(inputs.input_ids, inputs.positions, runner.kv_caches,
                                 inputs.meta), reps=10)))
        hidden = replay()
        rows.append(("compute_logits", cuda_time(lambda: runner.model.compute_logits(hidden))))
        t0 = time.perf_counter()
        for _ in range(20):
            runner.prepare(sched, [False] * len(sched.scheduled))
        rows.append(("prepare (host)", (time.perf_counter() - t0) / 20 * 1e3))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        rows.append(("engine.step (wall)", (time.perf_counter() - t0) / 20 * 1e3))
        cfg = runner.model_config
        x = torch.randn(args.batch, cfg.hidden_size, device="cuda", dtype=runner.dtype)
        layer = runner.model.layers[0]
        for name, w in (("qkv", layer.self_attn.qkv_proj.weight),
                        ("o", layer.self_attn.o_proj.weight),
                        ("gate_up", layer.mlp.gate_up_proj.weight)):
            ms = cuda_time(lambda: F.linear(x, w))
            gbs = w.numel() * w.element_size() / ms / 1e6
            rows.append((f"linear {name} {tuple(w.shape)} ({gbs:.0f} GB/s)", ms))
        xi = torch.randn(args.batch, cfg.intermediate_size, device="cuda", dtype=runner.dtype)
        w = layer.mlp.down_proj.weight
        ms = cuda_time(lambda: F.linear(xi, w))
        rows.append((f"linear down {tuple(w.shape)} "
                     f"({w.numel() * w.element_size() / ms / 1e6:.0f} GB/s)", ms))
    print(f"\n{args.model} batch {args.batch} on {torch.cuda.get_device_name()}\n")
    print("| part | ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} |")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
