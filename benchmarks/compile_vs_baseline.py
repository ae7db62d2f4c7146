"""Grammar compile time per schema: guided's compiler against xgrammar's `compile_json_schema`
as baseline_hf.py calls it (strict, compact), one schema at a time, no cache. Prints one table
(CPU: compare the two columns, not the absolute times).

    python benchmarks/compile_vs_baseline.py --workload .work/json.jsonl --num-requests 128
    python benchmarks/compile_vs_baseline.py --limit 30 [--tree /tmp/old]

--limit N takes N schemas per subset of ../shared/data, picked as coverage.py picks them.
--tree times the guided package of another checkout (e.g. `git worktree add /tmp/old REV`) on
the same schemas: a before/after comparison without two copies of this script.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed(fn) -> tuple[float, bool]:
    start = time.perf_counter()
    try:
        fn()
        ok = True
    except Exception:  # noqa: BLE001 - a refusal is a result here, timed like the rest
        ok = False
    return time.perf_counter() - start, ok


def _schemas(args) -> list:
    sys.path.insert(0, str(HERE))
    if args.workload:
        from common import workload_schemas

        return workload_schemas(args.workload, args.num_requests)
    from coverage import sample_cases

    return [case.schema for case in sample_cases(args.limit, None)]


def _guided_compiler(tokenizer):
    from guided.fsm.compiler import GrammarCompiler

    try:
        from guided.fsm.settings import CompileSettings as Settings
    except ImportError:  # a tree before fsm/settings.py (0137aa5): the engine's config
        from guided.config import EngineConfig as Settings
    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer),
                           config=Settings(grammar_cache_size=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=None, help="a file from serve.py --export-workload")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--limit", type=int, default=30, help="schemas per subset of ../shared/data")
    ap.add_argument("--tree", default=str(HERE.parent), help="the checkout whose guided to time")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import xgrammar as xgr

    from guided.params import ConstraintSpec
    from guided.worker import loader

    schemas = _schemas(args)
    tokenizer = loader.load_tokenizer("default")
    ours = _guided_compiler(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    theirs = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    results = {"guided": [], "xgrammar": []}
    for i, schema in enumerate(schemas):
        results["guided"].append(timed(
            lambda s=schema: ours.compile(ConstraintSpec.json_schema(s)).matcher()))
        results["xgrammar"].append(timed(lambda s=schema: theirs.compile_json_schema(
            json.dumps(s), strict_mode=True, any_whitespace=False)))
        print(f"\r{i + 1}/{len(schemas)} schemas", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    ours.shutdown()
    source = args.workload or f"../shared/data ({args.limit} per subset)"
    print(f"\ncompile time over {len(schemas)} schemas of {source}, one at a time, guided of "
          f"{args.tree}\n")
    print("| compiler | total s | p50 ms | p90 ms | p99 ms | max ms | compiled |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        seconds = sorted(s for s, _ in runs)
        at = [1e3 * seconds[int(q * (len(seconds) - 1))] for q in (0.5, 0.9, 0.99, 1)]
        print(f"| {name} | {sum(seconds):.1f} | " + " | ".join(f"{t:.0f}" for t in at)
              + f" | {sum(ok for _, ok in runs)}/{len(runs)} |")


if __name__ == "__main__":
    main()
