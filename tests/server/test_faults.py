"""Faults on a real server of its own (2 running sequences, 4 requests in flight at most): clients
that disconnect at every stage are aborted cleanly (no KV block or running request left), a
flood past the waiting queue gets 429s with Retry-After (which the official openai client honours)
while every accepted request completes,
and SIGTERM drains gracefully (the in-flight stream ends properly, exit status 0)."""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

MAX_NUM_SEQS, MAX_WAITING = 2, 4
DRAIN_S = 5
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(launch_server):
    """(url, process) of a `guided serve` with a tiny engine; the last test stops it."""
    url, proc = launch_server("--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests",
                              str(MAX_WAITING), "--drain-timeout", str(DRAIN_S), name="faults")
    yield url, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture
def url(server):
    return server[0]


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def wait_for(url: str, condition, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if condition(m):
            return m
        assert time.monotonic() < deadline, {k: v for k, v in m.items()
                                             if k.startswith("guided_") and "bucket" not in k}
        time.sleep(0.2)


def idle(m: dict[str, float]) -> bool:
    return (m["guided_kv_blocks_in_use"] == 0 and m["guided_requests_running"] == 0
            and m["guided_requests_waiting"] == 0)


def aborts(m: dict[str, float]) -> float:
    return m.get('guided_requests_total{finish_reason="abort"}', 0.0)


def long_chat(**fields) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 2000, "ignore_eos": True, "temperature": 0.8, **fields}


def disconnect_after(url: str, body: dict, seconds: float) -> None:
    """Send body and hang up after `seconds` without reading a response."""
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=url) as client:
        client.post(CHAT, json=body, timeout=httpx.Timeout(30, read=seconds))


class Streamer(threading.Thread):
    """A streaming request read in the background; stop() hangs up mid-stream."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.events: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self._hang_up = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=60) as client, \
                    client.stream("POST", CHAT, json=self.body) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                    if self._hang_up.is_set():
                        return  # closing the response mid-stream drops the connection
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            self.error = e

    def wait_events(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < n:
            assert self.is_alive() or len(self.events) >= n, (self.status, self.error)
            assert time.monotonic() < deadline, "no stream events"
            time.sleep(0.05)

    def stop(self) -> None:
        self._hang_up.set()
        self.join(30)
        assert not self.is_alive()


# ---- client disconnects at every stage ----------------------------------------------------------

def test_disconnect_while_streaming(url):
    before = aborts(metrics(url))
    streamer = Streamer(url, long_chat())
    streamer.start()
    streamer.wait_events(3)
    assert metrics(url)["guided_kv_blocks_in_use"] > 0
    streamer.stop()
    m = wait_for(url, idle)
    assert aborts(m) == before + 1


def test_disconnect_while_queued(url):
    blockers = [Streamer(url, long_chat()) for _ in range(MAX_NUM_SEQS)]
    for b in blockers:
        b.start()
    for b in blockers:
        b.wait_events(2)
    before = aborts(metrics(url))
    thread = threading.Thread(target=disconnect_after, args=(url, long_chat(max_tokens=5), 3.0))
    thread.start()
    # it waits in the server's admission queue (the engine runs MAX_NUM_SEQS at once)
    wait_for(url, lambda m: m["guided_requests_queued"] >= 1)
    thread.join()
    m = wait_for(url, lambda m: m["guided_requests_queued"] == 0)
    assert m["guided_requests_running"] == MAX_NUM_SEQS  # the queued one left, nothing else
    assert m["guided_requests_admitted"] == MAX_NUM_SEQS and m["guided_requests_waiting"] == 0
    for b in blockers:
        b.stop()
    m = wait_for(url, idle)
    assert m["guided_requests_admitted"] == 0
    assert aborts(m) == before + MAX_NUM_SEQS  # the queued one never reached the engine


def test_disconnect_while_compiling(url):
    # A schema that takes seconds to compile (a long counted pattern: ~4 s on a 2-core CI
    # machine; a huge maxLength compiles at once as a character budget), unique: no cache has it.
    count = 10_000 + random.randrange(1000)
    schema = {"type": "string", "pattern": f"^[a-z]{{0,{count}}}$"}
    before = metrics(url)
    start = time.monotonic()
    disconnect_after(url, long_chat(json_schema=schema, max_tokens=4), 1.0)
    assert time.monotonic() - start < 5
    # The compile finishes in the background; the request never reaches the engine.
    time.sleep(8)
    after = wait_for(url, idle)
    assert after["guided_prompt_tokens_total"] == before["guided_prompt_tokens_total"]
    streaming = {**long_chat(json_schema={**schema, "pattern": f"^[a-z]{{0,{count + 1}}}$"}),
                 "stream": True, "max_tokens": 4}
    disconnect_after(url, streaming, 1.0)
    time.sleep(8)
    after = wait_for(url, idle)
    assert after["guided_prompt_tokens_total"] == before["guided_prompt_tokens_total"]


def open_request(url: str, path: str, body: dict) -> socket.socket:
    """Send a request on a raw socket (the test decides when to hang up)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_disconnect_while_prefilling(url):
    before = metrics(url)
    prompt = "the cat sat on the mat " * 430  # ~2,600 tokens: 2 chunks of prefill
    sock = open_request(url, "/v1/completions", {"model": "default", "prompt": prompt,
                                                 "max_tokens": 16})
    m = wait_for(url, lambda m: m["guided_kv_blocks_in_use"] > 0, timeout=60)
    sock.close()
    # Still prefilling when the client left: no token had been generated.
    assert m["guided_generation_tokens_total"] == before["guided_generation_tokens_total"]
    m = wait_for(url, idle, timeout=180)  # the abort lands between steps; a chunk is slow
    assert aborts(m) == aborts(before) + 1  # finishing would count as "length", not "abort"


def test_disconnect_with_n_choices(url):
    before = aborts(metrics(url))
    streamer = Streamer(url, long_chat(n=2))
    streamer.start()
    streamer.wait_events(4)
    streamer.stop()
    m = wait_for(url, idle)
    assert aborts(m) == before + 2


# ---- overload -----------------------------------------------------------------------------------

def test_flood_gets_429_past_the_queue(url):
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 12, "ignore_eos": True}

    def one(_):
        with httpx.Client(base_url=url, timeout=120) as client:
            return client.post(CHAT, json=body)

    with ThreadPoolExecutor(24) as pool:
        responses = list(pool.map(one, range(24)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) > 0 and statuses.count(200) >= MAX_WAITING, statuses
    for r in responses:
        if r.status_code == 429:
            error = r.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
            assert 1 <= int(r.headers["retry-after"]) <= 60
        else:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and r.json()["usage"][
                "completion_tokens"] == 12
    wait_for(url, idle)
    assert httpx.post(url + CHAT, json=body, timeout=60).status_code == 200


@contextlib.contextmanager
def full_server(url: str):
    """Every engine slot streaming and the admission queue full (MAX_WAITING held open); the
    streams (Streamers) while it lasts, all ended and the server idle after."""
    blockers = [Streamer(url, long_chat()) for _ in range(MAX_NUM_SEQS)]
    for b in blockers:
        b.start()
    for b in blockers:
        b.wait_events(2)
    queued = [open_request(url, CHAT, long_chat(max_tokens=5)) for _ in range(MAX_WAITING)]
    try:
        wait_for(url, lambda m: m["guided_requests_queued"] == MAX_WAITING)
        yield blockers
    finally:
        for sock in queued:
            sock.close()
        for b in blockers:
            b.stop()
    wait_for(url, idle)


def test_the_openai_client_retries_a_429_after_its_retry_after(url):
    openai = pytest.importorskip("openai")
    attempts = []  # (time, status, Retry-After) of each attempt the client makes
    http = httpx.Client(event_hooks={"response": [lambda r: attempts.append(
        (time.monotonic(), r.status_code, r.headers.get("retry-after")))]})
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=1,
                           http_client=http, timeout=120)
    with http, full_server(url):
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="default", max_tokens=4,
                                           messages=[{"role": "user", "content": "Hi"}])
        assert caught.value.status_code == 429
        assert [status for _, status, _ in attempts] == [429, 429]
        (first, _, retry_after), (second, _, _) = attempts
        assert second - first >= int(retry_after) - 0.05  # it waited as told


def test_a_grammar_that_never_ends_is_a_400_at_the_door_of_a_full_server(url):
    """A grammar, regex or schema that never ends: refused structurally before the admission
    queue (which, full, would answer a 429), and the streams running meanwhile go on."""
    with full_server(url) as blockers:
        for field, value in (("grammar", 'root ::= "a" root'), ("regex", "[^\\s\\S]"),
                             ("json_schema", {"type": "object", "required": ["a"],
                                              "properties": {"a": {"$ref": "#"}}})):
            r = httpx.post(url + CHAT, json=long_chat(**{field: value}), timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        seen = [len(b.events) for b in blockers]
        for b, n in zip(blockers, seen):
            b.wait_events(n + 2)  # still streaming


def test_n_beyond_the_queue_is_a_400(url):
    response = httpx.post(url + CHAT, json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "n": MAX_WAITING + 1}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n"
    wait_for(url, idle)


# ---- the engine dies under a request ------------------------------------------------------------

def engine_pid(server_pid: int) -> int:
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in children:
        if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text():  # not the resource tracker
            return int(pid)
    raise AssertionError("no engine process")


def test_a_request_whose_engine_dies_gets_a_503_to_retry(server):
    url, proc = server
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, url + CHAT, json=long_chat(), timeout=120)
        wait_for(url, lambda m: m["guided_requests_running"] == 1)
        os.kill(engine_pid(proc.pid), signal.SIGKILL)
        response = pending.result()
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "overloaded" and response.headers["retry-after"]
    deadline = time.monotonic() + 240
    while httpx.get(url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert httpx.post(url + CHAT, json=long_chat(max_tokens=3), timeout=120).status_code == 200


# ---- graceful shutdown (runs last: it stops the module's server) --------------------------------

def test_sigterm_drains_and_exits_0(server):
    url, proc = server
    streamer = Streamer(url, long_chat())
    streamer.start()
    streamer.wait_events(3)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(DRAIN_S + 30) == 0
    assert time.monotonic() - start < DRAIN_S + 30
    streamer.join(30)
    assert streamer.error is None, streamer.error
    assert streamer.events[-1] == "[DONE]"  # finished or aborted, but ended properly
    assert '"finish_reason": ' in streamer.events[-2]
