"""How much a cold wave of compiles slows a step loop sharing its process: a probe thread runs a
fixed step-like workload (Python bookkeeping and a numpy row gather, ~1 ms) while the grammar
compiler, configured as the server resolves it on this host, compiles a workload's schemas
(every one new). Prints one table: the probe's time per iteration alone and during the wave,
the wave's wall time and the CPU time of the compile threads (xgrammar's pools included, the
schema worker processes not).

    python benchmarks/compile_contention.py --workload .work/json.jsonl --num-requests 512

On a GPU host pass --on-gpu (SCHED_IDLE compiles, threads as `guided serve` picks them there).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from common import workload_schemas

from guided.config import EngineConfig
from guided.fsm.compiler import GrammarCompiler
from guided.params import ConstraintSpec
from guided.scheduler import policy
from guided.worker import loader


def probe_iteration(table: np.ndarray, rows: np.ndarray, book: dict) -> None:
    """~1 ms of what a step's host work is made of: dict and list churn, small numpy calls."""
    for i in range(3000):
        key = i % 64
        entry = book.setdefault(key, [])
        entry.append(i)
        if len(entry) > 8:
            entry.clear()
    for _ in range(4):
        table[rows[:64]] = table[rows[64:128]]
        np.count_nonzero(table[rows[:64]])


def run_probe(seconds: float, stop: threading.Event | None = None) -> list[float]:
    table = np.random.default_rng(0).integers(0, 2**31, (4096, 1536), dtype=np.int32)
    rows = np.random.default_rng(1).integers(0, 4096, 128)
    times, book = [], {}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and not (stop is not None and stop.is_set()):
        start = time.perf_counter()
        probe_iteration(table, rows, book)
        times.append(time.perf_counter() - start)
    return times


def process_cpu_seconds() -> float:
    """CPU seconds of every thread this process ran, ended ones included (xgrammar's compile
    pools come and go): not the schema worker processes'."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, help="a file from serve.py --export-workload")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--on-gpu", action="store_true", help="resolve compile settings as on a GPU")
    ap.add_argument("--compile-threads", type=int, default=None)
    ap.add_argument("--xgrammar-threads", type=int, default=None)
    args = ap.parse_args()
    schemas = workload_schemas(args.workload, args.num_requests)
    tokenizer = loader.load_tokenizer("default")
    config = policy.resolve_compile_config(
        dataclasses.replace(EngineConfig(grammar_cache_size=1),
                            compile_threads=args.compile_threads,
                            xgrammar_threads=args.xgrammar_threads),
        on_gpu=args.on_gpu, num_cpus=os.cpu_count() or 1)
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), config=config)
    compiler.compile(ConstraintSpec.json_schema({"type": "string"}), timeout=120)  # warm
    alone = run_probe(3.0)

    stop = threading.Event()
    during: list[float] = []
    probe_cpu = [0.0]

    def probe_during() -> None:
        during.extend(run_probe(3600, stop))
        probe_cpu[0] = time.thread_time()

    probe = threading.Thread(target=probe_during)
    cpu_before, main_before = process_cpu_seconds(), time.thread_time()
    start = time.perf_counter()
    probe.start()
    futures = [compiler.submit(ConstraintSpec.json_schema(s)) for s in schemas]
    for i, future in enumerate(futures):
        future.exception()  # waits; a refusal is a result here
        print(f"\r{i + 1}/{len(futures)} compiled", end="", file=sys.stderr, flush=True)
    wall = time.perf_counter() - start
    stop.set()
    probe.join()
    # the compile threads' and their pools': all but the probe's and this waiting thread's
    cpu = (process_cpu_seconds() - cpu_before - probe_cpu[0]
           - (time.thread_time() - main_before))
    print(file=sys.stderr)
    compiler.shutdown()

    def ms(values: list[float], q: float) -> str:
        return f"{1e3 * sorted(values)[int(q * (len(values) - 1))]:.2f}"

    print(f"\n{len(schemas)} schemas compiled by {config.compile_threads} threads "
          f"(xgrammar_threads {config.xgrammar_threads}, SCHED_IDLE "
          f"{config.compile_sched_idle}, schema processes {config.schema_processes}) on "
          f"{os.cpu_count()} CPUs\n")
    print("| probe | iterations | ms p50 | ms p90 | ms mean | wave wall s | compile CPU s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| alone | {len(alone)} | {ms(alone, .5)} | {ms(alone, .9)} | "
          f"{1e3 * statistics.fmean(alone):.2f} | | |")
    print(f"| during the wave | {len(during)} | {ms(during, .5)} | {ms(during, .9)} | "
          f"{1e3 * statistics.fmean(during):.2f} | {wall:.1f} | {cpu:.1f} |")


if __name__ == "__main__":
    main()
