"""Faults against a real `guided serve` (issue 41): each one reproduced, and shown to stay local,
bounded and visible. Launches its own server (default model, CPU settings plus --server-args)
with an API key, runs the checks in order and prints one markdown table: check, expectation,
what was measured, ok. Exits 1 if any check fails.

    python benchmarks/faults.py                      # every check (~5 min on a 2-core CPU)
    python benchmarks/faults.py --only grammar,seed  # some of them

Checks: a never-ending grammar, an empty regex and an infinite schema (400 within a second while
streams run on unaffected), bad seeds, a lone surrogate, tool parameters that are no object
schema, a 1 MB model name (truncated echo), a 10 MB body (/health stays fast), the API key, a
slowloris client, a compile past its timeout (a retryable 503, never cached, streams unaffected),
a storm of 64 large new schemas (quick 503s, a small new schema compiles within 5 s of its end),
200 concurrent clients (each finishes or gets a quick 429 / 503), kill -9 and SIGSTOP of the engine process
(/health 503 within 5 s, a failed stream ends with [DONE], healthy again after the restart).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
KEY = "faults-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
STORM = 64
CLIENTS = 200


def chat(content: str = "Tell me a story.", **fields) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": content}],
            "max_tokens": 16, **fields}


class Server:
    def __init__(self, extra: str, log_path: str, compile_timeout_s: float):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
        cmd = [sys.executable, "-m", "guided.server.cli", "serve", "--port", str(self.port),
               "--log-level", "warning", "--api-key", KEY, "--compile-timeout-s",
               str(compile_timeout_s), *shlex.split(extra)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, headers=AUTH, timeout=300)
        if self.wait_healthy(300) is None:
            sys.exit(f"the server did not come up; see {log_path}")

    def health(self) -> int:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code
        except httpx.HTTPError:
            return 0

    def wait_healthy(self, timeout_s: float, healthy: bool = True) -> float | None:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if (self.health() == 200) == healthy:
                return time.monotonic() - start
            if self.proc.poll() is not None:
                return None
            time.sleep(0.05)
        return None

    def engine_pid(self) -> int:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        for pid in map(int, children.split()):
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text():  # not the tracker
                return pid
        raise RuntimeError("no engine process found")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Streams:
    """n streamed chats in the background; the largest gap between chunks of any of them
    (join: they run to their end; stop: they are cut once the fault they watched is over)."""

    def __init__(self, server: Server, n: int = 2, max_tokens: int = 2000):
        self.server, self.gaps, self.ends, self.errors = server, [], [], 0
        self.done, self.decoding = threading.Event(), threading.Semaphore(0)
        self.threads = [threading.Thread(target=self._run, args=(max_tokens,)) for _ in range(n)]
        for t in self.threads:
            t.start()
        for _ in self.threads:  # each past its prefill, decoding (a loaded host: minutes)
            self.decoding.acquire(timeout=300)

    def _run(self, max_tokens: int) -> None:
        body = chat(max_tokens=max_tokens, ignore_eos=True, stream=True)
        last, lines = None, []
        with self.server.http.stream("POST", CHAT, json=body) as r:
            for line in r.iter_lines():
                if self.done.is_set():
                    break
                if not line:
                    continue
                now = time.monotonic()
                if len(lines) >= 2:  # not the wait for the first token: the prefill
                    self.gaps.append(now - last)
                if len(lines) == 2:
                    self.decoding.release()
                last = now
                lines.append(line)
                self.errors += '"finish_reason": "error"' in line
        self.ends.append(lines[-1] if lines else "")

    def join(self) -> float:
        for t in self.threads:
            t.join()
        return max(self.gaps, default=0.0)

    def stop(self) -> float:
        self.done.set()
        return self.join()


def timed(fn):
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start


# ---- the checks: each returns (expectation, measured, ok) rows ----------------------------------

def check_grammar(s: Server) -> list[tuple]:
    streams = Streams(s)
    rows = []
    for name, body in [("grammar root ::= \"a\" root", chat(grammar='root ::= "a" root')),
                       ("regex [^\\s\\S]", chat(regex="[^\\s\\S]")),
                       ("schema requiring itself", chat(json_schema={
                           "type": "object", "properties": {"a": {"$ref": "#"}},
                           "required": ["a"]}))]:
        r, seconds = timed(lambda body=body: s.http.post(CHAT, json=body))
        rows.append((name, "400 within 1 s", f"{r.status_code} in {seconds:.2f} s",
                     r.status_code == 400 and seconds < 1.0))
    time.sleep(2)
    gap = streams.stop()
    rows.append(("streams meanwhile", "largest chunk gap < 2 s", f"{gap:.2f} s", gap < 2.0))
    return rows


def check_door(s: Server) -> list[tuple]:
    rows = []
    streams = Streams(s, n=1, max_tokens=100)
    for seed in (-1, 2 ** 63):
        r = s.http.post(CHAT, json=chat(seed=seed))
        rows.append((f"seed {seed}", "400 naming seed", (f"{r.status_code} "
                     f"{r.json()['error'].get('param')}"), r.status_code == 400))
    streams.join()
    rows.append(("a stream beside the bad seeds", "ends with [DONE]", str(streams.ends),
                 streams.ends == ["data: [DONE]"]))
    r = s.http.post(CHAT, content=b'{"model": "default", "messages": [{"role": "user", '
                                  b'"content": "a\\ud800b"}]}',
                    headers={"content-type": "application/json"})
    rows.append(("lone surrogate", "400", f"{r.status_code} {r.json()['error']['param']}",
                 r.status_code == 400))
    r = s.http.post(CHAT, json=chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]))
    rows.append(("tool parameters {type: string}", "400", str(r.status_code),
                 r.status_code == 400))
    r = s.http.post(CHAT, json=chat(model="m" * 2 ** 20))
    rows.append(("1 MB model name", "404, body < 4 KB", f"{r.status_code}, {len(r.content)} B",
                 r.status_code == 404 and len(r.content) < 4096))
    return rows


# polls /health every 20 ms and prints each latency: a process of its own, so that the 200
# client threads of this one do not hold the poller up (they did: 0.7 s "latencies")
_POLLER = """import sys, time, httpx
while True:
    start = time.monotonic()
    try:
        httpx.get(sys.argv[1] + "/health", timeout=5)
    except httpx.HTTPError:
        pass
    print(time.monotonic() - start, flush=True)
    time.sleep(0.02)
"""


@contextlib.contextmanager
def health_polled(s: Server) -> Iterator[list[float]]:
    """The latencies of /health, polled every 20 ms while the block runs."""
    poller = subprocess.Popen([sys.executable, "-c", _POLLER, s.url], stdout=subprocess.PIPE,
                              text=True)
    latencies: list[float] = []
    try:
        time.sleep(1)  # its imports
        yield latencies
    finally:
        poller.terminate()
        latencies += [float(line) for line in poller.communicate()[0].split()]


def health_row(latencies: list[float]) -> tuple:
    worst = max(latencies)
    return ("/health meanwhile", "< 100 ms", f"max {worst * 1e3:.0f} ms of {len(latencies)}",
            worst < 0.1)


def check_big_body(s: Server) -> list[tuple]:
    body = json.dumps(chat("word " * (2 * 2 ** 20))).encode()  # 10 MB of message
    with health_polled(s) as latencies:
        time.sleep(0.2)
        r, seconds = timed(lambda: s.http.post(CHAT, content=body,
                                               headers={"content-type": "application/json"}))
        time.sleep(0.2)
    return [("10 MB body", "400", f"{r.status_code} in {seconds:.2f} s", r.status_code == 400),
            health_row(latencies)]


def check_auth_and_slowloris(s: Server) -> list[tuple]:
    r = httpx.get(s.url + "/v1/models")
    rows = [("no API key", "401", str(r.status_code), r.status_code == 401),
            ("/health without key", "200", str(s.health()), s.health() == 200)]
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.settimeout(1)
        start, closed = time.monotonic(), False
        while time.monotonic() - start < 20 and not closed:
            try:
                sock.sendall(b"X")  # a header, a byte a second
                closed = sock.recv(100) == b""
            except TimeoutError:
                pass
            except OSError:
                closed = True
        seconds = time.monotonic() - start
    rows.append(("slowloris headers", "closed within ~10 s", f"closed after {seconds:.0f} s",
                 closed and seconds < 15))
    return rows


def slow_schema(count: int) -> dict:
    """A schema that takes seconds to compile, unique per count: a long counted pattern, which
    xgrammar 0.2.8 parses in time ~quadratic in the count (4000: ~4 s, 12000: ~50 s on a
    loaded 2-core CPU); the recursive `next` keeps it on xgrammar (no DFA)."""
    return {"type": "object", "properties": {
        "code": {"type": "string", "pattern": f"^[a-z]{{0,{count}}}$"},
        "next": {"$ref": "#"}}, "required": ["code"]}


def check_compile_timeout(s: Server, timeout_s: float) -> list[tuple]:
    streams = Streams(s)
    body = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "slow", "schema": slow_schema(8000 + random.randrange(1000))}})
    r, seconds = timed(lambda: s.http.post(CHAT, json=body))
    rows = [("compile past its timeout", f"503 + Retry-After after ~{timeout_s:g} s",
             f"{r.status_code} Retry-After {r.headers.get('retry-after')} in {seconds:.1f} s",
             r.status_code == 503 and r.headers.get("retry-after") is not None)]
    again = s.http.post(CHAT, json=body)
    rows.append(("same schema again at once", "503 (not a cached 400)", str(again.status_code),
                 again.status_code == 503))
    gap = streams.stop()  # the compile goes on at the lowest priority: on a busy CPU it waits
    rows.append(("streams meanwhile", "largest chunk gap < 2 s", f"{gap:.2f} s", gap < 2.0))
    start, status = time.monotonic(), None
    while time.monotonic() - start < 180:
        status = s.http.post(CHAT, json=body).status_code
        if status != 503:
            break
        time.sleep(2)
    rows.append(("once the background compile ends", "200 (cache filled)",
                 f"{status} after {time.monotonic() - start:.0f} s", status == 200))
    return rows


def check_storm(s: Server, timeout_s: float) -> list[tuple]:
    """64 new schemas at once, each compiling past the timeout (every one is abandoned to the
    background at the lowest priority, or refused); then a small new schema."""
    streams = Streams(s, max_tokens=600)
    base = 12000 + random.randrange(1000)  # unique: no cache has them; ~6.5 s each, idle

    def one(i):
        body = chat(response_format={"type": "json_schema", "json_schema": {
            "name": "storm", "schema": slow_schema(base + i)}})
        r, seconds = timed(lambda: s.http.post(CHAT, json=body))
        return r.status_code, r.headers.get("retry-after"), seconds

    with ThreadPoolExecutor(STORM) as pool:
        results, seconds = timed(lambda: list(pool.map(one, range(STORM))))
    small = chat(json_schema={"type": "object", "properties": {
        f"k{random.randrange(10 ** 9)}": {"type": "integer"}}, "required": ["k"]})
    r, small_s = timed(lambda: s.http.post(CHAT, json=small))
    gap = streams.stop()
    statuses = [code for code, _, _ in results]
    counts = {code: statuses.count(code) for code in sorted(set(statuses))}
    refusals = sorted(t for code, _, t in results if code == 503)
    no_retry = sum(code == 503 and not after for code, after, _ in results)
    median = refusals[len(refusals) // 2] if refusals else 0.0
    slowest = 2 * timeout_s + 5  # queued one timeout, compiled one, the server's margin
    return [(f"storm of {STORM} large new schemas", "200 or 503 each, nothing else",
             f"{counts} in {seconds:.0f} s", set(counts) <= {200, 503}),
            ("its 503s", f"Retry-After each, median < 3 s, slowest < {slowest:g} s",
             (f"{no_retry} without Retry-After, median {median:.1f} s, slowest "
              f"{max(refusals, default=0.0):.1f} s"),
             not no_retry and median < 3 and max(refusals, default=0.0) < slowest),
            ("a small new schema at the storm's end", "200 within 5 s",
             f"{r.status_code} in {small_s:.1f} s", r.status_code == 200 and small_s < 5),
            ("streams meanwhile", "largest chunk gap < 2 s", f"{gap:.2f} s", gap < 2.0)]


def check_clients(s: Server) -> list[tuple]:
    def one(i):
        start = time.monotonic()
        try:  # a connection of its own: no keep-alive race of a shared pool counts as lost
            r = httpx.post(s.url + CHAT, json=chat(f"Count to {i}.", max_tokens=32),
                           headers=AUTH, timeout=600)
            return r.status_code, time.monotonic() - start
        except httpx.HTTPError as e:
            return type(e).__name__, time.monotonic() - start

    with ThreadPoolExecutor(CLIENTS) as pool, health_polled(s) as latencies:
        results, seconds = timed(lambda: list(pool.map(one, range(CLIENTS))))
    ok = sorted(t for code, t in results if code == 200)
    refused = sorted(t for code, t in results if code in (429, 503))
    codes = {code: sum(c == code for c, _ in results) for code in (429, 503)}
    lost = sorted(str(code) for code, _ in results if code not in (200, 429, 503))
    slowest = max(ok + refused, default=0.0)
    median = refused[len(refused) // 2] if refused else 0.0
    return [(f"{CLIENTS} concurrent clients", "each 200, 429 or 503, none lost",
             (f"{len(ok)} x 200, {codes[429]} x 429, {codes[503]} x 503, lost: {lost} "
             f"in {seconds:.0f} s"), not lost),
            ("their refusals", "median < 1 s, none past the 30 s queue timeout",
             f"median {median:.2f} s, slowest {max(refused, default=0.0):.1f} s",
             median < 1.0 and max(refused, default=0.0) <= 35.0),
            ("nothing hangs", "every answer within 60 s", f"slowest {slowest:.1f} s",
             slowest < 60.0), health_row(latencies)]


def check_engine_death(s: Server, sig: int) -> list[tuple]:
    name = "kill -9" if sig == signal.SIGKILL else "SIGSTOP (a hung engine)"
    streams = Streams(s, n=1, max_tokens=2000)
    pid = s.engine_pid()
    os.kill(pid, sig)
    down = s.wait_healthy(60, healthy=False)
    rows = [(f"{name} of the engine", "/health 503 within 5 s",
             "never" if down is None else f"{down:.1f} s", down is not None and down < 5.0)]
    back = s.wait_healthy(300)
    streams.join()
    if sig == signal.SIGSTOP:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rows.append(("the stream it was serving", "finish_reason error, then data: [DONE]",
                 f"{streams.errors} error chunk(s), last line {streams.ends}",
                 streams.errors == 1 and streams.ends == ["data: [DONE]"]))
    r = s.http.post(CHAT, json=chat(max_tokens=4)) if back is not None else None
    rows.append(("after the restart", "healthy, serves",
                 "never" if back is None else f"healthy after {back:.0f} s, {r.status_code}",
                 back is not None and r.status_code == 200))
    start, idle = time.monotonic(), False
    while not idle and time.monotonic() - start < 10:  # the stats trail the last step a little
        m = s.http.get("/metrics").text
        idle = "guided_requests_running 0.0" in m and "guided_kv_blocks_in_use 0.0" in m
        time.sleep(0.2)
    rows.append(("/metrics after it", "0 running, 0 KV blocks in use (within 10 s)",
                 str(idle), idle))
    return rows


def host_load() -> str:
    """The host's load average and the share of the last minute every task stalled on memory
    (Linux PSI): other work on a shared host stretches the streams' gaps too."""
    try:
        full = Path("/proc/pressure/memory").read_text().splitlines()[1]
        stalled = f", memory stall {float(full.split()[2].split('=')[1]):.0f}%"
    except (OSError, IndexError, ValueError):
        stalled = ""
    return f"load {os.getloadavg()[0]:.1f}{stalled}"


CHECKS = ("grammar", "door", "body", "auth", "timeout", "storm", "clients", "kill", "hang")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(CHECKS), help=f"some of {CHECKS}")
    parser.add_argument("--compile-timeout-s", type=float, default=5.0)
    parser.add_argument("--server-args", default="", help="extra `guided serve` flags")
    parser.add_argument("--server-log", default=os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "guided-faults-server.log"))
    args = parser.parse_args()
    chosen = [c for c in args.only.split(",") if c]
    server = Server(args.server_args, args.server_log, args.compile_timeout_s)
    print(f"server at {server.url}, log {args.server_log}", flush=True)
    run = {"grammar": lambda: check_grammar(server), "door": lambda: check_door(server),
           "body": lambda: check_big_body(server),
           "auth": lambda: check_auth_and_slowloris(server),
           "timeout": lambda: check_compile_timeout(server, args.compile_timeout_s),
           "storm": lambda: check_storm(server, args.compile_timeout_s),
           "clients": lambda: check_clients(server),
           "kill": lambda: check_engine_death(server, signal.SIGKILL),
           "hang": lambda: check_engine_death(server, signal.SIGSTOP)}
    rows = []
    try:
        for name in chosen:
            try:
                got = run[name]()
            except Exception as e:  # noqa: BLE001 - a check that breaks is a failed row
                got = [(name, "runs", f"{type(e).__name__}: {e}"[:200], False)]
            host = host_load()
            rows += [(*row, host) for row in got]
            for row in got:
                print(f"  {name}: {row[0]}: {row[2]} {'ok' if row[3] else 'FAILED'} ({host})",
                      flush=True)
    finally:
        server.stop()
    print("\n| check | expected | measured | ok | host after it |\n|---|---|---|---|---|")
    for check, expected, measured, ok, host in rows:
        print(f"| {check} | {expected} | {measured} | {'yes' if ok else '**no**'} | {host} |")
    return 0 if all(row[3] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
