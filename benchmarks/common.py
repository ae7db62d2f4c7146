"""Shared helpers of the structured-generation benchmarks: data loading, prompts, batch driving,
jsonschema validation and markdown tables. The data is read in place (never copied)."""
from __future__ import annotations

import gc
import json
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / ".." / "shared" / "data"
if str(ROOT) not in sys.path:  # scripts run as `python benchmarks/x.py` from a checkout
    sys.path.insert(0, str(ROOT))
JSB_SUBSETS = ("Glaiveai2K", "Github_easy", "Github_medium", "Kubernetes", "Snowplow", "JME",
               "BFCL_simple", "BFCL_multiple", "BFCL_parallel", "BFCL_parallel_multiple",
               "BFCL_java", "BFCL_javascript", "BFCL_sql")
BFCL_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "simple_java",
                   "simple_javascript")
MAX_SCHEMA_CHARS = 1200  # longer schema texts are cut in the prompt (the constraint is whole)


def per_call_us(fn, repeats: int) -> float:
    """Mean microseconds of a call of fn, after one untimed call."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


@dataclass(slots=True)
class SchemaCase:
    id: str
    subset: str
    schema: dict | bool
    example_chars: int = 0  # the longest valid instance given with the schema, as compact JSON


def set_torch_threads(num: int) -> None:
    """On a shared CPU box, OpenMP threads spin-waiting for each other under contention made
    decoding ~9x slower with 2 threads than with 1 (measured here); 0 keeps torch's default."""
    if num > 0:
        import torch

        torch.set_num_threads(num)


def add_run_args(ap) -> None:
    """--data, --device and --threads: the flags every schema-driven benchmark takes."""
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (0: torch's default); 1 is robust on a shared box")


def add_offline_args(ap, *, concurrency: int = 64) -> None:
    """--model, --workload, --num-requests, --concurrency and --max-tokens: an offline run over
    an exported workload (engine_offline.py and the profilers)."""
    ap.add_argument("--model", default="default")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=concurrency)
    ap.add_argument("--max-tokens", type=int, default=256)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- data ---------------------------------------------------------------------------------------

def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def workload_schemas(path: str, num: int) -> list[dict | bool]:
    """The JSON schemas of the first num requests of a file from serve.py --export-workload."""
    return [row["body"]["response_format"]["json_schema"]["schema"]
            for row in _read_jsonl(Path(path))[:num]]


def load_jsonschemabench(data_dir: Path, subsets: Iterable[str] | None = None
                         ) -> dict[str, list[SchemaCase]]:
    """subset -> its schemas (subsets without a file are left out)."""
    folder = Path(data_dir) / "jsonschemabench"
    out: dict[str, list[SchemaCase]] = {}
    for subset in subsets or JSB_SUBSETS:
        path = folder / f"{subset}.jsonl"
        if path.exists():
            out[subset] = [SchemaCase(r["id"], r.get("subset", subset), r["schema"], max(
                (len(json.dumps(v, separators=(",", ":"))) for v in r.get("valid") or []),
                default=0)) for r in _read_jsonl(path)]
    return out


def sample_stratified(by_subset: dict[str, list[SchemaCase]], num: int, *, seed: int = 0
                      ) -> list[SchemaCase]:
    """num cases spread evenly over subsets (a small subset gives all it has, the rest is shared
    among the others), each subset drawn with a fixed seed; ordered by subset, then id."""
    rng = random.Random(seed)
    pools = {s: sorted(cases, key=lambda c: c.id) for s, cases in by_subset.items() if cases}
    quota = {s: 0 for s in pools}
    left = num
    while left > 0 and any(quota[s] < len(pools[s]) for s in pools):
        open_subsets = [s for s in pools if quota[s] < len(pools[s])]
        share = max(1, left // len(open_subsets))
        for s in open_subsets:
            take = min(share, len(pools[s]) - quota[s], left)
            quota[s] += take
            left -= take
            if left == 0:
                break
    picked = []
    for s, pool in pools.items():
        picked += sorted(rng.sample(pool, quota[s]), key=lambda c: c.id)
    return picked


def load_bfcl_tool_schemas(data_dir: Path, num: int, *, seed: int = 0) -> list[SchemaCase]:
    """Distinct tool parameter schemas from bfcl/*.jsonl, spread over categories."""
    folder = Path(data_dir) / "bfcl"
    by_category: dict[str, list[SchemaCase]] = {}
    for category in BFCL_CATEGORIES:
        path = folder / f"{category}.jsonl"
        if not path.exists():
            continue
        seen: set[str] = set()
        cases = []
        for record in _read_jsonl(path):
            for tool in record.get("tools") or []:
                fn = tool.get("function", {})
                params = fn.get("parameters")
                key = json.dumps(params, sort_keys=True)
                if not isinstance(params, dict) or key in seen:
                    continue
                seen.add(key)
                cases.append(SchemaCase(f"bfcl/{record['id']}/{fn.get('name')}",
                                        f"bfcl_{category}", params))
        by_category[category] = cases
    return sample_stratified(by_category, num, seed=seed)


# ---- prompts ------------------------------------------------------------------------------------

def schema_messages(schema: dict | bool, *, max_chars: int = MAX_SCHEMA_CHARS) -> list[dict]:
    text = json.dumps(schema, ensure_ascii=False)
    if len(text) > max_chars:
        text = text[:max_chars] + " ...(truncated)"
    return [{"role": "user",
             "content": f"Generate a JSON object that matches this schema: {text}"}]


# ---- validation ---------------------------------------------------------------------------------

def validation_error(schema: dict | bool, text: str) -> str | None:
    """None if text is JSON valid under schema (Draft 2020-12, formats checked), else why not."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    try:
        instance = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    try:
        validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
        error = best_match(validator.iter_errors(instance))
    except Exception as e:  # noqa: BLE001 - an unresolvable $ref etc. is reported, not raised
        return f"validator failed: {e!r}"[:500]
    if error is None:
        return None
    return f"{error.message[:300]} at {error.json_path}"


# ---- driving the engine -------------------------------------------------------------------------

def run_batch(engine, prompts: Sequence, params: Sequence, *, label: str = "",
              every: float = 0) -> tuple[list, float]:
    """Submit every request at once and step to the end, printing progress every `every` s.
    Returns (outputs in order, a ConstraintError for one refused at add_request; wall seconds)."""
    from guided.errors import ConstraintError

    start = time.perf_counter()
    ids: list[str | None] = []
    done: dict[str, object] = {}
    base = f"bench-{time.monotonic_ns()}"
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        request_id = f"{base}-{i}"
        try:
            engine.add_request(request_id, prompt, p)
        except ConstraintError as e:
            done[request_id] = e
        ids.append(request_id)
    last = start
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        now = time.perf_counter()
        if every and now - last >= every:
            last = now
            stats = engine.stats()
            progress(f"  {label}: {len(done)}/{len(ids)} done, {stats.num_running} running, "
                     f"{stats.generation_tokens_total} tokens generated ({now - start:.0f} s)")
    return [done[i] for i in ids], time.perf_counter() - start


def run_sequential(engine, prompts: Sequence, params: Sequence) -> tuple[list, float]:
    """One request at a time (batch-1 latency)."""
    outputs, seconds = [], 0.0
    for prompt, p in zip(prompts, params):
        outs, s = run_batch(engine, [prompt], [p])
        outputs += outs
        seconds += s
    return outputs, seconds


# ---- tables -------------------------------------------------------------------------------------

def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    def cell(v) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


class GcTimer:
    """Python's cyclic collections since the last reset: how many, how many of them full
    (generation 2), and the seconds in them. A collection holds the GIL, so every thread
    waits it out (a full one walks every live object not frozen: milliseconds, more as
    compiled grammars pile up)."""

    def __init__(self):
        self.count, self.full, self.seconds, self._start = 0, 0, 0.0, 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count += 1
            self.full += info.get("generation") == 2
            self.seconds += time.perf_counter() - self._start

    def reset(self) -> None:
        self.count, self.full, self.seconds = 0, 0, 0.0

    def close(self) -> None:
        if self._note in gc.callbacks:
            gc.callbacks.remove(self._note)
