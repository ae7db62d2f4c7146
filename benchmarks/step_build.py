"""Host time of a step's plain-data form (scheduler/output.py build_output), no model needed:
a mixed step (7 prompt chunks of 292 tokens, 2048 in all, beside 57 decodes) and a decode step
(the 57 decodes, ~330 tokens of context each). Median over --repeats calls.

    python benchmarks/step_build.py [--repeats 300]
"""
from __future__ import annotations

import argparse
import statistics
import time

from guided.params import SamplingParams
from guided.scheduler.output import build_output
from guided.scheduler.request import Request, RequestStatus
from guided.scheduler.scheduler import ScheduledRequest, StepPlan

BLOCK_SIZE = 16


def request(i: int, prompt_len: int, output_len: int, first_block: int, num_blocks: int,
            computed: int) -> Request:
    r = Request(request_id=f"r{i}", prompt_token_ids=list(range(100 + i, 100 + i + prompt_len)),
                params=SamplingParams(), seed=i, eos_token_ids=(2,), max_tokens=512,
                status=RequestStatus.RUNNING)
    r.output_token_ids = list(range(output_len))
    r.block_ids = list(range(first_block, first_block + num_blocks))
    r.num_computed_tokens = computed
    return r


def plans() -> dict[str, StepPlan]:
    prefills = [ScheduledRequest(request(i, 300, 0, 19 * i, 19, 0), num_new_tokens=292,
                                 num_draft_tokens=0, sample=False) for i in range(7)]
    decodes = [ScheduledRequest(request(i, 300, 30, 200 + 21 * i, 21, 329), num_new_tokens=1,
                                num_draft_tokens=0, sample=True) for i in range(7, 64)]
    return {"mixed: 2048 prompt tokens + 57 decodes": StepPlan(scheduled=prefills + decodes),
            "decode: 57 requests": StepPlan(scheduled=decodes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    print("| step | build_output median (µs) |\n|---|---|")
    for name, plan in plans().items():
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            build_output(plan, block_size=BLOCK_SIZE)
            times.append(time.perf_counter() - t0)
        print(f"| {name} | {statistics.median(times) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
