"""Grammar soundness over the shared JSON-schema material: no invalid instance may be accepted.

For each schema: compile it (or record the refusal), serialize each labelled instance the ways
the grammar's output can look (compact and ", "/": " separators), feed the bytes (or the tokens,
--mode tokens) and then EOS. A false accept (an invalid instance accepted through EOS on an
accepted schema) is a soundness bug; a false reject costs coverage only. "Invalid" means invalid
by the material's label *or* by jsonschema Draft 2020-12 with format checking (the contract).

    python benchmarks/grammar_soundness.py [--limit N] [--workers N] [--mode bytes|tokens]
"""
from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = Path(os.environ.get("GUIDED_DATA_DIR", "/work/shared/data"))
WALK_STEPS = 400
CLOSERS = (b'"', b"}", b"]", b'"}', b'"]', b"}]", b"]}")
FILES = sorted(glob.glob(str(DATA / "json-schema-test-suite" / "*.jsonl"))) + sorted(
    glob.glob(str(DATA / "jsonschemabench" / "*.jsonl")))


@dataclass
class Case:
    subset: str
    schema_id: str
    schema: object
    instances: list  # [(value, label_valid)]


@dataclass
class Outcome:
    subset: str
    schema_id: str
    refused: str | None = None
    num_valid: int = 0
    num_invalid: int = 0
    false_accepts: list = field(default_factory=list)  # (instance json, why invalid)
    false_rejects: list = field(default_factory=list)
    artefacts: int = 0  # valid instances rejected only for their number formatting
    keywords: list = field(default_factory=list)
    compile_ms: float = 0.0
    num_walks: int = 0  # random outputs of the grammar validated (--walks)


def load_cases(limit_per_file: int | None = None, files: list[str] | None = None) -> list[Case]:
    cases = []
    for path in files or FILES:
        with open(path) as f:
            for i, line in enumerate(f):
                if limit_per_file is not None and i >= limit_per_file:
                    break
                record = json.loads(line)
                if "tests" in record:
                    subset = "jsts/" + Path(path).stem.replace("jsts_", "")
                    instances = [(t["data"], t["valid"]) for t in record["tests"]]
                else:
                    subset = record["subset"]
                    instances = [(v, True) for v in record["valid"]] + [
                        (v, False) for v in record["invalid"]]
                cases.append(Case(subset, record["id"], record["schema"], instances))
    return cases


def keywords_of(schema, out: set | None = None) -> set:
    out = set() if out is None else out
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in ("properties", "$defs", "definitions", "patternProperties",
                       "dependentSchemas") and isinstance(value, dict):
                out.add(key)
                for sub in value.values():
                    keywords_of(sub, out)
                continue
            out.add(key if key != "format" else f"format:{value}")
            if isinstance(value, (dict, list)) and key not in ("enum", "const", "examples",
                                                               "default", "required"):
                keywords_of(value, out)
    elif isinstance(schema, list):
        for item in schema:
            keywords_of(item, out)
    return out


def serializations(value) -> list[str]:
    # the grammar writes properties in the schema's order; instances list them in their own
    # order (or sorted): a valid instance in another order is a serialization artefact
    texts = [json.dumps(value, ensure_ascii=False, separators=sep, sort_keys=sort)
             for sort in (True, False) for sep in ((", ", ": "), (",", ":"))]
    return list(dict.fromkeys(texts))


def _normalize_numbers(value):
    """Integral floats -> ints: how a grammar that writes 1 for 1.0 would serialize it."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, list):
        return [_normalize_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalize_numbers(v) for k, v in value.items()}
    return value


class Checker:
    """Per-process state: one compiler, one tokenizer."""

    def __init__(self, mode: str, any_whitespace: bool, max_whitespace: int, timeout_s: float,
                 tokenizer=None, walks: int = 0):
        from guided.fsm.compiler import GrammarCompiler
        from guided.fsm.settings import CompileSettings

        if tokenizer is None:
            sys.path.insert(0, str(ROOT / "tests"))
            from conftest import load_test_tokenizer

            tokenizer = load_test_tokenizer()
        self.tokenizer = tokenizer
        config = CompileSettings(any_whitespace=any_whitespace, max_whitespace=max_whitespace,
                              compile_timeout_s=timeout_s, compile_threads=1,
                              grammar_cache_size=4)
        self.compiler = GrammarCompiler(self.tokenizer, vocab_size=len(self.tokenizer),
                                        config=config)
        self.eos = self.compiler.vocab.eos_token_ids[0]
        self.mode = mode
        self.any_whitespace = any_whitespace
        self.walks = walks

    def close(self) -> None:
        self.compiler.shutdown()

    def accepts(self, factory, text: str) -> bool:
        matcher = factory()
        if self.mode == "bytes":
            ok = matcher.accept_bytes(text.encode("utf-8", "surrogatepass"))
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            ok = all(matcher.accept_token(i) for i in ids)
        return ok and matcher.accept_token(self.eos) and matcher.is_terminated()

    def walk(self, factory, rng) -> bytes | None:
        """An output drawn at random, token by token, among what the grammar allows (short
        tokens, and EOS once allowed after a while, so that strings and the walk end); None if
        it did not end within the step budget."""
        import numpy as np
        import torch

        matcher = factory()
        token_bytes = self.compiler.vocab.token_bytes
        row = torch.zeros((1, (self.compiler.vocab.vocab_size + 31) // 32), dtype=torch.int32)
        out = b""
        for step in range(WALK_STEPS):
            matcher.fill_bitmask(row, 0)
            ids = np.flatnonzero(np.unpackbits(row[0].numpy().view(np.uint8), bitorder="little"))
            if len(ids) == 0:
                return None
            late = step > WALK_STEPS // 8
            closers = [int(i) for i in ids if token_bytes[i] in CLOSERS] if late else []
            if self.eos in ids and (len(ids) == 1 or late or rng.random() < .2):
                token = self.eos
            elif closers and rng.random() < 0.5:  # past a while, end strings and containers
                token = rng.choice(closers)
            else:
                picks = [int(i) for i in rng.sample(list(ids), min(6, len(ids))) if i != self.eos]
                token = min(picks, key=lambda i: len(token_bytes[i]))
            if not matcher.accept_token(token):
                raise RuntimeError(f"a token of its own mask was refused: {token}")
            if token == self.eos:
                return out
            out += token_bytes[token]
        return None

    def variants(self, value) -> list[str]:
        texts = serializations(value)
        if not self.any_whitespace:  # the compact-separators grammar writes ", " and ": "
            texts = texts[::2]
        return texts

    def run(self, case: Case) -> Outcome:
        from jsonschema import Draft202012Validator

        from guided.errors import CompileTimeoutError, ConstraintError
        from guided.params import ConstraintSpec

        out = Outcome(case.subset, case.schema_id, keywords=sorted(keywords_of(case.schema)))
        try:
            spec = ConstraintSpec.json_schema(case.schema)
            start = time.perf_counter()
            grammar = self.compiler.compile(spec)
            out.compile_ms = (time.perf_counter() - start) * 1e3
        except (ConstraintError, CompileTimeoutError) as e:  # a timeout: not served either
            out.refused = str(e)
            return out
        factory = grammar.matcher
        try:
            validator = Draft202012Validator(case.schema,
                                             format_checker=Draft202012Validator.FORMAT_CHECKER)
        except Exception:  # noqa: BLE001 - material with schemas jsonschema cannot load
            validator = None
        for value, label in case.instances:
            try:
                contract_ok = validator is None or validator.is_valid(value)
            except Exception:  # noqa: BLE001 - e.g. unresolvable remote refs
                contract_ok = label
            valid = label and contract_ok
            try:
                texts = self.variants(value)
            except (TypeError, ValueError):
                continue
            accepted = any(self.accepts(factory, t) for t in texts)
            if valid:
                out.num_valid += 1
                if not accepted:
                    normalized = _normalize_numbers(value)
                    if normalized != value or json.dumps(normalized) != json.dumps(value):
                        if any(self.accepts(factory, t) for t in self.variants(normalized)):
                            out.artefacts += 1
                            continue
                    out.false_rejects.append(texts[0][:200])
            else:
                out.num_invalid += 1
                if accepted:
                    why = "label" if not label else "jsonschema-2020-12"
                    out.false_accepts.append((texts[0][:300], why))
        self._walks(case, factory, validator, out)
        return out

    def _walks(self, case: Case, factory, validator, out: Outcome) -> None:
        """Random outputs of the grammar, each validated: one that fails is a false accept."""
        import random

        rng = random.Random(case.schema_id)
        for _ in range(self.walks if validator is not None else 0):
            text = self.walk(factory, rng)
            if text is None:
                continue
            out.num_walks += 1
            try:
                value = json.loads(text)
            except ValueError as e:
                why = f"walk: not JSON: {e}"
            else:
                try:
                    error = next(iter(validator.iter_errors(value)), None)
                except Exception:  # noqa: BLE001, S112 - e.g. unresolvable remote refs: no verdict
                    continue
                why = None if error is None else f"walk: {error.message[:120]}"
            if why is not None:
                out.false_accepts.append((text.decode("utf-8", "replace")[:300], why))


_checker: Checker | None = None


def _init(mode: str, any_whitespace: bool, max_whitespace: int, timeout_s: float,
          walks: int = 0) -> None:
    global _checker
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # xgrammar's C++ warnings (ignored anchors, ...) flood stderr
    _checker = Checker(mode, any_whitespace, max_whitespace, timeout_s, walks=walks)


def _run(case: Case) -> Outcome:
    assert _checker is not None
    return _checker.run(case)


def refusal_keyword(message: str) -> str:
    if message.startswith("unsupported JSON Schema keyword '"):
        keyword = message.split("'")[1]
        if keyword == "format" and "format '" in message:
            return "format:" + message.split("format '")[1].split("'")[0]
        return keyword
    if "timed out" in message:
        return "(timeout)"
    if message.startswith("invalid JSON schema"):
        return "(invalid schema)"
    if message.startswith("cannot compile"):
        return "(backend error)"
    return "(other: " + message[:40] + ")"


def report(outcomes: list[Outcome], seconds: float) -> str:
    lines = ["| subset | schemas | refused | coverage | valid inst. | invalid inst. | "
             "false accepts | false rejects | number artefacts |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by_subset: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_subset[o.subset].append(o)
    total = Counter()
    for subset in sorted(by_subset):
        rows = by_subset[subset]
        c = Counter(schemas=len(rows), refused=sum(o.refused is not None for o in rows),
                    valid=sum(o.num_valid for o in rows), invalid=sum(o.num_invalid for o in rows),
                    fa=sum(len(o.false_accepts) for o in rows),
                    fr=sum(len(o.false_rejects) for o in rows),
                    art=sum(o.artefacts for o in rows))
        total.update(c)
        lines.append(_row(subset, c))
    lines.append(_row("**total**", total))
    lines += ["", "False accepts / false rejects by keyword present in the schema "
              "(a schema counts under each of its keywords):", "",
              "| keyword | schemas accepted | false accepts | false rejects |", "|---|---:|---:|---:|"]
    per_kw: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        if o.refused is None:
            for k in o.keywords:
                per_kw[k]["accepted"] += 1
                per_kw[k]["fa"] += len(o.false_accepts)
                per_kw[k]["fr"] += len(o.false_rejects)
    for k, c in sorted(per_kw.items(), key=lambda kv: (-kv[1]["fa"], -kv[1]["fr"], kv[0])):
        if c["fa"] or c["fr"]:
            lines.append(f"| {k} | {c['accepted']} | {c['fa']} | {c['fr']} |")
    lines += ["", "Refusals by reason:", "", "| reason | schemas |", "|---|---:|"]
    reasons = Counter(refusal_keyword(o.refused) for o in outcomes if o.refused)
    lines += [f"| {k} | {n} |" for k, n in reasons.most_common()]
    fas = [(o.schema_id, fa) for o in outcomes for fa in o.false_accepts]
    if fas:
        lines += ["", "False accepts (soundness bugs):"]
        lines += [f"- {sid}: {text} ({why})" for sid, (text, why) in fas[:50]]
    walks = sum(o.num_walks for o in outcomes)
    if walks:
        lines += ["", (f"{walks} random outputs of accepted grammars validated (--walks); "
                       "failures are listed with the false accepts")]
    lines += ["", f"({len(outcomes)} schemas in {seconds:.0f} s)"]
    return "\n".join(lines)


def _row(name: str, c: Counter) -> str:
    coverage = (c["schemas"] - c["refused"]) / max(1, c["schemas"])
    return (f"| {name} | {c['schemas']} | {c['refused']} | {coverage:.1%} | {c['valid']} | "
            f"{c['invalid']} | {c['fa']} | {c['fr']} | {c['art']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="schemas per file")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--mode", choices=("bytes", "tokens"), default="bytes")
    parser.add_argument("--compact", action="store_true", help="any_whitespace=False")
    parser.add_argument("--max-whitespace", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--walks", type=int, default=0,
                        help="random outputs per accepted schema, each validated with jsonschema")
    parser.add_argument("--json-out", default=None, help="write per-schema outcomes here")
    args = parser.parse_args()
    cases = load_cases(args.limit)
    print(f"{len(cases)} schemas from {len(FILES)} files, {args.workers} workers", flush=True)
    start = time.time()
    outcomes = []
    done: set[str] = set()
    if args.json_out and os.path.exists(args.json_out):  # resume an interrupted run
        with open(args.json_out) as f:
            outcomes = [Outcome(**json.loads(line)) for line in f]
        done = {o.schema_id for o in outcomes}
        cases = [c for c in cases if c.schema_id not in done]
        print(f"resuming: {len(done)} outcomes read from {args.json_out}", flush=True)
    sink = open(args.json_out, "a") if args.json_out else None  # noqa: SIM115
    init_args = (args.mode, not args.compact, args.max_whitespace, args.timeout, args.walks)
    # big schemas first so the tail of the run is not one slow worker
    cases.sort(key=lambda c: -len(json.dumps(c.schema)))
    with mp.get_context("spawn").Pool(args.workers, initializer=_init,
                                      initargs=init_args) as pool:
        for i, outcome in enumerate(pool.imap_unordered(_run, cases, chunksize=4)):
            outcomes.append(outcome)
            if sink is not None:
                sink.write(json.dumps(outcome.__dict__) + "\n")
                sink.flush()
            for text, why in outcome.false_accepts:
                print(f"  FALSE ACCEPT {outcome.schema_id}: {text[:160]} ({why})", flush=True)
            if (i + 1) % 250 == 0:
                fa = sum(len(o.false_accepts) for o in outcomes)
                print(f"  {i + 1}/{len(cases)} done, {time.time() - start:.0f} s, "
                      f"false accepts so far {fa}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.writelines(json.dumps(o.__dict__) + "\n" for o in outcomes)
    print(report(outcomes, time.time() - start))


if __name__ == "__main__":
    main()
