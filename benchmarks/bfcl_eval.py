"""BFCL-style tool-calling eval against a guided server: call-format validity and AST accuracy.

    python benchmarks/bfcl_eval.py --limit 20                  # starts a server (default model)
    python benchmarks/bfcl_eval.py --url http://127.0.0.1:8000 # against a running one

Per category (simple_python, multiple, parallel, irrelevance): every request is sent with its
tools and tool_choice "auto" (parallel_tool_calls true for `parallel`, false otherwise), greedy.
- format valid: returned tool calls whose arguments parse and validate against their tool's
  parameters schema (the engine guarantees this: it must be 100%);
- accuracy: BFCL's AST match: the right functions (one-to-one, any order, for parallel), every
  required argument present, no unknown ones, each value among the acceptable ones ("" in the
  acceptable list: the argument may be omitted); irrelevance: the rate of answers without a call.
Prints progress to stderr and one markdown table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import jsonschema
import openai

DATA_DIR = Path("/work/shared/data/bfcl")
CATEGORIES = ("simple_python", "multiple", "parallel", "irrelevance")


@dataclass
class Tally:
    n: int = 0
    with_calls: int = 0
    calls: int = 0
    valid_calls: int = 0
    correct: int = 0
    truncated: int = 0
    errors: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


# ---- AST matching (BFCL's rules, simplified) -------------------------------------------------

def _norm_str(s: str) -> str:
    return re.sub(r"[ ,./\-_*^]", "", s).lower()


def _value_matches(value, acceptable) -> bool:
    if isinstance(acceptable, str) and isinstance(value, str):
        return _norm_str(value) == _norm_str(acceptable)
    if isinstance(acceptable, bool) or isinstance(value, bool):
        return value is acceptable if isinstance(acceptable, bool) else False
    if isinstance(acceptable, (int, float)) and isinstance(value, (int, float)):
        return float(value) == float(acceptable)
    if isinstance(acceptable, list) and isinstance(value, (list, tuple)):
        return len(value) == len(acceptable) and all(
            _value_matches(v, a) for v, a in zip(value, acceptable))
    if isinstance(acceptable, dict) and isinstance(value, dict):
        return _args_match(value, {k: v if isinstance(v, list) else [v]
                                   for k, v in acceptable.items()})
    return value == acceptable


def _args_match(args: dict, expected: dict) -> bool:
    if set(args) - set(expected):
        return False
    for name, options in expected.items():
        if name not in args:
            if "" not in options:
                return False
            continue
        if not any(_value_matches(args[name], o) for o in options if o != ""):
            return False
    return True


def _call_matches(call: tuple[str, dict], expected: dict, name_map: dict) -> bool:
    [(fn, exp_args)] = expected.items()
    return name_map.get(call[0], call[0]) == fn and _args_match(call[1], exp_args)


def calls_match(calls: list[tuple[str, dict]], ground_truth: list[dict], name_map: dict) -> bool:
    if len(calls) != len(ground_truth):
        return False
    remaining = list(ground_truth)
    for call in calls:
        hit = next((g for g in remaining if _call_matches(call, g, name_map)), None)
        if hit is None:
            return False
        remaining.remove(hit)
    return True


# ---- running -----------------------------------------------------------------------------------

async def run_item(client: openai.AsyncOpenAI, item: dict, args) -> dict:
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
               for t in item["tools"]}
    start = time.perf_counter()
    r = await client.chat.completions.create(
        model=args.model, messages=item["messages"], tools=item["tools"], tool_choice="auto",
        parallel_tool_calls=item["category"] == "parallel", temperature=0,
        max_tokens=args.max_tokens)
    choice = r.choices[0]
    calls, valid = [], 0
    for c in choice.message.tool_calls or []:
        try:
            arguments = json.loads(c.function.arguments)
            jsonschema.validate(arguments, schemas[c.function.name])
            valid += 1
        except (json.JSONDecodeError, KeyError, jsonschema.ValidationError):
            arguments = None
        calls.append((c.function.name, arguments))
    return {"calls": calls, "valid": valid, "finish": choice.finish_reason,
            "content": choice.message.content, "seconds": time.perf_counter() - start}


async def run_category(client, category: str, args) -> Tally:
    path = Path(args.data_dir) / f"{category}.jsonl"
    items = [json.loads(line) for line in path.open()][:args.limit]
    tally, done = Tally(), 0
    sem = asyncio.Semaphore(args.concurrency)

    async def one(item):
        nonlocal done
        async with sem:
            try:
                res = await run_item(client, item, args)
            except openai.APIError as e:
                tally.errors += 1
                tally.failures.append(f"{item['id']}: {type(e).__name__}: {e}")
                res = None
        tally.n += 1
        if res is not None:
            _score(tally, item, res)
        done += 1
        if done % 10 == 0 or done == len(items):
            print(f"  {category}: {done}/{len(items)}", file=sys.stderr, flush=True)

    start = time.perf_counter()
    await asyncio.gather(*(one(item) for item in items))
    tally.seconds = time.perf_counter() - start
    return tally


def _score(tally: Tally, item: dict, res: dict) -> None:
    calls = res["calls"]
    tally.calls += len(calls)
    tally.valid_calls += res["valid"]
    tally.with_calls += bool(calls)
    tally.truncated += res["finish"] == "length"
    if item["category"] == "irrelevance":
        tally.correct += not calls
        return
    ok = all(a is not None for _, a in calls) and calls_match(
        calls, item["ground_truth"], item.get("name_map") or {})
    tally.correct += ok
    if not ok and len(tally.failures) < 5:
        tally.failures.append(f"{item['id']}: got {calls or res['content']!r:.200}")


def table(results: dict[str, Tally]) -> str:
    rows = [("| category | n | answered with calls | tool calls | format valid | accuracy | "
            "cut by max_tokens | errors | s |"),
            "|---|---|---|---|---|---|---|---|---|"]
    for cat, t in results.items():
        pct = (lambda a, b: f"{100 * a / b:.1f}%" if b else "-")
        metric = "no call" if cat == "irrelevance" else "AST match"
        rows.append(f"| {cat} | {t.n} | {pct(t.with_calls, t.n)} | {t.calls} | "
                    f"{pct(t.valid_calls, t.calls)} | {pct(t.correct, t.n)} ({metric}) | "
                    f"{t.truncated} | {t.errors} | {t.seconds:.0f} |")
    return "\n".join(rows)


# ---- a server of our own ------------------------------------------------------------------------

def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "guided.server.cli", "serve", "--port",
                             str(port), "--log-level", "warning", *extra], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up in 300 s")


async def main_async(args) -> None:
    proc = None
    url = args.url
    if url is None:
        print("starting a server ...", file=sys.stderr, flush=True)
        proc, url = start_server(shlex.split(args.server_args))
    try:
        client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused",
                                    max_retries=0, timeout=600)
        results = {}
        for category in args.categories.split(","):
            print(f"{category} ...", file=sys.stderr, flush=True)
            results[category] = await run_category(client, category, args)
        print(table(results))
        for cat, t in results.items():
            for f in t.failures[:3]:
                print(f"  e.g. {cat} miss: {f}", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--server-args", default="", help='flags for the started server, e.g. '
                                                     '"--max-num-seqs 32"')
    p.add_argument("--model", default="default")
    p.add_argument("--data-dir", default=str(DATA_DIR))
    p.add_argument("--categories", default=",".join(CATEGORIES))
    p.add_argument("--limit", type=int, default=None, help="items per category")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=160)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
