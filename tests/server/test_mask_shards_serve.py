"""A real `guided serve` set up as a GPU runs a small model by default: overlapped scheduling,
lazy masks and mask shard processes (forced on here, on the CPU). Concurrent JSON-schema
requests come back valid through the official client, and SIGTERM stops the server together
with its shard processes."""
from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

pytestmark = pytest.mark.slow

BOOK = {"type": "object", "required": ["title", "authors"], "additionalProperties": False,
        "properties": {"title": {"type": "string", "maxLength": 30},
                       "authors": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                   "minItems": 1, "maxItems": 2}}}
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "country": {"type": "string", "enum": ["France", "Japan", "Peru"]}},
    "required": ["city", "country"], "additionalProperties": False}
ASKS = [("Describe a book as JSON.", BOOK), ("Name a city and its country as JSON.", CITY)]


def alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def shard_pids(root: int) -> set[int]:
    """The root's descendants running guided's mask shard worker (from /proc): the engine's
    process starts them, and runs as the server's child (--engine-process) or in it."""
    children: dict[int, list[int]] = {}
    shards = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        pid, ppid = int(entry.name), int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(pid)
        if b"mask_shard_worker" in cmdline:
            shards.add(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return shards & found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_schema_requests_through_mask_shards_then_sigterm(launch_server):
    openai = pytest.importorskip("openai")
    url, proc = launch_server("--max-num-seqs", "4", "--async-scheduling",
                              "--mask-processes", "2", name="shards")
    deadline = time.monotonic() + 60  # the engine starts them beside its warm-up
    while len(shard_pids(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    shards = shard_pids(proc.pid)
    assert len(shards) == 2
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(i: int):
        text, schema = ASKS[i % 2]
        response = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": text}], max_tokens=64,
            temperature=0.8, seed=i, response_format={
                "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        return response.choices[0], schema

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(6)))
    finished = [(choice, schema) for choice, schema in answers if choice.finish_reason == "stop"]
    assert finished, [choice.finish_reason for choice, _ in answers]
    for choice, schema in finished:
        jsonschema.validate(json.loads(choice.message.content), schema)
    for choice, _ in answers:
        assert choice.finish_reason in ("stop", "length"), choice
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in shards) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in shards if alive(pid)]
