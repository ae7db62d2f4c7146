"""Soak test: N minutes of mixed load on a `guided serve` it launches (or --url), with client
aborts and bad requests mixed in; checks that nothing is lost, nothing 5xx's and nothing leaks.

    python benchmarks/soak.py --minutes 10                   # launches a server on a free port
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234 --minutes 2
    python benchmarks/soak.py --minutes 1 --server-args "--max-num-seqs 8"

Workers (--concurrency) loop until the deadline, each request drawn from: chat, json_schema,
regex, choice, tools (chat) and completion, streamed or not; --abort-fraction of the streamed ones
disconnect after a few chunks and --bad-fraction of all requests are malformed (bad types, bad
schema or regex, unknown model, too long prompt, invalid JSON, out-of-vocabulary ids). A request
is *lost* when it neither completed (200 with a full body, or a stream that ended in [DONE]) nor
got an error response (a status >= 400 with an OpenAI error body): a dropped connection, a stream
cut short, or no answer within --request-timeout. Prints a progress line every 30 s and one
markdown table at the end; exits 1 if a check fails (5xx, lost, KV blocks in use after idle).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

try:
    import httpx
except ImportError:  # the wheels carried to the GPU machine have the httpx2 fork (openai's)
    import httpx2 as httpx

REPO = Path(__file__).resolve().parents[1]
PROGRESS_EVERY_S = 30.0

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"]}}}]
TOPICS = ["the sea", "a cat", "Paris", "rain", "a robot", "coffee", "the moon", "trains"]

# Malformed requests: (path, JSON body or raw bytes). Each must be a 4xx with an error body.
BAD: list[tuple[str, object]] = [
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "temperature": "hot"}),
    ("/v1/chat/completions", {"model": "no-such-model",
                              "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/chat/completions", {"model": "default", "messages": []}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "regex": r"(a)\1"}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "grammar": 'root ::= "a" ( "b"'}),
    ("/v1/completions", {"model": "default", "prompt": [1, 2, 10 ** 9]}),
    ("/v1/completions", {"model": "default", "prompt": "word " * 12000}),
    ("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": -1}),
    ("/v1/chat/completions", b'{"model": "default", "messages": [}'),
]


@dataclass
class Tally:
    served: Counter = field(default_factory=Counter)  # class -> completed requests
    aborted: Counter = field(default_factory=Counter)  # class -> client disconnects on purpose
    errors: Counter = field(default_factory=Counter)  # (class, status) -> error responses
    lost: Counter = field(default_factory=Counter)  # class -> lost requests
    lost_examples: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # completed good requests, seconds
    bad_accepted: int = 0  # malformed requests that got a 2xx (should not happen)

    def total(self) -> int:
        return (sum(self.served.values()) + sum(self.aborted.values())
                + sum(self.errors.values()) + sum(self.lost.values()))

    def num_5xx(self) -> int:
        return sum(n for (_, status), n in self.errors.items() if status >= 500)


def good_request(rng: random.Random) -> tuple[str, str, dict]:
    """(class, path, body) of a well-formed request."""
    kind = rng.choice(["chat", "json_schema", "regex", "choice", "tools", "completion"])
    topic = rng.choice(TOPICS)
    chat = {"model": "default", "max_tokens": rng.randint(8, 32), "temperature": 0.7,
            "seed": rng.randint(0, 10 ** 6),
            "messages": [{"role": "user", "content": f"Say something about {topic}."}]}
    if kind == "chat":
        return kind, "/v1/chat/completions", chat
    if kind == "json_schema":
        chat["max_tokens"] = 48
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": PERSON}}
        return kind, "/v1/chat/completions", chat
    if kind == "regex":
        chat["regex"] = r"[A-Z][a-z]{2,8} (is|was) [a-z]{3,10}\."
        return kind, "/v1/chat/completions", chat
    if kind == "choice":
        chat["choice"] = ["yes", "no", "maybe"]
        return kind, "/v1/chat/completions", chat
    if kind == "tools":
        chat["max_tokens"] = 48
        chat["messages"] = [{"role": "user", "content": f"What is the weather in {topic}?"}]
        chat["tools"] = TOOLS
        chat["tool_choice"] = rng.choice(["auto", "required"])
        return kind, "/v1/chat/completions", chat
    return kind, "/v1/completions", {"model": "default", "prompt": f"A story about {topic}:",
                                     "max_tokens": rng.randint(8, 32), "temperature": 0.7}


def is_error_body(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally,
                      args: argparse.Namespace) -> None:
    if rng.random() < args.bad_fraction:
        path, body = rng.choice(BAD)
        await send_bad(client, path, body, tally)
        return
    kind, path, body = good_request(rng)
    stream = rng.random() < 0.5
    abort_after = rng.randint(1, 4) if stream and rng.random() < args.abort_fraction else None
    label = f"{kind}{'/stream' if stream else ''}"
    start = time.perf_counter()
    try:
        if stream:
            outcome = await send_stream(client, path, {**body, "stream": True}, abort_after)
        else:
            response = await client.post(path, json=body)
            outcome = ("ok" if response.status_code == 200 and "choices" in response.json()
                       else response.status_code)
            if outcome != "ok" and not is_error_body(response):
                outcome = f"{response.status_code} without an error body"
    except (httpx.HTTPError, ValueError) as e:
        outcome = f"{type(e).__name__}: {e}"
    if outcome == "ok":
        tally.served[label] += 1
        tally.latencies.append(time.perf_counter() - start)
    elif outcome == "aborted":
        tally.aborted[label] += 1
    elif isinstance(outcome, int):
        tally.errors[(label, outcome)] += 1
    else:
        tally.lost[label] += 1
        if len(tally.lost_examples) < 5:
            tally.lost_examples.append(f"{label}: {outcome}")


async def send_stream(client: httpx.AsyncClient, path: str, body: dict,
                      abort_after: int | None) -> str | int:
    """'ok' (ended in [DONE]), 'aborted' (we left), a status (error response), or why it is
    lost."""
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code if is_error_body(response) else \
                f"{response.status_code} without an error body"
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "ok"
            if "error" in json.loads(line[6:]):
                return 500  # an error after the 200: counted as a 5xx
            events += 1
            if abort_after is not None and events >= abort_after:
                return "aborted"  # leaving the block closes the connection mid-stream
    return "stream ended without [DONE]"


async def send_bad(client: httpx.AsyncClient, path: str, body: object, tally: Tally) -> None:
    label = "bad"
    try:
        if isinstance(body, bytes):
            response = await client.post(path, content=body,
                                         headers={"content-type": "application/json"})
        else:
            response = await client.post(path, json=body)
    except httpx.HTTPError as e:
        tally.lost[label] += 1
        if len(tally.lost_examples) < 5:
            tally.lost_examples.append(f"{label} {path}: {type(e).__name__}: {e}")
        return
    if response.status_code < 400:
        tally.bad_accepted += 1
        tally.served[label] += 1
    elif is_error_body(response):
        tally.errors[(label, response.status_code)] += 1
    else:
        tally.lost[label] += 1
        tally.lost_examples.append(f"{label}: {response.status_code} without an error body")


async def worker(client: httpx.AsyncClient, seed: int, deadline: float, tally: Tally,
                 args: argparse.Namespace) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        await one_request(client, rng, tally, args)


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                pass
    return values


async def idle_metrics(client: httpx.AsyncClient, timeout_s: float = 60.0) -> dict[str, float]:
    """/metrics once nothing runs any more (or after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = await metrics(client)
        idle = m.get("guided_requests_running", 0) == 0 and \
            m.get("guided_requests_waiting", 0) == 0 and m.get("guided_kv_blocks_in_use", 0) == 0
        if idle or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


def rss_mib(pid: int | None) -> float | None:
    """The RSS of pid and its descendants (the server, its engine process and theirs)."""
    if pid is None or not Path(f"/proc/{pid}").exists():
        return None
    kib, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text().splitlines()
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:  # ended meanwhile
            continue
        kib += next((int(line.split()[1]) for line in status if line.startswith("VmRSS:")), 0)
        stack.extend(map(int, children))
    return kib / 1024


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def soak(url: str, pid: int | None, args: argparse.Namespace) -> int:
    tally = Tally()
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout,
                                 limits=limits) as client:
        rss_start = rss_mib(pid)
        start = time.monotonic()
        deadline = start + args.minutes * 60
        tasks = [asyncio.create_task(worker(client, args.seed + w, deadline, tally, args))
                 for w in range(args.concurrency)]
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=PROGRESS_EVERY_S)
            m = await metrics(client)
            print(f"[{time.monotonic() - start:6.0f} s] requests {tally.total()}, served "
                  f"{sum(tally.served.values())}, aborted {sum(tally.aborted.values())}, errors "
                  f"{sum(tally.errors.values())} (5xx {tally.num_5xx()}), lost "
                  f"{sum(tally.lost.values())}; running {m.get('guided_requests_running', 0):.0f}"
                  f", KV blocks in use {m.get('guided_kv_blocks_in_use', 0):.0f}, RSS "
                  f"{rss_mib(pid) or float('nan'):.0f} MiB", flush=True)
        for t in tasks:
            t.result()  # a bug in this script should not pass as a clean run
        elapsed = time.monotonic() - start
        end = await idle_metrics(client)
        rss_end = rss_mib(pid)
    return report(tally, elapsed, end, rss_start, rss_end, args)


def report(tally: Tally, elapsed: float, end: dict[str, float], rss_start: float | None,
           rss_end: float | None, args: argparse.Namespace) -> int:
    kv_end = end.get("guided_kv_blocks_in_use", float("nan"))
    lost = sum(tally.lost.values())
    served = ", ".join(f"{k} {v}" for k, v in sorted(tally.served.items()))
    aborted = ", ".join(f"{k} {v}" for k, v in sorted(tally.aborted.items())) or "0"
    errors = ", ".join(f"{k} {s}: {v}" for (k, s), v in sorted(tally.errors.items())) or "0"
    growth = "n/a" if rss_start is None or rss_end is None else \
        f"{rss_start:.0f} → {rss_end:.0f} MiB ({rss_end - rss_start:+.0f} MiB)"
    latency = (f"{percentile(tally.latencies, 0.5):.2f} s / "
               f"{percentile(tally.latencies, 0.99):.2f} s")
    kv = f"{kv_end:.0f} of {end.get('guided_kv_blocks_total', float('nan')):.0f}"
    idle = (f"{end.get('guided_requests_running', float('nan')):.0f} / "
            f"{end.get('guided_requests_waiting', float('nan')):.0f}")
    rows = [
        ("duration", f"{elapsed / 60:.1f} min, concurrency {args.concurrency}"),
        ("requests", f"{tally.total()} ({tally.total() / elapsed:.2f}/s)"),
        ("served (completed) by class", served),
        ("client aborts (disconnect mid-stream)", aborted),
        ("error responses by class: status", errors),
        ("malformed requests answered 2xx", str(tally.bad_accepted)),
        ("5xx", str(tally.num_5xx())),
        ("lost requests", str(lost) + (f" ({'; '.join(tally.lost_examples)})" if lost else "")),
        ("latency p50 / p99 (completed)", latency),
        ("KV blocks in use after idle", kv),
        ("requests running / waiting after idle", idle),
        ("server + engine RSS start → end", growth),
    ]
    print("\n| soak | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    ok = tally.num_5xx() == 0 and lost == 0 and kv_end == 0 and tally.bad_accepted == 0
    print(f"\n{'PASS' if ok else 'FAIL'}: 5xx {tally.num_5xx()}, lost {lost}, KV blocks in use "
          f"after idle {kv_end:.0f}, malformed accepted {tally.bad_accepted}")
    return 0 if ok else 1


def launch(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(args.server_log, "w")  # noqa: SIM115 - lives as long as the server
    cmd = [sys.executable, "-m", "guided.server.cli", "serve", "--port", str(port),
           "--log-level", "warning", *shlex.split(args.server_args)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited ({proc.returncode}); see {args.server_log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"the server did not come up; see {args.server_log}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server (default: launch one)")
    parser.add_argument("--pid", type=int, help="the --url server's pid, for its (and its engine's) RSS")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--bad-fraction", type=float, default=0.1)
    parser.add_argument("--abort-fraction", type=float, default=0.2,
                        help="share of streamed requests that disconnect mid-stream")
    parser.add_argument("--request-timeout", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="--max-num-seqs 16",
                        help="extra `guided serve` flags for the launched server")
    parser.add_argument("--server-log", default=os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "guided-soak-server.log"))
    args = parser.parse_args()
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        proc, url = launch(args)
        pid = proc.pid
        print(f"launched `guided serve` (pid {pid}) at {url}; log {args.server_log}", flush=True)
    try:
        return asyncio.run(soak(url.rstrip("/"), pid, args))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
