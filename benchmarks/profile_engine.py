"""Where an offline run's host time goes: the step phases, then cProfile's top functions, for
a warm constrained run (grammars compiled, CUDA graphs captured) beside a free one.

    python benchmarks/profile_engine.py --model default --workload .work/json.jsonl \
        --concurrency 64 [--min-parallel-rows 64]

Session 6 found with it that a fresh pinned mask buffer per step cost ~2.5 ms a step under the
profiler on an H200 (ModelRunner.new_bitmask), and that the drafts' rows walked depth by depth
and the token bans over the whole vocabulary were most of the mask fill.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats

from common import add_offline_args
from engine_offline import compile_all, load, run

from guided.engine.core import Engine
from guided.masks import bitmask_fill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_offline_args(ap)
    ap.add_argument("--min-parallel-rows", type=int, action="append", default=[],
                    help="also time runs with this batched-fill thread threshold")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--profile-free", action="store_true",
                    help="also profile the free run (same lengths), to set beside the other")
    ap.add_argument("--gpu-kernels", action="store_true",
                    help="also the device's time per step (torch.profiler), constrained and free")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="any other EngineConfig field, e.g. --set mask_processes=0")
    args = ap.parse_args()
    options = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    engine = Engine(model=args.model, max_num_seqs=args.concurrency, **options)
    rows = load(args.workload, args.num_requests)

    def show(tag: str, result: dict) -> None:
        print(f"{tag}: {result['tok_s']:.0f} tok/s, {result['tokens']} tokens in "
              f"{result['seconds']:.2f} s | {result['phases']}", flush=True)

    show("warm-up (compiles)", run(engine, rows, args.max_tokens, False))
    compile_all(engine, rows)  # and the large schemas' DFAs, compiled in the background
    constrained = run(engine, rows, args.max_tokens, False)
    show("constrained", constrained)
    show("free", run(engine, rows, constrained["lengths"], True))
    if args.gpu_kernels:
        device_time(engine, "constrained", lambda: run(engine, rows, args.max_tokens, False),
                    args.top)
        device_time(engine, "free", lambda: run(engine, rows, constrained["lengths"], True),
                    args.top)
    defaults = bitmask_fill.fill_bitmasks.__kwdefaults__
    default_rows = defaults["min_parallel_rows"]
    for threshold in args.min_parallel_rows:
        defaults["min_parallel_rows"] = threshold
        show(f"min_parallel_rows {threshold}", run(engine, rows, args.max_tokens, False))
    defaults["min_parallel_rows"] = default_rows
    for free in (False, True) if args.profile_free else (False,):
        profile = cProfile.Profile()
        profile.enable()
        result = run(engine, rows, constrained["lengths"] if free else args.max_tokens, free)
        profile.disable()
        show(f"{'free' if free else 'constrained'}, profiled", result)
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats("guided|xgrammar", args.top)
        print(out.getvalue())
    engine.shutdown()


def device_time(engine: Engine, tag: str, fn, top: int) -> None:
    """The device's kernel time per step under torch.profiler: whether a slower step is the
    host's (it waits on the device less) or the device's (its kernels take longer)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn()
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA"),
                     key=lambda e: -e.device_time_total)
    total_ms = sum(e.device_time_total for e in kernels) / 1e3
    steps = engine.step_times.counts.get("steps", 0) or 1
    print(f"{tag} (profiled): {result['seconds']:.2f} s, {steps} steps, device kernels "
          f"{total_ms:.0f} ms = {total_ms / steps:.2f} ms a step "
          f"({total_ms / 1e3 / result['seconds']:.0%} of the run)")
    for e in kernels[:top]:
        print(f"  {e.device_time_total / 1e3 / steps:8.3f} ms/step {e.count:7d}x  {e.key[:110]}")


if __name__ == "__main__":
    main()
