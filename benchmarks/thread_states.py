"""Where a process's threads spend their time, from a py-spy profile with native frames:
running, waiting for the GIL, waiting on the device, or waiting on a lock, a queue or I/O.

    py-spy record --pid PID --threads --idle --native -r 25 -d 8 -f raw -o cold.txt
    python benchmarks/thread_states.py cold.txt [warm.txt ...] [--thread guided-engine]

One table per profile: each thread group's samples by state (threads named alike, as
grammar-compile-3 and grammar-compile-7, are one group); then the named thread's commonest
waits and Python frames. A profile taken with --gil (samples of the thread holding the GIL
only) reads by its "of all" column: each group's share of the GIL. A GIL wait is a native stack that ends in the interpreter's condition
wait (take_gil, or pthread_cond_(timed)wait reached from the interpreter itself); py-spy
samples every thread whether or not it holds the GIL, so this is what the GIL costs each one.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guided.server.stats_log import thread_group

_PY_FRAME = re.compile(r"\.py:\d+\)$")
_GIL_FRAMES = ("take_gil", "PyEval_RestoreThread", "PyEval_AcquireThread", "PyEval_AcquireLock",
               "PyGILState_Ensure", "drop_gil")
_DEVICE_FRAMES = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
                  "cuStreamSynchronize", "cuEventSynchronize", "cudaMemcpy", "libcuda")
_WAIT_FRAMES = ("sem_clockwait", "sem_timedwait", "sem_wait", "futex", "epoll_wait", "poll",
                "select", "__read", "read (libc", "recv", "nanosleep", "clock_nanosleep",
                "pthread_cond")


def parse(path: str) -> list[tuple[str, list[str], int]]:
    """(thread name, frames root to leaf, samples) of each line of a py-spy raw profile."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            head, *frames = stack.split(";")
            name = head.split(": ", 1)[1] if ": " in head else head
            rows.append((name, frames, int(count)))
    return rows


def state_of(frames: list[str]) -> str:
    """running | gil | device | wait (pure: one sample's frames, root to leaf)."""
    native_tail = []
    for frame in reversed(frames):
        if _PY_FRAME.search(frame):
            break
        native_tail.append(frame)
    tail = ";".join(native_tail)
    if any(f in tail for f in _GIL_FRAMES):
        return "gil"
    if any(f in tail for f in _DEVICE_FRAMES):
        return "device"
    if "pthread_cond_timedwait" in tail and "condition_variable" not in tail:
        # CPython waits for the GIL on a condition with the switch interval as its timeout (a
        # Python lock waits on a semaphore, not a condition); without symbols for the
        # interpreter this is what is left of take_gil
        return "gil"
    if any(f in tail for f in _WAIT_FRAMES):
        return "wait"
    return "running"


def signature(frames: list[str], depth: int = 2) -> str:
    """The last Python frame and the native frames below it (at most `depth`)."""
    native = []
    for frame in reversed(frames):
        if _PY_FRAME.search(frame):
            return " > ".join([frame] + list(reversed(native))[:depth])
        native.append(frame)
    return " > ".join(list(reversed(native))[-depth:])


def functions(rows, thread: str, top: int) -> list[tuple[str, float]]:
    """The named thread's Python functions by the share of its samples they are on the stack
    of (inclusive; each function once a sample)."""
    counts, total = Counter(), 0
    for name, frames, count in rows:
        if thread_group(name) != thread:
            continue
        total += count
        seen = {frame.split(" (", 1)[0] for frame in frames if _PY_FRAME.search(frame)}
        for function in seen:
            counts[function] += count
    return [(f, c / max(total, 1)) for f, c in counts.most_common(top)]


def report(path: str, thread: str, top: int) -> None:
    rows = parse(path)
    by_group: dict[str, Counter] = defaultdict(Counter)
    threads: dict[str, set] = defaultdict(set)
    for name, frames, count in rows:
        by_group[thread_group(name)][state_of(frames)] += count
        threads[thread_group(name)].add(name)
    print(f"\n## {path}\n")
    every = sum(sum(states.values()) for states in by_group.values()) or 1
    print("| threads | n | samples | of all | running | gil | device | wait |")
    print("|---|---|---|---|---|---|---|---|")
    for group, states in sorted(by_group.items(), key=lambda kv: -kv[1]["running"]):
        total = sum(states.values())
        shares = " | ".join(f"{states[s] / total:.0%}" for s in ("running", "gil", "device",
                                                                   "wait"))
        print(f"| {group} | {len(threads[group])} | {total} | {total / every:.0%} | {shares} |")
    mine = [(frames, count) for name, frames, count in rows if thread_group(name) == thread]
    total = sum(c for _, c in mine) or 1
    for state in ("gil", "device", "wait", "running"):
        sigs = Counter()
        for frames, count in mine:
            if state_of(frames) == state:
                sigs[signature(frames)] += count
        if not sigs:
            continue
        print(f"\n{thread}, {state}: {sum(sigs.values()) / total:.0%} of its samples")
        for sig, count in sigs.most_common(top):
            print(f"- {count / total:.1%} {sig[:220]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="+", help="py-spy raw profiles (-f raw, --native --idle)")
    ap.add_argument("--thread", default="guided-engine", help="the thread group to detail")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--functions", type=int, default=0, metavar="N",
                    help="instead: the thread's N commonest Python functions (inclusive), one "
                         "column a profile (for --gil profiles: where its GIL time goes)")
    args = ap.parse_args()
    if args.functions:
        tables = [dict(functions(parse(path), args.thread, args.functions * 3))
                  for path in args.profiles]
        names = sorted({n for table in tables for n in table},
                       key=lambda n: -max(table.get(n, 0.0) for table in tables))
        print("| function | " + " | ".join(args.profiles) + " |")
        print("|---|" + "---|" * len(tables))
        for name in names[:args.functions]:
            print(f"| {name} | " + " | ".join(f"{table.get(name, 0.0):.1%}" for table in tables)
                  + " |")
        return
    for path in args.profiles:
        report(path, args.thread, args.top)


if __name__ == "__main__":
    main()
