"""A fresh `guided serve`'s first constrained request: the seconds until /health answers, then
the first JSON-schema request's time to first token and to its end (the output validated).

    python benchmarks/first_request.py [--model default] [--port 8411] [--repeat 2]

Each repeat starts its own server: what a user's first request meets after a (re)start.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request

import jsonschema
from openai import OpenAI

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


def first_request(model: str, port: int) -> str:
    server = subprocess.Popen([sys.executable, "-m", "guided.server.cli", "serve", "--model",
                               model, "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with code {server.returncode}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        ready = time.time() - t0
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        t, first, text = time.time(), None, ""
        for chunk in client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "A person as JSON."}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "person", "schema": SCHEMA}},
                max_tokens=40, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.time() - t
                text += chunk.choices[0].delta.content
        total = time.time() - t
        jsonschema.validate(json.loads(text), SCHEMA)
        return (f"| {model} | {ready:.2f} | {first * 1e3:.0f} | {total * 1e3:.0f} |")
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--port", type=int, default=8411)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    print("| model | ready (s) | first request TTFT (ms) | first request total (ms) |")
    print("|---|---|---|---|")
    for i in range(args.repeat):
        print(first_request(args.model, args.port), flush=True)


if __name__ == "__main__":
    main()
