"""What building the device's DFA tables (guided/fsm/dfa_tables.py) costs the engine's process,
in the thread that asks against on worker processes (guided/fsm/table_worker.py), CPU:

    python benchmarks/bench_dfa_tables.py --workload .work/json.jsonl --num-requests 256

The workload's schemas that the token-level DFA serves are compiled, then each grammar's
tables are built both ways, one after the other: the engine-process CPU time of the asking
thread (time.thread_time: what holds the engine's GIL), the wall time, and how many grammars
got tables (the rest are over device_dfa_max_index_bytes). Then the tables are admitted to a
DeviceDfa on the CPU (what the first multi-step call with them copies up). One table.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from common import markdown_table, progress, workload_schemas

from guided.config import EngineConfig
from guided.errors import ConstraintError
from guided.fsm.backends.dfa_backend import TokenDfa
from guided.fsm.compiler import GrammarCompiler
from guided.fsm.table_worker import TableWorkers
from guided.params import ConstraintSpec
from guided.worker import loader
from guided.worker.device_dfa import DeviceDfa


def build_all(dfas, max_bytes: int, workers: TableWorkers | None) -> tuple[int, float, float]:
    built, cpu, started = 0, 0.0, time.perf_counter()
    for i, dfa in enumerate(dfas):
        before = time.thread_time()
        built += dfa.build_tables(max_bytes, workers) is not None
        cpu += time.thread_time() - before
        if i % 50 == 49:
            progress(f"  {i + 1}/{len(dfas)}")
    return built, cpu, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    config = EngineConfig(grammar_cache_size=4096)
    tokenizer = loader.load_tokenizer("default")
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), config=config)
    progress("compiling the workload's schemas")
    specs = [ConstraintSpec.json_schema(s) for s in workload_schemas(args.workload,
                                                                   args.num_requests)]
    grammars = []
    for spec in specs:
        try:
            grammars.append(compiler.compile(spec, timeout=120))
        except ConstraintError:
            pass
    rows = []
    for label, use_workers in (("in the asking thread", False), ("worker processes", True)):
        # fresh indexes of the same regexes: a grammar's tables are built once
        served = [g.matcher().dfa for g in grammars if g.backend == "dfa"]
        dfas = [TokenDfa(d.regex, d.vocab) for d in served]
        vocab = dfas[0].vocab
        workers = TableWorkers(args.workers, eos=vocab.eos_id, token_map=vocab.token_map,
                               num_words=vocab.num_words) if use_workers else None
        progress(f"building {len(dfas)} grammars' tables {label}")
        try:
            built, cpu, wall = build_all(dfas, config.device_dfa_max_index_bytes, workers)
        finally:
            if workers is not None:
                workers.shutdown()
        store = DeviceDfa(vocab.num_words, torch.device("cpu"), host_rows=config.max_num_seqs,
                          max_rows=config.device_dfa_max_rows,
                          max_exceptions=config.device_dfa_max_exceptions, eos=vocab.eos_id)
        started = time.perf_counter()
        admitted = sum(store.admit(d) for d in dfas if d.tables is not None)
        admit_s = time.perf_counter() - started
        rows.append([label, len(dfas), built, f"{cpu:.2f}", f"{wall:.2f}", admitted,
                     f"{admit_s:.2f}"])
    print(f"\nDFA tables of {args.workload} ({args.num_requests} requests), "
          f"{args.workers} workers, {os.cpu_count()} CPUs\n")
    print(markdown_table(["built", "grammars", "with tables", "engine-process CPU s",
                          "wall s", "admitted", "admission s (CPU tensors)"], rows))


if __name__ == "__main__":
    main()
