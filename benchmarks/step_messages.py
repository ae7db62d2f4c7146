"""What it costs to get one step to every tensor-parallel rank (worker/multiproc.py), on the host:
a decode step's Launch (its SchedulerOutput, pickled once, written to each rank's pipe) and its
bitmask rows, either pickled into the message or filled into shared memory that the ranks copy
out of (worker/shared_bitmasks.py).

Each row is the median over --steps round trips: the engine sends, every rank decodes (and
copies the mask rows out, where they are in shared memory) and answers one byte; the engine
waits for all answers. `send` is the engine's part alone (encode + writes), the time a step's
critical path on the engine's side grows by. The answers exist for the measurement only: the
real ranks answer nothing but rank 0's tokens.

    python benchmarks/step_messages.py [--ranks 2] [--steps 50]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "worker"))

from test_messages import decode_step  # noqa: E402 - a realistic step, as the tests build it

from guided.worker.messages import Launch, MaskSlot, Sample, decode, encode  # noqa: E402
from guided.worker.shared_bitmasks import MaskReader, SharedBitmasks  # noqa: E402

CONTEXT_LEN = 2048  # tokens per request: 129 block-table entries a row


def rank_loop(conn, rank: int, consumed_path: str, words: int, num_ranks: int) -> None:
    reader = MaskReader(rank, consumed_path, words, num_ranks)
    own = torch.empty(0, words, dtype=torch.int32)
    while True:
        message = decode(conn.recv_bytes())
        if message is None:
            return
        if isinstance(message, Sample) and message.masks is not None:
            slot = message.masks
            if isinstance(slot, bytes):  # the rows in the message itself
                rows = torch.frombuffer(slot, dtype=torch.int32).view(-1, words)
            else:
                rows = reader.read(slot.slot, slot.path, slot.num_rows)
            if own.shape[0] < rows.shape[0]:
                own = torch.empty(rows.shape[0], words, dtype=torch.int32)
            own[:rows.shape[0]].copy_(rows)  # into the rank's own (pinned) buffer, as it does
            if not isinstance(slot, bytes):
                reader.consumed(message.step)
        conn.send_bytes(b"k")


def measure(conns, make_message, steps: int, fill=None) -> tuple[float, float, int]:
    """(median round trip µs, median send µs, message bytes). fill(step): the mask filler's
    writes, before the clock starts (the same work in either design)."""
    trips, sends, size = [], [], 0
    for step in range(steps):
        message = fill(step) if fill is not None else None
        t0 = time.perf_counter()
        data = encode(make_message(step) if message is None else message)
        for conn in conns:
            conn.send_bytes(data)
        t1 = time.perf_counter()
        for conn in conns:
            conn.recv_bytes()
        trips.append(time.perf_counter() - t0)
        sends.append(t1 - t0)
        size = len(data)
    return 1e6 * statistics.median(trips), 1e6 * statistics.median(sends), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    print(f"{args.ranks} ranks, decode steps of {CONTEXT_LEN}-token requests, every row "
          "constrained, median of", args.steps, "steps")
    print(f"| {'message':<34} | {'batch':>5} | {'vocab':>7} | {'bytes':>9} | "
          f"{'send µs':>8} | {'round trip µs':>13} |")
    print(f"|{'-' * 36}|{'-' * 7}|{'-' * 9}|{'-' * 11}|{'-' * 10}|{'-' * 15}|")
    for vocab in (49_152, 128_256):
        words = -(-vocab // 32)
        shared = SharedBitmasks(words, args.ranks)
        pipes = [mp.Pipe() for _ in range(args.ranks)]
        procs = [mp.get_context("fork").Process(
            target=rank_loop, args=(theirs, r, shared.consumed_path, words, args.ranks))
            for r, (_, theirs) in enumerate(pipes)]
        for p in procs:
            p.start()
        conns = [ours for ours, _ in pipes]
        try:
            for batch in (1, 64, 256):
                out = decode_step(batch, CONTEXT_LEN)
                mask = torch.randint(-2**31, 2**31 - 1, (batch, words), dtype=torch.int32)
                rows = list(range(batch))

                def shm_fill(step, batch=batch, mask=mask, rows=rows):
                    view, slot, path = shared.take(batch, step, wait=lambda: None)
                    view.copy_(mask)  # the filler writing the rows in place
                    return Sample(step, MaskSlot(slot, path, batch, rows))

                cases = [("Launch (SchedulerOutput)", lambda step, out=out: Launch(step, out),
                          None),
                         ("Sample, bitmask in the message",
                          lambda step, mask=mask: Sample(step, mask.numpy().tobytes()), None),
                         ("Sample, bitmask in shared memory", None, shm_fill)]
                if vocab != 49_152:
                    cases = cases[1:]
                for name, make, fill in cases:
                    trip, send, size = measure(conns, make, args.steps, fill)
                    print(f"| {name:<34} | {batch:>5} | {vocab:>7} | {size:>9,} | {send:>8.0f} | "
                          f"{trip:>13.0f} |", flush=True)
        finally:
            for conn in conns:
                conn.send_bytes(encode(None))
            for p in procs:
                p.join()
            shared.close()


if __name__ == "__main__":
    main()
