"""Masks inside length-bounded JSON strings: our compile (a counted plain-character pattern up
to 64 characters, xgrammar's keywords beyond, as character budgets past 128: char_budgets.py;
control-byte tokens removed) against xgrammar's
own minLength / maxLength rule, and the compile times. A random walk inside the string (a random allowed token each
step, as a random-weight model writes) times each fill. Prints one markdown table.

    python benchmarks/bench_string_bounds.py [--bounds 16,64,128,256,512,1024] [--walks 4]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import xgrammar as xgr

from guided.config import EngineConfig
from guided.fsm.backends.xgrammar_backend import XGrammarMatcher
from guided.fsm.compiler import GrammarCompiler
from guided.params import ConstraintSpec
from guided.worker.loader import load_tokenizer


def allowed_ids(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    bits = ((bitmask[0].unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:vocab_size]
    return bits.nonzero().flatten().tolist()


def walk(make_matcher, vocab_size: int, words: int, walks: int, steps: int, control: set[int]
         ) -> tuple[str, int]:
    """("median / mean" ms per fill inside the string, control-byte tokens ever allowed)"""
    rng = random.Random(0)
    bitmask = torch.zeros(1, words, dtype=torch.int32)
    times, bad = [], 0
    for _ in range(walks):
        matcher = make_matcher()
        assert matcher.accept_bytes(b'{"a": "')
        for _ in range(steps):
            t0 = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            times.append(time.perf_counter() - t0)
            allowed = allowed_ids(bitmask, vocab_size)
            bad += len(control.intersection(allowed))
            inside = [t for t in allowed if t not in control]  # stay inside: skip no token
            if not inside:
                break
            matcher.accept_token(rng.choice(inside))
            if matcher.is_terminated():
                break
    return f"{1e3 * statistics.median(times):.3f} / {1e3 * statistics.mean(times):.3f}", bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bounds", default="16,64,128,256,512,1024")
    parser.add_argument("--walks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    tokenizer = load_tokenizer("default")
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), config=EngineConfig())
    vocab = compiler.vocab
    token_bytes = vocab.token_bytes
    control = {i for i, b in enumerate(token_bytes) if b and min(b) < 0x20}
    words = -(-vocab.vocab_size // 32)
    raw = xgr.GrammarCompiler(xgr.TokenizerInfo(token_bytes, xgr.VocabType.RAW,
                                                vocab_size=vocab.vocab_size,
                                                stop_token_ids=list(vocab.eos_token_ids)))
    print("| maxLength | ours: ms per mask, median / mean | control tokens allowed | compile s "
          "| xgrammar keywords: ms per mask, median / mean | control tokens allowed | compile s |")
    print("|---|---|---|---|---|---|---|")
    for bound in [int(b) for b in args.bounds.split(",")]:
        schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": bound}},
                  "required": ["a"]}
        t0 = time.perf_counter()
        ours = compiler.submit(ConstraintSpec("json_schema", json.dumps(schema))).result(120)
        t1 = time.perf_counter()
        theirs = raw.compile_json_schema(json.dumps(schema), any_whitespace=False)
        t2 = time.perf_counter()
        ours_ms, ours_bad = walk(ours.matcher, len(token_bytes), words, args.walks, args.steps,
                                 control)
        theirs_ms, theirs_bad = walk(lambda: XGrammarMatcher(theirs, vocab), len(token_bytes),
                                     words, args.walks, args.steps, control)
        print(f"| {bound} | {ours_ms} | {ours_bad} | {t1 - t0:.2f} | {theirs_ms} | {theirs_bad} "
              f"| {t2 - t1:.2f} |", flush=True)
    compiler.shutdown()


if __name__ == "__main__":
    main()
