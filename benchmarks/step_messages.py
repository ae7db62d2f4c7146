"""What it costs to get one step to every tensor-parallel rank (worker/multiproc.py), on the host:
a decode step's Launch (its SchedulerOutput, pickled once, written to each rank's pipe) and its
bitmask rows, either pickled into the message or filled into shared memory that the ranks copy
out of (worker/shared_bitmasks.py).

Each row is the median over --steps round trips: the engine sends, every rank decodes, copies
the mask rows out into a buffer of its own (from the message's bytes or from shared memory, as
the real rank does into its pinned buffer) and answers with its CPU time; the engine waits for
every answer. CPU times (thread_time) hold on a busy host; the wall-clock round trip includes
waking the ranks and is only meaningful on an idle one. The answers exist for the measurement:
the real ranks answer nothing but rank 0's tokens.

    python benchmarks/step_messages.py [--ranks 2] [--steps 50]
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import statistics
import struct
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "worker"))

from test_messages import decode_step

from guided.worker.multiproc import Launch, MaskSlot, Sample, decode, encode
from guided.worker.shared_bitmasks import MaskReader, SharedBitmasks

CONTEXT_LEN = 2048  # tokens per request: 129 block-table entries a row


def rank_loop(conn, rank: int, consumed_path: str, words: int, num_ranks: int) -> None:
    torch.set_num_threads(1)  # as a CPU rank; no OpenMP spin-waits counted as copy time
    reader = MaskReader(rank, consumed_path, words, num_ranks)
    own = torch.empty(0, words, dtype=torch.int32)
    while True:
        t0 = time.thread_time()  # CPU time only: the wait for the message does not count,
        data = conn.recv_bytes()  # its copy out of the kernel does
        message = decode(data)
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
        conn.send_bytes(struct.pack("d", time.thread_time() - t0))


_steps = itertools.count()  # step numbers only grow, as the executor's (shared slots need it)


def measure(conns, make_message, steps: int, fill=None) -> tuple[float, float, float, int]:
    """Medians in µs of (the engine's CPU time to encode and write, the slowest rank's CPU
    time to decode and copy the mask rows out, the wall-clock round trip), and the message's
    bytes. fill(step): the mask filler's writes, before the clock starts (the same work in
    either design)."""
    trips, sends, ranks, size = [], [], [], 0
    for _ in range(steps):
        step = next(_steps)
        message = fill(step) if fill is not None else None
        t0, c0 = time.perf_counter(), time.thread_time()
        data = encode(make_message(step) if message is None else message)
        for conn in conns:
            conn.send_bytes(data)
        sends.append(time.thread_time() - c0)
        ranks.append(max(struct.unpack("d", conn.recv_bytes())[0] for conn in conns))
        trips.append(time.perf_counter() - t0)
        size = len(data)
    return (1e6 * statistics.median(sends), 1e6 * statistics.median(ranks),
            1e6 * statistics.median(trips), size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    print(f"{args.ranks} ranks, decode steps of {CONTEXT_LEN}-token requests, every row "
          "constrained, median of", args.steps, "steps")
    print(f"| {'message':<34} | {'batch':>5} | {'vocab':>7} | {'bytes':>9} | "
          f"{'engine CPU µs':>13} | {'rank CPU µs':>11} | {'round trip µs':>13} |")
    print(f"|{'-' * 36}|{'-' * 7}|{'-' * 9}|{'-' * 11}|{'-' * 15}|{'-' * 13}|{'-' * 15}|")
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

                def shm_fill(step, batch=batch, mask=mask, rows=rows, shared=shared):
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
                    send, rank, trip, size = measure(conns, make, args.steps, fill)
                    print(f"| {name:<34} | {batch:>5} | {vocab:>7} | {size:>9,} | {send:>13.0f} "
                          f"| {rank:>11.0f} | {trip:>13.0f} |", flush=True)
        finally:
            for conn in conns:
                conn.send_bytes(encode(None))
            for p in procs:
                p.join()
            shared.close()


if __name__ == "__main__":
    main()
