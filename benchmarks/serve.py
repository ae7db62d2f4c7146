"""Serving benchmark against a running `guided serve`: throughput, TTFT/TPOT/ITL and validity.

    python benchmarks/serve.py http://127.0.0.1:8000 --workload json --concurrency 64,256
    python benchmarks/serve.py --launch "--model default" --workload chat --request-rate 1,4,inf
    python benchmarks/serve.py --workload json --num-requests 512 --export-workload json.jsonl
    python benchmarks/serve.py URL --workload json.jsonl --concurrency 64   # no ../shared needed

Streams every request (/v1/chat/completions, stream_options.include_usage) and measures TTFT
(first content or tool-call delta), ITL (gaps between later chunks), TPOT ((latency - TTFT) /
(completion_tokens - 1)) and latency; checks JSON answers against their schema and tool-call
arguments against their tool's parameters. One row per concurrency (N workers loop over the
requests) or per request rate (Poisson arrivals; inf sends all at once). Deltas of the server's
/metrics give the prefix-cache hit rate and the share of jump-forward tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import httpx
except ImportError:  # the wheels carried to the GPU machine have the httpx2 fork (openai's)
    import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads
from workloads import WorkItem, markdown


@dataclass(slots=True)
class Result:
    ok: bool = False
    error: str | None = None
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    constrained: bool = False  # json / tools: the answer is checked
    invalid: str | None = None  # why a constrained answer is invalid (None: valid or n/a)
    sent: float = 0.0  # perf_counter() when the request went out


# ---- one request --------------------------------------------------------------------------------

async def sse_lines(resp: httpx.Response):
    """The stream's lines, ended at LF (SSE's line end) only: httpx's aiter_lines also ends them
    at U+0085, U+2028 and U+2029, which a server may send raw inside an event's JSON."""
    pending = ""
    async for text in resp.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending


async def send(client: httpx.AsyncClient, model: str, item: WorkItem, args) -> Result:
    max_tokens = args.lengths.get(item.id, args.max_tokens)
    body = {**item.body, "model": model, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if args.ignore_eos or item.id in args.lengths:
        body["ignore_eos"] = True
    res, text, calls = Result(), [], {}
    start = last = res.sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in sse_lines(resp):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))[:200]
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    got = bool(delta.get("content")) or bool(delta.get("tool_calls"))
                    text.append(delta.get("content") or "")
                    for tc in delta.get("tool_calls") or []:
                        name, arguments = calls.get(tc.get("index", 0), ("", ""))
                        fn = tc.get("function") or {}
                        calls[tc.get("index", 0)] = (name + (fn.get("name") or ""),
                                                     arguments + (fn.get("arguments") or ""))
                    if got:
                        now = time.perf_counter()
                        if res.ttft == 0.0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.latency = time.perf_counter() - start
    res.ok = True
    res.constrained = workloads.is_constrained(item)
    if res.constrained:
        res.invalid = workloads.check(item, "".join(text),
                                      [calls[i] for i in sorted(calls)])
    return res


# ---- drivers ------------------------------------------------------------------------------------

class Progress:
    def __init__(self, total: int, desc: str):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
        except ImportError:
            self.bar = None
        self.total, self.done, self.desc = total, 0, desc

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.done == self.total or self.done % max(1, self.total // 20) == 0:
            print(f"\r{self.desc}: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print(file=sys.stderr)


async def run_concurrency(client, model, items, args, concurrency: int, progress) -> list[Result]:
    results: list[Result | None] = [None] * len(items)
    next_index = iter(range(len(items)))

    async def worker() -> None:
        for i in next_index:  # shared iterator: each worker takes the next request when free
            results[i] = await send(client, model, items[i], args)
            progress.update()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def run_rate(client, model, items, args, rate: float, progress) -> list[Result]:
    rng = random.Random(args.seed)
    cap = asyncio.Semaphore(args.max_concurrency or len(items))

    async def one(item: WorkItem) -> Result:
        async with cap:
            res = await send(client, model, item, args)
        progress.update()
        return res

    tasks = []
    for item in items:
        tasks.append(asyncio.create_task(one(item)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """The unlabeled samples of /metrics ({} if the server has none)."""
    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError:
        return {}
    out = {}
    for line in resp.text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                pass
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))] * 1000.0


def summarize(results: list[Result], duration: float, before: dict, after: dict, **row) -> dict:
    ok = [r for r in results if r.ok]
    # the engine guarantees validity of complete answers; truncated ones are counted apart
    checked = [r for r in ok if r.constrained and r.finish_reason != "length"]
    tpot = [(r.latency - r.ttft) / (r.completion_tokens - 1) for r in ok
            if r.completion_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queries = delta.get("guided_prefix_cache_queries_total", 0.0)
    generated = delta.get("guided_generation_tokens_total", 0.0)
    row.update(
        requests=len(results), duration_s=round(duration, 2),
        req_per_s=len(ok) / duration, out_tok_per_s=sum(r.completion_tokens for r in ok) / duration,
        mean_in=sum(r.prompt_tokens for r in ok) / max(1, len(ok)),
        mean_out=sum(r.completion_tokens for r in ok) / max(1, len(ok)),
        ttft_p50=_pct([r.ttft for r in ok], 50), ttft_p99=_pct([r.ttft for r in ok], 99),
        tpot_p50=_pct(tpot, 50), tpot_p99=_pct(tpot, 99),
        itl_p50=_pct(itl, 50), itl_p99=_pct(itl, 99),
        e2e_p50=_pct([r.latency for r in ok], 50), e2e_p99=_pct([r.latency for r in ok], 99),
        truncated=sum(r.finish_reason == "length" for r in ok),
        prefix_hit=(delta.get("guided_prefix_cache_hit_tokens_total", 0.0) / queries
                    if queries else None),
        jump_forward=(delta.get("guided_jump_forward_tokens_total", 0.0) / generated
                      if generated else None))
    # 400s are constraints the engine refuses (e.g. a keyword it cannot enforce), not failures
    row["rejected"] = sum(bool(r.error and r.error.startswith("HTTP 400")) for r in results)
    row["errors"] = len(results) - len(ok) - row["rejected"]
    row["valid"] = (f"{sum(r.invalid is None for r in checked)}/{len(checked)}"
                    if checked else None)
    row["invalid_examples"] = [r.invalid for r in checked if r.invalid][:5]
    # failures first: five refusals would hide the one request that failed
    errors = sorted((r.error for r in results if r.error), key=lambda e: e.startswith("HTTP 400"))
    row["error_examples"] = errors[:5]
    return row


# ---- tables -------------------------------------------------------------------------------------

COLUMNS = [("label", "label", "{}"), ("workload", "workload", "{}"), ("load", "load", "{}"),
           ("requests", "n", "{}"), ("errors", "err", "{}"), ("rejected", "400", "{}"),
           ("req_per_s", "req/s", "{:.2f}"),
           ("out_tok_per_s", "out tok/s", "{:.1f}"), ("mean_in", "in len", "{:.0f}"),
           ("mean_out", "out len", "{:.0f}"), ("ttft_p50", "TTFT p50", "{:.0f}"),
           ("ttft_p99", "TTFT p99", "{:.0f}"), ("tpot_p50", "TPOT p50", "{:.1f}"),
           ("tpot_p99", "TPOT p99", "{:.1f}"), ("itl_p50", "ITL p50", "{:.1f}"),
           ("itl_p99", "ITL p99", "{:.1f}"), ("e2e_p50", "E2E p50", "{:.0f}"),
           ("valid", "valid", "{}"), ("truncated", "trunc", "{}"),
           ("prefix_hit", "prefix hit", "{:.0%}"), ("jump_forward", "JF tok", "{:.0%}")]


# ---- server launch ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`guided serve <serve_args>` on a free local port, its log in a temporary file."""

    def __init__(self, serve_args: str, timeout_s: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="guided-serve-", suffix=".log")
        root = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
        cmd = [sys.executable, "-m", "guided.server.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), *shlex.split(serve_args)]
        print(f"launching: {shlex.join(cmd)} (log: {self.log_path})", file=sys.stderr)
        with os.fdopen(fd, "w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server was not healthy within {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, num_lines: int = 30) -> str:
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: uvicorn drains and exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- main ---------------------------------------------------------------------------------------

def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", nargs="?", default=None, help="base URL of a running server")
    p.add_argument("--launch", metavar="SERVE_ARGS", default=None,
                   help='start `guided serve SERVE_ARGS` on a free port (e.g. "--model default '
                        '--max-num-seqs 64"), stop it at the end')
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--workload", default="chat",
                   help=f"one of {', '.join(workloads.WORKLOADS)}, or a .jsonl file written by "
                        "--export-workload")
    p.add_argument("--data", type=Path, default=workloads.DEFAULT_DATA)
    p.add_argument("--export-workload", type=Path, metavar="FILE",
                   help="write the sampled requests to FILE (JSONL) and exit")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=_ints, default=None,
                   help="comma-separated: one row per max concurrency (default 16)")
    p.add_argument("--request-rate", type=_floats, default=None,
                   help="comma-separated requests/s, inf for all at once: one row per rate")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="with --request-rate: at most this many requests in flight")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: true (fixed output lengths; for unconstrained runs)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="")
    p.add_argument("--json-out", type=Path, help="append the rows (JSON lines) to this file")
    p.add_argument("--lengths-out", type=Path, metavar="FILE",
                   help="write each request's output length in the last pass (a JSON list in "
                        "workload order)")
    p.add_argument("--lengths-in", type=Path, metavar="FILE",
                   help="ask each request for the output length FILE gives it, with ignore_eos "
                        "(another engine's --lengths-out: equal work where a grammar ends a "
                        "request early on one engine and not on the other)")
    p.add_argument("--timeline-out", type=Path,
                   help="append one JSON line per request to this file: when it was sent, its "
                        "TTFT and latency (s, from the start of its load), tokens, error")
    return p


async def bench(url: str, items: list[WorkItem], args) -> list[dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        warm = Progress(args.warmup, "warmup")
        await run_concurrency(c, model, items[:args.warmup], args, 1, warm)
        warm.close()
        loads = [("concurrency", n) for n in args.concurrency or ([] if args.request_rate
                                                                  else [16])]
        loads += [("rate", r) for r in args.request_rate or []]
        rows = []
        for kind, value in loads:
            name = f"conc {value}" if kind == "concurrency" else f"rate {value:g}"
            progress = Progress(len(items), name)
            before = await scrape(c)
            start = time.perf_counter()
            if kind == "concurrency":
                results = await run_concurrency(c, model, items, args, value, progress)
            else:
                results = await run_rate(c, model, items, args, value, progress)
            duration = time.perf_counter() - start
            progress.close()
            row = summarize(results, duration, before, await scrape(c), label=args.label,
                            workload=Path(args.workload).stem, load=name, model=model,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
            rows.append(row)
            if args.lengths_out:  # the last pass's: what a peer is then asked to generate
                args.lengths_out.write_text(json.dumps(
                    [r.completion_tokens if r.ok else None for r in results]))
            if args.timeline_out:
                write_timeline(args.timeline_out, results, start, label=args.label, load=name)
            for reason in row["error_examples"] + row["invalid_examples"]:
                print(f"  [{name}] {reason}", file=sys.stderr)
        return rows


def write_timeline(path: Path, results: list[Result], start: float, **labels) -> None:
    """One line per request, in workload order: where a pass's time went (its tail)."""
    with path.open("a", encoding="utf-8") as f:
        for i, r in enumerate(results):
            f.write(json.dumps({**labels, "index": i, "sent": round(r.sent - start, 4),
                                "ttft": round(r.ttft, 4), "latency": round(r.latency, 4),
                                "tokens": r.completion_tokens, "error": r.error}) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    items = workloads.build(args.workload, args.num_requests, seed=args.seed, data=args.data)
    lengths = json.loads(args.lengths_in.read_text()) if args.lengths_in else []
    args.lengths = {item.id: n for item, n in zip(items, lengths) if n}  # by workload position
    if args.export_workload:
        workloads.save(items, args.export_workload)
        print(f"wrote {len(items)} {args.workload} requests to {args.export_workload}")
        return 0
    if (args.url is None) == (args.launch is None):
        print("serve.py: give either a server URL or --launch SERVE_ARGS", file=sys.stderr)
        return 2
    server = LaunchedServer(args.launch, args.launch_timeout) if args.launch else None
    try:
        rows = asyncio.run(bench(server.url if server else args.url, items, args))
    finally:
        if server:
            server.stop()
    print(markdown(rows, COLUMNS))
    print("\n(latencies in ms; valid: complete constrained answers that parse and validate; "
          "trunc: answers cut by max_tokens; 400: requests refused as bad input (e.g. a schema "
          "keyword the engine cannot enforce); "
          "prefix hit: prompt tokens served from the prefix cache; JF tok: generated tokens "
          "appended by jump-forward)")
    if args.json_out:
        with args.json_out.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
