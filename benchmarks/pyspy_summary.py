"""Where a guided server's time went, from a py-spy profile in its raw format (`py-spy record
--subprocesses --threads --format raw`, as benchmarks/profile_serve.sh takes it): samples per
thread (numbered threads of a pool together), then the engine process's main thread (the step
loop) by function, inclusive and self. Prints markdown.

    python benchmarks/pyspy_summary.py profile.txt [--top 30]
"""
from __future__ import annotations

import argparse
import re
from collections import Counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    threads, inclusive, own = Counter(), Counter(), Counter()
    loop_samples = 0
    with open(args.profile) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit() or not stack.startswith("process "):
                continue  # a piece of a sample whose frame text held a newline: left out
            frames = stack.split(";")
            process = [f for f in frames if f.startswith("process ")][-1]
            thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
            code = [f for f in frames if not f.startswith(("process ", "thread "))]
            name = re.sub(r"[_-]\d+$", "-N", thread.split(": ", 1)[-1])  # a pool's threads as one
            threads[(re.sub(r"^process \d+:", "", process)[:60], name)] += int(count)
            if name == "MainThread" and any("engine_process.py" in f for f in code):
                loop_samples += int(count)
                own[code[-1]] += int(count)
                start = next(i for i, f in enumerate(code) if "engine_process.py" in f)
                for frame in set(code[start:]):  # from the loop down, not the process's start
                    inclusive[frame] += int(count)
    print("| process | thread | samples |\n|---|---|---:|")
    for (process, name), n in threads.most_common(args.top):
        print(f"| `{process}` | {name} | {n} |")
    print(f"\nThe step loop (the engine process's main thread): {loop_samples} samples\n")
    print("| function | inclusive | self |\n|---|---:|---:|")
    for frame, n in inclusive.most_common(args.top):
        print(f"| `{frame}` | {n} | {own.get(frame, 0)} |")


if __name__ == "__main__":
    main()
