"""JSONSchemaBench generation compliance: declared coverage and jsonschema-checked validity.

    python benchmarks/compliance.py                      # 300 schemas, stratified, seed 0
    python benchmarks/compliance.py --limit 20           # a quick run
    python benchmarks/compliance.py --num-schemas 600 --device cuda

Each schema is asked for with the default model's chat template ("Generate a JSON object that
matches this schema: ...") under a json_schema constraint, greedy, all requests submitted at once.
- accepted: the engine compiled the constraint (refused: finish_reason "error", error_type
  "constraint", or ConstraintError at submission); declared coverage = accepted / schemas;
- finished: accepted outputs that ended with "stop"; outputs cut by max_tokens are reported as
  length-cut, not judged. To make cuts rare, a schema whose longest valid example instance is
  long gets --long-max-tokens; --retry-max-tokens N > 0 retries the cut ones once (costly: a
  cut output is usually a loop the model will not leave);
- valid: finished outputs that validate with jsonschema (Draft 2020-12, formats checked);
  compliance = valid / finished, which the engine guarantees to be 100%: every failure is printed
  with the schema id, the output and the validation error.
Prints progress to stderr and one markdown table.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from dataclasses import dataclass, field

from common import (
    SchemaCase,
    add_run_args,
    load_jsonschemabench,
    markdown_table,
    pct,
    progress,
    run_batch,
    sample_stratified,
    schema_messages,
    set_torch_threads,
    validation_error,
)

LONG_EXAMPLE_CHARS = 450  # ~150 tokens of compact JSON: the model may need more than 256


@dataclass
class Tally:
    schemas: int = 0
    accepted: int = 0
    finished: int = 0
    valid: int = 0
    length_cut: int = 0
    errors: int = 0  # accepted but finished "error" (an engine bug: the grammar rejected a token)
    refusals: collections.Counter = field(default_factory=collections.Counter)


def refusal_keyword(message: str) -> str:
    """A short key for the refusal table: the quoted keyword the message names, if any."""
    m = re.search(r"'([$A-Za-z][\w-]*)'", message or "")
    return m.group(1) if m else (message or "?")[:40]


def run(args: argparse.Namespace) -> int:
    from guided import LLM, SamplingParams

    set_torch_threads(args.threads)
    cases = sample_stratified(load_jsonschemabench(args.data), args.num_schemas, seed=args.seed)
    if args.limit:
        cases = cases[::max(1, len(cases) // args.limit)][:args.limit]
    if not cases:
        progress(f"no schemas under {args.data}/jsonschemabench")
        return 2
    progress(f"{len(cases)} schemas over {len({c.subset for c in cases})} subsets")
    llm = LLM(device=args.device, max_num_seqs=args.max_num_seqs, cpu_kv_cache_gb=2.0)
    prompts = [llm.apply_chat_template(schema_messages(c.schema)) for c in cases]

    def params(max_tokens: int | None) -> list:
        return [SamplingParams(json_schema=c.schema, temperature=0, max_tokens=max_tokens or (
            args.long_max_tokens if c.example_chars > LONG_EXAMPLE_CHARS else args.max_tokens))
            for c in cases]

    num_long = sum(c.example_chars > LONG_EXAMPLE_CHARS for c in cases)
    progress(f"{num_long} schemas with long examples get max_tokens {args.long_max_tokens}")
    outputs, seconds = run_batch(llm.engine, prompts, params(None), label="compliance",
                                 every=30)
    progress(f"first pass: {seconds:.0f} s")
    cut = [i for i, o in enumerate(outputs) if getattr(o, "finish_reason", None) == "length"]
    if cut and args.retry_max_tokens > args.max_tokens:
        progress(f"retrying {len(cut)} length-cut outputs with max_tokens {args.retry_max_tokens}")
        retry_params = params(args.retry_max_tokens)
        again, s = run_batch(llm.engine, [prompts[i] for i in cut], [retry_params[i] for i in cut],
                             label="retry", every=30)
        for i, out in zip(cut, again):
            outputs[i] = out
        progress(f"retry: {s:.0f} s")
    tallies = tally(cases, outputs)
    print_report(tallies, args)
    stats = llm.engine.stats()
    progress(f"engine: {stats.forward_passes_total} forward passes, "
             f"{stats.jump_forward_tokens_total} jump-forward tokens, "
             f"{stats.kv_blocks_in_use} KV blocks in use after the run")
    bad = sum(t.finished - t.valid + t.errors for t in tallies.values())
    return 1 if bad else 0


def tally(cases: list[SchemaCase], outputs: list) -> dict[str, Tally]:
    tallies: dict[str, Tally] = collections.defaultdict(Tally)
    for case, out in zip(cases, outputs):
        t = tallies[case.subset]
        t.schemas += 1
        if isinstance(out, Exception):
            t.refusals[refusal_keyword(str(out))] += 1
            continue
        if out.finish_reason == "error" and out.error_type == "constraint":
            t.refusals[refusal_keyword(out.error)] += 1
            continue
        t.accepted += 1
        if out.finish_reason == "length":
            t.length_cut += 1
        elif out.finish_reason == "error":
            t.errors += 1
            print(f"\nENGINE ERROR {case.id}: {out.error_type}: {out.error}\n  output: "
                  f"{out.text[:400]!r}", flush=True)
        elif out.finish_reason == "stop":
            t.finished += 1
            problem = validation_error(case.schema, out.text)
            if problem is None:
                t.valid += 1
            else:
                print(f"\nINVALID {case.id}: {problem}\n  output: {out.text[:600]!r}\n  schema: "
                      f"{json.dumps(case.schema)[:600]}", flush=True)
    return tallies


def print_report(tallies: dict[str, Tally], args: argparse.Namespace) -> None:
    rows = []
    total = Tally()
    for subset, t in tallies.items():
        rows.append([subset, t.schemas, f"{t.accepted} ({pct(t.accepted, t.schemas)})",
                     t.finished, t.valid, pct(t.valid, t.finished), t.length_cut, t.errors])
        for name in ("schemas", "accepted", "finished", "valid", "length_cut", "errors"):
            setattr(total, name, getattr(total, name) + getattr(t, name))
        total.refusals.update(t.refusals)
    rows.append(["**all**", total.schemas, f"{total.accepted} ({pct(total.accepted, total.schemas)})",
                 total.finished, total.valid, pct(total.valid, total.finished), total.length_cut,
                 total.errors])
    retry = (f", length-cut retried with {args.retry_max_tokens}" if args.retry_max_tokens
             > args.max_tokens else "")
    print(f"\nCompliance (greedy, max_tokens {args.max_tokens}, {args.long_max_tokens} for "
          f"schemas with long examples{retry}, seed {args.seed}):\n")
    print(markdown_table(["subset", "schemas", "accepted (coverage)", "finished", "valid",
                          "compliance", "length-cut", "engine errors"], rows))
    if total.refusals:
        print("\nRefusals by keyword: " + ", ".join(
            f"{k} {n}" for k, n in total.refusals.most_common(15)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(ap)
    ap.add_argument("--num-schemas", type=int, default=300)
    ap.add_argument("--limit", type=int, default=0, help="run only this many of the drawn schemas")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--long-max-tokens", type=int, default=512)
    ap.add_argument("--retry-max-tokens", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
