"""How well a regex's unrolled size (guided/fsm/regex_size.py) predicts what its token-level DFA
costs to build, over a workload's distinct schemas: for each size limit, the schemas past it
(served by xgrammar at once while their DFA builds in the background: EngineConfig
dfa_max_wait_size), the build seconds they hold, and the slowest build left below it. One
markdown table (CPU: compare rows, not absolute times).

    python benchmarks/bench_dfa_sizes.py --workload .work/json.jsonl --num-requests 512
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import workload_schemas

from guided.fsm.backends.dfa_backend import DfaVocab, TokenDfa
from guided.fsm.regex_size import regex_size
from guided.fsm.schema_check import check_schema
from guided.fsm.schema_regex import NotRegular, schema_regex
from guided.fsm.vocab import TokenVocab
from guided.worker.loader import load_tokenizer


def distinct_regexes(path: str, num: int) -> list[str]:
    """The regexes of the workload's distinct schemas that have one."""
    seen, regexes = set(), []
    for schema in workload_schemas(path, num):
        key = json.dumps(schema, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        try:
            regexes.append(schema_regex(check_schema(schema)))
        except NotRegular:
            continue
        except Exception:  # noqa: BLE001 - a refused schema is no DFA's
            continue
    return regexes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, help="a file from serve.py --export-workload")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--limits", default="250,500,1000,2000,5000")
    args = ap.parse_args()
    vocab = DfaVocab(TokenVocab.from_tokenizer(load_tokenizer("default"), vocab_size=49152))
    regexes = distinct_regexes(args.workload, args.num_requests)
    built = []  # (size, seconds)
    for i, regex in enumerate(regexes):
        start = time.perf_counter()
        try:
            TokenDfa(regex, vocab)
        except BaseException:  # noqa: BLE001 - a Rust panic: no DFA, nothing to time
            continue
        built.append((regex_size(regex), time.perf_counter() - start))
        print(f"\r{i + 1}/{len(regexes)} DFAs built", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    total = sum(seconds for _, seconds in built)
    print(f"\n{len(built)} DFAs of the distinct schemas of {args.num_requests} requests of "
          f"{args.workload}: {total:.1f} s to build in all\n")
    print("| size limit | schemas past it | their build s | slowest build below it s |")
    print("|---|---|---|---|")
    for limit in (int(x) for x in args.limits.split(",")):
        past = [seconds for size, seconds in built if size > limit]
        below = [seconds for size, seconds in built if size <= limit]
        print(f"| {limit} | {len(past)} | {sum(past):.1f} | {max(below, default=0):.2f} |")


if __name__ == "__main__":
    main()
