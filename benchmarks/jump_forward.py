"""Jump-forward on vs off: identical greedy outputs, fewer forward passes, lower latency.

    python benchmarks/jump_forward.py                       # 70 JSONSchemaBench + 40 BFCL schemas
    python benchmarks/jump_forward.py --limit 20 --num-sequential 5
    python benchmarks/jump_forward.py --device cuda

Three engines with the same config but for drafting: off (jump_forward=False), forced (the
grammar's forced text only, lookup_draft_tokens=0) and on (the default: forced text + prompt-lookup
drafts). Every schema is asked for greedily in each (all requests submitted at once; the grammars
are compiled beforehand so that compile time is not measured), then a subset one request at a
time (batch-1 latency, the modes alternated and averaged). Forward passes count prefill passes
too. Checks token-for-token equality with off (it must hold for every schema) and prints one
markdown table: forward passes / off (goal <= 0.6), wall time / off, accepted draft tokens; and a
control: drafting off at batch 1 vs in the batch (on the GPU, batch composition alone changes
near-tie greedy tokens in bf16).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import (
    add_run_args,
    load_bfcl_tool_schemas,
    load_jsonschemabench,
    markdown_table,
    progress,
    run_batch,
    run_sequential,
    sample_stratified,
    schema_messages,
    set_torch_threads,
)


def load_cases(data: Path, num_jsb: int, num_bfcl: int, seed: int) -> list:
    return (sample_stratified(load_jsonschemabench(data), num_jsb, seed=seed)
            + load_bfcl_tool_schemas(data, num_bfcl, seed=seed))


def precompile(llm, params: list) -> None:
    from guided.errors import ConstraintError

    for p in params:
        try:
            llm.engine.compiler.submit(p.constraint)
        except ConstraintError:
            pass
    for p in params:  # wait for all (failures are cached too)
        try:
            llm.engine.compiler.submit(p.constraint).exception()
        except ConstraintError:
            pass


def summarize(outputs: list) -> dict:
    ok = [o for o in outputs if not isinstance(o, Exception) and o.finish_reason != "error"]
    return {"passes": sum(o.metrics.forward_passes for o in ok),
            "tokens": sum(len(o.token_ids) for o in ok),
            "jump": sum(o.metrics.jump_forward_tokens for o in ok)}


def compare(cases: list, on: list, off: list) -> tuple[int, int, list[str]]:
    """(compared, identical, mismatch descriptions); refused in both modes are not compared."""
    compared, identical, mismatches = 0, 0, []
    for case, a, b in zip(cases, on, off):
        refused_a = isinstance(a, Exception) or a.finish_reason == "error"
        refused_b = isinstance(b, Exception) or b.finish_reason == "error"
        if refused_a and refused_b:
            continue
        compared += 1
        if not refused_a and not refused_b and a.token_ids == b.token_ids:
            identical += 1
            continue
        desc = [f"{case.id}:"]
        for name, o in (("on", a), ("off", b)):
            desc.append(f"  {name}: {o!r}" if isinstance(o, Exception) else
                        f"  {name}: {o.finish_reason} {o.error or ''} {o.text[:300]!r}")
        mismatches.append("\n".join(desc))
    return compared, identical, mismatches


MODES = {  # engine options per mode: drafting off, forced text only, forced text + lookup
    "off": {"jump_forward": False},
    "forced": {"jump_forward": True, "lookup_draft_tokens": 0},
    "on": {"jump_forward": True},
}


def run(args: argparse.Namespace) -> int:
    from guided import LLM, SamplingParams

    set_torch_threads(args.threads)
    cases = load_cases(args.data, args.num_jsb, args.num_bfcl, args.seed)
    if args.limit:
        cases = cases[::max(1, len(cases) // args.limit)][:args.limit]
    if not cases:
        progress(f"no schemas under {args.data}")
        return 2
    config = {"device": args.device, "max_num_seqs": args.max_num_seqs, "cpu_kv_cache_gb": 1.0,
              # the engines share the GPU: each takes part of its memory
              "gpu_memory_utilization": 0.25}
    llms = {mode: LLM(**options, **config) for mode, options in MODES.items()}
    prompts = [llms["on"].apply_chat_template(schema_messages(c.schema)) for c in cases]
    params = [SamplingParams(json_schema=c.schema, temperature=0, max_tokens=args.max_tokens)
              for c in cases]
    for llm in llms.values():
        precompile(llm, params)
    progress(f"{len(cases)} schemas ({args.num_jsb} JSONSchemaBench + {args.num_bfcl} BFCL "
             "requested); grammars compiled")

    batch: dict[str, list] = {}
    seconds = {mode: 0.0 for mode in MODES}
    order = list(MODES) + list(reversed(MODES)) if args.repeats > 1 else list(MODES)
    for mode in order:  # alternated to spread the machine's noise over the modes
        outs, s = run_batch(llms[mode].engine, prompts, params, label=f"batch {mode}", every=30)
        progress(f"batch, drafting {mode}: {s:.1f} s")
        seconds[mode] += s / (len(order) // len(MODES))
        if mode in batch and [getattr(o, "token_ids", None) for o in outs] != [
                getattr(o, "token_ids", None) for o in batch[mode]]:
            progress(f"warning: drafting {mode} is not reproducible across runs")
        batch[mode] = outs

    seq_idx = list(range(0, len(cases), max(1, len(cases) // max(1, args.num_sequential))))
    seq_idx = seq_idx[:args.num_sequential]
    seq: dict[str, tuple] = {}
    for mode in list(MODES) + list(reversed(MODES)):  # alternated: the box's load drifts
        outs, s = run_sequential(llms[mode].engine, [prompts[i] for i in seq_idx],
                                 [params[i] for i in seq_idx])
        seq[mode] = (outs, s / 2 + (seq[mode][1] if mode in seq else 0.0))
        progress(f"batch 1 x {len(seq_idx)}, drafting {mode}: {s:.1f} s")

    failed = False
    rows = []
    off, s_off = summarize(batch["off"]), summarize(seq["off"][0])
    for mode in ("forced", "on"):
        compared, identical, mismatches = compare(cases, batch[mode], batch["off"])
        s_compared, s_identical, s_mismatches = compare(
            [cases[i] for i in seq_idx], seq[mode][0], seq["off"][0])
        for m in mismatches + s_mismatches:
            print(f"\nMISMATCH ({mode}) {m}", flush=True)
        failed |= bool(mismatches or s_mismatches)
        b, s1 = summarize(batch[mode]), summarize(seq[mode][0])
        rows.append([f"{mode}: batch ({len(cases)} at once)", f"{identical}/{compared}",
                     off["tokens"], b["passes"], off["passes"], b["passes"] / max(1, off["passes"]),
                     f"{seconds[mode]:.1f} / {seconds['off']:.1f}",
                     seconds[mode] / seconds["off"], b["jump"]])
        rows.append([f"{mode}: batch 1 ({len(seq_idx)} sequential)", f"{s_identical}/{s_compared}",
                     s_off["tokens"], s1["passes"], s_off["passes"],
                     s1["passes"] / max(1, s_off["passes"]),
                     f"{seq[mode][1]:.1f} / {seq['off'][1]:.1f}", seq[mode][1] / seq["off"][1],
                     s1["jump"]])
    # control: drafting off at batch 1 vs in the batch (what batch composition alone changes)
    c_compared, c_identical, _ = compare([cases[i] for i in seq_idx], seq["off"][0],
                                         [batch["off"][i] for i in seq_idx])
    print(f"\nDrafting on vs off ({args.device}, greedy, max_tokens {args.max_tokens}, "
          f"{len(cases)} schemas, {len(cases) - compared} refused in both modes; forced = the "
          "grammar's forced text only, on = forced text + prompt-lookup drafts):\n")
    print(markdown_table(["run", "identical to off", "output tokens (off)", "passes", "passes off",
                          "passes / off", "wall s / off", "latency / off",
                          "accepted draft tokens"], rows))
    print(f"\ncontrol: drafting off, batch 1 vs batch: {c_identical}/{c_compared} identical")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(ap)
    ap.add_argument("--num-jsb", type=int, default=70, help="JSONSchemaBench schemas")
    ap.add_argument("--num-bfcl", type=int, default=40, help="BFCL tool parameter schemas")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--num-sequential", type=int, default=16, help="schemas run at batch 1")
    ap.add_argument("--repeats", type=int, default=1, help="2: batch runs as on, off, off, on")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
