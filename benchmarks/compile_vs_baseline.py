"""Grammar compile time over a workload's schemas: guided's compiler against xgrammar's
`compile_json_schema` as baseline_hf.py calls it (strict, compact), one schema at a time, no
cache. Prints one table (CPU: compare the two columns, not the absolute times).

    python benchmarks/compile_vs_baseline.py --workload .work/json.jsonl --num-requests 128
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import workload_schemas

from guided.fsm.compiler import GrammarCompiler
from guided.fsm.settings import CompileSettings
from guided.params import ConstraintSpec
from guided.worker import loader


def timed(fn) -> tuple[float, bool]:
    start = time.perf_counter()
    try:
        fn()
        ok = True
    except Exception:  # noqa: BLE001 - a refusal is a result here, timed like the rest
        ok = False
    return time.perf_counter() - start, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, help="a file from serve.py --export-workload")
    ap.add_argument("--num-requests", type=int, default=128)
    args = ap.parse_args()
    import xgrammar as xgr

    schemas = workload_schemas(args.workload, args.num_requests)
    tokenizer = loader.load_tokenizer("default")
    ours = GrammarCompiler(tokenizer, vocab_size=len(tokenizer),
                           config=CompileSettings(grammar_cache_size=1))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    theirs = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    results = {"guided": [], "xgrammar": []}
    heavy = []  # per grammar guided compiled: whether its rows are heavy (fsm/side_fill.py)
    for i, schema in enumerate(schemas):
        results["guided"].append(timed(lambda: heavy.append(getattr(  # a DFA's has none
            ours.compile(ConstraintSpec.json_schema(schema)).matcher(), "heavy", False))))
        results["xgrammar"].append(timed(lambda: theirs.compile_json_schema(
            json.dumps(schema), strict_mode=True, any_whitespace=False)))
        print(f"\r{i + 1}/{len(schemas)} schemas", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    ours.shutdown()
    print(f"\ncompile time over {len(schemas)} schemas of {args.workload}, one at a time\n")
    print("| compiler | total s | median ms | p90 ms | max ms | compiled |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        seconds = sorted(s for s, _ in runs)
        print(f"| {name} | {sum(seconds):.1f} | {1e3 * statistics.median(seconds):.0f} | "
              f"{1e3 * seconds[int(0.9 * (len(seconds) - 1))]:.0f} | {1e3 * seconds[-1]:.0f} | "
              f"{sum(ok for _, ok in runs)}/{len(runs)} |")
    print(f"\nheavy grammars (rows filled on side threads): {sum(heavy)} of the {len(heavy)} "
          "guided compiled")


if __name__ == "__main__":
    main()
