"""Grammar compiles on a thread beside a busy Python thread (the step loop's stand-in).

The engine compiles on threads (guided/fsm/compiler.py) on the grounds that xgrammar compiles
without the GIL. This measures how far that holds: a workload's schemas compiled by guided's
compiler, one at a time on its compile thread, alone and beside a thread spinning in Python, at
the compile threads' niceness 0 and the default +10. It prints the compiles' wall time and the
spinning thread's rate against its rate alone: a rate well below 1.00x means the compiles hold
the GIL for part of their time, and a compile wall far above the one alone means they wait for
it. One markdown table (CPU; ratios are what transfer, not times).

    python benchmarks/bench_compile_gil.py --workload .work/json.jsonl --num-requests 48

--stages times each stage of a compile the same way, over the stages' own inputs: the schema
check and its regex (Python), the regex's size, outlines-core's index of a small and of a
large regex, xgrammar's compile of the schemas it serves. A stage that keeps the busy thread
at 1.00x runs without the GIL; at 0.50x it holds it throughout (on two cores).

    python benchmarks/bench_compile_gil.py --workload .work/json.jsonl --num-requests 512 --stages
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
    parser.add_argument("--stages", action="store_true",
                        help="each stage of a compile beside the busy thread, not whole compiles")
    args = parser.parse_args()
    if args.stages:
        stages(workload_schemas(args.workload, args.num_requests))
        return
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


def beside(fn, items: list, alone_rate: float) -> tuple[float, float]:
    """fn over items on a thread beside a spinning one: (seconds, the spinner's rate against
    alone_rate)."""
    def each() -> None:
        for item in items:
            try:
                fn(item)
            except Exception:  # noqa: BLE001 - a refusal is timed like the rest
                pass

    done, wall = threading.Event(), []
    worker = threading.Thread(target=lambda: (wall.append(timed(each)), done.set()))
    start, count = time.perf_counter(), 0
    worker.start()
    while not done.is_set():  # spin_rate's loop, counted to the end however short the stage
        for _ in range(1000):
            count += 1
        time.perf_counter()
    worker.join()
    return wall[0], count / (time.perf_counter() - start) / alone_rate


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def stages(schemas: list) -> None:
    from guided.fsm.backends.dfa_backend import DfaVocab, TokenDfa
    from guided.fsm.regex_size import regex_size
    from guided.fsm.schema_check import check_schema
    from guided.fsm.schema_regex import schema_regex

    tokenizer = load_tokenizer("default")
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer),
                               config=EngineConfig(grammar_cache_size=1, device_dfa=False))
    checked, small, large, xgrammar = [], [], [], []
    for schema in schemas:
        try:
            checked.append(check_schema(schema))
        except Exception:  # noqa: BLE001 - refused: not compiled by any backend
            continue
        try:
            regex = schema_regex(checked[-1])
        except Exception:  # noqa: BLE001 - not regular: xgrammar's
            xgrammar.append(checked[-1])
            continue
        size = regex_size(regex)
        (small if size <= compiler.config.dfa_max_wait_size else large).append(regex)
        if size > compiler.config.dfa_max_wait_size:
            xgrammar.append(checked[-1])  # served by xgrammar while its DFA builds
    vocab = DfaVocab(compiler.vocab)
    alone_rate = spin_rate(2.0)
    print(f"\n{len(schemas)} schemas: {len(checked)} accepted, {len(small)} small regexes, "
          f"{len(large)} large ones, {len(xgrammar)} compiled by xgrammar\n")
    print("| stage | items | s beside a busy thread | busy thread's rate |")
    print("|---|---|---|---|")
    for name, fn, items in (
            ("check_schema", check_schema, schemas),
            ("schema_regex", schema_regex, checked),
            ("regex_size", regex_size, small + large),
            ("outlines-core index, small regexes", lambda r: TokenDfa(r, vocab), small[:150]),
            ("outlines-core index, large regexes", lambda r: TokenDfa(r, vocab), large[:6]),
            ("xgrammar compile", compiler._xgrammar.compile_checked_schema, xgrammar)):
        seconds, rate = beside(fn, items, alone_rate)
        shown = f"{rate:.2f}x" if seconds >= 0.05 else "(too short to tell)"
        print(f"| {name} | {len(items)} | {seconds:.2f} | {shown} |", flush=True)
    compiler.shutdown()


if __name__ == "__main__":
    main()
