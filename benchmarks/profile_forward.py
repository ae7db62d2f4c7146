"""Where a step's device time goes: torch.profiler's kernels over decode steps and a prefill wave.

    python benchmarks/profile_forward.py --model synthetic:llama-3-8b [--batch 64]
        [--prompt-len 300] [--max-num-batched-tokens 2048] [--rows 12]

Decode: --batch requests of --prompt-len tokens (ignore_eos), prefilled, then 40 timed steps and
20 profiled ones. Prefill: a wave of --batch new prompts (distinct, so no prefix-cache hits)
through steps of at most --max-num-batched-tokens tokens, two waves to warm up, one timed and
one profiled. Each phase prints its time and the kernels by device time (a table each).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from guided import SamplingParams
from guided.config import EngineConfig
from guided.engine.core import Engine


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernels(prof, rows: int) -> str:
    by = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    return prof.key_averages().table(sort_by=by, row_limit=rows, max_name_column_width=60)


def activities() -> list:
    return [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]


def prompt(tag: int, i: int, length: int) -> list[int]:
    return [100 + (j * 7 + i * 13 + tag * 101) % 20000 for j in range(length)]


def decode(engine: Engine, batch: int, prompt_len: int, rows: int) -> None:
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", prompt(0, i, prompt_len), params)
    while any(len(r.output_token_ids) < 10 for r in engine.requests.values()):
        engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(40):
        engine.step()
    sync()
    print(f"decode, batch {batch}: {1e3 * (time.perf_counter() - t0) / 40:.3f} ms a step")
    with profile(activities=activities()) as prof:
        for _ in range(20):
            engine.step()
        sync()
    print(f"kernels of 20 decode steps:\n{kernels(prof, rows)}")
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    engine.step()


def prefill_wave(engine: Engine, tag: int, batch: int, prompt_len: int) -> int:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{tag}-{i}", prompt(tag, i, prompt_len), params)
    steps = 0
    while engine.requests:
        engine.step()
        steps += 1
    return steps


def prefill(engine: Engine, batch: int, prompt_len: int, rows: int) -> None:
    prefill_wave(engine, 1, batch, prompt_len)
    prefill_wave(engine, 2, batch, prompt_len)
    sync()
    t0 = time.perf_counter()
    steps = prefill_wave(engine, 3, batch, prompt_len)
    sync()
    elapsed = time.perf_counter() - t0
    print(f"prefill of {batch} x {prompt_len} tokens: {steps} steps, {1e3 * elapsed:.1f} ms, "
          f"{batch * prompt_len / elapsed:.0f} tok/s")
    with profile(activities=activities()) as prof:
        prefill_wave(engine, 4, batch, prompt_len)
        sync()
    print(f"kernels of one prefill wave:\n{kernels(prof, rows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:llama-3-8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=12, help="kernels listed per table")
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=args.model, max_num_seqs=max(args.batch, 64),
                                 max_model_len=2048,
                                 max_num_batched_tokens=args.max_num_batched_tokens))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{args.model} on {device}", file=sys.stderr)
    decode(engine, args.batch, args.prompt_len, args.rows)
    prefill(engine, args.batch, args.prompt_len, args.rows)
    engine.shutdown()


if __name__ == "__main__":
    main()
