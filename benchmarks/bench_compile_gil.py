"""Grammar compiles on a thread beside a busy Python thread (the step loop's stand-in).

The engine compiles on threads (guided/fsm/compiler.py) on the grounds that xgrammar compiles
without the GIL. This measures how far that holds: a workload's schemas compiled by guided's
compiler, one at a time on its compile thread, alone and beside a thread spinning in Python, at
the compile threads' niceness 0 and the default +10. It prints the compiles' wall time and the
spinning thread's rate against its rate alone: a rate well below 1.00x means the compiles hold
the GIL for part of their time, and a compile wall far above the one alone means they wait for
it. One markdown table (CPU; ratios are what transfer, not times).

    python benchmarks/bench_compile_gil.py --workload .work/json.jsonl --num-requests 48
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import workload_schemas

from guided.config import EngineConfig
from guided.fsm.compiler import GrammarCompiler
from guided.params import ConstraintSpec
from guided.worker.loader import load_tokenizer


def spin_rate(seconds: float) -> float:
    """Python loop iterations a second (a busy thread's progress)."""
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            count += 1
    return count / seconds


def compile_all(compiler: GrammarCompiler, specs: list[ConstraintSpec]) -> float:
    start = time.perf_counter()
    for spec in specs:
        try:
            compiler.compile(spec)
        except Exception:  # noqa: BLE001 - a refused schema is timed like the rest
            pass
    return time.perf_counter() - start


def beside_spinner(compiler: GrammarCompiler, specs: list[ConstraintSpec], alone_rate: float
                   ) -> tuple[float, float]:
    """The compiles' wall time with a Python thread spinning meanwhile, and its rate then
    against alone_rate."""
    done, wall = threading.Event(), []
    worker = threading.Thread(target=lambda: (wall.append(compile_all(compiler, specs)),
                                              done.set()))
    worker.start()
    start, count = time.perf_counter(), 0.0
    while not done.is_set():
        count += spin_rate(0.1) * 0.1
    worker.join()
    return wall[0], count / (time.perf_counter() - start) / alone_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, help="a file from serve.py --export-workload")
    parser.add_argument("--num-requests", type=int, default=48)
    args = parser.parse_args()
    specs = [ConstraintSpec.json_schema(schema)
             for schema in workload_schemas(args.workload, args.num_requests)]
    tokenizer = load_tokenizer("default")
    alone_rate = spin_rate(2.0)
    print(f"\n{len(specs)} schemas of {args.workload}, compiled one at a time on one compile "
          "thread (no cache)\n")
    print("| compile thread nice | compiles alone s | compiles beside a busy thread s "
          "| busy thread's rate |")
    print("|---|---|---|---|")
    for nice in (0, 10):
        config = EngineConfig(compile_threads=1, compile_nice=nice, grammar_cache_size=1)
        results = []
        for measure in (compile_all, lambda c, s: beside_spinner(c, s, alone_rate)):
            compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), config=config)
            try:  # a compiler of its own each time: nothing cached from the run before
                results.append(measure(compiler, specs))
            finally:
                compiler.shutdown()
        alone, (beside, rate) = results
        print(f"| {nice:+d} | {alone:.2f} | {beside:.2f} | {rate:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
