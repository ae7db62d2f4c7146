"""Schema coverage and soundness, guided against llguidance alone and xgrammar alone.

    python benchmarks/coverage.py [--limit N] [--subsets Glaiveai2K,jsts/draft7] [--workers N]
                                  [--json-out F]

Per subset of ../shared/data (JSONSchemaBench and the JSON-Schema-Test-Suite), each engine is
given the same schemas with the same tokenizer (the default model's):
- coverage: schemas it accepted (compiled without an error within --timeout);
- valid accepted: of the valid instances of accepted schemas, those the grammar admits (in any of
  the usual serializations: compact or ", " / ": " separators, keys sorted or as given);
- false accepts: invalid instances admitted, a soundness bug. Invalid means invalid by the
  material's label or by jsonschema (Draft 2020-12, formats checked), the contract guided keeps;
  valid means both agree it is valid. False accepts are counted by the keyword jsonschema names
  for the failure ("(label)" where only the label says invalid).
guided runs as the engine compiles by default (check_schema, then xgrammar with compact
separators); xgrammar alone runs with its defaults (strict mode, any whitespace), llguidance
alone with its defaults (flexible whitespace). Progress goes to stderr, the table to stdout. --json-out keeps per-schema outcomes and resumes an interrupted run.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grammar_soundness import FILES, Case, load_cases, refusal_keyword, serializations  # noqa: E402

ENGINES = ("guided", "llguidance", "xgrammar")
BUSY_RETRIES = 600  # one a second


@dataclass
class EngineOutcome:
    refused: str | None = None
    compile_ms: float = 0.0
    valid_accepted: int = 0
    false_accepts: list = field(default_factory=list)  # [keyword, instance text]


@dataclass
class Outcome:
    subset: str
    schema_id: str
    num_valid: int = 0
    num_invalid: int = 0
    engines: dict = field(default_factory=dict)  # engine -> EngineOutcome as a dict


def _with_timeout(fn, timeout_s: float):
    """fn() in a daemon thread: its result, or TimeoutError (the thread is abandoned; the
    compilers release the GIL, so it costs a core until it ends, never the run)."""
    box: list = []

    def target() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - a Rust panic is a BaseException
            box.append((False, e))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not box:
        raise TimeoutError(f"timed out after {timeout_s:.0f} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


class Engines:
    """One process's compilers, each behind compile(schema) -> accepts(text) -> bool."""

    def __init__(self, timeout_s: float):
        import llguidance
        import llguidance.hf
        import xgrammar as xgr

        from guided.fsm.compiler import GrammarCompiler
        from guided.fsm.settings import CompileSettings
        from guided.worker.loader import load_tokenizer

        tokenizer = load_tokenizer("default")
        self.timeout_s = timeout_s
        self.waited_s = 0.0  # the last guided compile's wait for a busy compiler
        config = CompileSettings(compile_timeout_s=timeout_s, compile_threads=1,
                              grammar_cache_size=4)
        self.guided = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), config=config)
        self.eos = self.guided.vocab.eos_token_ids[0]
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.xgr = xgr
        self.xgrammar = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.llg = llguidance
        self.llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def compile(self, engine: str, schema):
        return getattr(self, f"_compile_{engine}")(schema)

    def _compile_guided(self, schema):
        from guided.errors import CompileTimeoutError
        from guided.params import ConstraintSpec

        spec = ConstraintSpec.json_schema(schema)
        waited = time.perf_counter()
        for _ in range(BUSY_RETRIES):
            # a compile past its timeout goes on in the background and the compiler refuses
            # new specs while its queue is that deep: wait for it rather than count a refusal
            started = time.perf_counter()
            try:
                grammar = self.guided.compile(spec)
                break
            except CompileTimeoutError as e:
                if "busy" not in str(e) and "waiting to compile" not in str(e):
                    raise
                time.sleep(1.0)
        else:
            raise TimeoutError("the compiler stayed busy")
        self.waited_s = started - waited

        def accepts(text: str) -> bool:
            matcher = grammar.matcher()
            return (matcher.accept_bytes(text.encode("utf-8", "surrogatepass"))
                    and matcher.accept_token(self.eos) and matcher.is_terminated())

        return accepts

    def _compile_xgrammar(self, schema):
        compiled = _with_timeout(lambda: self.xgrammar.compile_json_schema(json.dumps(schema)),
                                 self.timeout_s)

        def accepts(text: str) -> bool:
            matcher = self.xgr.GrammarMatcher(compiled)
            return (matcher.accept_string(text) and matcher.accept_token(self.eos)
                    and matcher.is_terminated())

        return accepts

    def _compile_llguidance(self, schema):
        matcher_class = self.llg.LLMatcher
        grammar = matcher_class.grammar_from_json_schema(schema)
        first = _with_timeout(lambda: matcher_class(self.llg_tokenizer, grammar, log_level=0),
                              self.timeout_s)
        if first.is_error():
            raise ValueError(first.get_error())

        def accepts(text: str) -> bool:
            matcher = first.deep_copy()
            ids = self.llg_tokenizer.tokenize_str(text)
            return matcher.consume_tokens(ids) and matcher.is_accepting()

        return accepts

    def close(self) -> None:
        self.guided.shutdown()


def _failure_keyword(validator, value, label: bool) -> str | None:
    """None if the instance is valid (label and jsonschema agree), else the failing keyword."""
    from jsonschema.exceptions import best_match

    if validator is not None:
        try:
            error = best_match(validator.iter_errors(value))
        except Exception:  # noqa: BLE001 - e.g. unresolvable remote refs: the label decides
            error = None
        if error is not None:
            return str(error.validator)
    return None if label else "(label)"


def run_case(engines: Engines, case: Case) -> Outcome:
    from jsonschema import Draft202012Validator

    try:
        validator = Draft202012Validator(case.schema,
                                         format_checker=Draft202012Validator.FORMAT_CHECKER)
    except Exception:  # noqa: BLE001 - material jsonschema cannot load
        validator = None
    instances = []
    for value, label in case.instances:
        try:
            texts = serializations(value)
        except (TypeError, ValueError):
            continue
        instances.append((texts, _failure_keyword(validator, value, label)))
    out = Outcome(case.subset, case.schema_id,
                  num_valid=sum(kw is None for _, kw in instances),
                  num_invalid=sum(kw is not None for _, kw in instances))
    for engine in ENGINES:
        result = EngineOutcome()
        engines.waited_s = 0.0
        start = time.perf_counter()
        try:
            accepts = engines.compile(engine, case.schema)
        except BaseException as e:  # noqa: BLE001 - refusals, errors, Rust panics alike
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            result.refused = (str(e) or type(e).__name__)[:300]
        result.compile_ms = (time.perf_counter() - start - engines.waited_s) * 1e3
        if result.refused is None:
            for texts, keyword in instances:
                accepted = any(accepts(t) for t in texts)
                if keyword is None:
                    result.valid_accepted += accepted
                elif accepted:
                    result.false_accepts.append([keyword, texts[0][:200]])
        out.engines[engine] = asdict(result)
    return out


_engines: Engines | None = None


def _init(timeout_s: float) -> None:
    global _engines
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # xgrammar's C++ warnings flood stderr
    _engines = Engines(timeout_s)


def _run(case: Case) -> Outcome:
    assert _engines is not None
    return run_case(_engines, case)


def sample_cases(limit: int | None, subsets: set[str] | None) -> list[Case]:
    """Every case, or `limit` per subset spread evenly over its file (not its first lines)."""
    by_subset: dict[str, list[Case]] = defaultdict(list)
    for case in load_cases(None, FILES):
        if subsets is None or case.subset in subsets:
            by_subset[case.subset].append(case)
    cases = []
    for rows in by_subset.values():
        if limit is None or len(rows) <= limit:
            cases += rows
        else:
            cases += [rows[i * len(rows) // limit] for i in range(limit)]
    return cases


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def report(outcomes: list[Outcome], seconds: float) -> str:
    by_subset: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_subset[o.subset].append(o)
    head = ["subset", "schemas"] + [f"{e} coverage" for e in ENGINES] + [
        f"{e} valid accepted" for e in ENGINES] + [f"{e} false accepts" for e in ENGINES]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for subset in [*sorted(by_subset), None]:
        rows = outcomes if subset is None else by_subset[subset]
        cells = ["**all**" if subset is None else subset, str(len(rows))]
        accepted = {e: [o for o in rows if o.engines[e]["refused"] is None] for e in ENGINES}
        cells += [_pct(len(accepted[e]), len(rows)) for e in ENGINES]
        cells += [_pct(sum(o.engines[e]["valid_accepted"] for o in accepted[e]),
                       sum(o.num_valid for o in accepted[e])) for e in ENGINES]
        cells += [str(sum(len(o.engines[e]["false_accepts"]) for o in rows)) for e in ENGINES]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "False accepts by the keyword jsonschema names:", "",
              "| keyword | " + " | ".join(ENGINES) + " |", "|---|" + "---:|" * len(ENGINES)]
    per_kw: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        for e in ENGINES:
            for keyword, _ in o.engines[e]["false_accepts"]:
                per_kw[keyword][e] += 1
    for keyword, c in sorted(per_kw.items(), key=lambda kv: -sum(kv[1].values())):
        lines.append(f"| {keyword} | " + " | ".join(str(c[e]) for e in ENGINES) + " |")
    lines += ["", "Compile time per schema, ms (accepted and refused alike):", "",
              "| engine | p50 | p90 | p99 | max |", "|---|---:|---:|---:|---:|"]
    for e in ENGINES:
        ms = sorted(o.engines[e]["compile_ms"] for o in outcomes)
        if ms:
            at = [ms[int(q * (len(ms) - 1))] for q in (0.5, 0.9, 0.99)]
            lines.append(f"| {e} | " + " | ".join(f"{v:.1f}" for v in [*at, ms[-1]]) + " |")
    lines += ["", "guided's refusals by reason (schemas):", "", "| reason | schemas |",
              "|---|---:|"]
    reasons = Counter(refusal_keyword(o.engines["guided"]["refused"]) for o in outcomes
                      if o.engines["guided"]["refused"])
    lines += [f"| {k} | {n} |" for k, n in reasons.most_common(30)]
    guided_fas = [(o.schema_id, fa) for o in outcomes for fa in o.engines["guided"]["false_accepts"]]
    if guided_fas:
        lines += ["", "guided's false accepts (soundness bugs):"]
        lines += [f"- {sid}: [{kw}] {text}" for sid, (kw, text) in guided_fas[:50]]
    lines += ["", f"({len(outcomes)} schemas in {seconds:.0f} s)"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="schemas per subset, spread evenly")
    ap.add_argument("--subsets", default=None, help="comma-separated, e.g. JME,jsts/draft7")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=30.0, help="compile timeout per engine, s")
    ap.add_argument("--json-out", default=None, help="per-schema outcomes (resumes a run)")
    args = ap.parse_args()
    subsets = set(args.subsets.split(",")) if args.subsets else None
    cases = sample_cases(args.limit, subsets)
    outcomes: list[Outcome] = []
    if args.json_out and os.path.exists(args.json_out):
        with open(args.json_out) as f:
            outcomes = [Outcome(**json.loads(line)) for line in f]
        done = {o.schema_id for o in outcomes}
        cases = [c for c in cases if c.schema_id not in done]
        print(f"resuming: {len(done)} outcomes from {args.json_out}", file=sys.stderr)
    print(f"{len(cases)} schemas, {args.workers} workers", file=sys.stderr, flush=True)
    cases.sort(key=lambda c: -len(json.dumps(c.schema)))  # big first: no slow tail
    sink = open(args.json_out, "a") if args.json_out else None  # noqa: SIM115
    start = time.time()
    with mp.get_context("spawn").Pool(args.workers, initializer=_init,
                                      initargs=(args.timeout,)) as pool:
        for i, outcome in enumerate(pool.imap_unordered(_run, cases, chunksize=2)):
            outcomes.append(outcome)
            if sink is not None:
                sink.write(json.dumps(asdict(outcome)) + "\n")
                sink.flush()
            for keyword, text in outcome.engines["guided"]["false_accepts"]:
                print(f"  GUIDED FALSE ACCEPT {outcome.schema_id} [{keyword}]: {text[:160]}",
                      file=sys.stderr, flush=True)
            if (i + 1) % 50 == 0 or i + 1 == len(cases):
                print(f"  {i + 1}/{len(cases)} schemas, {time.time() - start:.0f} s",
                      file=sys.stderr, flush=True)
    print(report(outcomes, time.time() - start))


if __name__ == "__main__":
    main()
