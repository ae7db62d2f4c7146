"""Offline engine throughput on a workload file, with the host's time per step phase:

    python benchmarks/engine_offline.py --model synthetic:llama-3-8b \
        --workload .work/json.jsonl --num-requests 256 --concurrency 64 [--free]
        [--paired [--rounds 5]]

--free drops the constraints and forces the same output lengths (ignore_eos), for the
constrained / unconstrained ratio on the same prompts. Workload files come from
`benchmarks/serve.py --export-workload`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import Counter

from common import GcTimer, add_offline_args

from guided import SamplingParams
from guided.config import EngineConfig
from guided.engine.core import Engine
from guided.worker.step_times import StepTimes

GC = GcTimer()


def load(path: str, n: int) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:n]


# "final": only finished outputs, as an offline user (LLM.generate) or a non-streaming server
# request asks; --output-kind cumulative: an output every step, as streaming requests get
OUTPUT_KIND = {"kind": "final"}


def params_for(row: dict, max_tokens: int, free: bool) -> SamplingParams:
    body = row.get("body", row)
    fmt = body.get("response_format") or {}
    schema = (fmt.get("json_schema") or {}).get("schema") if not free else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, json_schema=schema,
                          ignore_eos=free, output_kind=OUTPUT_KIND["kind"])


def run(engine: Engine, rows: list[dict], max_tokens: int | list[int], free: bool,
        tag: str = "q") -> dict:
    """All rows submitted at once (max_num_seqs is the concurrency); max_tokens per row when a
    list (the paired run forces the constrained run's lengths)."""
    t0 = time.perf_counter()
    engine.step_times.reset()
    GC.reset()
    refused, tokens = 0, 0
    lengths: dict[int, int] = {}
    for i, row in enumerate(rows):
        body = row.get("body", row)
        prompt = engine.tokenizer.apply_chat_template(body["messages"], tokenize=True,
                                                      add_generation_prompt=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        limit = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
        engine.add_request(f"{tag}{i}", prompt, params_for(row, limit, free))
    t_added = time.perf_counter()
    num_calls = 0
    by_batch = BatchTimes(engine.step_times)
    while engine.has_unfinished_requests():
        num_calls += 1
        with by_batch.step(len(engine.scheduler.running)):
            outputs = engine.step()
        for out in outputs:
            if out.finished:
                tokens += len(out.token_ids)
                refused += out.finish_reason == "error"
                lengths[int(out.request_id[len(tag):])] = len(out.token_ids)
        if not outputs:  # as LLM.generate: no spinning while only compiles are pending
            engine.wait_for_compiles(0.05)
    elapsed = time.perf_counter() - t0
    return {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed,
            "refused": refused,
            "phases": engine.step_times.summary() + loop_time(engine, t_added - t0,
                                                              time.perf_counter() - t_added,
                                                              num_calls)
            + by_batch.summary(),
            "lengths": [lengths.get(i, 0) for i in range(len(rows))]}


class BatchTimes:
    """The loop's calls by how many requests were running: where a mode's time goes, the full
    batch or the tail of a few long requests (a step's fixed costs show in the tail). The
    phases of the calls with the most running (above the last edge) and of the tail's middle
    (5-64 running) are kept apart too: the run's means mix the full batch with the tail."""
    EDGES = (4, 16, 64)

    def __init__(self, times: StepTimes | None = None):
        self.calls = [0] * (len(self.EDGES) + 1)
        self.seconds = [0.0] * (len(self.EDGES) + 1)
        self._times = times
        # seconds per phase by bucket of running requests
        self.phases: list[dict[str, float]] = [{} for _ in self.calls]
        self.per_call: list[tuple[int, dict[str, float], dict[str, int]]] = []  # with a timeline

    @contextlib.contextmanager
    def step(self, num_running: int):
        k = sum(num_running > edge for edge in self.EDGES)
        before = dict(self._times.seconds) if self._times is not None else None
        counts = dict(self._times.counts) if self._times is not None else None
        t0 = time.perf_counter()
        yield
        self.calls[k] += 1
        self.seconds[k] += time.perf_counter() - t0
        if self._times is not None:
            self.per_call.append((num_running, {
                name: total - before.get(name, 0.0) for name, total in self._times.seconds.items()
                if total - before.get(name, 0.0) >= 5e-5}, {
                name: n - counts.get(name, 0) for name, n in self._times.counts.items()
                if n != counts.get(name, 0)}))
            phases = self.phases[k]
            for name, total in self._times.seconds.items():
                phases[name] = phases.get(name, 0.0) + total - before.get(name, 0.0)

    def summary(self) -> str:
        lows = (1, *(edge + 1 for edge in self.EDGES))
        highs = (*(str(edge) for edge in self.EDGES), "")
        text = " | by running: " + ", ".join(
            f"{lo}-{hi} {n} calls {s * 1e3:.0f} ms"
            for lo, hi, n, s in zip(lows, highs, self.calls, self.seconds) if n)
        groups = ((f"above {self.EDGES[-1]}", [len(self.EDGES)]),
                  (f"{self.EDGES[0] + 1}-{self.EDGES[-1]}", list(range(1, len(self.EDGES)))))
        for label, buckets in groups:
            num = sum(self.calls[k] for k in buckets)
            phases: dict[str, float] = {}
            for k in buckets:
                for name, s in self.phases[k].items():
                    phases[name] = phases.get(name, 0.0) + s
            if num and phases:
                text += f" | per call {label} running: " + ", ".join(
                    f"{name} {1e3 * s / num:.2f} ms"
                    for name, s in sorted(phases.items()) if s >= 5e-5 * num)
        return text


def loop_time(engine: Engine, adding: float, stepping: float, num_calls: int) -> str:
    """The run's time outside the phases: adding the requests (templates, tokenizing), and the
    step loop's time no phase names (a gap here is host work no phase times)."""
    times = engine.step_times
    named = sum(v for k, v in times.seconds.items() if not k.endswith(("(thread)", "(part)")))
    steps = max(times.counts.get("steps", 0), 1)
    return (f" | adding {adding * 1e3:.0f} ms, stepping {stepping * 1e3:.0f} ms in {num_calls}"
            f" calls, unnamed {(stepping - named) * 1e3 / steps:.2f} ms a step, gc {GC.count}"
            f" collections {GC.seconds * 1e3:.1f} ms")


def compile_all(engine: Engine, rows: list[dict]) -> list[dict]:
    """One token of every row, which compiles every grammar once (and waits for what is built
    after a compile: large schemas' DFAs); the rows not refused."""
    warm = run(engine, rows, 1, free=False, tag="w")
    kept = [r for r, n in zip(rows, warm["lengths"]) if n > 0]
    if not kept:
        raise SystemExit("every grammar was refused: see the engine's log for why")
    backends = Counter()
    for row in kept:
        spec = params_for(row, 1, free=False).constraint
        if spec is None:
            continue
        backends[engine.compiler.submit(spec).result().backend] += 1
    print(f"  grammars of the {len(kept)} requests kept: "
          + ", ".join(f"{n} {name}" for name, n in backends.most_common()),
          file=sys.stderr, flush=True)
    return kept


def paired(engine: Engine, rows: list[dict], max_tokens: int) -> list[dict]:
    """Constrained vs unconstrained on the same prompts with the same output lengths, grammars
    compiled beforehand (compile time is measured by bench_grammar.py): the cost of masking.
    Refused schemas are dropped from both runs."""
    kept = compile_all(engine, rows)
    constrained = run(engine, kept, max_tokens, free=False, tag="c")
    lengths = [max(1, n) for n in constrained["lengths"]]
    free = run(engine, kept, lengths, free=True, tag="f")
    constrained_again = run(engine, kept, max_tokens, free=False, tag="d")
    return [dict(mode="constrained", **constrained), dict(mode="free", **free),
            dict(mode="constrained (repeat)", **constrained_again)]


def rounds(engine: Engine, rows: list[dict], max_tokens: int, num_rounds: int) -> list[dict]:
    """Constrained then free (the same lengths), num_rounds times after one compiling warm run:
    one pair's ratio moves with the host's speed from run to run (a 3 s run on the H200's
    host moved 1.3x between runs of one call), the median of several holds still. Round 1
    prefills prompts the later rounds find in the prefix cache."""
    kept = compile_all(engine, rows)


    pairs = []
    for k in range(num_rounds):
        constrained = run(engine, kept, max_tokens, free=False, tag=f"c{k}-")
        free = run(engine, kept, [max(1, n) for n in constrained["lengths"]], free=True,
                   tag=f"f{k}-")
        pairs.append({"constrained": constrained, "free": free,
                      "ratio": constrained["tok_s"] / free["tok_s"]})
        print(f"  round {k + 1}/{num_rounds}: constrained {constrained['tok_s']:.0f} tok/s, "
              f"free {free['tok_s']:.0f} tok/s, ratio {pairs[-1]['ratio']:.3f}",
              file=sys.stderr, flush=True)
        print(f"    constrained {k + 1}: {constrained['phases']}", file=sys.stderr, flush=True)
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_offline_args(ap)
    ap.add_argument("--free", action="store_true")
    ap.add_argument("--no-jump-forward", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="any other EngineConfig field, e.g. --set jump_forward=false")
    ap.add_argument("--paired", action="store_true",
                    help="constrained vs free with matched lengths, grammars precompiled")
    ap.add_argument("--rounds", type=int, default=0,
                    help="with --paired: this many constrained / free pairs, and their medians")
    ap.add_argument("--output-kind", choices=("final", "cumulative"), default="final",
                    help="final: only finished outputs (offline use); cumulative: every step's")
    args = ap.parse_args()
    OUTPUT_KIND["kind"] = args.output_kind
    options = {"model": args.model, "max_num_seqs": args.concurrency,
               "jump_forward": not args.no_jump_forward}
    options.update({k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)})
    engine = Engine(EngineConfig(**options))
    rows = load(args.workload, args.num_requests)
    run(engine, rows[:8], 8, args.free)  # warm-up: compile caches, graphs
    if args.paired and args.rounds:
        pairs = rounds(engine, rows, args.max_tokens, args.rounds)
        print(f"\n{args.model}, concurrency {args.concurrency}, jump-forward "
              f"{'off' if args.no_jump_forward else 'on'} {' '.join(args.set)}, "
              f"{args.output_kind} outputs: same prompts, same output lengths, "
              f"{args.rounds} rounds\n")
        print("| round | requests | tokens | constrained tok/s | free tok/s | ratio |")
        print("|---|---|---|---|---|---|")
        for k, p in enumerate(pairs):
            print(f"| {k + 1} | {len(p['free']['lengths'])} | {p['free']['tokens']} | "
                  f"{p['constrained']['tok_s']:.0f} | {p['free']['tok_s']:.0f} | "
                  f"{p['ratio']:.3f} |")
        warm = pairs[1:] or pairs  # round 1 prefills what the others find cached
        med = statistics.median
        print(f"| median of rounds {2 if len(pairs) > 1 else 1}-{len(pairs)} | | | "
              f"{med(p['constrained']['tok_s'] for p in warm):.0f} | "
              f"{med(p['free']['tok_s'] for p in warm):.0f} | "
              f"{med(p['ratio'] for p in warm):.3f} |")
        print(f"  last constrained: {pairs[-1]['constrained']['phases']}", file=sys.stderr)
        print(f"  last free: {pairs[-1]['free']['phases']}", file=sys.stderr)
        return
    if args.paired:
        results = paired(engine, rows, args.max_tokens)
        print(f"\n{args.model}, concurrency {args.concurrency}, jump-forward "
              f"{'off' if args.no_jump_forward else 'on'} {' '.join(args.set)}: same prompts, "
              "same output lengths\n")
        print("| mode | requests | tokens | seconds | output tok/s | ratio to free |")
        print("|---|---|---|---|---|---|")
        free_tps = results[1]["tok_s"]
        for r in results:
            print(f"| {r['mode']} | {len(r['lengths'])} | {r['tokens']} | {r['seconds']:.1f} | "
                  f"{r['tok_s']:.0f} | {r['tok_s'] / free_tps:.3f} |")
        for r in results:
            print(f"  {r['mode']}: {r['phases']}", file=sys.stderr)
        return
    r = run(engine, rows, args.max_tokens, args.free)
    label = "free" if args.free else "constrained"
    print(f"{args.model} {label} conc {args.concurrency}: {r['tok_s']:.0f} tok/s "
          f"({r['tokens']} tokens in {r['seconds']:.1f} s, {r['refused']} refused)\n"
          f"  {r['phases']}", file=sys.stderr)
    print(json.dumps({"model": args.model, "mode": label, **r}))


if __name__ == "__main__":
    main()
