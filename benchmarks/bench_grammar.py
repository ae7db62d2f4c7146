"""Grammar compile time (cold / cached) and bitmask fill time per token over JSONSchemaBench.

For each subset: compile up to --per-subset schemas (cold: a fresh compiler; cached: a second
submit of the same spec), then walk each valid instance's tokens, timing fill_bitmask before
every token. Also times fill_draft_rows over a batch of matchers halfway through an instance,
without drafts and with the instance's next tokens as drafts, one thread vs several; and the
time of a compile's Python (held under the GIL) a schema. Prints markdown.

    python benchmarks/bench_grammar.py [--per-subset N] [--batch 64]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import torch
from grammar_soundness import DATA, load_cases


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-subset", type=int, default=25)
    parser.add_argument("--instances", type=int, default=2, help="valid instances per schema")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--drafts", type=int, default=4, help="drafts per matcher at most")
    args = parser.parse_args()

    from conftest import load_test_tokenizer

    from guided.errors import ConstraintError
    from guided.fsm.compiler import GrammarCompiler
    from guided.fsm.settings import CompileSettings
    from guided.masks.bitmask_fill import fill_draft_rows
    from guided.params import ConstraintSpec

    tokenizer = load_test_tokenizer()
    config = CompileSettings(compile_threads=1, compile_timeout_s=30)
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), config=config)
    eos = compiler.vocab.eos_token_ids[0]
    files = sorted(str(p) for p in (DATA / "jsonschemabench").glob("*.jsonl"))
    cases = load_cases(args.per_subset, files)
    compile_python(cases)  # first: no compile has met these grammars yet
    words = (compiler.vocab.vocab_size + 31) // 32
    bitmask = torch.zeros(args.batch, words, dtype=torch.int32)  # (batch, ceil(V / 32))
    rows = []
    all_fill: list[float] = []
    batch_matchers = []
    subsets = sorted({c.subset for c in cases})
    for n, subset in enumerate(subsets):
        cold, cached, fill, refused = [], [], [], 0
        for case in (c for c in cases if c.subset == subset):
            spec = ConstraintSpec.json_schema(case.schema)
            start = time.perf_counter()
            try:
                grammar = compiler.compile(spec)
            except ConstraintError:
                refused += 1
                continue
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            compiler.submit(spec).result()
            cached.append(time.perf_counter() - start)
            for value, ok in case.instances[: args.instances]:
                if not ok:
                    continue
                ids = tokenizer.encode(json.dumps(value, sort_keys=True, ensure_ascii=False),
                                       add_special_tokens=False)
                matcher = grammar.matcher()
                for token in [*ids, eos]:
                    start = time.perf_counter()
                    matcher.fill_bitmask(bitmask, 0)
                    fill.append(time.perf_counter() - start)
                    if not matcher.accept_token(token):
                        break
                if len(batch_matchers) < args.batch:
                    m = grammar.matcher()
                    half = len(ids) // 2
                    if all(m.accept_token(token) for token in ids[:half]):
                        batch_matchers.append((m, ids[half:half + args.drafts]))
        all_fill += fill
        rows.append((subset, len(cold), refused, cold, cached, fill))
        print(f"[{n + 1}/{len(subsets)}] {subset}: {len(cold)} compiled, {len(fill)} fills",
              file=sys.stderr, flush=True)

    print("| subset | compiled | refused | compile p50 ms (cold) | compile p99 ms (cold) | "
          "cached p50 µs | cached p99 µs | mask fill p50 µs | mask fill p99 µs | tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    every_cold = [x for r in rows for x in r[3]]
    every_cached = [x for r in rows for x in r[4]]
    for subset, ok, refused, cold, cached, fill in [*rows, ("**all**", len(every_cold), sum(
            r[2] for r in rows), every_cold, every_cached, all_fill)]:
        print(f"| {subset} | {ok} | {refused} | {pct(cold, .5) * 1e3:.1f} | "
              f"{pct(cold, .99) * 1e3:.1f} | {pct(cached, .5) * 1e6:.1f} | "
              f"{pct(cached, .99) * 1e6:.1f} | {pct(fill, .5) * 1e6:.1f} | "
              f"{pct(fill, .99) * 1e6:.1f} | {len(fill)} |")

    print("\n| batch | drafts a matcher | rows | serial µs/step | threads µs/step | threads |\n"
          "|---:|---:|---:|---:|---:|---:|")
    for size in (1, 8, 16, 32, 64, 128, 256):
        if size > len(batch_matchers):
            break
        for with_drafts in (False, True):
            items, row = [], 0
            for m, drafts in batch_matchers[:size]:
                items.append((m, drafts if with_drafts else [], row))
                row += len(items[-1][1]) + 1
            rows_mask = torch.zeros(row, words, dtype=torch.int32)
            timings = {}
            for threads in (1, args.threads):
                fill_draft_rows(items, rows_mask, num_threads=threads)  # warm up
                start = time.perf_counter()
                for _ in range(20):
                    fill_draft_rows(items, rows_mask, num_threads=threads)
                timings[threads] = (time.perf_counter() - start) / 20 * 1e6
            print(f"| {size} | {(row - size) / size:.1f} | {row} | {timings[1]:.0f} | "
                  f"{timings[args.threads]:.0f} | {args.threads} |")
    compiler.shutdown()


def compile_python(cases) -> None:
    """The Python of every schema's compile, one schema after another as a server's compiles
    meet them: what a compile thread runs holding the GIL the step loop needs (the grammar-text
    rewrites of grammar_text.py, the bounds check of grammar_bounds.py)."""
    import xgrammar as xgr

    from guided.errors import ConstraintError
    from guided.fsm.grammar_bounds import check_grammar_bounds
    from guided.fsm.grammar_text import budget_long_repetitions, exact_utf8
    from guided.fsm.schema_check import check_schema

    grammars = []
    for case in cases:
        try:
            checked = json.dumps(check_schema(case.schema))
            grammars.append(xgr.Grammar.from_json_schema(checked, strict_mode=True))
        except (ConstraintError, RuntimeError, ValueError):
            continue
    texts = [str(grammar) for grammar in grammars]
    serialized = [grammar.serialize_json() for grammar in grammars]
    start = time.perf_counter()
    for text in texts:
        budget_long_repetitions(exact_utf8(text))
    middle = time.perf_counter()
    for data in serialized:
        try:
            check_grammar_bounds(data)
        except ConstraintError:
            pass
    end = time.perf_counter()
    each = 1e6 / max(len(texts), 1)
    print(f"a compile's Python over {len(texts)} schemas' grammars: grammar-text rewrites "
          f"{(middle - start) * each:.0f} µs a grammar, bounds check {(end - middle) * each:.0f} "
          "µs a grammar\n")

if __name__ == "__main__":
    main()
