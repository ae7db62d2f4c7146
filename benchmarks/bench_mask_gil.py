"""Mask filling on a second thread beside a busy Python thread, at two GIL switch intervals.

xgrammar fills bitmasks without the GIL, so a mask thread could run beside the step loop; but it
needs the GIL back after every fill, and a thread waiting for it waits up to the switch interval
while another thread runs Python. This times one "step" of a mask thread (a batched fill of 64
rows, then each matcher walked one token on and back, as draft rows do) alone and beside a thread
spinning in Python (medians of --repeats runs). Prints one markdown table (CPU; ratios are what
transfer, not times).

    python benchmarks/bench_mask_gil.py [--rows 64] [--steps 20] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import xgrammar as xgr

from guided.config import EngineConfig
from guided.fsm.compiler import GrammarCompiler
from guided.params import ConstraintSpec
from guided.worker.loader import load_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
          "required": ["a", "b"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="median of this many runs")
    args = parser.parse_args()

    tokenizer = load_tokenizer("default")
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer),
                               config=EngineConfig(compile_threads=1))
    grammar = compiler.compile(ConstraintSpec.json_schema(SCHEMA))
    matchers = [grammar.matcher().xgrammar_matcher for _ in range(args.rows)]
    prefix = tokenizer.encode('{"a": "hello world this is', add_special_tokens=False)
    for m in matchers:
        assert all(m.accept_token(t) for t in prefix)
    token = tokenizer.encode(" a", add_special_tokens=False)[0]
    bitmask = xgr.allocate_token_bitmask(args.rows, len(tokenizer))
    batch = xgr.BatchGrammarMatcher(max_threads=2)

    def mask_steps() -> float:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            batch.batch_fill_next_token_bitmask(matchers, bitmask)
            for m in matchers:
                m.accept_token(token)
            for m in matchers:
                m.rollback(1)
        return (time.perf_counter() - t0) / args.steps * 1e3

    def beside_busy_thread(interval_s: float) -> float:
        old = sys.getswitchinterval()
        sys.setswitchinterval(interval_s)
        stop = threading.Event()

        def spin() -> None:
            n = 0
            while not stop.is_set():
                n += 1

        spinner = threading.Thread(target=spin)
        spinner.start()
        result: list[float] = []
        worker = threading.Thread(target=lambda: result.append(mask_steps()))
        worker.start()
        worker.join()
        stop.set()
        spinner.join()
        sys.setswitchinterval(old)
        return result[0]

    mask_steps()  # warm up
    alone = statistics.median(mask_steps() for _ in range(args.repeats))
    rows = [("alone", alone)] + [
        (f"beside a busy thread, switch interval {s * 1e3:g} ms",
         statistics.median(beside_busy_thread(s) for _ in range(args.repeats)))
        for s in (0.005, 0.0005)]
    print(f"mask thread, {args.rows} rows per step, default model's vocabulary "
          f"({len(tokenizer)} tokens)\n")
    print("| mask thread | ms per step | x alone |\n|---|---|---|")
    for label, ms in rows:
        print(f"| {label} | {ms:.2f} | {ms / alone:.1f} |")


if __name__ == "__main__":
    main()
