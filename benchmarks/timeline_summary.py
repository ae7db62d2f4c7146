"""Where a serving pass's time went, from `serve.py --timeline-out FILE`: for each pass (label and
load, in file order), how many requests were in flight and how many were decoding (past their
first token) at each tick, and the requests that ended last. Prints one table a pass.

    python benchmarks/timeline_summary.py timeline.jsonl [--tick 0.5] [--tail 5]
"""
from __future__ import annotations

import argparse
import json
from itertools import groupby
from pathlib import Path


def passes(path: Path) -> list[list[dict]]:
    """The file's requests split into passes: a pass is a run of lines with one label and load
    whose indexes count up from 0 (a second pass of the same load starts at 0 again)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out: list[list[dict]] = []
    for _, group in groupby(rows, key=lambda r: (r["label"], r["load"])):
        for row in group:
            if row["index"] == 0 or not out:
                out.append([])
            out[-1].append(row)
    return out


def occupancy(requests: list[dict], t: float) -> tuple[int, int]:
    """(requests in flight at t, requests decoding at t: past their first token)."""
    in_flight = decoding = 0
    for r in requests:
        end = r["sent"] + max(r["latency"], r["ttft"])
        if r["sent"] <= t < end:
            in_flight += 1
            if not r["error"] and r["sent"] + r["ttft"] <= t:
                decoding += 1
    return in_flight, decoding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline", type=Path)
    ap.add_argument("--tick", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--tail", type=int, default=5, help="the requests that ended last")
    args = ap.parse_args()
    for requests in passes(args.timeline):
        done = [r for r in requests if not r["error"]]
        end = max(r["sent"] + r["latency"] for r in done)
        print(f"\n{requests[0]['label'] or '-'} ({requests[0]['load']}): {len(requests)} "
              f"requests, {len(requests) - len(done)} failed or refused, the last ended at "
              f"{end:.2f} s, the last was sent at {max(r['sent'] for r in requests):.2f} s\n")
        print("| t s | in flight | decoding |")
        print("|---|---|---|")
        t = 0.0
        while t < end:
            in_flight, decoding = occupancy(requests, t)
            print(f"| {t:.1f} | {in_flight} | {decoding} |")
            t += args.tick
        print("\n| ended last: index | sent s | TTFT s | latency s | tokens |")
        print("|---|---|---|---|---|")
        for r in sorted(done, key=lambda r: -(r["sent"] + r["latency"]))[:args.tail]:
            print(f"| {r['index']} | {r['sent']:.2f} | {r['ttft']:.2f} | {r['latency']:.2f} | "
                  f"{r['tokens']} |")


if __name__ == "__main__":
    main()
