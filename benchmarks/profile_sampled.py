"""Where an offline run's host time goes, sampled by py-spy: ms a step per function, constrained
beside free, for the step loop's thread. cProfile (profile_engine.py) times every call, which
roughly doubles the cost of the loop's many small calls and shifts the picture; py-spy reads
the stacks from outside, without pausing the process (--nonblocking).

    python benchmarks/profile_sampled.py --model default --workload .work/json.jsonl \
        --concurrency 64 [--rounds 2] [--set FIELD=VALUE] [--out DIR]

It runs itself under `py-spy record` (pip install py-spy; it must be allowed to read a child
process, as it is for a process's own child). The child warms up (grammars, CUDA graphs), then
runs the measured constrained and free passes inside marker functions, whose frames tell the
samples of each mode apart. Waits count (--idle): the loop's wait for the device or for the
mask shards shows as the frame that waits.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter

from common import add_offline_args

MARKERS = {"measured_constrained": "constrained", "measured_free": "free"}


def child(args) -> None:
    from engine_offline import compile_all, load, run

    from guided.engine.core import Engine

    options = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    engine = Engine(model=args.model, max_num_seqs=args.concurrency, **options)
    rows = compile_all(engine, load(args.workload, args.num_requests))
    warm = run(engine, rows, args.max_tokens, False)
    lengths = [max(1, n) for n in warm["lengths"]]
    run(engine, rows, lengths, True)
    steps = Counter()
    seconds = Counter()

    def measured_constrained():
        return run(engine, rows, args.max_tokens, False)

    def measured_free():
        return run(engine, rows, lengths, True)

    for k in range(args.rounds):
        for fn in (measured_constrained, measured_free):
            result = fn()
            mode = MARKERS[fn.__name__]
            steps[mode] += engine.step_times.counts.get("steps", 0)
            seconds[mode] += result["seconds"]
            print(f"round {k + 1} {mode}: {result['tok_s']:.0f} tok/s | {result['phases']}",
                  flush=True)
    with open(os.path.join(args.out, "steps.json"), "w") as f:
        json.dump({"steps": steps, "seconds": seconds}, f)
    engine.shutdown()


def frame_name(frame: str) -> str:
    """'Class.fn (path/to/file.py:123)' -> 'path/to/file.py:Class.fn'."""
    name, _, where = frame.partition(" (")
    return f"{where.split(':')[0]}:{name}" if where else name


def marker(names: list[str]) -> str | None:
    for name in names:
        for fn, mode in MARKERS.items():
            if name.endswith((f".{fn}", f":{fn}")):
                return mode
    return None


def analyze(stacks_path: str, steps: dict, rate: int, top: int) -> None:
    self_ms = {mode: Counter() for mode in MARKERS.values()}
    incl_ms = {mode: Counter() for mode in MARKERS.values()}
    total = Counter()
    with open(stacks_path, errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            names = [frame_name(fr) for fr in frames]
            mode = marker(names)
            if mode is None:
                continue
            n = int(count)
            total[mode] += n
            self_ms[mode][names[-1]] += n
            for name in set(names):
                incl_ms[mode][name] += n
    for mode in MARKERS.values():
        per_step = 1e3 / rate / max(1, steps.get(mode, 0))
        print(f"\n## {mode}: {total[mode]} samples, {steps.get(mode, 0)} steps, "
              f"{total[mode] * per_step:.2f} ms a step sampled\n")
        print("self (ms a step) | function")
        for name, n in self_ms[mode].most_common(top):
            print(f"{n * per_step:8.3f} | {name}")
        print("\ninclusive, guided's functions (ms a step) | function")
        shown = 0
        for name, n in incl_ms[mode].most_common():
            if not name.startswith("guided/"):
                continue
            print(f"{n * per_step:8.3f} | {name}")
            shown += 1
            if shown >= top:
                break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_offline_args(ap)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=int, default=1000, help="samples a second")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default=".profile")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        child(args)
        return
    stacks = os.path.join(args.out, "stacks.txt")
    cmd = ["py-spy", "record", "--format", "raw", "--idle", "--nonblocking", "--threads",
           "-r", str(args.rate), "-o", stacks, "--", sys.executable, os.path.abspath(__file__),
           "--child", *sys.argv[1:]]
    subprocess.run(cmd, check=True)
    with open(os.path.join(args.out, "steps.json")) as f:
        steps = json.load(f)["steps"]
    analyze(stacks, steps, args.rate, args.top)


if __name__ == "__main__":
    main()
