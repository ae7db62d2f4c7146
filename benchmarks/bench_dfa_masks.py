"""A constrained batch's grammar work per decode step, xgrammar against the token-level DFA
(guided/fsm/backends/dfa_backend.py), on the same token sequences (CPU):

    python benchmarks/bench_dfa_masks.py --workload .work/json.jsonl --num-requests 256 --steps 128

Each request of the workload whose schema the DFA serves gets a sequence of tokens drawn at
random among those its grammar allows (what a random-weights model writes) and taken by
xgrammar's matcher too. Then, one step at a time over the whole batch, as a decode step does:
every matcher accepts its last token and the batch's mask rows are filled (fill_bitmasks, the
engine's call, with its threads). Two passes with fresh matchers: the first finds the DFA's row
memos empty (a schema's first requests), the second full (the schema served before). One
table: ms a step, us a row, and the compile times.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch
from common import markdown_table, progress, workload_schemas

from guided.config import EngineConfig
from guided.errors import ConstraintError
from guided.masks.bitmask_fill import fill_bitmasks
from guided.fsm.compiler import GrammarCompiler
from guided.params import ConstraintSpec
from guided.worker import loader


def compile_all(compiler: GrammarCompiler, schemas: list) -> tuple[list, list[float]]:
    grammars, seconds = [], []
    for schema in schemas:
        try:
            grammar = compiler.compile(ConstraintSpec.json_schema(schema), timeout=120)
        except ConstraintError:
            grammar = None
        grammars.append(grammar)
        if grammar is not None:
            seconds.append(grammar.compile_seconds)
    return grammars, seconds


def random_tokens(dfa_grammar, xgr_grammar, words: int, steps: int, eos: int,
                  rng: random.Random) -> list[int]:
    """Tokens allowed by the DFA at each step (EOS only at the end), taken by xgrammar too."""
    dfa, xgr = dfa_grammar.matcher(), xgr_grammar.matcher()
    row = torch.zeros((1, words), dtype=torch.int32)
    tokens: list[int] = []
    for _ in range(steps):
        dfa.fill_bitmask(row, 0)
        allowed = np.flatnonzero(np.unpackbits(row[0].numpy().view(np.uint8), bitorder="little"))
        others = [int(t) for t in allowed if t != eos]
        token = rng.choice(others) if others else eos
        if not xgr.accept_token(token):
            break  # the two languages differ here (xgrammar's is wider elsewhere): stop
        dfa.accept_token(token)
        tokens.append(token)
        if token == eos:
            break
    return tokens


def step_times(grammars: list, sequences: list[list[int]], words: int,
               num_threads: int) -> list[float]:
    """Seconds per step for the batch: accept the last tokens, fill every live row."""
    matchers = [g.matcher() for g in grammars]
    bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)
    out = []
    for step in range(max(len(s) for s in sequences)):
        start = time.perf_counter()
        live = []
        for b, (matcher, tokens) in enumerate(zip(matchers, sequences)):
            if step < len(tokens):
                if step and not matcher.accept_token(tokens[step - 1]):
                    raise RuntimeError("a token of the sequence was refused")
                live.append((matcher, b))
        fill_bitmasks(live, bitmask, num_threads=num_threads)
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--mask-threads", type=int, default=EngineConfig().mask_threads)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tokenizer = loader.load_tokenizer("default")
    words = (len(tokenizer) + 31) // 32
    schemas = workload_schemas(args.workload, args.num_requests)
    progress(f"compiling {len(schemas)} schemas twice (DFA on, off)")
    on = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), config=EngineConfig(
        grammar_cache_size=4096))
    off = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), config=EngineConfig(
        grammar_cache_size=4096, dfa_masks=False))
    dfa_grammars, _ = compile_all(on, schemas)
    xgr_grammars, _ = compile_all(off, schemas)
    pairs = [(d, x) for d, x in zip(dfa_grammars, xgr_grammars)
             if d is not None and x is not None and d.backend == "dfa"]
    accepted = sum(g is not None for g in dfa_grammars)
    progress(f"{len(pairs)} of {accepted} accepted schemas on the DFA; drawing token sequences")
    rng = random.Random(args.seed)
    eos = on.vocab.eos_token_ids[0]
    sequences = [random_tokens(d, x, words, args.steps, eos, rng) for d, x in pairs]
    threads = args.mask_threads
    rows = []
    for name, grammars in (("xgrammar", [x for _, x in pairs]),
                           ("dfa, memos empty", [d for d, _ in pairs]),
                           ("dfa, memos full", [d for d, _ in pairs])):
        progress(f"stepping the batch: {name}")
        times = step_times(grammars, sequences, words, threads)
        num_rows = sum(len(s) for s in sequences)
        rows.append([name, len(pairs), f"{statistics.median(times) * 1e3:.2f}",
                     f"{max(times) * 1e3:.2f}", f"{sum(times) / num_rows * 1e6:.1f}",
                     f"{sum(times) * 1e3:.0f}"])
    on.shutdown()
    off.shutdown()
    print(markdown_table(["backend", "requests", "ms a step p50", "ms a step max",
                          "us a row (mean)", "total ms"], rows))
    seqs = [len(s) for s in sequences]
    print(f"\n{len(pairs)} requests, tokens each: median {statistics.median(seqs):.0f}, "
          f"max {max(seqs)}; mask threads {threads}; rows memoized "
          f"{sum(d.matcher().dfa.num_rows for d, _ in pairs)} over {len(pairs)} grammars")
    print("compile ms (p50 / p99) on the DFA: " + _pcts([d.compile_seconds for d, _ in pairs])
          + "; on xgrammar: " + _pcts([x.compile_seconds for _, x in pairs]))
    print(json.dumps({"args": vars(args)}))


def _pcts(seconds: list[float]) -> str:
    ms = sorted(s * 1e3 for s in seconds)
    return f"{ms[len(ms) // 2]:.0f} / {ms[min(len(ms) - 1, int(len(ms) * 0.99))]:.0f}"


if __name__ == "__main__":
    main()
