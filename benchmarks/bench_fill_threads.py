"""How a batch of grammar mask rows is best filled: a Python loop, xgrammar's batched call on 1-N
of its threads, or a Python thread pool over GIL-free per-row calls; by batch size.

The matchers come from the workload's JSON schemas, each walked a random number of random
allowed tokens (seeded) so that the rows mix JSON structure and string positions, as a step's
rows do. One table: median ms per batch and µs per row.

    python benchmarks/bench_fill_threads.py --workload .work/json.jsonl [--batch 8 --batch 64]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def walked_matchers(compiler, schemas: list[str], *, max_depth: int, seed: int) -> list:
    from guided.errors import ConstraintError
    from guided.params import ConstraintSpec

    rng = random.Random(seed)
    words = (compiler.vocab.vocab_size + 31) // 32
    row = torch.zeros(1, words, dtype=torch.int32)
    matchers = []
    for schema in schemas:
        try:
            matcher = compiler.submit(ConstraintSpec.json_schema(schema)).result().matcher()
        except ConstraintError:  # refused (as the server would): not a row of any step
            continue
        for _ in range(rng.randrange(max_depth)):
            matcher.fill_bitmask(row, 0)
            bits = row[0].numpy().view("uint32")
            allowed = [w * 32 + b for w in range(len(bits)) if bits[w]
                       for b in range(32) if bits[w] >> b & 1]
            allowed = [t for t in allowed if t not in compiler.vocab.eos_token_ids]
            if not allowed or not matcher.accept_token(rng.choice(allowed)):
                break
        matchers.append(matcher)
    return matchers


def timed(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--threads", type=int, action="append", default=[])
    ap.add_argument("--max-depth", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    batches = args.batch or [8, 16, 32, 64]
    thread_counts = args.threads or [2, 4, 8]

    import xgrammar as xgr

    from guided.config import EngineConfig
    from guided.fsm.compiler import GrammarCompiler
    from guided.worker import loader

    tokenizer = loader.load_tokenizer("default")
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), config=EngineConfig())
    schemas = []
    with open(args.workload) as f:
        bodies = [json.loads(line)["body"] for line in f]
    for body in bodies:
        schema = (body.get("response_format") or {}).get("json_schema", {}).get("schema")
        if schema is not None:
            schemas.append(json.dumps(schema))
    print(f"walking up to {len(schemas)} matchers...", file=sys.stderr, flush=True)
    matchers = walked_matchers(compiler, schemas[:2 * max(batches)], max_depth=args.max_depth,
                               seed=0)[:max(batches)]
    batches = [n for n in batches if n <= len(matchers)]
    if not batches:
        raise SystemExit(f"only {len(matchers)} usable schemas in {args.workload}")
    raw = [m.xgrammar_matcher for m in matchers]
    words = (compiler.vocab.vocab_size + 31) // 32
    bitmask = torch.zeros(max(batches), words, dtype=torch.int32)
    batchers = {t: xgr.BatchGrammarMatcher(max_threads=t) for t in [1, *thread_counts]}
    pools = {t: ThreadPoolExecutor(t) for t in thread_counts}

    def loop(n: int) -> None:
        for i in range(n):
            raw[i].fill_next_token_bitmask(bitmask, i)

    def batched(n: int, t: int) -> None:
        batchers[t].batch_fill_next_token_bitmask(raw[:n], bitmask, indices=list(range(n)))

    def pooled(n: int, t: int) -> None:
        def chunk(start: int) -> None:
            for i in range(start, n, t):
                raw[i].fill_next_token_bitmask(bitmask, i)
        for future in [pools[t].submit(chunk, s) for s in range(min(t, n))]:
            future.result()

    modes = [("loop", loop), ("batched x1", lambda n: batched(n, 1))]
    modes += [(f"batched x{t}", lambda n, t=t: batched(n, t)) for t in thread_counts]
    modes += [(f"pool x{t}", lambda n, t=t: pooled(n, t)) for t in thread_counts]
    print(f"| rows | {' | '.join(name for name, _ in modes)} |")
    print(f"|---|{'---|' * len(modes)}")
    for n in batches:
        cells = []
        for _, fn in modes:
            seconds = timed(lambda fn=fn, n=n: fn(n), args.repeats)
            cells.append(f"{seconds * 1e3:.3f} ms ({seconds * 1e6 / n:.0f} µs/row)")
        print(f"| {n} | {' | '.join(cells)} |", flush=True)
    for pool in pools.values():
        pool.shutdown()
    compiler.shutdown()


if __name__ == "__main__":
    main()
