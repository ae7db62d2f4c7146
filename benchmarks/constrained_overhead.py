"""Constrained vs unconstrained decoding of the same batch: the cost of the grammar per token.

    python benchmarks/constrained_overhead.py
    python benchmarks/constrained_overhead.py --device cuda --batch 8 --repeats 5

A batch of `--batch` JSON-schema requests (JSONSchemaBench, fixed seed) is decoded greedily with
its constraint; then the same prompts unconstrained, each forced to the constrained output's
token count (max_tokens = that count, ignore_eos). Grammars are compiled beforehand (compile time
is not the subject). Row 1: jump-forward off (a fair per-token comparison: same tokens, same
forward passes); row 2: jump-forward on (fewer passes for the constrained batch). Each pair runs
`--repeats` times in alternating order; the table shows the median wall-time ratio (goal <= 1.10).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from common import (
    add_run_args,
    load_jsonschemabench,
    markdown_table,
    progress,
    run_batch,
    sample_stratified,
    schema_messages,
    set_torch_threads,
)


def pick_schemas(llm, data: Path, num: int, seed: int, max_tokens: int) -> tuple[list, list]:
    """num schemas that compile and whose greedy output ends before max_tokens."""
    from guided import SamplingParams

    candidates = sample_stratified(load_jsonschemabench(data, ["Glaiveai2K", "Github_easy",
                                                               "Kubernetes", "Snowplow"]),
                                   num * 4, seed=seed)
    picked, params = [], []
    for case in candidates:
        p = SamplingParams(json_schema=case.schema, temperature=0, max_tokens=max_tokens)
        try:
            if llm.engine.compiler.submit(p.constraint).exception() is None:
                picked.append(case)
                params.append(p)
        except ValueError:
            continue
    return picked, params


def run(args: argparse.Namespace) -> int:
    from guided import LLM, SamplingParams

    set_torch_threads(args.threads)
    config = {"device": args.device, "max_num_seqs": max(8, args.batch), "cpu_kv_cache_gb": 1.0}
    llms = {"off": LLM(jump_forward=False, **config), "on": LLM(jump_forward=True, **config)}
    cases, params = pick_schemas(llms["off"], args.data, args.batch * 2, args.seed,
                                 args.max_tokens)
    prompts = [llms["off"].apply_chat_template(schema_messages(c.schema)) for c in cases]
    # keep the first `batch` whose outputs finish (a cut output would not measure the grammar)
    outs, _ = run_batch(llms["off"].engine, prompts, params)
    keep = [i for i, o in enumerate(outs) if o.finish_reason == "stop"][:args.batch]
    if len(keep) < args.batch:
        progress(f"only {len(keep)} schemas finished within max_tokens {args.max_tokens}")
    cases = [cases[i] for i in keep]
    prompts = [prompts[i] for i in keep]
    params = [params[i] for i in keep]
    counts = [len(outs[i].token_ids) for i in keep]
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in counts]
    for llm in llms.values():
        for p in params:
            llm.engine.compiler.submit(p.constraint).result()
    progress(f"{len(cases)} schemas, output tokens {counts} (sum {sum(counts)})")

    rows = []
    for mode in ("off", "on"):
        engine = llms[mode].engine
        run_batch(engine, prompts[:2], free[:2])  # warm-up
        ratios, c_times, u_times, passes = [], [], [], {}
        for rep in range(args.repeats):
            order = ("c", "u") if rep % 2 == 0 else ("u", "c")
            times = {}
            for kind in order:
                before = engine.stats().forward_passes_total
                got, times[kind] = run_batch(engine, prompts, params if kind == "c" else free)
                passes[kind] = engine.stats().forward_passes_total - before
                if kind == "c" and [len(o.token_ids) for o in got] != counts:
                    progress("warning: constrained token counts changed between runs")
                if kind == "u" and [len(o.token_ids) for o in got] != counts:
                    progress("warning: unconstrained token counts differ from the forced counts")
            c_times.append(times["c"])
            u_times.append(times["u"])
            ratios.append(times["c"] / times["u"])
            progress(f"jump-forward {mode}, rep {rep + 1}: constrained {times['c']:.2f} s, "
                     f"unconstrained {times['u']:.2f} s, ratio {ratios[-1]:.3f}")
        rows.append([f"jump-forward {mode}", len(cases), sum(counts), passes["c"], passes["u"],
                     statistics.median(c_times), statistics.median(u_times),
                     f"{statistics.median(ratios):.3f}",
                     " ".join(f"{r:.3f}" for r in ratios)])
    print(f"\nConstrained vs unconstrained ({args.device}, batch {len(cases)}, greedy, "
          f"{args.repeats} repeats alternating, median):\n")
    print(markdown_table(["row", "requests", "output tokens", "passes constrained",
                          "passes free", "wall s constrained", "wall s free",
                          "ratio (goal <= 1.10)", "ratios"], rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(ap)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=192)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
