"""What a grammar's mask rows cost along a random walk (what a random-weights model writes:
its logits carry no preference, so its masked greedy picks are close to uniform over the
allowed tokens), per schema of a workload, with each compiled grammar's size:

    python benchmarks/row_costs.py --workload .work/json.jsonl --num-requests 256 --steps 256

One table: the schemas whose rows cost most (mean and worst row, size), then the spread over
all of them. Session 9 asked it why a few in-process rows could cost the 8B's step loop ~10 ms
at concurrency 256 with mask shards (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from guided.config import EngineConfig
from guided.fsm.compiler import GrammarCompiler
from guided.params import ConstraintSpec
from guided.worker import loader


def walk(matcher, num_words: int, steps: int, rng: random.Random) -> list[float]:
    """Seconds per row fill for up to `steps` tokens picked uniformly among the allowed."""
    bitmask = torch.zeros((1, num_words), dtype=torch.int32)
    seconds = []
    for _ in range(steps):
        if matcher.is_terminated():
            break
        start = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        seconds.append(time.perf_counter() - start)
        bits = bitmask[0].numpy().view("uint32")
        allowed = [32 * w + b for w in bits.nonzero()[0] for b in range(32) if bits[w] >> b & 1]
        if not allowed or not matcher.accept_token(rng.choice(allowed)):
            break
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    tokenizer = loader.load_tokenizer("default")
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), config=EngineConfig())
    num_words = -(-len(tokenizer) // 32)
    rows = []
    with open(args.workload) as f:
        bodies = [json.loads(line)["body"] for line in f if line.strip()][:args.num_requests]
    seen = set()
    for i, body in enumerate(bodies):
        schema = body["response_format"]["json_schema"]["schema"]
        key = json.dumps(schema, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        try:
            grammar = compiler.compile(ConstraintSpec.json_schema(schema))
        except Exception as e:  # noqa: BLE001 - a schema we refuse: reported, not timed
            print(f"schema {i}: refused ({e})", file=sys.stderr)
            continue
        matcher = grammar.matcher()
        size = getattr(getattr(matcher, "compiled", None), "memory_size_bytes", 0)
        seconds = walk(matcher, num_words, args.steps, random.Random(args.seed + i))
        if seconds:
            rows.append((i, size, len(seconds), statistics.mean(seconds), max(seconds)))
        print(f"\r{len(rows)} grammars walked", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    compiler.shutdown()
    rows.sort(key=lambda r: -r[3] * r[2])
    print("| schema | grammar MB | rows | mean row µs | worst row µs | row time ms |")
    print("|---|---|---|---|---|---|")
    for i, size, n, mean, worst in rows[:args.top]:
        print(f"| {i} | {size / 2**20:.1f} | {n} | {mean * 1e6:.0f} | {worst * 1e6:.0f} "
              f"| {mean * n * 1e3:.1f} |")
    means = sorted(r[3] for r in rows)
    total = sum(r[3] * r[2] for r in rows)
    top = sum(r[3] * r[2] for r in rows[:max(1, len(rows) // 20)])
    print(f"\n{len(rows)} grammars: mean row µs p50 {means[len(means) // 2] * 1e6:.0f}, "
          f"p90 {means[int(len(means) * 0.9)] * 1e6:.0f}, max {means[-1] * 1e6:.0f}; "
          f"the costliest 5% of grammars hold {100 * top / total:.0f}% of all row time; "
          f"grammars over 32 MB: {sum(r[1] > 32 << 20 for r in rows)}")


if __name__ == "__main__":
    main()
