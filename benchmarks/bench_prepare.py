"""ModelRunner.prepare on the host: a step's inputs for 256 requests, free (one row each) beside
constrained verify steps (drafts: several rows each), on the CPU (one table):

    python benchmarks/bench_prepare.py [--requests 256] [--drafts 0,2,4] [--repeats 200]

Another tree's prepare, for a before / after: `git archive REV guided | tar -x -C /tmp/prev`,
then `PYTHONPATH=/tmp/prev python benchmarks/bench_prepare.py` (its guided is imported; the
host-loop model shape synthetic:tiny is added where that tree lacks it).

The default model's constrained full-batch calls carried ~2.4 tokens a request (jump-forward
drafts), and prepare took 2.38 ms of their 13.8 ms against 1.39 ms for a free call
(benchmarks/RESULTS.md, session 22): it is per-row Python.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

try:
    import guided  # noqa: F401  (PYTHONPATH's tree, when given)
except ImportError:  # run from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import per_call_us

from guided.engine.core import Engine
from guided.params import SamplingParams
from guided.scheduler.request import Request, RequestStatus
from guided.scheduler.scheduler import ScheduledRequest, SchedulerOutput


def make_step(num_requests: int, num_drafts: int, block_size: int, *, placeholders: bool,
              seed: int = 0) -> tuple[SchedulerOutput, dict[int, int]]:
    """A decode (verify) step: each request has a 300-token prompt and 0-200 output tokens;
    under overlap its one new token is the previous step's sample (a placeholder)."""
    rng = random.Random(seed)
    scheduled, holes = [], {}
    next_block = 0
    for b in range(num_requests):
        prompt = [rng.randrange(1000, 40000) for _ in range(300)]
        request = Request(request_id=f"r{b}", prompt_token_ids=prompt,
                          params=SamplingParams(max_tokens=256, temperature=0.0),
                          seed=rng.getrandbits(63), eos_token_ids=(2,), max_tokens=256)
        request.output_token_ids = [rng.randrange(1000, 40000) for _ in range(rng.randrange(200))]
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = request.num_tokens - 1
        blocks = (request.num_tokens + num_drafts + 1) // block_size + 1
        request.block_ids = list(range(next_block, next_block + blocks))
        next_block += blocks
        drafts = [rng.randrange(1000, 40000) for _ in range(num_drafts)]
        scheduled.append(ScheduledRequest(request, 1, num_drafts, True, drafts,
                                          num_forced_drafts=num_drafts,
                                          placeholder=placeholders))
        if placeholders:
            holes[b] = b * (num_drafts + 1) + num_drafts
    return SchedulerOutput(scheduled, num_requests * (1 + num_drafts)), holes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--drafts", default="0,2,4")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    from guided.worker import model_config

    model_config.SYNTHETIC_SHAPES.setdefault("tiny", dict(  # trees from before it
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=32, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True))
    engine = Engine(model="synthetic:tiny", device="cpu", max_num_seqs=args.requests,
                    num_kv_blocks=20000)
    runner = engine.runner
    print(f"prepare, {args.requests} requests, CPU, {args.repeats} calls each\n")
    print("| drafts a request | rows | constrained | µs a call | µs a row |")
    print("|---|---|---|---|---|")
    for drafts in (int(d) for d in args.drafts.split(",")):
        sched, holes = make_step(args.requests, drafts, runner.block_size, placeholders=True)
        rows = args.requests * (drafts + 1)
        for constrained in (False, True):
            flags = [constrained] * args.requests
            us = per_call_us(lambda: runner.prepare(sched, flags, holes), args.repeats)
            print(f"| {drafts} | {rows} | {constrained} | {us:.0f} | {us / rows:.2f} |")
    engine.shutdown()


if __name__ == "__main__":
    main()
