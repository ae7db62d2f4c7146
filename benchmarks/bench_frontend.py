"""The serving frontend's own cost, with no model: the real app (guided.server.app) under real
uvicorn on 127.0.0.1, N concurrent streaming chat completions, over an engine stand-in whose
steps cost next to nothing and emit one token per running request, each step as soon as the
frontend has written every request's previous token to its socket ("as fast as the frontend
takes them"). Prints one markdown table.

    python benchmarks/bench_frontend.py                          # concurrency 64 and 256
    python benchmarks/bench_frontend.py --concurrency 64 --tokens 200 --seconds 10 --client httpx

The server runs in a child process (its event loop is the child's main thread; the engine is
AsyncEngine's thread); the clients run here, so their CPU is not the server's. Columns:
delivered tokens/s; CPU per 1000 tokens of the event-loop thread (time.thread_time inside the
loop: uvicorn, the app, SSE), of the engine thread outside the stand-in's step() and
add_request() (AsyncEngine's commands, hand-off and stats) and of the whole server process (less
the stand-in's own CPU, which is mostly its waiting for deliveries). The last row times
AsyncEngine._step alone on this thread: one engine step's hand-off of 256 outputs (prebuilt as
the engine builds them: fresh lists of --step-context+ token ids of a real vocabulary's size)
to 256 streams, whose consumers run on an event loop between the steps.

On a 2-core machine the raw client (default: a few lines of asyncio HTTP/1.1, the cheapest
reader) keeps the client from being the bottleneck; --client httpx / openai use those clients.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's guided, whatever is installed
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests" / "server"))  # the scripted fake engine of the tests
from common import markdown_table, progress

# A JSON-ish ASCII answer: one byte token per character with the fake engine's tokenizer.
ANSWER = '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"], '
# A step waits (in slices; time.sleep frees the GIL) until every running request's last token
# was written, as an engine step emits one token for each running request, but no longer than
# STEP_WAIT_S so that a slow stream does not hold up the others.
POLL_S, STEP_WAIT_S = 50e-6, 2e-3


def answer(tokens: int) -> str:
    return (ANSWER * (tokens // len(ANSWER) + 1))[:tokens]


# ---- the server (child process) -----------------------------------------------------------------

def paced_engine():
    """A FakeEngine whose step() costs next to nothing and is paced by deliveries: `ready`
    receives the ids of jobs whose last token reached the socket (from DeliveryCounter)."""
    from fake_engine import FakeEngine

    from guided.outputs import RequestMetrics, RequestOutput

    class PacedEngine(FakeEngine):
        def __init__(self):
            super().__init__(max_model_len=8192, max_waiting=4096)
            self.ready: collections.deque[str] = collections.deque()
            self._by_job: dict[str, str] = {}  # HTTP job id -> engine request id
            self._texts: dict[str, str] = {}
            self._ready: set[str] = set()  # request ids ready for their next token
            self.engine_cpu = 0.0  # the engine thread's CPU time as of its last step
            self.own_cpu = 0.0  # of which inside this stand-in (its steps and adds)

        def add_request(self, request_id, prompt, params, *, arrival_time=None) -> None:
            start = time.thread_time()
            super().add_request(request_id, prompt, params, arrival_time=arrival_time)
            self._texts[request_id] = self.tokenizer.decode(self._reqs[request_id].script)
            job = request_id.rsplit("-", 1)[0]
            self._by_job[job] = request_id
            self.ready.append(job)  # its first token needs no delivery
            self.own_cpu += time.thread_time() - start

        def step(self) -> list[RequestOutput]:
            start = time.thread_time()
            deadline = time.monotonic() + STEP_WAIT_S
            while len(self._take_ready()) < len(self._reqs) and time.monotonic() < deadline:
                time.sleep(POLL_S)
            outs = [self._advance(self._reqs[rid]) for rid in self._ready if rid in self._reqs]
            self._ready.clear()
            self.engine_cpu = time.thread_time()
            self.own_cpu += self.engine_cpu - start
            return outs

        def _take_ready(self) -> set[str]:
            """Request ids whose last token was written (ids of finished jobs dropped)."""
            while self.ready:
                rid = self._by_job.get(self.ready.popleft())
                if rid is not None:
                    self._ready.add(rid)
            return self._ready

        def _advance(self, r) -> RequestOutput:
            r.token_ids.append(r.script[len(r.token_ids)])
            n = len(r.token_ids)
            self._generated += 1
            done = n == len(r.script)
            if done:
                del self._reqs[r.request_id]
                self._by_job.pop(r.request_id.rsplit("-", 1)[0], None)
                self._finished["stop"] = self._finished.get("stop", 0) + 1
            # as the real engine hands them: fresh token list, cumulative text
            return RequestOutput(
                request_id=r.request_id, prompt_token_ids=r.prompt_ids,
                token_ids=list(r.token_ids), text=self._texts[r.request_id][:n], finished=done,
                finish_reason="stop" if done else None,
                metrics=RequestMetrics(arrival_time=r.arrival))

    return PacedEngine()


class DeliveryCounter:
    """ASGI wrapper around the app: the first body message of a chat stream (the role chunk)
    names the job; every later one hands the job back to the engine for its next token."""

    _ID = re.compile(rb'"id":\s*"([^"]+)"')

    def __init__(self, app, ready: collections.deque):
        self.app, self.ready = app, ready

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        job = None

        async def counting_send(message):
            nonlocal job
            if message["type"] == "http.response.body" and message.get("body"):
                if job is None:
                    found = self._ID.search(message["body"])
                    job = found.group(1).decode() if found else ""
                else:
                    self.ready.append(job)
            await send(message)

        await self.app(scope, receive, counting_send)


def serve_child(port: int) -> None:
    import uvicorn

    from guided.server.app import create_app
    from guided.serving.async_engine import AsyncEngine

    fake = paced_engine()
    app = create_app(AsyncEngine(fake), drain_timeout=0)

    async def cpu() -> dict:  # runs on the event-loop thread: thread_time is the loop's
        return {"loop": time.thread_time(), "engine": fake.engine_cpu - fake.own_cpu,
                "process": time.process_time() - fake.own_cpu}

    app.add_api_route("/bench/cpu", cpu, methods=["GET"])
    config = uvicorn.Config(DeliveryCounter(app, fake.ready), host="127.0.0.1", port=port,
                            log_level="warning")
    asyncio.run(uvicorn.Server(config).serve())


# ---- clients ------------------------------------------------------------------------------------

class Tally:
    def __init__(self):
        self.requests = self.tokens = self.events = self.errors = 0

    def add(self, tokens: int, events: int, ok: bool) -> None:
        self.requests += 1
        self.tokens += tokens
        self.events += events
        self.errors += not ok


def chat_body(tokens: int) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": "ECHO:" + answer(tokens)}],
            "stream": True, "stream_options": {"include_usage": True}, "max_tokens": tokens}


def read_events(data: bytes) -> tuple[str, int, int]:
    """(content, completion tokens, content events) of a whole SSE body."""
    content, usage, events = [], 0, 0
    for event in data.split(b"\n\n"):
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        chunk = json.loads(event[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", []):
            if choice["delta"].get("content"):
                content.append(choice["delta"]["content"])
                events += 1
    return "".join(content), usage, events


class RawClient:
    """Keep-alive HTTP/1.1 over asyncio streams; reads the chunked body, parses it at the end."""

    def __init__(self, port: int):
        self.port = port
        self.conn = None

    async def chat(self, tokens: int) -> tuple[str, int, int]:
        if self.conn is None:
            self.conn = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.conn
        body = json.dumps(chat_body(tokens)).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200") or b"chunked" not in head.lower():
            raise RuntimeError(head.decode(errors="replace"))
        parts = []
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            parts.append((await reader.readexactly(size + 2))[:-2])
        await reader.readuntil(b"\r\n")
        return read_events(b"".join(parts))

    async def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()


class HttpxClient:
    def __init__(self, port: int):
        import httpx

        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300)

    async def chat(self, tokens: int) -> tuple[str, int, int]:
        async with self.client.stream("POST", "/v1/chat/completions",
                                      json=chat_body(tokens)) as r:
            r.raise_for_status()
            data = b"".join([chunk async for chunk in r.aiter_bytes()])
        return read_events(data)

    async def close(self) -> None:
        await self.client.aclose()


class OpenAIClient:
    def __init__(self, port: int):
        import openai

        self.client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                                         max_retries=0, timeout=300)

    async def chat(self, tokens: int) -> tuple[str, int, int]:
        body = chat_body(tokens)
        del body["stream"]
        content, usage, events = [], 0, 0
        async for chunk in await self.client.chat.completions.create(stream=True, **body):
            if chunk.usage:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    content.append(choice.delta.content)
                    events += 1
        return "".join(content), usage, events

    async def close(self) -> None:
        await self.client.close()


CLIENTS = {"raw": RawClient, "httpx": HttpxClient, "openai": OpenAIClient}


async def worker(client, tokens: int, deadline: float, tally: Tally) -> None:
    expected = answer(tokens)
    try:
        while time.monotonic() < deadline:
            text, usage, events = await client.chat(tokens)
            tally.add(usage, events, text == expected and usage == tokens)
    finally:
        await client.close()


async def report_progress(label: str, tally: Tally, start: float) -> None:
    while True:
        await asyncio.sleep(2.0)
        elapsed = time.monotonic() - start
        progress(f"  {label}: {elapsed:5.1f} s, {tally.requests} requests, {tally.tokens} tokens, "
                 f"{tally.tokens / elapsed:,.0f} tok/s")


async def drive(args, port: int, concurrency: int, seconds: float, label: str) -> tuple[Tally, float]:
    tally, start = Tally(), time.monotonic()
    clients = [CLIENTS[args.client](port) for _ in range(concurrency)]
    ticker = asyncio.create_task(report_progress(label, tally, start))
    try:
        await asyncio.gather(*(worker(c, args.tokens, start + seconds, tally) for c in clients))
    finally:
        ticker.cancel()
    return tally, time.monotonic() - start


def cpu_snapshot(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/bench/cpu", timeout=30) as r:
        return json.loads(r.read())


def serve_row(args, port: int, concurrency: int) -> dict:
    asyncio.run(drive(args, port, concurrency, args.warmup, f"c={concurrency} warm-up"))
    before = cpu_snapshot(port)
    tally, wall = asyncio.run(drive(args, port, concurrency, args.seconds, f"c={concurrency}"))
    after = cpu_snapshot(port)
    if tally.errors:
        raise SystemExit(f"{tally.errors} of {tally.requests} answers were wrong")
    per_k = {k: 1e6 * (after[k] - before[k]) / max(tally.tokens, 1) for k in after}
    return {"name": f"serve, {concurrency} streams ({tally.requests} requests)",
            "tok_s": tally.tokens / wall, "tok_event": tally.tokens / max(tally.events, 1),
            "loop": per_k["loop"], "engine": per_k["engine"], "process": per_k["process"]}


# ---- the engine thread's hand-off, alone --------------------------------------------------------

class ReplayEngine:
    """step() returns prebuilt outputs. has_unfinished_requests() is False, so AsyncEngine's
    own thread stays parked on its command queue while this thread calls _step()."""

    def __init__(self, steps: list):
        self.steps, self.next = steps, 0

    def has_unfinished_requests(self) -> bool:
        return False

    def step(self) -> list:
        out = self.steps[self.next % len(self.steps)]
        self.next += 1
        return out

    def stats(self):
        from guided.outputs import EngineStats

        return EngineStats(num_running=1)


def step_row(outputs: int, context: int, steps: int = 20, rounds: int = 25) -> dict:
    """Time AsyncEngine._step on this thread; between steps (not timed) the event loop runs the
    deliveries and a consumer per stream takes them, as a server's loop would."""
    from guided.outputs import RequestMetrics, RequestOutput
    from guided.serving.async_engine import AsyncEngine, RequestStream

    ids = [f"req-{i}" for i in range(outputs)]
    metrics = {rid: RequestMetrics(arrival_time=time.time()) for rid in ids}
    prompt = list(range(100))
    vocab = 128_000  # token ids as large as a real vocabulary's: int objects of their own
    prebuilt = [[RequestOutput(rid, prompt, [(7919 * t) % vocab for t in range(context + s)],
                               "x" * (context + s), metrics=metrics[rid]) for rid in ids]
                for s in range(steps)]
    engine = AsyncEngine(ReplayEngine(prebuilt))
    loop = asyncio.new_event_loop()
    wall, cpu = [], []
    for _ in range(rounds):
        streams = [RequestStream(rid, engine, loop) for rid in ids]
        engine._live.update((s.request_id, s) for s in streams)
        consumers = [loop.create_task(_consume(s)) for s in streams]
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            engine._step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            loop.run_until_complete(_settle())
        for task in consumers:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*consumers, return_exceptions=True))
        engine._live.clear()
    loop.close()
    us = 1e6 * statistics.median(wall)
    progress(f"  AsyncEngine._step: {us:.0f} us per step of {outputs} outputs")
    return {"name": f"AsyncEngine._step alone: {us:.0f} us per step of {outputs} outputs "
                    f"({context}+ tokens each)",
            "engine": 1e6 * statistics.median(cpu) / outputs}


async def _consume(stream) -> None:
    async for _ in stream:
        pass


async def _settle() -> None:
    for _ in range(3):  # the hand-off callback, then the consumers it woke
        await asyncio.sleep(0)


# ---- main ---------------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--port", str(port)], cwd=ROOT)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("the benchmark server did not come up") from None
            time.sleep(0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="64,256", help="comma-separated stream counts")
    ap.add_argument("--tokens", type=int, default=200, help="output tokens per request")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured time per row")
    ap.add_argument("--warmup", type=float, default=2.0, help="unmeasured time before each row")
    ap.add_argument("--client", choices=sorted(CLIENTS), default="raw")
    ap.add_argument("--step-outputs", type=int, default=256)
    ap.add_argument("--step-context", type=int, default=256, help="tokens per output")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return serve_child(args.port)
    rows = []
    proc, port = start_server()
    try:
        for concurrency in (int(c) for c in args.concurrency.split(",") if c):
            progress(f"serving {concurrency} streams x {args.tokens} tokens, {args.client} client")
            rows.append(serve_row(args, port, concurrency))
    finally:
        proc.terminate()
        proc.wait(30)
    rows.append(step_row(args.step_outputs, args.step_context))
    print(markdown_table(
        ["scenario", "delivered tok/s", "tok / SSE event", "event-loop CPU ms / 1k tok",
         "engine-thread CPU ms / 1k tok", "process CPU ms / 1k tok"],
        [[r["name"], _fmt(r.get("tok_s"), "{:,.0f}"), _fmt(r.get("tok_event"), "{:.2f}"),
          _fmt(r.get("loop"), "{:.1f}"), _fmt(r.get("engine"), "{:.1f}"),
          _fmt(r.get("process"), "{:.1f}")] for r in rows]))


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


if __name__ == "__main__":
    main()
